//! What `/readyz` knows of a consumer: whether its broker answers, whether its task runs, and
//! whether a dead letter is owed. Written by the consumer, read by the admin listener.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::metrics::ConsumerMetrics;

/// One consumer's readiness, shared between its task and `/readyz`.
#[derive(Debug)]
pub struct BrokerHealth {
    pub consumer: String,
    /// The broker answered the last read (a fetch; a failed ack or keep does not count).
    reachable: AtomicBool,
    /// The task stopped and is waiting to be started again.
    restarting: AtomicBool,
    /// Messages whose dead letter the target has not taken yet.
    owed: AtomicUsize,
}

impl BrokerHealth {
    pub fn new(consumer: &str) -> Arc<Self> {
        Arc::new(BrokerHealth {
            consumer: consumer.to_string(),
            // Not ready until the broker has answered once.
            reachable: AtomicBool::new(false),
            restarting: AtomicBool::new(false),
            owed: AtomicUsize::new(0),
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
        match self.owed.load(Ordering::Relaxed) {
            0 => None,
            owed => Some(format!(
                "consumer {consumer:?}: the dead-letter target refuses dead letters ({owed} owed)"
            )),
        }
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
}

/// One dead letter owed, for as long as this lives: counted in `/readyz` and the metric, and
/// given back when dropped, however the wait for the target ends (taken, shutdown, a panic).
pub(super) struct Owed<'a> {
    health: &'a BrokerHealth,
    metrics: &'a ConsumerMetrics,
}

impl<'a> Owed<'a> {
    pub(super) fn new(health: &'a BrokerHealth, metrics: &'a ConsumerMetrics) -> Self {
        health.owed.fetch_add(1, Ordering::Relaxed);
        metrics.dead_letter_owed(true);
        Owed { health, metrics }
    }
}

impl Drop for Owed<'_> {
    fn drop(&mut self) {
        self.health.owed.fetch_sub(1, Ordering::Relaxed);
        self.metrics.dead_letter_owed(false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;

    #[test]
    fn ready_only_when_reachable_running_and_owing_nothing() {
        let h = BrokerHealth::new("orders");
        let metrics = Metrics::new().consumer("orders");
        assert!(h.not_ready().is_some_and(|w| w.contains("unreachable")));
        h.set_reachable(true);
        assert_eq!(h.not_ready(), None);
        {
            let _one = Owed::new(&h, &metrics);
            let _two = Owed::new(&h, &metrics);
            assert!(h.not_ready().is_some_and(|w| w.contains("2 owed")));
        }
        assert_eq!(h.not_ready(), None, "given back when dropped");
        h.set_restarting(true);
        assert!(h.not_ready().is_some_and(|w| w.contains("restarted")));
        h.set_restarting(false);
        assert!(
            h.not_ready().is_some_and(|w| w.contains("unreachable")),
            "a restarted task waits for its broker"
        );
    }
}
