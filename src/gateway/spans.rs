//! A keyed request's trace span (`[telemetry]`): opened with the request's HTTP attributes,
//! ended with what became of it. Only made when traces are on.

use http::Request;
use opentelemetry::KeyValue;

use super::phases::Answer;
use super::{ClientConn, Route};
use crate::conn::ClientBody;
use crate::metrics::Outcome;
use crate::telemetry::traces::{self, Traces};

/// A keyed request's server span (`{method} {route}`), continuing the caller's trace; the
/// upstream gets the span's context as its `traceparent` ([`traces::hand_on`]).
pub(super) fn request_span(
    traces: &Traces,
    route: &Route,
    req: &mut Request<ClientBody>,
    conn: &ClientConn,
) -> opentelemetry::Context {
    let pattern = route.config.pattern.to_string();
    let version = match req.version() {
        http::Version::HTTP_2 => "2",
        http::Version::HTTP_10 => "1.0",
        _ => "1.1",
    };
    let attributes = vec![
        KeyValue::new("http.request.method", req.method().as_str().to_string()),
        KeyValue::new("http.route", pattern.clone()),
        // Capped: a path as long as the header limit would ride in every export.
        KeyValue::new(
            "url.path",
            (req.uri().path().chars().take(MAX_PATH_ATTRIBUTE)).collect::<String>(),
        ),
        KeyValue::new("client.address", conn.addr.ip().to_string()),
        KeyValue::new("network.protocol.version", version),
        KeyValue::new("idemgate.route", route.config.name.clone()),
    ];
    let name = format!("{} {pattern}", req.method());
    let cx = traces.server_span(name, req.headers(), attributes);
    req.extensions_mut().insert(traces::Handed(cx.clone()));
    cx
}

/// The longest `url.path` a span carries.
const MAX_PATH_ATTRIBUTE: usize = 256;

/// Ends a request's span with its outcome: never the key, only its id's first 16 hex digits.
pub(super) fn end_span(cx: &opentelemetry::Context, answer: &Answer) {
    let mut attributes = vec![
        KeyValue::new("idemgate.outcome", answer.outcome.as_str()),
        KeyValue::new(
            "idemgate.replayed",
            matches!(answer.outcome, Outcome::Replayed | Outcome::Waited),
        ),
    ];
    if let Some(key) = &answer.key {
        attributes.push(KeyValue::new("idemgate.key.id", key.short()));
    }
    traces::finish(cx, answer.response.status().as_u16(), attributes);
}
