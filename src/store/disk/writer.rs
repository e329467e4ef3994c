//! The writer thread: every change to the store, applied in batches (group commit), each batch
//! one atomic write with one fsync when a change in it needs one, then its callers answered and
//! its waiters woken. Purging expired records is in [`super::purge`].

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant as StdInstant};

use bytes::Bytes;
use fjall::{OwnedWriteBatch, PersistMode};
use tokio::sync::mpsc;

use std::collections::HashMap;

use super::recent::{Lookup, Recent};
use super::{
    cost, expiry_key, read_error, split, stored_value, Answers, Change, Counters, Db, Done, Inbox,
    Job, Reply,
};
use crate::config::{DiskSettings, SyncMode};
use crate::key::StoreKey;
use crate::store::changes::Waiters;
use crate::store::codec::{self, Seal};
use crate::store::{
    ms_after, now_ms, Bound, OwnerToken, Record, RecordState, Reservation, StoreError,
    StoredResponse,
};

/// Changes applied in one transaction at most, so one batch never holds the others up for long.
const MAX_BATCH: usize = 1024;
/// How often the writer purges expired records (and, with `sync = "batch"`, how often at least
/// it checks whether a sync is due).
const TICK: Duration = Duration::from_secs(1);

/// Wakes the writer once a tick (purge; with `sync = "batch"`, the sync that is due) until the
/// store is gone.
pub(super) async fn tick(writer: mpsc::WeakSender<Job>, sync: SyncMode) {
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
pub(super) struct Writer {
    pub(super) db: Arc<Db>,
    pub(super) counters: Arc<Counters>,
    pub(super) waiters: Waiters,
    pub(super) sync: SyncMode,
    pub(super) max_disk: u64,
    /// When a change was last committed without a sync (`sync = "batch"`), if one is pending.
    pub(super) unsynced_since: Option<StdInstant>,
    /// The last expiry entry purged: the next pass starts after it. From the start, every pass
    /// would step over the tombstones of all it removed before (until compaction drops them),
    /// which made purging quadratic. New entries always sort after it: they expire in the
    /// future, and it is in the past.
    pub(super) purged_to: Option<Vec<u8>>,
    /// The wall clock at the last purge, to notice it stepping back.
    pub(super) purged_at: u64,
    /// The number of the last batch committed (or failed), purges included.
    pub(super) batches: u64,
    /// The records the last batches wrote, so that most changes read nothing from fjall.
    pub(super) recent: Recent,
    /// [`Effects::leased`]'s buffer, kept from batch to batch: no allocation per batch.
    pub(super) leased: Vec<(StoreKey, OwnerToken, Duration)>,
}

/// What one batch did, to apply once it is committed.
#[derive(Default)]
struct Effects {
    purged: u64,
    /// Keys whose waiters must re-read once the batch is visible.
    wake: Vec<StoreKey>,
    /// Some change in the batch must be on disk before its caller hears back.
    sync: bool,
    /// The new pending records the batch wrote (reservations, take-overs), with their leases:
    /// stamped again after a slow sync ([`Writer::restamp`]).
    leased: Vec<(StoreKey, OwnerToken, Duration)>,
}

impl Writer {
    pub(super) fn new(
        db: Arc<Db>,
        counters: Arc<Counters>,
        waiters: Waiters,
        settings: &DiskSettings,
    ) -> Self {
        Writer {
            db,
            counters,
            waiters,
            sync: settings.sync,
            max_disk: settings.max_disk,
            unsynced_since: None,
            purged_to: None,
            purged_at: 0,
            batches: 0,
            recent: Recent::new(),
            leased: Vec::new(),
        }
    }

    pub(super) fn run(mut self, mut rx: mpsc::Receiver<Job>) {
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
        let mut effects = Effects {
            leased: std::mem::take(&mut self.leased),
            ..Effects::default()
        };
        let mut answers: Vec<Answer> = Vec::with_capacity(jobs.len());
        let mut used = self.counters.used.load(Ordering::Relaxed) as i64;
        let mut written = HashMap::new();
        let applied_at = now_ms();
        let committed = (|| -> Result<bool, String> {
            let mut tables = Tables {
                db: &self.db,
                recent: &self.recent,
                batch: self.db.db.batch(),
                written: &mut written,
            };
            let now = applied_at;
            for job in jobs {
                let (key, change, reply, inbox) = match job {
                    Job::Change {
                        key,
                        change,
                        reply,
                        inbox,
                    } => (key, change, reply, inbox),
                    Job::Flush(reply) => {
                        effects.sync = true;
                        answers.push((reply, None, Ok(Done::Changed)));
                        continue;
                    }
                    Job::Tick => continue,
                };
                let result = self.apply(&mut tables, &key, change, now, &mut used, &mut effects);
                // A read that failed (the only way `apply` answers `Unavailable`) failed before
                // its change wrote anything: that change is refused, the rest of the batch goes
                // on, and the store stays usable (the next change of that key reads again).
                if let Err(StoreError::Unavailable(e)) = &result {
                    tracing::warn!(error = %e, key = key.short(), "disk store: a read failed; that change is refused");
                }
                answers.push((reply, inbox, result));
            }
            let due = match self.sync {
                SyncMode::Always => false,
                SyncMode::Batch { interval } => self
                    .unsynced_since
                    .is_some_and(|t| t.elapsed() >= interval / 2),
            };
            let durable = effects.sync || due;
            let failed = |e: fjall::Error| e.to_string();
            tables.batch.commit().map_err(failed)?;
            if durable {
                // fdatasync: the journal's data and what is needed to read it back (its size),
                // without the metadata (times) a full fsync also writes.
                self.db.db.persist(PersistMode::SyncData).map_err(failed)?;
            }
            Ok(durable)
        })();
        self.batches += 1;
        match committed {
            Ok(durable) => {
                self.restamp(&mut written, &effects.leased, applied_at);
                effects.leased.clear();
                self.leased = std::mem::take(&mut effects.leased);
                for (key, value) in written {
                    self.recent.wrote(self.batches, key, value);
                }
                // Readers see the batch only now: synced if it had to be.
                self.db.publish(self.batches);
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
                deliver(answers);
                for key in &effects.wake {
                    self.waiters.notify(key);
                }
            }
            Err(e) => self.write_failed(&e, answers),
        }
    }

    /// A batch whose commit or sync failed. It may be applied (a failed fsync) or not (a failed
    /// write): either way its callers are told the store failed, and a retry re-reads what is
    /// there. fjall refuses every write after a failed one (its journal may be torn): the store
    /// stays failed, and readiness says so, until the gateway restarts and recovers the journal.
    fn write_failed(&mut self, e: &str, answers: Vec<Answer>) {
        tracing::error!(error = %e, "disk store: a write failed; the store refuses writes until the gateway restarts");
        self.counters.failing.store(true, Ordering::Relaxed);
        // Some of the batch may be in fjall: nothing recent is to be trusted.
        self.recent.clear(self.batches + 1);
        let msg = format!("disk: {e}");
        let failed = answers
            .into_iter()
            .map(|(reply, inbox, _)| (reply, inbox, Err(StoreError::Unavailable(msg.clone()))));
        deliver(failed.collect());
    }

    /// Stamps the leases of the batch's new pending records again when its sync took more than a
    /// third of a lease: a lease counted from when the record was applied would have run out
    /// partly, or wholly, before anyone could read the record or its owner renew it, and a
    /// duplicate would read the key as abandoned though its request is only now forwarded. The
    /// new stamp is written without a sync before the batch is published: after a crash the
    /// synced stamp stands, and reads as abandoned, which a crash is.
    fn restamp(
        &self,
        written: &mut HashMap<StoreKey, Option<Vec<u8>>>,
        leased: &[(StoreKey, OwnerToken, Duration)],
        applied_at: u64,
    ) {
        let took = now_ms().saturating_sub(applied_at);
        let mut late = leased
            .iter()
            .filter(|(_, _, lease)| u128::from(took) * 3 > lease.as_millis())
            .peekable();
        if late.peek().is_none() {
            return;
        }
        let mut batch = self.db.db.batch();
        let mut stamped = Vec::new();
        for (key, owner, lease) in late {
            let Some(Some(value)) = written.get(key) else {
                continue;
            };
            let Ok((expires_at, raw)) = split(value) else {
                continue;
            };
            let seal = self.db.seal(key);
            let Ok(mut record) = codec::decode(&Bytes::copy_from_slice(raw), seal) else {
                continue;
            };
            if !matches!(record.state, RecordState::Pending { owner: o, .. } if o == *owner) {
                continue;
            }
            record = leased_record(record, *owner, *lease);
            let value = stored_value(expires_at, &codec::encode(&record, seal));
            batch.insert(&self.db.records, key.as_bytes().to_vec(), value.clone());
            stamped.push((*key, value));
        }
        if stamped.is_empty() {
            return;
        }
        match batch.commit() {
            // What readers of the recent batches see is what fjall holds.
            Ok(()) => written.extend(stamped.into_iter().map(|(k, v)| (k, Some(v)))),
            // The synced stamps stand: the leases are shorter than they should be, never longer.
            Err(e) => {
                tracing::warn!(error = %e, "disk store: cannot stamp the leases of a slow batch again")
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

    /// The upstream already executed: the result is kept whatever the bound says, but past
    /// `max_disk` without its body (a replay then says so), as the memory store does at
    /// `max_bytes`.
    fn within_max_disk(
        &self,
        mut response: StoredResponse,
        key_len: usize,
        old_len: Option<usize>,
        used: i64,
    ) -> StoredResponse {
        let others = used - old_len.map_or(0, |len| cost(key_len, len) as i64);
        let full = cost(key_len, 8 + 64 + response.size()) as i64;
        if others + full > self.max_disk as i64 && response.body_kept {
            response.body = Bytes::new();
            response.body_kept = false;
        }
        response
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
        let current = t.live(key, change.absent_at(), now, used, effects)?;
        // The stored value's length, for the `max_disk` count: known here, not read again.
        let old_len = current.as_ref().map(|(_, raw)| 8 + raw.len());
        let sync = self.must_sync(&change);
        let done = match change {
            Change::Reserve {
                owner,
                record,
                lease,
                ttl,
                ..
            } => {
                if let Some((_, raw)) = current {
                    let record = codec::decode(&raw, self.db.seal(key))?.checked_lease();
                    return Ok(Done::Reserved(Reservation::Existing(record)));
                }
                let raw = codec::encode(&leased_record(record, owner, lease), self.db.seal(key));
                if *used + cost(k.len(), 8 + raw.len()) as i64 > self.max_disk as i64 {
                    return Err(StoreError::Full(Bound::MaxDisk));
                }
                t.put(key, None, ms_after(ttl), &raw, used);
                effects.leased.push((*key, owner, lease));
                Done::Reserved(Reservation::Owner(owner))
            }
            Change::Complete {
                owner,
                response,
                ttl,
            } => {
                let response = self.within_max_disk(response, k.len(), old_len, *used);
                let state = RecordState::Completed(Arc::new(response));
                t.rewrite_owned(key, current, owner, Some(ms_after(ttl)), state, used)?;
                effects.wake.push(*key);
                Done::Changed
            }
            Change::MarkUnknown { owner, reason } => {
                let state = RecordState::Unknown {
                    since_ms: now_ms(),
                    reason,
                };
                t.rewrite_owned(key, current, owner, None, state, used)?;
                effects.wake.push(*key);
                Done::Changed
            }
            Change::Release { owner } => {
                owned(current, owner, self.db.seal(key))?;
                t.remove(key, old_len, used);
                effects.wake.push(*key);
                Done::Changed
            }
            Change::Renew { owner, lease } => {
                let state = RecordState::Pending {
                    owner,
                    lease_until_ms: ms_after(lease),
                };
                t.rewrite_owned(key, current, owner, None, state, used)?;
                Done::Changed
            }
            Change::TakeOver {
                expected,
                owner,
                record,
                lease,
                ttl,
            } => {
                let Some((expires_at, raw)) = current else {
                    return Ok(Done::TakenOver(None));
                };
                if codec::decode(&raw, self.db.seal(key))?.checked_lease() != expected {
                    return Ok(Done::TakenOver(None));
                }
                let raw = codec::encode(&leased_record(record, owner, lease), self.db.seal(key));
                let old = Some((expires_at, old_len.unwrap_or(0)));
                t.put(key, old, ms_after(ttl), &raw, used);
                effects.leased.push((*key, owner, lease));
                Done::TakenOver(Some(owner))
            }
            Change::Delete if current.is_none() => Done::Deleted(false),
            Change::Delete => {
                t.remove(key, old_len, used);
                effects.wake.push(*key);
                Done::Deleted(true)
            }
        };
        effects.sync |= sync;
        Ok(done)
    }
}

/// An answer of the writer's: where it goes, and through which worker's inbox if any.
type Answer = (Reply, Option<Inbox>, Result<Done, StoreError>);

/// Sends a batch's answers: those of a worker's callers in one hand-off to its inbox, the others
/// one by one.
fn deliver(answers: Vec<Answer>) {
    let mut inboxes: Vec<(Inbox, Answers)> = Vec::new();
    for (reply, inbox, result) in answers {
        let Some(inbox) = inbox else {
            let _ = reply.send(result);
            continue;
        };
        match inboxes.iter_mut().find(|(i, _)| i.0.same_channel(&inbox.0)) {
            Some((_, list)) => list.push((reply, result)),
            None => inboxes.push((inbox, vec![(reply, result)])),
        }
    }
    for (inbox, list) in inboxes {
        // A worker that is gone took its callers with it.
        let _ = inbox.0.send(list);
    }
}

/// A new pending record with its lease from now (when the writer applies it).
fn leased_record(mut record: Record, owner: OwnerToken, lease: Duration) -> Record {
    record.state = RecordState::Pending {
        owner,
        lease_until_ms: ms_after(lease),
    };
    record
}

/// The pending record `owner` owns, with its expiry, or `NotOwner`.
fn owned(
    current: Option<(u64, Bytes)>,
    owner: OwnerToken,
    seal: Seal,
) -> Result<(u64, Record), StoreError> {
    let Some((expires_at, raw)) = current else {
        return Err(StoreError::NotOwner);
    };
    let record = codec::decode(&raw, seal)?;
    match record.state {
        RecordState::Pending { owner: o, .. } if o == owner => Ok((expires_at, record)),
        _ => Err(StoreError::NotOwner),
    }
}

/// The keyspaces as one batch sees them: what the batch wrote so far, else what is committed.
struct Tables<'a> {
    db: &'a Db,
    recent: &'a Recent,
    batch: OwnedWriteBatch,
    /// Records this batch wrote (`None`: removed), for the batch's own later reads: a batch is
    /// applied only when it commits.
    written: &'a mut HashMap<StoreKey, Option<Vec<u8>>>,
}

impl Tables<'_> {
    /// The live record under `key`: (expiry, codec bytes). An expired one is removed on the
    /// spot. `absent_at`: see [`Change::Reserve`].
    fn live(
        &mut self,
        key: &StoreKey,
        absent_at: Option<u64>,
        now: u64,
        used: &mut i64,
        effects: &mut Effects,
    ) -> Result<Option<(u64, Bytes)>, StoreError> {
        let k = key.as_bytes().as_slice();
        // One copy of the stored value; the codec bytes are a slice of it.
        let value = match self.written.get(key) {
            Some(v) => v.as_deref().map(Bytes::copy_from_slice),
            None => match self.recent.lookup(key, absent_at) {
                Lookup::Known(v) => v,
                Lookup::Read => self
                    .db
                    .records
                    .get(k)
                    .map_err(read_error)?
                    .map(|v| Bytes::copy_from_slice(&v)),
            },
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
                self.remove(key, Some(8 + raw.len()), used);
                effects.purged += 1;
                Ok(None)
            }
            other => Ok(other),
        }
    }

    /// Writes `raw` under `key`, expiring at `expires_at`. `old`: the record's expiry and stored
    /// length, if there is one (it is filed already).
    fn put(
        &mut self,
        key: &StoreKey,
        old: Option<(u64, usize)>,
        expires_at: u64,
        raw: &[u8],
        used: &mut i64,
    ) {
        let k = key.as_bytes().as_slice();
        let value = stored_value(expires_at, raw);
        if let Some((_, len)) = old {
            *used -= cost(k.len(), len) as i64;
        }
        *used += cost(k.len(), value.len()) as i64;
        self.batch
            .insert(&self.db.records, k.to_vec(), value.clone());
        self.written.insert(*key, Some(value));
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
        key: &StoreKey,
        current: Option<(u64, Bytes)>,
        owner: OwnerToken,
        expires_at: Option<u64>,
        state: RecordState,
        used: &mut i64,
    ) -> Result<(), StoreError> {
        let old_len = current.as_ref().map_or(0, |(_, raw)| 8 + raw.len());
        let (old_expiry, pending) = owned(current, owner, self.db.seal(key))?;
        // Sealed again with the current key: a new answer is never sealed with a key a
        // rotation retired (this store compares records decoded, not their bytes).
        let record = Record {
            state,
            sealing: crate::store::seal::Sealing::New,
            ..pending
        };
        let expires_at = expires_at.unwrap_or(old_expiry);
        self.put(
            key,
            Some((old_expiry, old_len)),
            expires_at,
            &codec::encode(&record, self.db.seal(key)),
            used,
        );
        Ok(())
    }

    /// Removes the record under `key` (stored length `old_len`). Its expiry entry stays until it
    /// comes up, and the purge then finds no record (or a newer one, which it files again).
    fn remove(&mut self, key: &StoreKey, old_len: Option<usize>, used: &mut i64) {
        let k = key.as_bytes().as_slice();
        if let Some(len) = old_len {
            *used -= cost(k.len(), len) as i64;
        }
        self.batch.remove(&self.db.records, k.to_vec());
        self.written.insert(*key, None);
    }
}
