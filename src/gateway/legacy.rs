//! When keys stored before the client scope derivation changed (issue 42) are looked up too:
//! for one `ttl` from the first start of a gateway of this version on the store. That time is
//! kept in the store itself, as a marker record no request can name, so that a restart does not
//! reopen the window (during it, a value in a header other than a list's first also finds what
//! the same value in the first header stored, as the previous version did).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;

use crate::fingerprint::Fingerprint;
use crate::key::{ClientScope, StoreKey};
use crate::store::{now_ms, Claim, RecordState, Reservation, Store, StoreError, StoredResponse};

/// The marker is kept this long (the longest a store keeps anything); once it expires, the next
/// start writes a new one and looks older keys up for one more `ttl`.
const MARKER_TTL: Duration = Duration::from_secs(365 * 24 * 3600);
/// Tries to read or write the marker, 1 s apart, before keeping the start time as its own.
const ATTEMPTS: u32 = 120;

/// The start of the window, in ms since the epoch.
pub(super) struct LegacyWindow {
    since_ms: AtomicU64,
}

impl LegacyWindow {
    /// A volatile store (memory) holds nothing from before this process: no window. Otherwise
    /// it runs from now until the store says when it began.
    pub(super) fn new(durable: bool) -> Self {
        LegacyWindow {
            since_ms: AtomicU64::new(if durable { now_ms() } else { 0 }),
        }
    }

    /// Whether keys of the older derivation may still be stored for a route keeping them `ttl`.
    pub(super) fn open(&self, ttl: Duration) -> bool {
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        now_ms() < self.since_ms.load(Ordering::Relaxed).saturating_add(ttl_ms)
    }

    /// Learns from the store when the window began (writing it on the first start).
    pub(super) async fn learn(self: Arc<Self>, store: Arc<dyn Store>) {
        for _ in 0..ATTEMPTS {
            match since(&*store).await {
                Ok(Some(at)) => {
                    self.since_ms.store(at, Ordering::Relaxed);
                    // Its id, for an operator to start the window again (docs/security.md).
                    tracing::info!(since_ms = at, marker = %marker(), "keys of the client scope derivation before issue 42 are looked up for one ttl from since_ms");
                    return;
                }
                Ok(None) => {}
                Err(e) => tracing::debug!(error = %e, "scope derivation marker not read yet"),
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        tracing::warn!("the scope derivation marker could not be read or written: keys of the previous derivation are looked up for one ttl from this start");
    }
}

/// The marker's key: a scope no header value hashes to (none holds a NUL) on a route name no
/// config can give (control characters are refused).
fn marker() -> StoreKey {
    let scope = ClientScope::from_value(b"\x00idemgate/scope-derivation/v2");
    StoreKey::new(&scope, "\x00marker", "since")
}

/// When the window began; `None` while another gateway is writing it.
async fn since(store: &dyn Store) -> Result<Option<u64>, StoreError> {
    let key = marker();
    let claim = Claim::from(Fingerprint([0; 32]));
    match store
        .reserve(&key, &claim, Duration::from_secs(10), MARKER_TTL)
        .await?
    {
        Reservation::Owner(owner) => {
            let now = now_ms();
            let response = StoredResponse {
                status: StatusCode::OK,
                headers: Vec::new(),
                trailers: Vec::new(),
                body: Bytes::from(now.to_string()),
                body_kept: true,
                completed_ms: now,
            };
            store.complete(&key, owner, response, MARKER_TTL).await?;
            Ok(Some(now))
        }
        Reservation::Existing(record) => match record.state {
            RecordState::Completed(stored) => Ok(std::str::from_utf8(&stored.body)
                .ok()
                .and_then(|t| t.parse().ok())),
            // A gateway stopped between writing it and completing it: written again.
            RecordState::Abandoned { .. } | RecordState::Unknown { .. } => {
                store.delete(&key).await?;
                Ok(None)
            }
            RecordState::Pending { .. } => Ok(None),
        },
    }
}
