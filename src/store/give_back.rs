//! Giving back what a store call whose answer was lost may have written: a reservation (deleted
//! with its owner's token), a take-over (the outcome it replaced, written again).

use std::sync::Arc;
use std::time::Duration;

use super::{OwnerToken, Record, RecordState, Store, StoreError, StoredResponse, UnknownReason};
use crate::fingerprint::Fingerprint;
use crate::key::StoreKey;

/// What a take-over gives back when its own answer is uncertain (lost, timed out, or
/// acknowledged by too few replicas): the state it replaced, written again under the take-over's
/// token. A take-over never frees the key: releasing its new record would also drop the unknown
/// or completed outcome it replaced, and the next retry would run the request again. The
/// replaced outcome comes back (an unknown one as unknown, for the same reason; a completed one
/// with its stored answer, kept for `ttl`); a pending or abandoned one comes back as abandoned.
/// If this fails too, the new record keeps its lease and then reads as abandoned: an unknown
/// outcome, never a free key.
pub(crate) enum Replaced {
    /// Completed with this answer: `complete` it again.
    Completed(Arc<StoredResponse>),
    /// Unknown for this reason: `mark_unknown` it again.
    Unknown(UnknownReason),
    /// A refusal (4xx) another request was taking over on a business-key route: `release`d
    /// instead. Completed again under the taker's record, it would keep the taker's fingerprint
    /// and be replayed to the taker's retries, which would never run; freed, the refusal's own
    /// request (refused: nothing was done) runs again if it comes again.
    Refusal,
}

impl Replaced {
    /// What to write back of `replaced`, which a claim with `taker`'s fingerprint was taking
    /// over: a refusal is released only when another request was taking it over (the core, on
    /// a business-key route); an operator's take-over keeps the fingerprint, and gets it back.
    pub(crate) fn of(replaced: &Record, taker: &Fingerprint) -> Replaced {
        match &replaced.state {
            RecordState::Completed(response)
                if response.status.is_client_error() && *taker != replaced.fingerprint =>
            {
                Replaced::Refusal
            }
            RecordState::Completed(response) => Replaced::Completed(Arc::clone(response)),
            RecordState::Unknown { reason, .. } => Replaced::Unknown(*reason),
            RecordState::Pending { .. } | RecordState::Abandoned { .. } => {
                Replaced::Unknown(UnknownReason::Abandoned)
            }
        }
    }
}

/// Writes the [`Replaced`] outcome back under `owner` (the uncertain take-over's token) through
/// the store's owner-only calls, and says in the error what became of the record.
pub(crate) async fn give_back_replaced(
    store: &dyn Store,
    key: &StoreKey,
    (owner, taker): (OwnerToken, &Fingerprint),
    replaced: &Record,
    ttl: Duration,
    failed: StoreError,
) -> StoreError {
    let replacing = Replaced::of(replaced, taker);
    let refusal = matches!(replacing, Replaced::Refusal);
    let given = match replacing {
        Replaced::Completed(response) => {
            let response = Arc::unwrap_or_clone(response);
            store.complete(key, owner, response, ttl).await
        }
        Replaced::Unknown(reason) => store.mark_unknown(key, owner, reason).await,
        Replaced::Refusal => store.release(key, owner).await,
    };
    let note = match given {
        Ok(()) if refusal => "the refusal it replaced was released: the next request with the key runs",
        Ok(()) => "the record was left as it was",
        // Not landed (not ours), or not answered: if the take-over lands, its record reads as
        // in flight, then as abandoned.
        Err(_) => "the record is unchanged, or reads as in flight until its lease ends and then as an unknown outcome; the key is never freed",
    };
    tracing::warn!(key = key.short(), error = %failed, note, "a take-over's answer is uncertain");
    match failed {
        StoreError::Unavailable(why) => StoreError::Unavailable(format!("{why}; {note}")),
        other => other,
    }
}

/// Give-backs of lost reservations being tried at once in this process ([`give_back`]).
static GIVING_BACK: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
/// The most at once: past it (a store outage that loses every answer), a give-back is tried
/// once, and a reservation that lands later reads as an unknown outcome instead.
const MAX_GIVING_BACK: usize = 256;

/// One running give-back, counted in [`GIVING_BACK`] for as long as it lives (a task dropped
/// with its runtime included).
struct Counted(usize);

impl Counted {
    fn new() -> Counted {
        Counted(GIVING_BACK.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        GIVING_BACK.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Gives back a reservation whose answer was lost: `attempt` deletes the record with its owner's
/// token, answering whether it did. A reservation whose answer was lost may land later (a
/// command still queued or sent again; a Postgres statement is cancelled when it runs out of
/// time, and one waiting for a synchronous standby then commits at once), so it is tried, with
/// backoff up to 2 s, until it deletes or the lease ends: after that, a record that lands reads
/// as abandoned, an unknown outcome. Deleting one's own reservation is right, since nothing was
/// forwarded for it; at most [`MAX_GIVING_BACK`] are tried again at once.
pub(crate) async fn give_back<F, Fut>(key: StoreKey, lease: Duration, mut attempt: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let until = tokio::time::Instant::now() + lease;
    let counted = Counted::new();
    let mut pause = Duration::from_millis(100);
    loop {
        if attempt().await {
            tracing::info!(
                key = key.short(),
                "released a reservation whose answer was lost"
            );
            return;
        }
        if counted.0 >= MAX_GIVING_BACK || tokio::time::Instant::now() + pause >= until {
            return;
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(2));
    }
}
