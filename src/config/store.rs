//! `[store]` as the gateway runs it: which backend, and that backend's settings.

use std::time::Duration;

use super::redact_url;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreConfig {
    /// The volatile embedded store: one process, lost on restart, bounded by keys and bytes.
    Memory { max_keys: usize, max_bytes: u64 },
    /// The durable embedded store: one process, every key kept across restarts and crashes.
    Disk(DiskSettings),
    /// A Redis server or cluster shared by every instance.
    Redis(RedisSettings),
    /// A Postgres database shared by every instance.
    Postgres(PostgresSettings),
}

impl StoreConfig {
    /// `max_clock_skew` of a shared store; none for an embedded one (one process, one clock).
    pub fn max_clock_skew(&self) -> std::time::Duration {
        match self {
            StoreConfig::Redis(r) => r.max_clock_skew,
            StoreConfig::Postgres(p) => p.max_clock_skew,
            StoreConfig::Memory { .. } | StoreConfig::Disk(_) => std::time::Duration::ZERO,
        }
    }
}

#[derive(Clone, PartialEq, Eq)]
pub struct PostgresSettings {
    /// A libpq-style URL, perhaps with several hosts and `target_session_attrs=read-write`; it
    /// may carry a password, so it is never printed ([`redact_url`]).
    pub url: String,
    /// The records' table, perhaps schema-qualified; checked to be a plain identifier.
    pub table: String,
    /// Connections of one gateway process, shared out among its worker threads (each has a pool
    /// of `pool_size / workers`, at least 2), besides one for the background purge and one that
    /// listens for notifications.
    pub pool_size: usize,
    /// The gateway's worker threads (`server.workers`), among which `pool_size` is shared out.
    pub workers: usize,
    /// Upper bound for one statement, and for waiting on a connection from the pool.
    pub command_timeout: Duration,
    /// `store.max_clock_skew`: the most the clocks of the instances sharing the store may
    /// differ. A pending record is taken for abandoned, and an unknown outcome looked up, only
    /// this long after the time another instance's clock wrote in it.
    pub max_clock_skew: Duration,
    /// PEM file of the CA that signed the server's certificate; `None` trusts the system's roots.
    pub tls_ca_file: Option<std::path::PathBuf>,
    /// PEM certificate and key presented to a server that verifies its clients.
    pub tls_client: Option<(std::path::PathBuf, std::path::PathBuf)>,
    /// `store.allow_async_commit`: use connections whose `synchronous_commit` is `off` (a crash
    /// of the database may lose reservations already acted on), with a warning, instead of
    /// refusing them.
    pub allow_async_commit: bool,
}

impl std::fmt::Debug for PostgresSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresSettings")
            .field("url", &redact_url(&self.url))
            .field("table", &self.table)
            .field("pool_size", &self.pool_size)
            .field("workers", &self.workers)
            .field("command_timeout", &self.command_timeout)
            .field("max_clock_skew", &self.max_clock_skew)
            .field("tls_ca_file", &self.tls_ca_file)
            .field("tls_client", &self.tls_client)
            .field("allow_async_commit", &self.allow_async_commit)
            .finish()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskSettings {
    /// The directory of the store's file (created if missing).
    pub path: std::path::PathBuf,
    pub sync: SyncMode,
    /// Bytes of records kept at most; new keys are refused beyond.
    pub max_disk: u64,
}

/// When a result reaches the disk, relative to its client's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncMode {
    /// Before the answer (the default): every result a client received survives a crash.
    Always,
    /// Within `interval` after it: a crash in that window turns those results into
    /// `outcome-unknown` answers (never into a second execution), for fewer fsyncs.
    Batch { interval: Duration },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisSettings {
    pub target: RedisTarget,
    /// Prepended to every key and to the pub/sub channel; lets several gateways share a Redis.
    pub key_prefix: String,
    /// Upper bound for one Redis command, so a slow Redis cannot stall requests.
    pub command_timeout: Duration,
    /// `store.max_clock_skew`: the most the clocks of the instances sharing the store may
    /// differ. A pending record is taken for abandoned, and an unknown outcome looked up, only
    /// this long after the time another instance's clock wrote in it.
    pub max_clock_skew: Duration,
    /// PEM file of the CA that signed Redis's certificate (rediss:// with a private CA); `None`
    /// trusts the system's roots.
    pub tls_ca_file: Option<std::path::PathBuf>,
    /// Refuse new keys (503) unless Redis says its `maxmemory-policy` is `noeviction`.
    pub require_noeviction: bool,
    /// PEM certificate and key presented to a Redis that verifies its clients (mTLS).
    pub tls_client: Option<(std::path::PathBuf, std::path::PathBuf)>,
    /// `store.min_replicas` above 0: writes acknowledged by replicas before they are acted on.
    pub replicas: Option<ReplicaAcks>,
}

/// `store.min_replicas` and `replica_timeout`: how many replicas must hold a write (Redis's
/// `WAIT`) before the gateway acts on it, and how long it waits for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaAcks {
    pub min: u32,
    pub timeout: Duration,
}

#[derive(Clone, PartialEq, Eq)]
pub enum RedisTarget {
    /// `redis://[user:password@]host:port[/db]`.
    Single(String),
    /// Seed nodes of a Redis Cluster.
    Cluster(Vec<String>),
    /// The primary named `master`, found through these sentinels and followed through
    /// failovers. The sentinels' URLs carry the credentials, database and TLS (`rediss://`)
    /// used for the sentinels and for the primary alike.
    Sentinel {
        sentinels: Vec<String>,
        master: String,
    },
}

impl std::fmt::Debug for RedisTarget {
    // URLs may carry a password: never print it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RedisTarget::Single(u) => write!(f, "Single({})", redact_url(u)),
            RedisTarget::Cluster(nodes) => {
                let shown: Vec<String> = nodes.iter().map(|u| redact_url(u)).collect();
                write!(f, "Cluster({shown:?})")
            }
            RedisTarget::Sentinel { sentinels, master } => {
                let shown: Vec<String> = sentinels.iter().map(|u| redact_url(u)).collect();
                write!(f, "Sentinel({shown:?}, {master:?})")
            }
        }
    }
}
