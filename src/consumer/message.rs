//! A message's life in a consumer, from its fetch to its end: attempts ([`super::attempt`]),
//! retries with backoff (the message kept claimed meanwhile), the acknowledgement, the dead
//! letter (tried again while its target refuses), or its release back to the broker.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::attempt::Verdict;
use super::health::Owed;
use super::{backoff, jitter, BrokerHealth, Context, Message, Source, SourceError};
use crate::config::ConsumerConfig;
use crate::metrics::{ConsumerMetrics, ConsumerOutcome};

/// The pauses between tries of a dead letter its target refuses: the first, and the longest.
const DEAD_LETTER_FIRST: Duration = Duration::from_secs(1);
const DEAD_LETTER_MAX: Duration = Duration::from_secs(30);

/// One run of a consumer, shared by its messages' tasks.
pub(super) struct Consumer<S> {
    pub(super) config: ConsumerConfig,
    pub(super) source: S,
    pub(super) ctx: Context,
    pub(super) metrics: ConsumerMetrics,
    pub(super) health: Arc<BrokerHealth>,
    /// Cancelled at shutdown or when this run stops: waits end, messages are released.
    pub(super) stop: CancellationToken,
}

/// How a message's handling ended.
enum End {
    /// Acknowledged (its result stored) or dead-lettered, or handed back to the broker for a
    /// delayed retry: nothing of it is held here any more.
    Done,
    /// Not finished (shutdown, a broker call that failed, a dead letter not taken): released,
    /// to be delivered again.
    Left,
}

impl<S: Source> Consumer<S> {
    /// Handles `message` to its end; one not finished is released to the broker.
    pub(super) async fn handle(&self, message: &mut Message) {
        #[cfg(feature = "failpoints")]
        fail::fail_point!("consumer-handle", |_| {});
        if let End::Left = self.settle(message).await {
            if let Err(e) = self.source.release(message).await {
                tracing::warn!(consumer = %self.config.name, id = %message.id, error = %e, "cannot give the message back; it is delivered again once its claim runs out");
            }
        }
    }

    async fn settle(&self, message: &mut Message) -> End {
        let name = &self.config.name;
        loop {
            let (reason, counted) = match self.attempt(message).await {
                Verdict::Ack(outcome) => {
                    self.metrics.count(outcome);
                    // A lost acknowledgement only means one more delivery, which replays.
                    return match self.source.ack(message).await {
                        Ok(()) => End::Done,
                        Err(e) => {
                            tracing::warn!(consumer = %name, id = %message.id, error = %e, "acknowledgement failed; the message will be delivered again");
                            End::Left
                        }
                    };
                }
                Verdict::DeadLetter(reason) => return self.dead_letter(message, &reason).await,
                Verdict::NotStored => {
                    self.metrics.count(ConsumerOutcome::NotStored);
                    message.handler_answered = true;
                    tracing::warn!(consumer = %name, id = %message.id, "the store did not take the handler's answer; the message is not acknowledged, and its next attempt finds the key's record");
                    ("the store did not take the answer".to_string(), false)
                }
                Verdict::Retry { reason, counted } => {
                    if counted && message.deliveries >= self.config.max_attempts {
                        let reason = format!(
                            "failed: {reason} (gave up after {} attempts)",
                            message.deliveries
                        );
                        return self.dead_letter(message, &reason).await;
                    }
                    self.metrics.count(ConsumerOutcome::Retried);
                    (reason, counted)
                }
            };
            let delay = backoff(
                u32::try_from(message.deliveries).unwrap_or(u32::MAX),
                self.config.backoff,
                self.config.max_backoff,
                jitter(),
            );
            tracing::info!(consumer = %name, id = %message.id, %reason, ?delay, "message not done; trying again");
            if counted {
                match self.source.retry_later(message, delay).await {
                    // The broker delivers it again, as one more delivery.
                    Ok(true) => return End::Done,
                    Ok(false) => {}
                    Err(e) => {
                        tracing::warn!(consumer = %name, id = %message.id, error = %e, "cannot hand the message back; it is delivered again after its claim runs out");
                        return End::Left;
                    }
                }
            }
            if !self.wait_claimed(message, delay).await {
                // Stopping: left pending, for whichever instance claims it next.
                return End::Left;
            }
            if counted {
                if let Err(e) = self.source.keep(message, true).await {
                    tracing::warn!(consumer = %name, id = %message.id, error = %e, "cannot count the attempt; leaving the message pending");
                    return End::Left;
                }
                message.deliveries += 1;
            }
        }
    }

    /// Moves `message` to the dead-letter target. While the target refuses, the message is
    /// owed (`/readyz` fails) and tried again with backoff, held and kept claimed: nothing
    /// else takes it, and it is not lost. (Handing it back to the broker instead would not
    /// free a RabbitMQ prefetch slot, the queue sending it straight back, and would count a
    /// delivery against a quorum queue's `x-delivery-limit`, whose own dead-lettering would
    /// drop it when the target refuses.)
    async fn dead_letter(&self, message: &Message, reason: &str) -> End {
        let name = &self.config.name;
        let mut owed = None;
        let mut refusals = 0u32;
        loop {
            let refused = match self.source.dead_letter(message, reason).await {
                Ok(()) => {
                    tracing::warn!(consumer = %name, id = %message.id, %reason, "message moved to the dead-letter target");
                    self.metrics.count(ConsumerOutcome::DeadLettered);
                    return End::Done;
                }
                Err(SourceError::Gone(why)) => {
                    tracing::warn!(consumer = %name, id = %message.id, %why, "the message is no longer this consumer's; it is delivered again");
                    return End::Left;
                }
                Err(e) => e,
            };
            owed.get_or_insert_with(|| Owed::new(&self.health, &self.metrics));
            refusals = refusals.saturating_add(1);
            let pause = backoff(refusals, DEAD_LETTER_FIRST, DEAD_LETTER_MAX, jitter());
            tracing::error!(consumer = %name, id = %message.id, error = %refused, ?pause, "the dead-letter target did not take the message; trying again");
            if !self.wait_claimed(message, pause).await {
                return End::Left;
            }
        }
    }

    /// Sleeps `delay` while keeping the message claimed; false if this run stops first.
    async fn wait_claimed(&self, message: &Message, delay: Duration) -> bool {
        let until = Instant::now() + delay;
        let every = self.keep_every();
        loop {
            let next = (Instant::now() + every).min(until);
            tokio::select! {
                () = tokio::time::sleep_until(next) => {}
                () = self.stop.cancelled() => return false,
            }
            if Instant::now() >= until {
                return true;
            }
            let _ = self.source.keep(message, false).await;
        }
    }

    /// How often a held message's claim is renewed: well within the broker's deadline.
    pub(super) fn keep_every(&self) -> Duration {
        (self.source.claim_after() / 3).max(Duration::from_millis(10))
    }
}

impl<S: Source> Consumer<S> {
    /// Handling `message` panicked (a bug), and its run stops (its state may be broken): the
    /// message is dead-lettered if the source still can, so that it cannot stop the consumer
    /// again at its next read; not ready from now if this was the `live` run.
    pub(super) async fn panicked(&self, message: &Message, live: bool) {
        let name = &self.config.name;
        if live {
            self.health.set_restarting(true);
        }
        tracing::error!(consumer = %name, id = %message.id, "handling the message panicked; the consumer starts again");
        let reason = "panicked: handling the message panicked (a bug in the gateway); the handler may have run: the key's record says";
        match self.source.dead_letter(message, reason).await {
            Ok(()) => {
                tracing::warn!(consumer = %name, id = %message.id, %reason, "message moved to the dead-letter target");
                self.metrics.count(ConsumerOutcome::DeadLettered);
            }
            Err(e) => {
                tracing::error!(consumer = %name, id = %message.id, error = %e, "cannot dead-letter the message that panicked; it is read again");
            }
        }
    }
}
