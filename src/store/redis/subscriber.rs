//! The pub/sub subscriber: one connection per store, turning "key done" messages into local
//! wake-ups of the requests waiting on that key.
//!
//! Messages published while it is not subscribed are lost, so after every (re)subscription all
//! local waiters re-read; the waiters also re-read on a timer of their own, as a last resort.
//! With Sentinel it subscribes on the primary the sentinels name, and again when it moves.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;

use super::sentinel::Follower;
use crate::key::StoreKey;
use crate::store::changes::Waiters;

/// Where to subscribe.
// One per store, made once: the size of the fixed variant costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum Source {
    /// One Redis (or a cluster's first seed node).
    Fixed(redis::Client),
    /// The primary the sentinels name now.
    Following(Arc<Follower>),
}

impl Source {
    /// The client to subscribe with now, and what tells that it is no longer the one.
    fn now(&self) -> Option<(redis::Client, Option<tokio::sync::watch::Receiver<u64>>)> {
        match self {
            Source::Fixed(client) => Some((client.clone(), None)),
            Source::Following(follower) => {
                let mut moved = follower.moved();
                moved.mark_unchanged();
                let primary = follower.current()?;
                Some((primary.client.clone(), Some(moved)))
            }
        }
    }
}

/// Resolves when the primary moves; never for a fixed Redis.
async fn moved(watch: &mut Option<tokio::sync::watch::Receiver<u64>>) {
    if let Some(w) = watch {
        if w.changed().await.is_ok() {
            return;
        }
    }
    std::future::pending().await
}

/// Subscribes to `channel` and wakes waiters until the task is aborted; `subscribed` says
/// whether it listens right now.
pub async fn listen(
    source: Source,
    channel: String,
    waiters: Waiters,
    subscribed: Arc<AtomicBool>,
) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let Some((client, mut primary_moved)) = source.now() else {
            tokio::time::sleep(backoff).await;
            continue;
        };
        let connected = tokio::time::timeout(Duration::from_secs(5), async {
            let mut ps = client.get_async_pubsub().await?;
            ps.subscribe(&channel).await?;
            Ok::<_, redis::RedisError>(ps)
        })
        .await;
        match connected {
            Ok(Ok(mut ps)) => {
                backoff = Duration::from_millis(100);
                // Anything published while we were not subscribed is lost: re-check everyone.
                waiters.notify_all();
                subscribed.store(true, Ordering::Release);
                let mut messages = ps.on_message();
                loop {
                    let msg = tokio::select! {
                        msg = messages.next() => msg,
                        () = moved(&mut primary_moved) => None,
                    };
                    let Some(msg) = msg else { break };
                    if let Some(key) = std::str::from_utf8(msg.get_payload_bytes())
                        .ok()
                        .and_then(StoreKey::from_hex)
                    {
                        waiters.notify(&key);
                    }
                }
                subscribed.store(false, Ordering::Release);
                tracing::warn!(
                    "Redis pub/sub connection lost, or the primary moved; subscribing again"
                );
            }
            Ok(Err(e)) => tracing::warn!(error = %e, "cannot subscribe to Redis; retrying"),
            Err(_) => tracing::warn!("Redis subscription timed out; retrying"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}
