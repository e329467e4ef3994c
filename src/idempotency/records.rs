//! The store as the core uses it ([`Records`]): the worker's handle, every call timed and
//! counted; and the phases that talk to it: `resolve` (what an existing record means, waiting
//! while it is pending), the lease renewal, and `settle` (writing down what an execution did).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::{
    decide, not_executed, store_refusal, Attempt, Refusal, Resolved, Rules, Settled, Shared, Sought,
};
use crate::config::OnUnknown;
use crate::duplicates::Seen;
use crate::key::StoreKey;
use crate::store::{
    now_ms, Claim, OwnerToken, Record, Reservation, Store, StoreError, StoreOp, StoredResponse,
    UnknownReason,
};
use crate::telemetry::span::Trace;
use opentelemetry::trace::SpanKind;
use opentelemetry::KeyValue;

/// The outcome of waiting on a pending record, when it is an answer.
pub(super) enum Waited {
    Replay(Arc<StoredResponse>),
    Refused(Refusal),
}

/// The store as the core uses it: the worker's handle, every call timed and counted.
#[derive(Clone)]
pub(super) struct Records {
    pub(super) store: Arc<dyn Store>,
    pub(super) shared: Arc<Shared>,
    /// The call's span when it is traced: each store call a child of it.
    pub(super) trace: Option<Trace>,
}

impl Records {
    pub(super) async fn timed<T>(
        &self,
        op: StoreOp,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let span = self.trace.as_ref().map(|t| self.store_span(t, op));
        let started = Instant::now();
        let result = call.await;
        let failed = result.as_ref().is_err_and(StoreError::is_failure);
        self.shared
            .metrics
            .store_call(op, started.elapsed(), failed);
        if let Some(span) = span {
            span.end(failed.then_some("the store failed"));
        }
        result
    }

    /// A store call's client span (`store reserve`, ...), with the store's `db.system`.
    fn store_span(&self, trace: &Trace, op: StoreOp) -> Trace {
        trace.phase(
            op.span_name(),
            SpanKind::Client,
            vec![
                KeyValue::new("db.system", self.store.system()),
                KeyValue::new("db.operation.name", op.as_str()),
            ],
        )
    }

    pub(super) async fn get(&self, key: &StoreKey) -> Result<Option<Record>, StoreError> {
        self.timed(StoreOp::Get, self.store.get(key)).await
    }

    pub(super) async fn reserve(
        &self,
        key: &StoreKey,
        claim: &Claim,
        rules: Rules,
    ) -> Result<Reservation, StoreError> {
        self.timed(
            StoreOp::Reserve,
            self.store.reserve(key, claim, rules.lease, rules.ttl),
        )
        .await
    }

    pub(super) async fn take_over(
        &self,
        key: &StoreKey,
        old: &Record,
        claim: &Claim,
        rules: Rules,
    ) -> Result<Option<OwnerToken>, StoreError> {
        self.timed(
            StoreOp::TakeOver,
            self.store
                .take_over(key, old, claim, rules.lease, rules.ttl),
        )
        .await
    }

    /// [`Self::take_over`] of a stored refusal (a business-key route's 4xx): finished even if
    /// the caller goes away meanwhile (an HTTP client hanging up), and then the new record
    /// released, since nothing was forwarded under it. Without that, a take-over dropped after
    /// it landed would leave a pending record with nobody to run it: read as abandoned, an
    /// unknown outcome for every later event with the key, for a whole `ttl`.
    pub(super) async fn take_over_refusal(
        &self,
        key: &StoreKey,
        old: &Record,
        claim: &Claim,
        rules: Rules,
        tasks: &tokio_util::task::TaskTracker,
    ) -> Result<Option<OwnerToken>, StoreError> {
        let gone = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let taking = {
            let records = self.clone();
            let (key, old, claim, gone) = (*key, old.clone(), claim.clone(), Arc::clone(&gone));
            async move {
                let taken = records.take_over(&key, &old, &claim, rules).await;
                if let (true, Ok(Some(token))) =
                    (gone.load(std::sync::atomic::Ordering::SeqCst), &taken)
                {
                    records.release(&key, *token).await;
                }
                taken
            }
        };
        let detached = super::detach::Detachable::new(taking, tasks.clone());
        // Pinned here, so that it stays a local declared before `left` (an `.await` on it by
        // value would move it into a temporary dropped first): `left` is dropped before it, and
        // the flag is set before the take-over moves to a task of its own and can look at it.
        tokio::pin!(detached);
        let mut left = LeftOnDrop(Some(gone));
        let taken = (&mut detached).await;
        // Answered: nothing left to release.
        left.0 = None;
        taken
    }

    /// Phase `resolve`: what an existing record means, waiting while it is pending. `Ok(None)`:
    /// the key was released meanwhile. Answers found by waiting come back as `Err(Waited)`, so
    /// the caller can tell them from immediate ones.
    pub(super) async fn resolve(
        &self,
        key: &StoreKey,
        sought: &Sought<'_>,
        rules: Rules,
        record: Record,
        wait_until: Instant,
    ) -> Result<Option<Resolved>, Waited> {
        if let Some(done) = decide(rules, sought, &record).map_err(Waited::Refused)? {
            return Ok(Some(done));
        }
        if Instant::now() >= wait_until {
            return Err(Waited::Refused(Refusal::InFlight));
        }
        // The read that found the record pending counts as none here: the room's reader reads
        // again, so a change since then is not missed.
        // Its span ends however the wait does: dropped with this future.
        let _waiting =
            (self.trace.as_ref()).map(|t| t.phase("wait", SpanKind::Internal, Vec::new()));
        let Ok(mut seat) =
            self.shared
                .rooms
                .join(key, rules.max_waiters, &self.store, &self.shared.metrics)
        else {
            tracing::debug!(key = key.short(), "too many duplicates waiting on this key");
            return Err(Waited::Refused(Refusal::InFlight));
        };
        loop {
            let seen = tokio::select! {
                seen = seat.next() => seen,
                () = tokio::time::sleep_until(wait_until) => {
                    return Err(Waited::Refused(Refusal::InFlight))
                }
            };
            let record = match seen {
                Seen::Nothing => continue,
                // Another worker's reader, stopped with its runtime at shutdown: a new room,
                // read from this one, so that this waiter still gets the owner's answer.
                Seen::ReaderGone => {
                    drop(seat);
                    seat = match self.shared.rooms.join(
                        key,
                        rules.max_waiters,
                        &self.store,
                        &self.shared.metrics,
                    ) {
                        Ok(seat) => seat,
                        Err(_) => return Err(Waited::Refused(Refusal::InFlight)),
                    };
                    continue;
                }
                Seen::Failed(e) => return Err(Waited::Refused(store_refusal(key, e))),
                Seen::Record(None) => return Ok(None),
                Seen::Record(Some(record)) => record,
            };
            match decide(rules, sought, &record).map_err(Waited::Refused)? {
                Some(Resolved::Replay(response)) => return Err(Waited::Replay(response)),
                Some(take_over) => return Ok(Some(take_over)),
                None => {}
            }
        }
    }

    /// Keeps the lease alive while the operation runs; returns only if ownership was lost.
    pub(super) async fn renew_lease(&self, key: &StoreKey, token: OwnerToken, lease: Duration) {
        let period = (lease / 3).max(Duration::from_millis(10));
        let mut tick = tokio::time::interval_at(Instant::now() + period, period);
        loop {
            tick.tick().await;
            match self
                .timed(StoreOp::Renew, self.store.renew(key, token, lease))
                .await
            {
                Ok(()) => {}
                Err(StoreError::NotOwner) => {
                    tracing::warn!(
                        key = key.short(),
                        "lease lost while the upstream was working"
                    );
                    return;
                }
                Err(e) => tracing::warn!(key = key.short(), error = %e, "lease renewal failed"),
            }
        }
    }

    /// Phase `settle`: writes down what the execution did.
    pub(super) async fn settle<R>(
        &self,
        key: &StoreKey,
        token: OwnerToken,
        rules: Rules,
        attempt: Attempt<R>,
    ) -> Settled<R> {
        let (mut response, output, status) = match attempt {
            Attempt::Answered {
                response,
                output,
                status,
            } => (response, output, status),
            Attempt::NotSent(e) => {
                tracing::warn!(key = key.short(), error = %e, "upstream unreachable; key released");
                self.release(key, token).await;
                return Settled::NotSent(e);
            }
            Attempt::Unknown { reason, error } => {
                tracing::warn!(key = key.short(), error = %error, "outcome unknown");
                let retryable = self.keep_unknown(key, token, rules, reason).await;
                return Settled::Unknown { reason, retryable };
            }
        };
        if rules.unknown_statuses.contains(status) {
            tracing::warn!(
                key = key.short(),
                status,
                "the upstream answered a status that may follow a commit (unknown_statuses)"
            );
            let reason = if status == 504 {
                UnknownReason::Timeout
            } else {
                UnknownReason::Interrupted
            };
            let retryable = self.keep_unknown(key, token, rules, reason).await;
            return Settled::AnsweredUnknown {
                output,
                status,
                reason,
                retryable,
            };
        }
        if not_executed(status, rules.store_server_errors) {
            self.release(key, token).await;
            return Settled::Released(output);
        }
        response.completed_ms = now_ms();
        let stored = self
            .timed(
                StoreOp::Complete,
                self.store.complete(key, token, response, rules.ttl),
            )
            .await;
        match stored {
            Ok(()) => {
                let quotas = &self.shared.quotas;
                quotas.stored_by(rules.quota.as_ref(), rules.share, rules.ttl);
                Settled::Stored(output)
            }
            // Retries see the pending record until the store's background write of it lands
            // (Redis, Postgres: `store::complete_later`, after `Unavailable`), or (lease ended)
            // an unknown outcome: never a second execution.
            Err(e) => {
                tracing::error!(key = key.short(), error = %e, "cannot store the response");
                Settled::NotStored {
                    output,
                    lost: matches!(e, StoreError::NotOwner),
                }
            }
        }
    }

    /// Keeps the key as an unknown outcome, or releases it when the rules allow running it
    /// again (`on_unknown = "retry"`): whether it was released.
    pub(super) async fn keep_unknown(
        &self,
        key: &StoreKey,
        token: OwnerToken,
        rules: Rules,
        reason: UnknownReason,
    ) -> bool {
        if rules.on_unknown == OnUnknown::Retry {
            tracing::warn!(key = key.short(), "key released (on_unknown = \"retry\")");
            self.release(key, token).await;
            return true;
        }
        let marked = self
            .timed(
                StoreOp::MarkUnknown,
                self.store.mark_unknown(key, token, reason),
            )
            .await;
        match marked {
            // Kept for ttl like a stored answer: it counts against the quota.
            Ok(()) => {
                let quotas = &self.shared.quotas;
                quotas.stored_by(rules.quota.as_ref(), rules.share, rules.ttl)
            }
            Err(e) => {
                tracing::error!(key = key.short(), error = %e, "cannot mark outcome unknown; the lease will expire instead")
            }
        }
        false
    }

    pub(super) async fn release(&self, key: &StoreKey, token: OwnerToken) {
        let released = self
            .timed(StoreOp::Release, self.store.release(key, token))
            .await;
        if let Err(e) = released {
            tracing::error!(key = key.short(), error = %e, "cannot release the key; it stays pending until its lease expires");
        }
    }
}

/// Sets its flag when dropped: the caller went away.
struct LeftOnDrop(Option<Arc<std::sync::atomic::AtomicBool>>);

impl Drop for LeftOnDrop {
    fn drop(&mut self) {
        if let Some(gone) = &self.0 {
            gone.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }
}
