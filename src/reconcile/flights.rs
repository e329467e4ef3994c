//! One lookup in flight per key, shared: every retry that meets a key's unknown outcome while
//! its lookup runs (and the background, if it comes to the key then) waits for that lookup's
//! answer instead of asking again, so a storm of retries of one key makes one request to the
//! upstream and one log line. Lookups at once, from retries and the background together, are at
//! most [`MAX_LOOKUPS`]; each also takes a connection slot of its upstream
//! (`upstream.max_connections`). A retry that finds no lookup free is answered at once (the
//! outcome stays unknown, the background asks soon), never queued.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{watch, Semaphore, SemaphorePermit};

use super::Reconciled;
use crate::key::StoreKey;

/// Lookups at once in the whole process.
pub const MAX_LOOKUPS: usize = 8;

/// How much longer than the lookup's own timeout a follower waits for the leader's answer (the
/// leader reads and writes the record around it).
const FOLLOW_MARGIN: Duration = Duration::from_secs(2);

type Answer = watch::Receiver<Option<Reconciled>>;

/// The lookups in flight, by key; one per process.
pub(super) struct Flights {
    permits: Semaphore,
    /// At most one entry per leader: bounded by the leaders, themselves bounded by the retries
    /// holding a permit and the background's tasks.
    inflight: Mutex<HashMap<StoreKey, Answer>>,
}

/// A call's place in its key's lookup.
pub(super) enum Seat<'a> {
    /// No lookup of the key in flight: this call makes it, and tells the others.
    Lead(Lead<'a>),
    /// Another call's lookup is in flight: wait for its answer.
    Follow(Answer),
}

impl Flights {
    pub(super) fn new() -> Flights {
        Flights {
            permits: Semaphore::new(MAX_LOOKUPS),
            inflight: Mutex::new(HashMap::new()),
        }
    }

    pub(super) fn join(&self, key: &StoreKey) -> Seat<'_> {
        let mut inflight = self.inflight.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(answer) = inflight.get(key) {
            return Seat::Follow(answer.clone());
        }
        let (tx, rx) = watch::channel(None);
        inflight.insert(*key, rx);
        Seat::Lead(Lead {
            flights: self,
            key: *key,
            tx,
        })
    }

    /// A lookup's permit: at once or none for a retry (`wait = false`), waiting for one in
    /// the background.
    pub(super) async fn permit(&self, wait: bool) -> Option<SemaphorePermit<'_>> {
        match wait {
            true => self.permits.acquire().await.ok(),
            false => self.permits.try_acquire().ok(),
        }
    }
}

/// Waits for the leader's answer, at most the lookup's `timeout` and a margin: `Busy` (not
/// asked for this caller) if none comes (the leader's caller went away, or it overran).
pub(super) async fn follow(mut answer: Answer, timeout: Duration) -> Reconciled {
    let waited = tokio::time::timeout(
        timeout.saturating_add(FOLLOW_MARGIN),
        answer.wait_for(Option::is_some),
    )
    .await;
    match waited {
        Ok(Ok(settled)) => settled.clone().unwrap_or(Reconciled::Busy),
        _ => Reconciled::Busy,
    }
}

/// The lookup of one key, while this call makes it; the key's entry goes when it is dropped
/// (answered or not: followers of a leader that went away stop waiting at once).
pub(super) struct Lead<'a> {
    flights: &'a Flights,
    key: StoreKey,
    tx: watch::Sender<Option<Reconciled>>,
}

impl Lead<'_> {
    pub(super) fn answer(self, settled: &Reconciled) {
        self.tx.send_replace(Some(settled.clone()));
    }
}

impl Drop for Lead<'_> {
    fn drop(&mut self) {
        let mut inflight = (self.flights.inflight.lock()).unwrap_or_else(PoisonError::into_inner);
        if inflight
            .get(&self.key)
            .is_some_and(|rx| rx.same_channel(&self.tx.subscribe()))
        {
            inflight.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_leader_per_key_and_its_followers_get_its_answer() {
        let flights = Flights::new();
        let key = StoreKey::from_bytes([1; 32]);
        let Seat::Lead(lead) = flights.join(&key) else {
            panic!("the first call leads");
        };
        let Seat::Follow(answer) = flights.join(&key) else {
            panic!("the second follows");
        };
        assert!(matches!(
            flights.join(&StoreKey::from_bytes([2; 32])),
            Seat::Lead(_)
        ));
        let follower = tokio::spawn(follow(answer, Duration::from_secs(5)));
        lead.answer(&Reconciled::Released);
        assert!(matches!(follower.await.unwrap(), Reconciled::Released));
        assert!(
            matches!(flights.join(&key), Seat::Lead(_)),
            "the entry went with its leader"
        );
    }

    #[tokio::test]
    async fn followers_of_a_leader_that_went_away_stop_waiting() {
        let flights = Flights::new();
        let key = StoreKey::from_bytes([1; 32]);
        let lead = flights.join(&key);
        let Seat::Follow(answer) = flights.join(&key) else {
            panic!("the second follows");
        };
        drop(lead);
        let got = tokio::time::timeout(
            Duration::from_secs(1),
            follow(answer, Duration::from_secs(60)),
        )
        .await;
        assert!(matches!(got, Ok(Reconciled::Busy)));
    }

    #[tokio::test]
    async fn lookups_at_once_are_capped() {
        let flights = Flights::new();
        let mut held = Vec::new();
        for _ in 0..MAX_LOOKUPS {
            held.push(flights.permit(false).await.expect("a permit"));
        }
        assert!(
            flights.permit(false).await.is_none(),
            "a retry is not queued"
        );
        drop(held.pop());
        assert!(flights.permit(true).await.is_some());
    }
}
