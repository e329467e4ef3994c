//! The idempotency core: what happens to one keyed operation, whichever front it came from (an
//! HTTP request today, a broker message next). No HTTP server types: a front brings a scoped key,
//! a fingerprint, the rules of its route and a way to execute ([`Execute`]), and gets a typed
//! [`Decision`] back.
//!
//! ```text
//! reserve ───── store down/full ─▶ Refused(StoreUnavailable | StoreFull), or Bypass (on_store_error = "pass")
//!    ├─ Owner ──▶ execute (lease renewed) ─▶ settle: complete | release | mark_unknown
//!    │            ─▶ Owned { Stored | NotStored | Released | NotSent | Unknown }
//!    └─ Existing ▶ decide: other fingerprint ─▶ Refused(KeyReused) (record untouched)
//!                  completed ─▶ Replay (byte for byte)
//!                  unknown, abandoned ─▶ Refused(OutcomeUnknown) (never re-executed), or take
//!                                        over when on_unknown = "retry"
//!                  pending ───▶ wait (woken by the store) ─▶ decide again | Refused(InFlight)
//!                               | reserve again (the key was released meanwhile)
//! ```
//! The owner's execution outlives its caller: if the caller goes away (an HTTP client hangs up),
//! the execution moves to a task of its own ([`Detachable`]), still finishes, and its result is
//! still stored for the retry that is surely coming. [`decide`] and [`not_executed`] are the
//! pure decisions, tested on their own below. [`legacy`] finds keys that older versions derived
//! otherwise.

mod detach;
pub mod legacy;
mod records;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use opentelemetry::trace::SpanKind;
use opentelemetry::KeyValue;

use crate::config::{OnStoreError, OnUnknown, Policy, ServerStatuses};
use crate::duplicates::Rooms;
use crate::error::BoxError;
use crate::fingerprint::Fingerprint;
use crate::key::StoreKey;
use crate::metrics::Metrics;
use crate::quota::{Quota, Quotas, Share, SHARE_RETRY};
use crate::reconcile::{Lookup, Reconciled, Reconciler};
use crate::store::{
    now_ms, Claim, OwnerToken, Record, RecordState, Reservation, Store, StoreError, StoredResponse,
    TraceLink, UnknownReason,
};
use crate::telemetry::span::Trace;
use detach::Detachable;
use records::{Records, Waited};

/// A waiter whose key keeps being released and re-taken gives up after this many rounds.
const MAX_RESERVE_ROUNDS: usize = 8;

/// The rules the core applies to one operation: the front makes them from its own config (a
/// route's or a consumer's policy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rules {
    /// False for deliveries deduplicated by business id: a later, different message with the
    /// same key gets the stored response instead of a mismatch.
    pub check_fingerprint: bool,
    /// The owner's lease (`lock_timeout`), renewed while it executes.
    pub lease: Duration,
    pub ttl: Duration,
    /// How long a duplicate waits for the original's result.
    pub wait: Duration,
    /// Duplicates waiting on one key at once; one more is refused as in flight at once.
    pub max_waiters: usize,
    /// The caller's quota of stored records, if its route and scope have one (set by the
    /// front, which knows the scope).
    pub quota: Option<Quota>,
    /// The caller's place on a store whose bound it shares ([`Share`]).
    pub share: Share,
    pub store_server_errors: bool,
    /// Answers that may follow a commit (`unknown_statuses`): kept as unknown outcomes.
    pub unknown_statuses: ServerStatuses,
    pub on_store_error: OnStoreError,
    pub on_unknown: OnUnknown,
}

impl Rules {
    /// The rules of a route's or consumer's `policy`, for callers with no quota and no share of
    /// the store to keep (a front with clients sets its own).
    pub fn of(policy: &Policy, check_fingerprint: bool) -> Rules {
        Rules {
            check_fingerprint,
            lease: policy.lock_timeout,
            ttl: policy.ttl,
            wait: policy.wait,
            max_waiters: policy.max_waiters,
            quota: None,
            share: Share::Unshared,
            store_server_errors: policy.store_server_errors,
            unknown_statuses: policy.unknown_statuses,
            on_store_error: policy.on_store_error,
            on_unknown: policy.on_unknown,
        }
    }
}

/// How a front runs its operation once this call owns the key.
pub trait Execute: Send + Sync + 'static {
    /// What the front's caller gets (an HTTP response).
    type Output: Send + 'static;

    /// Runs the operation, once, within the front's own deadline.
    fn execute(self) -> impl Future<Output = Attempt<Self::Output>> + Send;

    /// The fingerprint the version before issue 44 gave this request
    /// ([`crate::fingerprint::earlier_fingerprint`]): asked only when an existing record's
    /// fingerprint is not the claim's, to find a record that version stored.
    fn earlier_fingerprint(&self) -> Option<Fingerprint>;

    /// The span of the request or message, when it is traced: the core's phases are its
    /// children.
    fn trace(&self) -> Option<&Trace> {
        None
    }
}

/// What became of an execution.
pub enum Attempt<R> {
    /// The operation ran and answered: `response` is what retries get (its `completed_ms` is
    /// set by the core), `output` what this caller gets, and `status` what the answer stands
    /// for as the front judges it (for a gRPC answer, the HTTP status of its `grpc-status`):
    /// the core keeps or releases the key by it.
    Answered {
        response: StoredResponse,
        output: R,
        status: u16,
    },
    /// The operation certainly did not run (nothing was sent).
    NotSent(BoxError),
    /// It was sent and may have run, but no complete answer came back.
    Unknown {
        reason: UnknownReason,
        error: BoxError,
    },
}

impl<R> Attempt<R> {
    /// Ends the span of the call that made this attempt (`[telemetry]`); an answer keeps
    /// `link`, the span of the request or message it answers, for the replays that will link to
    /// it.
    pub fn end_span(&mut self, call: &Trace, link: Option<TraceLink>) {
        match self {
            Attempt::Answered {
                response, status, ..
            } => {
                call.set(KeyValue::new(
                    "http.response.status_code",
                    i64::from(response.status.as_u16()),
                ));
                response.link = link;
                call.end((*status >= 500).then_some(""));
            }
            Attempt::NotSent(_) => call.end(Some("not sent")),
            Attempt::Unknown { reason, .. } => call.end(Some(reason.as_str())),
        }
    }
}

/// The core's answer for one operation.
pub enum Decision<E: Execute> {
    /// This call owned the key and ran the operation for `took`; `settled` says what became of
    /// it.
    Owned {
        settled: Settled<E::Output>,
        took: Duration,
    },
    /// An earlier execution's stored result.
    Replay {
        response: Arc<StoredResponse>,
        /// The original was still running when this call came, and this call waited for it.
        waited: bool,
    },
    /// Refused without running.
    Refused(Refusal),
    /// The store cannot be used and the rules say to run without idempotency
    /// (`on_store_error = "pass"`): the operation is handed back to the front.
    Bypass(E),
}

/// How the owner's execution was written down (phase `settle`).
pub enum Settled<R> {
    /// It ran and answered; the answer is stored for retries.
    Stored(R),
    /// It ran and answered, and the store did not take the answer. `lost`: the record was no
    /// longer this owner's (lease run out and taken over, or released by an operator); else
    /// Redis and Postgres write it again in the background (`store::complete_later`): until then
    /// it reads as in flight, then as an unknown outcome; never run again. An HTTP caller still
    /// gets the answer; a broker message is not acknowledged.
    NotStored { output: R, lost: bool },
    /// It ran, and its answer says it did not execute (408, 415, 425, 429, or a 5xx the rules do
    /// not store): the answer is passed on and the key released.
    Released(R),
    /// It could not be sent (why): the key was released.
    NotSent(BoxError),
    /// It was sent without a complete answer. The key is kept as unknown, or released when
    /// `retryable` (on_unknown = "retry").
    Unknown {
        reason: UnknownReason,
        retryable: bool,
    },
    /// It answered with a status that may follow a commit (`unknown_statuses`: a proxy's 502
    /// or 504 in front of an upstream that ran it): the answer is passed on, and the key is
    /// kept as unknown (or released when `retryable`), as for [`Settled::Unknown`].
    AnsweredUnknown {
        output: R,
        status: u16,
        reason: UnknownReason,
        retryable: bool,
    },
}

impl<R> Settled<R> {
    /// Whether the key was kept as an unknown outcome (for the reconciliation to ask about).
    fn kept_unknown(&self) -> bool {
        matches!(
            self,
            Settled::Unknown {
                retryable: false,
                ..
            } | Settled::AnsweredUnknown {
                retryable: false,
                ..
            }
        )
    }
}

/// Why an operation was refused without running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The key was used with other parameters (another fingerprint); the record is untouched.
    KeyReused,
    /// The original is still running after `wait`.
    InFlight,
    /// An earlier attempt's outcome is unknown: never executed again automatically.
    OutcomeUnknown(UnknownReason),
    /// As `OutcomeUnknown`, on a route whose upstream is asked (`reconcile`): its next lookup
    /// is due at this time (ms since the Unix epoch), in the background if no retry comes.
    LookupDue {
        reason: UnknownReason,
        due_ms: u64,
    },
    /// As `OutcomeUnknown`, but the upstream's lookup (`reconcile`) was not asked for this
    /// call (every lookup was taken, or the one it waited for was not answered): it may say
    /// soon, so a message is tried again rather than dead-lettered.
    Reconciling(UnknownReason),
    StoreUnavailable,
    StoreFull,
    /// The key's record is sealed and does not open with this gateway's keys: never replayed,
    /// never executed again, whatever `on_store_error` says.
    Unreadable,
    /// The caller's scope stored as many records as its quota allows in this window.
    OverQuota {
        retry_after: Duration,
    },
}

/// What an existing record means for this call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolved {
    Replay(Arc<StoredResponse>),
    /// Abandoned or unknown, and the rules allow running it again; or, on a route that does not
    /// check fingerprints, a stored 4xx of another request: take over this record.
    TakeOver(Record),
}

/// Runs keyed operations; one per process, shared by every worker and front.
pub struct Core {
    /// Owner executions whose caller went away; shutdown waits for them.
    tasks: TaskTracker,
    shared: Arc<Shared>,
}

/// What every execution of the core uses, one `Arc` for a request to hold.
struct Shared {
    metrics: Arc<Metrics>,
    /// Asks upstreams about unknown outcomes, now and in the background.
    reconciler: Arc<Reconciler>,
    /// Duplicates waiting on pending keys, one store reader per key.
    rooms: Rooms,
    /// Records stored per client scope, against the routes' quotas.
    quotas: Quotas,
}

impl Core {
    pub fn new(metrics: Arc<Metrics>, reconciler: Arc<Reconciler>) -> Self {
        Core {
            shared: Arc::new(Shared {
                rooms: Rooms::new(metrics.waiting()),
                quotas: Quotas::new(),
                metrics,
                reconciler,
            }),
            tasks: TaskTracker::new(),
        }
    }

    /// Owner executions still running on their own (their callers went away).
    pub fn tasks(&self) -> &TaskTracker {
        &self.tasks
    }

    /// What settles unknown outcomes (the server runs its background part).
    pub fn reconciler(&self) -> &Arc<Reconciler> {
        &self.shared.reconciler
    }

    /// When a new key of this caller would be refused for its quota or its share of the store:
    /// how long until it may try again.
    fn over_quota(&self, rules: &Rules, store: &Arc<dyn Store>) -> Option<Duration> {
        let quotas = &self.shared.quotas;
        if let Some(Err(over)) = rules.quota.map(|q| quotas.check(&q)) {
            return Some(over.retry_after);
        }
        quotas
            .share_refuses(rules.share, || store.fill())
            .then_some(SHARE_RETRY)
    }

    /// One keyed operation, from reservation to decision. `store` is the calling worker's
    /// handle ([`Store::for_worker`]).
    /// `lookup`: how to ask the upstream about this key when its outcome is unknown
    /// ([`crate::reconcile`]).
    /// `keys`: the key, and for one found under an older derivation ([`legacy`]), this
    /// version's key for the same request.
    pub async fn run<E: Execute>(
        &self,
        store: &Arc<dyn Store>,
        keys: Keys,
        claim: Claim,
        (rules, lookup): (Rules, Option<&Lookup>),
        exec: E,
    ) -> Decision<E> {
        let Keys {
            key: mut current,
            mut instead,
        } = keys;
        let key = &mut current;
        let records = Records {
            store: Arc::clone(store),
            shared: Arc::clone(&self.shared),
            trace: exec.trace().cloned(),
        };
        let wait_until = Instant::now() + rules.wait;
        let earlier = || exec.earlier_fingerprint();
        let sought = Sought::new(claim.fingerprint, &earlier);
        for _ in 0..MAX_RESERVE_ROUNDS {
            let reservation = match self.reservation(&records, store, key, &claim, rules).await {
                Ok(r) => r,
                Err(None) => return Decision::Bypass(exec),
                Err(Some(refusal)) => return Decision::Refused(refusal),
            };
            let record = match reservation {
                // An older key's record went before this call read it: given back at once.
                Reservation::Owner(token) if instead.is_some() => {
                    records.release(key, token).await;
                    move_on(key, &mut instead);
                    continue;
                }
                Reservation::Owner(token) => {
                    return self
                        .execute(records, *key, token, (rules, lookup), exec)
                        .await;
                }
                Reservation::Existing(record) => record,
            };
            let old = match records
                .resolve(key, &sought, rules, record, wait_until)
                .await
            {
                Ok(Some(Resolved::Replay(response))) => {
                    return Decision::Replay {
                        response,
                        waited: false,
                    }
                }
                // Not under an older key: this version's takes its place.
                Ok(Some(Resolved::TakeOver(_))) if instead.is_some() => {
                    move_on(key, &mut instead);
                    continue;
                }
                // A take-over is a new execution: not past the scope's quota, which let this
                // call read the record only to replay it.
                Ok(Some(Resolved::TakeOver(old))) => match self.over_quota(&rules, store) {
                    Some(retry_after) => {
                        return Decision::Refused(Refusal::OverQuota { retry_after })
                    }
                    None => old,
                },
                // Released while we waited: this call may run it now.
                Ok(None) => {
                    move_on(key, &mut instead);
                    continue;
                }
                Err(Waited::Replay(response)) => {
                    return Decision::Replay {
                        response,
                        waited: true,
                    }
                }
                Err(Waited::Refused(Refusal::OutcomeUnknown(reason))) => {
                    // Boxed: the upstream's lookup is rare, and inline it would size every call.
                    match Box::pin(self.reconciled(&records, key, lookup, rules, reason)).await {
                        Some(decision) => return decision,
                        // The upstream says it did not happen: this call may run it now.
                        None => {
                            move_on(key, &mut instead);
                            continue;
                        }
                    }
                }
                Err(Waited::Refused(r)) => return Decision::Refused(r),
            };
            let taken = match self.take_over(&records, key, &old, &claim, rules).await {
                Ok(taken) => taken,
                Err(e) => return Decision::Refused(store_refusal(key, e)),
            };
            if let Some(token) = taken {
                return self
                    .execute(records, *key, token, (rules, lookup), exec)
                    .await;
            }
        }
        Decision::Refused(Refusal::InFlight)
    }

    /// Phase `reserve`: the key's reservation, or why this call stops: refused, or (`None`)
    /// forwarded without idempotency (`on_store_error = "pass"`).
    async fn reservation(
        &self,
        records: &Records,
        store: &Arc<dyn Store>,
        key: &StoreKey,
        claim: &Claim,
        rules: Rules,
    ) -> Result<Reservation, Option<Refusal>> {
        let reserved = match self.over_quota(&rules, store) {
            // A scope at its quota may still get its replays, but not a new key.
            Some(retry_after) => match records.get(key).await {
                Ok(Some(record)) => Ok(Reservation::Existing(record)),
                Ok(None) => return Err(Some(Refusal::OverQuota { retry_after })),
                Err(e) => Err(e),
            },
            None => records.reserve(key, claim, rules).await,
        };
        let reservation = match reserved {
            Ok(r) => r,
            // A record that exists but cannot be read: its outcome is unknown, and it must
            // never be run, whatever on_store_error says.
            Err(StoreError::Corrupt(e)) => {
                tracing::error!(key = key.short(), error = %e, "unreadable record");
                return Err(Some(Refusal::OutcomeUnknown(UnknownReason::Interrupted)));
            }
            Err(e @ StoreError::Unreadable { .. }) => return Err(Some(store_refusal(key, e))),
            // The operator asked for a store that keeps records, not for idempotency when
            // convenient: a store that may not keep them is no reason to go without.
            Err(e)
                if rules.on_store_error == OnStoreError::Pass
                    && !matches!(e, StoreError::Unsafe(_)) =>
            {
                // The operator chose availability over duplicates for this route.
                tracing::warn!(key = key.short(), error = %e, "store unavailable; forwarding without idempotency (on_store_error = \"pass\")");
                return Err(None);
            }
            Err(e) => return Err(Some(store_refusal(key, e))),
        };
        Ok(reservation)
    }

    /// Takes `old` over for this call (`None`: it changed meanwhile). A stored refusal's
    /// take-over is finished, and given back, even if the caller goes away
    /// ([`Records::take_over_refusal`]).
    async fn take_over(
        &self,
        records: &Records,
        key: &StoreKey,
        old: &Record,
        claim: &Claim,
        rules: Rules,
    ) -> Result<Option<OwnerToken>, StoreError> {
        let refusal = matches!(old.state, RecordState::Completed(_));
        let taken = match refusal {
            // Boxed: rare, and inline it would size every call's future.
            true => Box::pin(records.take_over_refusal(key, old, claim, rules, &self.tasks)).await,
            false => records.take_over(key, old, claim, rules).await,
        };
        if let Ok(Some(_)) = taken {
            match refusal {
                true => tracing::info!(
                    key = key.short(),
                    "another request with this key runs: the stored answer refused a different one (4xx, check_fingerprint = false)"
                ),
                false => tracing::warn!(
                    key = key.short(),
                    "taking over an abandoned or unknown key (on_unknown = \"retry\")"
                ),
            }
        }
        taken
    }

    /// Phase `reconcile`: an unknown outcome, settled by the upstream's lookup if the caller has
    /// one. `None`: it did not happen and the key is free again.
    async fn reconciled<E: Execute>(
        &self,
        records: &Records,
        key: &StoreKey,
        lookup: Option<&Lookup>,
        rules: Rules,
        reason: UnknownReason,
    ) -> Option<Decision<E>> {
        let Some(lookup) = lookup else {
            return Some(Decision::Refused(Refusal::OutcomeUnknown(reason)));
        };
        let reconciler = &self.shared.reconciler;
        let span =
            (records.trace.as_ref()).map(|t| t.phase("reconcile", SpanKind::Internal, Vec::new()));
        let settled = reconciler.settle(&*records.store, key, lookup, rules.ttl, span.as_ref());
        let settled = settled.await;
        if let Some(span) = &span {
            span.set(KeyValue::new("idemgate.reconciliation", settled.as_str()));
            span.end(None);
        }
        match settled {
            Reconciled::Replay(response) => Some(Decision::Replay {
                response,
                waited: false,
            }),
            // It did not happen, or it was settled meanwhile: read the record again.
            Reconciled::Released | Reconciled::Settled => None,
            Reconciled::TooEarly(due_ms) => {
                reconciler.schedule(*key, lookup, rules.ttl, due_ms);
                Some(Decision::Refused(Refusal::LookupDue { reason, due_ms }))
            }
            // Not asked (every lookup was taken, or the shared one went unanswered): the
            // background asks as soon as it can.
            Reconciled::Busy => {
                reconciler.schedule(*key, lookup, rules.ttl, now_ms());
                Some(Decision::Refused(Refusal::Reconciling(reason)))
            }
            Reconciled::Unknown => {
                // The background asks again, with backoff.
                let due_ms = now_ms().saturating_add(lookup.after.as_millis() as u64);
                reconciler.schedule(*key, lookup, rules.ttl, due_ms);
                Some(Decision::Refused(Refusal::LookupDue { reason, due_ms }))
            }
        }
    }

    /// Phase `execute`: the owner runs the operation and stores the result. Runs in the caller's
    /// own task while it waits, and on its own if the caller goes away ([`Detachable`]).
    async fn execute<E: Execute>(
        &self,
        records: Records,
        key: StoreKey,
        token: OwnerToken,
        (rules, lookup): (Rules, Option<&Lookup>),
        exec: E,
    ) -> Decision<E> {
        // Owned: the execution may outlive this call.
        let lookup = lookup.cloned();
        let run = async move {
            // Dropped unfinished only when its runtime is torn down at the end of the shutdown
            // grace: then it names the key it leaves pending.
            let cut_off = detach::CutOff::new(key);
            let started = Instant::now();
            let forward = exec.execute();
            tokio::pin!(forward);
            let attempt = tokio::select! {
                a = &mut forward => a,
                () = records.renew_lease(&key, token, rules.lease) => forward.await,
            };
            let took = started.elapsed();
            let settled = records.settle(&key, token, rules, attempt).await;
            if let (true, Some(lookup)) = (settled.kept_unknown(), &lookup) {
                // Asked in the background once `after` (and `max_clock_skew`, as a lookup waits)
                // has passed, whether or not anyone retries.
                let wait = lookup.after.saturating_add(records.store.max_clock_skew());
                let due = now_ms().saturating_add(wait.as_millis() as u64);
                records
                    .shared
                    .reconciler
                    .schedule(key, lookup, rules.ttl, due);
            }
            cut_off.finished();
            Decision::Owned { settled, took }
        };
        Detachable::new(run, self.tasks.clone()).await
    }
}

/// The key of one call ([`Core::run`]).
#[derive(Debug, Clone, Copy)]
pub struct Keys {
    pub key: StoreKey,
    /// When `key` is an older derivation's, found holding this request's record: this
    /// version's key, which the call moves to before anything would be written under the older
    /// one (a record written there would outlive the window in which older keys are looked up).
    pub instead: Option<StoreKey>,
}

impl Keys {
    pub fn of(key: StoreKey) -> Keys {
        Keys { key, instead: None }
    }
}

/// Moves a call from an older key to this version's, where it has one.
fn move_on(key: &mut StoreKey, instead: &mut Option<StoreKey>) {
    if let Some(newer) = instead.take() {
        *key = newer;
    }
}

/// What a record must hold to be this request's: the claim's fingerprint, or the one the version
/// before issue 44 gave the same request. That one is computed only when the first does not
/// match (again for each record read: only a pending record of the previous version is read
/// twice), and can only match a record that version stored: this version's
/// fingerprints are of another form ([`crate::fingerprint::fingerprint`]). Those records are
/// gone one `ttl` after the upgrade.
pub struct Sought<'a> {
    fingerprint: Fingerprint,
    earlier: &'a (dyn Fn() -> Option<Fingerprint> + Sync),
}

impl<'a> Sought<'a> {
    pub fn new(
        fingerprint: Fingerprint,
        earlier: &'a (dyn Fn() -> Option<Fingerprint> + Sync),
    ) -> Self {
        Sought {
            fingerprint,
            earlier,
        }
    }

    pub(crate) fn matches(&self, record: &Record) -> bool {
        record.fingerprint == self.fingerprint || (self.earlier)() == Some(record.fingerprint)
    }
}

/// What an existing record means: `Ok(None)` while it is pending with a live lease (wait).
pub fn decide(
    rules: Rules,
    sought: &Sought<'_>,
    record: &Record,
) -> Result<Option<Resolved>, Refusal> {
    if rules.check_fingerprint && !sought.matches(record) {
        return Err(Refusal::KeyReused);
    }
    match &record.state {
        // A refusal answers the request it refused, not the operation its key names: another
        // event with the same business key runs in its place (the 4xx said nothing was done).
        RecordState::Completed(stored)
            if stored.status.is_client_error() && !sought.matches(record) =>
        {
            Ok(Some(Resolved::TakeOver(record.clone())))
        }
        RecordState::Completed(stored) => Ok(Some(Resolved::Replay(Arc::clone(stored)))),
        RecordState::Unknown { .. } | RecordState::Abandoned { .. }
            if rules.on_unknown == OnUnknown::Retry =>
        {
            Ok(Some(Resolved::TakeOver(record.clone())))
        }
        RecordState::Unknown { reason, .. } => Err(Refusal::OutcomeUnknown(*reason)),
        RecordState::Abandoned { .. } => Err(Refusal::OutcomeUnknown(UnknownReason::Abandoned)),
        RecordState::Pending { .. } => Ok(None),
    }
}

/// Statuses that say the upstream did not execute the request: the key is released so a retry
/// runs. 5xx only when `store_server_errors = false`; 408, 425 and 429 always (the request was
/// refused before it was processed, and storing it would make every retry fail), 415 too (the
/// upstream refused the body's format or coding before reading it: a retry sent otherwise must
/// run, as a compressed first attempt to an upstream that reads none is retried plain); 401 and 403
/// always (the caller was refused before anything ran, and storing refusals would let anyone
/// with made-up credentials fill the store).
pub fn not_executed(status: u16, store_server_errors: bool) -> bool {
    ((500..600).contains(&status) && !store_server_errors)
        || matches!(status, 401 | 403 | 408 | 415 | 425 | 429)
}

fn store_refusal(key: &StoreKey, e: StoreError) -> Refusal {
    // An unreadable record is logged with its key id only: never key material, nor the record.
    if let StoreError::Unreadable { key_id, why, .. } = e {
        tracing::error!(key = key.short(), key_id = ?key_id, why, "a sealed record does not open: refused, not executed (record-unreadable)");
        return Refusal::Unreadable;
    }
    tracing::warn!(key = key.short(), error = %e, "store error");
    match e {
        StoreError::Full(_) => Refusal::StoreFull,
        _ => Refusal::StoreUnavailable,
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod model;
