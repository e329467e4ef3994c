//! What `/readyz` knows of a consumer: whether its broker answers, whether its task runs, and
//! whether a dead letter is owed. Written by the consumer, read by the admin listener.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

/// How long a refused dead letter keeps `/readyz` failing when no message is held for it (a
/// source that gives such messages back): past it, the target is taken to have recovered or
/// the message to have gone to another instance.
const REFUSED_RECENTLY: Duration = Duration::from_secs(60);

/// One consumer's readiness, shared between its task and `/readyz`.
#[derive(Debug)]
pub struct BrokerHealth {
    pub consumer: String,
    /// The broker answered the last read (a fetch; a failed ack or keep does not count).
    reachable: AtomicBool,
    /// The task ended or panicked and is waiting to be started again.
    restarting: AtomicBool,
    /// Messages whose dead letter the target has not taken yet.
    owed: AtomicUsize,
    /// Dead letters refused in a row (0 once one is taken): the backoff of the next try.
    refusals: AtomicU32,
    /// When the last was refused, in milliseconds after `born`.
    refused_at: AtomicU64,
    born: Instant,
}

impl BrokerHealth {
    pub fn new(consumer: &str) -> Arc<Self> {
        Arc::new(BrokerHealth {
            consumer: consumer.to_string(),
            // Not ready until the broker has answered once.
            reachable: AtomicBool::new(false),
            restarting: AtomicBool::new(false),
            owed: AtomicUsize::new(0),
            refusals: AtomicU32::new(0),
            refused_at: AtomicU64::new(0),
            born: Instant::now(),
        })
    }

    /// Why `/readyz` should fail for this consumer, if it should.
    pub fn not_ready(&self) -> Option<String> {
        let consumer = &self.consumer;
        if self.restarting.load(Ordering::Relaxed) {
            return Some(format!("consumer {consumer:?}: stopped, being restarted"));
        }
        if !self.reachable.load(Ordering::Relaxed) {
            return Some(format!("consumer {consumer:?}: broker unreachable"));
        }
        let owed = self.owed.load(Ordering::Relaxed);
        if owed > 0 || self.refused_lately() {
            return Some(format!(
                "consumer {consumer:?}: the dead-letter target refuses dead letters ({owed} owed)"
            ));
        }
        None
    }

    pub(super) fn set_reachable(&self, reachable: bool) {
        self.reachable.store(reachable, Ordering::Relaxed);
    }

    /// The task stopped (`true`) or was started again (`false`): a new task is not ready
    /// until its broker answers.
    pub(super) fn set_restarting(&self, restarting: bool) {
        if restarting {
            self.reachable.store(false, Ordering::Relaxed);
        }
        self.restarting.store(restarting, Ordering::Relaxed);
    }

    pub(super) fn owe(&self, owed: bool) {
        if owed {
            self.owed.fetch_add(1, Ordering::Relaxed);
        } else {
            // Never below zero, whatever the order of calls.
            let _ = (self.owed)
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        }
    }

    /// A dead letter was refused: how many in a row now.
    pub(super) fn dead_letter_refused(&self) -> u32 {
        self.refused_at.store(self.now_ms(), Ordering::Relaxed);
        self.refusals
            .fetch_add(1, Ordering::Relaxed)
            .saturating_add(1)
    }

    /// A dead letter was taken.
    pub(super) fn dead_letter_taken(&self) {
        self.refusals.store(0, Ordering::Relaxed);
    }

    fn refused_lately(&self) -> bool {
        self.refusals.load(Ordering::Relaxed) > 0
            && self
                .now_ms()
                .saturating_sub(self.refused_at.load(Ordering::Relaxed))
                < REFUSED_RECENTLY.as_millis() as u64
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.born.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_when_reachable_running_and_owing_nothing() {
        let h = BrokerHealth::new("orders");
        assert!(h.not_ready().is_some_and(|w| w.contains("unreachable")));
        h.set_reachable(true);
        assert_eq!(h.not_ready(), None);
        h.owe(true);
        assert!(h.not_ready().is_some_and(|w| w.contains("1 owed")));
        h.owe(false);
        h.owe(false);
        assert_eq!(h.not_ready(), None, "never below zero");
        assert_eq!(h.dead_letter_refused(), 1);
        assert_eq!(h.dead_letter_refused(), 2, "counted in a row");
        assert!(h.not_ready().is_some_and(|w| w.contains("refuses")));
        h.dead_letter_taken();
        assert_eq!(h.not_ready(), None);
        assert_eq!(h.dead_letter_refused(), 1, "counted afresh");
        h.dead_letter_taken();
        h.set_restarting(true);
        assert!(h.not_ready().is_some_and(|w| w.contains("restarted")));
        h.set_restarting(false);
        assert!(
            h.not_ready().is_some_and(|w| w.contains("unreachable")),
            "a restarted task waits for its broker"
        );
    }
}
