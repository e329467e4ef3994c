//! The disk store: one instance, durable. Every key survives a restart, `kill -9` and an OOM
//! kill, with no server to run. Built on fjall, an embedded log-structured key-value store with
//! a checksummed journal and atomic write batches (chosen over redb, slower on this workload
//! with the same fsyncs, and RocksDB, no faster: bench/README.md, "bench/embedded-stores").
//!
//! - One directory, opened by one process at a time (fjall locks it; a second process is refused
//!   at startup with a message that says why).
//! - Every change goes through one writer thread, which applies whatever has queued up as one
//!   atomic batch with one fsync of the journal (group commit) and only then answers: under
//!   concurrent load, many requests share one fsync. The writer is also what makes `reserve`
//!   atomic (insert if absent). It remembers what its recent batches wrote ([`recent`]), so a
//!   new key and its result need no read of fjall, and hands each worker a batch's answers at
//!   once ([`Inbox`]).
//! - What reaches the disk before the caller hears back: a new pending record always (the
//!   request is forwarded only after); a result, an unknown outcome, a release or a delete with
//!   `sync = "always"`; with `sync = "batch"`, those within `sync_interval`, so a crash in that
//!   window reads back as the pending record it was, then as abandoned (`outcome-unknown`), never
//!   as "no record". Lease renewals are never synced: after a crash every lease is over anyway.
//! - Reads (get, watch, and `reserve` of a key that already exists: every replay) run on the
//!   caller's thread, without a hop to the writer, on the snapshot the writer publishes after
//!   each batch is as durable as promised: never on a result that a crash could take back.
//! - A caller that goes away while its reservation is on its way releases it
//!   ([`GiveBackOnDrop`]): nothing was forwarded, so the key must not stay pending; one whose
//!   take-over is on its way writes the replaced outcome back, never frees the key.
//! - A reservation's or take-over's lease is stamped when the writer applies it, and again after
//!   the batch's sync if that took over a third of the lease ([`writer`]): a write stall never
//!   publishes a lease that already ran out.
//! - Each record is kept with its expiry (wall clock, so it holds across restarts) and filed once
//!   in an expiry index (a rewrite that moves the expiry later is filed again when the old entry
//!   comes up); the writer purges what expired in small passes between its batches, and fjall's
//!   compaction gives the space back.
//!   `max_disk` bounds the bytes of the records kept: at the bound new keys are refused (503),
//!   live ones never evicted, and room comes back as records expire.
//! - A read or write error fails the call (`Unavailable`: the route's `on_store_error` decides);
//!   a failed read refuses only its own change, and the next one reads again; after a failed
//!   write (a full disk) fjall takes no more writes, so readiness stays false until the gateway
//!   restarts and recovers the journal. A record that cannot be decoded, or data that
//!   fails its checksum, is `Corrupt` (`outcome-unknown`): nothing ever reads as "no record".

mod giveback;
mod purge;
mod recent;
mod scan;
mod writer;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use bytes::{BufMut, Bytes, BytesMut};

use fjall::{Database, Keyspace, KeyspaceCreateOptions};
use tokio::sync::{mpsc, oneshot};

use super::changes::Waiters;
use super::codec::{self, Seal};
use super::seal::Sealer;
use super::{
    now_ms, Claim, OpenError, OwnerToken, Record, Reservation, ScanPage, Store, StoreError,
    StoreStats, StoredResponse, UnknownReason, Watch,
};
use crate::config::DiskSettings;
use crate::key::StoreKey;
use giveback::GiveBackOnDrop;
use writer::{tick, Writer};

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

/// A handle to the store; every clone is the same store.
#[derive(Clone)]
pub struct DiskStore {
    shared: Arc<Shared>,
    /// A worker's handle ([`Store::for_worker`]): where the writer hands its answers.
    inbox: Option<Inbox>,
}

/// Where the writer sends its answer to a change.
type Reply = oneshot::Sender<Result<Done, StoreError>>;

/// The answers of one batch to one worker's callers.
type Answers = Vec<(Reply, Result<Done, StoreError>)>;

/// A worker's inbox for answers: the writer hands over all of a batch's answers to a worker at
/// once, and a task on that worker sends them on. Answered one by one from the writer's
/// thread, each answer woke the worker's event loop with a system call of its own (two per new
/// key, `perf stat` in bench/run), on the one thread every change waits for. Unbounded, but it
/// never holds more than the changes in flight, which the writer's queue and the callers
/// waiting on them bound.
#[derive(Clone)]
struct Inbox(mpsc::UnboundedSender<Answers>);

impl Inbox {
    /// An inbox served by a task on the current runtime, if there is one.
    fn on_this_runtime() -> Option<Self> {
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        let (tx, mut rx) = mpsc::unbounded_channel::<Answers>();
        // Ends once every handle with this inbox is gone.
        runtime.spawn(async move {
            while let Some(answers) = rx.recv().await {
                for (reply, result) in answers {
                    let _ = reply.send(result);
                }
            }
        });
        Some(Inbox(tx))
    }
}

struct Shared {
    db: Arc<Db>,
    /// To the writer thread; closed when the last handle goes, which ends the writer.
    writer: mpsc::Sender<Job>,
    waiters: Waiters,
    counters: Arc<Counters>,
    /// `max_disk`, for [`Store::fill`].
    max_disk: u64,
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
    published: arc_swap::ArcSwap<Published>,
    /// `store.encryption_keys_*`: records' answers and origins sealed ([`super::seal`]).
    sealer: Option<Arc<Sealer>>,
}

/// A snapshot readers may use, and the number of the writer's batch it ends with.
struct Published {
    snapshot: fjall::Snapshot,
    batch: u64,
}

impl Db {
    /// How the record under `key` is sealed.
    fn seal<'a>(&'a self, key: &'a StoreKey) -> Seal<'a> {
        Seal::new(self.sealer.as_deref(), key)
    }

    fn publish(&self, batch: u64) {
        self.published.store(Arc::new(Published {
            snapshot: self.db.snapshot(),
            batch,
        }));
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
        reply: Reply,
        /// Answered through this worker's inbox, if the caller is a worker.
        inbox: Option<Inbox>,
    },
    /// The ticker: time to purge, or to sync (`sync = "batch"`).
    Tick,
    /// Sync whatever is not yet synced, then answer (at shutdown, [`Store::flush`]).
    Flush(Reply),
}

enum Change {
    /// The pending record and its owner are made by the caller, so that a caller that goes
    /// away before the answer can release what it may have reserved ([`GiveBackOnDrop`]). Its
    /// lease is stamped when the writer applies it (`lease` from then), not when the caller
    /// queued it: a write stall must not publish a record whose lease already ran out.
    Reserve {
        owner: OwnerToken,
        record: Record,
        lease: Duration,
        ttl: Duration,
        /// The published batch in whose snapshot the caller found no record for the key: the
        /// writer then need not read fjall unless a later batch wrote it ([`recent`]).
        absent_at: Option<u64>,
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
    /// Its lease is stamped when applied, as a reservation's.
    TakeOver {
        expected: Record,
        owner: OwnerToken,
        record: Record,
        lease: Duration,
        ttl: Duration,
    },
    Delete,
}

impl Change {
    /// See [`Change::Reserve`]'s `absent_at`.
    fn absent_at(&self) -> Option<u64> {
        match self {
            Change::Reserve { absent_at, .. } => *absent_at,
            _ => None,
        }
    }
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
    pub fn open(settings: &DiskSettings, sealer: Option<Arc<Sealer>>) -> Result<Self, OpenError> {
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
                let published = arc_swap::ArcSwap::from_pointee(Published {
                    snapshot: db.snapshot(),
                    batch: 0,
                });
                Ok(Db {
                    db,
                    records,
                    expiry,
                    published,
                    sealer,
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
        let writer = Writer::new(
            Arc::clone(&db),
            Arc::clone(&counters),
            waiters.clone(),
            settings,
        );
        let thread = std::thread::Builder::new()
            .name("idemgate-disk".into())
            .spawn(move || writer.run(rx))
            .map_err(|e| fail(format!("cannot start the writer thread ({e})")))?;
        tokio::spawn(tick(tx.downgrade(), settings.sync));
        Ok(DiskStore {
            inbox: None,
            shared: Arc::new(Shared {
                db,
                writer: tx,
                waiters,
                counters,
                max_disk: settings.max_disk,
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
            inbox: self.inbox.clone(),
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
        self.read_at(key).map(|(record, _)| record)
    }

    /// [`Self::read`], and when there is no record at all (not even an expired one), the number
    /// of the batch whose snapshot says so.
    fn read_at(&self, key: &StoreKey) -> Result<(Option<Record>, Option<u64>), StoreError> {
        use fjall::Readable;
        let published = self.shared.db.published.load();
        let Some(value) = published
            .snapshot
            .get(&self.shared.db.records, key.as_bytes())
            .map_err(read_error)?
        else {
            return Ok((None, Some(published.batch)));
        };
        let (expires_at, raw) = split(&value)?;
        if expires_at <= now_ms() {
            return Ok((None, None));
        }
        let record =
            codec::decode(&Bytes::copy_from_slice(raw), self.shared.db.seal(key))?.checked_lease();
        Ok((Some(record), None))
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

#[async_trait]
impl Store for DiskStore {
    async fn reserve(
        &self,
        key: &StoreKey,
        claim: &Claim,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Reservation, StoreError> {
        // A key that exists (every replay, every duplicate) is answered from a read, without
        // waiting for the writer; only a new key needs the writer's insert-if-absent.
        let (found, absent_at) = self.read_at(key)?;
        if let Some(record) = found {
            return Ok(Reservation::Existing(record));
        }
        let (owner, record) = super::pending(claim, lease);
        let guard = GiveBackOnDrop::release(self, key, owner);
        let change = Change::Reserve {
            owner,
            record,
            lease,
            ttl,
            absent_at,
        };
        let answer = self.submit(key, change).await;
        guard.disarm();
        match answer? {
            Done::Reserved(r) => Ok(r),
            _ => Err(StoreError::Unavailable("disk: unexpected answer".into())),
        }
    }

    async fn get(&self, key: &StoreKey) -> Result<Option<Record>, StoreError> {
        self.read(key)
    }

    async fn expires_ms(&self, key: &StoreKey) -> Result<Option<u64>, StoreError> {
        use fjall::Readable;
        let published = self.shared.db.published.load();
        let value = (published.snapshot)
            .get(&self.shared.db.records, key.as_bytes())
            .map_err(read_error)?;
        let Some(value) = value else {
            return Ok(None);
        };
        let (expires_at, _) = split(&value)?;
        Ok((expires_at > now_ms()).then_some(expires_at))
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
        claim: &Claim,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Option<OwnerToken>, StoreError> {
        let (owner, record) = super::pending(claim, lease);
        let guard = GiveBackOnDrop::restore(self, key, (owner, &claim.fingerprint), expected, ttl);
        let answer = self
            .submit(
                key,
                Change::TakeOver {
                    expected: expected.clone(),
                    owner,
                    record,
                    lease,
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

    async fn scan_unknown(
        &self,
        cursor: Option<&str>,
        want: usize,
    ) -> Result<ScanPage, StoreError> {
        let after = super::after_cursor(cursor)?;
        let db = Arc::clone(&self.shared.db);
        tokio::task::spawn_blocking(move || scan::unknown_after(&db, after, want))
            .await
            .map_err(unavailable)?
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

    fn fill(&self) -> Option<f64> {
        Some(self.used() as f64 / self.shared.max_disk.max(1) as f64)
    }

    fn max_clock_skew(&self) -> Duration {
        // One process writes and reads it: one clock.
        Duration::ZERO
    }

    fn system(&self) -> &'static str {
        "fjall"
    }

    fn stats(&self) -> StoreStats {
        StoreStats {
            purged: self.shared.counters.purged.load(Ordering::Relaxed),
            syncs: self.shared.counters.syncs.load(Ordering::Relaxed),
            ..StoreStats::default()
        }
    }

    fn for_worker(&self) -> Arc<dyn Store> {
        Arc::new(DiskStore {
            shared: Arc::clone(&self.shared),
            inbox: Inbox::on_this_runtime(),
        })
    }
}
