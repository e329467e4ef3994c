//! The broker consumers' series ([`crate::consumer`]).
//!
//! - `idemgate_consumer_messages_total{consumer, outcome}`: deliveries by what became of them,
//!   one of the [`ConsumerOutcome`] names.
//! - `idemgate_consumer_handler_duration_seconds{consumer}`: time to the handler's answer.
//! - `idemgate_consumer_pending{consumer}`: messages read and not acknowledged.
//! - `idemgate_consumer_restarts_total{consumer}`: consumer tasks that ended or panicked and
//!   were started again.
//! - `idemgate_consumer_dead_letters_owed{consumer}`: messages whose dead letter the target has
//!   not taken yet (being tried again); `/readyz` fails while one is owed.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::{histograms, registered, HistogramFamily, Metrics};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ConsumerLabel {
    consumer: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ConsumerLabels {
    consumer: String,
    outcome: &'static str,
}

/// What became of one delivery of a broker message (the `outcome` label of
/// `idemgate_consumer_messages_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConsumerOutcome {
    /// The handler ran it, its answer was stored, and the message was acknowledged.
    Delivered,
    /// A duplicate (a producer's retry, a redelivery): the stored answer stood for it, and it
    /// was acknowledged without reaching the handler.
    Deduplicated,
    /// The handler failed (or could not be reached, or the store): to be tried again.
    Retried,
    /// Moved to the dead-letter stream with its reason, then acknowledged.
    DeadLettered,
    /// The handler answered but the store refused the answer: not acknowledged; the next
    /// attempt finds the key's record (an unknown outcome once its lease runs out).
    NotStored,
}

impl ConsumerOutcome {
    const ALL: [ConsumerOutcome; 5] = [
        ConsumerOutcome::Delivered,
        ConsumerOutcome::Deduplicated,
        ConsumerOutcome::Retried,
        ConsumerOutcome::DeadLettered,
        ConsumerOutcome::NotStored,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ConsumerOutcome::Delivered => "delivered",
            ConsumerOutcome::Deduplicated => "deduplicated",
            ConsumerOutcome::Retried => "retried",
            ConsumerOutcome::DeadLettered => "dead_lettered",
            ConsumerOutcome::NotStored => "not_stored",
        }
    }
}

/// One consumer's series, made once when it starts.
#[derive(Clone)]
pub struct ConsumerMetrics {
    messages: [Counter; ConsumerOutcome::ALL.len()],
    handler: Histogram,
    pending: Gauge,
    restarts: Counter,
    dead_letters_owed: Gauge,
}

impl ConsumerMetrics {
    pub fn count(&self, outcome: ConsumerOutcome) {
        self.messages[outcome as usize].inc();
    }

    pub fn handler(&self, took: Duration) {
        self.handler.observe(took.as_secs_f64());
    }

    /// Entries read but not acknowledged yet, in the whole group (every instance's).
    pub fn set_pending(&self, pending: u64) {
        self.pending.set(i64::try_from(pending).unwrap_or(i64::MAX));
    }

    /// The consumer's task ended or panicked, and is started again.
    pub fn restarted(&self) {
        self.restarts.inc();
    }

    /// One more (`owed`) or one fewer dead letter waiting for its target.
    pub fn dead_letter_owed(&self, owed: bool) {
        if owed {
            self.dead_letters_owed.inc();
        } else {
            self.dead_letters_owed.dec();
        }
    }
}

/// The consumers' families, registered once.
pub(super) struct ConsumerFamilies {
    messages: Family<ConsumerLabels, Counter>,
    handler: HistogramFamily<ConsumerLabel>,
    pending: Family<ConsumerLabel, Gauge>,
    restarts: Family<ConsumerLabel, Counter>,
    dead_letters_owed: Family<ConsumerLabel, Gauge>,
}

impl ConsumerFamilies {
    pub(super) fn new(r: &mut Registry) -> Self {
        ConsumerFamilies {
            messages: registered(
                r,
                "consumer_messages",
                "Broker messages by consumer and outcome (delivered, deduplicated, retried, dead_lettered, not_stored)",
            ),
            handler: histograms(
                r,
                "consumer_handler_duration_seconds",
                "Time to the handler's complete answer, per consumer",
            ),
            pending: registered(
                r,
                "consumer_pending",
                "Messages read and not acknowledged (and, for NATS, RabbitMQ and Kafka, those waiting to be delivered)",
            ),
            restarts: registered(
                r,
                "consumer_restarts",
                "Consumer tasks that ended or panicked and were started again",
            ),
            dead_letters_owed: registered(
                r,
                "consumer_dead_letters_owed",
                "Messages whose dead letter the dead-letter target has not taken yet (tried again with backoff; /readyz fails meanwhile)",
            ),
        }
    }
}

impl Metrics {
    /// The series of one consumer, created (at zero) now.
    pub fn consumer(&self, consumer: &str) -> ConsumerMetrics {
        let families = &self.consumers;
        let label = ConsumerLabel {
            consumer: consumer.to_string(),
        };
        ConsumerMetrics {
            messages: ConsumerOutcome::ALL.map(|outcome| {
                (families.messages)
                    .get_or_create(&ConsumerLabels {
                        consumer: consumer.to_string(),
                        outcome: outcome.as_str(),
                    })
                    .clone()
            }),
            handler: families.handler.get_or_create(&label).clone(),
            pending: families.pending.get_or_create(&label).clone(),
            restarts: families.restarts.get_or_create(&label).clone(),
            dead_letters_owed: families.dead_letters_owed.get_or_create(&label).clone(),
        }
    }
}
