//! The disk store: one instance, durable. Every key survives a restart, `kill -9` and an OOM
//! kill, with no server to run. Built on fjall, an embedded log-structured key-value store with
//! a checksummed journal and atomic write batches (chosen over redb, which was slower on this
//! workload with the same fsyncs: bench/README.md, "bench/embedded-stores").
//!
//! - One directory, opened by one process at a time (fjall locks it; a second process is refused
//!   at startup with a message that says why).
//! - Every change goes through one writer thread, which applies whatever has queued up as one
//!   atomic batch with one fsync of the journal (group commit) and only then answers: under
//!   concurrent load, many requests share one fsync. The writer is also what makes `reserve`
//!   atomic (insert if absent).
//! - What reaches the disk before the caller hears back: a new pending record always (the
//!   request is forwarded only after); a result, an unknown outcome, a release or a delete with
//!   `sync = "always"`; with `sync = "batch"`, those within `sync_interval`, so a crash in that
//!   window reads back as the pending record it was, then as abandoned (`outcome-unknown`), never
//!   as "no record". Lease renewals are never synced: after a crash every lease is over anyway.
//! - Reads (get, watch, and `reserve` of a key that already exists: every replay) run on the
//!   caller's thread, without a hop to the writer, on the snapshot the writer publishes after
//!   each batch is as durable as promised: never on a result that a crash could take back.
//! - A caller that goes away while its reservation is on its way releases it
//!   ([`ReleaseOnDrop`]): nothing was forwarded, so the key must not stay pending.
//! - Each record is kept with its expiry (wall clock, so it holds across restarts) and filed once
//!   in an expiry index (a rewrite that moves the expiry later is filed again when the old entry
//!   comes up); the writer purges what expired in small passes between its batches, and fjall's
//!   compaction gives the space back.
//!   `max_disk` bounds the bytes of the records kept: at the bound new keys are refused (503),
//!   live ones never evicted, and room comes back as records expire.
//! - A read or write error fails the call (`Unavailable`: the route's `on_store_error` decides);
//!   after a failed write (a full disk) fjall takes no more writes, so readiness stays false until
//!   the gateway restarts and recovers the journal. A record that cannot be decoded, or data that
//!   fails its checksum, is `Corrupt` (`outcome-unknown`): nothing ever reads as "no record".

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant as StdInstant};

use async_trait::async_trait;
use bytes::{BufMut, Bytes, BytesMut};
use std::collections::HashMap;

use fjall::{Database, Keyspace, KeyspaceCreateOptions, OwnedWriteBatch, PersistMode};
use tokio::sync::{mpsc, oneshot};

use super::codec;
use super::wait::Waiters;
use super::{
    ms_after, now_ms, Bound, OpenError, OwnerToken, Record, RecordState, Reservation, Store,
    StoreError, StoreStats, StoredResponse, UnknownReason, Watch,
};
use crate::config::{DiskSettings, SyncMode};
use crate::fingerprint::Fingerprint;
use crate::key::StoreKey;

/// Keyspace of the records: key -> expiry (ms since the epoch, big endian) then codec bytes.
const RECORDS: &str = "records";
/// Keyspace of the expiry index: expiry (big endian) then key -> nothing, in expiry order.
const EXPIRY: &str = "expiry";
/// The journal's size at most, before fjall flushes it into tables: the smallest it allows, so
/// the directory stays close to what `max_disk` counts.
const MAX_JOURNAL: u64 = 64 << 20;

/// Bytes counted per record against `max_disk` besides its key and value: its expiry entry and
/// the B-tree's bookkeeping.
const RECORD_OVERHEAD: u64 = 128;
/// Changes queued for the writer at most; past that, callers wait for room.
const QUEUE: usize = 4096;
/// Changes applied in one transaction at most, so one batch never holds the others up for long.
const MAX_BATCH: usize = 1024;
/// How often the writer purges expired records (and, with `sync = "batch"`, how often at least
/// it checks whether a sync is due).
const TICK: Duration = Duration::from_secs(1);
/// Expired records removed in one purge pass at most. A pass runs after a batch once a tick, and
/// after every batch while expired records are left over: small passes keep any one batch's
/// callers from waiting behind a long purge, and keep up with new keys (a pass per batch).
const PURGE_CHUNK: usize = 64;
/// How long one purge runs at most, chunk after chunk, before the writer takes the next batch.
const PURGE_BUDGET: Duration = Duration::from_millis(2);

/// A handle to the store; every clone is the same store.
#[derive(Clone)]
pub struct DiskStore {
    shared: Arc<Shared>,
}

struct Shared {
    db: Arc<Db>,
    /// To the writer thread; closed when the last handle goes, which ends the writer.
    writer: mpsc::Sender<Job>,
    waiters: Waiters,
    counters: Arc<Counters>,
    /// Joined when the last handle goes, so the file is released once the store is dropped
    /// (a process may open the directory again, as the restart tests do).
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

#[derive(Default)]
struct Counters {
    purged: AtomicU64,
    syncs: AtomicU64,
    /// Bytes of records kept, as counted against `max_disk`.
    used: AtomicU64,
    /// A batch failed to write (a full disk, an I/O error). fjall takes no write after that, so
    /// neither does the store: readiness says so until a restart.
    failing: std::sync::atomic::AtomicBool,
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Dropping the sender (a field, dropped after this) ends the writer; close it first so
        // the join below does not wait for ever.
        let (closed, _) = mpsc::channel(1);
        drop(std::mem::replace(&mut self.writer, closed));
        let thread = self
            .thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

/// The database and its two keyspaces.
struct Db {
    db: Database,
    records: Keyspace,
    expiry: Keyspace,
    /// What readers see: the database as of the last batch whose changes are as durable as
    /// promised (synced, or with `sync = "batch"` committed). A batch is visible in fjall as soon
    /// as it is committed, before its fsync; read from there, a duplicate could be answered with
    /// a result that a crash then takes back.
    published: arc_swap::ArcSwap<fjall::Snapshot>,
}

impl Db {
    fn publish(&self) {
        self.published.store(Arc::new(self.db.snapshot()));
    }
}

/// What the writer is asked to do.
// Jobs pass through a bounded queue once each; boxing the large one would cost an allocation per
// change for nothing.
#[allow(clippy::large_enum_variant)]
enum Job {
    /// One change, and where its answer goes.
    Change {
        key: StoreKey,
        change: Change,
        reply: oneshot::Sender<Result<Done, StoreError>>,
    },
    /// The ticker: time to purge, or to sync (`sync = "batch"`).
    Tick,
    /// Sync whatever is not yet synced, then answer (at shutdown, [`Store::flush`]).
    Flush(oneshot::Sender<Result<Done, StoreError>>),
}

enum Change {
    /// The pending record and its owner are made by the caller, so that a caller that goes
    /// away before the answer can release what it may have reserved ([`ReleaseOnDrop`]).
    Reserve {
        owner: OwnerToken,
        record: Record,
        ttl: Duration,
    },
    Complete {
        owner: OwnerToken,
        response: StoredResponse,
        ttl: Duration,
    },
    MarkUnknown {
        owner: OwnerToken,
        reason: UnknownReason,
    },
    Release {
        owner: OwnerToken,
    },
    Renew {
        owner: OwnerToken,
        lease: Duration,
    },
    TakeOver {
        expected: Record,
        owner: OwnerToken,
        record: Record,
        ttl: Duration,
    },
    Delete,
}

enum Done {
    Reserved(Reservation),
    /// Owner-only changes: done (or `NotOwner` as an error).
    Changed,
    TakenOver(Option<OwnerToken>),
    Deleted(bool),
}

impl DiskStore {
    /// Opens (creating if need be) the store in `settings.path` and starts its writer thread and
    /// ticker, so it must be called inside a tokio runtime.
    pub fn open(settings: &DiskSettings) -> Result<Self, OpenError> {
        let dir = &settings.path;
        let fail = |reason: String| OpenError::Disk {
            path: dir.clone(),
            reason,
        };
        std::fs::create_dir_all(dir).map_err(|e| {
            fail(format!(
                "cannot create the directory ({e}); create it, or give the gateway's user write access to its parent"
            ))
        })?;
        let opened = Database::builder(dir)
            .max_journaling_size(MAX_JOURNAL)
            // Flushes and compactions in the background; one thread is plenty for this load
            // and leaves the cores to the requests.
            .worker_threads(1)
            .open()
            .and_then(|db| {
                let records = db.keyspace(RECORDS, KeyspaceCreateOptions::default)?;
                let expiry = db.keyspace(EXPIRY, KeyspaceCreateOptions::default)?;
                let published = arc_swap::ArcSwap::from_pointee(db.snapshot());
                Ok(Db {
                    db,
                    records,
                    expiry,
                    published,
                })
            });
        let db = opened.map_err(|e| match e {
            fjall::Error::Locked => fail(
                "another process has it open: one directory serves one gateway process (stop the other one, give this one its own path, or use backend = \"redis\" for several instances)"
                    .into(),
            ),
            e => fail(format!(
                "cannot open it ({e}); check its permissions and the disk, or move it aside to start with an empty store"
            )),
        })?;
        let used = prepare(&db).map_err(|e| fail(format!("cannot read the records ({e})")))?;
        let db = Arc::new(db);
        let counters = Arc::new(Counters {
            used: AtomicU64::new(used),
            ..Counters::default()
        });
        let waiters = Waiters::new();
        let (tx, rx) = mpsc::channel(QUEUE);
        let writer = Writer {
            db: Arc::clone(&db),
            counters: Arc::clone(&counters),
            waiters: waiters.clone(),
            sync: settings.sync,
            max_disk: settings.max_disk,
            unsynced_since: None,
            purged_to: None,
            purged_at: 0,
        };
        let thread = std::thread::Builder::new()
            .name("idemgate-disk".into())
            .spawn(move || writer.run(rx))
            .map_err(|e| fail(format!("cannot start the writer thread ({e})")))?;
        tokio::spawn(tick(tx.downgrade(), settings.sync));
        Ok(DiskStore {
            shared: Arc::new(Shared {
                db,
                writer: tx,
                waiters,
                counters,
                thread: Mutex::new(Some(thread)),
            }),
        })
    }

    /// Bytes of records kept, as counted against `max_disk`.
    pub fn used(&self) -> u64 {
        self.shared.counters.used.load(Ordering::Relaxed)
    }

    async fn submit(&self, key: &StoreKey, change: Change) -> Result<Done, StoreError> {
        let (reply, answer) = oneshot::channel();
        let job = Job::Change {
            key: *key,
            change,
            reply,
        };
        if self.shared.writer.send(job).await.is_err() {
            return Err(StoreError::Unavailable(
                "the disk store's writer stopped".into(),
            ));
        }
        answer.await.unwrap_or_else(|_| {
            Err(StoreError::Unavailable(
                "disk: the change was not kept (a write of its batch failed; see the log)".into(),
            ))
        })
    }

    /// The live record for `key` as last published ([`Db::published`]), read on the caller's
    /// thread.
    fn read(&self, key: &StoreKey) -> Result<Option<Record>, StoreError> {
        use fjall::Readable;
        let snapshot = self.shared.db.published.load();
        let Some(value) = snapshot
            .get(&self.shared.db.records, key.as_bytes())
            .map_err(read_error)?
        else {
            return Ok(None);
        };
        let (expires_at, raw) = split(&value)?;
        if expires_at <= now_ms() {
            return Ok(None);
        }
        Ok(Some(
            codec::decode(&Bytes::copy_from_slice(raw))?.checked_lease(),
        ))
    }
}

/// Releases a reservation whose answer never reached its caller (the caller's future was
/// dropped, as when an HTTP client hangs up while the writer syncs), unless disarmed. Without
/// it the key would stay pending, then read as abandoned, for its whole `ttl`, though nothing
/// was forwarded. The writer takes changes in order, so the release comes after the reservation;
/// if the reservation found the key taken, the release is refused as not the owner's.
struct ReleaseOnDrop {
    armed: Option<(mpsc::Sender<Job>, StoreKey, OwnerToken)>,
}

impl ReleaseOnDrop {
    fn new(store: &DiskStore, key: &StoreKey, owner: OwnerToken) -> Self {
        ReleaseOnDrop {
            armed: Some((store.shared.writer.clone(), *key, owner)),
        }
    }

    fn disarm(mut self) {
        self.armed = None;
    }
}

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        let Some((writer, key, owner)) = self.armed.take() else {
            return;
        };
        let (reply, _) = oneshot::channel();
        let job = Job::Change {
            key,
            change: Change::Release { owner },
            reply,
        };
        if let Err(mpsc::error::TrySendError::Full(job)) = writer.try_send(job) {
            // The queue is full: wait for room in the background rather than here.
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(async move {
                    let _ = writer.send(job).await;
                });
            }
        }
    }
}

/// Counts the bytes of the records kept.
fn prepare(db: &Db) -> Result<u64, fjall::Error> {
    let mut used = 0;
    for entry in db.records.iter() {
        let (k, v) = entry.into_inner()?;
        used += cost(k.len(), v.len());
    }
    Ok(used)
}

fn cost(key_len: usize, value_len: usize) -> u64 {
    (key_len + value_len) as u64 + RECORD_OVERHEAD
}

/// Expiry and codec bytes of a stored value.
fn split(value: &[u8]) -> Result<(u64, &[u8]), StoreError> {
    if value.len() < 8 {
        return Err(StoreError::Corrupt("record shorter than its expiry".into()));
    }
    let (at, raw) = value.split_at(8);
    let mut be = [0u8; 8];
    be.copy_from_slice(at);
    Ok((u64::from_be_bytes(be), raw))
}

fn stored_value(expires_at: u64, raw: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(8 + raw.len());
    v.extend_from_slice(&expires_at.to_be_bytes());
    v.extend_from_slice(raw);
    v
}

fn expiry_key(expires_at: u64, key: &[u8]) -> Vec<u8> {
    let mut k = BytesMut::with_capacity(8 + key.len());
    k.put_u64(expires_at);
    k.put_slice(key);
    k.to_vec()
}

fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(format!("disk: {e}"))
}

/// A failed read: data that fails its checksum or cannot be decoded is `Corrupt` (its outcome is
/// unknown, and it must never be run again, whatever `on_store_error` says); anything else is the
/// store being unavailable.
fn read_error(e: fjall::Error) -> StoreError {
    use fjall::LsmError;
    match e {
        fjall::Error::Storage(
            LsmError::ChecksumMismatch { .. }
            | LsmError::InvalidTag(_)
            | LsmError::InvalidTrailer
            | LsmError::InvalidHeader(_)
            | LsmError::Decompress(_),
        )
        | fjall::Error::Decompress(_)
        | fjall::Error::InvalidTrailer
        | fjall::Error::InvalidTag(_) => StoreError::Corrupt(format!("disk: {e}")),
        e => unavailable(e),
    }
}

/// Wakes the writer once a tick (purge; with `sync = "batch"`, the sync that is due) until the
/// store is gone.
async fn tick(writer: mpsc::WeakSender<Job>, sync: SyncMode) {
    // With `sync = "batch"`, ticks at half the interval and a sync due at half of it: whatever
    // the phase, a change waits at most `interval` for its sync.
    let period = match sync {
        SyncMode::Always => TICK,
        SyncMode::Batch { interval } => (interval / 2).clamp(Duration::from_millis(1), TICK),
    };
    let mut timer = tokio::time::interval(period);
    timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        timer.tick().await;
        let Some(tx) = writer.upgrade() else { return };
        // A full queue means the writer is busy and will look at the time soon anyway.
        let _ = tx.try_send(Job::Tick);
    }
}

/// The writer thread's state.
struct Writer {
    db: Arc<Db>,
    counters: Arc<Counters>,
    waiters: Waiters,
    sync: SyncMode,
    max_disk: u64,
    /// When a change was last committed without a sync (`sync = "batch"`), if one is pending.
    unsynced_since: Option<StdInstant>,
    /// The last expiry entry purged: the next pass starts after it. From the start, every pass
    /// would step over the tombstones of all it removed before (until compaction drops them),
    /// which made purging quadratic. New entries always sort after it: they expire in the
    /// future, and it is in the past.
    purged_to: Option<Vec<u8>>,
    /// The wall clock at the last purge, to notice it stepping back.
    purged_at: u64,
}

/// What one batch did, to apply once it is committed.
#[derive(Default)]
struct Effects {
    purged: u64,
    /// Keys whose waiters must re-read once the batch is visible.
    wake: Vec<StoreKey>,
    /// Some change in the batch must be on disk before its caller hears back.
    sync: bool,
}

impl Writer {
    fn run(mut self, mut rx: mpsc::Receiver<Job>) {
        let mut last_purge = StdInstant::now();
        // The last purge pass stopped at its chunk with more expired records left.
        let mut backlog = false;
        let mut last_len = 0;
        while let Some(first) = rx.blocking_recv() {
            let mut jobs = Vec::with_capacity(16);
            jobs.push(first);
            // Under load (the last batch shared its sync), the queue is empty only for a moment:
            // yielding the core once lets the workers queue what they are about to, so one
            // sync covers more changes. Measured (bench/run): 0.11 fsyncs a request instead of
            // 0.16, throughput unchanged within the noise. A lone change (idle store) never
            // waits for it.
            let mut yielded = false;
            while jobs.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(j) => jobs.push(j),
                    Err(_) if !yielded && last_len > 1 => {
                        yielded = true;
                        std::thread::yield_now();
                    }
                    Err(_) => break,
                }
            }
            last_len = jobs.len();
            self.batch(jobs);
            if backlog || last_purge.elapsed() >= TICK {
                last_purge = StdInstant::now();
                backlog = self.purge();
            }
        }
        // Closing: whatever was committed without a sync goes to disk now.
        if self.unsynced_since.is_some() {
            let _ = self.sync_now();
        }
    }

    fn sync_now(&mut self) -> Result<(), fjall::Error> {
        self.db.db.persist(PersistMode::SyncData)?;
        self.counters.syncs.fetch_add(1, Ordering::Relaxed);
        self.unsynced_since = None;
        Ok(())
    }

    /// Applies `jobs` as one atomic batch, commits it (with one fsync if any needs it), answers.
    fn batch(&mut self, jobs: Vec<Job>) {
        type Reply = oneshot::Sender<Result<Done, StoreError>>;
        let mut effects = Effects::default();
        let mut answers: Vec<(Reply, Result<Done, StoreError>)> = Vec::with_capacity(jobs.len());
        let mut used = self.counters.used.load(Ordering::Relaxed) as i64;
        let committed = (|| -> Result<bool, String> {
            let mut tables = Tables {
                db: &self.db,
                batch: self.db.db.batch(),
                written: HashMap::new(),
            };
            let now = now_ms();
            for job in jobs {
                let (key, change, reply) = match job {
                    Job::Change { key, change, reply } => (key, change, reply),
                    Job::Flush(reply) => {
                        effects.sync = true;
                        answers.push((reply, Ok(Done::Changed)));
                        continue;
                    }
                    Job::Tick => continue,
                };
                let result = self.apply(&mut tables, &key, change, now, &mut used, &mut effects);
                // A failed read leaves the batch in doubt: none of it is kept.
                if let Err(StoreError::Unavailable(e)) = &result {
                    return Err(e.clone());
                }
                answers.push((reply, result));
            }
            let due = match self.sync {
                SyncMode::Always => false,
                SyncMode::Batch { interval } => self
                    .unsynced_since
                    .is_some_and(|t| t.elapsed() >= interval / 2),
            };
            let durable = effects.sync || due;
            tables.batch.commit().map_err(|e| e.to_string())?;
            if durable {
                // fdatasync: the journal's data and what is needed to read it back (its size),
                // without the metadata (times) a full fsync also writes.
                self.db
                    .db
                    .persist(PersistMode::SyncData)
                    .map_err(|e| e.to_string())?;
            }
            Ok(durable)
        })();
        match committed {
            Ok(durable) => {
                // Readers see the batch only now: synced if it had to be.
                self.db.publish();
                if durable {
                    self.counters.syncs.fetch_add(1, Ordering::Relaxed);
                    self.unsynced_since = None;
                } else if self.unsynced_since.is_none() && !answers.is_empty() {
                    self.unsynced_since = Some(StdInstant::now());
                }
                self.counters
                    .used
                    .store(used.max(0) as u64, Ordering::Relaxed);
                self.counters
                    .purged
                    .fetch_add(effects.purged, Ordering::Relaxed);
                for (reply, result) in answers {
                    let _ = reply.send(result);
                }
                for key in &effects.wake {
                    self.waiters.notify(key);
                }
            }
            Err(e) => {
                // The batch may be applied (a failed fsync) or not (a failed write): either
                // way its callers are told the store failed, and a retry re-reads what is there.
                // fjall refuses every write after a failed one (its journal may be torn): the
                // store stays failed, and readiness says so, until the gateway restarts and
                // recovers the journal.
                tracing::error!(error = %e, "disk store: a write failed; the store refuses writes until the gateway restarts");
                self.counters.failing.store(true, Ordering::Relaxed);
                let msg = format!("disk: {e}");
                for (reply, _) in answers {
                    let _ = reply.send(Err(StoreError::Unavailable(msg.clone())));
                }
            }
        }
    }

    /// Whether a change of this kind must be on disk before its caller hears back.
    fn must_sync(&self, change: &Change) -> bool {
        match change {
            // The request is forwarded right after: its pending record must survive a crash.
            Change::Reserve { .. } | Change::TakeOver { .. } => true,
            Change::Renew { .. } => false,
            _ => self.sync == SyncMode::Always,
        }
    }

    fn apply(
        &self,
        t: &mut Tables<'_>,
        key: &StoreKey,
        change: Change,
        now: u64,
        used: &mut i64,
        effects: &mut Effects,
    ) -> Result<Done, StoreError> {
        let k = key.as_bytes().as_slice();
        let current = t.live(k, now, used, effects)?;
        // The stored value's length, for the `max_disk` count: known here, not read again.
        let old_len = current.as_ref().map(|(_, raw)| 8 + raw.len());
        let sync = self.must_sync(&change);
        let done = match change {
            Change::Reserve { owner, record, ttl } => {
                if let Some((_, raw)) = current {
                    let record = codec::decode(&raw)?.checked_lease();
                    return Ok(Done::Reserved(Reservation::Existing(record)));
                }
                let raw = codec::encode(&record);
                let size = cost(k.len(), 8 + raw.len()) as i64;
                if *used + size > self.max_disk as i64 {
                    return Err(StoreError::Full(Bound::MaxDisk));
                }
                t.put(k, None, ms_after(ttl), &raw, used);
                Done::Reserved(Reservation::Owner(owner))
            }
            Change::Complete {
                owner,
                mut response,
                ttl,
            } => {
                // The upstream already executed: the result is kept whatever the bound says,
                // but past `max_disk` without its body (a replay then says so), as the memory
                // store does at `max_bytes`.
                let others = *used - old_len.map_or(0, |len| cost(k.len(), len) as i64);
                let full = cost(k.len(), 8 + 64 + response.size()) as i64;
                if others + full > self.max_disk as i64 && response.body_kept {
                    response.body = Bytes::new();
                    response.body_kept = false;
                }
                let state = RecordState::Completed(Arc::new(response));
                t.rewrite_owned(k, current, owner, Some(ms_after(ttl)), state, used)?;
                effects.wake.push(*key);
                Done::Changed
            }
            Change::MarkUnknown { owner, reason } => {
                let state = RecordState::Unknown {
                    since_ms: now_ms(),
                    reason,
                };
                t.rewrite_owned(k, current, owner, None, state, used)?;
                effects.wake.push(*key);
                Done::Changed
            }
            Change::Release { owner } => {
                owned(current, owner)?;
                t.remove(k, old_len, used);
                effects.wake.push(*key);
                Done::Changed
            }
            Change::Renew { owner, lease } => {
                let state = RecordState::Pending {
                    owner,
                    lease_until_ms: ms_after(lease),
                };
                t.rewrite_owned(k, current, owner, None, state, used)?;
                Done::Changed
            }
            Change::TakeOver {
                expected,
                owner,
                record,
                ttl,
            } => {
                let Some((expires_at, raw)) = current else {
                    return Ok(Done::TakenOver(None));
                };
                if codec::decode(&raw)?.checked_lease() != expected {
                    return Ok(Done::TakenOver(None));
                }
                t.put(
                    k,
                    Some((expires_at, old_len.unwrap_or(0))),
                    ms_after(ttl),
                    &codec::encode(&record),
                    used,
                );
                Done::TakenOver(Some(owner))
            }
            Change::Delete => match current {
                None => Done::Deleted(false),
                Some(_) => {
                    t.remove(k, old_len, used);
                    effects.wake.push(*key);
                    Done::Deleted(true)
                }
            },
        };
        effects.sync |= sync;
        Ok(done)
    }

    /// Purges in chunks for at most [`PURGE_BUDGET`], so a backlog (after a burst, or a
    /// restart) is worked off quickly without holding the next batch up for long; says whether
    /// expired records were left.
    fn purge(&mut self) -> bool {
        let started = StdInstant::now();
        loop {
            let more = self.purge_chunk();
            if !more || started.elapsed() >= PURGE_BUDGET {
                return more;
            }
        }
    }

    /// Removes what expired, oldest first, up to [`PURGE_CHUNK`], as a batch of its own; says
    /// whether it stopped at the chunk (more may be due).
    fn purge_chunk(&mut self) -> bool {
        let now = now_ms();
        // A wall clock stepped back: entries filed since may sort before the cursor.
        if now < self.purged_at {
            self.purged_to = None;
        }
        self.purged_at = now;
        let end = expiry_key(now, &[0xff; 32]);
        let mut batch = self.db.db.batch();
        let mut purged = 0u64;
        let mut freed = 0u64;
        let mut seen = 0;
        let mut last = None;
        // A key filed twice (released, then reserved again) is purged once.
        let mut handled = std::collections::HashSet::new();
        let from = match &self.purged_to {
            Some(k) => std::ops::Bound::Excluded(k.clone()),
            None => std::ops::Bound::Unbounded,
        };
        let scanned = (|| -> Result<(), fjall::Error> {
            let range: (std::ops::Bound<Vec<u8>>, _) = (from, std::ops::Bound::Included(end));
            for entry in self.db.expiry.range(range).take(PURGE_CHUNK) {
                seen += 1;
                let filed_key = entry.key()?;
                last = Some(filed_key.to_vec());
                batch.remove(&self.db.expiry, filed_key.clone());
                let key = &filed_key[8..];
                if !handled.insert(key.to_vec()) {
                    continue;
                }
                // The record as it is now: gone (released, deleted), expired, or rewritten since
                // it was filed, with a later expiry: filed again then.
                if let Some(v) = self.db.records.get(key)? {
                    if let Ok((at, _)) = split(&v) {
                        if at <= now {
                            batch.remove(&self.db.records, key.to_vec());
                            freed += cost(key.len(), v.len());
                            purged += 1;
                        } else {
                            batch.insert(&self.db.expiry, expiry_key(at, key), Vec::new());
                        }
                    }
                }
            }
            Ok(())
        })();
        let done = scanned.and_then(|()| batch.commit());
        match done {
            Ok(()) => {
                if last.is_some() {
                    self.purged_to = last;
                }
                let used = self.counters.used.load(Ordering::Relaxed);
                self.counters
                    .used
                    .store(used.saturating_sub(freed), Ordering::Relaxed);
                self.counters.purged.fetch_add(purged, Ordering::Relaxed);
                // Not synced: a purge lost in a crash is done again after the restart.
                if self.unsynced_since.is_none() && purged > 0 {
                    self.unsynced_since = Some(StdInstant::now());
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "disk store: purging expired records failed; retrying later");
                return false;
            }
        }
        seen == PURGE_CHUNK
    }
}

/// The pending record `owner` owns, with its expiry, or `NotOwner`.
fn owned(current: Option<(u64, Bytes)>, owner: OwnerToken) -> Result<(u64, Record), StoreError> {
    let Some((expires_at, raw)) = current else {
        return Err(StoreError::NotOwner);
    };
    let record = codec::decode(&raw)?;
    match record.state {
        RecordState::Pending { owner: o, .. } if o == owner => Ok((expires_at, record)),
        _ => Err(StoreError::NotOwner),
    }
}

/// The keyspaces as one batch sees them: what the batch wrote so far, else what is committed.
struct Tables<'a> {
    db: &'a Db,
    batch: OwnedWriteBatch,
    /// Records this batch wrote (`None`: removed), for the batch's own later reads: a batch is
    /// applied only when it commits.
    written: HashMap<Vec<u8>, Option<Vec<u8>>>,
}

impl Tables<'_> {
    /// The live record under `k`: (expiry, codec bytes). An expired one is removed on the spot.
    fn live(
        &mut self,
        k: &[u8],
        now: u64,
        used: &mut i64,
        effects: &mut Effects,
    ) -> Result<Option<(u64, Bytes)>, StoreError> {
        // One copy of the stored value; the codec bytes are a slice of it.
        let value = match self.written.get(k) {
            Some(v) => v.as_deref().map(Bytes::copy_from_slice),
            None => self
                .db
                .records
                .get(k)
                .map_err(read_error)?
                .map(|v| Bytes::copy_from_slice(&v)),
        };
        let found = match value {
            None => None,
            Some(v) => {
                let (at, _) = split(&v)?;
                Some((at, v.slice(8..)))
            }
        };
        match found {
            Some((at, raw)) if at <= now => {
                self.remove(k, Some(8 + raw.len()), used);
                effects.purged += 1;
                Ok(None)
            }
            other => Ok(other),
        }
    }

    /// Writes `raw` under `k`, expiring at `expires_at`. `old`: the record's expiry and stored
    /// length, if there is one (it is filed already).
    fn put(
        &mut self,
        k: &[u8],
        old: Option<(u64, usize)>,
        expires_at: u64,
        raw: &[u8],
        used: &mut i64,
    ) {
        let value = stored_value(expires_at, raw);
        if let Some((_, len)) = old {
            *used -= cost(k.len(), len) as i64;
        }
        *used += cost(k.len(), value.len()) as i64;
        self.batch
            .insert(&self.db.records, k.to_vec(), value.clone());
        self.written.insert(k.to_vec(), Some(value));
        // A record already filed keeps its entry: a rewrite only moves the expiry later, and the
        // purge files it again at its new expiry when the old one comes up. One index entry per
        // key rather than one removal and one insertion per write.
        if old.is_none() {
            self.batch
                .insert(&self.db.expiry, expiry_key(expires_at, k), Vec::new());
        }
    }

    /// Gives the pending record that `owner` owns the state `state`, expiring at `expires_at`
    /// (`None`: when it did), or answers `NotOwner`.
    fn rewrite_owned(
        &mut self,
        k: &[u8],
        current: Option<(u64, Bytes)>,
        owner: OwnerToken,
        expires_at: Option<u64>,
        state: RecordState,
        used: &mut i64,
    ) -> Result<(), StoreError> {
        let old_len = current.as_ref().map_or(0, |(_, raw)| 8 + raw.len());
        let (old_expiry, pending) = owned(current, owner)?;
        let record = Record { state, ..pending };
        let expires_at = expires_at.unwrap_or(old_expiry);
        self.put(
            k,
            Some((old_expiry, old_len)),
            expires_at,
            &codec::encode(&record),
            used,
        );
        Ok(())
    }

    /// Removes the record under `k` (stored length `old_len`). Its expiry entry stays until it
    /// comes up, and the purge then finds no record (or a newer one, which it files again).
    fn remove(&mut self, k: &[u8], old_len: Option<usize>, used: &mut i64) {
        if let Some(len) = old_len {
            *used -= cost(k.len(), len) as i64;
        }
        self.batch.remove(&self.db.records, k.to_vec());
        self.written.insert(k.to_vec(), None);
    }
}

#[async_trait]
impl Store for DiskStore {
    async fn reserve(
        &self,
        key: &StoreKey,
        fingerprint: Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Reservation, StoreError> {
        // A key that exists (every replay, every duplicate) is answered from a read, without
        // waiting for the writer; only a new key needs the writer's insert-if-absent.
        if let Some(record) = self.read(key)? {
            return Ok(Reservation::Existing(record));
        }
        let (owner, record) = super::pending(fingerprint, lease);
        let guard = ReleaseOnDrop::new(self, key, owner);
        let answer = self
            .submit(key, Change::Reserve { owner, record, ttl })
            .await;
        guard.disarm();
        match answer? {
            Done::Reserved(r) => Ok(r),
            _ => Err(StoreError::Unavailable("disk: unexpected answer".into())),
        }
    }

    async fn get(&self, key: &StoreKey) -> Result<Option<Record>, StoreError> {
        self.read(key)
    }

    async fn watch(&self, key: &StoreKey) -> Result<Watch, StoreError> {
        // The writer wakes a key's waiters after every change that ends a pending state.
        let changes = self.shared.waiters.subscribe(key);
        let record = self.read(key)?;
        Ok(Watch { record, changes })
    }

    async fn complete(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        response: StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.submit(
            key,
            Change::Complete {
                owner,
                response,
                ttl,
            },
        )
        .await
        .map(drop)
    }

    async fn mark_unknown(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        reason: UnknownReason,
    ) -> Result<(), StoreError> {
        self.submit(key, Change::MarkUnknown { owner, reason })
            .await
            .map(drop)
    }

    async fn release(&self, key: &StoreKey, owner: OwnerToken) -> Result<(), StoreError> {
        self.submit(key, Change::Release { owner }).await.map(drop)
    }

    async fn renew(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        self.submit(key, Change::Renew { owner, lease })
            .await
            .map(drop)
    }

    async fn take_over(
        &self,
        key: &StoreKey,
        expected: &Record,
        fingerprint: Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Option<OwnerToken>, StoreError> {
        let (owner, record) = super::pending(fingerprint, lease);
        let guard = ReleaseOnDrop::new(self, key, owner);
        let answer = self
            .submit(
                key,
                Change::TakeOver {
                    expected: expected.clone(),
                    owner,
                    record,
                    ttl,
                },
            )
            .await;
        guard.disarm();
        match answer? {
            Done::TakenOver(t) => Ok(t),
            _ => Err(StoreError::Unavailable("disk: unexpected answer".into())),
        }
    }

    async fn delete(&self, key: &StoreKey) -> Result<bool, StoreError> {
        match self.submit(key, Change::Delete).await? {
            Done::Deleted(d) => Ok(d),
            _ => Err(StoreError::Unavailable("disk: unexpected answer".into())),
        }
    }

    async fn ping(&self) -> Result<(), StoreError> {
        if self.shared.writer.is_closed() {
            return Err(StoreError::Unavailable(
                "the disk store's writer stopped".into(),
            ));
        }
        if self.shared.counters.failing.load(Ordering::Relaxed) {
            return Err(StoreError::Unavailable(
                "disk: a write failed (is the disk full?); restart the gateway once it is fixed"
                    .into(),
            ));
        }
        // A read that goes to the keyspace: it fails once the store cannot be used.
        self.shared.db.records.get([0u8; 32]).map_err(unavailable)?;
        Ok(())
    }

    async fn flush(&self) -> Result<(), StoreError> {
        let (reply, answer) = oneshot::channel();
        if self.shared.writer.send(Job::Flush(reply)).await.is_err() {
            return Err(StoreError::Unavailable(
                "the disk store's writer stopped".into(),
            ));
        }
        match answer.await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(StoreError::Unavailable(
                "disk: the final sync failed; see the log".into(),
            )),
        }
    }

    fn stats(&self) -> StoreStats {
        StoreStats {
            purged: self.shared.counters.purged.load(Ordering::Relaxed),
            syncs: self.shared.counters.syncs.load(Ordering::Relaxed),
            eviction_policy: None,
        }
    }

    fn for_worker(&self) -> Arc<dyn Store> {
        Arc::new(self.clone())
    }
}
