//! When keys stored under an older derivation are looked up too (the client scope before issue
//! 42, a key's number or boolean parts before issue 45): for one `ttl` after the gateway starts, on a store that keeps records across restarts (a
//! memory store holds nothing from before). A restart opens the window again: it costs a store
//! read only for the requests whose derivation changed, and during it a value in a header other
//! than a list's first also finds what the same value in the first header stored, as the
//! previous version did (knowing another client's secret value is already being that client).
//! Writing when the window began into the store would close it for good, but would put a record
//! of the gateway's own beside the clients' in every store.

use std::time::Duration;

use crate::key::StoreKey;
use crate::store::{now_ms, Store, StoreError};

/// The start of the window, in ms since the epoch.
#[derive(Debug, Clone, Copy)]
pub struct LegacyWindow {
    since_ms: u64,
}

impl LegacyWindow {
    pub fn new(durable: bool) -> Self {
        LegacyWindow {
            since_ms: if durable { now_ms() } else { 0 },
        }
    }

    /// Whether keys of the older derivation may still be stored for a route keeping them `ttl`.
    pub fn open(&self, ttl: Duration) -> bool {
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        now_ms() < self.since_ms.saturating_add(ttl_ms)
    }
}

/// The first of `older` keys that holds a record, else `key`: so that a retry across an upgrade
/// finds what the previous version stored. An extra store read per older key, for the requests
/// whose derivation changed only. An error refuses: not knowing whether an older key holds the
/// operation, the newer one may not be claimed (its reservation could run it again).
pub async fn older_stored(
    store: &dyn Store,
    key: StoreKey,
    older: &[StoreKey],
) -> Result<StoreKey, StoreError> {
    for candidate in older {
        if store.get(candidate).await?.is_some() {
            return Ok(*candidate);
        }
    }
    Ok(key)
}
