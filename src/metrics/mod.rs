//! Prometheus metrics, kept in a `prometheus-client` registry and encoded by it for `/metrics`.
//!
//! - `idemgate_requests_total{route, outcome}`: every request; `outcome` is one of the
//!   [`Outcome`] names (`executed`, `replayed`, `waited`, `mismatch`, ..., `passthrough`); pass-through
//!   requests outside any route have `route=""`.
//! - `idemgate_upstream_duration_seconds{route}`: time to the upstream's answer (complete, on
//!   idempotent routes; the response head, on pass-through).
//! - `idemgate_store_duration_seconds{op}`, `idemgate_store_errors_total{op}`: per store call.
//! - `idemgate_requests_in_flight`: requests being handled now.
//! - `idemgate_worker_connections{worker}`: client connections each worker thread serves now (the
//!   acceptor gives a new connection to the worker with the fewest).
//! - `idemgate_connections_closed_total{reason}`: client connections closed by a deadline
//!   (`header_timeout`, `idle_timeout`, `send_timeout`).
//! - `idemgate_reconciliations_total{result}`: unknown outcomes asked of the upstream's lookup
//!   ([`crate::reconcile`]): `reconciled`, `released`, `unknown`, `gave_up`.
//! - `idemgate_records_purged_total`: expired records removed by an embedded store.
//! - `idemgate_store_fill_ratio`: how full an embedded store is (0 for Redis and Postgres).
//! - `idemgate_store_replica_acks_missed_total{op}`: Redis writes acknowledged by fewer
//!   replicas than `store.min_replicas` ([`crate::store::redis`]).
//! - `idemgate_trace_spans_dropped_total{reason}`: spans the trace exporter dropped
//!   (`queue_full`, `export_failed`), while `[telemetry]` is on.
//! - `idemgate_store_syncs_total`: durable commits (fsyncs) of the disk store; divided by the
//!   requests, the fsyncs per request (below 1 under concurrent load: group commit).
//! - the broker consumers' series ([`crate::consumer`]), in [`consumer`].
//! - the client identity series, in [`client`].
//! - the sealed records' series, in [`sealed`].

mod client;
mod consumer;
mod sealed;
pub mod text;

pub use consumer::{ConsumerMetrics, ConsumerOutcome};

use std::sync::atomic::Ordering;
use std::sync::OnceLock;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::conn::Expiry;
use crate::store::{StoreOp, StoreStats};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

/// What became of a request, for logs and metrics (the `outcome` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The upstream ran it and its response was stored.
    Executed,
    /// A retry got the stored response.
    Replayed,
    /// A duplicate waited for the original and got its response.
    Waited,
    Mismatch,
    InFlightRejected,
    MissingKey,
    InvalidKey,
    TooLarge,
    BadRequest,
    StoreError,
    /// The upstream could not be reached for a keyed request: nothing was sent and the key was
    /// released.
    UpstreamError,
    /// The upstream answered that it did not execute the request (408, 415, 425, 429, or a 5xx
    /// with `store_server_errors = false`): its answer was passed on and the key released.
    Released,
    Unknown,
    /// Refused before anything ran, to keep a limit: the client scope's record quota, the
    /// memory budget for buffered bodies, or the upstream's connection cap.
    Limited,
    /// The store could not be used and the route forwarded without idempotency
    /// (`on_store_error = "pass"`); the answer is marked `Idempotency-Bypassed: true`.
    Bypassed,
    Passthrough,
}

impl Outcome {
    /// How many outcomes there are, for per-route metric handles indexed by `outcome as usize`
    /// (`Passthrough` stays the last variant).
    pub const COUNT: usize = Outcome::Passthrough as usize + 1;

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Executed => "executed",
            Outcome::Replayed => "replayed",
            Outcome::Waited => "waited",
            Outcome::Mismatch => "mismatch",
            Outcome::InFlightRejected => "in_flight_rejected",
            Outcome::MissingKey => "missing_key",
            Outcome::InvalidKey => "invalid_key",
            Outcome::TooLarge => "too_large",
            Outcome::BadRequest => "bad_request",
            Outcome::StoreError => "store_error",
            Outcome::UpstreamError => "upstream_error",
            Outcome::Released => "released",
            Outcome::Unknown => "unknown",
            Outcome::Limited => "limited",
            Outcome::Bypassed => "bypassed",
            Outcome::Passthrough => "passthrough",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    route: String,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SignatureLabels {
    route: String,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PolicyLabel {
    policy: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabel {
    route: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerLabel {
    worker: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabel {
    op: &'static str,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// One route's series, taken from the families on first use and kept: a family lookup hashes
/// and allocates its labels under a lock, a kept handle is one atomic add. A series appears in
/// `/metrics` only once used, as with a lookup. Lives beside the route's config in the gateway's
/// routing table, so a reload that renames a route starts afresh.
#[derive(Clone)]
pub struct RouteMetrics {
    /// The `route` label: the route's name, or "" outside any route.
    route: String,
    requests: [OnceLock<Counter>; Outcome::COUNT],
    upstream: OnceLock<Histogram>,
}

impl RouteMetrics {
    pub fn new(route: &str) -> Self {
        RouteMetrics {
            route: route.to_string(),
            requests: Default::default(),
            upstream: OnceLock::new(),
        }
    }
}

impl std::fmt::Debug for RouteMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RouteMetrics({:?})", self.route)
    }
}

fn latency_histogram() -> Histogram {
    // 100 µs .. ~26 s.
    Histogram::new(exponential_buckets(0.0001, 2.0, 19))
}

pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    upstream_seconds: HistogramFamily<RouteLabel>,
    store_seconds: HistogramFamily<OpLabel>,
    store_errors: Family<OpLabel, Counter>,
    in_flight: Gauge,
    waiting: Gauge,
    buffered: Gauge,
    tunnels: Gauge,
    worker_connections: Family<WorkerLabel, Gauge>,
    connections_closed: Family<ReasonLabel, Counter>,
    reconciliations: Family<ResultLabel, Counter>,
    signatures: Family<SignatureLabels, Counter>,
    client: client::ClientMetrics,
    records_purged: Counter,
    store_syncs: Counter,
    eviction_risk: Family<PolicyLabel, Gauge>,
    store_fill: Gauge<f64, std::sync::atomic::AtomicU64>,
    replica_acks_missed: Family<OpLabel, Counter>,
    spans_dropped: Family<ReasonLabel, Counter>,
    sealed: sealed::SealedMetrics,
    consumers: consumer::ConsumerFamilies,
    /// Requests outside any route.
    unrouted: RouteMetrics,
    store_ops: [OnceLock<Histogram>; StoreOp::COUNT],
}

/// A new metric of type `M`, registered under `name`; the registry keeps a handle to it.
fn registered<M>(registry: &mut Registry, name: &str, help: &str) -> M
where
    M: Default + Clone + prometheus_client::registry::Metric,
{
    let metric = M::default();
    registry.register(name, help, metric.clone());
    metric
}

fn histograms<L>(registry: &mut Registry, name: &str, help: &str) -> HistogramFamily<L>
where
    L: Clone + std::hash::Hash + Eq,
    HistogramFamily<L>: Clone + prometheus_client::registry::Metric,
{
    let family: HistogramFamily<L> = Family::new_with_constructor(latency_histogram);
    registry.register(name, help, family.clone());
    family
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("idemgate");
        let r = &mut registry;
        let tunnels: Gauge = registered(
            r,
            "tunnels_open",
            "Upgraded connections (WebSocket) being relayed between a client and an upstream",
        );
        let signatures: Family<SignatureLabels, Counter> = registered(r, "signatures", "Deliveries on routes with a signature, by route and result (verified, missing, stale, invalid)");
        let connections_closed: Family<ReasonLabel, Counter> = registered(
            r,
            "connections_closed",
            "Client connections closed by a deadline, by reason",
        );
        let requests: Family<RequestLabels, Counter> =
            registered(r, "requests", "Requests by route and outcome");
        let reconciliations: Family<ResultLabel, Counter> = registered(
            r,
            "reconciliations",
            "Unknown outcomes asked of the upstream's lookup, by result (reconciled, released, unknown, gave_up)",
        );
        let upstream_seconds: HistogramFamily<RouteLabel> = histograms(
            r,
            "upstream_duration_seconds",
            "Time to the upstream's complete answer",
        );
        let store_seconds: HistogramFamily<OpLabel> =
            histograms(r, "store_duration_seconds", "Duration of store calls");
        let store_errors: Family<OpLabel, Counter> = registered(
            r,
            "store_errors",
            "Store calls that failed (unreachable, timed out, full)",
        );
        let in_flight: Gauge = registered(r, "requests_in_flight", "Requests being handled");
        let waiting: Gauge = registered(
            r,
            "waiting_requests",
            "Duplicates waiting for the original's result (at most max_waiters per key)",
        );
        let buffered: Gauge = registered(r, "buffered_request_bytes", "Bytes of request bodies buffered now, all requests together (at most server.max_buffered)");
        let worker_connections: Family<WorkerLabel, Gauge> = registered(
            r,
            "worker_connections",
            "Client connections each worker thread is serving",
        );
        let records_purged: Counter = registered(
            r,
            "records_purged",
            "Expired records removed by an embedded store",
        );
        let store_syncs: Counter = registered(
            r,
            "store_syncs",
            "Durable commits (fsyncs) of the disk store",
        );
        let store_fill: Gauge<f64, std::sync::atomic::AtomicU64> = registered(
            r,
            "store_fill_ratio",
            "How full an embedded store is, 0 to 1 of its tightest bound (max_disk, max_keys, max_bytes); new keys get 503 store-full at 1",
        );
        let eviction_risk: Family<PolicyLabel, Gauge> = registered(r, "store_eviction_risk", "1 while Redis's maxmemory-policy (the label) can evict live records, 0 under noeviction; absent until read, and where it cannot be");
        let replica_acks_missed: Family<OpLabel, Counter> = registered(
            r,
            "store_replica_acks_missed",
            "Redis writes acknowledged by fewer replicas than store.min_replicas within replica_timeout, by store call; absent until the first",
        );
        let spans_dropped: Family<ReasonLabel, Counter> = registered(
            r,
            "trace_spans_dropped",
            "Trace spans dropped instead of exported ([telemetry]): queue_full (the collector slower than the traffic, or down), export_failed (an export refused or unanswered); absent while traces are off",
        );
        let consumers = consumer::ConsumerFamilies::new(r);
        let (client, sealed) = (client::ClientMetrics::new(r), sealed::SealedMetrics::new(r));
        Metrics {
            client,
            eviction_risk,
            store_fill,
            consumers,
            registry,
            requests,
            upstream_seconds,
            store_seconds,
            store_errors,
            in_flight,
            waiting,
            buffered,
            tunnels,
            worker_connections,
            connections_closed,
            reconciliations,
            signatures,
            records_purged,
            store_syncs,
            replica_acks_missed,
            spans_dropped,
            sealed,
            unrouted: RouteMetrics::new(""),
            store_ops: Default::default(),
        }
    }

    /// The series of requests outside any route (`route=""`).
    pub fn unrouted(&self) -> &RouteMetrics {
        &self.unrouted
    }

    pub fn request(&self, route: &RouteMetrics, outcome: Outcome) {
        route.requests[outcome as usize]
            .get_or_init(|| {
                self.requests
                    .get_or_create(&RequestLabels {
                        route: route.route.clone(),
                        outcome: outcome.as_str(),
                    })
                    .clone()
            })
            .inc();
    }

    pub fn upstream(&self, route: &RouteMetrics, took: Duration) {
        route
            .upstream
            .get_or_init(|| {
                self.upstream_seconds
                    .get_or_create(&RouteLabel {
                        route: route.route.clone(),
                    })
                    .clone()
            })
            .observe(took.as_secs_f64());
    }

    pub fn store_call(&self, op: StoreOp, took: Duration, failed: bool) {
        self.store_ops[op as usize]
            .get_or_init(|| {
                self.store_seconds
                    .get_or_create(&OpLabel { op: op.as_str() })
                    .clone()
            })
            .observe(took.as_secs_f64());
        if failed {
            self.store_errors
                .get_or_create(&OpLabel { op: op.as_str() })
                .inc();
        }
    }

    /// Counts a request as in flight until the guard drops.
    pub fn in_flight(&self) -> InFlight<'_> {
        self.in_flight.inc();
        InFlight(&self.in_flight)
    }

    /// One reconciliation and its result ([`crate::reconcile`]).
    pub fn reconciliation(&self, result: &'static str) {
        self.reconciliations
            .get_or_create(&ResultLabel { result })
            .inc();
    }

    pub fn connection_closed(&self, why: Expiry) {
        self.connections_closed
            .get_or_create(&ReasonLabel {
                reason: why.as_str(),
            })
            .inc();
    }

    /// The connection count of worker `index`; the acceptor balances on it.
    pub fn worker_connections(&self, index: usize) -> Gauge {
        self.worker_connections
            .get_or_create(&WorkerLabel {
                worker: index.to_string(),
            })
            .clone()
    }

    /// A delivery's signature checked on `route`: `result` is `verified` or why not.
    pub fn signature(&self, route: &RouteMetrics, result: &'static str) {
        self.signatures
            .get_or_create(&SignatureLabels {
                route: route.route.clone(),
                result,
            })
            .inc();
    }

    /// The count of duplicates waiting on keys ([`crate::duplicates`] keeps it).
    pub fn waiting(&self) -> Gauge {
        self.waiting.clone()
    }

    /// The tunnels open now (one per upgraded connection).
    pub fn tunnels(&self) -> Gauge {
        self.tunnels.clone()
    }

    /// The bytes of request bodies buffered now ([`crate::body::Budget`] counts in it).
    pub fn buffered(&self) -> Gauge {
        self.buffered.clone()
    }

    /// Requests being handled right now.
    pub fn in_flight_now(&self) -> i64 {
        self.in_flight.get()
    }

    /// Sets the store's counters from its own running totals.
    pub fn set_store_stats(&self, stats: StoreStats) {
        self.records_purged
            .inner()
            .store(stats.purged, Ordering::Relaxed);
        self.store_syncs
            .inner()
            .store(stats.syncs, Ordering::Relaxed);
        for (op, missed) in StoreOp::ALL.iter().zip(stats.replica_acks_missed) {
            if missed > 0 {
                self.replica_acks_missed
                    .get_or_create(&OpLabel { op: op.as_str() })
                    .inner()
                    .store(missed, Ordering::Relaxed);
            }
        }
        // One series, for the policy read last; none while it is not known.
        self.eviction_risk.clear();
        if let Some(policy) = stats.eviction_policy {
            let risk = i64::from(policy != "noeviction");
            self.eviction_risk
                .get_or_create(&PolicyLabel { policy })
                .set(risk);
        }
    }

    /// The trace exporter's running totals of dropped spans: (queue full, export failed).
    pub fn set_spans_dropped(&self, (queue_full, export_failed): (u64, u64)) {
        for (reason, n) in [("queue_full", queue_full), ("export_failed", export_failed)] {
            self.spans_dropped
                .get_or_create(&ReasonLabel { reason })
                .inner()
                .store(n, Ordering::Relaxed);
        }
    }

    /// How full an embedded store is (`None`: a store without a bound the gateway knows).
    pub fn set_store_fill(&self, fill: Option<f64>) {
        if let Some(fill) = fill {
            self.store_fill.set(fill);
        }
    }

    /// The text exposition (OpenMetrics) of everything; [`text::classic`] makes the classic
    /// format of it.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

pub struct InFlight<'a>(&'a Gauge);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Handles are indexed by variant: every variant must fall inside the arrays. The matches
    /// are exhaustive, so a new variant fails to compile here until it is listed.
    #[test]
    fn every_variant_has_a_handle_slot() {
        let outcomes = [
            Outcome::Executed,
            Outcome::Replayed,
            Outcome::Waited,
            Outcome::Mismatch,
            Outcome::InFlightRejected,
            Outcome::MissingKey,
            Outcome::InvalidKey,
            Outcome::TooLarge,
            Outcome::BadRequest,
            Outcome::StoreError,
            Outcome::UpstreamError,
            Outcome::Released,
            Outcome::Unknown,
            Outcome::Limited,
            Outcome::Bypassed,
            Outcome::Passthrough,
        ];
        for o in outcomes {
            match o {
                Outcome::Executed
                | Outcome::Replayed
                | Outcome::Waited
                | Outcome::Mismatch
                | Outcome::InFlightRejected
                | Outcome::MissingKey
                | Outcome::InvalidKey
                | Outcome::TooLarge
                | Outcome::BadRequest
                | Outcome::StoreError
                | Outcome::UpstreamError
                | Outcome::Released
                | Outcome::Unknown
                | Outcome::Limited
                | Outcome::Bypassed
                | Outcome::Passthrough => assert!((o as usize) < Outcome::COUNT, "{o:?}"),
            }
        }
        assert_eq!(outcomes.len(), Outcome::COUNT);
        // ALL is COUNT long: a variant added to the enum but not to ALL does not compile.
        let ops = StoreOp::ALL;
        for (i, op) in ops.into_iter().enumerate() {
            assert_eq!(op as usize, i, "StoreOp::ALL is in index order");
            match op {
                StoreOp::Reserve
                | StoreOp::Get
                | StoreOp::Complete
                | StoreOp::MarkUnknown
                | StoreOp::Release
                | StoreOp::Renew
                | StoreOp::TakeOver
                | StoreOp::Delete
                | StoreOp::Ping => assert!((op as usize) < StoreOp::COUNT, "{op:?}"),
            }
        }
        assert_eq!(ops.len(), StoreOp::COUNT);
    }

    /// A kept handle counts into the same series a lookup finds, and the series shows only
    /// once used.
    #[test]
    fn route_handles_count_into_the_labelled_series() {
        let m = Metrics::new();
        let handles = RouteMetrics::new("pay");
        assert!(!m.encode().contains("route=\"pay\""));
        m.request(&handles, Outcome::Executed);
        m.request(&handles, Outcome::Executed);
        m.request(&RouteMetrics::new("pay"), Outcome::Executed);
        m.request(m.unrouted(), Outcome::Passthrough);
        m.store_call(StoreOp::Reserve, Duration::from_millis(1), true);
        let text = m.encode();
        assert!(
            text.contains("idemgate_requests_total{route=\"pay\",outcome=\"executed\"} 3"),
            "{text}"
        );
        assert!(text.contains("idemgate_requests_total{route=\"\",outcome=\"passthrough\"} 1"));
        assert!(!text.contains("outcome=\"replayed\""));
        assert!(text.contains("idemgate_store_errors_total{op=\"reserve\"} 1"));
        assert!(text.contains("idemgate_store_duration_seconds_count{op=\"reserve\"} 1"));
    }
}
