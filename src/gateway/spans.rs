//! A keyed request's trace span (`[telemetry]`): opened with the request's HTTP attributes,
//! ended with what became of it. Only made when traces are on.

use http::{request, Request};
use opentelemetry::trace::SpanKind;
use opentelemetry::KeyValue;

use super::phases::Answer;
use super::{ClientConn, Route};
use crate::config::UpstreamUrl;
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
    let name = match known_method(req.method()) {
        "_OTHER" => format!("HTTP {pattern}"),
        method => format!("{method} {pattern}"),
    };
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
    // Any method a client sends would otherwise make a span name of its own.
    let name = match known_method(&parts.method) {
        "_OTHER" => "HTTP".to_owned(),
        method => method.to_owned(),
    };
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
    let scheme = if conn.addr.tls() { "https" } else { "http" };
    let mut attributes = vec![
        KeyValue::new("http.request.method", known_method(method)),
        KeyValue::new("url.scheme", scheme),
        // Capped: a path as long as the header limit would ride in every export.
        KeyValue::new(
            "url.path",
            (uri.path().chars().take(MAX_PATH_ATTRIBUTE)).collect::<String>(),
        ),
        KeyValue::new("client.address", conn.addr.ip().to_string()),
        KeyValue::new("network.protocol.version", version),
    ];
    if known_method(method) == "_OTHER" {
        let original = method.as_str().chars().take(MAX_METHOD_ATTRIBUTE);
        attributes.push(KeyValue::new(
            "http.request.method_original",
            original.collect::<String>(),
        ));
    }
    attributes
}

/// The longest `http.request.method_original` a span carries.
const MAX_METHOD_ATTRIBUTE: usize = 32;

/// A method as the HTTP conventions name it: one of the standard ones, else `_OTHER`.
fn known_method(method: &http::Method) -> &'static str {
    use http::Method as M;
    match *method {
        M::GET => "GET",
        M::HEAD => "HEAD",
        M::POST => "POST",
        M::PUT => "PUT",
        M::DELETE => "DELETE",
        M::CONNECT => "CONNECT",
        M::OPTIONS => "OPTIONS",
        M::TRACE => "TRACE",
        M::PATCH => "PATCH",
        _ => "_OTHER",
    }
}

/// The `tracing` span a traced request's log lines are written in: its ids, as the trace's
/// backend shows them.
pub(super) fn log_span(trace: &Trace) -> tracing::Span {
    let (trace_id, span_id) = trace.ids();
    // At the error level: enabled whatever RUST_LOG lets through, so every line written is in it.
    tracing::error_span!("request", trace_id = %trace_id, span_id = %span_id)
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
pub(super) fn upstream_call(
    parts: &mut request::Parts,
    upstream: &UpstreamUrl,
) -> Option<UpstreamCall> {
    let request = parts.extensions.get::<Trace>()?;
    let port = (upstream.authority.port_u16()).unwrap_or(if upstream.tls { 443 } else { 80 });
    let attributes = vec![
        KeyValue::new("http.request.method", known_method(&parts.method)),
        // An IPv6 address without its brackets, as the conventions write it.
        KeyValue::new(
            "server.address",
            (upstream.authority.host())
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned(),
        ),
        KeyValue::new("server.port", i64::from(port)),
    ];
    let span = request.phase("upstream", SpanKind::Client, attributes);
    let link = request.link();
    span.hand_on(&mut parts.headers);
    Some(UpstreamCall { span, link })
}

/// Ends the upstream call's span; an answer keeps the request span's ids, for the replays that
/// will link to it.
pub(super) fn end_upstream_call<R>(call: UpstreamCall, attempt: &mut Attempt<R>) {
    attempt.end_span(&call.span, call.link);
}
