//! The cap on connections to each upstream (`[upstream] max_connections`), shared by every
//! worker's pool.
//!
//! Each connection holds a slot from its upstream's [`Gate`] for as long as its socket is open
//! (the slot lives in the task that drives the connection), so the cap counts real sockets: in
//! use, idle in a pool, or still finishing a call whose client left. A request that finds no
//! idle connection and no free slot waits within the connect timeout, then gets
//! [`NoConnectionSlot`] (not sent; `503 overloaded` for its client). While anyone waits, idle
//! connections to that upstream are closed rather than kept (at once when they come back, and
//! on each worker's next heartbeat for those already idle), so that a slot idle in one worker's
//! pool does not starve a request on another.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use http::uri::Authority;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// Every upstream's gate; one per process.
pub struct ConnectionLimits {
    max: usize,
    /// A config names a handful of upstreams: a list beats a map, and it is only searched when
    /// a connection is made.
    gates: Mutex<Vec<(Authority, Arc<Gate>)>>,
}

impl ConnectionLimits {
    /// At most `max` connections to each upstream (host and port).
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(ConnectionLimits {
            max: max.max(1),
            gates: Mutex::new(Vec::new()),
        })
    }

    pub fn gate(&self, authority: &Authority) -> Arc<Gate> {
        let mut gates = self.gates.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, gate)) = gates.iter().find(|(a, _)| a == authority) {
            return Arc::clone(gate);
        }
        let gate = Arc::new(Gate {
            slots: Arc::new(Semaphore::new(self.max)),
            waiting: AtomicUsize::new(0),
            max: self.max,
        });
        gates.push((authority.clone(), Arc::clone(&gate)));
        gate
    }
}

/// The slots of one upstream.
pub struct Gate {
    slots: Arc<Semaphore>,
    /// Requests waiting for a slot now.
    waiting: AtomicUsize,
    max: usize,
}

/// Every connection to the upstream stayed busy until the deadline.
#[derive(Debug, thiserror::Error)]
#[error("all {max} connections to the upstream stayed busy (upstream.max_connections)")]
pub struct NoConnectionSlot {
    pub max: usize,
}

impl Gate {
    /// A slot for a new connection, waiting until `deadline` at most.
    pub async fn slot(&self, deadline: Instant) -> Result<OwnedSemaphorePermit, NoConnectionSlot> {
        if let Ok(permit) = Arc::clone(&self.slots).try_acquire_owned() {
            return Ok(permit);
        }
        let _waiting = Waiting::new(&self.waiting);
        let waited =
            tokio::time::timeout_at(deadline, Arc::clone(&self.slots).acquire_owned()).await;
        match waited {
            Ok(Ok(permit)) => Ok(permit),
            // Timed out, or (never: the semaphore is not closed) closed.
            _ => Err(NoConnectionSlot { max: self.max }),
        }
    }

    /// Someone waits for a slot: idle connections should give theirs up.
    pub fn is_wanted(&self) -> bool {
        self.waiting.load(Ordering::Relaxed) > 0
    }

    /// Connections open now (for tests and metrics).
    pub fn open(&self) -> usize {
        self.max - self.slots.available_permits()
    }
}

/// Counts a waiting request until it stops waiting, however it stops (its caller may drop it).
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn new(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Waiting(count)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn a_full_gate_makes_a_request_wait_then_gives_up() {
        let limits = ConnectionLimits::new(2);
        let gate = limits.gate(&Authority::from_static("up:80"));
        let soon = || Instant::now() + Duration::from_secs(1);
        let a = gate.slot(soon()).await.unwrap();
        let _b = gate.slot(soon()).await.unwrap();
        assert_eq!(gate.open(), 2);
        let err = gate.slot(soon()).await.unwrap_err();
        assert_eq!(err.max, 2);
        assert!(!gate.is_wanted(), "a request that gave up no longer waits");
        let g = Arc::clone(&gate);
        let waiter =
            tokio::spawn(async move { g.slot(Instant::now() + Duration::from_secs(5)).await });
        tokio::task::yield_now().await;
        assert!(gate.is_wanted());
        drop(a);
        assert!(waiter.await.unwrap().is_ok());
        assert!(!gate.is_wanted());
        let g = Arc::clone(&gate);
        let gave_up =
            tokio::spawn(async move { g.slot(Instant::now() + Duration::from_secs(5)).await });
        tokio::task::yield_now().await;
        gave_up.abort();
        let _ = gave_up.await;
        assert!(!gate.is_wanted(), "a waiter dropped half-way still counted");
    }

    #[test]
    fn each_upstream_has_its_own_gate() {
        let limits = ConnectionLimits::new(1);
        let a = limits.gate(&Authority::from_static("a:80"));
        let again = limits.gate(&Authority::from_static("a:80"));
        let b = limits.gate(&Authority::from_static("b:80"));
        assert!(Arc::ptr_eq(&a, &again));
        assert!(!Arc::ptr_eq(&a, &b));
    }
}
