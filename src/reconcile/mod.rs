//! Reconciliation: asking the upstream whether an unknown outcome happened, instead of leaving
//! every such key to an operator (`reconcile = { url = ".../by-key/{key}", after = "30s" }` on a
//! route). When a retry meets an unknown outcome (sent, no complete answer; or a gateway that
//! stopped mid-flight, its lease run out), and `after` has passed since the request was last
//! known to run, the gateway GETs the lookup URL with the client's key in it:
//!
//! - 2xx: it happened. That answer becomes the key's result (marked `idemgate-reconciled: true`),
//!   and this retry and every later one replay it.
//! - 404: it did not happen. The key is released, and this retry executes it.
//! - anything else, or no answer: it stays unknown (the retry gets `outcome-unknown`); a later
//!   retry asks again.
//!
//! Both changes replace exactly the record read ([`crate::operator::resolve`]), so an owner
//! finishing meanwhile is never overwritten. A wrong 404 is a double charge: the lookup must be
//! consistent with the upstream's own writes, and nothing may run after `after`
//! (docs/lifecycle.md).

mod background;
mod flights;

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, HeaderValue, StatusCode, Uri};
use http_body_util::{BodyExt, Limited};
use opentelemetry::trace::SpanKind;
use opentelemetry::KeyValue;

use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};

use crate::config::Policy;
use crate::key::StoreKey;
use crate::metrics::Metrics;
use crate::operator::{self, Change};
use crate::store::{millis, now_ms, RecordState, Store, StoredResponse};
use crate::telemetry::span::Trace;
use crate::upstream::{oneshot, ConnectionLimits, UpstreamTlsConnector};
use background::Queue;
pub use background::{run as run_background, Backlog, Sources};
use flights::{Flights, Seat};

/// Marks a result the gateway learned from the upstream's lookup rather than its own call.
pub const RECONCILED_HEADER: HeaderName = HeaderName::from_static("idemgate-reconciled");

/// What a key keeps as it is in the lookup's URL: RFC 3986's unreserved characters; everything
/// else (`/`, `?`, `%`, spaces, ...) is percent-encoded, so a key is one path segment or value.
const KEY_IN_PATH: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// One key's lookup, made by the front (which knows the client's key) for the core.
#[derive(Debug, Clone)]
pub struct Lookup {
    /// The route's `reconcile.url` with `{key}` replaced by the client's key, percent-encoded.
    pub url: Uri,
    /// No lookup before this long after the request was last known to run.
    pub after: Duration,
    /// How long the lookup may take (the route's `upstream_timeout`).
    pub timeout: Duration,
    /// The largest answer kept as the key's result (`max_stored_response`).
    pub max_body: usize,
}

impl Lookup {
    /// The lookup for the client's key `raw_key` under `policy`, if the policy has one.
    pub fn of(policy: &Policy, raw_key: &str) -> Option<Lookup> {
        let reconcile = policy.reconcile.as_ref()?;
        let key = utf8_percent_encode(raw_key, KEY_IN_PATH).to_string();
        // Validated at load with a plain key; a client's key is percent-encoded, so it fits.
        let url = reconcile.url.replace("{key}", &key).parse().ok()?;
        Some(Lookup {
            url,
            after: reconcile.after.unwrap_or(policy.upstream_timeout),
            timeout: policy.upstream_timeout,
            max_body: policy.max_stored_response,
        })
    }
}

/// What a reconciliation came to.
#[derive(Clone)]
pub enum Reconciled {
    /// It happened: the stored result, for this retry too.
    Replay(Arc<StoredResponse>),
    /// It did not: the key is free, and this retry may run it.
    Released,
    /// Still unknown: the lookup did not say, or the record changed while it was settled.
    Unknown,
    /// `after` has not passed since the request last ran: no lookup before this time (ms since
    /// the Unix epoch).
    TooEarly(u64),
    /// The record is no longer an unknown outcome (settled meanwhile, or gone).
    Settled,
    /// Not asked: every lookup a process may make at once is in flight ([`flights`]).
    Busy,
}

impl Reconciled {
    pub fn as_str(&self) -> &'static str {
        match self {
            Reconciled::Replay(_) => "reconciled",
            Reconciled::Released => "released",
            Reconciled::Unknown => "unknown",
            Reconciled::TooEarly(_) => "too_early",
            Reconciled::Settled => "settled",
            Reconciled::Busy => "busy",
        }
    }
}

/// Settles unknown outcomes by their lookups, now (for a retry) or in the background; one per
/// process.
pub struct Reconciler {
    metrics: Arc<Metrics>,
    /// For `https://` lookups: the `[upstream]` TLS settings.
    tls: Arc<UpstreamTlsConnector>,
    /// A lookup is a connection to its upstream: it takes one of its `max_connections` slots.
    limits: Arc<ConnectionLimits>,
    /// One lookup per key at a time, shared; a few at once in all.
    flights: Flights,
    queue: Queue,
    /// The receiving end of `queue`, until the server starts the background task.
    backlog: std::sync::Mutex<Option<Backlog>>,
}

impl Reconciler {
    pub fn new(
        metrics: Arc<Metrics>,
        tls: Arc<UpstreamTlsConnector>,
        limits: Arc<ConnectionLimits>,
    ) -> Reconciler {
        let (queue, backlog) = background::queue();
        Reconciler {
            metrics,
            tls,
            limits,
            flights: Flights::new(),
            queue,
            backlog: std::sync::Mutex::new(Some(backlog)),
        }
    }

    /// Asks the upstream about `key`'s unknown outcome and settles the record by its answer,
    /// for a retry: the lookup in flight for the key if there is one, `Busy` rather than a wait
    /// when every lookup is taken.
    pub async fn settle(
        &self,
        store: &dyn Store,
        key: &StoreKey,
        lookup: &Lookup,
        ttl: Duration,
        trace: Option<&Trace>,
    ) -> Reconciled {
        self.settle_as(store, key, lookup, ttl, (false, trace))
            .await
    }

    /// [`Self::settle`]; `wait`: for a free lookup rather than `Busy` (the background);
    /// `trace`: the retry's reconciliation span, the lookup's parent.
    async fn settle_as(
        &self,
        store: &dyn Store,
        key: &StoreKey,
        lookup: &Lookup,
        ttl: Duration,
        (wait, trace): (bool, Option<&Trace>),
    ) -> Reconciled {
        // The background never waits for a permit while it leads a key (retries of the key
        // would wait behind its wait), nor holds one while it follows another's lookup.
        let mut held = None;
        let lead = loop {
            match self.flights.join(key) {
                Seat::Follow(answer) => {
                    drop(held);
                    return flights::follow(answer, lookup.timeout).await;
                }
                Seat::Lead(lead) if !wait || held.is_some() => break lead,
                Seat::Lead(lead) => {
                    held = self.flights.permit(false).await;
                    if held.is_some() {
                        break lead;
                    }
                    drop(lead);
                    held = self.flights.permit(true).await;
                }
            }
        };
        let asker = Asker {
            tls: &self.tls,
            limits: &self.limits,
            flights: &self.flights,
            held,
            trace,
        };
        let (settled, why) = ask(store, key, lookup, ttl, asker).await;
        lead.answer(&settled);
        if !matches!(
            settled,
            Reconciled::Replay(_) | Reconciled::Released | Reconciled::Unknown
        ) {
            // Not asked (too early, settled meanwhile, every lookup taken): a storm of retries
            // before `after` must not log a line each.
            tracing::debug!(
                key = key.short(),
                result = settled.as_str(),
                "reconciliation not asked"
            );
            if matches!(settled, Reconciled::Busy) {
                self.metrics.reconciliation(settled.as_str());
            }
            return settled;
        }
        // Counted when the upstream was asked, and when it could not be (`busy`).
        self.metrics.reconciliation(settled.as_str());
        // One line per lookup, whoever shares its answer.
        match why {
            Some(why) => {
                tracing::warn!(key = key.short(), result = settled.as_str(), why = %why, "reconciliation: the lookup did not say; the outcome stays unknown")
            }
            None => tracing::info!(
                key = key.short(),
                result = settled.as_str(),
                "reconciliation"
            ),
        }
        settled
    }

    /// Has the background ask about `key` from `due_ms` on (ms since the Unix epoch), again
    /// with backoff while the lookup does not say. Never waits: with the queue full, the key
    /// is left to retries, the next sweep and the operator.
    pub fn schedule(&self, key: StoreKey, lookup: &Lookup, ttl: Duration, due_ms: u64) {
        self.queue.schedule(key, lookup, ttl, due_ms);
    }

    /// The background's side of the queue, once (the server takes it when it starts).
    pub fn take_backlog(&self) -> Option<Backlog> {
        self.backlog
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }
}

/// What a lookup needs of the reconciler.
struct Asker<'a> {
    tls: &'a UpstreamTlsConnector,
    limits: &'a ConnectionLimits,
    flights: &'a Flights,
    /// The background's permit, taken before it led the key; a retry takes one at once or
    /// gets `Busy`.
    held: Option<tokio::sync::SemaphorePermit<'a>>,
    /// The span the lookup's is a child of (a retry's; the background's lookups have none).
    trace: Option<&'a Trace>,
}

/// When a lookup about an unknown outcome may first be believed (ms since the epoch): `after`
/// past the time the request was last known to run (marked unknown, or its lease's end), and
/// `skew` more, as that time is another clock's (the instance that wrote it, or the database's)
/// and this one may be ahead of it by up to `skew`. `None` unless the outcome is unknown.
pub(crate) fn lookup_due(state: &RecordState, after: Duration, skew: Duration) -> Option<u64> {
    let last_ran = match *state {
        RecordState::Unknown { since_ms, .. } => since_ms,
        RecordState::Abandoned { lease_until_ms, .. } => lease_until_ms,
        _ => return None,
    };
    Some(
        last_ran
            .saturating_add(millis(after))
            .saturating_add(millis(skew)),
    )
}

async fn ask(
    store: &dyn Store,
    key: &StoreKey,
    lookup: &Lookup,
    ttl: Duration,
    asker: Asker<'_>,
) -> (Reconciled, Option<String>) {
    let record = match store.get(key).await {
        Ok(Some(record)) => record,
        Ok(None) => return (Reconciled::Settled, None),
        Err(e) => return (Reconciled::Unknown, Some(format!("the store: {e}"))),
    };
    let Some(due) = lookup_due(&record.state, lookup.after, store.max_clock_skew()) else {
        return (Reconciled::Settled, None);
    };
    if now_ms() < due {
        return (Reconciled::TooEarly(due), None);
    }
    let permit = match asker.held {
        Some(held) => Some(held),
        None => asker.flights.permit(false).await,
    };
    let Some(_permit) = permit else {
        return (Reconciled::Busy, None);
    };
    let span = (asker.trace).map(|t| {
        let attributes = vec![KeyValue::new("http.request.method", "GET")];
        t.phase("reconcile lookup", SpanKind::Client, attributes)
    });
    let got = get(lookup, asker.tls, asker.limits, span.as_ref()).await;
    if let Some(span) = &span {
        span.end(got.as_ref().err().map(String::as_str));
    }
    let changed = match got {
        Ok(Some(response)) => {
            let stored = Arc::new(response.clone());
            match operator::resolve(store, (key, Some(&record)), response, false, ttl).await {
                Ok(Change::Done) => Ok(Reconciled::Replay(stored)),
                other => Err(other.map(drop)),
            }
        }
        Ok(None) => match operator::release(store, (key, Some(&record)), false, ttl).await {
            Ok(Change::Done) => Ok(Reconciled::Released),
            other => Err(other.map(drop)),
        },
        Err(why) => return (Reconciled::Unknown, Some(why)),
    };
    match changed {
        Ok(settled) => (settled, None),
        // The record changed while the lookup ran (an owner finished), or the store failed.
        Err(Ok(())) => (Reconciled::Unknown, None),
        Err(Err(e)) => (Reconciled::Unknown, Some(format!("the store: {e}"))),
    }
}

/// The lookup: `Some(answer)` for a 2xx, `None` for a 404, why not for anything else.
async fn get(
    lookup: &Lookup,
    tls: &UpstreamTlsConnector,
    limits: &ConnectionLimits,
    span: Option<&Trace>,
) -> Result<Option<StoredResponse>, String> {
    let mut headers = http::HeaderMap::new();
    if let Some(span) = span {
        span.hand_on(&mut headers);
    }
    let deadline = tokio::time::Instant::now() + lookup.timeout;
    let answer = async {
        // Held until the answer is read: the lookup's connection counts in the upstream's cap.
        let _slot = match lookup.url.authority() {
            Some(authority) => Some(
                limits
                    .gate(authority)
                    .slot(deadline)
                    .await
                    .map_err(|e| e.to_string())?,
            ),
            None => None,
        };
        let response = oneshot::get(&lookup.url, tls, oneshot::Peer::Upstream, headers).await?;
        let (parts, body) = response.into_parts();
        if parts.status == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        if !parts.status.is_success() {
            return Err(format!("the lookup answered {}", parts.status));
        }
        let body = Limited::new(body, lookup.max_body)
            .collect()
            .await
            .map_err(|e| format!("the lookup's answer: {e}"))?
            .to_bytes();
        let mut headers: Vec<(HeaderName, HeaderValue)> = parts
            .headers
            .iter()
            .filter(|(name, _)| !hop_by_hop(name))
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect();
        headers.push((RECONCILED_HEADER, HeaderValue::from_static("true")));
        Ok(Some(StoredResponse {
            status: parts.status,
            headers,
            trailers: Vec::new(),
            body,
            body_kept: true,
            completed_ms: now_ms(),
            link: None,
        }))
    };
    tokio::time::timeout(lookup.timeout, answer)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {:?}", lookup.timeout)))
}

fn hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "transfer-encoding"
            | "te"
            | "trailer"
            | "upgrade"
            | "content-length"
    )
}
