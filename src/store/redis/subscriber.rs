//! The pub/sub subscriber: one connection per store, turning "key done" messages into local
//! wake-ups of the requests waiting on that key.
//!
//! Messages published while it is not subscribed are lost, so after every (re)subscription all
//! local waiters re-read; the waiters also re-read on a timer of their own, as a last resort.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;

use crate::key::StoreKey;
use crate::store::changes::Waiters;

/// Subscribes to `channel` and wakes waiters until the task is aborted; `subscribed` says
/// whether it listens right now.
pub async fn listen(
    client: redis::Client,
    channel: String,
    waiters: Waiters,
    subscribed: Arc<AtomicBool>,
) {
    let mut backoff = Duration::from_millis(100);
    loop {
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
                while let Some(msg) = messages.next().await {
                    if let Some(key) = std::str::from_utf8(msg.get_payload_bytes())
                        .ok()
                        .and_then(StoreKey::from_hex)
                    {
                        waiters.notify(&key);
                    }
                }
                subscribed.store(false, Ordering::Release);
                tracing::warn!("Redis pub/sub connection lost; reconnecting");
            }
            Ok(Err(e)) => tracing::warn!(error = %e, "cannot subscribe to Redis; retrying"),
            Err(_) => tracing::warn!("Redis subscription timed out; retrying"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}
