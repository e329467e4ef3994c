//! A Redis stream read by a consumer group: XREADGROUP for new entries, XAUTOCLAIM for entries
//! a consumer that died left pending, XACK once a message is done, XCLAIM to keep one while it
//! is worked on, and one Lua script (XADD, then XACK) to move one to the dead-letter stream
//! atomically.
//!
//! Each gateway instance is its own consumer in the group, named after its host and process
//! (unique per instance, and per restart), so that instances share the stream's entries and a
//! restarted instance takes over what it left pending only once that is `claim_idle` old, as
//! any other instance would.
//!
//! With a Sentinel store the stream is read on the primary the sentinels name, and followed
//! to the new one after a failover, as the store's own connections are.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};
use redis::aio::ConnectionManagerConfig;
use redis::{Cmd, Value};

use super::source::{Message, Source, SourceError};
use crate::config::RedisSettings;
use crate::store::redis::{StreamConn, StreamRedis};

/// How long one XREADGROUP waits for new entries: short, so that shutdown and retries are not
/// held up, long enough that an idle consumer costs Redis next to nothing.
const BLOCK: Duration = Duration::from_millis(1000);
/// Fields of an entry passed on (as headers) at most; more are left out, and still copied
/// whole into a dead-letter record.
const MAX_FIELDS: usize = 64;
/// Longest field value passed on as a header.
const MAX_FIELD_VALUE: usize = 8 * 1024;

/// Writes the dead-letter record (KEYS[2]) from ARGV[3..], then acknowledges ARGV[2] in the
/// group ARGV[1] of KEYS[1]; an error in the XADD ends the script before the XACK.
const DEAD_LETTER_SCRIPT: &str = "redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3)) \
     return redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])";
/// Fields of an entry copied into its dead-letter record at most (Lua's `unpack` takes about
/// 8,000 values).
const MAX_DEAD_LETTER_FIELDS: usize = 1000;

/// Headers a field may not become: they frame or route the handler's request.
const RESERVED: &[&str] = &[
    "host",
    "content-length",
    "content-type",
    "transfer-encoding",
    "connection",
    "te",
    "upgrade",
    "keep-alive",
    "proxy-connection",
    "trailer",
    "expect",
];

pub struct RedisStream {
    stream: String,
    group: String,
    dead_letter: String,
    consumer: String,
    body_field: String,
    claim_idle: Duration,
    timeout: Duration,
    /// For XREADGROUP, which blocks the connection it runs on.
    reader: StreamConn,
    /// For everything else.
    writer: StreamConn,
    redis: StreamRedis,
    /// Where the next XAUTOCLAIM scan starts.
    cursor: Mutex<String>,
    group_made: AtomicBool,
}

impl RedisStream {
    /// Connects lazily: a Redis that is down now only makes the first fetches fail.
    pub fn new(
        settings: &RedisSettings,
        stream: &str,
        group: &str,
        dead_letter: &str,
        claim_idle: Duration,
        body_field: &str,
    ) -> Result<Self, SourceError> {
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(settings.command_timeout.max(Duration::from_secs(1))))
            // Every call is bounded by our own timeout, the blocking read included.
            .set_response_timeout(None)
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_secs(1));
        let redis =
            StreamRedis::open(settings, config).map_err(|e| SourceError::Refused(e.to_string()))?;
        let conn = || {
            redis
                .conn()
                .map_err(|e| SourceError::Unreachable(e.to_string()))
        };
        Ok(RedisStream {
            stream: stream.to_string(),
            group: group.to_string(),
            dead_letter: dead_letter.to_string(),
            consumer: instance_name(),
            body_field: body_field.to_string(),
            claim_idle,
            timeout: settings.command_timeout,
            reader: conn()?,
            writer: conn()?,
            redis,
            cursor: Mutex::new("0-0".to_string()),
            group_made: AtomicBool::new(false),
        })
    }

    /// This instance's consumer name in the group.
    pub fn consumer_name(&self) -> &str {
        &self.consumer
    }

    async fn call(
        &self,
        conn: &StreamConn,
        cmd: &Cmd,
        wait: Duration,
    ) -> Result<Value, SourceError> {
        let answer = tokio::time::timeout(wait, conn.query(cmd)).await;
        if let Ok(Ok(Err(e))) = &answer {
            self.redis.failed(Some(e));
        } else if answer.is_err() {
            self.redis.failed(None);
        }
        match answer {
            // No primary known yet (Sentinel).
            Ok(Err(e)) => Err(SourceError::Unreachable(e.to_string())),
            Ok(Ok(Ok(v))) => Ok(v),
            Ok(Ok(Err(e)))
                if e.is_io_error()
                    || e.is_connection_dropped()
                    || e.is_timeout()
                    || e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly) =>
            {
                Err(SourceError::Unreachable(e.to_string()))
            }
            Ok(Ok(Err(e))) => {
                if e.code() == Some("NOGROUP") {
                    // The stream or the group was deleted: made again before the next read.
                    self.group_made.store(false, Ordering::Relaxed);
                }
                Err(SourceError::Refused(e.to_string()))
            }
            Err(_) => Err(SourceError::Unreachable(format!(
                "no answer within {wait:?}"
            ))),
        }
    }

    /// The group, made with the stream if either is missing. It starts at the stream's first
    /// entry, so that what was added before the first gateway started is not skipped.
    async fn ensure_group(&self) -> Result<(), SourceError> {
        if self.group_made.load(Ordering::Relaxed) {
            return Ok(());
        }
        let mut cmd = redis::cmd("XGROUP");
        cmd.arg("CREATE")
            .arg(&self.stream)
            .arg(&self.group)
            .arg("0")
            .arg("MKSTREAM");
        match self.call(&self.writer, &cmd, self.timeout).await {
            Ok(_) => {}
            Err(SourceError::Refused(e)) if e.contains("BUSYGROUP") => {}
            Err(e) => return Err(e),
        }
        self.group_made.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Entries pending longer than `claim_idle` with another consumer (one that died), taken.
    async fn claim_abandoned(&self, max: usize) -> Result<Vec<Message>, SourceError> {
        let cursor = self
            .cursor
            .lock()
            .map(|c| c.clone())
            .unwrap_or_else(|_| "0-0".to_string());
        let mut cmd = redis::cmd("XAUTOCLAIM");
        cmd.arg(&self.stream)
            .arg(&self.group)
            .arg(&self.consumer)
            .arg(u64::try_from(self.claim_idle.as_millis()).unwrap_or(u64::MAX))
            .arg(&cursor)
            .arg("COUNT")
            .arg(max);
        let reply = self.call(&self.writer, &cmd, self.timeout).await?;
        let Value::Array(parts) = reply else {
            return Err(SourceError::Refused("unexpected XAUTOCLAIM reply".into()));
        };
        let mut parts = parts.into_iter();
        let next = parts
            .next()
            .and_then(|v| text(&v))
            .unwrap_or_else(|| "0-0".into());
        if let Ok(mut c) = self.cursor.lock() {
            *c = next;
        }
        let entries = entries(parts.next().unwrap_or(Value::Nil));
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        // XAUTOCLAIM counted this delivery; XPENDING says how many there were in all.
        let counts = self.delivery_counts(&entries).await.unwrap_or_default();
        Ok(entries
            .into_iter()
            .map(|(id, fields)| {
                let deliveries = counts.iter().find(|(i, _)| *i == id).map_or(2, |(_, n)| *n);
                self.message(id, fields, deliveries)
            })
            .collect())
    }

    async fn delivery_counts(
        &self,
        entries: &[(String, Vec<(Bytes, Bytes)>)],
    ) -> Result<Vec<(String, u64)>, SourceError> {
        let (Some(first), Some(last)) = (entries.first(), entries.last()) else {
            return Ok(Vec::new());
        };
        let mut cmd = redis::cmd("XPENDING");
        cmd.arg(&self.stream)
            .arg(&self.group)
            .arg(&first.0)
            .arg(&last.0)
            .arg(entries.len())
            .arg(&self.consumer);
        let Value::Array(rows) = self.call(&self.writer, &cmd, self.timeout).await? else {
            return Ok(Vec::new());
        };
        Ok(rows
            .into_iter()
            .filter_map(|row| match row {
                Value::Array(f) if f.len() >= 4 => Some((text(&f[0])?, int(&f[3])?)),
                _ => None,
            })
            .collect())
    }

    fn message(&self, id: String, raw: Vec<(Bytes, Bytes)>, deliveries: u64) -> Message {
        let mut body = None;
        let mut fields = HeaderMap::new();
        for (name, value) in &raw {
            if body.is_none() && name.as_ref() == self.body_field.as_bytes() {
                body = Some(value.clone());
                continue;
            }
            let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(name),
                HeaderValue::from_maybe_shared(value.clone()),
            ) else {
                continue;
            };
            if passed_on(&name, value.len(), fields.len()) {
                fields.append(name, value);
            }
        }
        Message {
            id,
            deliveries,
            read: 0,
            body,
            fields,
            raw,
            invalid: None,
            handler_answered: false,
        }
    }
}

/// Whether a field (a message header) is passed on to the handler as a header: not one that
/// frames or routes the request, not one of the gateway's own, within the count and size caps.
pub(super) fn passed_on(name: &HeaderName, len: usize, passed: usize) -> bool {
    passed < MAX_FIELDS
        && len <= MAX_FIELD_VALUE
        && !RESERVED.contains(&name.as_str())
        && !name.as_str().starts_with("idemgate-")
}

impl Source for RedisStream {
    async fn fetch(&self, max: usize) -> Result<Vec<Message>, SourceError> {
        self.ensure_group().await?;
        let claimed = self.claim_abandoned(max).await?;
        if !claimed.is_empty() {
            return Ok(claimed);
        }
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP")
            .arg(&self.group)
            .arg(&self.consumer)
            .arg("COUNT")
            .arg(max)
            .arg("BLOCK")
            .arg(u64::try_from(BLOCK.as_millis()).unwrap_or(1000))
            .arg("STREAMS")
            .arg(&self.stream)
            .arg(">");
        let reply = self.call(&self.reader, &cmd, BLOCK + self.timeout).await?;
        let entries = match reply {
            Value::Nil => Vec::new(),
            // One stream asked for: [[name, entries]] (RESP2) or {name: entries} (RESP3).
            Value::Array(streams) => streams
                .into_iter()
                .flat_map(|s| match s {
                    Value::Array(mut pair) if pair.len() == 2 => entries(pair.remove(1)),
                    _ => Vec::new(),
                })
                .collect(),
            Value::Map(streams) => streams.into_iter().flat_map(|(_, e)| entries(e)).collect(),
            _ => return Err(SourceError::Refused("unexpected XREADGROUP reply".into())),
        };
        Ok(entries
            .into_iter()
            .map(|(id, fields)| self.message(id, fields, 1))
            .collect())
    }

    async fn ack(&self, message: &Message) -> Result<(), SourceError> {
        let mut cmd = redis::cmd("XACK");
        cmd.arg(&self.stream).arg(&self.group).arg(&message.id);
        self.call(&self.writer, &cmd, self.timeout).await.map(drop)
    }

    async fn keep(&self, message: &Message, redelivery: bool) -> Result<(), SourceError> {
        // XCLAIM to ourselves resets the entry's idle time, so no XAUTOCLAIM takes it; without
        // JUSTID it also counts one more delivery.
        let mut cmd = redis::cmd("XCLAIM");
        cmd.arg(&self.stream)
            .arg(&self.group)
            .arg(&self.consumer)
            .arg(0)
            .arg(&message.id);
        if !redelivery {
            cmd.arg("JUSTID");
        }
        self.call(&self.writer, &cmd, self.timeout).await.map(drop)
    }

    async fn retry_later(&self, _message: &Message, _delay: Duration) -> Result<bool, SourceError> {
        Ok(false)
    }

    async fn dead_letter(&self, message: &Message, reason: &str) -> Result<(), SourceError> {
        // One script, so that the entry is acknowledged only if the dead-letter record was
        // written: in MULTI/EXEC a failed XADD would not stop the XACK.
        let mut cmd = Cmd::new();
        cmd.arg("EVAL")
            .arg(DEAD_LETTER_SCRIPT)
            .arg(2)
            .arg(&self.stream)
            .arg(&self.dead_letter)
            .arg(&self.group)
            .arg(&message.id);
        for (name, value) in message.raw.iter().take(MAX_DEAD_LETTER_FIELDS) {
            cmd.arg(name.as_ref()).arg(value.as_ref());
        }
        cmd.arg("idemgate-reason")
            .arg(reason)
            .arg("idemgate-stream")
            .arg(&self.stream)
            .arg("idemgate-id")
            .arg(&message.id)
            .arg("idemgate-deliveries")
            .arg(message.deliveries);
        self.call(&self.writer, &cmd, self.timeout).await.map(drop)
    }

    async fn release(&self, _message: &Message) -> Result<(), SourceError> {
        // Nothing held here: the entry stays pending in the group, claimed after claim_idle.
        Ok(())
    }

    async fn pending(&self) -> Result<u64, SourceError> {
        let mut cmd = redis::cmd("XPENDING");
        cmd.arg(&self.stream).arg(&self.group);
        match self.call(&self.writer, &cmd, self.timeout).await? {
            Value::Array(summary) => Ok(summary.first().and_then(int).unwrap_or(0)),
            _ => Ok(0),
        }
    }

    fn claim_after(&self) -> Duration {
        self.claim_idle
    }
}

/// `host-pid-random`: unique per instance and per start, so that a restarted instance is a new
/// consumer and what the old one left pending is claimed like any dead consumer's.
fn instance_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "idemgate".to_string());
    let nonce: u32 = rand::random();
    format!("{host}-{}-{nonce:08x}", std::process::id())
}

/// Entries of a stream reply: `[[id, [field, value, ...]], ...]`; deleted entries (a nil
/// field list) are left out.
fn entries(value: Value) -> Vec<(String, Vec<(Bytes, Bytes)>)> {
    let Value::Array(items) = value else {
        return Vec::new();
    };
    items
        .into_iter()
        .filter_map(|item| {
            let Value::Array(mut pair) = item else {
                return None;
            };
            if pair.len() != 2 {
                return None;
            }
            let fields = pair.pop()?;
            let id = text(&pair[0])?;
            let fields = match fields {
                Value::Array(flat) => {
                    let mut out = Vec::with_capacity(flat.len() / 2);
                    let mut it = flat.into_iter();
                    while let (Some(k), Some(v)) = (it.next(), it.next()) {
                        out.push((bytes(k)?, bytes(v)?));
                    }
                    out
                }
                Value::Map(pairs) => pairs
                    .into_iter()
                    .map(|(k, v)| Some((bytes(k)?, bytes(v)?)))
                    .collect::<Option<Vec<_>>>()?,
                _ => return None,
            };
            Some((id, fields))
        })
        .collect()
}

fn bytes(v: Value) -> Option<Bytes> {
    match v {
        Value::BulkString(b) => Some(Bytes::from(b)),
        Value::SimpleString(s) => Some(Bytes::from(s)),
        Value::VerbatimString { text, .. } => Some(Bytes::from(text)),
        _ => None,
    }
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

fn int(v: &Value) -> Option<u64> {
    match v {
        Value::Int(n) => u64::try_from(*n).ok(),
        other => text(other)?.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn entries_keep_field_order_and_skip_deleted_ones() {
        let reply = Value::Array(vec![
            Value::Array(vec![
                bulk("1-0"),
                Value::Array(vec![bulk("b"), bulk("2"), bulk("a"), bulk("1")]),
            ]),
            // XAUTOCLAIM before Redis 7 gave deleted entries as nil fields.
            Value::Array(vec![bulk("2-0"), Value::Nil]),
        ]);
        let got = entries(reply);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].0, "1-0");
        assert_eq!(
            got[0].1,
            vec![
                (Bytes::from("b"), Bytes::from("2")),
                (Bytes::from("a"), Bytes::from("1"))
            ]
        );
    }

    #[test]
    fn instance_names_differ_per_start() {
        let a = instance_name();
        assert!(a.contains(&std::process::id().to_string()));
        assert!(!a.is_empty() && a.len() < 128);
    }
}
