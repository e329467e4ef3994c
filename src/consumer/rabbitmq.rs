//! A RabbitMQ queue (`lapin`): one channel consumes with manual acknowledgement and a prefetch
//! of the consumer's `concurrency`, so the broker never hands this instance more than it
//! handles; a message is acknowledged (`basic.ack`) only once its result is stored; a second
//! channel, in confirm mode, publishes dead letters to the dead-letter queue, and the original is
//! acknowledged only once the broker has confirmed the copy.
//!
//! - Unacknowledged messages stay with this connection as long as it lives, so there is nothing
//!   to renew while one is handled ([`Source::keep`] does nothing); RabbitMQ closes a channel
//!   whose delivery stays unacknowledged past its `consumer_timeout` (30 minutes by default),
//!   and its messages are delivered again.
//! - Retries wait here, the message held (RabbitMQ has no delayed redelivery), and are counted
//!   here; what counts across a crash is the broker's count: a quorum queue's
//!   `x-delivery-count` header (deliveries before this one), else `redelivered` (at least one).
//! - A lost connection: the next fetch connects again. The broker returns what was unacknowledged
//!   to the queue, and acknowledgements of messages from the old connection fail: they are
//!   delivered again and find their stored result (a replay), never a second execution.
//! - `amqps://` is verified against the system's roots and, when set, the CAs of
//!   `tls_ca_file`.
//! - The gateway declares nothing: the queue and the dead-letter queue must exist (a passive
//!   declare checks both at connect, and says which is missing).
//! - A message whose `message_id`, `correlation_id`, `type` or a header name is not UTF-8:
//!   RabbitMQ takes and delivers it as it came, and lapin fails the whole connection on it
//!   without telling which message it was. It comes back at each reconnection until a quorum
//!   queue's `x-delivery-limit` dead-letters it (by `x-dead-letter-exchange`); the consumer is
//!   unready meanwhile. Declare the queue so.
//! - A dead letter the dead-letter queue refuses (full, with `x-overflow = reject-publish`;
//!   unconfirmed) is tried again by the consumer, the original held (see
//!   `consumer::message`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http::{HeaderMap, HeaderName, HeaderValue};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::tcp::OwnedTLSConfig;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, Consumer};
use tokio::sync::Mutex as AsyncMutex;

use super::redis_stream::passed_on;
use super::source::{Message, Source, SourceError};
use crate::config::RabbitSource;

/// How long one fetch waits for a first message.
const WAIT: Duration = Duration::from_millis(1000);
/// Every broker call at most (connecting, publishing and its confirmation, acknowledging).
const TIMEOUT: Duration = Duration::from_secs(5);

struct Connected {
    /// Told apart from earlier connections in message ids: an id of another one cannot be
    /// acknowledged any more.
    generation: u64,
    connection: Connection,
    consuming: Channel,
    /// In confirm mode: dead letters.
    publishing: Channel,
    deliveries: AsyncMutex<Consumer>,
}

impl Connected {
    /// Whether every part of it still works: the connection and both channels.
    fn alive(&self) -> bool {
        self.connection.status().connected()
            && self.consuming.status().connected()
            && self.publishing.status().connected()
    }

    /// Closes the connection (within [`TIMEOUT`]; one already closed is left as it is): the
    /// broker gives back every message it held unacknowledged.
    async fn close(&self, why: &str) {
        let reason = ShortString::from(why);
        let _ = tokio::time::timeout(TIMEOUT, self.connection.close(320, reason)).await;
    }
}

/// What acknowledging or dead-lettering a message needs.
struct Held {
    connected: Arc<Connected>,
    tag: u64,
    properties: BasicProperties,
}

pub struct RabbitQueue {
    source: RabbitSource,
    /// The prefetch: the consumer's `concurrency`.
    prefetch: u16,
    connected: AsyncMutex<Option<Arc<Connected>>>,
    generations: std::sync::atomic::AtomicU64,
    held: Mutex<HashMap<String, Held>>,
}

impl RabbitQueue {
    pub fn new(source: RabbitSource, concurrency: usize) -> Self {
        RabbitQueue {
            source,
            prefetch: u16::try_from(concurrency.max(1)).unwrap_or(u16::MAX),
            connected: AsyncMutex::new(None),
            generations: std::sync::atomic::AtomicU64::new(0),
            held: Mutex::new(HashMap::new()),
        }
    }

    pub fn queue(&self) -> &str {
        &self.source.queue
    }

    /// The connection, made if there is none or the last one broke.
    async fn connected(&self) -> Result<Arc<Connected>, SourceError> {
        let mut slot = self.connected.lock().await;
        if let Some(c) = slot.take() {
            if c.alive() {
                *slot = Some(Arc::clone(&c));
                return Ok(c);
            }
            // What is left of it (a channel that closed on a live connection) goes, so that the
            // broker gives back what it holds.
            c.close("idemgate: reconnecting").await;
        }
        let c = Arc::new(
            tokio::time::timeout(TIMEOUT, self.connect())
                .await
                .map_err(|_| {
                    SourceError::Unreachable(format!("no connection within {TIMEOUT:?}"))
                })??,
        );
        // Messages of an earlier connection can no longer be acknowledged (the broker gave them
        // back): forget them, and let that connection go.
        if let Ok(mut held) = self.held.lock() {
            held.retain(|_, h| h.connected.generation == c.generation);
        }
        *slot = Some(Arc::clone(&c));
        Ok(c)
    }

    async fn connect(&self) -> Result<Connected, SourceError> {
        let ca = match &self.source.tls_ca_file {
            Some(path) => Some(tokio::fs::read_to_string(path).await.map_err(|e| {
                SourceError::Refused(format!("tls_ca_file {}: {e}", path.display()))
            })?),
            None => None,
        };
        let tls = OwnedTLSConfig {
            identity: None,
            cert_chain: ca,
        };
        let runtime = lapin::runtime::default_runtime().map_err(unreachable)?;
        let props = ConnectionProperties::default();
        let connection = Connection::connect_with_config(&self.source.url, props, tls, runtime)
            .await
            .map_err(unreachable)?;
        let consuming = connection.create_channel().await.map_err(unreachable)?;
        let publishing = connection.create_channel().await.map_err(unreachable)?;
        for queue in [&self.source.queue, &self.source.dead_letter] {
            declared(&consuming, queue).await.map_err(|e| {
                SourceError::Refused(format!(
                    "queue {queue:?}: {e} (the gateway declares no queue: declare it durable first)"
                ))
            })?;
        }
        publishing
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(unreachable)?;
        consuming
            .basic_qos(self.prefetch, BasicQosOptions::default())
            .await
            .map_err(unreachable)?;
        let deliveries = consuming
            .basic_consume(
                self.source.queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(unreachable)?;
        let generation = 1 + self
            .generations
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Connected {
            generation,
            connection,
            consuming,
            publishing,
            deliveries: AsyncMutex::new(deliveries),
        })
    }

    /// Forgets the connection, so that the next fetch connects again.
    async fn reset(&self) {
        *self.connected.lock().await = None;
    }

    /// A connection a call on a message failed on (an ack or nack without an answer, a dead
    /// channel): closed, so that the broker gives back every message it holds unacknowledged
    /// rather than keeping them, and their prefetch slots, until `consumer_timeout`; the next
    /// fetch connects anew.
    async fn broken(&self, connected: &Connected) {
        {
            let mut slot = self.connected.lock().await;
            if slot
                .as_ref()
                .is_some_and(|c| c.generation == connected.generation)
            {
                *slot = None;
            }
        }
        connected
            .close("idemgate: a call on a message failed")
            .await;
    }

    fn take(&self, id: &str) -> Option<Held> {
        self.held.lock().ok()?.remove(id)
    }

    fn message(&self, connected: &Arc<Connected>, d: lapin::message::Delivery) -> Message {
        let id = format!("{}-{}", connected.generation, d.delivery_tag);
        let (fields, raw) = fields_of(&d.properties);
        let message = Message {
            id: id.clone(),
            deliveries: deliveries(&d.properties, d.redelivered),
            read: 0,
            body: Some(Bytes::from(d.data)),
            fields,
            raw,
            invalid: None,
            handler_answered: false,
        };
        if let Ok(mut held) = self.held.lock() {
            held.insert(
                id,
                Held {
                    connected: Arc::clone(connected),
                    tag: d.delivery_tag,
                    properties: d.properties,
                },
            );
        }
        message
    }
}

/// The queue `name`, if it exists (a passive declare: nothing is created).
async fn declared(channel: &Channel, name: &str) -> Result<u32, lapin::Error> {
    let options = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let queue = channel
        .queue_declare(name.into(), options, FieldTable::default())
        .await?;
    Ok(queue.message_count())
}

/// Deliveries so far, this one included: a quorum queue's count of the earlier ones if it
/// gives one, else at least 2 for a redelivery.
fn deliveries(properties: &BasicProperties, redelivered: bool) -> u64 {
    let counted = properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get("x-delivery-count").and_then(integer));
    match counted {
        Some(n) => u64::try_from(n).unwrap_or(0) + 1,
        None if redelivered => 2,
        None => 1,
    }
}

fn integer(v: &AMQPValue) -> Option<i64> {
    Some(match v {
        AMQPValue::ShortShortInt(n) => i64::from(*n),
        AMQPValue::ShortShortUInt(n) => i64::from(*n),
        AMQPValue::ShortInt(n) => i64::from(*n),
        AMQPValue::ShortUInt(n) => i64::from(*n),
        AMQPValue::LongInt(n) => i64::from(*n),
        AMQPValue::LongUInt(n) => i64::from(*n),
        AMQPValue::LongLongInt(n) => *n,
        _ => return None,
    })
}

/// A header's value as text, for the handler's headers and the key (numbers by value).
fn text(v: &AMQPValue) -> Option<String> {
    match v {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        AMQPValue::Boolean(b) => Some(b.to_string()),
        other => integer(other).map(|n| n.to_string()),
    }
}

/// The message's headers, and `message-id`, `correlation-id` and `type` from its properties,
/// as the consumer sees fields (what `key = { field = ... }` names); and the same as pairs, for
/// the dead letter.
fn fields_of(properties: &BasicProperties) -> (HeaderMap, Vec<(Bytes, Bytes)>) {
    let mut pairs: Vec<(String, String)> = Vec::new();
    for (name, value) in [
        ("message-id", properties.message_id()),
        ("correlation-id", properties.correlation_id()),
        ("type", properties.kind()),
    ] {
        if let Some(v) = value {
            pairs.push((name.to_owned(), v.as_str().to_owned()));
        }
    }
    if let Some(headers) = properties.headers() {
        for (name, value) in headers.inner() {
            if let Some(v) = text(value) {
                pairs.push((name.as_str().to_owned(), v));
            }
        }
    }
    let mut fields = HeaderMap::new();
    for (n, v) in &pairs {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(n.to_ascii_lowercase().as_bytes()),
            HeaderValue::from_str(v),
        ) {
            if passed_on(&n, v.len(), fields.len()) {
                fields.append(n, v);
            }
        }
    }
    let raw = pairs
        .into_iter()
        .map(|(n, v)| (Bytes::from(n), Bytes::from(v)))
        .collect();
    (fields, raw)
}

/// The broker sent a frame lapin cannot parse, most likely a message whose `message_id`,
/// `correlation_id`, `type` or header name is not UTF-8 (RabbitMQ passes such bytes on; lapin
/// holds them as `String`s and fails the whole connection, before the consumer sees which
/// message it was). The broker gives the message back and delivers it again; only a quorum
/// queue's `x-delivery-limit` ends that, dead-lettering it through the queue's
/// `x-dead-letter-exchange` (README, "RabbitMQ").
fn unparsable(e: &lapin::Error) -> SourceError {
    SourceError::Refused(format!(
        "a message the AMQP client cannot read ({e}): a property or header name that is not \
         UTF-8? RabbitMQ delivers it again until the queue's x-delivery-limit dead-letters it"
    ))
}

fn unreachable(e: impl std::fmt::Display) -> SourceError {
    SourceError::Unreachable(e.to_string())
}

/// `call` within [`TIMEOUT`].
async fn bounded<T>(
    call: impl std::future::Future<Output = Result<T, lapin::Error>>,
) -> Result<T, SourceError> {
    tokio::time::timeout(TIMEOUT, call)
        .await
        .map_err(|_| SourceError::Unreachable(format!("no answer within {TIMEOUT:?}")))?
        .map_err(unreachable)
}

impl Source for RabbitQueue {
    async fn fetch(&self, max: usize) -> Result<Vec<Message>, SourceError> {
        let connected = self.connected().await?;
        let mut deliveries = connected.deliveries.lock().await;
        let mut out = Vec::new();
        // The first may take a while; those the broker already sent are taken at once.
        let first = match tokio::time::timeout(WAIT, deliveries.next()).await {
            Err(_) => return Ok(out),
            Ok(Some(Ok(d))) => d,
            ended => {
                drop(deliveries);
                self.reset().await;
                return Err(match ended {
                    Ok(Some(Err(e))) if matches!(e.kind(), lapin::ErrorKind::ParsingError(_)) => {
                        unparsable(&e)
                    }
                    Ok(Some(Err(e))) => unreachable(e),
                    _ => SourceError::Unreachable("the broker cancelled the consumer".into()),
                });
            }
        };
        out.push(self.message(&connected, first));
        while out.len() < max {
            match futures_util::FutureExt::now_or_never(deliveries.next()) {
                Some(Some(Ok(d))) => out.push(self.message(&connected, d)),
                _ => break,
            }
        }
        Ok(out)
    }

    async fn ack(&self, message: &Message) -> Result<(), SourceError> {
        let Some(held) = self.take(&message.id) else {
            return Ok(());
        };
        let channel = &held.connected.consuming;
        let acked = bounded(channel.basic_ack(held.tag, BasicAckOptions::default())).await;
        if acked.is_err() {
            self.broken(&held.connected).await;
        }
        acked
    }

    async fn keep(&self, _message: &Message, _redelivery: bool) -> Result<(), SourceError> {
        // Unacknowledged, it stays with this connection; retries are counted by the caller.
        Ok(())
    }

    async fn retry_later(&self, _message: &Message, _delay: Duration) -> Result<bool, SourceError> {
        // No delayed redelivery: the caller waits, holding the message.
        Ok(false)
    }

    async fn dead_letter(&self, message: &Message, reason: &str) -> Result<(), SourceError> {
        let Some(held) = self.held.lock().ok().and_then(|h| {
            h.get(&message.id)
                .map(|held| (Arc::clone(&held.connected), held.properties.clone()))
        }) else {
            return Err(SourceError::Gone(
                "its connection is gone; the broker delivers it again".into(),
            ));
        };
        let (connected, properties) = held;
        if !connected.alive() {
            // Never published on a dead channel for ever: the connection goes, and the broker
            // gives its messages back.
            self.take(&message.id);
            self.broken(&connected).await;
            return Err(SourceError::Gone(
                "its connection or a channel of it closed; the broker delivers it again".into(),
            ));
        }
        let mut headers = properties.headers().clone().unwrap_or_default();
        for (name, value) in [
            ("idemgate-reason", reason.to_owned()),
            ("idemgate-queue", self.source.queue.clone()),
            ("idemgate-deliveries", message.deliveries.to_string()),
        ] {
            headers.insert(
                ShortString::from(name),
                AMQPValue::LongString(LongString::from(value)),
            );
        }
        let properties = properties.with_headers(headers);
        let body = message.body.clone().unwrap_or_default();
        let confirm = bounded(async {
            connected
                .publishing
                .basic_publish(
                    "".into(),
                    self.source.dead_letter.as_str().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    &body,
                    properties,
                )
                .await?
                .await
        })
        .await?;
        match confirm {
            // Written: not written again now, whatever becomes of the acknowledgement.
            Confirmation::Ack(None) => self.ack(message).await.map_err(|e| {
                SourceError::Gone(format!(
                    "its dead letter is written, its acknowledgement failed: {e}"
                ))
            }),
            Confirmation::Ack(Some(_)) => Err(SourceError::Refused(format!(
                "the dead-letter queue {:?} did not take the message (returned)",
                self.source.dead_letter
            ))),
            other => Err(SourceError::Refused(format!(
                "the broker did not confirm the dead letter: {other:?}"
            ))),
        }
    }

    async fn release(&self, message: &Message) -> Result<(), SourceError> {
        let Some(held) = self.take(&message.id) else {
            return Ok(());
        };
        // Given back to the queue now rather than left unacknowledged, holding a prefetch slot
        // for as long as the connection lives.
        let options = BasicNackOptions {
            multiple: false,
            requeue: true,
        };
        let nacked = bounded(held.connected.consuming.basic_nack(held.tag, options)).await;
        if nacked.is_err() {
            self.broken(&held.connected).await;
        }
        nacked
    }

    async fn pending(&self) -> Result<u64, SourceError> {
        let connected = self.connected().await?;
        let ready = bounded(declared(&connected.consuming, &self.source.queue)).await?;
        let held = self.held.lock().map(|h| h.len()).unwrap_or(0);
        Ok(u64::from(ready) + held as u64)
    }

    fn claim_after(&self) -> Duration {
        // Nothing to renew: see the module doc.
        Duration::from_secs(3600)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deliveries_count_the_brokers_earlier_ones() {
        let plain = BasicProperties::default();
        assert_eq!(deliveries(&plain, false), 1);
        assert_eq!(deliveries(&plain, true), 2);
        let mut headers = FieldTable::default();
        headers.insert("x-delivery-count".into(), AMQPValue::LongLongInt(4));
        let quorum = BasicProperties::default().with_headers(headers);
        assert_eq!(deliveries(&quorum, true), 5);
    }

    #[test]
    fn properties_and_headers_become_fields() {
        let mut headers = FieldTable::default();
        headers.insert(
            "Order-Id".into(),
            AMQPValue::LongString(LongString::from("o-1")),
        );
        headers.insert("attempt".into(), AMQPValue::LongInt(3));
        let properties = BasicProperties::default()
            .with_message_id("m-1".into())
            .with_headers(headers);
        let (fields, raw) = fields_of(&properties);
        assert_eq!(fields["message-id"], "m-1");
        assert_eq!(fields["order-id"], "o-1");
        assert_eq!(fields["attempt"], "3");
        assert_eq!(raw.len(), 3);
    }
}
