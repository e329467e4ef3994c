//! The guard that gives back a new record whose reservation did not end well: its answer was
//! lost (a timeout, or the caller gone), or too few replicas acknowledged it.

use std::sync::Arc;
use std::time::Duration;

use super::conn::{eval, RedisConn};
use super::scripts::Scripts;
use super::{codec, record_key, RedisStore};
use crate::key::StoreKey;
use crate::store::OwnerToken;

/// Releases a reservation whose answer was lost, unless disarmed: see [`RedisStore::reserve`].
pub(super) struct ReleaseOnDrop {
    armed: Option<Armed>,
}

/// Everything the release needs, owned, as it may run after the store call is gone. Cheap to
/// build (nearly every guard is disarmed): the strings are made only when it fires.
struct Armed {
    scripts: Arc<Scripts>,
    prefix: Arc<str>,
    channel: Arc<str>,
    conn: RedisConn,
    key: StoreKey,
    owner: OwnerToken,
}

impl ReleaseOnDrop {
    pub(super) fn new(
        store: &RedisStore,
        key: &StoreKey,
        owner: OwnerToken,
        conn: RedisConn,
    ) -> Self {
        ReleaseOnDrop {
            armed: Some(Armed {
                scripts: Arc::clone(&store.shared.scripts),
                prefix: Arc::clone(&store.shared.prefix),
                channel: Arc::clone(&store.shared.channel),
                conn,
                key: *key,
                owner,
            }),
        }
    }

    pub(super) fn disarm(mut self) {
        self.armed = None;
    }
}

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        let Some(Armed {
            scripts,
            prefix,
            channel,
            mut conn,
            key,
            owner,
        }) = self.armed.take()
        else {
            return;
        };
        // Best effort, in the background: if Redis is unreachable the record keeps its lease
        // and then reads as an unknown outcome, which is the safe side.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let args: [&[u8]; 3] = [
                    &codec::owner_bytes(owner),
                    channel.as_bytes(),
                    &key.hex_digits(),
                ];
                let released: redis::RedisResult<i64> = tokio::time::timeout(
                    Duration::from_secs(5),
                    eval(
                        &mut conn,
                        &scripts.release,
                        &record_key(&prefix, &key),
                        &args,
                    ),
                )
                .await
                .unwrap_or_else(|_| Err((redis::ErrorKind::Io, "release timed out").into()));
                if let Ok(1) = released {
                    tracing::info!("released a reservation whose answer was lost");
                }
            });
        }
    }
}
