//! In-process fan-out of "this key changed" signals to the requests waiting on it.
//!
//! One `watch` channel per key that has waiters, created on the first subscription and removed
//! with the last. A `watch` receiver remembers the version it has seen, so a change that lands
//! between subscribing and waiting is still delivered: waiting never races reading.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::watch;

use crate::key::StoreKey;

/// The registry of keys with waiters. Cheap to clone.
#[derive(Clone, Default)]
pub struct Waiters {
    inner: Arc<Mutex<HashMap<StoreKey, watch::Sender<()>>>>,
}

impl Waiters {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn subscribe(&self, key: &StoreKey) -> Subscription {
        let mut map = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let rx = match map.get(key) {
            Some(tx) => tx.subscribe(),
            None => {
                let (tx, rx) = watch::channel(());
                map.insert(*key, tx);
                rx
            }
        };
        Subscription {
            rx: Some(rx),
            key: *key,
            waiters: self.clone(),
        }
    }

    /// Wakes everything waiting on `key`. Costs one hash lookup when nobody waits.
    pub fn notify(&self, key: &StoreKey) {
        let map = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(tx) = map.get(key) {
            tx.send_replace(());
        }
    }

    /// Wakes every waiter, to re-read after signals may have been missed (e.g. a reconnect).
    pub fn notify_all(&self) {
        let map = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        for tx in map.values() {
            tx.send_replace(());
        }
    }

    /// Keys with at least one waiter (for tests and metrics).
    pub fn len(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Interest in one key; dropping it unregisters.
pub struct Subscription {
    rx: Option<watch::Receiver<()>>,
    key: StoreKey,
    waiters: Waiters,
}

impl Subscription {
    /// Resolves at the first change after the subscription was made (or since the last call).
    pub async fn changed(&mut self) {
        match self.rx.as_mut() {
            Some(rx) => {
                if rx.changed().await.is_err() {
                    // The sender is only removed with the last subscriber, so this is unreachable;
                    // never resolving would be wrong, so treat it as a change and let the caller re-read.
                }
            }
            None => std::future::pending().await,
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut map = self
            .waiters
            .inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        drop(self.rx.take());
        if map
            .get(&self.key)
            .is_some_and(|tx| tx.receiver_count() == 0)
        {
            map.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::ClientScope;
    use std::time::Duration;

    fn key(k: &str) -> StoreKey {
        StoreKey::new(&ClientScope::from_value(b"c"), "r", k)
    }

    #[tokio::test(start_paused = true)]
    async fn a_change_between_subscribe_and_wait_is_not_lost() {
        let w = Waiters::new();
        let mut sub = w.subscribe(&key("a"));
        w.notify(&key("a"));
        tokio::time::timeout(Duration::from_secs(1), sub.changed())
            .await
            .expect("the earlier notify must be seen");
    }

    #[tokio::test(start_paused = true)]
    async fn other_keys_do_not_wake() {
        let w = Waiters::new();
        let mut sub = w.subscribe(&key("a"));
        w.notify(&key("b"));
        assert!(tokio::time::timeout(Duration::from_secs(1), sub.changed())
            .await
            .is_err());
    }

    #[tokio::test]
    async fn the_last_subscription_cleans_up() {
        let w = Waiters::new();
        let a = w.subscribe(&key("a"));
        let b = w.subscribe(&key("a"));
        assert_eq!(w.len(), 1);
        drop(a);
        assert_eq!(w.len(), 1);
        drop(b);
        assert!(w.is_empty());
    }
}
