//! When keys stored before the client scope derivation changed (issue 42) are looked up too:
//! for one `ttl` after the gateway starts, on a store that keeps records across restarts (a
//! memory store holds nothing from before). A restart opens the window again: it costs a store
//! read only for the requests whose derivation changed, and during it a value in a header other
//! than a list's first also finds what the same value in the first header stored, as the
//! previous version did (knowing another client's secret value is already being that client).
//! Writing when the window began into the store would close it for good, but would put a record
//! of the gateway's own beside the clients' in every store.

use std::time::Duration;

use crate::store::now_ms;

/// The start of the window, in ms since the epoch.
pub(super) struct LegacyWindow {
    since_ms: u64,
}

impl LegacyWindow {
    pub(super) fn new(durable: bool) -> Self {
        LegacyWindow {
            since_ms: if durable { now_ms() } else { 0 },
        }
    }

    /// Whether keys of the older derivation may still be stored for a route keeping them `ttl`.
    pub(super) fn open(&self, ttl: Duration) -> bool {
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        now_ms() < self.since_ms.saturating_add(ttl_ms)
    }
}
