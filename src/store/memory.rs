//! The memory store: one process, records in hash maps split over shards, lost on restart.
//!
//! 64 shards, each a map behind its own mutex, picked by the (uniformly distributed) hashed key:
//! requests for different keys rarely wait on each other, and growing a map (a rehash) stalls one
//! shard's keys instead of every request.
//!
//! Bounded by `max_keys` and `max_bytes` (counted across shards): at the bound it refuses *new*
//! keys (the gateway answers 503) rather than evicting live ones, which would let a retry execute
//! again. Concurrent reservations may overshoot the bound by at most one record each. A completed
//! response that no longer fits the byte budget is kept without its body (and replays say so).
//! Expired records are invisible at once and are purged by a background task once a second; the
//! task holds only a weak reference and ends with the store. Everything is lost on restart: use the
//! Redis store when that matters or when more than one instance runs.
//!
//! Every worker shares the one store ([`Store::for_worker`] hands out the same maps).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::time::Instant;

use super::changes::Waiters;
use super::codec::{self, Seal};
use super::seal::Sealer;
use super::{
    ms_after, now_ms, Bound, Claim, OwnerToken, Record, RecordState, Reservation, ScanPage,
    Scanned, Store, StoreError, StoreStats, StoredResponse, UnknownReason, Watch,
};
use crate::key::StoreKey;

/// Hashes a [`StoreKey`] for the shard maps. The key is already a SHA-256 output, so one
/// multiply is enough to spread it; the per-process random seed keeps anyone who grinds keys
/// from aiming them at one bucket. SipHash, the default, costs far more for nothing here
/// (bench/README.md, "bench/callgrind").
#[derive(Clone, Copy)]
struct KeyHasher {
    seed: u64,
}

impl Default for KeyHasher {
    fn default() -> Self {
        static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
        let seed = *SEED.get_or_init(|| {
            use std::hash::BuildHasher;
            std::collections::hash_map::RandomState::new().hash_one(0x6964_656d_6761_7465u64)
        });
        KeyHasher { seed }
    }
}

impl std::hash::BuildHasher for KeyHasher {
    type Hasher = SeededHasher;

    fn build_hasher(&self) -> SeededHasher {
        SeededHasher(self.seed)
    }
}

struct SeededHasher(u64);

impl std::hash::Hasher for SeededHasher {
    fn write(&mut self, bytes: &[u8]) {
        // Not used by StoreKey (it writes one u64); kept correct for any other input.
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .rotate_left(29);
    }

    fn finish(&self) -> u64 {
        self.0.wrapping_mul(0xbf58_476d_1ce4_e5b9)
    }
}

/// Fixed cost charged per record against `max_bytes`, besides its response.
const RECORD_OVERHEAD: usize = 256;
const PURGE_INTERVAL: Duration = Duration::from_secs(1);
const SHARDS: usize = 64;

/// Cheap to clone: every clone is the same store.
#[derive(Clone)]
pub struct MemoryStore {
    shared: Arc<Shared>,
}

struct Shared {
    shards: Box<[Mutex<Inner>]>,
    counts: Counts,
    waiters: Waiters,
    max_keys: usize,
    max_bytes: u64,
    /// `store.encryption_keys_*`: completed records' answers and open records' origins sealed
    /// ([`super::seal`]).
    sealer: Option<Arc<Sealer>>,
}

/// Totals across shards, for the bounds and metrics.
#[derive(Default)]
struct Counts {
    keys: AtomicUsize,
    bytes: AtomicU64,
    purged: AtomicU64,
}

#[derive(Default)]
struct Inner {
    map: HashMap<StoreKey, Entry, KeyHasher>,
    /// Expiry times; an item is stale when its entry is gone or has another `generation`.
    expiry: BinaryHeap<Reverse<(Instant, u64, StoreKey)>>,
    next_generation: u64,
}

struct Entry {
    held: Held,
    expires_at: Instant,
    /// Changes when the key is removed and reserved again, so stale heap items can be told apart.
    generation: u64,
    size: u64,
}

/// A record as this store keeps it. Pending and unknown records stay as they are: small, and a
/// pending one is rewritten by every lease renewal. A completed one, which lives for the whole
/// `ttl`, is kept as its encoded bytes ([`super::codec`]): one allocation instead of several, and
/// much less memory, which under a stream of new keys is most of what this store costs
/// (bench/README.md, "bench/run"). Reads decode it; header values and body then share that one
/// buffer.
///
/// A record held as is is boxed, so that every key's map slot stays small (a test holds it to 96
/// bytes): under new keys that is less memory to touch for every request than the allocation costs.
///
/// With keys (`store.encryption_keys_*`), an open record's origin (route and client key) is
/// held sealed beside it, as the shared stores keep it.
enum Held {
    /// The record, and its origin sealed apart (then the record's own is `None`).
    Record(Box<(Record, Option<Bytes>)>),
    Encoded(Bytes),
}

impl Held {
    /// An open record as held: its origin sealed apart when `seal` seals.
    fn open(mut record: Record, seal: Seal) -> Held {
        let sealed = match (seal.seals(&record.sealing), &record.origin) {
            (true, Some(origin)) => codec::encode_origin(origin, seal).map(Bytes::from),
            _ => None,
        };
        if sealed.is_some() {
            record.origin = None;
        }
        Held::Record(Box::new((record, sealed)))
    }

    fn record(&self, seal: Seal) -> Result<Record, StoreError> {
        match self {
            Held::Record(open) => match &open.1 {
                None => Ok(open.0.clone()),
                Some(origin) => {
                    let lease = match open.0.state {
                        RecordState::Pending { lease_until_ms, .. } => Some(lease_until_ms),
                        _ => None,
                    };
                    let (origin, sealing) =
                        codec::decode_origin(origin, seal).map_err(|e| codec::leased(e, lease))?;
                    Ok(Record {
                        origin,
                        sealing,
                        ..open.0.clone()
                    })
                }
            },
            Held::Encoded(raw) => codec::decode(raw, seal),
        }
    }
}

impl MemoryStore {
    /// Creates the store and starts its purge task (so it must be called inside a tokio runtime).
    pub fn new(max_keys: usize, max_bytes: u64) -> Self {
        Self::sealed(max_keys, max_bytes, None)
    }

    /// [`MemoryStore::new`], sealing answers and origins with `sealer`'s keys.
    pub fn sealed(max_keys: usize, max_bytes: u64, sealer: Option<Arc<Sealer>>) -> Self {
        let shared = Arc::new(Shared {
            shards: (0..SHARDS).map(|_| Mutex::new(Inner::default())).collect(),
            counts: Counts::default(),
            waiters: Waiters::new(),
            max_keys,
            max_bytes,
            sealer,
        });
        tokio::spawn(purge_loop(Arc::downgrade(&shared)));
        MemoryStore { shared }
    }

    /// Records currently held (expired ones included until purged).
    pub fn len(&self) -> usize {
        self.shared.counts.keys.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How the record under `key` is sealed.
    fn seal<'a>(&'a self, key: &'a StoreKey) -> Seal<'a> {
        self.shared.seal(key)
    }
}

impl Shared {
    fn seal<'a>(&'a self, key: &'a StoreKey) -> Seal<'a> {
        Seal::new(self.sealer.as_deref(), key)
    }

    fn shard(&self, key: &StoreKey) -> MutexGuard<'_, Inner> {
        lock(&self.shards[key.shard(SHARDS)])
    }

    fn purge_all(&self, now: Instant) {
        for shard in self.shards.iter() {
            lock(shard).purge_expired(now, &self.counts);
        }
    }

    /// Which bound one more record of `size` bytes would break, if any.
    fn over_bound(&self, size: u64) -> Option<Bound> {
        if self.counts.keys.load(Ordering::Relaxed) >= self.max_keys {
            Some(Bound::MaxKeys)
        } else if self.counts.bytes.load(Ordering::Relaxed) + size > self.max_bytes {
            Some(Bound::MaxBytes)
        } else {
            None
        }
    }

    /// Reserves `key` in its shard unless it exists or a bound is reached.
    fn try_reserve(
        &self,
        key: &StoreKey,
        claim: &Claim,
        lease: Duration,
        ttl: Duration,
        now: Instant,
    ) -> Result<Reservation, StoreError> {
        let size = pending_size(claim);
        let mut inner = self.shard(key);
        if let Some(e) = inner.live(key, now, &self.counts) {
            return Ok(Reservation::Existing(
                e.held.record(self.seal(key))?.checked_lease(),
            ));
        }
        if let Some(which) = self.over_bound(size) {
            return Err(StoreError::Full(which));
        }
        let (owner, record) = super::pending(claim, lease);
        let held = Held::open(record, self.seal(key));
        inner.insert(*key, held, deadline(ttl), size, &self.counts);
        Ok(Reservation::Owner(owner))
    }

    /// The unknown outcomes after `after`, in key order, at most `want`; and whether more
    /// follow. Reads every shard (it is memory): a page sorts what is unknown, not everything.
    fn open_after(&self, after: Option<StoreKey>, want: usize) -> (Vec<Scanned>, bool) {
        let (now, wall) = (Instant::now(), now_ms());
        let mut found: Vec<Scanned> = Vec::new();
        for shard in &self.shards {
            let inner = lock(shard);
            for (key, entry) in &inner.map {
                // Completed records are kept encoded; only open ones as records.
                let Held::Record(open) = &entry.held else {
                    continue;
                };
                let record = &open.0;
                let unknown = match record.state {
                    RecordState::Unknown { .. } => true,
                    RecordState::Pending { lease_until_ms, .. } => lease_until_ms < wall,
                    _ => false,
                };
                if unknown && entry.expires_at > now && after.is_none_or(|a| *key > a) {
                    let left = entry.expires_at.saturating_duration_since(now);
                    // With its origin, opened; one the keys do not open is not listed.
                    let whole = match entry.held.record(self.seal(key)) {
                        Ok(whole) => whole,
                        Err(e) => {
                            tracing::warn!(id = key.hex(), error = %e, "listing: a record that does not open with this gateway's keys (GET /keys/{{id}})");
                            continue;
                        }
                    };
                    found.push(Scanned {
                        key: *key,
                        record: whole.checked_lease_at(wall),
                        expires_ms: Some(wall.saturating_add(left.as_millis() as u64)),
                    });
                }
            }
            drop(inner);
            // Only the first `want` + 1 can matter: keep the list that short as it grows.
            if found.len() > 2 * want + 64 {
                found.sort_unstable_by_key(|s| s.key);
                found.truncate(want + 1);
            }
        }
        found.sort_unstable_by_key(|s| s.key);
        let more = found.len() > want;
        found.truncate(want);
        (found, more)
    }
}

/// What a pending record counts against `max_bytes`: its origin is kept with it.
fn pending_size(claim: &Claim) -> u64 {
    let origin = claim
        .origin
        .as_deref()
        .map_or(0, |o| o.name.len() + o.key.len());
    (RECORD_OVERHEAD + origin) as u64
}

fn lock(m: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    // A panic while holding the lock cannot leave a half-written entry (every mutation is a
    // single insert or remove), so a poisoned lock is still consistent.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Inner {
    /// The live entry for `key`; an expired one is removed on the spot.
    fn live(&mut self, key: &StoreKey, now: Instant, counts: &Counts) -> Option<&mut Entry> {
        if self.map.get(key).is_some_and(|e| e.expires_at <= now) {
            self.remove(key, counts);
            counts.purged.fetch_add(1, Ordering::Relaxed);
        }
        self.map.get_mut(key)
    }

    /// Stores `held` under `key`. A key that is already there keeps its generation and its item
    /// in the expiry heap, which the purge re-files at the later expiry when it comes up: one
    /// heap item per key, not one per write.
    fn insert(
        &mut self,
        key: StoreKey,
        held: Held,
        expires_at: Instant,
        size: u64,
        counts: &Counts,
    ) {
        counts.bytes.fetch_add(size, Ordering::Relaxed);
        if let Some(entry) = self.map.get_mut(&key) {
            counts.bytes.fetch_sub(entry.size, Ordering::Relaxed);
            // Expiry only moves later (every write sets now + ttl), so the old item still fires
            // first.
            entry.expires_at = entry.expires_at.max(expires_at);
            entry.held = held;
            entry.size = size;
            return;
        }
        let generation = self.next_generation;
        self.next_generation += 1;
        self.expiry.push(Reverse((expires_at, generation, key)));
        // Released records leave stale heap items until their old expiry: rebuild once they
        // outnumber the live ones, so the heap stays proportional to the map.
        if self.expiry.len() > 2 * self.map.len() + 64 {
            self.expiry = self
                .map
                .iter()
                .map(|(k, e)| Reverse((e.expires_at, e.generation, *k)))
                .collect();
        }
        counts.keys.fetch_add(1, Ordering::Relaxed);
        self.map.insert(
            key,
            Entry {
                held,
                expires_at,
                generation,
                size,
            },
        );
    }

    fn remove(&mut self, key: &StoreKey, counts: &Counts) -> Option<Entry> {
        let e = self.map.remove(key)?;
        counts.bytes.fetch_sub(e.size, Ordering::Relaxed);
        counts.keys.fetch_sub(1, Ordering::Relaxed);
        Some(e)
    }

    /// The pending record owned by `owner` and its entry's size, or `NotOwner`.
    fn owned(
        &mut self,
        key: &StoreKey,
        owner: OwnerToken,
        now: Instant,
        counts: &Counts,
    ) -> Result<(&mut Record, u64), StoreError> {
        match self.live(key, now, counts) {
            Some(Entry {
                held: Held::Record(open),
                size,
                ..
            }) if matches!(open.0.state, RecordState::Pending { owner: o, .. } if o == owner) => {
                Ok((&mut open.0, *size))
            }
            _ => Err(StoreError::NotOwner),
        }
    }

    fn purge_expired(&mut self, now: Instant, counts: &Counts) {
        while let Some(Reverse((at, generation, _))) = self.expiry.peek() {
            if *at > now {
                break;
            }
            let (generation, key) = (*generation, self.expiry.pop().map(|Reverse((_, _, k))| k));
            let Some(key) = key else { break };
            match self.map.get(&key) {
                Some(e) if e.generation == generation && e.expires_at <= now => {
                    self.remove(&key, counts);
                    counts.purged.fetch_add(1, Ordering::Relaxed);
                }
                // Written again since it was filed: file it at its current expiry.
                Some(e) if e.generation == generation => {
                    self.expiry.push(Reverse((e.expires_at, generation, key)));
                }
                _ => {}
            }
        }
    }
}

async fn purge_loop(shared: Weak<Shared>) {
    let mut tick = tokio::time::interval(PURGE_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        shared.purge_all(Instant::now());
    }
}

fn deadline(ttl: Duration) -> Instant {
    // Far-future TTLs saturate instead of overflowing.
    let now = Instant::now();
    now.checked_add(ttl)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}

#[async_trait]
impl Store for MemoryStore {
    async fn reserve(
        &self,
        key: &StoreKey,
        claim: &Claim,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Reservation, StoreError> {
        let now = Instant::now();
        match self.shared.try_reserve(key, claim, lease, ttl, now) {
            Err(StoreError::Full(_)) => {
                // At a bound: purge what has expired (no shard lock held, as the purge takes
                // every shard's), then try once more.
                self.shared.purge_all(now);
                self.shared.try_reserve(key, claim, lease, ttl, now)
            }
            other => other,
        }
    }

    async fn take_over(
        &self,
        key: &StoreKey,
        expected: &Record,
        claim: &Claim,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Option<OwnerToken>, StoreError> {
        let counts = &self.shared.counts;
        let mut inner = self.shared.shard(key);
        match inner.live(key, Instant::now(), counts) {
            Some(e)
                if e.held
                    .record(self.seal(key))
                    .is_ok_and(|r| r.checked_lease() == *expected) => {}
            _ => return Ok(None),
        }
        let (owner, record) = super::pending(claim, lease);
        let held = Held::open(record, self.seal(key));
        inner.insert(*key, held, deadline(ttl), pending_size(claim), counts);
        Ok(Some(owner))
    }

    async fn expires_ms(&self, key: &StoreKey) -> Result<Option<u64>, StoreError> {
        let mut inner = self.shared.shard(key);
        let now = Instant::now();
        let left = (inner.live(key, now, &self.shared.counts))
            .map(|e| e.expires_at.saturating_duration_since(now));
        Ok(left.map(|left| now_ms().saturating_add(left.as_millis() as u64)))
    }

    async fn get(&self, key: &StoreKey) -> Result<Option<Record>, StoreError> {
        let mut inner = self.shared.shard(key);
        inner
            .live(key, Instant::now(), &self.shared.counts)
            .map(|e| e.held.record(self.seal(key)).map(|r| r.checked_lease()))
            .transpose()
    }

    async fn watch(&self, key: &StoreKey) -> Result<Watch, StoreError> {
        // Every change here wakes the key's waiters, so subscribing is all watching takes.
        let changes = self.shared.waiters.subscribe(key);
        let record = self.get(key).await?;
        Ok(Watch { record, changes })
    }

    async fn complete(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        mut response: StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        {
            let counts = &self.shared.counts;
            let mut inner = self.shared.shard(key);
            let (pending, old_size) = inner.owned(key, owner, Instant::now(), counts)?;
            let (fingerprint, created_ms) = (pending.fingerprint, pending.created_ms);
            // The upstream already executed: the record must be stored whatever the budget says,
            // so at the byte bound only the body is dropped (and the replay says so).
            let others = counts
                .bytes
                .load(Ordering::Relaxed)
                .saturating_sub(old_size);
            let budget = self.shared.max_bytes.saturating_sub(others);
            let mut size = (RECORD_OVERHEAD + response.size()) as u64;
            if size > budget && response.body_kept {
                size -= response.body.len() as u64;
                response.body = Bytes::new();
                response.body_kept = false;
            }
            let record = Record {
                fingerprint,
                created_ms,
                state: RecordState::Completed(Arc::new(response)),
                origin: None,
                sealing: super::seal::Sealing::New,
            };
            let encoded = codec::encode(&record, self.seal(key));
            inner.insert(*key, Held::Encoded(encoded), deadline(ttl), size, counts);
        }
        self.shared.waiters.notify(key);
        Ok(())
    }

    async fn mark_unknown(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        reason: UnknownReason,
    ) -> Result<(), StoreError> {
        {
            let mut inner = self.shared.shard(key);
            let (pending, _) = inner.owned(key, owner, Instant::now(), &self.shared.counts)?;
            pending.state = RecordState::Unknown {
                since_ms: now_ms(),
                reason,
            };
        }
        self.shared.waiters.notify(key);
        Ok(())
    }

    async fn release(&self, key: &StoreKey, owner: OwnerToken) -> Result<(), StoreError> {
        {
            let counts = &self.shared.counts;
            let mut inner = self.shared.shard(key);
            inner.owned(key, owner, Instant::now(), counts)?;
            inner.remove(key, counts);
        }
        self.shared.waiters.notify(key);
        Ok(())
    }

    async fn renew(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let mut inner = self.shared.shard(key);
        let (pending, _) = inner.owned(key, owner, Instant::now(), &self.shared.counts)?;
        pending.state = RecordState::Pending {
            owner,
            lease_until_ms: ms_after(lease),
        };
        Ok(())
    }

    async fn delete(&self, key: &StoreKey) -> Result<bool, StoreError> {
        let removed = self
            .shared
            .shard(key)
            .remove(key, &self.shared.counts)
            .is_some();
        if removed {
            self.shared.waiters.notify(key);
        }
        Ok(removed)
    }

    async fn scan_unknown(
        &self,
        cursor: Option<&str>,
        want: usize,
    ) -> Result<ScanPage, StoreError> {
        let after = super::after_cursor(cursor)?;
        let (records, more) = self.shared.open_after(after, want);
        let cursor = more.then(|| records.last().map(|r| r.key.hex())).flatten();
        Ok(ScanPage { records, cursor })
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }

    async fn flush(&self) -> Result<(), StoreError> {
        // Nothing outlives the process anyway.
        Ok(())
    }

    fn fill(&self) -> Option<f64> {
        let shared = &self.shared;
        let keys =
            shared.counts.keys.load(Ordering::Relaxed) as f64 / shared.max_keys.max(1) as f64;
        let bytes =
            shared.counts.bytes.load(Ordering::Relaxed) as f64 / shared.max_bytes.max(1) as f64;
        Some(keys.max(bytes))
    }

    fn max_clock_skew(&self) -> Duration {
        // One process writes and reads it: one clock.
        Duration::ZERO
    }

    fn system(&self) -> &'static str {
        "memory"
    }

    fn stats(&self) -> StoreStats {
        StoreStats {
            purged: self.shared.counts.purged.load(Ordering::Relaxed),
            syncs: 0,
            ..StoreStats::default()
        }
    }

    fn for_worker(&self) -> Arc<dyn Store> {
        Arc::new(self.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::Fingerprint;
    use crate::key::ClientScope;

    fn key(k: &str) -> StoreKey {
        StoreKey::new(&ClientScope::from_value(b"c"), "r", k)
    }

    fn response(body: &'static [u8]) -> StoredResponse {
        StoredResponse {
            trailers: vec![],
            status: http::StatusCode::CREATED,
            headers: vec![],
            body: Bytes::from_static(body),
            body_kept: true,
            completed_ms: 0,
            link: None,
        }
    }

    async fn own(s: &MemoryStore, k: &str, ttl: Duration) -> OwnerToken {
        match s
            .reserve(
                &key(k),
                &Fingerprint([0; 32]).into(),
                Duration::from_secs(30),
                ttl,
            )
            .await
            .unwrap()
        {
            Reservation::Owner(t) => t,
            other => panic!("expected to own {k}, got {other:?}"),
        }
    }

    #[test]
    fn a_map_slot_stays_small() {
        // Every key kept costs its slot (over a table at most 7/8 full): see `Held`.
        assert!(std::mem::size_of::<(StoreKey, Entry)>() <= 96);
    }

    #[test]
    fn the_key_hasher_spreads_keys_and_depends_on_its_seed() {
        use std::hash::BuildHasher;
        let keys: Vec<StoreKey> = (0..1000).map(|i| key(&i.to_string())).collect();
        let a = KeyHasher { seed: 1 };
        let b = KeyHasher { seed: 2 };
        // The low 7 bits pick hashbrown's group, the top 7 its tag: both must vary.
        let low: std::collections::HashSet<u64> =
            keys.iter().map(|k| a.hash_one(k) & 0x7f).collect();
        let top: std::collections::HashSet<u64> =
            keys.iter().map(|k| a.hash_one(k) >> 57).collect();
        assert!(
            low.len() > 100 && top.len() > 100,
            "{} {}",
            low.len(),
            top.len()
        );
        assert!(keys.iter().all(|k| a.hash_one(k) != b.hash_one(k)));
    }

    /// With keys, what a completed record keeps is sealed: its bytes show neither body nor
    /// headers, and it reads back whole.
    #[tokio::test]
    async fn a_completed_record_is_kept_sealed() {
        let keys = "k1:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
        let sealer = Arc::new(Sealer::parse(keys).unwrap());
        let s = MemoryStore::sealed(10, 1 << 20, Some(sealer));
        let t = own(&s, "a", Duration::from_secs(60)).await;
        let mut answer = response(b"card-4242-body");
        answer.headers = vec![(
            http::HeaderName::from_static("x-card"),
            http::HeaderValue::from_static("4242-header"),
        )];
        s.complete(&key("a"), t, answer.clone(), Duration::from_secs(60))
            .await
            .unwrap();
        let held = match &s.shared.shard(&key("a")).map[&key("a")].held {
            Held::Encoded(raw) => raw.clone(),
            Held::Record(..) => panic!("a completed record is kept encoded"),
        };
        assert!(!held.windows(4).any(|w| w == b"4242"), "{held:?}");
        let read = s.get(&key("a")).await.unwrap().unwrap();
        assert_eq!(read.state, RecordState::Completed(Arc::new(answer)));
        // An open record's origin, the key the client sent, is held sealed too.
        let origin = crate::store::Origin::new(
            crate::store::OriginKind::Route,
            "payments",
            "client-key-4242".into(),
        );
        let claim = Claim {
            fingerprint: Fingerprint([0; 32]),
            origin: Some(origin.clone()),
        };
        let ttl = Duration::from_secs(60);
        s.reserve(&key("b"), &claim, ttl, ttl).await.unwrap();
        match &s.shared.shard(&key("b")).map[&key("b")].held {
            Held::Record(open) if open.1.is_some() => {
                let (record, sealed) = (&open.0, open.1.as_ref().unwrap());
                assert_eq!(record.origin, None);
                assert!(!sealed.windows(4).any(|w| w == b"4242"), "{sealed:?}");
            }
            _ => panic!("an open record's origin is held sealed"),
        }
        let read = s.get(&key("b")).await.unwrap().unwrap();
        assert_eq!(read.origin, Some(origin));
    }

    #[tokio::test(start_paused = true)]
    async fn records_expire_after_ttl_and_are_purged() {
        let s = MemoryStore::new(10, 1 << 20);
        let t = own(&s, "a", Duration::from_secs(60)).await;
        s.complete(&key("a"), t, response(b"x"), Duration::from_secs(60))
            .await
            .unwrap();
        tokio::time::advance(Duration::from_secs(59)).await;
        assert!(s.get(&key("a")).await.unwrap().is_some());
        tokio::time::advance(Duration::from_secs(2)).await;
        // Purge runs on its own timer; give it a tick.
        tokio::time::sleep(PURGE_INTERVAL).await;
        assert_eq!(s.len(), 0, "the purge task removed the expired record");
        assert_eq!(s.stats().purged, 1);
        assert!(s.get(&key("a")).await.unwrap().is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_completed_record_lives_ttl_from_completion_with_one_heap_item() {
        let s = MemoryStore::new(10, 1 << 20);
        let t = own(&s, "a", Duration::from_secs(60)).await;
        tokio::time::advance(Duration::from_secs(20)).await;
        let stored = StoredResponse {
            trailers: vec![],
            headers: vec![(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/json"),
            )],
            ..response(b"{\"id\":1}")
        };
        s.complete(&key("a"), t, stored.clone(), Duration::from_secs(60))
            .await
            .unwrap();
        let heap_items = s.shared.shard(&key("a")).expiry.len();
        assert_eq!(heap_items, 1, "completing did not add a heap item");
        // Past the reservation's expiry (60 s), within the completion's (80 s).
        tokio::time::advance(Duration::from_secs(50)).await;
        tokio::time::sleep(PURGE_INTERVAL).await;
        match s.get(&key("a")).await.unwrap() {
            Some(Record {
                state: RecordState::Completed(r),
                ..
            }) => assert_eq!(*r, stored, "what was stored reads back the same"),
            other => panic!("expected the completed record, got {other:?}"),
        }
        tokio::time::advance(Duration::from_secs(11)).await;
        tokio::time::sleep(PURGE_INTERVAL).await;
        assert_eq!(s.len(), 0);
        assert_eq!(s.stats().purged, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn pending_records_live_for_the_full_ttl() {
        let s = MemoryStore::new(10, 1 << 20);
        own(&s, "a", Duration::from_secs(3600)).await;
        tokio::time::advance(Duration::from_secs(600)).await;
        assert!(matches!(
            s.reserve(
                &key("a"),
                &Fingerprint([0; 32]).into(),
                Duration::from_secs(30),
                Duration::from_secs(3600)
            )
            .await
            .unwrap(),
            Reservation::Existing(Record {
                state: RecordState::Pending { .. },
                ..
            })
        ));
    }

    #[tokio::test]
    async fn at_max_keys_new_keys_are_refused_and_live_ones_kept() {
        let s = MemoryStore::new(2, 1 << 20);
        own(&s, "a", Duration::from_secs(60)).await;
        own(&s, "b", Duration::from_secs(60)).await;
        let err = s
            .reserve(
                &key("c"),
                &Fingerprint([0; 32]).into(),
                Duration::from_secs(30),
                Duration::from_secs(60),
            )
            .await
            .unwrap_err();
        assert_eq!(err, StoreError::Full(Bound::MaxKeys));
        assert!(s.get(&key("a")).await.unwrap().is_some());
        assert!(s.get(&key("b")).await.unwrap().is_some());
    }

    #[tokio::test]
    async fn released_keys_do_not_accumulate_in_the_expiry_heap() {
        let s = MemoryStore::new(100_000, 1 << 30);
        for i in 0..20_000 {
            let t = own(&s, &format!("k{i}"), Duration::from_secs(3600)).await;
            s.release(&key(&format!("k{i}")), t).await.unwrap();
        }
        let heap_items: usize = s.shared.shards.iter().map(|m| lock(m).expiry.len()).sum();
        assert!(heap_items < 20_000, "{heap_items} stale expiry items kept");
        assert!(s.is_empty());
    }

    #[tokio::test]
    async fn stored_bodies_do_not_pin_larger_buffers() {
        let s = MemoryStore::new(10, 1 << 20);
        let t = own(&s, "a", Duration::from_secs(60)).await;
        let big = Bytes::from(vec![7u8; 64 * 1024]);
        let mut r = response(b"");
        r.body = big.slice(0..10);
        s.complete(&key("a"), t, r, Duration::from_secs(60))
            .await
            .unwrap();
        let RecordState::Completed(stored) = s.get(&key("a")).await.unwrap().unwrap().state else {
            panic!()
        };
        assert_eq!(stored.body, Bytes::from(vec![7u8; 10]));
        // Had the store kept the slice, `big` would not be the only holder of its buffer.
        assert!(big.is_unique(), "the store pins the 64 KiB buffer");
    }

    #[tokio::test]
    async fn at_max_bytes_the_body_is_dropped_not_the_record() {
        let s = MemoryStore::new(10, 600);
        let t = own(&s, "a", Duration::from_secs(60)).await;
        s.complete(
            &key("a"),
            t,
            response(&[b'x'; 1000]),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
        match s.get(&key("a")).await.unwrap().unwrap().state {
            RecordState::Completed(r) => {
                assert!(!r.body_kept);
                assert!(r.body.is_empty());
                assert_eq!(r.status, http::StatusCode::CREATED);
            }
            other => panic!("{other:?}"),
        }
    }
}
