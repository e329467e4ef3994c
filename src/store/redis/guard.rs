//! The guard that gives back a new record whose reservation did not end well: its answer was
//! lost (a timeout, or the caller gone), or too few replicas acknowledged it. A reservation
//! whose answer was lost may still land later (a command still queued on its connection, or
//! sent again by the cluster client): the give-back is tried again, with the owner's token,
//! until it deletes the record ([`crate::store::give_back`]), so that a key nobody owns is not
//! left to read as an unknown outcome for its whole `ttl`. Only for reservations: a take-over
//! never frees its key ([`crate::store::give_back_replaced`]). And the other uncertain end: a
//! completion whose write got no answer, written again in the background
//! ([`crate::store::complete_later`]).

use std::sync::Arc;
use std::time::Duration;

use super::conn::record_key;
use super::conn::{eval, RedisConn};
use super::replicas::Shortfall;
use super::scripts::Scripts;
use super::{codec, RedisStore};
use crate::key::StoreKey;
use crate::store::{OwnerToken, StoreError, StoreOp};

/// Releases a reservation whose answer was lost, unless disarmed: see [`RedisStore::reserve`].
pub(super) struct ReleaseOnDrop {
    armed: Option<Armed>,
}

/// Everything the release needs, owned, as it may run after the store call is gone. Cheap to
/// build (nearly every guard is disarmed): the strings are made only when it fires.
#[derive(Clone)]
struct Armed {
    scripts: Arc<Scripts>,
    prefix: Arc<str>,
    channel: Arc<str>,
    conn: RedisConn,
    key: StoreKey,
    owner: OwnerToken,
    /// The reservation's lease: how long a give-back is tried.
    lease: Duration,
}

impl ReleaseOnDrop {
    pub(super) fn new(
        store: &RedisStore,
        key: &StoreKey,
        owner: OwnerToken,
        conn: RedisConn,
        lease: Duration,
    ) -> Self {
        ReleaseOnDrop {
            armed: Some(Armed {
                scripts: Arc::clone(&store.shared.scripts),
                prefix: Arc::clone(&store.shared.prefix),
                channel: Arc::clone(&store.shared.channel),
                conn,
                key: *key,
                owner,
                lease,
            }),
        }
    }

    pub(super) fn disarm(mut self) {
        self.armed = None;
    }

    /// Gives the record back now, within `within`; if that fails, it is tried again in the
    /// background when the guard drops.
    pub(super) async fn release_now(mut self, within: Duration) {
        if let Some(armed) = &mut self.armed {
            if armed.release(within).await.is_ok() {
                self.armed = None;
            }
        }
    }
}

impl Armed {
    /// Runs the release script: 1 if it deleted our record, 0 if it was not ours (any more).
    async fn release(&mut self, within: Duration) -> redis::RedisResult<i64> {
        let args: [&[u8]; 3] = [
            &codec::owner_bytes(self.owner),
            self.channel.as_bytes(),
            &self.key.hex_digits(),
        ];
        let key = record_key(&self.prefix, &self.key);
        tokio::time::timeout(
            within,
            eval(&mut self.conn, &self.scripts.release, &key, &args),
        )
        .await
        .unwrap_or_else(|_| Err((redis::ErrorKind::Io, "release timed out").into()))
    }
}

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        let Some(armed) = self.armed.take() else {
            return;
        };
        // In the background: if Redis stays unreachable the record keeps its lease and then
        // reads as an unknown outcome, which is the safe side.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let (key, lease) = (armed.key, armed.lease);
                crate::store::give_back(key, lease, || {
                    let mut armed = armed.clone();
                    // Not there (yet), or Redis did not answer: false, and tried again.
                    async move { matches!(armed.release(Duration::from_secs(5)).await, Ok(1)) }
                })
                .await;
            });
        }
    }
}

impl RedisStore {
    /// Whether a new record (of `reserve` or `take_over`) may be acted on: always without
    /// `min_replicas`; with it, only once enough replicas acknowledged it.
    pub(super) fn may_act(&self, op: StoreOp, acked: Option<i64>) -> Result<(), StoreError> {
        match (&self.shared.replicas, acked) {
            (Some(replicas), Some(acked)) if !replicas.enough(op, acked, Shortfall::Refuse) => {
                Err(StoreError::Unavailable(format!(
                    "{}: the new record was acknowledged by {acked} of {} replicas within {:?} (store.min_replicas)",
                    op.as_str(),
                    replicas.min(),
                    replicas.timeout()
                )))
            }
            _ => Ok(()),
        }
    }

    /// Acts on a new record ([`Self::may_act`]), or gives it back (`guard`) before the refusal
    /// is answered, so that the client's retry finds the key free rather than in flight.
    pub(super) async fn act_or_give_back(
        &self,
        op: StoreOp,
        acked: Option<i64>,
        guard: ReleaseOnDrop,
    ) -> Result<(), StoreError> {
        let Err(refused) = self.may_act(op, acked) else {
            guard.disarm();
            return Ok(());
        };
        guard.release_now(self.shared.timeout).await;
        Err(refused)
    }
}

impl RedisStore {
    /// Runs the completion script (`args`) again in the background after it got no answer
    /// ([`crate::store::complete_later`]), on this handle's connections.
    pub(super) fn complete_later(&self, key: StoreKey, args: [Vec<u8>; 5]) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let store = RedisStore {
            shared: Arc::clone(&self.shared),
            conn: self.conn.clone(),
        };
        runtime.spawn(async move {
            crate::store::complete_later(key, || async {
                let args = args.each_ref().map(Vec::as_slice);
                let script = &store.shared.scripts.complete;
                store.owned(StoreOp::Complete, script, &key, &args).await
            })
            .await;
        });
    }
}
