//! The store: where each key's record lives, and the contract every backend keeps.
//!
//! A record moves through `Pending` (one owner is executing it) to `Completed` (the response to
//! replay) or `Unknown` (the request reached the upstream but no complete answer came back), or
//! is released (deleted) when the upstream definitely did not execute it. The contract:
//! - [`Store::reserve`] is one atomic insert-if-absent: exactly one caller becomes the owner of a
//!   new key, every other caller gets the existing record in the same call;
//! - `complete`, `mark_unknown`, `release` and `renew` take the owner token and do nothing but
//!   return [`StoreError::NotOwner`] for anyone else, so a late owner can never overwrite;
//! - a pending record lives for the full `ttl`, not just its lease, so a crashed owner's key never
//!   silently vanishes and lets a retry execute again;
//! - a pending record whose lease ran out is read as [`RecordState::Abandoned`]: the store
//!   decides it, on every read. Where the lease was written by another instance's clock (Redis),
//!   it runs out `max_clock_skew` later ([`Record::checked_lease_skewed`]): clocks that differ
//!   by less never make a live owner's record read as abandoned;
//! - [`Store::watch`] reads a record for a caller that will wait on it, and wakes that caller
//!   when the record changes, without polling.
//!
//! Backends: [`disk::DiskStore`] (embedded and durable, one instance), [`memory::MemoryStore`]
//! (embedded, lost on restart), [`redis::RedisStore`] (shared, one Redis or a Redis Cluster) and
//! [`postgres::PostgresStore`] (shared, one table); the disk and Redis stores keep records in
//! the [`codec`]'s form, Postgres its outcomes. A new backend is one
//! module implementing [`Store`], one arm in [`open`], and one more run of the contract suite
//! (`tests/e2e/store_contract.rs`).

pub mod changes;
mod clock;
pub mod codec;
mod complete_later;
pub mod disk;
mod give_back;
pub mod memory;
mod origin;
pub mod postgres;
pub mod redis;
pub mod seal;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};

use crate::config::StoreConfig;
use crate::fingerprint::Fingerprint;
use crate::key::StoreKey;
pub use changes::Subscription;
pub use clock::{millis, ms_after, now_ms};
pub(crate) use complete_later::complete_later;
pub(crate) use give_back::{give_back, give_back_replaced, Replaced};
pub use origin::{Claim, Origin, OriginKind, TraceLink};

/// Proof of ownership of a pending key, random per reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OwnerToken(pub u128);

impl OwnerToken {
    pub fn random() -> Self {
        OwnerToken(rand::random())
    }
}

/// What is stored under a key. Two records are equal when they hold the same, however it was
/// found sealed ([`Record::sealing`] says how to write it, not what it is).
#[derive(Debug, Clone)]
pub struct Record {
    pub fingerprint: Fingerprint,
    /// Wall-clock milliseconds since the Unix epoch (shared by every instance of a shared store).
    pub created_ms: u64,
    pub state: RecordState,
    /// Who asked for it, while its outcome is open; stores drop it once the record completes.
    pub origin: Option<Arc<Origin>>,
    /// How its parts were found sealed ([`seal`]): written again, it is the bytes it was read
    /// from (the stores' compare-and-set compares them).
    pub sealing: seal::Sealing,
}

impl PartialEq for Record {
    fn eq(&self, o: &Record) -> bool {
        let this = (self.fingerprint, self.created_ms, &self.state, &self.origin);
        this == (o.fingerprint, o.created_ms, &o.state, &o.origin)
    }
}
impl Eq for Record {}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordState {
    /// An owner is executing the request; it renews `lease_until_ms` while it works.
    Pending {
        owner: OwnerToken,
        lease_until_ms: u64,
    },
    /// Stored as pending, but the owner's lease ran out without a result (its gateway died
    /// mid-flight): the outcome is unknown. The store decides this when it reads the record
    /// ([`Record::checked_lease`]); it is never written as such.
    Abandoned {
        owner: OwnerToken,
        lease_until_ms: u64,
    },
    /// The upstream answered; this is what every retry gets.
    Completed(Arc<StoredResponse>),
    /// The request was sent but no complete answer came back: it may or may not have run.
    Unknown {
        since_ms: u64,
        reason: UnknownReason,
    },
}

impl Record {
    /// The record as every backend returns it: a pending record whose lease ran out reads as
    /// [`RecordState::Abandoned`]. Backends call this on every record they return, and nothing
    /// outside the store compares leases with clocks. Only a pending record reads the clock.
    pub fn checked_lease(self) -> Record {
        match self.state {
            RecordState::Pending { .. } => self.checked_lease_at(now_ms()),
            _ => self,
        }
    }

    /// [`Record::checked_lease`] for a lease written by another clock, which may be up to
    /// `skew` ahead of this one: it has run out only once it is `skew` past.
    pub fn checked_lease_skewed(self, skew: Duration) -> Record {
        match self.state {
            RecordState::Pending { .. } => self.checked_lease_skewed_at(now_ms(), skew),
            _ => self,
        }
    }

    /// [`Record::checked_lease_skewed`] at `now_ms` (this clock's).
    pub fn checked_lease_skewed_at(self, now_ms: u64, skew: Duration) -> Record {
        self.checked_lease_at(now_ms.saturating_sub(millis(skew)))
    }

    /// Whether nobody knows if it ran: marked unknown, or abandoned (read so by
    /// [`Record::checked_lease`]).
    pub fn is_unknown(&self) -> bool {
        matches!(
            self.state,
            RecordState::Unknown { .. } | RecordState::Abandoned { .. }
        )
    }

    /// [`Record::checked_lease`] at `now_ms`.
    pub fn checked_lease_at(mut self, now_ms: u64) -> Record {
        if let RecordState::Pending {
            owner,
            lease_until_ms,
        } = self.state
        {
            if lease_until_ms < now_ms {
                self.state = RecordState::Abandoned {
                    owner,
                    lease_until_ms,
                };
            }
        }
        self
    }
}

/// Why an outcome is unknown, as retries are told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnknownReason {
    /// No response within `upstream_timeout`.
    Timeout,
    /// The connection failed after the request was sent, or the body was cut off.
    Interrupted,
    /// The owner's lease ran out without a result (the gateway died mid-flight).
    Abandoned,
}

impl UnknownReason {
    pub fn as_str(self) -> &'static str {
        match self {
            UnknownReason::Timeout => "timeout",
            UnknownReason::Interrupted => "interrupted",
            UnknownReason::Abandoned => "abandoned",
        }
    }
}

/// A captured upstream response, replayed byte for byte.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    pub status: StatusCode,
    /// End-to-end headers in their original order; hop-by-hop headers were removed.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The trailers after the body (gRPC's `grpc-status`), usually none.
    pub trailers: Vec<(HeaderName, HeaderValue)>,
    pub body: Bytes,
    /// False when the body was larger than `max_stored_response` (or the store's byte budget) and
    /// only status and headers were kept: a replay must then say so, never pass off an empty body.
    pub body_kept: bool,
    pub completed_ms: u64,
    /// The span of the execution that made this answer, when it was traced: what a replay's
    /// span links to. Never replayed.
    pub link: Option<TraceLink>,
}

impl StoredResponse {
    /// Approximate bytes this response occupies, for the memory bound.
    pub fn size(&self) -> usize {
        self.body.len()
            + self
                .headers
                .iter()
                .chain(&self.trailers)
                .map(|(n, v)| n.as_str().len() + v.len() + 16)
                .sum::<usize>()
            + 64
    }
}

/// Records one [`Store::scan_unknown`] call reads at most, whatever it finds: a page of the
/// operator's listing costs the store a bounded amount of work however large it is.
pub const SCAN_BUDGET: usize = 5_000;

/// One page of [`Store::scan_unknown`].
#[derive(Debug, Default)]
pub struct ScanPage {
    pub records: Vec<Scanned>,
    /// Where the next page starts; `None` once the whole store was read.
    pub cursor: Option<String>,
}

/// A key-ordered store's cursor (the hex id of the last record a page read) as the key to go on
/// after.
pub fn after_cursor(cursor: Option<&str>) -> Result<Option<StoreKey>, StoreError> {
    cursor
        .map(|c| StoreKey::from_hex(c).ok_or(StoreError::BadCursor))
        .transpose()
}

/// A record found by [`Store::scan_unknown`].
#[derive(Debug, Clone)]
pub struct Scanned {
    pub key: StoreKey,
    pub record: Record,
    /// When the record expires (ms since the Unix epoch), where the store can say cheaply.
    pub expires_ms: Option<u64>,
}

/// The answer of an atomic reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reservation {
    /// The key was new: the caller owns it and must complete, mark unknown or release it.
    Owner(OwnerToken),
    /// The key exists: this is its record at the moment of the call.
    Existing(Record),
}

/// A record read by a caller that will wait for it to change ([`Store::watch`]).
pub struct Watch {
    /// The record at the moment of the read (`None`: there is none).
    pub record: Option<Record>,
    /// Fires at the record's next change after the read.
    pub changes: Subscription,
}

/// Which bound of an embedded store refused a new key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    MaxKeys,
    MaxBytes,
    MaxDisk,
}

impl Bound {
    pub fn as_str(self) -> &'static str {
        match self {
            Bound::MaxKeys => "max_keys",
            Bound::MaxBytes => "max_bytes",
            Bound::MaxDisk => "max_disk",
        }
    }
}

impl std::fmt::Display for Bound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The caller's token no longer owns the key (it was completed, released or taken over).
    #[error("not the owner of this key (any more)")]
    NotOwner,
    /// An embedded store is at its configured bound and refuses new keys.
    #[error("store is full ({0})")]
    Full(Bound),
    /// The backend could not be reached or did not answer in time.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// A stored record could not be decoded.
    #[error("stored record is corrupt: {0}")]
    Corrupt(String),
    /// A stored record is sealed and does not open with this gateway's keys (its key is not
    /// listed, the gateway has none, or it was altered): never replayed, never executed.
    /// `key_id`: the key it names (never key material); `lease_until_ms`: a pending record's
    /// lease, from its clear part (while it runs, not even a forced release frees the key).
    #[error("stored record is unreadable: {why}")]
    Unreadable {
        key_id: Option<String>,
        why: String,
        lease_until_ms: Option<u64>,
    },
    /// The store answers, but is not known to keep what it is given (`store.require_noeviction`
    /// and Redis may evict): new keys are refused, never forwarded without idempotency.
    #[error("store refuses new keys: {0}")]
    Unsafe(String),
    /// A listing's cursor that this store did not hand out.
    #[error("not a cursor of this store")]
    BadCursor,
}

impl StoreError {
    /// Whether the store failed (for metrics), as opposed to answering that the caller lost
    /// ownership, which is an answer.
    pub fn is_failure(&self) -> bool {
        !matches!(self, StoreError::NotOwner)
    }
}

/// Why a store could not be opened (a bad setting: nothing remote is contacted at open).
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("invalid Redis URL: {0}")]
    RedisUrl(String),
    #[error("cannot set up a Redis connection: {0}")]
    RedisConnection(String),
    #[error("invalid Postgres settings: {0}")]
    PostgresUrl(String),
    #[error("cannot set up TLS to Postgres: {0}")]
    PostgresTls(String),
    #[error("cannot open the disk store at {path}: {reason}")]
    Disk {
        path: std::path::PathBuf,
        reason: String,
    },
    #[error("cannot read {path} (store.tls_*): {source}")]
    TlsCaFile {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

/// The store calls, as timed and counted in `/metrics` (`op` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreOp {
    Reserve,
    /// [`Store::get`] and [`Store::watch`].
    Get,
    Complete,
    MarkUnknown,
    Release,
    Renew,
    TakeOver,
    Delete,
    Ping,
}

impl StoreOp {
    /// For handles indexed by `op as usize` (`Ping` stays the last variant).
    pub const COUNT: usize = StoreOp::Ping as usize + 1;

    /// Every operation, in `op as usize` order.
    pub const ALL: [StoreOp; StoreOp::COUNT] = [
        StoreOp::Reserve,
        StoreOp::Get,
        StoreOp::Complete,
        StoreOp::MarkUnknown,
        StoreOp::Release,
        StoreOp::Renew,
        StoreOp::TakeOver,
        StoreOp::Delete,
        StoreOp::Ping,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            StoreOp::Reserve => "reserve",
            StoreOp::Get => "get",
            StoreOp::Complete => "complete",
            StoreOp::MarkUnknown => "mark_unknown",
            StoreOp::Release => "release",
            StoreOp::Renew => "renew",
            StoreOp::TakeOver => "take_over",
            StoreOp::Delete => "delete",
            StoreOp::Ping => "ping",
        }
    }

    /// A trace's name for a call of this kind.
    pub fn span_name(self) -> &'static str {
        match self {
            StoreOp::Reserve => "store reserve",
            StoreOp::Get => "store get",
            StoreOp::Complete => "store complete",
            StoreOp::MarkUnknown => "store mark_unknown",
            StoreOp::Release => "store release",
            StoreOp::Renew => "store renew",
            StoreOp::TakeOver => "store take_over",
            StoreOp::Delete => "store delete",
            StoreOp::Ping => "store ping",
        }
    }
}

/// What a store reports about itself for `/metrics`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Expired records this process removed (0 where the backend expires records itself).
    pub purged: u64,
    /// Durable commits (fsyncs) this process made (0 where nothing is written to a local disk).
    pub syncs: u64,
    /// The store's own eviction policy (Redis's `maxmemory-policy`); `None` where there is
    /// none, or it is not known (not read yet, or `CONFIG` disabled).
    pub eviction_policy: Option<String>,
    /// Writes acknowledged by fewer replicas than `store.min_replicas`, by operation
    /// (`StoreOp as usize`); zeros where nothing is replicated or nothing is asked.
    pub replica_acks_missed: [u64; StoreOp::COUNT],
}

/// What a store's own configuration means for readiness.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    Fine,
    /// Ready, but an operator should know this.
    Warning(String),
    /// Not ready, for this reason.
    NotReady(String),
}

/// Every backend implements this; see the module doc for the contract.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Atomically creates a pending record owned by a new token, or returns the existing record.
    /// The record expires after `ttl` whatever happens to its owner.
    async fn reserve(
        &self,
        key: &StoreKey,
        claim: &Claim,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Reservation, StoreError>;

    /// The current record, if any.
    async fn get(&self, key: &StoreKey) -> Result<Option<Record>, StoreError>;

    /// The current record, for a caller that will wait for it to change: the subscription is
    /// made before the read, so a change in between is never missed, and the end of a pending
    /// state is announced to it (a shared store announces only to records read this way, which
    /// spares a message per request when, as usual, nobody waits).
    async fn watch(&self, key: &StoreKey) -> Result<Watch, StoreError>;

    /// Stores the response and keeps it for `ttl` from now. Owner only.
    async fn complete(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        response: StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError>;

    /// Records that the outcome is unknown; the record keeps its original expiry. Owner only.
    async fn mark_unknown(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        reason: UnknownReason,
    ) -> Result<(), StoreError>;

    /// Deletes the record: the upstream did not execute, so a retry may run. Owner only.
    async fn release(&self, key: &StoreKey, owner: OwnerToken) -> Result<(), StoreError>;

    /// Extends the owner's lease to `lease` from now. Owner only.
    async fn renew(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        lease: Duration,
    ) -> Result<(), StoreError>;

    /// Replaces the record with a new pending one owned by a new token, if it is still exactly
    /// `expected` as this store returned it (compare and set): how a retry takes over an
    /// abandoned or unknown key when the route allows it (`on_unknown = "retry"`). `None` when
    /// the record changed meanwhile.
    async fn take_over(
        &self,
        key: &StoreKey,
        expected: &Record,
        claim: &Claim,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Option<OwnerToken>, StoreError>;

    /// Deletes a record whoever owns it: for operators, after checking the upstream's records.
    async fn delete(&self, key: &StoreKey) -> Result<bool, StoreError>;

    /// Up to `want` records whose outcome is unknown (marked unknown, or pending with a lease
    /// that ran out), reading at most [`SCAN_BUDGET`] records from where `cursor` (a previous
    /// page's) left off: the operator API's listing, with no index to keep on the request
    /// path. A page may come back short, or empty, with a cursor to go on; a record written
    /// during a scan may be missed or seen twice. The order is the store's own.
    async fn scan_unknown(&self, cursor: Option<&str>, want: usize)
        -> Result<ScanPage, StoreError>;

    /// Whether the backend can serve requests now (for readiness).
    async fn ping(&self) -> Result<(), StoreError>;

    /// Makes every change this store has answered durable, for a clean shutdown: what a store
    /// syncs later than it answers (the disk store with `sync = "batch"`) is synced now. Stores
    /// that answer only once a change is as durable as it gets have nothing to do.
    async fn flush(&self) -> Result<(), StoreError>;

    /// Counters for `/metrics`.
    fn stats(&self) -> StoreStats;

    /// When `key`'s live record expires (ms since the Unix epoch): the moment a retry would
    /// execute again; `None` when there is no live record. For the operator API's reads.
    async fn expires_ms(&self, key: &StoreKey) -> Result<Option<u64>, StoreError>;

    /// What the store is, as a trace's `db.system` says it: `redis`, `postgresql`, `fjall`
    /// (the disk store), `memory`.
    fn system(&self) -> &'static str;

    /// How full an embedded store is, from 0 to 1 of its tightest bound (`max_keys`,
    /// `max_bytes`, `max_disk`); `None` for a store without a bound the gateway knows (Redis,
    /// Postgres). Kept current without I/O: read on every anonymous new key.
    fn fill(&self) -> Option<f64> {
        None
    }

    /// `store.max_clock_skew`: how far the clock that wrote a time into a record (another
    /// instance's, or the database's) may be from this instance's. None for an embedded store,
    /// which one process reads and writes. Required: a shared backend that forgot it would make
    /// lookups and releases compare another clock's times with no margin.
    fn max_clock_skew(&self) -> Duration;

    /// What the store's own configuration means for readiness (`/readyz`), beyond reaching it.
    fn readiness(&self) -> Readiness {
        Readiness::Fine
    }

    /// A handle to this same store for one worker thread, made on that thread and used only
    /// there: a backend whose connections are driven by the runtime that made them (Redis)
    /// gives each worker its own, so no command hops threads; the disk store gives each worker
    /// an inbox for its writer's answers (one wake-up per batch); the others share themselves.
    fn for_worker(&self) -> Arc<dyn Store>;
}

/// A new pending record for a fresh owner.
pub fn pending(claim: &Claim, lease: Duration) -> (OwnerToken, Record) {
    let owner = OwnerToken::random();
    let record = Record {
        fingerprint: claim.fingerprint,
        created_ms: now_ms(),
        state: RecordState::Pending {
            owner,
            lease_until_ms: ms_after(lease),
        },
        origin: claim.origin.clone(),
        sealing: seal::Sealing::New,
    };
    (owner, record)
}

/// Opens the backend named in the config, sealing what it stores with `sealer`'s keys if
/// given. Never waits for a remote store to be reachable.
pub fn open(
    config: &StoreConfig,
    sealer: Option<Arc<seal::Sealer>>,
) -> Result<Arc<dyn Store>, OpenError> {
    Ok(match config {
        StoreConfig::Memory {
            max_keys,
            max_bytes,
        } => Arc::new(memory::MemoryStore::sealed(*max_keys, *max_bytes, sealer)),
        StoreConfig::Disk(settings) => Arc::new(disk::DiskStore::open(settings, sealer)?),
        StoreConfig::Redis(settings) => Arc::new(redis::RedisStore::new(settings, sealer)?),
        StoreConfig::Postgres(settings) => {
            Arc::new(postgres::PostgresStore::new(settings, sealer)?)
        }
    })
}

#[cfg(test)]
mod tests;
