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
//! - [`Store::subscribe`] lets a duplicate wait for the key to change without polling.
//!
//! Backends: [`memory::MemoryStore`] (embedded, one instance) and [`redis::RedisStore`]
//! (shared, one Redis or a Redis Cluster), whose records use [`codec`]. The contract tests in
//! `tests/store_contract.rs` run against every backend.

pub mod codec;
pub mod instrumented;
pub mod memory;
pub mod redis;
pub mod wait;

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};

use crate::fingerprint::Fingerprint;
use crate::key::StoreKey;
pub use wait::Subscription;

/// Proof of ownership of a pending key, random per reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OwnerToken(pub u128);

impl OwnerToken {
    pub fn random() -> Self {
        OwnerToken(rand::random())
    }
}

/// What is stored under a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub fingerprint: Fingerprint,
    /// Wall-clock milliseconds since the Unix epoch (shared by every instance of a shared store).
    pub created_ms: u64,
    pub state: RecordState,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordState {
    /// An owner is executing the request; it renews `lease_until_ms` while it works.
    Pending {
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
    pub body: Bytes,
    /// False when the body was larger than `max_stored_response` (or the store's byte budget) and
    /// only status and headers were kept: a replay must then say so, never pass off an empty body.
    pub body_kept: bool,
    pub completed_ms: u64,
}

impl StoredResponse {
    /// Approximate bytes this response occupies, for the memory bound.
    pub fn size(&self) -> usize {
        self.body.len()
            + self
                .headers
                .iter()
                .map(|(n, v)| n.as_str().len() + v.len() + 16)
                .sum::<usize>()
            + 64
    }
}

/// The answer of an atomic reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reservation {
    /// The key was new: the caller owns it and must complete, mark unknown or release it.
    Owner(OwnerToken),
    /// The key exists: this is its record at the moment of the call.
    Existing(Record),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The caller's token no longer owns the key (it was completed, released or taken over).
    #[error("not the owner of this key (any more)")]
    NotOwner,
    /// The embedded store is at its configured bound and refuses new keys.
    #[error("store is full ({0})")]
    Full(&'static str),
    /// The backend could not be reached or did not answer in time.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// A stored record could not be decoded.
    #[error("stored record is corrupt: {0}")]
    Corrupt(String),
}

/// Every backend implements this; see the module doc for the contract.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Atomically creates a pending record owned by a new token, or returns the existing record.
    /// The record expires after `ttl` whatever happens to its owner.
    async fn reserve(
        &self,
        key: &StoreKey,
        fingerprint: Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Reservation, StoreError>;

    /// The current record, if any.
    async fn get(&self, key: &StoreKey) -> Result<Option<Record>, StoreError>;

    /// [`Store::get`] for a caller that holds a [`Store::subscribe`] subscription and will wait:
    /// if the record is pending, the store is told someone waits, so the end of the pending
    /// state is announced. A shared store announces only then, which spares a message per
    /// request when, as usual, nobody waits. The embedded store always wakes its waiters.
    async fn get_watched(&self, key: &StoreKey) -> Result<Option<Record>, StoreError> {
        self.get(key).await
    }

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
    /// `expected` (compare and set): how a retry takes over an abandoned or unknown key when the
    /// route allows it (`on_unknown = "retry"`). `None` when the record changed meanwhile.
    async fn take_over(
        &self,
        key: &StoreKey,
        expected: &Record,
        fingerprint: Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Option<OwnerToken>, StoreError>;

    /// Deletes a record whoever owns it: for operators, after checking the upstream's records.
    async fn delete(&self, key: &StoreKey) -> Result<bool, StoreError>;

    /// Registers interest in changes to `key`. Subscribe *before* reading the record, so a change
    /// between the read and the wait is never missed.
    fn subscribe(&self, key: &StoreKey) -> Subscription;

    /// Whether the backend can serve requests now (for readiness).
    async fn ping(&self) -> Result<(), StoreError>;

    /// Expired records this process removed so far (backends that expire on their own: 0).
    fn purged(&self) -> u64 {
        0
    }
}

/// A new pending record for a fresh owner.
pub fn pending(fingerprint: Fingerprint, lease: Duration) -> (OwnerToken, Record) {
    let owner = OwnerToken::random();
    let record = Record {
        fingerprint,
        created_ms: now_ms(),
        state: RecordState::Pending {
            owner,
            lease_until_ms: ms_after(lease),
        },
    };
    (owner, record)
}

/// Wall-clock milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// `now_ms() + d`, saturating.
pub fn ms_after(d: Duration) -> u64 {
    now_ms().saturating_add(d.as_millis().min(u64::MAX as u128) as u64)
}

/// Opens the backend named in the config. Never waits for a remote store to be reachable.
pub fn open(config: &crate::config::StoreConfig) -> Result<Arc<dyn Store>, redis::RedisUrlError> {
    Ok(match config {
        crate::config::StoreConfig::Memory {
            max_keys,
            max_bytes,
        } => Arc::new(memory::MemoryStore::new(*max_keys, *max_bytes)),
        crate::config::StoreConfig::Redis(settings) => Arc::new(redis::RedisStore::new(settings)?),
    })
}
