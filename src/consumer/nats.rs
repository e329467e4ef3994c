//! A NATS JetStream stream read by a durable pull consumer (`async-nats`): every gateway
//! instance binds to the same durable, so they share its messages; a message is acknowledged
//! with a confirmed ack (`double_ack`) once its result is stored, kept with `+WPI` (in progress)
//! while it is handled, handed back with a delayed `nak` for a retry, and moved to the dead-letter subject (published to
//! JetStream, so its own stream keeps it) before it is acknowledged.
//!
//! Unlike Redis's script, the dead-letter publish and the ack are two steps: a crash between them
//! leaves the message pending, and its redelivery is judged again. One dead-lettered for its
//! key (missing, reused) or an unknown outcome lands in the dead-letter stream a second time;
//! one that ran out of attempts had its key released, so the handler is tried again.
//!
//! The gateway never creates the stream, and refuses to start reading when the stream would
//! capture the dead-letter subject (every dead letter would come back as a new message) or when
//! the durable exists with other settings than the config's.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, AckKind};
use bytes::Bytes;
use futures_util::StreamExt;
use http::{HeaderMap, HeaderName, HeaderValue};
use tokio::sync::Mutex as AsyncMutex;

use super::redis_stream::passed_on;
use super::source::{Message, Source, SourceError};
use crate::config::NatsSource;

/// How long one pull waits for a first message.
const WAIT: Duration = Duration::from_millis(1000);

struct Connected {
    client: async_nats::Client,
    js: jetstream::Context,
    consumer: jetstream::consumer::PullConsumer,
    /// The continuous pull: the client keeps up to `buffer` messages requested ahead.
    messages: AsyncMutex<pull::Stream>,
}

pub struct NatsStream {
    source: NatsSource,
    timeout: Duration,
    /// Messages pulled ahead at most: the consumer's `concurrency`.
    buffer: usize,
    /// Made on the first fetch, and again after the pull ended (the durable deleted, say).
    connected: AsyncMutex<Option<Arc<Connected>>>,
    /// The messages being handled, by stream sequence: what acknowledging needs.
    held: Mutex<HashMap<String, jetstream::Message>>,
}

impl NatsStream {
    pub fn new(source: NatsSource, buffer: usize) -> Self {
        NatsStream {
            source,
            timeout: Duration::from_secs(5),
            buffer: buffer.max(1),
            connected: AsyncMutex::new(None),
            held: Mutex::new(HashMap::new()),
        }
    }

    pub fn durable(&self) -> &str {
        &self.source.durable
    }

    /// The connection and the bound durable, made if there is none; a broker that is not
    /// connected now is an error (the client reconnects by itself meanwhile).
    async fn connected(&self) -> Result<Arc<Connected>, SourceError> {
        let mut slot = self.connected.lock().await;
        if let Some(c) = slot.as_ref() {
            if c.client.connection_state() != async_nats::connection::State::Connected {
                return Err(SourceError::Unreachable("not connected to NATS".into()));
            }
            return Ok(Arc::clone(c));
        }
        let c = Arc::new(self.connect().await?);
        *slot = Some(Arc::clone(&c));
        Ok(c)
    }

    /// Forgets the connection, so that the next fetch connects and binds again.
    async fn reset(&self) {
        *self.connected.lock().await = None;
    }

    async fn connect(&self) -> Result<Connected, SourceError> {
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(self.timeout)
            .connect(self.source.url.as_str())
            .await
            .map_err(|e| SourceError::Unreachable(e.to_string()))?;
        let js = jetstream::new(client.clone());
        let mut stream = js
            .get_stream(&self.source.stream)
            .await
            .map_err(|e| SourceError::Refused(format!("stream {:?}: {e}", self.source.stream)))?;
        let subjects = stream
            .info()
            .await
            .map_err(|e| SourceError::Unreachable(e.to_string()))?
            .config
            .subjects
            .clone();
        if let Some(s) = subjects
            .iter()
            .find(|s| subject_matches(s, &self.source.dead_letter))
        {
            return Err(SourceError::Refused(format!(
                "stream {:?} captures the dead-letter subject {:?} (its subject {s:?}): every dead letter would come back; use a subject outside it",
                self.source.stream, self.source.dead_letter
            )));
        }
        let wanted = pull::Config {
            durable_name: Some(self.source.durable.clone()),
            filter_subject: self.source.subject.clone().unwrap_or_default(),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: self.source.ack_wait,
            // Attempts are counted and capped by the gateway, which dead-letters with the
            // reason; the server never drops one.
            max_deliver: -1,
            ..Default::default()
        };
        let mut consumer: jetstream::consumer::PullConsumer = stream
            .get_or_create_consumer(&self.source.durable, wanted.clone())
            .await
            .map_err(|e| {
                SourceError::Refused(format!("consumer {:?}: {e}", self.source.durable))
            })?;
        let info = consumer
            .info()
            .await
            .map_err(|e| SourceError::Unreachable(e.to_string()))?;
        let have = &info.config;
        if have.ack_wait != wanted.ack_wait
            || have.max_deliver != wanted.max_deliver
            || have.filter_subject != wanted.filter_subject
            || have.ack_policy != wanted.ack_policy
        {
            return Err(SourceError::Refused(format!(
                "the durable {:?} exists with other settings (ack_wait {:?}, max_deliver {}, filter {:?}); delete it or match the config",
                self.source.durable, have.ack_wait, have.max_deliver, have.filter_subject
            )));
        }
        let messages = consumer
            .stream()
            .max_messages_per_batch(self.buffer)
            .messages()
            .await
            .map_err(|e| SourceError::Unreachable(e.to_string()))?;
        Ok(Connected {
            client,
            js,
            consumer,
            messages: AsyncMutex::new(messages),
        })
    }

    fn take(&self, id: &str) -> Option<jetstream::Message> {
        self.held.lock().ok()?.remove(id)
    }

    fn get(&self, id: &str) -> Option<jetstream::Message> {
        self.held.lock().ok()?.get(id).cloned()
    }

    fn message(&self, m: jetstream::Message) -> Option<Message> {
        let info = m.info().ok()?;
        let id = info.stream_sequence.to_string();
        let deliveries = u64::try_from(info.delivered).unwrap_or(1).max(1);
        let mut raw = Vec::new();
        let mut fields = HeaderMap::new();
        if let Some(headers) = &m.headers {
            for (name, values) in headers.iter() {
                for value in values {
                    let (n, v) = (name.to_string(), value.to_string());
                    raw.push((Bytes::from(n.clone()), Bytes::from(v.clone())));
                    if let (Ok(n), Ok(v)) = (
                        HeaderName::from_bytes(n.as_bytes()),
                        HeaderValue::from_str(&v),
                    ) {
                        if passed_on(&n, v.len(), fields.len()) {
                            fields.append(n, v);
                        }
                    }
                }
            }
        }
        let body = Some(m.payload.clone());
        if let Ok(mut held) = self.held.lock() {
            held.insert(id.clone(), m);
        }
        Some(Message {
            id,
            deliveries,
            read: 0,
            body,
            fields,
            raw,
            invalid: None,
            handler_answered: false,
        })
    }
}

/// Whether the NATS subject pattern `pattern` (with `*` for one token, `>` for the rest)
/// matches the literal `subject`.
fn subject_matches(pattern: &str, subject: &str) -> bool {
    let mut want = subject.split('.');
    for token in pattern.split('.') {
        match (token, want.next()) {
            (">", Some(_)) => return true,
            ("*", Some(_)) => {}
            (t, Some(w)) if t == w => {}
            _ => return false,
        }
    }
    want.next().is_none()
}

fn unreachable(e: impl std::fmt::Display) -> SourceError {
    SourceError::Unreachable(e.to_string())
}

impl Source for NatsStream {
    async fn fetch(&self, max: usize) -> Result<Vec<Message>, SourceError> {
        let connected = self.connected().await?;
        let mut messages = connected.messages.lock().await;
        let mut out = Vec::new();
        // The first message may take a while; those already pulled ahead are taken at once.
        let first = match tokio::time::timeout(WAIT, messages.next()).await {
            Err(_) => return Ok(out),
            Ok(Some(Ok(m))) => m,
            ended => {
                drop(messages);
                self.reset().await;
                return Err(match ended {
                    Ok(Some(Err(e))) => unreachable(e),
                    _ => SourceError::Unreachable("the pull ended".into()),
                });
            }
        };
        out.extend(self.message(first));
        while out.len() < max {
            match futures_util::FutureExt::now_or_never(messages.next()) {
                Some(Some(Ok(m))) => out.extend(self.message(m)),
                _ => break,
            }
        }
        Ok(out)
    }

    async fn ack(&self, message: &Message) -> Result<(), SourceError> {
        let Some(m) = self.take(&message.id) else {
            return Ok(());
        };
        tokio::time::timeout(self.timeout, m.double_ack())
            .await
            .map_err(unreachable)?
            .map_err(unreachable)
    }

    async fn keep(&self, message: &Message, _redelivery: bool) -> Result<(), SourceError> {
        // The server counts deliveries it makes; the gateway counts its own retries.
        let Some(m) = self.get(&message.id) else {
            return Ok(());
        };
        tokio::time::timeout(self.timeout, m.ack_with(AckKind::Progress))
            .await
            .map_err(unreachable)?
            .map_err(unreachable)
    }

    async fn retry_later(&self, message: &Message, delay: Duration) -> Result<bool, SourceError> {
        // The server counts the redelivery, so attempts survive a crash of this instance.
        let Some(m) = self.take(&message.id) else {
            return Ok(true);
        };
        tokio::time::timeout(self.timeout, m.ack_with(AckKind::Nak(Some(delay))))
            .await
            .map_err(unreachable)?
            .map_err(unreachable)?;
        Ok(true)
    }

    async fn dead_letter(&self, message: &Message, reason: &str) -> Result<(), SourceError> {
        let connected = self.connected().await?;
        let mut headers = async_nats::HeaderMap::new();
        for (name, value) in &message.raw {
            headers.append(
                String::from_utf8_lossy(name).as_ref(),
                String::from_utf8_lossy(value).as_ref(),
            );
        }
        headers.insert("Idemgate-Reason", reason);
        headers.insert("Idemgate-Stream", self.source.stream.as_str());
        headers.insert("Idemgate-Id", message.id.as_str());
        headers.insert(
            "Idemgate-Deliveries",
            message.deliveries.to_string().as_str(),
        );
        let payload = message.body.clone().unwrap_or_default();
        let publish = async {
            connected
                .js
                .publish_with_headers(self.source.dead_letter.clone(), headers, payload)
                .await
                .map_err(unreachable)?
                .await
                .map_err(unreachable)
        };
        tokio::time::timeout(self.timeout, publish)
            .await
            .map_err(unreachable)??;
        // Written: not written again now, whatever becomes of the acknowledgement (a failed
        // one has the server deliver the message again after ack_wait).
        self.ack(message).await.map_err(|e| {
            SourceError::Gone(format!(
                "its dead letter is written, its acknowledgement failed: {e}"
            ))
        })
    }

    async fn release(&self, message: &Message) -> Result<(), SourceError> {
        // Redelivered by the server once its ack_wait runs out.
        self.take(&message.id);
        Ok(())
    }

    async fn pending(&self) -> Result<u64, SourceError> {
        let connected = self.connected().await?;
        let mut consumer = connected.consumer.clone();
        let info = tokio::time::timeout(self.timeout, consumer.info())
            .await
            .map_err(unreachable)?
            .map_err(unreachable)?;
        Ok(u64::try_from(info.num_ack_pending).unwrap_or(u64::MAX) + info.num_pending)
    }

    fn claim_after(&self) -> Duration {
        self.source.ack_wait
    }
}

#[cfg(test)]
mod tests {
    use super::subject_matches;

    #[test]
    fn subject_patterns_match_as_nats_does() {
        assert!(subject_matches("orders.>", "orders.dead"));
        assert!(subject_matches("orders.*", "orders.dead"));
        assert!(subject_matches("dead.orders", "dead.orders"));
        assert!(!subject_matches("orders.*", "orders.dead.x"));
        assert!(!subject_matches("orders.>", "orders"));
        assert!(!subject_matches("orders.>", "dead.orders"));
        assert!(!subject_matches("orders", "orders.dead"));
    }
}
