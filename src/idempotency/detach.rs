//! An owner's execution that outlives its caller: see [`Detachable`].

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio_util::task::TaskTracker;
use tracing::Instrument as _;

use crate::key::StoreKey;

/// An owner's execution, run inside the caller's task while the caller waits. If the caller
/// goes away first (hyper then drops the request's future), the execution moves to a task of its
/// own, so the operation still completes and its result is still stored; shutdown waits for such
/// tasks ([`super::Core::tasks`]). Spawning every execution up front would cost a task, a wake-up and a
/// hand-off per request for the rare caller that hangs up.
pub(super) struct Detachable<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    /// `None` once finished. Boxed so that, half-run, it can still be moved to a task.
    run: Option<Pin<Box<F>>>,
    tasks: TaskTracker,
}

impl<F> Detachable<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    pub(super) fn new(run: F, tasks: TaskTracker) -> Self {
        Detachable {
            run: Some(Box::pin(run)),
            tasks,
        }
    }
}

impl<F> Future for Detachable<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let Some(run) = self.run.as_mut() else {
            // Polled again after finishing: a caller's bug, and nothing left to give.
            return Poll::Pending;
        };
        let done = ready!(run.as_mut().poll(cx));
        self.run = None;
        Poll::Ready(done)
    }
}

impl<F> Drop for Detachable<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn drop(&mut self) {
        let Some(run) = self.run.take() else { return };
        match tokio::runtime::Handle::try_current() {
            // In the `tracing` span the caller was dropped in (a traced request's, which names
            // its trace): the execution's log lines keep the request's ids.
            Ok(runtime) => {
                self.tasks.spawn_on(run.in_current_span(), &runtime);
            }
            // Only when the runtime itself is being torn down, past the shutdown grace: the
            // run, dropped here, names its key ([`CutOff`]).
            Err(_) => drop(run),
        }
    }
}

/// An owner's execution until it has settled its key: dropped before (its runtime torn down at
/// the end of the shutdown grace, with the upstream call or the store write still running), it
/// logs the key it leaves pending, one line per key, so that an operator knows which outcomes
/// to check (`idemgate keys list` shows them once their leases run out).
pub(super) struct CutOff {
    key: Option<StoreKey>,
}

impl CutOff {
    pub(super) fn new(key: StoreKey) -> CutOff {
        CutOff { key: Some(key) }
    }

    pub(super) fn finished(mut self) {
        self.key = None;
    }
}

impl Drop for CutOff {
    fn drop(&mut self) {
        let Some(key) = self.key else { return };
        if std::thread::panicking() {
            tracing::error!(key = key.short(), id = %key.hex(), "an upstream call ended in a panic before its key was settled: it may stay pending until its lease runs out, then read as an unknown outcome");
            return;
        }
        tracing::warn!(
            key = key.short(),
            id = %key.hex(),
            "an upstream call was cut off by the end of the shutdown grace: its key may stay pending until its lease runs out, then read as an unknown outcome"
        );
    }
}
