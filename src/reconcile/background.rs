//! Reconciliation in the background: an unknown outcome is asked about as soon as its `after`
//! has passed, without waiting for a retry, and asked again with backoff while the lookup does
//! not say, up to [`MAX_TRIES`] times; then it is left to the operator (counted as `gave_up`).
//!
//! Keys come from two places: this gateway, when it marks an outcome unknown or a retry meets
//! one ([`super::Reconciler::schedule`]); and sweeps of the store's unknown outcomes
//! ([`crate::store::Store::scan_unknown`]), which find what no running gateway knows of: a
//! request whose gateway was killed mid-flight (once its lease has run out, so the first sweep
//! waits for the longest `lock_timeout`), or another instance's. A sweep reads the whole store
//! in pages with a pause between them, every [`SWEEP_EVERY`], and only while some route or
//! consumer has a `reconcile`.
//!
//! Everything is bounded: the queue, the keys waiting for their time ([`MAX_JOBS`]), the lookups
//! at once ([`MAX_INFLIGHT`] tasks, and the process-wide cap of [`super::flights`]), and each
//! lookup by its route's `upstream_timeout`.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::{Lookup, Reconciled, Reconciler};
use crate::key::StoreKey;
use crate::store::{millis, now_ms, Origin, Store};

/// Lookups per key that did not say, before the key is left to the operator.
pub const MAX_TRIES: u32 = 5;
/// Keys waiting for their time at most; more wait for a retry or the next sweep.
const MAX_JOBS: usize = 10_000;
/// Keys handed over and not yet taken in.
const QUEUE: usize = 1024;
/// Lookups at once: two fewer than the process may make ([`super::flights::MAX_LOOKUPS`]),
/// which are left to retries.
const MAX_INFLIGHT: usize = super::flights::MAX_LOOKUPS - 2;
/// How often the store is swept for unknown outcomes nobody scheduled.
pub const SWEEP_EVERY: Duration = Duration::from_secs(300);
/// Records asked of the store per sweep page, and the pause between pages.
const SWEEP_PAGE: usize = 500;
const SWEEP_PAUSE: Duration = Duration::from_millis(20);
/// The longest wait between two tries.
const MAX_BACKOFF: Duration = Duration::from_secs(3600);
/// The longest wait before asking again about a key whose lookup found every lookup taken.
const MAX_BUSY_WAIT: Duration = Duration::from_secs(1);

/// Where the background learns how to ask about a record it found by sweeping.
pub trait Sources: Send + Sync + 'static {
    /// The lookup and `ttl` for a record from `origin`, if its route or consumer reconciles.
    fn lookup(&self, origin: &Origin) -> Option<(Lookup, Duration)>;
    /// Whether any route or consumer reconciles now (else sweeps read nothing).
    fn any(&self) -> bool;
    /// The longest `lock_timeout` of those that do: how long after a crash every lease it
    /// left has run out.
    fn longest_lease(&self) -> Duration;
}

/// One key to ask about.
struct Job {
    key: StoreKey,
    lookup: Lookup,
    ttl: Duration,
    due_ms: u64,
    tries: u32,
}

/// The gateway's side of the queue.
#[derive(Clone)]
pub(super) struct Queue {
    tx: mpsc::Sender<Job>,
}

impl Queue {
    pub(super) fn schedule(&self, key: StoreKey, lookup: &Lookup, ttl: Duration, due_ms: u64) {
        let job = Job {
            key,
            lookup: lookup.clone(),
            ttl,
            due_ms,
            tries: 0,
        };
        if self.tx.try_send(job).is_err() {
            tracing::debug!(
                key = key.short(),
                "reconciliation queue full; left to the next sweep"
            );
        }
    }
}

/// The background's side of the queue.
pub struct Backlog {
    rx: mpsc::Receiver<Job>,
    /// For the sweeps, which wait for room instead of dropping.
    tx: mpsc::Sender<Job>,
}

pub(super) fn queue() -> (Queue, Backlog) {
    let (tx, rx) = mpsc::channel(QUEUE);
    (Queue { tx: tx.clone() }, Backlog { rx, tx })
}

/// The keys waiting, in the order they are due.
#[derive(Default)]
struct Schedule {
    jobs: HashMap<StoreKey, Job>,
    due: BinaryHeap<Reverse<(u64, StoreKey)>>,
    /// Being asked now: a sweep does not add them again.
    asking: HashSet<StoreKey>,
    /// Tried [`MAX_TRIES`] times: left to the operator, not taken again from sweeps.
    given_up: HashSet<StoreKey>,
}

impl Schedule {
    fn add(&mut self, job: Job) {
        let key = job.key;
        if self.jobs.contains_key(&key)
            || self.asking.contains(&key)
            || self.given_up.contains(&key)
        {
            return;
        }
        if self.jobs.len() >= MAX_JOBS {
            tracing::debug!(key = key.short(), "reconciliation backlog full");
            return;
        }
        self.due.push(Reverse((job.due_ms, key)));
        self.jobs.insert(key, job);
    }

    fn next_due(&self) -> Option<u64> {
        self.due.peek().map(|Reverse((at, _))| *at)
    }

    /// The first job due by `now`, moved to `asking`.
    fn pop_due(&mut self, now: u64) -> Option<Job> {
        while let Some(Reverse((at, key))) = self.due.peek().copied() {
            if at > now {
                return None;
            }
            self.due.pop();
            if self.jobs.get(&key).is_some_and(|j| j.due_ms == at) {
                self.asking.insert(key);
                return self.jobs.remove(&key);
            }
        }
        None
    }

    /// What to do after a try: done, again later, or given up (true).
    fn after_try(&mut self, mut job: Job, result: &Reconciled) -> bool {
        self.asking.remove(&job.key);
        match result {
            Reconciled::Replay(_) | Reconciled::Released | Reconciled::Settled => false,
            // Never from the background's own lookups, which wait for a permit; from a retry's
            // it followed: ask again soon, not counted as a try.
            Reconciled::Busy => {
                job.due_ms = now_ms().saturating_add(millis(job.lookup.after.min(MAX_BUSY_WAIT)));
                self.add(job);
                false
            }
            Reconciled::TooEarly(at) => {
                job.due_ms = *at;
                self.add(job);
                false
            }
            Reconciled::Unknown => {
                job.tries += 1;
                if job.tries >= MAX_TRIES {
                    if self.given_up.len() >= MAX_JOBS {
                        self.given_up.clear();
                    }
                    self.given_up.insert(job.key);
                    return true;
                }
                job.due_ms = now_ms().saturating_add(millis(backoff(job.lookup.after, job.tries)));
                self.add(job);
                false
            }
        }
    }
}

/// The wait after `tries` tries (1 or more): `after`, doubled at each further try, at most
/// [`MAX_BACKOFF`].
fn backoff(after: Duration, tries: u32) -> Duration {
    after
        .max(Duration::from_millis(100))
        .saturating_mul(1 << tries.saturating_sub(1).min(16))
        .min(MAX_BACKOFF)
}

/// Runs until `stop`: asks about each key when it is due, and sweeps the store.
pub async fn run(
    mut backlog: Backlog,
    reconciler: Arc<Reconciler>,
    store: Arc<dyn Store>,
    sources: Arc<dyn Sources>,
    stop: CancellationToken,
) {
    let sweeper = tokio::spawn(sweeps(
        Arc::clone(&store),
        sources,
        backlog.tx.clone(),
        stop.clone(),
    ));
    let mut schedule = Schedule::default();
    let mut asking = JoinSet::new();
    // Which key each lookup task asks about: a task that panics hands back no job, and its key
    // must leave `asking` (a later sweep finds it again).
    let mut tasks: HashMap<tokio::task::Id, StoreKey> = HashMap::new();
    loop {
        let wait = schedule
            .next_due()
            .map(|at| Duration::from_millis(at.saturating_sub(now_ms())));
        let room = asking.len() < MAX_INFLIGHT;
        tokio::select! {
            () = stop.cancelled() => break,
            job = backlog.rx.recv() => match job {
                Some(job) => schedule.add(job),
                None => break,
            },
            () = tokio::time::sleep(wait.unwrap_or(MAX_BACKOFF)), if wait.is_some() && room => {
                if let Some(job) = schedule.pop_due(now_ms()) {
                    let (reconciler, store) = (Arc::clone(&reconciler), Arc::clone(&store));
                    let key = job.key;
                    let task = asking.spawn(async move {
                        let result = reconciler.settle_as(&*store, &job.key, &job.lookup, job.ttl, (true, None)).await;
                        (job, result)
                    });
                    tasks.insert(task.id(), key);
                }
            }
            Some(joined) = asking.join_next_with_id() => match joined {
                Ok((id, (job, result))) => {
                    tasks.remove(&id);
                    let key = job.key;
                    if schedule.after_try(job, &result) {
                        reconciler.metrics.reconciliation("gave_up");
                        tracing::warn!(key = key.short(), tries = MAX_TRIES, "reconciliation: the lookup never said; the outcome is left to the operator");
                    }
                }
                Err(e) => {
                    if let Some(key) = tasks.remove(&e.id()) {
                        schedule.asking.remove(&key);
                        tracing::error!(key = key.short(), error = %e, "reconciliation: a lookup task failed; the key is taken up again by the next sweep");
                    }
                }
            },
        }
    }
    sweeper.abort();
    asking.abort_all();
}

/// Sweeps the store: once every lease a crash left has run out, then every [`SWEEP_EVERY`].
async fn sweeps(
    store: Arc<dyn Store>,
    sources: Arc<dyn Sources>,
    tx: mpsc::Sender<Job>,
    stop: CancellationToken,
) {
    // A lease read by another clock runs out `max_clock_skew` later.
    let mut next = sources.longest_lease() + store.max_clock_skew() + Duration::from_secs(1);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(next) => {}
        }
        if sources.any() {
            sweep(&*store, &*sources, &tx).await;
        }
        next = SWEEP_EVERY;
    }
}

/// One pass over the store's unknown outcomes, queueing those whose route or consumer
/// reconciles.
async fn sweep(store: &dyn Store, sources: &dyn Sources, tx: &mpsc::Sender<Job>) {
    let mut cursor = None;
    let mut found = 0usize;
    loop {
        let page = match store.scan_unknown(cursor.as_deref(), SWEEP_PAGE).await {
            Ok(page) => page,
            Err(e) => {
                tracing::warn!(error = %e, "reconciliation sweep: the store failed; trying at the next sweep");
                return;
            }
        };
        for scanned in page.records {
            let Some(origin) = scanned.record.origin.as_deref() else {
                continue;
            };
            let Some((lookup, ttl)) = sources.lookup(origin) else {
                continue;
            };
            let skew = store.max_clock_skew();
            let Some(due_ms) = super::lookup_due(&scanned.record.state, lookup.after, skew) else {
                continue;
            };
            let job = Job {
                key: scanned.key,
                due_ms,
                lookup,
                ttl,
                tries: 0,
            };
            found += 1;
            if tx.send(job).await.is_err() {
                return;
            }
        }
        cursor = page.cursor;
        if cursor.is_none() {
            break;
        }
        tokio::time::sleep(SWEEP_PAUSE).await;
    }
    tracing::info!(found, "reconciliation sweep done");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(n: u8, due_ms: u64) -> Job {
        Job {
            key: StoreKey::from_bytes([n; 32]),
            lookup: Lookup {
                url: "http://up/k".parse().unwrap(),
                after: Duration::from_secs(2),
                timeout: Duration::from_secs(1),
                max_body: 1024,
            },
            ttl: Duration::from_secs(60),
            due_ms,
            tries: 0,
        }
    }

    #[test]
    fn keys_come_due_in_order_once() {
        let mut s = Schedule::default();
        s.add(job(1, 30));
        s.add(job(2, 10));
        s.add(job(2, 5));
        assert_eq!(
            s.next_due(),
            Some(10),
            "a key scheduled twice keeps its first time"
        );
        assert!(s.pop_due(9).is_none());
        assert_eq!(
            s.pop_due(10).map(|j| j.key),
            Some(StoreKey::from_bytes([2; 32]))
        );
        // Being asked: not added again by a sweep.
        s.add(job(2, 0));
        assert!(s.pop_due(20).is_none());
        assert_eq!(s.pop_due(30).map(|j| j.due_ms), Some(30));
    }

    #[test]
    fn a_lookup_that_never_says_is_tried_a_bounded_number_of_times() {
        let mut s = Schedule::default();
        s.add(job(1, 0));
        let mut tries = 0;
        while let Some(j) = s.pop_due(u64::MAX) {
            tries += 1;
            if s.after_try(j, &Reconciled::Unknown) {
                break;
            }
        }
        assert_eq!(tries, MAX_TRIES);
        s.add(job(1, 0));
        assert!(
            s.pop_due(u64::MAX).is_none(),
            "given up: left to the operator"
        );
    }

    #[test]
    fn backoff_doubles_from_after_and_is_capped() {
        let after = Duration::from_secs(30);
        assert_eq!(backoff(after, 1), after);
        assert_eq!(backoff(after, 3), Duration::from_secs(120));
        assert_eq!(backoff(after, 40), MAX_BACKOFF);
    }

    #[test]
    fn the_backlog_is_bounded() {
        let mut s = Schedule::default();
        for i in 0..MAX_JOBS + 10 {
            let mut j = job(0, 1);
            j.key = StoreKey::from_bytes([
                (i % 256) as u8,
                (i / 256) as u8,
                1,
                1,
                1,
                1,
                1,
                1,
                1,
                1,
                1,
                1,
                1,
                1,
                1,
                1,
                1,
                1,
                1,
                1,
                1,
                1,
                1,
                1,
                1,
                1,
                1,
                1,
                1,
                1,
                1,
                1,
            ]);
            s.add(j);
        }
        assert_eq!(s.jobs.len(), MAX_JOBS);
    }
}
