//! One request's or message's span and its phases ([`Trace`]), W3C trace context in and out of
//! headers, and the link a replay makes to the execution it replays ([`TraceLink`]).

use http::{HeaderMap, HeaderName, HeaderValue};
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId, TraceState,
    Tracer as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracer;

use crate::store::TraceLink;

const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");
/// A caller's `tracestate` longer than W3C's 512 characters or with more than its 32 members is
/// not kept: it would ride in every span and every export.
const MAX_TRACESTATE: usize = 512;
const MAX_TRACESTATE_MEMBERS: usize = 32;

/// A span and the tracer its phases are opened with; cheap to clone (both are shared). A span
/// ends when [`Trace::end`] is called, or when its last clone is dropped (a caller that went
/// away): never left open.
#[derive(Clone)]
pub struct Trace {
    cx: Context,
    tracer: SdkTracer,
}

impl Trace {
    /// A span continuing the context in `headers` (a `traceparent`), if any.
    pub(super) fn continuing(
        tracer: &SdkTracer,
        name: String,
        kind: SpanKind,
        headers: &HeaderMap,
        attributes: Vec<KeyValue>,
    ) -> Trace {
        let parent = TraceContextPropagator::new().extract(&Headers(headers));
        let span = tracer
            .span_builder(name)
            .with_kind(kind)
            .with_attributes(attributes)
            .start_with_context(tracer, &parent);
        Trace {
            cx: parent.with_span(span),
            tracer: tracer.clone(),
        }
    }

    /// A child span: a phase of this one.
    pub fn phase(&self, name: &'static str, kind: SpanKind, attributes: Vec<KeyValue>) -> Trace {
        let span = self
            .tracer
            .span_builder(name)
            .with_kind(kind)
            .with_attributes(attributes)
            .start_with_context(&self.tracer, &self.cx);
        Trace {
            cx: self.cx.with_span(span),
            tracer: self.tracer.clone(),
        }
    }

    pub fn set(&self, attribute: KeyValue) {
        self.cx.span().set_attribute(attribute);
    }

    /// Ends the span; `error`: why it failed, if it did.
    pub fn end(&self, error: Option<&str>) {
        let span = self.cx.span();
        if let Some(why) = error {
            span.set_status(Status::error(why.to_owned()));
        }
        span.end();
    }

    /// Puts this span in `headers` as the `traceparent` (and `tracestate`) the next hop gets,
    /// in place of any it had.
    pub fn hand_on(&self, headers: &mut HeaderMap) {
        headers.remove(TRACEPARENT);
        headers.remove(TRACESTATE);
        TraceContextPropagator::new().inject_context(&self.cx, &mut HeadersMut(headers));
    }

    /// What a later replay links to: this span, if it is sampled (an unsampled one is in no
    /// trace to find).
    pub fn link(&self) -> Option<TraceLink> {
        let span = self.cx.span();
        let sc = span.span_context();
        (sc.is_valid() && sc.is_sampled()).then(|| TraceLink {
            trace_id: sc.trace_id().to_bytes(),
            span_id: sc.span_id().to_bytes(),
        })
    }

    /// Links this span to the one that made the answer it gives (`idemgate.original_trace_id`
    /// too, for backends that show no links).
    pub fn link_to(&self, original: TraceLink) {
        let span = self.cx.span();
        let trace_id = TraceId::from_bytes(original.trace_id);
        span.set_attribute(KeyValue::new(
            "idemgate.original_trace_id",
            trace_id.to_string(),
        ));
        let cx = SpanContext::new(
            trace_id,
            SpanId::from_bytes(original.span_id),
            TraceFlags::SAMPLED,
            true,
            TraceState::NONE,
        );
        span.add_link(cx, Vec::new());
    }

    /// The ids log lines carry (`trace_id`, `span_id`), as hex.
    pub fn ids(&self) -> (String, String) {
        let span = self.cx.span();
        let sc = span.span_context();
        (sc.trace_id().to_string(), sc.span_id().to_string())
    }
}

struct Headers<'a>(&'a HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        let value = self.0.get(key).and_then(|v| v.to_str().ok())?;
        let oversized = key == TRACESTATE.as_str()
            && (value.len() > MAX_TRACESTATE || value.split(',').count() > MAX_TRACESTATE_MEMBERS);
        (!oversized).then_some(value)
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

struct HeadersMut<'a>(&'a mut HeaderMap);

impl Injector for HeadersMut<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(key.as_bytes()),
            HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}
