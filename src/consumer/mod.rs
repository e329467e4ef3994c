//! Broker consumers (`[[consumers]]`): the second front on the idempotency core, beside the HTTP
//! gateway. Each reads one [`Source`] (a Redis stream, a NATS JetStream stream, a RabbitMQ
//! queue or a Kafka topic), POSTs every message to its handler
//! through [`Core::run`], with the same stores, key hashing, fingerprints and unknown-outcome
//! rules as an HTTP route, and acknowledges the message only once its result is stored.
//!
//! One message, phase by phase:
//! ```text
//! read ─▶ key (a body field, entry fields) ── none ─▶ dead-letter "missing-key"
//!   └─▶ core.run ─▶ verdict:  stored answer (2xx, 4xx), replay ───────────▶ ack
//!                            5xx, 401/403/408/425/429, handler unreachable ─▶ retry (backoff) ─▶ … ─▶ dead-letter after max_attempts
//!                            another message with this key and other content ─▶ dead-letter "key-reused"
//!                            outcome unknown ─▶ dead-letter "outcome-unknown" (on_unknown = "retry": retry)
//!                            store down, original still running ─▶ retry, not counted
//! ```
//! The message stays claimed (unacknowledged, its idle time reset) while it is handled and
//! while it waits for a retry, so no other instance takes it; a crash leaves it pending, and
//! whichever instance gets it next (after `claim_idle`, or NATS's `ack_wait`) finds the key's
//! record: a replay if the
//! answer was stored, an unknown outcome (never run twice) if the crash came mid-call.
//!
//! Back pressure: at most `concurrency` messages are held at once; no more are read until one
//! is done. Shutdown stops reading, lets the messages being handled finish (within
//! `server.shutdown_grace`) and leaves those waiting for a retry pending, for the next claim.

mod any;
mod handler;
pub mod kafka;
pub mod nats;
pub mod rabbitmq;
pub mod redis_stream;
pub mod source;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, HeaderValue, Method};
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::ConsumerConfig;
use crate::fingerprint::{fingerprint, IgnoredFields, RequestParts};
use crate::idempotency::{Core, Decision, Refusal, Rules, Settled};
use crate::key::{ClientScope, Sent, StoreKey};
use crate::metrics::{ConsumerMetrics, ConsumerOutcome, Metrics};
use crate::store::{Claim, Origin, OriginKind, Store};
use crate::upstream::UpstreamPool;

pub use any::{sources, AnySource};
use handler::HandlerCall;
pub use kafka::KafkaTopic;
pub use nats::NatsStream;
pub use rabbitmq::RabbitQueue;
pub use redis_stream::RedisStream;
pub use source::{Message, Source, SourceError};

/// Messages read in one fetch at most (bounded by the free `concurrency` slots too).
const MAX_BATCH: usize = 64;
/// How often the group's pending count is read for the metric.
const PENDING_EVERY: Duration = Duration::from_secs(5);

/// What a consumer needs of the running gateway.
pub struct Context {
    pub core: Arc<Core>,
    pub store: Arc<dyn Store>,
    pub metrics: Arc<Metrics>,
    pub pool: UpstreamPool,
}

/// Whether a consumer's broker answered its last read (a fetch; a failed ack, keep or
/// dead-letter does not count): `/readyz` fails while one does not.
#[derive(Debug)]
pub struct BrokerHealth {
    pub consumer: String,
    reachable: AtomicBool,
}

impl BrokerHealth {
    pub fn new(consumer: &str) -> Arc<Self> {
        Arc::new(BrokerHealth {
            consumer: consumer.to_string(),
            // Not ready until the broker has answered once.
            reachable: AtomicBool::new(false),
        })
    }

    pub fn is_reachable(&self) -> bool {
        self.reachable.load(Ordering::Relaxed)
    }

    fn set(&self, reachable: bool) {
        self.reachable.store(reachable, Ordering::Relaxed);
    }
}

#[derive(Debug, thiserror::Error)]
#[error("consumer {consumer:?}: {source}")]
pub struct ConsumerError {
    consumer: String,
    source: SourceError,
}

/// One consumer, running until `shutdown`: reads, hands each message to a task of its own
/// (at most `concurrency`), and at shutdown waits up to `grace` for those tasks.
pub async fn run<S: Source>(
    config: ConsumerConfig,
    source: S,
    ctx: Context,
    health: Arc<BrokerHealth>,
    shutdown: CancellationToken,
    grace: Duration,
) {
    let metrics = ctx.metrics.consumer(&config.name);
    let consumer = Arc::new(Consumer {
        config,
        source,
        ctx,
        metrics,
        shutdown: shutdown.clone(),
    });
    let slots = Arc::new(Semaphore::new(consumer.config.concurrency));
    let tasks = TaskTracker::new();
    let mut failures = 0u32;
    let mut pending_read = Instant::now();
    loop {
        // Back pressure: read only as many as there are free slots, and none while all are
        // taken.
        let first = tokio::select! {
            slot = Arc::clone(&slots).acquire_owned() => match slot {
                Ok(s) => s,
                Err(_) => break,
            },
            () = shutdown.cancelled() => break,
        };
        let mut held = vec![first];
        while held.len() < MAX_BATCH {
            match Arc::clone(&slots).try_acquire_owned() {
                Ok(s) => held.push(s),
                Err(_) => break,
            }
        }
        let fetched = tokio::select! {
            f = consumer.source.fetch(held.len()) => f,
            () = shutdown.cancelled() => break,
        };
        match fetched {
            Ok(messages) => {
                health.set(true);
                failures = 0;
                for (message, slot) in messages.into_iter().zip(held) {
                    let consumer = Arc::clone(&consumer);
                    tasks.spawn(async move {
                        consumer.handle(message).await;
                        drop(slot);
                    });
                }
            }
            Err(e) => {
                health.set(false);
                failures = failures.saturating_add(1);
                tracing::warn!(consumer = %consumer.config.name, error = %e, "cannot read from the broker; trying again");
                let pause = backoff(
                    failures,
                    Duration::from_millis(200),
                    Duration::from_secs(5),
                    jitter(),
                );
                tokio::select! {
                    () = tokio::time::sleep(pause) => {}
                    () = shutdown.cancelled() => break,
                }
            }
        }
        if pending_read.elapsed() >= PENDING_EVERY {
            pending_read = Instant::now();
            if let Ok(n) = consumer.source.pending().await {
                consumer.metrics.set_pending(n);
            }
        }
    }
    tasks.close();
    if tokio::time::timeout(grace, tasks.wait()).await.is_err() {
        tracing::warn!(
            consumer = %consumer.config.name,
            running = tasks.len(),
            "grace period over with messages still being handled; they stay pending and are delivered again"
        );
    }
}

struct Consumer<S> {
    config: ConsumerConfig,
    source: S,
    ctx: Context,
    metrics: ConsumerMetrics,
    shutdown: CancellationToken,
}

/// What to do with a message after one attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Verdict {
    /// Its result is stored (now, or by an earlier delivery): acknowledge it.
    Ack(ConsumerOutcome),
    /// Not done: try again later. `counted`: the attempt counts against `max_attempts` (the
    /// handler failed), rather than waiting on something else (the store, the original).
    Retry { reason: String, counted: bool },
    /// Never to be tried again automatically: to the dead-letter stream, with why.
    DeadLetter(String),
}

impl<S: Source> Consumer<S> {
    async fn handle(&self, mut message: Message) {
        let name = &self.config.name;
        loop {
            let verdict = self.attempt(&message).await;
            match verdict {
                Verdict::Ack(outcome) => {
                    // A lost acknowledgement only means one more delivery, which replays.
                    if let Err(e) = self.source.ack(&message).await {
                        tracing::warn!(consumer = %name, id = %message.id, error = %e, "acknowledgement failed; the message will be delivered again");
                    }
                    self.metrics.count(outcome);
                    return;
                }
                Verdict::DeadLetter(reason) => return self.dead_letter(&message, &reason).await,
                Verdict::Retry { reason, counted } => {
                    if counted && message.deliveries >= self.config.max_attempts {
                        let reason = format!(
                            "failed: {reason} (gave up after {} attempts)",
                            message.deliveries
                        );
                        return self.dead_letter(&message, &reason).await;
                    }
                    self.metrics.count(ConsumerOutcome::Retried);
                    let delay = backoff(
                        u32::try_from(message.deliveries).unwrap_or(u32::MAX),
                        self.config.backoff,
                        self.config.max_backoff,
                        jitter(),
                    );
                    tracing::info!(consumer = %name, id = %message.id, %reason, ?delay, "message not done; trying again");
                    if counted {
                        match self.source.retry_later(&message, delay).await {
                            // The broker delivers it again, as one more delivery.
                            Ok(true) => return,
                            Ok(false) => {}
                            Err(e) => {
                                tracing::warn!(consumer = %name, id = %message.id, error = %e, "cannot hand the message back; it is delivered again after its claim runs out");
                                return;
                            }
                        }
                    }
                    if !self.wait_claimed(&message, delay).await {
                        // Shutting down: left pending, for whichever instance claims it next.
                        return;
                    }
                    if counted {
                        if let Err(e) = self.source.keep(&message, true).await {
                            tracing::warn!(consumer = %name, id = %message.id, error = %e, "cannot count the attempt; leaving the message pending");
                            return;
                        }
                        message.deliveries += 1;
                    }
                }
            }
        }
    }

    async fn dead_letter(&self, message: &Message, reason: &str) {
        let name = &self.config.name;
        match self.source.dead_letter(message, reason).await {
            Ok(()) => {
                tracing::warn!(consumer = %name, id = %message.id, %reason, "message moved to the dead-letter stream");
                self.metrics.count(ConsumerOutcome::DeadLettered);
            }
            // Still pending: delivered again, and judged again.
            Err(e) => {
                tracing::error!(consumer = %name, id = %message.id, error = %e, "cannot dead-letter the message; it stays pending")
            }
        }
    }

    /// Sleeps `delay` while keeping the message claimed; false if shutdown came first.
    async fn wait_claimed(&self, message: &Message, delay: Duration) -> bool {
        let until = Instant::now() + delay;
        let every = (self.source.claim_after() / 3).max(Duration::from_millis(10));
        loop {
            let next = (Instant::now() + every).min(until);
            tokio::select! {
                () = tokio::time::sleep_until(next) => {}
                () = self.shutdown.cancelled() => return false,
            }
            if Instant::now() >= until {
                return true;
            }
            let _ = self.source.keep(message, false).await;
        }
    }

    /// One attempt at a message: key, fingerprint, the core.
    async fn attempt(&self, message: &Message) -> Verdict {
        let config = &self.config;
        let Some(body) = &message.body else {
            return Verdict::DeadLetter(format!(
                "no-body: the entry has no field {:?}",
                config.body_field
            ));
        };
        if body.len() > config.policy.max_body {
            return Verdict::DeadLetter(format!(
                "too-large: {} bytes, over max_body ({})",
                body.len(),
                config.policy.max_body
            ));
        }
        let Sent { key, sent } = match config.key.extract_sent(&message.fields, body) {
            Ok(Some(k)) => k,
            Ok(None) => {
                let parts: Vec<String> = config
                    .key
                    .headers
                    .iter()
                    .map(|f| format!("the field {f}"))
                    .chain(
                        config
                            .key
                            .pointers
                            .iter()
                            .map(|p| format!("the body field {p}")),
                    )
                    .collect();
                return Verdict::DeadLetter(format!(
                    "missing-key: the message has no value for {}",
                    parts.join(" and ")
                ));
            }
            Err(e) => return Verdict::DeadLetter(format!("invalid-key: {e}")),
        };
        let store_key = StoreKey::new(&ClientScope::shared(), &config.name, &key);
        let lookup = crate::reconcile::Lookup::of(&config.policy, &sent);
        let mut headers = message.fields.clone();
        headers.insert(http::header::CONTENT_TYPE, config.content_type.clone());
        let fp = fingerprint(
            &RequestParts {
                method: &Method::POST,
                route: &config.name,
                path: &config.handler.prefix,
                query: None,
                headers: &headers,
                body,
            },
            &IgnoredFields::default(),
        );
        headers.insert(IDEMPOTENCY_KEY.clone(), header_value(&key));
        headers.insert(MESSAGE_ID.clone(), header_value(&message.id));
        headers.insert(DELIVERIES.clone(), HeaderValue::from(message.deliveries));
        let call = HandlerCall {
            pool: self.ctx.pool.clone(),
            handler: config.handler.clone(),
            policy: config.policy.clone(),
            headers,
            body: body.clone(),
        };
        let claim = Claim {
            fingerprint: fp,
            origin: Some(Origin::new(OriginKind::Consumer, &config.name, sent)),
        };
        let run = self.ctx.core.run(
            &self.ctx.store,
            &store_key,
            claim,
            // A message has no client to count records for.
            (
                Rules::of(&config.policy, config.check_fingerprint),
                lookup.as_ref(),
            ),
            call,
        );
        tokio::pin!(run);
        // Claimed for as long as it runs, however long the handler takes.
        let every = (self.source.claim_after() / 3).max(Duration::from_millis(10));
        let decision = loop {
            tokio::select! {
                d = &mut run => break d,
                () = tokio::time::sleep(every) => {
                    let _ = self.source.keep(message, false).await;
                }
            }
        };
        if let Decision::Owned { took, .. } = &decision {
            self.metrics.handler(*took);
        }
        verdict(decision)
    }
}

/// What became of one attempt, as the broker must see it: the pure core of this module.
fn verdict(decision: Decision<HandlerCall>) -> Verdict {
    match decision {
        Decision::Owned { settled, .. } => match settled {
            Settled::Stored(_) => Verdict::Ack(ConsumerOutcome::Delivered),
            Settled::Released(status) => Verdict::Retry {
                reason: format!("the handler answered {status}"),
                counted: true,
            },
            Settled::NotSent(e) => Verdict::Retry {
                reason: format!("the handler could not be reached: {e}"),
                counted: true,
            },
            Settled::Unknown {
                retryable: true, ..
            } => Verdict::Retry {
                reason: "outcome unknown (on_unknown = \"retry\")".into(),
                counted: true,
            },
            Settled::Unknown { reason, .. } => Verdict::DeadLetter(format!(
                "outcome-unknown: the handler was called and gave no complete answer ({})",
                reason.as_str()
            )),
            Settled::AnsweredUnknown {
                retryable: true,
                status,
                ..
            } => Verdict::Retry {
                reason: format!("the handler answered {status}, which may follow a commit; outcome unknown (on_unknown = \"retry\")"),
                counted: true,
            },
            Settled::AnsweredUnknown { status, .. } => Verdict::DeadLetter(format!(
                "outcome-unknown: the handler answered {status}, which may follow a commit (unknown_statuses)"
            )),
        },
        Decision::Replay { .. } => Verdict::Ack(ConsumerOutcome::Deduplicated),
        Decision::Refused(refusal) => match refusal {
            Refusal::KeyReused => Verdict::DeadLetter(
                "key-reused: a message with this key and other content was handled before".into(),
            ),
            Refusal::OutcomeUnknown(reason) => Verdict::DeadLetter(format!(
                "outcome-unknown: an earlier delivery called the handler and its outcome is not known ({})",
                reason.as_str()
            )),
            Refusal::InFlight => Verdict::Retry {
                reason: "another delivery of this key is still being handled".into(),
                counted: false,
            },
            Refusal::StoreUnavailable | Refusal::StoreFull | Refusal::OverQuota { .. } => {
                Verdict::Retry {
                    reason: "the store cannot take the key now".into(),
                    counted: false,
                }
            }
        },
        // on_store_error is always "reject" for consumers (config).
        Decision::Bypass(_) => Verdict::Retry {
            reason: "the store cannot take the key now".into(),
            counted: false,
        },
    }
}

static IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
static MESSAGE_ID: HeaderName = HeaderName::from_static("idemgate-message-id");
static DELIVERIES: HeaderName = HeaderName::from_static("idemgate-deliveries");

fn header_value(s: &str) -> HeaderValue {
    HeaderValue::from_str(s).unwrap_or_else(|_| HeaderValue::from_static("invalid"))
}

/// The delay before retry number `attempt` (1 for the first): `base` doubled per attempt up to
/// `max`, then scaled by `jitter` (0.5 to 1.0), so that messages that failed together do not
/// come back together.
fn backoff(attempt: u32, base: Duration, max: Duration, jitter: f64) -> Duration {
    let doubled = base.saturating_mul(1u32 << attempt.saturating_sub(1).min(20));
    doubled.min(max).mul_f64(jitter.clamp(0.5, 1.0))
}

/// A random factor in [0.5, 1.0): spreads retries apart.
fn jitter() -> f64 {
    rand::random_range(0.5..1.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::UnknownReason;

    fn owned(settled: Settled<u16>) -> Decision<HandlerCall> {
        Decision::Owned {
            settled,
            took: Duration::ZERO,
        }
    }

    #[test]
    fn stored_answers_and_replays_are_acknowledged() {
        assert_eq!(
            verdict(owned(Settled::Stored(201))),
            Verdict::Ack(ConsumerOutcome::Delivered)
        );
        assert_eq!(
            verdict(owned(Settled::Stored(422))),
            Verdict::Ack(ConsumerOutcome::Delivered)
        );
        let replay = Decision::Replay {
            response: Arc::new(crate::store::StoredResponse {
                status: http::StatusCode::CREATED,
                headers: Vec::new(),
                trailers: Vec::new(),
                body: bytes::Bytes::new(),
                body_kept: true,
                completed_ms: 0,
            }),
            waited: false,
        };
        assert_eq!(verdict(replay), Verdict::Ack(ConsumerOutcome::Deduplicated));
    }

    #[test]
    fn handler_failures_are_retried_and_counted() {
        for d in [
            owned(Settled::Released(503)),
            owned(Settled::NotSent("refused".into())),
            owned(Settled::Unknown {
                reason: UnknownReason::Timeout,
                retryable: true,
            }),
        ] {
            assert!(matches!(verdict(d), Verdict::Retry { counted: true, .. }));
        }
    }

    #[test]
    fn waiting_on_others_is_retried_without_counting() {
        for r in [
            Refusal::InFlight,
            Refusal::StoreUnavailable,
            Refusal::StoreFull,
        ] {
            assert!(matches!(
                verdict(Decision::Refused(r)),
                Verdict::Retry { counted: false, .. }
            ));
        }
    }

    #[test]
    fn unknown_outcomes_and_reused_keys_go_to_an_operator() {
        let unknown = verdict(owned(Settled::Unknown {
            reason: UnknownReason::Interrupted,
            retryable: false,
        }));
        assert!(matches!(unknown, Verdict::DeadLetter(r) if r.starts_with("outcome-unknown")));
        let earlier = verdict(Decision::Refused(Refusal::OutcomeUnknown(
            UnknownReason::Abandoned,
        )));
        assert!(matches!(earlier, Verdict::DeadLetter(r) if r.starts_with("outcome-unknown")));
        let reused = verdict(Decision::Refused(Refusal::KeyReused));
        assert!(matches!(reused, Verdict::DeadLetter(r) if r.starts_with("key-reused")));
    }

    #[test]
    fn backoff_doubles_up_to_its_cap_with_jitter() {
        let (base, max) = (Duration::from_secs(1), Duration::from_secs(60));
        assert_eq!(backoff(1, base, max, 1.0), Duration::from_secs(1));
        assert_eq!(backoff(2, base, max, 1.0), Duration::from_secs(2));
        assert_eq!(backoff(4, base, max, 1.0), Duration::from_secs(8));
        assert_eq!(backoff(30, base, max, 1.0), max);
        assert_eq!(backoff(u32::MAX, base, max, 1.0), max);
        assert_eq!(backoff(2, base, max, 0.5), Duration::from_secs(1));
        assert_eq!(
            backoff(2, base, max, 0.1),
            Duration::from_secs(1),
            "jitter is floored at 0.5"
        );
        let j = jitter();
        assert!((0.5..1.0).contains(&j));
    }
}
