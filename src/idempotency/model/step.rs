//! The model's steps: which actions a state allows, and what each does. Every store operation
//! is one atomic step, as the contract makes it (insert-if-absent, compare-and-set, owner-only
//! writes).

use super::{Action, By, Exec, Gw, Protocol, Rec, Run, State, AFTER, L, TICK_MS, W};
use crate::config::OnUnknown;
use crate::idempotency::{not_executed, Refusal, Resolved};
use crate::reconcile::lookup_due;

/// Statuses an upstream answers after applying a request, and after not applying it.
const APPLIED: [u16; 3] = [201, 409, 504];
const NOT_APPLIED: [u16; 4] = [500, 401, 429, 504];

pub(super) fn actions(m: &Protocol, s: &State, out: &mut Vec<Action>) {
    for (g, gw) in s.gws.iter().enumerate() {
        let g8 = g as u8;
        match *gw {
            Gw::Idle if s.sent < m.sends => out.push(Action::Send(g8)),
            Gw::Idle => {}
            Gw::Waiting { until } => {
                out.push(Action::Recheck(g8));
                if m.clock(g, s.now) >= until || s.now == m.horizon {
                    out.push(Action::GiveUp(g8));
                }
                out.push(Action::Crash(g8));
            }
            Gw::Owner { exec: None, .. } => {
                out.push(Action::Forward(g8));
                out.push(Action::Crash(g8));
            }
            Gw::Owner { .. } if unrenewed(m, s, g) => {
                out.push(Action::Renew(g8));
                out.push(Action::Crash(g8));
            }
            Gw::Owner { exec: Some(e), .. } => {
                let exec = s.execs[usize::from(e)];
                if exec.run != Run::Running {
                    let statuses: &[u16] = if exec.run == Run::Applied {
                        &APPLIED
                    } else {
                        &NOT_APPLIED
                    };
                    out.extend(statuses.iter().map(|&st| Action::Answer(e, st)));
                }
                out.push(Action::Lose(e));
                out.push(Action::Crash(g8));
            }
        }
    }
    for (e, exec) in s.execs.iter().enumerate() {
        if exec.run == Run::Running {
            out.push(Action::Apply(e as u8));
            out.push(Action::Fail(e as u8));
        }
    }
    // Time passes unless an execution must have ended by the next tick (the upstream's `after`
    // promise: nothing completes at or past its deadline).
    let overdue = s
        .execs
        .iter()
        .any(|e| e.run == Run::Running && e.deadline.is_some_and(|d| d <= s.now + 1));
    // Nor before every live owner has renewed its lease in this tick.
    let renewing = (0..s.gws.len()).any(|g| unrenewed(m, s, g));
    if s.now < m.horizon && !overdue && !renewing {
        out.push(Action::Tick);
    }
    if m.on_unknown == OnUnknown::Reject && !s.operator_acted && open_outcome(m, s) {
        out.push(Action::OperatorResolve);
        // An operator releases only once the upstream shows nothing applied nor running.
        if s.execs.iter().all(|e| e.run == Run::Failed) {
            out.push(Action::OperatorRelease);
        }
    }
}

/// Whether gateway `g` owns the pending record and has not renewed its lease in this tick.
fn unrenewed(m: &Protocol, s: &State, g: usize) -> bool {
    match (s.gws[g], s.store) {
        (
            Gw::Owner { token, .. },
            Some(Rec::Pending {
                token: t,
                lease_until,
            }),
        ) => token == t && lease_until < m.clock(g, s.now) + L,
        _ => false,
    }
}

/// Whether the record is an unknown outcome as the operator's gateway (the first) reads it.
fn open_outcome(m: &Protocol, s: &State) -> bool {
    s.store
        .is_some_and(|rec| m.judge(0, s.now, rec).0.is_unknown())
}

pub(super) fn next(m: &Protocol, s: &State, action: Action) -> State {
    let mut s = s.clone();
    match action {
        Action::Send(g) => {
            s.sent += 1;
            arrive(m, &mut s, usize::from(g));
        }
        Action::Recheck(g) => arrive(m, &mut s, usize::from(g)),
        Action::GiveUp(g) => s.gws[usize::from(g)] = Gw::Idle,
        Action::Forward(g) => forward(&mut s, usize::from(g)),
        Action::Renew(g) => {
            if let Some(Rec::Pending { token, .. }) = s.store {
                s.store = Some(Rec::Pending {
                    token,
                    lease_until: m.clock(usize::from(g), s.now) + L,
                });
            }
        }
        Action::Apply(e) => s.execs[usize::from(e)].run = Run::Applied,
        Action::Fail(e) => s.execs[usize::from(e)].run = Run::Failed,
        Action::Answer(e, status) => answer(m, &mut s, e, status),
        Action::Lose(e) => lose(m, &mut s, e),
        Action::Crash(g) => crash(m, &mut s, usize::from(g)),
        Action::Tick => tick(&mut s),
        Action::OperatorResolve => {
            s.operator_acted = true;
            complete(&mut s, By::Operator);
            s.unknown_open = false;
        }
        Action::OperatorRelease => {
            s.operator_acted = true;
            s.store = None;
            s.unknown_open = false;
        }
    }
    s
}

/// A request (or a woken waiter) at gateway `g`: reserve, or read and decide.
fn arrive(m: &Protocol, s: &mut State, g: usize) {
    let Some(rec) = s.store else {
        reserve(m, s, g);
        return;
    };
    let (record, decided) = m.judge(g, s.now, rec);
    if matches!(rec, Rec::Completed(_)) && !matches!(decided, Ok(Some(Resolved::Replay(_)))) {
        s.missed_answer = true;
    }
    s.gws[g] = match decided {
        Ok(Some(Resolved::Replay(_))) => {
            s.replayed = true;
            Gw::Idle
        }
        Ok(Some(Resolved::TakeOver(_))) => {
            // The compare-and-set succeeds: the record is as read (this step is atomic).
            s.taken_over = true;
            reserve(m, s, g);
            return;
        }
        Ok(None) => match s.gws[g] {
            waiting @ Gw::Waiting { .. } => waiting,
            _ => Gw::Waiting {
                until: m.clock(g, s.now) + W,
            },
        },
        Err(Refusal::OutcomeUnknown(_)) if m.reconcile => {
            let after = std::time::Duration::from_millis(AFTER * TICK_MS);
            let margin = std::time::Duration::from_millis(m.margin * TICK_MS);
            if lookup_due(&record.state, after, margin)
                .is_some_and(|due| m.clock(g, s.now) * TICK_MS >= due)
            {
                look_up(s);
            }
            Gw::Idle
        }
        Err(_) => Gw::Idle,
    };
}

/// A lookup asks the upstream: applied answers the record (compare-and-set on the unknown
/// one, as read in the same step); nothing applied releases the key.
fn look_up(s: &mut State) {
    match s.execs.iter().position(|e| e.run == Run::Applied) {
        Some(e) => {
            s.looked_up_2xx = true;
            complete(s, By::Exec(e as u8));
        }
        None => {
            s.looked_up_404 = true;
            s.store = None;
        }
    }
    s.unknown_open = false;
}

fn reserve(m: &Protocol, s: &mut State, g: usize) {
    s.tokens += 1;
    let token = s.tokens;
    s.store = Some(Rec::Pending {
        token,
        lease_until: m.clock(g, s.now) + L,
    });
    s.gws[g] = Gw::Owner { token, exec: None };
}

fn forward(s: &mut State, g: usize) {
    let Gw::Owner { token, exec: None } = s.gws[g] else {
        return;
    };
    if s.unknown_open {
        s.reexecuted_unknown = true;
    }
    // Another gateway that forwarded and is alive, its answer not settled: its execution may
    // still run (or have applied, its answer on the way).
    let live_owner =
        (0..s.gws.len()).any(|h| h != g && matches!(s.gws[h], Gw::Owner { exec: Some(_), .. }));
    if live_owner {
        s.overlapped_live_owner = true;
    }
    s.execs.push(Exec {
        gw: g as u8,
        token,
        run: Run::Running,
        deadline: None,
    });
    s.gws[g] = Gw::Owner {
        token,
        exec: Some((s.execs.len() - 1) as u8),
    };
}

/// The owner settles an answer as the core does: released if the status says nothing ran,
/// kept as unknown if `unknown_statuses` names it, else completed.
fn answer(m: &Protocol, s: &mut State, e: u8, status: u16) {
    let exec = s.execs[usize::from(e)];
    let rules = m.rules();
    if rules.unknown_statuses.contains(status) {
        unknown(m, s, exec);
    } else if not_executed(status, rules.store_server_errors) {
        if owns(s, exec.token) {
            s.store = None;
        }
    } else if owns(s, exec.token) {
        complete(s, By::Exec(e));
    }
    s.gws[usize::from(exec.gw)] = Gw::Idle;
}

/// The call ends without an answer; an execution still running is no longer watched, and ends
/// within `AFTER` of the time the record is marked with.
fn lose(m: &Protocol, s: &mut State, e: u8) {
    let exec = s.execs[usize::from(e)];
    if exec.run == Run::Running {
        s.execs[usize::from(e)].deadline = Some(s.now + AFTER);
    }
    unknown(m, s, exec);
    s.gws[usize::from(exec.gw)] = Gw::Idle;
}

/// `keep_unknown`: released under `on_unknown = "retry"`, else marked unknown (owner only).
fn unknown(m: &Protocol, s: &mut State, exec: Exec) {
    if !owns(s, exec.token) {
        return;
    }
    if m.on_unknown == OnUnknown::Retry {
        s.store = None;
    } else {
        s.store = Some(Rec::Unknown {
            since: m.clock(usize::from(exec.gw), s.now),
        });
        s.unknown_open = true;
    }
}

/// The gateway dies: its waiters are gone; a key it owned stays pending until its lease runs
/// out (an unknown outcome then), and an execution it started ends within `AFTER` of the
/// lease's end.
fn crash(m: &Protocol, s: &mut State, g: usize) {
    if let Gw::Owner { token, exec } = s.gws[g] {
        if let Some(Rec::Pending {
            token: t,
            lease_until,
        }) = s.store
        {
            if t == token {
                s.unknown_open = true;
                if let Some(e) = exec {
                    let real_end = lease_until.saturating_sub(m.offset(g));
                    s.execs[usize::from(e)].deadline = Some(real_end.max(s.now) + AFTER);
                }
            }
        }
        if let Some(e) = exec {
            if s.execs[usize::from(e)].deadline.is_none() {
                s.execs[usize::from(e)].deadline = Some(s.now + AFTER);
            }
        }
    }
    s.gws[g] = Gw::Idle;
}

/// A tick passes (every live owner renews in it: [`Action::Renew`]).
fn tick(s: &mut State) {
    s.now += 1;
}

fn owns(s: &State, token: u8) -> bool {
    matches!(s.store, Some(Rec::Pending { token: t, .. }) if t == token)
}

fn complete(s: &mut State, by: By) {
    s.store = Some(Rec::Completed(by));
    if s.first_completed.is_none() {
        s.first_completed = Some(by);
    }
}
