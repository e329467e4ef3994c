//! A model of the reservation protocol, checked exhaustively (stateright, breadth first): two
//! gateways with their own clocks, one store whose operations are atomic steps, clients that
//! retry through either gateway, and an upstream that counts what it applies. Crashes of a
//! gateway at every step, leases renewed while their owner lives, answers that release the key
//! or are lost, take-overs under `on_unknown = "retry"`, reconciliation lookups answering 2xx or
//! 404, and an operator's resolve and release are all actions the checker interleaves in every
//! order. The model decides nothing itself: a record is read through the store's real
//! [`Record::checked_lease_skewed_at`], judged by the core's real [`decide`], an answer by the
//! real [`not_executed`] and `unknown_statuses`, a lookup's time by the real
//! [`crate::reconcile::lookup_due`]. docs/lifecycle.md states the properties and bounds.
//!
//! Time is in ticks (a second each in the records): `L` the lease (renewed once every tick, a
//! third of it, as [`super::records`] does, at any point of the tick), `W` a duplicate's wait, `AFTER` the lookup's `after`. The
//! upstream's promise that makes a lookup's 404 mean anything (`after`, docs/configuration.md)
//! is an assumption of the model: an execution whose gateway stopped watching it (cut, or the
//! gateway died) ends within `AFTER` of the time its record says it last ran.

use std::io::Write as _;
use std::sync::Arc;
use std::time::Duration;

use stateright::{Checker, Expectation, HasDiscoveries, Model, Property};

use super::{decide, Refusal, Resolved, Rules, Sought};
use crate::config::{OnUnknown, Policy};
use crate::fingerprint::Fingerprint;
use crate::store::{OwnerToken, Record, RecordState, StoredResponse, UnknownReason};

const TICK_MS: u64 = 1000;
const L: u64 = 3;
const W: u64 = 2;
const AFTER: u64 = 2;
const GATEWAYS: usize = 2;

/// One configuration to check.
#[derive(Clone, Copy, Debug)]
struct Protocol {
    on_unknown: OnUnknown,
    /// Whether retries of an unknown outcome ask the upstream (`reconcile`).
    reconcile: bool,
    /// How far the second gateway's clock is ahead of the first's, in ticks.
    skew: u64,
    /// `store.max_clock_skew`, in ticks.
    margin: u64,
    /// Client attempts in all, and the last tick.
    sends: u8,
    horizon: u64,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum By {
    Exec(u8),
    Operator,
}

/// The key's record; times in the clock of whoever wrote them, in ticks.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Rec {
    Pending { token: u8, lease_until: u64 },
    Completed(By),
    Unknown { since: u64 },
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Gw {
    Idle,
    /// A duplicate waiting on a pending record until this time (its clock).
    Waiting {
        until: u64,
    },
    /// The owner of the key; `exec`: its execution, once forwarded.
    Owner {
        token: u8,
        exec: Option<u8>,
    },
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Run {
    Running,
    Applied,
    Failed,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
struct Exec {
    gw: u8,
    token: u8,
    run: Run,
    /// Real time by which it has ended, once its gateway no longer watches it.
    deadline: Option<u64>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct State {
    now: u64,
    store: Option<Rec>,
    gws: [Gw; GATEWAYS],
    execs: Vec<Exec>,
    sent: u8,
    tokens: u8,
    operator_acted: bool,
    // What happened, for the properties.
    first_completed: Option<By>,
    /// An outcome became unknown and no lookup's 404 or operator's release has cleared it.
    unknown_open: bool,
    reexecuted_unknown: bool,
    overlapped_live_owner: bool,
    /// A retry met a completed record and did not get its answer.
    missed_answer: bool,
    replayed: bool,
    taken_over: bool,
    looked_up_404: bool,
    looked_up_2xx: bool,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Action {
    /// A client sends (or retries) through this gateway.
    Send(u8),
    /// A waiter reads the record again (the store woke it).
    Recheck(u8),
    /// A waiter's wait ran out: `in-flight`.
    GiveUp(u8),
    Forward(u8),
    /// A live owner renews its lease (once a tick, a third of the lease, before the next).
    Renew(u8),
    Apply(u8),
    Fail(u8),
    /// The execution's answer reaches its gateway with this status.
    Answer(u8, u16),
    /// The gateway's call ends without an answer (cut at its deadline, connection lost).
    Lose(u8),
    Crash(u8),
    Tick,
    OperatorResolve,
    OperatorRelease,
}

impl Protocol {
    fn clock(&self, gw: usize, now: u64) -> u64 {
        if gw == 1 {
            now + self.skew
        } else {
            now
        }
    }

    fn offset(&self, gw: usize) -> u64 {
        self.clock(gw, 0)
    }

    fn rules(&self) -> Rules {
        let mut policy = Policy::builtin();
        policy.on_unknown = self.on_unknown;
        policy.lock_timeout = Duration::from_millis(L * TICK_MS);
        Rules::of(&policy, true)
    }

    /// The record as the real types hold it.
    fn record(rec: Rec) -> Record {
        let state = match rec {
            Rec::Pending { token, lease_until } => RecordState::Pending {
                owner: OwnerToken(u128::from(token)),
                lease_until_ms: lease_until * TICK_MS,
            },
            Rec::Completed(_) => RecordState::Completed(Arc::new(StoredResponse {
                status: http::StatusCode::CREATED,
                headers: Vec::new(),
                trailers: Vec::new(),
                body: bytes::Bytes::new(),
                body_kept: true,
                completed_ms: 0,
                link: None,
            })),
            Rec::Unknown { since } => RecordState::Unknown {
                since_ms: since * TICK_MS,
                reason: UnknownReason::Timeout,
            },
        };
        Record {
            fingerprint: Fingerprint([1; 32]),
            created_ms: 0,
            state,
            origin: None,
            sealing: crate::store::seal::Sealing::New,
        }
    }

    /// The record as gateway `gw` reads it now: the store's lease check, then the core's
    /// decision.
    fn judge(&self, gw: usize, now: u64, rec: Rec) -> (Record, Result<Option<Resolved>, Refusal>) {
        let clock_ms = self.clock(gw, now) * TICK_MS;
        let margin = Duration::from_millis(self.margin * TICK_MS);
        let record = Self::record(rec).checked_lease_skewed_at(clock_ms, margin);
        let no_earlier = || None;
        let sought = Sought::new(Fingerprint([1; 32]), &no_earlier);
        let decided = decide(self.rules(), &sought, &record);
        (record, decided)
    }
}

mod step;

impl Model for Protocol {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            now: 0,
            store: None,
            gws: [Gw::Idle; GATEWAYS],
            execs: Vec::new(),
            sent: 0,
            tokens: 0,
            operator_acted: false,
            first_completed: None,
            unknown_open: false,
            reexecuted_unknown: false,
            overlapped_live_owner: false,
            missed_answer: false,
            replayed: false,
            taken_over: false,
            looked_up_404: false,
            looked_up_2xx: false,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        step::actions(self, s, actions);
    }

    fn next_state(&self, s: &State, action: Action) -> Option<State> {
        Some(step::next(self, s, action))
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(
                "at most one execution applied (on_unknown = reject)",
                |m: &Protocol, s: &State| {
                    m.on_unknown == OnUnknown::Retry
                        || s.execs.iter().filter(|e| e.run == Run::Applied).count() <= 1
                },
            ),
            Property::always(
                "a completed record is never overwritten",
                |_, s: &State| match s.store {
                    Some(Rec::Completed(by)) => s.first_completed == Some(by),
                    _ => true,
                },
            ),
            // Under `on_unknown = "retry"` an abandoned key is taken over: by design.
            Property::always(
                "an unknown outcome runs again only after a 404 or a release",
                |m: &Protocol, s: &State| m.on_unknown == OnUnknown::Retry || !s.reexecuted_unknown,
            ),
            Property::always(
                "no execution starts while a live owner's runs",
                |_, s: &State| !s.overlapped_live_owner,
            ),
            Property::always(
                "a retry that meets a completed record gets its answer",
                |_, s: &State| !s.missed_answer,
            ),
            Property::sometimes("a retry replayed", |_, s: &State| s.replayed),
            Property::sometimes("a record taken over", |_, s: &State| s.taken_over),
            Property::sometimes("a lookup answered 404", |_, s: &State| s.looked_up_404),
            Property::sometimes("a lookup answered 2xx", |_, s: &State| s.looked_up_2xx),
        ]
    }

    fn within_boundary(&self, s: &State) -> bool {
        s.now <= self.horizon
    }
}

/// What checking one configuration found, after exploring every state within its bounds.
struct Found {
    /// Safety properties (`always`) with a counterexample.
    broken: Vec<&'static str>,
    /// Behaviours (`sometimes`) no state showed: the model did not reach them.
    unreached: Vec<&'static str>,
}

/// Checks `protocol` exhaustively (`until` a counterexample, for the runs expected to find
/// one); prints what it explored past the test harness's capture, so CI's log shows it, and
/// each counterexample's steps.
fn check(protocol: Protocol, until: HasDiscoveries) -> Found {
    let checker = protocol.checker().finish_when(until).spawn_bfs().join();
    let mut found = Found {
        broken: Vec::new(),
        unreached: Vec::new(),
    };
    for property in protocol.properties() {
        let discovered = checker.discovery(property.name).is_some();
        match property.expectation {
            Expectation::Always | Expectation::Eventually if discovered => {
                found.broken.push(property.name)
            }
            Expectation::Sometimes if !discovered => found.unreached.push(property.name),
            _ => {}
        }
    }
    let mut err = std::io::stderr();
    let _ = writeln!(
        err,
        "model {protocol:?}: {} states explored ({} unique); counterexamples: {:?}; not reached: {:?}",
        checker.state_count(),
        checker.unique_state_count(),
        found.broken,
        found.unreached,
    );
    for name in &found.broken {
        if let Some(path) = checker.discovery(name) {
            let _ = writeln!(err, "  {name}: {:?}", path.into_actions());
        }
    }
    found
}

#[cfg(test)]
mod tests;
