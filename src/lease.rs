//! Keeping owners' leases alive while their upstream calls run: one task renews every lease that
//! is due, instead of a timer per request.
//!
//! An owner holds its lease for as long as it forwards ([`LeaseKeeper::hold`]); every third of
//! `lock_timeout` the keeper renews it in the store, until the guard drops. A timer per request
//! cost about 5 % of the CPU of a new key on the embedded store: registering a timer that runs
//! out sooner than the ones already armed (hyper's 30 s header timers on every idle connection)
//! wakes the worker's event loop through its eventfd, once for every third request or so. The
//! keeper has one timer, on its own runtime, re-armed only when a lease earlier than every other
//! one arrives: with requests flowing that is almost never.
//!
//! A renewal that finds the lease taken over (`NotOwner`) stops renewing that lease; the owner
//! still waits for its upstream call and then learns, when it stores the result, that it is no
//! longer the owner.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::AbortHandle;
use tokio::time::Instant;

use crate::key::StoreKey;
use crate::store::{OwnerToken, Store, StoreError};

/// The shortest renewal period, whatever `lock_timeout` says.
const MIN_PERIOD: Duration = Duration::from_millis(10);

/// How often a lease of `lease` is renewed.
pub fn renewal_period(lease: Duration) -> Duration {
    (lease / 3).max(MIN_PERIOD)
}

/// The leases being held, and the task that renews them.
pub struct LeaseKeeper {
    shared: Arc<Shared>,
    task: Option<AbortHandle>,
}

struct Shared {
    store: Arc<dyn Store>,
    table: Mutex<Table>,
    /// Wakes the renewer when a lease falls due before the time it sleeps until.
    wake: Notify,
}

#[derive(Default)]
struct Table {
    next_id: u64,
    held: HashMap<u64, Held>,
    /// When the renewer wakes next (`None`: it waits for a lease to be held).
    next_wake: Option<Instant>,
}

struct Held {
    key: StoreKey,
    token: OwnerToken,
    lease: Duration,
    due: Instant,
}

impl LeaseKeeper {
    /// Starts the renewer on the current runtime (the gateway's main one). Outside a runtime
    /// nothing is renewed, which only tests that never forward would do.
    pub fn new(store: Arc<dyn Store>) -> Self {
        let shared = Arc::new(Shared {
            store,
            table: Mutex::new(Table::default()),
            wake: Notify::new(),
        });
        let task = tokio::runtime::Handle::try_current()
            .ok()
            .map(|rt| rt.spawn(renew_forever(Arc::clone(&shared))).abort_handle());
        LeaseKeeper { shared, task }
    }

    /// Renews `token`'s lease on `key` every third of `lease` until the guard drops.
    pub fn hold(&self, key: StoreKey, token: OwnerToken, lease: Duration) -> LeaseGuard {
        let due = Instant::now() + renewal_period(lease);
        let mut table = self.shared.lock();
        let id = table.next_id;
        table.next_id = table.next_id.wrapping_add(1);
        table.held.insert(
            id,
            Held {
                key,
                token,
                lease,
                due,
            },
        );
        if table.next_wake.map_or(true, |wake| due < wake) {
            table.next_wake = Some(due);
            self.shared.wake.notify_one();
        }
        LeaseGuard {
            shared: Arc::clone(&self.shared),
            id,
        }
    }

    /// Leases held now.
    pub fn held(&self) -> usize {
        self.shared.lock().held.len()
    }
}

impl Drop for LeaseKeeper {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// Stops the renewals of one lease when dropped.
pub struct LeaseGuard {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        self.shared.lock().held.remove(&self.id);
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Table> {
        // The table stays consistent across a panic (every update is a single insert, remove or
        // field write), so a poisoned lock is still usable.
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }
}

async fn renew_forever(shared: Arc<Shared>) {
    loop {
        let (due, next_wake) = {
            let mut table = shared.lock();
            let now = Instant::now();
            let mut due = Vec::new();
            let mut next_wake: Option<Instant> = None;
            for (id, held) in table.held.iter_mut() {
                if held.due <= now {
                    due.push((*id, held.key, held.token, held.lease));
                    held.due = now + renewal_period(held.lease);
                }
                next_wake = Some(next_wake.map_or(held.due, |w| w.min(held.due)));
            }
            table.next_wake = next_wake;
            (due, next_wake)
        };
        for (id, key, token, lease) in due {
            tokio::spawn(renew_one(Arc::clone(&shared), id, key, token, lease));
        }
        match next_wake {
            Some(at) => {
                tokio::select! {
                    () = tokio::time::sleep_until(at) => {}
                    () = shared.wake.notified() => {}
                }
            }
            None => shared.wake.notified().await,
        }
    }
}

async fn renew_one(
    shared: Arc<Shared>,
    id: u64,
    key: StoreKey,
    token: OwnerToken,
    lease: Duration,
) {
    match shared.store.renew(&key, token, lease).await {
        Ok(()) => {}
        Err(StoreError::NotOwner) => {
            tracing::warn!(
                key = key.short(),
                "lease lost while the upstream was working"
            );
            shared.lock().held.remove(&id);
        }
        Err(e) => tracing::warn!(key = key.short(), error = %e, "lease renewal failed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::Fingerprint;
    use crate::key::ClientScope;
    use crate::metrics::Metrics;
    use crate::store::instrumented::Instrumented;
    use crate::store::memory::MemoryStore;
    use crate::store::Reservation;

    const LEASE: Duration = Duration::from_secs(3);
    const TTL: Duration = Duration::from_secs(3600);

    /// The embedded store, counting its calls in the metrics.
    fn store() -> (Arc<dyn Store>, Arc<Metrics>) {
        let metrics = Arc::new(Metrics::new());
        let inner: Arc<dyn Store> = Arc::new(MemoryStore::new(100, 1 << 20));
        (
            Arc::new(Instrumented::new(inner, Arc::clone(&metrics))),
            metrics,
        )
    }

    /// Renewals that reached the store so far (successful or not).
    fn renewals(metrics: &Metrics) -> u64 {
        metrics
            .encode()
            .lines()
            .find_map(|l| l.strip_prefix("idemgate_store_duration_seconds_count{op=\"renew\"} "))
            .map_or(0, |n| n.trim().parse().unwrap_or(0))
    }

    fn key(name: &str) -> StoreKey {
        StoreKey::new(&ClientScope::of(&http::HeaderMap::new(), None), "r", name)
    }

    async fn own(store: &dyn Store, key: &StoreKey) -> OwnerToken {
        match store.reserve(key, Fingerprint([1; 32]), LEASE, TTL).await {
            Ok(Reservation::Owner(t)) => t,
            other => panic!("expected to own the key: {other:?}"),
        }
    }

    /// Lets the renewer and the renewals it spawned run, with the clock paused.
    async fn settle() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_held_lease_is_renewed_each_period_until_the_guard_drops() {
        let (store, metrics) = store();
        let keeper = LeaseKeeper::new(Arc::clone(&store));
        let k = key("held");
        let token = own(&*store, &k).await;
        let guard = keeper.hold(k, token, LEASE);

        tokio::time::advance(renewal_period(LEASE) - Duration::from_millis(1)).await;
        settle().await;
        assert_eq!(renewals(&metrics), 0, "nothing before the first period");

        tokio::time::advance(Duration::from_millis(1)).await;
        settle().await;
        assert_eq!(renewals(&metrics), 1, "renewed after one period");

        tokio::time::advance(renewal_period(LEASE)).await;
        settle().await;
        assert_eq!(renewals(&metrics), 2, "and after each period");
        assert_eq!(keeper.held(), 1, "the lease is still ours");

        drop(guard);
        assert_eq!(keeper.held(), 0);
        tokio::time::advance(renewal_period(LEASE) * 3).await;
        settle().await;
        assert_eq!(renewals(&metrics), 2, "no renewal once the guard dropped");
    }

    #[tokio::test(start_paused = true)]
    async fn a_lease_taken_over_is_no_longer_renewed() {
        let (store, metrics) = store();
        let keeper = LeaseKeeper::new(Arc::clone(&store));
        let k = key("lost");
        let token = own(&*store, &k).await;
        let _guard = keeper.hold(k, token, LEASE);
        // Someone else owns the key now (an operator released it, another owner reserved it).
        store.release(&k, token).await.unwrap();
        own(&*store, &k).await;
        tokio::time::advance(renewal_period(LEASE)).await;
        settle().await;
        assert_eq!(renewals(&metrics), 1);
        assert_eq!(keeper.held(), 0, "the lost lease is dropped from the table");
        tokio::time::advance(renewal_period(LEASE) * 3).await;
        settle().await;
        assert_eq!(renewals(&metrics), 1, "and never tried again");
    }

    #[tokio::test(start_paused = true)]
    async fn a_shorter_lease_wakes_the_renewer_earlier() {
        let (store, metrics) = store();
        let keeper = LeaseKeeper::new(Arc::clone(&store));
        let (long, short) = (key("long"), key("short"));
        let t_long = own(&*store, &long).await;
        let _g1 = keeper.hold(long, t_long, LEASE * 100);
        // The renewer now sleeps until the long lease's first renewal.
        settle().await;
        let t_short = own(&*store, &short).await;
        let _g2 = keeper.hold(short, t_short, LEASE);
        tokio::time::advance(renewal_period(LEASE)).await;
        settle().await;
        assert_eq!(renewals(&metrics), 1, "the short lease was renewed on time");
    }
}
