//! Traces: OpenTelemetry spans exported over OTLP/HTTP (`[telemetry]`), the caller's W3C trace
//! context continued and the gateway's own sent on to the upstream. Off (no [`Traces`]) unless
//! configured: then the request path tests one `Option`. Spans are queued (at most
//! `MAX_QUEUE`) and sent in batches by the SDK's own thread: a slow or absent collector drops
//! spans, never holds a request.

use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue};
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{SpanKind, Status, TraceContextExt, Tracer as _, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracer, SdkTracerProvider,
};
use opentelemetry_sdk::Resource;

use crate::config::telemetry::Resolved;

/// Spans waiting for export; past it they are dropped, never waited for.
const MAX_QUEUE: usize = 2048;
/// How often queued spans are sent: soon enough for an engineer watching a trace.
const EXPORT_EVERY: Duration = Duration::from_secs(1);
/// One export's deadline: a slow collector delays the exporter's thread, not a request.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// Why traces could not be set up.
#[derive(Debug, thiserror::Error)]
#[error("telemetry: {0}")]
pub struct TracesError(String);

/// The process's tracer and its exporter.
pub struct Traces {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    propagator: TraceContextPropagator,
}

impl Traces {
    /// `[telemetry]` with the environment's settings where it has none.
    pub fn from_config(
        config: &crate::config::telemetry::Telemetry,
    ) -> Result<Traces, TracesError> {
        let (resolved, warnings) = config.with_env(|name| std::env::var(name).ok());
        for warning in warnings {
            tracing::warn!(%warning, "telemetry: an OpenTelemetry environment variable is not used");
        }
        let traces = Traces::start(&resolved)?;
        tracing::info!(
            endpoint = %format!("{}/v1/traces", resolved.otlp_endpoint),
            sample_ratio = resolved.sample_ratio,
            service = %resolved.service_name,
            "traces exported over OTLP/HTTP"
        );
        Ok(traces)
    }

    pub fn start(settings: &Resolved) -> Result<Traces, TracesError> {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(format!("{}/v1/traces", settings.otlp_endpoint))
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(|e| TracesError(format!("the OTLP exporter could not be built: {e}")))?;
        let batches = BatchSpanProcessor::builder(exporter)
            .with_batch_config(
                BatchConfigBuilder::default()
                    .with_max_queue_size(MAX_QUEUE)
                    .with_scheduled_delay(EXPORT_EVERY)
                    .build(),
            )
            .build();
        // Empty: the SDK's own reading of the environment would undo the file's precedence
        // (`[telemetry]` already merged it); the service's name last, so nothing overrides it.
        let resource = Resource::builder_empty()
            .with_attributes(
                settings
                    .resource_attributes
                    .iter()
                    .map(|(k, v)| KeyValue::new(k.clone(), v.clone())),
            )
            .with_service_name(settings.service_name.clone())
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(batches)
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                settings.sample_ratio,
            ))))
            .with_resource(resource)
            .build();
        let tracer = provider.tracer("idemgate");
        Ok(Traces {
            provider,
            tracer,
            propagator: TraceContextPropagator::new(),
        })
    }

    /// A server span for a request, continuing the caller's `traceparent` if it sent one.
    pub fn server_span(
        &self,
        name: String,
        headers: &HeaderMap,
        attributes: Vec<KeyValue>,
    ) -> Context {
        let parent = self.propagator.extract(&Headers(headers));
        let span = self
            .tracer
            .span_builder(name)
            .with_kind(SpanKind::Server)
            .with_attributes(attributes)
            .start_with_context(&self.tracer, &parent);
        parent.with_span(span)
    }

    /// Sends what is queued, within `grace`.
    pub fn shutdown(&self, grace: Duration) {
        let _ = self.provider.shutdown_with_timeout(grace);
    }
}

const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");
/// A caller's `tracestate` longer than W3C's 512 characters or with more than its 32 members is
/// not kept: it would ride in every span and every export.
const MAX_TRACESTATE: usize = 512;
const MAX_TRACESTATE_MEMBERS: usize = 32;

/// A request's span, kept in its extensions until its upstream call is made.
#[derive(Clone)]
pub struct Handed(pub Context);

/// Puts the request's span (if it has one) in `headers` as the `traceparent` (and `tracestate`)
/// the upstream gets, in place of the caller's: done as the upstream request is made, after
/// every phase read the caller's headers as they came.
pub fn hand_on(extensions: &http::Extensions, headers: &mut HeaderMap) {
    let Some(Handed(cx)) = extensions.get::<Handed>() else {
        return;
    };
    headers.remove(TRACEPARENT);
    headers.remove(TRACESTATE);
    TraceContextPropagator::new().inject_context(cx, &mut HeadersMut(headers));
}

/// Ends a request's span with what became of it.
pub fn finish(cx: &Context, status: u16, attributes: Vec<KeyValue>) {
    let span = cx.span();
    span.set_attribute(KeyValue::new(
        "http.response.status_code",
        i64::from(status),
    ));
    for a in attributes {
        span.set_attribute(a);
    }
    if status >= 500 {
        span.set_status(Status::error(""));
    }
    span.end();
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
