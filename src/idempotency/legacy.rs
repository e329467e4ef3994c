//! When keys stored under an older derivation are looked up too (the client scope before issue
//! 42, a key's number or boolean parts before issue 45): for one `ttl` after the gateway starts, on a store that keeps records across restarts (a
//! memory store holds nothing from before). A restart opens the window again: it costs a store
//! read only for the requests whose derivation changed, and during it a value in a header other
//! than a list's first also finds what the same value in the first header stored, as the
//! previous version did (knowing another client's secret value is already being that client).
//! Writing when the window began into the store would close it for good, but would put a record
//! of the gateway's own beside the clients' in every store.

use std::time::Duration;

use super::Sought;
use crate::key::StoreKey;
use crate::store::{now_ms, Record, RecordState, Store, StoreError};

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

/// The first of `older` keys whose record answers this request ([`answers`]), else `key`: so
/// that a retry across an upgrade finds what the previous version stored. An extra store read
/// per older key, for the requests whose derivation changed only. An error refuses: not knowing
/// whether an older key holds the operation, the newer one may not be claimed (its reservation
/// could run it again).
pub async fn older_stored(
    store: &dyn Store,
    key: StoreKey,
    older: &[StoreKey],
    (check_fingerprint, sought): (bool, &Sought<'_>),
) -> Result<StoreKey, StoreError> {
    for candidate in older {
        match store.get(candidate).await? {
            Some(record) if answers(&record, check_fingerprint, sought) => return Ok(*candidate),
            _ => {}
        }
    }
    Ok(key)
}

/// Whether a record under an older key is this request's to replay, wait on or be refused by:
/// where fingerprints are checked, only its own request's (an older key may be what this
/// version derives for another request: the string `"123"`'s key is the number `123`'s older
/// one); where they are not (business keys), any but a refusal of another request, which this
/// request does not take over there but runs under its own key, so that nothing new is ever
/// written under an older key by a take-over (its record would outlive the window).
fn answers(record: &Record, check_fingerprint: bool, sought: &Sought<'_>) -> bool {
    let same = sought.matches(record);
    match &record.state {
        RecordState::Completed(stored) if stored.status.is_client_error() => same,
        _ => same || !check_fingerprint,
    }
}
