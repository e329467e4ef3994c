//! A NATS JetStream stream read by a durable pull consumer (`async-nats`): every gateway
//! instance binds to the same durable, so they share its messages; a message is acknowledged
//! with a confirmed ack (`double_ack`) once its result is stored, kept with `+WPI` (in progress)
//! while it is handled or waits for a retry, and moved to the dead-letter subject (published to
//! JetStream, so its own stream keeps it) before it is acknowledged.
//!
//! Unlike Redis's MULTI, the dead-letter publish and the ack are two steps: a crash between them
//! leaves the message pending, and its redelivery is judged again (it lands in the dead-letter
//! stream a second time, never in the handler).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, AckKind};
use bytes::Bytes;
use futures_util::StreamExt;
use http::{HeaderMap, HeaderName, HeaderValue};
use tokio::sync::{Mutex as AsyncMutex, OnceCell};

use super::redis_stream::passed_on;
use super::source::{Message, Source, SourceError};

/// How long one pull waits for a first message.
const WAIT: Duration = Duration::from_millis(1000);

struct Connected {
    js: jetstream::Context,
    consumer: jetstream::consumer::PullConsumer,
    /// The continuous pull: the client keeps up to `buffer` messages requested ahead.
    messages: AsyncMutex<pull::Stream>,
}

pub struct NatsStream {
    url: String,
    stream: String,
    subject: Option<String>,
    durable: String,
    dead_letter: String,
    ack_wait: Duration,
    timeout: Duration,
    /// Messages pulled ahead at most: the consumer's `concurrency`.
    buffer: usize,
    connected: OnceCell<Connected>,
    /// The messages being handled, by stream sequence: what acknowledging needs.
    held: Mutex<HashMap<String, jetstream::Message>>,
}

impl NatsStream {
    pub fn new(
        url: &str,
        stream: &str,
        subject: Option<&str>,
        durable: &str,
        dead_letter: &str,
        ack_wait: Duration,
        buffer: usize,
    ) -> Self {
        NatsStream {
            url: url.to_string(),
            stream: stream.to_string(),
            subject: subject.map(str::to_string),
            durable: durable.to_string(),
            dead_letter: dead_letter.to_string(),
            ack_wait,
            timeout: Duration::from_secs(5),
            buffer: buffer.max(1),
            connected: OnceCell::new(),
            held: Mutex::new(HashMap::new()),
        }
    }

    pub fn durable(&self) -> &str {
        &self.durable
    }

    /// Connects and binds the durable consumer, once; a failure is tried again on the next call.
    async fn connected(&self) -> Result<&Connected, SourceError> {
        self.connected
            .get_or_try_init(|| async {
                let client = async_nats::ConnectOptions::new()
                    .connection_timeout(self.timeout)
                    .connect(self.url.as_str())
                    .await
                    .map_err(|e| SourceError::Unreachable(e.to_string()))?;
                let js = jetstream::new(client);
                let stream = js
                    .get_stream(&self.stream)
                    .await
                    .map_err(|e| SourceError::Refused(format!("stream {:?}: {e}", self.stream)))?;
                let consumer: jetstream::consumer::PullConsumer = stream
                    .get_or_create_consumer(
                        &self.durable,
                        pull::Config {
                            durable_name: Some(self.durable.clone()),
                            filter_subject: self.subject.clone().unwrap_or_default(),
                            ack_policy: jetstream::consumer::AckPolicy::Explicit,
                            ack_wait: self.ack_wait,
                            // Attempts are counted and capped by the gateway, which
                            // dead-letters with the reason; the server never drops one.
                            max_deliver: -1,
                            ..Default::default()
                        },
                    )
                    .await
                    .map_err(|e| {
                        SourceError::Refused(format!("consumer {:?}: {e}", self.durable))
                    })?;
                let messages = consumer
                    .stream()
                    .max_messages_per_batch(self.buffer)
                    .messages()
                    .await
                    .map_err(|e| SourceError::Unreachable(e.to_string()))?;
                Ok(Connected {
                    js,
                    consumer,
                    messages: AsyncMutex::new(messages),
                })
            })
            .await
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
            body,
            fields,
            raw,
        })
    }
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
            Ok(None) => return Err(SourceError::Unreachable("the pull ended".into())),
            Ok(Some(m)) => m.map_err(unreachable)?,
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
        headers.insert("Idemgate-Stream", self.stream.as_str());
        headers.insert("Idemgate-Id", message.id.as_str());
        headers.insert(
            "Idemgate-Deliveries",
            message.deliveries.to_string().as_str(),
        );
        let payload = message.body.clone().unwrap_or_default();
        let publish = async {
            connected
                .js
                .publish_with_headers(self.dead_letter.clone(), headers, payload)
                .await
                .map_err(unreachable)?
                .await
                .map_err(unreachable)
        };
        tokio::time::timeout(self.timeout, publish)
            .await
            .map_err(unreachable)??;
        self.ack(message).await
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
        self.ack_wait
    }
}
