//! Where a consumer's messages come from: one small trait ([`Source`]) that a broker implements
//! (Redis Streams, [`super::redis_stream`]; NATS JetStream, [`super::nats`]; RabbitMQ,
//! [`super::rabbitmq`]; Kafka, [`super::kafka`]), and the
//! message as the consumer sees it ([`Message`]).

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use http::HeaderMap;

/// One delivery of a message.
#[derive(Debug, Clone)]
pub struct Message {
    /// The broker's id of this entry (a stream entry id): for logs, acknowledgement and the
    /// dead-letter record, never the idempotency key (a producer's retry gets a new one).
    pub id: String,
    /// How often the broker has delivered it, this delivery included (1 the first time).
    pub deliveries: u64,
    /// Which read of the entry this is, for a source that can read one entry twice while the
    /// first read is still being handled (Kafka, when a rebalance gives a partition back):
    /// each read settles its own. 0 for the others.
    pub read: u64,
    /// The handler's request body (a named field, or the payload); `None` when the entry has no
    /// such field (it is dead-lettered).
    pub body: Option<Bytes>,
    /// The entry's other fields (or the message's headers), by name: where `key = { field = ... }`
    /// looks, and what the handler gets as headers.
    pub fields: HeaderMap,
    /// The entry as it came, every field in order, copied whole into a dead-letter record.
    pub raw: Vec<(Bytes, Bytes)>,
    /// Why the message cannot be handled as it came (a header name that is not UTF-8): it is
    /// dead-lettered as `invalid-message` without an attempt.
    pub invalid: Option<String>,
    /// Set by the consumer when the handler answered and the store did not take the answer:
    /// its later attempts never take the key over to call the handler again (whatever
    /// `on_unknown` says), since it is known to have run.
    pub handler_answered: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("the broker cannot be reached: {0}")]
    Unreachable(String),
    #[error("the broker refused: {0}")]
    Refused(String),
    #[error("the message is no longer this consumer's: {0}")]
    Gone(String),
}

/// A broker, as a consumer uses it. Every call is bounded by the source's own deadline.
///
/// Acknowledging is the last step of a message and the only one that tells the broker it is
/// done: a consumer calls [`Source::ack`] only once the message's result is stored (or it is
/// in the dead-letter stream), so a crash at any point before leaves the message pending, to be
/// delivered again.
pub trait Source: Send + Sync + 'static {
    /// Up to `max` messages: entries that another consumer left pending for too long first, then
    /// new ones, waiting a short while (under a second) when there are none.
    fn fetch(&self, max: usize) -> impl Future<Output = Result<Vec<Message>, SourceError>> + Send;

    /// Done with `message`: the broker may forget it.
    fn ack(&self, message: &Message) -> impl Future<Output = Result<(), SourceError>> + Send;

    /// Still working on `message` (a handler that takes long, or a retry that waits): the broker
    /// must not hand it to another consumer meanwhile. Counts as one more delivery when
    /// `redelivery` (a new attempt), not otherwise.
    fn keep(
        &self,
        message: &Message,
        redelivery: bool,
    ) -> impl Future<Output = Result<(), SourceError>> + Send;

    /// Hands `message` back to the broker to be delivered again after `delay`, to any
    /// instance, as one more delivery: true if the broker does that (NATS's `nak` with a delay),
    /// false if it cannot and the caller must wait and try again itself, keeping the message
    /// (a Redis stream has no delayed redelivery).
    fn retry_later(
        &self,
        message: &Message,
        delay: Duration,
    ) -> impl Future<Output = Result<bool, SourceError>> + Send;

    /// Moves `message` to the dead-letter stream with `reason`, and acknowledges it, at once.
    fn dead_letter(
        &self,
        message: &Message,
        reason: &str,
    ) -> impl Future<Output = Result<(), SourceError>> + Send;

    /// Done with `message` without acknowledging it (shutdown, a broker call that failed, a
    /// dead letter not written): forgets what is held for it. RabbitMQ is told to deliver it
    /// again now (`basic.nack` with requeue); the others leave it pending, delivered again once
    /// its claim runs out (Kafka: once its partition is read again from the committed offset).
    fn release(&self, message: &Message) -> impl Future<Output = Result<(), SourceError>> + Send;

    /// Entries read by the group but not acknowledged yet (every consumer's), for the metric.
    fn pending(&self) -> impl Future<Output = Result<u64, SourceError>> + Send;

    /// How long an unacknowledged entry stays with its consumer before another may take it:
    /// [`Source::keep`] must be called more often than this.
    fn claim_after(&self) -> Duration;
}
