//! Writing a completed answer again, in the background, after its write got no answer in time
//! (lost on the way, or the store unreachable for a while). The client already has the
//! upstream's answer; without this, the record would stay pending and the client's retries
//! would wait out the lease, then get `outcome-unknown` instead of the replay (what the
//! partition tests found: tests/e2e/partitions). Redis and Postgres use it; the write is the
//! same owner-only completion as the first, so nothing runs twice and no other request's record
//! is written: a record that is no longer this owner's pending one (the first write landed, or
//! the key was taken over, released or resolved) ends it.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::Semaphore;

use super::StoreError;
use crate::key::StoreKey;

/// How long a completion is written again: long enough for a partition or a failover to heal;
/// a record still pending after it reads as an unknown outcome, as it did before.
pub(crate) const COMPLETE_LATER_FOR: Duration = Duration::from_secs(300);

/// Completions being written again at once in this process (their own budget: the give-backs
/// of lost reservations keep theirs).
static RUNNING: AtomicUsize = AtomicUsize::new(0);
/// The most at once: past it (an outage under load), a completion is tried once more only.
const MAX_RUNNING: usize = 256;
/// Attempts in flight at once: each may hold a store connection (a pooled Postgres one) up to
/// `command_timeout`, so only a few at a time, leaving the connections to requests.
static ATTEMPTS: Semaphore = Semaphore::const_new(4);

/// A completion being written again, counted in [`RUNNING`] while it lives; dropped before it
/// settled (its runtime shut down), it says which key was cut off.
struct Unsettled {
    key: StoreKey,
    over_budget: bool,
    settled: bool,
}

impl Unsettled {
    fn new(key: StoreKey) -> Unsettled {
        let before = RUNNING.fetch_add(1, Ordering::Relaxed);
        Unsettled {
            key,
            over_budget: before >= MAX_RUNNING,
            settled: false,
        }
    }
}

impl Drop for Unsettled {
    fn drop(&mut self) {
        RUNNING.fetch_sub(1, Ordering::Relaxed);
        if !self.settled {
            tracing::warn!(
                key = self.key.short(),
                "shutting down before an answer whose write got no answer was stored again: its retries get outcome-unknown once the lease ends"
            );
        }
    }
}

/// Runs `attempt` (the owner-only completion) until it stands or cannot: with backoff from 100 ms
/// to 2 s, for at most [`COMPLETE_LATER_FOR`], one attempt at a time per [`ATTEMPTS`] permit.
/// Stored, or not this owner's record any more: done; the store unreachable again: tried again;
/// any other error: stopped, and logged.
pub(crate) async fn complete_later<F, Fut>(key: StoreKey, mut attempt: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), StoreError>>,
{
    let until = tokio::time::Instant::now() + COMPLETE_LATER_FOR;
    let mut unsettled = Unsettled::new(key);
    let mut pause = Duration::from_millis(100);
    loop {
        let outcome = {
            // Never closed: the permit is always granted.
            let _permit = ATTEMPTS.acquire().await.ok();
            attempt().await
        };
        match outcome {
            Ok(()) => tracing::info!(
                key = key.short(),
                "stored an answer whose first write got no answer: its retries replay it"
            ),
            Err(StoreError::NotOwner) => tracing::info!(
                key = key.short(),
                "an answer whose write got no answer: its record is no longer this owner's pending one (the first write landed, or the key was taken over, released or resolved)"
            ),
            Err(StoreError::Unavailable(_))
                if !unsettled.over_budget && tokio::time::Instant::now() + pause < until =>
            {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
                continue;
            }
            Err(e) => tracing::warn!(
                key = key.short(),
                error = %e,
                "gave up storing an answer whose write got no answer: its retries get outcome-unknown once the lease ends"
            ),
        }
        unsettled.settled = true;
        return;
    }
}
