//! `store.min_replicas`: a write is acted on only once that many replicas hold it.
//!
//! Redis replicates asynchronously: a primary that answered a write and then died before its
//! replicas had it takes the write with it, and the promoted replica has never heard of the key.
//! A retry of that key then executes again. So every write is sent in one pipeline with
//! `WAIT min timeout` behind it, on the connection that wrote it (in a cluster, the connection to
//! the node that owns the key's slot), and the reply says how many replicas acknowledged it.
//!
//! What too few acknowledgements mean depends on the write ([`Shortfall`]): a new reservation is
//! given back and the request refused (503) before anything is forwarded; a stored result, an
//! unknown outcome, a renewal, a release or a delete still stand (the upstream has answered, or
//! nothing is forwarded on them), and are counted and logged. After a failover those last ones
//! can fall back to the pending record they replaced, which reads as an unknown outcome: never a
//! second execution.
//!
//! `WAIT` is not consensus. It makes a failover lose no acknowledged write only if the replica
//! promoted is one that acknowledged, which Sentinel and Cluster prefer (the replica with the
//! most recent data) but do not promise; and it blocks the connection it runs on for as long as
//! it waits, so a stalled replica slows every command queued behind it, up to `replica_timeout`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use redis::{Cmd, Pipeline, Script};

use super::conn::RedisConn;
use crate::config::ReplicaAcks;
use crate::store::StoreOp;

/// What a write with fewer acknowledgements than asked for means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shortfall {
    /// The write must not be acted on: give it back and refuse.
    Refuse,
    /// The write stands; count it and say so.
    Note,
}

/// The settings, and the writes that got fewer acknowledgements than asked, by operation.
pub struct Replicas {
    acks: ReplicaAcks,
    missed: [AtomicU64; StoreOp::COUNT],
}

impl Replicas {
    pub fn new(acks: ReplicaAcks) -> Self {
        Replicas {
            acks,
            missed: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }

    pub fn min(&self) -> u32 {
        self.acks.min
    }

    /// How much longer than a plain command an acknowledged one may take.
    pub fn timeout(&self) -> Duration {
        self.acks.timeout
    }

    /// Writes of each operation acknowledged by fewer replicas than `min`, since start.
    pub fn missed(&self) -> [u64; StoreOp::COUNT] {
        std::array::from_fn(|i| self.missed[i].load(Ordering::Relaxed))
    }

    /// Whether `acked` replicas are enough; if not, counts and logs it, saying what it means.
    pub fn enough(&self, op: StoreOp, acked: i64, shortfall: Shortfall) -> bool {
        if acked >= i64::from(self.acks.min) {
            return true;
        }
        self.missed[op as usize].fetch_add(1, Ordering::Relaxed);
        let (min, within) = (self.acks.min, self.acks.timeout);
        match shortfall {
            Shortfall::Refuse => tracing::warn!(
                op = op.as_str(),
                acked,
                min,
                "a new record was acknowledged by {acked} of {min} replicas within {within:?}: given back, and the request refused (503) before anything was forwarded"
            ),
            Shortfall::Note => tracing::warn!(
                op = op.as_str(),
                acked,
                min,
                "a write was acknowledged by {acked} of {min} replicas within {within:?}: it stands, but a failover now could bring back the record it replaced"
            ),
        }
        false
    }

    /// `cmd` followed by `WAIT`, as one pipeline: both go over the same connection, whatever
    /// reconnects in between, so the count is this write's.
    fn pipeline(&self, cmd: Cmd) -> Pipeline {
        let mut pipe = redis::pipe();
        pipe.add_command(cmd);
        pipe.cmd("WAIT")
            .arg(self.acks.min)
            .arg(self.acks.timeout.as_millis().max(1) as u64);
        pipe
    }

    /// Sends `cmd` and waits for the replicas: its reply, and how many acknowledged.
    pub async fn send<T: redis::FromRedisValue>(
        &self,
        conn: &mut RedisConn,
        cmd: Cmd,
    ) -> redis::RedisResult<(T, i64)> {
        self.pipeline(cmd).query_async(conn).await
    }

    /// [`super::conn::eval`] with the replicas' acknowledgement.
    pub async fn eval<T: redis::FromRedisValue>(
        &self,
        conn: &mut RedisConn,
        script: &Script,
        key: &[u8],
        args: &[&[u8]],
    ) -> redis::RedisResult<(T, i64)> {
        let pipe = self.pipeline(super::conn::evalsha(script, key, args));
        match pipe.query_async(conn).await {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                script.load_async(conn).await?;
                pipe.query_async(conn).await
            }
            other => other,
        }
    }
}
