//! A Kafka topic (`rdkafka`, over librdkafka): a consumer group that every instance joins. Kafka
//! has no acknowledgement per message, only an offset per partition meaning "everything before
//! it is done"; the consumer handles up to `concurrency` messages at once, of any partition, and
//! moves a partition's offset only past the messages that are finished (their result stored, or
//! dead-lettered): [`Offsets`] keeps, per partition, the offsets read and not finished, and the
//! offset stored for the next commit is the lowest of them (or one past the last read when none
//! is left). librdkafka commits the stored offsets every `auto.commit.interval.ms` (1 s here),
//! when a partition is revoked and when the consumer closes.
//!
//! - A crash redelivers what was not committed: at most the unfinished messages and the last
//!   second's finished ones. Their keys' records make that safe: a replay, or an unknown outcome
//!   that is never run again.
//! - Rebalances: when a partition is revoked, its finished offsets are committed as the revoke
//!   goes through, and what is still being handled goes on; its result is stored, but its offset
//!   is no longer this instance's to move: the partition's new owner reads it again and finds the
//!   result stored (a replay) or still being written (it waits, as a duplicate does).
//! - Retries wait here, the message held (Kafka has no redelivery of one message), and are
//!   counted here: a restart counts again from 1.
//! - Dead letters are produced to the dead-letter topic (`acks=all`), with the original key,
//!   value and headers and `idemgate-*` headers, before the offset moves past the original. One
//!   the topic does not take is tried again by the consumer, holding the message (and so the
//!   partition's committed offset) while `/readyz` fails and
//!   `idemgate_consumer_dead_letters_owed` says so: never frozen silently.
//! - The gateway creates no topic: both must exist (checked with a metadata request, which is
//!   also how readiness knows the brokers answer while the topic is idle).

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use http::{HeaderMap, HeaderName, HeaderValue};
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, ClientContext, Message as _, Offset, TopicPartitionList};
use tokio::time::Instant;

use super::kafka_headers;
use super::redis_stream::passed_on;
use super::source::{Message, Source, SourceError};
use crate::config::KafkaSource;

/// How long one fetch waits for a first message.
const WAIT: Duration = Duration::from_millis(1000);
/// Producing a dead letter, a metadata request, reading watermarks: each at most this long.
const TIMEOUT: Duration = Duration::from_secs(5);
/// While nothing arrives, how often the brokers are asked whether the topics exist.
const CHECK_EVERY: Duration = Duration::from_secs(5);
/// The field that holds the message's Kafka key (`key = { field = "kafka-key" }`).
pub const KEY_FIELD: &str = "kafka-key";

pub struct KafkaTopic {
    source: KafkaSource,
    consumer: Arc<StreamConsumer<Rebalances>>,
    producer: FutureProducer,
    offsets: Arc<Mutex<Offsets>>,
    /// By read (unique per source): two reads of one offset each settle their own.
    held: Mutex<HashMap<u64, Held>>,
    /// Reads so far: what tells two reads of one offset apart.
    reads: AtomicU64,
    /// When the brokers last answered (a message, or the topics' metadata).
    answered: Mutex<Option<Instant>>,
}

/// What finishing or dead-lettering a message needs besides the [`Message`].
struct Held {
    partition: i32,
    offset: i64,
    /// The assignment of the partition it was read under.
    epoch: u64,
    key: Option<Vec<u8>>,
}

impl KafkaTopic {
    /// The consumer (subscribed, not connected yet) and the dead letters' producer; fails on a
    /// setting librdkafka refuses.
    pub fn new(source: KafkaSource) -> Result<Self, SourceError> {
        let offsets = Arc::new(Mutex::new(Offsets::default()));
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", source.brokers.join(","))
            .set("client.id", "idemgate")
            .set("group.id", &source.group)
            // librdkafka commits what `ack` stores, never what was merely read.
            .set("enable.auto.commit", "true")
            .set("enable.auto.offset.store", "false")
            .set("auto.commit.interval.ms", "1000")
            // A new group starts at the oldest message: none is skipped.
            .set("auto.offset.reset", "earliest");
        for (name, value) in &source.options {
            config.set(name, value);
        }
        let context = Rebalances {
            topic: source.topic.clone(),
            offsets: Arc::clone(&offsets),
        };
        let consumer: StreamConsumer<Rebalances> = config
            .create_with_context(context)
            .map_err(|e| refused_setting("consumer", &e))?;
        consumer
            .subscribe(&[&source.topic])
            .map_err(|e| SourceError::Refused(e.to_string()))?;
        let mut producing = ClientConfig::new();
        producing
            .set("bootstrap.servers", source.brokers.join(","))
            .set("client.id", "idemgate-dead-letters")
            .set("acks", "all")
            .set("message.timeout.ms", TIMEOUT.as_millis().to_string());
        for (name, value) in source.options.iter().filter(|(n, _)| !consumer_only(n)) {
            producing.set(name, value);
        }
        let producer = producing
            .create()
            .map_err(|e| refused_setting("dead letters' producer", &e))?;
        Ok(KafkaTopic {
            source,
            consumer: Arc::new(consumer),
            producer,
            offsets,
            held: Mutex::new(HashMap::new()),
            reads: AtomicU64::new(0),
            answered: Mutex::new(None),
        })
    }

    pub fn topic(&self) -> &str {
        &self.source.topic
    }

    pub fn group(&self) -> &str {
        &self.source.group
    }

    fn answered_now(&self) {
        if let Ok(mut a) = self.answered.lock() {
            *a = Some(Instant::now());
        }
    }

    /// Asks the brokers for both topics, unless they answered lately.
    async fn check(&self) -> Result<(), SourceError> {
        let fresh = self
            .answered
            .lock()
            .ok()
            .and_then(|a| *a)
            .is_some_and(|at| at.elapsed() < CHECK_EVERY);
        if fresh {
            return Ok(());
        }
        let consumer = Arc::clone(&self.consumer);
        let topics = [self.source.topic.clone(), self.source.dead_letter.clone()];
        // librdkafka's metadata call blocks its thread.
        tokio::task::spawn_blocking(move || {
            topics.iter().try_for_each(|topic| exists(&consumer, topic))
        })
        .await
        .map_err(unreachable)??;
        self.answered_now();
        Ok(())
    }

    fn message(&self, m: &BorrowedMessage<'_>) -> Message {
        let (partition, offset) = (m.partition(), m.offset());
        let epoch = self
            .offsets
            .lock()
            .map(|mut o| o.read(partition, offset))
            .unwrap_or(0);
        // A partition given back to this instance is read again while the old read's task may
        // still hold the message: each read settles its own.
        let read = self.reads.fetch_add(1, Ordering::Relaxed);
        let id = format!("{}/{partition}@{offset}", self.source.topic);
        let (fields, raw, invalid) = fields_of(m);
        let message = Message {
            id,
            read,
            // Kafka counts no deliveries: retries are counted here, from 1 at each read.
            deliveries: 1,
            body: Some(Bytes::copy_from_slice(m.payload().unwrap_or_default())),
            fields,
            raw,
            invalid,
            handler_answered: false,
        };
        if let Ok(mut held) = self.held.lock() {
            held.insert(
                read,
                Held {
                    partition,
                    offset,
                    epoch,
                    key: m.key().map(<[u8]>::to_vec),
                },
            );
        }
        message
    }
}

/// A setting librdkafka refused, by its name only: librdkafka's message quotes the value, which
/// may be a password.
fn refused_setting(client: &str, e: &KafkaError) -> SourceError {
    SourceError::Refused(match e {
        KafkaError::ClientConfig(_, _, name, _) => {
            format!("librdkafka refused the setting {name:?} for the Kafka {client}")
        }
        // librdkafka's check of the settings together (a missing file, a mechanism it was built
        // without): names settings, not their values.
        KafkaError::ClientCreation(why) => format!("the Kafka {client} cannot be made: {why}"),
        other => format!("the Kafka {client} cannot be made: {other}"),
    })
}

/// Settings librdkafka's producer does not know (it warns about each).
fn consumer_only(name: &str) -> bool {
    name.starts_with("session.")
        || name.starts_with("heartbeat.")
        || name.starts_with("auto.")
        || name.starts_with("fetch.")
        || matches!(
            name,
            "max.poll.interval.ms"
                | "partition.assignment.strategy"
                | "group.instance.id"
                | "group.protocol"
                | "isolation.level"
                | "check.crcs"
                | "queued.min.messages"
                | "queued.max.messages.kbytes"
                | "max.partition.fetch.bytes"
        )
}

/// Fails unless the brokers know `topic` (the consumer asks without creating it).
fn exists(consumer: &StreamConsumer<Rebalances>, topic: &str) -> Result<(), SourceError> {
    let metadata = consumer
        .fetch_metadata(Some(topic), TIMEOUT)
        .map_err(unreachable)?;
    match metadata.topics().iter().find(|t| t.name() == topic) {
        Some(t) if t.error().is_none() && !t.partitions().is_empty() => Ok(()),
        _ => Err(SourceError::Refused(format!(
            "topic {topic:?} does not exist (the gateway creates no topic: create it first)"
        ))),
    }
}

/// The message's headers, and its key as the field `kafka-key`, as the consumer sees fields
/// (what `key = { field = ... }` names, passed on as the handler's headers); the headers as
/// they came, for the dead letter; and why the message is invalid, if it is (a header name that
/// is not UTF-8: it is dead-lettered, its name written lossily).
fn fields_of(m: &BorrowedMessage<'_>) -> (HeaderMap, Vec<(Bytes, Bytes)>, Option<String>) {
    let mut raw = Vec::new();
    let mut fields = HeaderMap::new();
    let mut invalid = None;
    let add = |name: &[u8], value: &[u8], fields: &mut HeaderMap| {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(&name.to_ascii_lowercase()),
            HeaderValue::from_bytes(value),
        ) {
            if passed_on(&n, v.len(), fields.len()) {
                fields.append(n, v);
            }
        }
    };
    if let Some(key) = m.key() {
        add(KEY_FIELD.as_bytes(), key, &mut fields);
    }
    for (i, h) in kafka_headers::raw_headers(m).into_iter().enumerate() {
        let value = h.value.unwrap_or_default();
        if std::str::from_utf8(h.name).is_err() {
            invalid.get_or_insert_with(|| format!("header {i}'s name is not UTF-8"));
        } else {
            add(h.name, value, &mut fields);
        }
        raw.push((
            Bytes::copy_from_slice(h.name),
            Bytes::copy_from_slice(value),
        ));
    }
    (fields, raw, invalid)
}

/// The dead letter is written and the original's offset could not be stored: read again, and
/// dead-lettered again, after a restart or a rebalance (not written again now).
fn written_not_acked(e: SourceError) -> SourceError {
    SourceError::Gone(format!(
        "its dead letter is written, its offset not stored: {e}"
    ))
}

fn unreachable(e: impl std::fmt::Display) -> SourceError {
    SourceError::Unreachable(e.to_string())
}

impl Source for KafkaTopic {
    async fn fetch(&self, max: usize) -> Result<Vec<Message>, SourceError> {
        self.check().await?;
        let mut out = Vec::new();
        // The first may take a while; those librdkafka already has are taken at once.
        let first = match tokio::time::timeout(WAIT, self.consumer.recv()).await {
            Err(_) => return Ok(out),
            Ok(Err(e)) => return Err(unreachable(e)),
            Ok(Ok(m)) => self.message(&m),
        };
        out.push(first);
        while out.len() < max {
            match self.consumer.recv().now_or_never() {
                Some(Ok(m)) => out.push(self.message(&m)),
                _ => break,
            }
        }
        self.answered_now();
        Ok(out)
    }

    async fn ack(&self, message: &Message) -> Result<(), SourceError> {
        let Some(held) = self
            .held
            .lock()
            .ok()
            .and_then(|mut h| h.remove(&message.read))
        else {
            return Ok(());
        };
        let Ok(mut offsets) = self.offsets.lock() else {
            return Err(SourceError::Refused("the offsets' lock is poisoned".into()));
        };
        let Some(next) = offsets.finish(held.partition, held.offset, held.epoch) else {
            return Ok(());
        };
        // Under the lock: two acknowledgements never store offsets out of order.
        let mut list = TopicPartitionList::new();
        list.add_partition_offset(&self.source.topic, held.partition, Offset::Offset(next))
            .and_then(|()| self.consumer.store_offsets(&list))
            .map_err(|e| SourceError::Refused(format!("storing offset {next}: {e}")))
    }

    async fn keep(&self, _message: &Message, _redelivery: bool) -> Result<(), SourceError> {
        // Its partition stays with this instance while the group's session lives.
        Ok(())
    }

    async fn retry_later(&self, _message: &Message, _delay: Duration) -> Result<bool, SourceError> {
        // No redelivery of one message: the caller waits, holding it.
        Ok(false)
    }

    async fn dead_letter(&self, message: &Message, reason: &str) -> Result<(), SourceError> {
        let Some((partition, offset, key)) = self.held.lock().ok().and_then(|h| {
            h.get(&message.read)
                .map(|h| (h.partition, h.offset, h.key.clone()))
        }) else {
            return Err(SourceError::Gone(
                "its partition was given away, or it was released; it is read again".into(),
            ));
        };
        let mut headers = OwnedHeaders::new_with_capacity(message.raw.len() + 5);
        for (name, value) in &message.raw {
            headers = headers.insert(Header {
                key: &String::from_utf8_lossy(name),
                value: Some(value.as_ref()),
            });
        }
        let (partition, offset) = (partition.to_string(), offset.to_string());
        let deliveries = message.deliveries.to_string();
        for (name, value) in [
            ("idemgate-reason", reason),
            ("idemgate-topic", self.source.topic.as_str()),
            ("idemgate-partition", partition.as_str()),
            ("idemgate-offset", offset.as_str()),
            ("idemgate-deliveries", deliveries.as_str()),
        ] {
            headers = headers.insert(Header {
                key: name,
                value: Some(value),
            });
        }
        let body = message.body.clone().unwrap_or_default();
        // One try: the consumer tries again with backoff, holding the message (Kafka gives it
        // to no one else while this instance holds its partition).
        let mut record = FutureRecord::to(&self.source.dead_letter)
            .payload(body.as_ref())
            .headers(headers);
        if let Some(key) = &key {
            record = record.key(key.as_slice());
        }
        match tokio::time::timeout(TIMEOUT * 2, self.producer.send(record, TIMEOUT)).await {
            Ok(Ok(_)) => self.ack(message).await.map_err(written_not_acked),
            Ok(Err((e, _))) => Err(SourceError::Refused(format!(
                "the dead-letter topic {:?} did not take the message: {e}",
                self.source.dead_letter
            ))),
            Err(_) => Err(SourceError::Unreachable(format!(
                "no answer within {:?}",
                TIMEOUT * 2
            ))),
        }
    }

    async fn release(&self, message: &Message) -> Result<(), SourceError> {
        // Its offset stays unfinished, so the partition's committed offset stays before it: read
        // again by this group after a restart or a rebalance.
        if let Ok(mut held) = self.held.lock() {
            held.remove(&message.read);
        }
        Ok(())
    }

    async fn pending(&self) -> Result<u64, SourceError> {
        let consumer = Arc::clone(&self.consumer);
        let topic = self.source.topic.clone();
        let unread = tokio::task::spawn_blocking(move || unread(&consumer, &topic))
            .await
            .map_err(unreachable)??;
        let unfinished = self.offsets.lock().map(|o| o.unfinished()).unwrap_or(0);
        Ok(unread + unfinished)
    }

    fn claim_after(&self) -> Duration {
        // Nothing to renew: see the module doc.
        Duration::from_secs(3600)
    }
}

/// Messages of this instance's partitions not read yet: the high watermark less the position.
fn unread(consumer: &StreamConsumer<Rebalances>, topic: &str) -> Result<u64, SourceError> {
    let positions = consumer.position().map_err(unreachable)?;
    let mut total = 0u64;
    for p in positions.elements_for_topic(topic) {
        let Offset::Offset(at) = p.offset() else {
            continue;
        };
        let (_, high) = consumer
            .fetch_watermarks(topic, p.partition(), TIMEOUT)
            .map_err(unreachable)?;
        total += u64::try_from(high - at).unwrap_or(0);
    }
    Ok(total)
}

/// The consumer group's callbacks: what each assignment of a partition is.
pub struct Rebalances {
    topic: String,
    offsets: Arc<Mutex<Offsets>>,
}

impl ClientContext for Rebalances {}

impl ConsumerContext for Rebalances {
    fn pre_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let Ok(mut offsets) = self.offsets.lock() else {
            return;
        };
        match rebalance {
            Rebalance::Revoke(list) => {
                for p in list.elements_for_topic(&self.topic) {
                    offsets.revoke(p.partition());
                }
                tracing::info!(topic = %self.topic, partitions = ?partitions(list, &self.topic), "partitions revoked; their finished offsets are committed");
            }
            Rebalance::Assign(list) => {
                for p in list.elements_for_topic(&self.topic) {
                    offsets.assign(p.partition());
                }
                tracing::info!(topic = %self.topic, partitions = ?partitions(list, &self.topic), "partitions assigned");
            }
            Rebalance::Error(e) => {
                tracing::warn!(topic = %self.topic, error = %e, "rebalance failed")
            }
        }
    }
}

fn partitions(list: &TopicPartitionList, topic: &str) -> Vec<i32> {
    list.elements_for_topic(topic)
        .iter()
        .map(|p| p.partition())
        .collect()
}

/// Per partition of this instance: the offsets read and not finished, and how far the
/// committed offset may go.
#[derive(Debug, Default)]
struct Offsets {
    partitions: HashMap<i32, Assigned>,
    epochs: u64,
}

#[derive(Debug)]
struct Assigned {
    /// Which assignment of the partition this is: a message read under another one finishes
    /// nothing here.
    epoch: u64,
    unfinished: BTreeSet<i64>,
    /// One past the highest offset read.
    next: i64,
    /// The offset last stored for commit.
    stored: i64,
}

impl Offsets {
    fn assign(&mut self, partition: i32) -> u64 {
        self.epochs += 1;
        let assigned = Assigned {
            epoch: self.epochs,
            unfinished: BTreeSet::new(),
            next: 0,
            stored: -1,
        };
        self.partitions.insert(partition, assigned);
        self.epochs
    }

    fn revoke(&mut self, partition: i32) {
        self.partitions.remove(&partition);
    }

    /// `offset` of `partition` read: unfinished until [`Offsets::finish`]. Its epoch.
    fn read(&mut self, partition: i32, offset: i64) -> u64 {
        if !self.partitions.contains_key(&partition) {
            self.assign(partition);
        }
        let Some(p) = self.partitions.get_mut(&partition) else {
            return 0;
        };
        if p.stored < 0 {
            // The first read of an assignment starts where the group's committed offset is.
            p.stored = offset;
        }
        p.unfinished.insert(offset);
        p.next = p.next.max(offset + 1);
        p.epoch
    }

    /// `offset` finished: the partition's new committable offset, if it moved.
    fn finish(&mut self, partition: i32, offset: i64, epoch: u64) -> Option<i64> {
        let p = self
            .partitions
            .get_mut(&partition)
            .filter(|p| p.epoch == epoch)?;
        p.unfinished.remove(&offset);
        let next = p.unfinished.first().copied().unwrap_or(p.next);
        (next > p.stored).then(|| {
            p.stored = next;
            next
        })
    }

    fn unfinished(&self) -> u64 {
        self.partitions
            .values()
            .map(|p| p.unfinished.len() as u64)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_offset_moves_only_past_contiguous_finished_messages() {
        let mut o = Offsets::default();
        let e = o.assign(0);
        for offset in 10..15 {
            assert_eq!(o.read(0, offset), e);
        }
        assert_eq!(o.finish(0, 12, e), None, "10 and 11 are not finished");
        assert_eq!(o.finish(0, 11, e), None);
        assert_eq!(o.finish(0, 10, e), Some(13), "10 to 12 done: 13 is next");
        assert_eq!(o.finish(0, 14, e), None, "13 still runs");
        assert_eq!(o.unfinished(), 1);
        assert_eq!(o.finish(0, 13, e), Some(15));
        assert_eq!(o.unfinished(), 0);
    }

    #[test]
    fn a_message_of_a_revoked_assignment_moves_nothing() {
        let mut o = Offsets::default();
        let old = o.assign(3);
        o.read(3, 7);
        o.revoke(3);
        assert_eq!(o.finish(3, 7, old), None, "revoked");
        let new = o.assign(3);
        assert_ne!(new, old);
        o.read(3, 7);
        assert_eq!(o.finish(3, 7, old), None, "read under the old assignment");
        assert_eq!(o.finish(3, 7, new), Some(8));
    }

    #[test]
    fn offsets_of_other_partitions_are_apart() {
        let mut o = Offsets::default();
        let (a, b) = (o.assign(0), o.assign(1));
        o.read(0, 0);
        o.read(1, 0);
        o.read(1, 1);
        assert_eq!(o.finish(1, 1, b), None);
        assert_eq!(o.finish(0, 0, a), Some(1));
        assert_eq!(o.finish(1, 0, b), Some(2));
    }
}
