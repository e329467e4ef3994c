//! The guard that gives back what a change may have written when its caller went away before
//! the writer's answer: a reservation is released, a take-over's replaced outcome written back.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use super::{Change, DiskStore, Job};
use crate::fingerprint::Fingerprint;
use crate::key::StoreKey;
use crate::store::{OwnerToken, Record, Replaced};

/// Gives back what a change may have written when its answer never reached its caller (the
/// caller's future was dropped, as when an HTTP client hangs up while the writer syncs), unless
/// disarmed. A reservation is released: without it the key would stay pending, then read as
/// abandoned, for its whole `ttl`, though nothing was forwarded. A take-over is never released
/// (that would free the key and the outcome it replaced): the replaced outcome is written back
/// under the take-over's token ([`crate::store::Replaced`]). The writer takes changes in order,
/// so the give-back comes after the change; if the change did not land, the give-back is
/// refused as not the owner's.
pub(super) struct GiveBackOnDrop {
    armed: Option<(mpsc::Sender<Job>, StoreKey, Change)>,
}

impl GiveBackOnDrop {
    /// For a reservation by `owner`.
    pub(super) fn release(store: &DiskStore, key: &StoreKey, owner: OwnerToken) -> Self {
        GiveBackOnDrop {
            armed: Some((store.shared.writer.clone(), *key, Change::Release { owner })),
        }
    }

    /// For a take-over by `owner` of `replaced`.
    pub(super) fn restore(
        store: &DiskStore,
        key: &StoreKey,
        (owner, taker): (OwnerToken, &Fingerprint),
        replaced: &Record,
        ttl: Duration,
    ) -> Self {
        let change = match Replaced::of(replaced, taker) {
            Replaced::Completed(response) => Change::Complete {
                owner,
                response: Arc::unwrap_or_clone(response),
                ttl,
            },
            Replaced::Unknown(reason) => Change::MarkUnknown { owner, reason },
            Replaced::Refusal => Change::Release { owner },
        };
        GiveBackOnDrop {
            armed: Some((store.shared.writer.clone(), *key, change)),
        }
    }

    pub(super) fn disarm(mut self) {
        self.armed = None;
    }
}

impl Drop for GiveBackOnDrop {
    fn drop(&mut self) {
        let Some((writer, key, change)) = self.armed.take() else {
            return;
        };
        let (reply, _) = oneshot::channel();
        let job = Job::Change {
            key,
            change,
            reply,
            inbox: None,
        };
        if let Err(mpsc::error::TrySendError::Full(job)) = writer.try_send(job) {
            // The queue is full: wait for room in the background rather than here.
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(async move {
                    let _ = writer.send(job).await;
                });
            }
        }
    }
}
