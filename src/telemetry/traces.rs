//! Traces: OpenTelemetry spans exported over OTLP/HTTP (`[telemetry]`), the caller's W3C trace
//! context continued and the gateway's own sent on to the upstream. Off (no [`Traces`]) unless
//! configured: then the request path tests one `Option`. Spans are queued (at most
//! [`MAX_QUEUE`]) and sent in batches by the SDK's own thread: a slow or absent collector drops
//! spans (counted, [`super::export`]), never holds a request.

use std::time::Duration;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use http::HeaderMap;
use opentelemetry::trace::{SpanKind, TracerProvider as _};
use opentelemetry::KeyValue;
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracer, SdkTracerProvider,
};
use opentelemetry_sdk::Resource;

use super::export::{Counted, CountedExporter, Gate, MAX_QUEUE};
use super::span::Trace;
use crate::config::telemetry::Resolved;
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
    gate: Arc<Gate>,
    passthrough: bool,
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

    fn start(settings: &Resolved) -> Result<Traces, TracesError> {
        let gate = Arc::new(Gate::default());
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(format!("{}/v1/traces", settings.otlp_endpoint))
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(|e| TracesError(format!("the OTLP exporter could not be built: {e}")))?;
        let exporter = CountedExporter {
            inner: exporter,
            gate: Arc::clone(&gate),
        };
        let batches = BatchSpanProcessor::builder(exporter)
            .with_batch_config(
                BatchConfigBuilder::default()
                    // Room to spare: the gate ([`Counted`]) keeps it to `MAX_QUEUE` and counts
                    // what it turns away, which the processor's own bound would not.
                    .with_max_queue_size(2 * MAX_QUEUE)
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
            .with_span_processor(Counted {
                inner: batches,
                gate: Arc::clone(&gate),
            })
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                settings.sample_ratio,
            ))))
            .with_resource(resource)
            .build();
        let tracer = provider.tracer("idemgate");
        Ok(Traces {
            provider,
            tracer,
            gate,
            passthrough: settings.trace_passthrough,
        })
    }

    /// A span for a request or a message (`kind`: server or consumer), continuing the caller's
    /// `traceparent` if `headers` carry one.
    pub fn span(
        &self,
        name: String,
        kind: SpanKind,
        headers: &HeaderMap,
        attributes: Vec<KeyValue>,
    ) -> Trace {
        Trace::continuing(&self.tracer, name, kind, headers, attributes)
    }

    /// Whether requests outside the routes get spans (`trace_passthrough`).
    pub fn passthrough(&self) -> bool {
        self.passthrough
    }

    /// Spans dropped since the start: (queue full, export failed).
    pub fn dropped(&self) -> (u64, u64) {
        let d = &self.gate.dropped;
        (
            d.queue_full.load(Ordering::Relaxed),
            d.export_failed.load(Ordering::Relaxed),
        )
    }

    /// Sends what is queued, within `grace`.
    pub fn shutdown(&self, grace: Duration) {
        let _ = self.provider.shutdown_with_timeout(grace);
    }
}
