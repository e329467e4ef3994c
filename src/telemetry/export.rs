//! Counting what the exporter drops: the SDK's batch processor drops spans when its queue is
//! full and says so only in a log line at shutdown, and a failed export loses its batch. A
//! gate in front of the processor ([`Counted`]) holds the queue to [`MAX_QUEUE`] spans itself,
//! and the exporter's wrapper ([`CountedExporter`]) counts what leaves the queue and what a
//! failed export lost: both in [`Dropped`], read by `/metrics`.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use opentelemetry::Context;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{BatchSpanProcessor, Span, SpanData, SpanExporter, SpanProcessor};
use opentelemetry_sdk::Resource;

/// Spans waiting for export; past it they are dropped, never waited for.
pub const MAX_QUEUE: usize = 2048;
/// At most one warning about failed exports in this long: a collector that is down for an hour
/// must not fill the gateway's log.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// Spans dropped since the start, by why.
#[derive(Debug, Default)]
pub struct Dropped {
    /// The queue was full (the collector is slower than the traffic, or down).
    pub queue_full: AtomicU64,
    /// An export failed (the collector refused, was unreachable, or did not answer in time).
    pub export_failed: AtomicU64,
}

/// What the gate and the exporter share.
#[derive(Default)]
pub(super) struct Gate {
    queued: AtomicUsize,
    pub(super) dropped: Dropped,
    last_warning: std::sync::Mutex<Option<Instant>>,
}

/// The batch processor behind a gate that keeps its queue below its own bound.
#[derive(Debug)]
pub(super) struct Counted {
    pub(super) inner: BatchSpanProcessor,
    pub(super) gate: Arc<Gate>,
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gate")
            .field("dropped", &self.dropped)
            .finish()
    }
}

impl SpanProcessor for Counted {
    fn on_start(&self, span: &mut Span, cx: &Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        // Every span handed on is counted, sampled or not: the processor exports whatever it
        // is given, and the exporter's wrapper counts each one out.
        if self.gate.queued.fetch_add(1, Ordering::AcqRel) >= MAX_QUEUE {
            self.gate.queued.fetch_sub(1, Ordering::AcqRel);
            self.gate.dropped.queue_full.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.inner.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// The OTLP exporter, counting what leaves the queue and what a failed export lost.
#[derive(Debug)]
pub(super) struct CountedExporter<E> {
    pub(super) inner: E,
    pub(super) gate: Arc<Gate>,
}

impl<E: SpanExporter> SpanExporter for CountedExporter<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let n = batch.len();
        let result = self.inner.export(batch).await;
        self.gate.queued.fetch_sub(n, Ordering::AcqRel);
        if let Err(e) = &result {
            let gate = &self.gate;
            gate.dropped
                .export_failed
                .fetch_add(n as u64, Ordering::Relaxed);
            let mut last = gate
                .last_warning
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if last.is_none_or(|at| at.elapsed() >= WARN_EVERY) {
                *last = Some(Instant::now());
                tracing::warn!(spans = n, error = %e, "traces: an export to the collector failed; its spans are dropped (idemgate_trace_spans_dropped_total; one warning a minute at most)");
            }
        }
        result
    }

    fn shutdown_with_timeout(&mut self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&mut self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}
