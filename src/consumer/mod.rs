//! Broker consumers (`[[consumers]]`): the second front on the idempotency core, beside the HTTP
//! gateway. Each reads one [`Source`] (a Redis stream, a NATS JetStream stream, a RabbitMQ
//! queue or a Kafka topic), POSTs every message to its handler
//! through [`Core::run`](crate::idempotency::Core::run), with the same stores, key hashing,
//! fingerprints and unknown-outcome rules as an HTTP route, and acknowledges the message only
//! once its result is stored.
//!
//! One message, phase by phase ([`message`] and [`attempt`]):
//! ```text
//! read ─▶ invalid (a header name not UTF-8) ─▶ dead-letter "invalid-message"
//!   └─▶ key (a body field, entry fields) ── none ─▶ dead-letter "missing-key"
//!   └─▶ core.run ─▶ verdict:  stored answer (2xx, 4xx), replay ───────────▶ ack
//!                            5xx, 401/403/408/415/425/429, handler unreachable ─▶ retry (backoff) ─▶ … ─▶ dead-letter after max_attempts
//!                            another message with this key and other content ─▶ dead-letter "key-reused"
//!                            outcome unknown ─▶ dead-letter "outcome-unknown" (on_unknown = "retry": retry)
//!                            store down, original still running ─▶ retry, not counted
//!                            answered, the store refused the answer ─▶ not acknowledged; tried again, not counted
//! ```
//! The message stays claimed (unacknowledged, its idle time reset) while it is handled and
//! while it waits for a retry, so no other instance takes it; a crash leaves it pending, and
//! whichever instance gets it next (after `claim_idle`, or NATS's `ack_wait`) finds the key's
//! record: a replay if the
//! answer was stored, an unknown outcome (never run twice) if the crash came mid-call.
//!
//! A dead letter the target refuses is tried again with backoff, the message held, while
//! `/readyz` fails ([`health`]).
//!
//! Back pressure: at most `concurrency` messages are held at once; no more are read until one
//! is done. Shutdown stops reading, lets the messages being handled finish (within
//! `server.shutdown_grace`) and leaves those waiting for a retry pending, for the next claim.
//!
//! A consumer's task that ends or panics (or one of whose messages panics: that message is
//! dead-lettered) is started again with backoff ([`supervise`]), once the old task's messages
//! are done, from a new source, so that it reads what the broker still holds; `/readyz` fails
//! until its broker answers again.

mod any;
mod attempt;
mod handler;
mod health;
pub mod kafka;
mod kafka_headers;
mod message;
pub mod nats;
pub mod rabbitmq;
pub mod redis_stream;
pub mod source;
mod spans;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::ConsumerConfig;
use crate::idempotency::Core;
use crate::metrics::{ConsumerMetrics, Metrics};
use crate::store::Store;
use crate::upstream::UpstreamPool;

pub use any::{sources, AnySource};
pub use health::BrokerHealth;
pub use kafka::KafkaTopic;
use message::Consumer;
pub use nats::NatsStream;
pub use rabbitmq::RabbitQueue;
pub use redis_stream::RedisStream;
pub use source::{Message, Source, SourceError};

/// Messages read in one fetch at most (bounded by the free `concurrency` slots too).
const MAX_BATCH: usize = 64;
/// How often the group's pending count is read for the metric.
const PENDING_EVERY: Duration = Duration::from_secs(5);
/// The pause before a stopped consumer task is started again: the first, and the longest.
const RESTART_FIRST: Duration = Duration::from_secs(1);
const RESTART_MAX: Duration = Duration::from_secs(30);
/// A task that ran this long before it stopped starts its backoff afresh.
const RAN_WELL: Duration = Duration::from_secs(60);

/// What a consumer needs of the running gateway.
#[derive(Clone)]
pub struct Context {
    pub core: Arc<Core>,
    pub store: Arc<dyn Store>,
    pub metrics: Arc<Metrics>,
    pub pool: UpstreamPool,
    /// When keys of older derivations are looked up too.
    pub legacy: crate::idempotency::legacy::LegacyWindow,
    /// `[telemetry]`'s spans, when configured: one per attempt at a message.
    pub traces: Option<Arc<crate::telemetry::traces::Traces>>,
}

#[derive(Debug, thiserror::Error)]
#[error("consumer {consumer:?}: {source}")]
pub struct ConsumerError {
    consumer: String,
    source: SourceError,
}

/// One consumer, for as long as the gateway runs: its task (`run`), started again with backoff
/// whenever it ends or panics before `shutdown`, each time on a source from `remake`.
pub async fn supervise<S: Source>(
    config: ConsumerConfig,
    first: S,
    remake: impl Fn(&ConsumerConfig) -> Result<S, ConsumerError>,
    ctx: Context,
    health: Arc<BrokerHealth>,
    shutdown: CancellationToken,
    grace: Duration,
) {
    let name = config.name.clone();
    let metrics = ctx.metrics.consumer(&name);
    let mut source = Some(first);
    let mut stops = 0u32;
    loop {
        let source = match source.take().map_or_else(|| remake(&config), Ok) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(consumer = %name, error = %e, "cannot make the consumer's source again");
                stops = stops.saturating_add(1);
                if !pause(stops, &shutdown).await {
                    return;
                }
                continue;
            }
        };
        health.set_restarting(false);
        let started = Instant::now();
        // This run's own stop and tasks: whatever ends it, the waits of its messages' tasks
        // end too, and the next run starts only once they are all done, so that no two runs
        // hold messages at once (nor two Kafka consumers of this instance sit in the group).
        let stop = shutdown.child_token();
        let tasks = TaskTracker::new();
        let task = tokio::spawn(run(
            config.clone(),
            source,
            ctx.clone(),
            (metrics.clone(), Arc::clone(&health)),
            stop.clone(),
            tasks.clone(),
        ));
        let ended = task.await;
        stop.cancel();
        tasks.close();
        if !shutdown.is_cancelled() {
            health.set_restarting(true);
            // Each ends within its own deadlines: waits for a retry or a dead letter end with
            // `stop`, a handler call within upstream_timeout, a wait on a duplicate within
            // `wait`.
            tokio::select! {
                () = tasks.wait() => {}
                () = shutdown.cancelled() => {}
            }
        }
        if shutdown.is_cancelled() {
            if tokio::time::timeout(grace, tasks.wait()).await.is_err() {
                tracing::warn!(
                    consumer = %name,
                    running = tasks.len(),
                    "grace period over with messages still being handled; they stay pending and are delivered again"
                );
            }
            return;
        }
        metrics.restarted();
        stops = if started.elapsed() >= RAN_WELL {
            1
        } else {
            stops.saturating_add(1)
        };
        let why = match ended {
            Ok(Stopped::MessagePanicked) => "handling a message panicked".to_string(),
            Ok(Stopped::Ended) => "the task ended".to_string(),
            Err(e) if e.is_panic() => format!("it panicked: {}", panic_text(e.into_panic())),
            Err(e) => format!("it was cancelled: {e}"),
        };
        tracing::error!(consumer = %name, %why, "consumer stopped; starting it again");
        if !pause(stops, &shutdown).await {
            return;
        }
    }
}

/// Waits before restart number `stops`; false if shutdown came first.
async fn pause(stops: u32, shutdown: &CancellationToken) -> bool {
    let delay = backoff(stops, RESTART_FIRST, RESTART_MAX, jitter());
    tokio::select! {
        () = tokio::time::sleep(delay) => true,
        () = shutdown.cancelled() => false,
    }
}

fn panic_text(payload: Box<dyn std::any::Any + Send>) -> String {
    match payload.downcast::<String>() {
        Ok(s) => *s,
        Err(payload) => payload
            .downcast_ref::<&str>()
            .map_or_else(|| "(no message)".to_string(), |s| (*s).to_string()),
    }
}

/// Why a consumer's task returned (at shutdown, this says nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stopped {
    /// The read loop ended.
    Ended,
    /// A message's task panicked: the run stops, so that a new source reads that message
    /// again rather than leaving it held (and a Kafka partition's offset frozen behind it).
    MessagePanicked,
}

/// One run of a consumer, until `stop` (shutdown) or a message's panic: reads, and hands each
/// message to a task of its own on `tasks` (at most `concurrency` at once).
async fn run<S: Source>(
    config: ConsumerConfig,
    source: S,
    ctx: Context,
    (metrics, health): (ConsumerMetrics, Arc<BrokerHealth>),
    stop: CancellationToken,
    tasks: TaskTracker,
) -> Stopped {
    let panicked = Arc::new(AtomicBool::new(false));
    let consumer = Arc::new(Consumer {
        config,
        source,
        ctx,
        metrics,
        health: Arc::clone(&health),
        stop: stop.clone(),
    });
    let slots = Arc::new(Semaphore::new(consumer.config.concurrency));
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
            () = stop.cancelled() => break,
        };
        failpoint_read();
        let mut held = vec![first];
        while held.len() < MAX_BATCH {
            match Arc::clone(&slots).try_acquire_owned() {
                Ok(s) => held.push(s),
                Err(_) => break,
            }
        }
        let fetched = tokio::select! {
            f = consumer.source.fetch(held.len()) => f,
            () = stop.cancelled() => break,
        };
        match fetched {
            Ok(messages) => {
                health.set_reachable(true);
                failures = 0;
                for (mut message, slot) in messages.into_iter().zip(held) {
                    let consumer = Arc::clone(&consumer);
                    let (stop, panicked) = (stop.clone(), Arc::clone(&panicked));
                    tasks.spawn(async move {
                        let handled = std::panic::AssertUnwindSafe(consumer.handle(&mut message))
                            .catch_unwind()
                            .await;
                        if handled.is_err() {
                            // Stops reading at once; not ready if this is still the live run.
                            let live = !stop.is_cancelled();
                            panicked.store(true, Ordering::Relaxed);
                            stop.cancel();
                            consumer.panicked(&message, live).await;
                        }
                        drop(slot);
                    });
                }
            }
            Err(e) => {
                health.set_reachable(false);
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
                    () = stop.cancelled() => break,
                }
            }
        }
        if pending_read.elapsed() >= PENDING_EVERY {
            pending_read = Instant::now();
            tokio::select! {
                n = consumer.source.pending() => {
                    if let Ok(n) = n {
                        consumer.metrics.set_pending(n);
                    }
                }
                () = stop.cancelled() => break,
            }
        }
    }
    if panicked.load(Ordering::Relaxed) {
        Stopped::MessagePanicked
    } else {
        Stopped::Ended
    }
}

/// Fault injection for the tests of restarts (`--features failpoints`, then
/// `FAILPOINTS=consumer-read=1*panic`): nothing in other builds.
fn failpoint_read() {
    #[cfg(feature = "failpoints")]
    fail::fail_point!("consumer-read", |_| {});
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

    #[test]
    fn a_panics_text_is_kept_whatever_its_type() {
        assert_eq!(panic_text(Box::new("static")), "static");
        assert_eq!(panic_text(Box::new(String::from("owned"))), "owned");
        assert_eq!(panic_text(Box::new(7u8)), "(no message)");
    }
}
