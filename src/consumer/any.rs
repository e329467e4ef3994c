//! Every broker behind one type: [`AnySource`] is what the server holds per consumer, made from
//! its config by [`sources`], and dispatches each [`Source`] call to the broker's own.

use std::time::Duration;

use super::{
    ConsumerError, KafkaTopic, Message, NatsStream, RabbitQueue, RedisStream, Source, SourceError,
};
use crate::config::{ConsumerConfig, SourceConfig};

/// A consumer's source, whichever broker it is.
// Boxed: their connection state is large, and one is made per consumer.
pub enum AnySource {
    Redis(Box<RedisStream>),
    Nats(Box<NatsStream>),
    Rabbit(Box<RabbitQueue>),
    Kafka(Box<KafkaTopic>),
}

impl AnySource {
    /// Who this instance is to the broker: its consumer name in the group, or the durable it
    /// shares.
    pub fn describe(&self) -> String {
        match self {
            AnySource::Redis(r) => format!("redis stream, consumer {}", r.consumer_name()),
            AnySource::Nats(n) => format!("nats stream, durable {}", n.durable()),
            AnySource::Rabbit(r) => format!("rabbitmq queue {}", r.queue()),
            AnySource::Kafka(k) => format!("kafka topic {}, group {}", k.topic(), k.group()),
        }
    }
}

impl Source for AnySource {
    async fn fetch(&self, max: usize) -> Result<Vec<Message>, SourceError> {
        match self {
            AnySource::Redis(s) => s.fetch(max).await,
            AnySource::Nats(s) => s.fetch(max).await,
            AnySource::Rabbit(s) => s.fetch(max).await,
            AnySource::Kafka(s) => s.fetch(max).await,
        }
    }

    async fn ack(&self, message: &Message) -> Result<(), SourceError> {
        match self {
            AnySource::Redis(s) => s.ack(message).await,
            AnySource::Nats(s) => s.ack(message).await,
            AnySource::Rabbit(s) => s.ack(message).await,
            AnySource::Kafka(s) => s.ack(message).await,
        }
    }

    async fn keep(&self, message: &Message, redelivery: bool) -> Result<(), SourceError> {
        match self {
            AnySource::Redis(s) => s.keep(message, redelivery).await,
            AnySource::Nats(s) => s.keep(message, redelivery).await,
            AnySource::Rabbit(s) => s.keep(message, redelivery).await,
            AnySource::Kafka(s) => s.keep(message, redelivery).await,
        }
    }

    async fn retry_later(&self, message: &Message, delay: Duration) -> Result<bool, SourceError> {
        match self {
            AnySource::Redis(s) => s.retry_later(message, delay).await,
            AnySource::Nats(s) => s.retry_later(message, delay).await,
            AnySource::Rabbit(s) => s.retry_later(message, delay).await,
            AnySource::Kafka(s) => s.retry_later(message, delay).await,
        }
    }

    async fn dead_letter(&self, message: &Message, reason: &str) -> Result<(), SourceError> {
        match self {
            AnySource::Redis(s) => s.dead_letter(message, reason).await,
            AnySource::Nats(s) => s.dead_letter(message, reason).await,
            AnySource::Rabbit(s) => s.dead_letter(message, reason).await,
            AnySource::Kafka(s) => s.dead_letter(message, reason).await,
        }
    }

    async fn release(&self, message: &Message) -> Result<(), SourceError> {
        match self {
            AnySource::Redis(s) => s.release(message).await,
            AnySource::Nats(s) => s.release(message).await,
            AnySource::Rabbit(s) => s.release(message).await,
            AnySource::Kafka(s) => s.release(message).await,
        }
    }

    async fn pending(&self) -> Result<u64, SourceError> {
        match self {
            AnySource::Redis(s) => s.pending().await,
            AnySource::Nats(s) => s.pending().await,
            AnySource::Rabbit(s) => s.pending().await,
            AnySource::Kafka(s) => s.pending().await,
        }
    }

    fn claim_after(&self) -> Duration {
        match self {
            AnySource::Redis(s) => s.claim_after(),
            AnySource::Nats(s) => s.claim_after(),
            AnySource::Rabbit(s) => s.claim_after(),
            AnySource::Kafka(s) => s.claim_after(),
        }
    }
}

/// Makes each consumer's source (without connecting yet).
pub fn sources(configs: &[ConsumerConfig]) -> Result<Vec<AnySource>, ConsumerError> {
    configs.iter().map(AnySource::of).collect()
}

impl AnySource {
    /// The source of consumer `c` (without connecting yet): at start, and again for each
    /// restart of its task, so that a restart reads from what the broker holds, not from where
    /// the stopped task left off.
    pub fn of(c: &ConsumerConfig) -> Result<AnySource, ConsumerError> {
        match &c.source {
            SourceConfig::RedisStream {
                stream,
                group,
                redis,
                dead_letter,
                claim_idle,
            } => RedisStream::new(
                redis,
                stream,
                group,
                dead_letter,
                *claim_idle,
                &c.body_field,
            )
            .map(|s| AnySource::Redis(Box::new(s)))
            .map_err(|source| ConsumerError {
                consumer: c.name.clone(),
                source,
            }),
            SourceConfig::NatsStream(source) => Ok(AnySource::Nats(Box::new(NatsStream::new(
                source.clone(),
                c.concurrency,
            )))),
            SourceConfig::RabbitQueue(source) => Ok(AnySource::Rabbit(Box::new(RabbitQueue::new(
                source.clone(),
                c.concurrency,
            )))),
            SourceConfig::KafkaTopic(source) => KafkaTopic::new(source.clone())
                .map(|s| AnySource::Kafka(Box::new(s)))
                .map_err(|source| ConsumerError {
                    consumer: c.name.clone(),
                    source,
                }),
        }
    }
}
