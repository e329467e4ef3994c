//! A keyed request's trace span (`[telemetry]`): opened with the request's HTTP attributes,
//! ended with what became of it. Only made when traces are on.

use http::{request, Request};
use opentelemetry::trace::SpanKind;
use opentelemetry::KeyValue;

use super::phases::Answer;
use super::{ClientConn, Route};
use crate::conn::ClientBody;
use crate::idempotency::Attempt;
use crate::metrics::Outcome;
use crate::store::TraceLink;
use crate::telemetry::span::Trace;
use crate::telemetry::traces::Traces;

/// A keyed request's server span (`{method} {route}`), continuing the caller's trace; kept in
/// the request's extensions, where its phases find it (the upstream call's span is the
/// upstream's `traceparent`).
pub(super) fn request_span(
    traces: &Traces,
    route: &Route,
    req: &mut Request<ClientBody>,
    conn: &ClientConn,
) -> Trace {
    let pattern = route.config.pattern.to_string();
    let mut attributes = http_attributes(req.method(), req.uri(), req.version(), conn);
    attributes.push(KeyValue::new("http.route", pattern.clone()));
    attributes.push(KeyValue::new("idemgate.route", route.config.name.clone()));
    let name = format!("{} {pattern}", req.method());
    let trace = traces.span(name, SpanKind::Server, req.headers(), attributes);
    req.extensions_mut().insert(trace.clone());
    trace
}

/// A pass-through request's server span (`telemetry.trace_passthrough`), named by its method
/// alone; its context is the upstream's `traceparent`.
pub(super) fn passthrough_span(
    traces: &Traces,
    parts: &mut request::Parts,
    conn: &ClientConn,
) -> Trace {
    let attributes = http_attributes(&parts.method, &parts.uri, parts.version, conn);
    let name = parts.method.as_str().to_owned();
    let trace = traces.span(name, SpanKind::Server, &parts.headers, attributes);
    trace.hand_on(&mut parts.headers);
    trace
}

/// Ends a pass-through request's span with the status its client got.
pub(super) fn end_passthrough_span(trace: &Trace, status: u16) {
    trace.set(KeyValue::new(
        "http.response.status_code",
        i64::from(status),
    ));
    trace.set(KeyValue::new(
        "idemgate.outcome",
        Outcome::Passthrough.as_str(),
    ));
    trace.end((status >= 500).then_some(""));
}

/// The HTTP semantic conventions' attributes of a request.
fn http_attributes(
    method: &http::Method,
    uri: &http::Uri,
    version: http::Version,
    conn: &ClientConn,
) -> Vec<KeyValue> {
    let version = match version {
        http::Version::HTTP_2 => "2",
        http::Version::HTTP_10 => "1.0",
        _ => "1.1",
    };
    vec![
        KeyValue::new("http.request.method", method.as_str().to_string()),
        // Capped: a path as long as the header limit would ride in every export.
        KeyValue::new(
            "url.path",
            (uri.path().chars().take(MAX_PATH_ATTRIBUTE)).collect::<String>(),
        ),
        KeyValue::new("client.address", conn.addr.ip().to_string()),
        KeyValue::new("network.protocol.version", version),
    ]
}

/// The `tracing` span a traced request's log lines are written in: its ids, as the trace's
/// backend shows them.
pub(super) fn log_span(trace: &Trace) -> tracing::Span {
    let (trace_id, span_id) = trace.ids();
    tracing::info_span!("request", trace_id = %trace_id, span_id = %span_id)
}

/// The longest `url.path` a span carries.
const MAX_PATH_ATTRIBUTE: usize = 256;

/// Ends a request's span with its outcome: never the key, only its id's first 16 hex digits.
/// A replay links to the execution whose answer it gives ([`Trace::link_to`]).
pub(super) fn end_span(trace: &Trace, answer: &Answer) {
    let status = answer.response.status().as_u16();
    trace.set(KeyValue::new(
        "http.response.status_code",
        i64::from(status),
    ));
    trace.set(KeyValue::new("idemgate.outcome", answer.outcome.as_str()));
    let replayed = matches!(answer.outcome, Outcome::Replayed | Outcome::Waited);
    trace.set(KeyValue::new("idemgate.replayed", replayed));
    if let Some(key) = &answer.key {
        trace.set(KeyValue::new("idemgate.key.id", key.short()));
    }
    if let Some(link) = answer.link {
        trace.link_to(link);
    }
    trace.end((status >= 500).then_some(""));
}

/// The upstream call's client span, and the request span's link for the answer to keep.
pub(super) struct UpstreamCall {
    span: Trace,
    link: Option<TraceLink>,
}

/// The upstream call's client span, a child of the request's; its context is the upstream's
/// `traceparent` (the caller's own is replaced: it is the request span's parent).
pub(super) fn upstream_call(parts: &mut request::Parts) -> Option<UpstreamCall> {
    let request = parts.extensions.get::<Trace>()?;
    let span = request.phase(
        "upstream",
        SpanKind::Client,
        vec![KeyValue::new(
            "http.request.method",
            parts.method.as_str().to_owned(),
        )],
    );
    let link = request.link();
    span.hand_on(&mut parts.headers);
    Some(UpstreamCall { span, link })
}

/// Ends the upstream call's span; an answer keeps the request span's ids, for the replays that
/// will link to it.
pub(super) fn end_upstream_call<R>(call: UpstreamCall, attempt: &mut Attempt<R>) {
    attempt.end_span(&call.span, call.link);
}
