//! Quotas of stored records per client scope, so that one client (or every anonymous caller
//! together) cannot fill the store and lock the other clients out.
//!
//! A route's quota is a number of records a client scope may have stored per window of the
//! route's `ttl` (a fixed window, so at most twice the quota of its records are alive at once).
//! Only records that were stored count: an answer the key is released on (401, 403, 429, an
//! unstored 5xx, ...) stores nothing and counts nothing (an unknown outcome, kept for `ttl`,
//! counts), so a flood with made-up credentials that
//! the upstream refuses neither fills the store nor this table. A new key is refused (`429
//! key-quota`, before anything is forwarded) once its scope is at the quota.
//!
//! The counts are kept in this instance's memory: with several instances each counts its own
//! traffic, and a restart starts every count afresh. The check and the count are not one atomic
//! step, so concurrent new keys of one scope can pass the quota by as many as run at once.
//!
//! Anonymous callers have no count by default (a sidecar whose callers send no client header must
//! never be stopped by one): they have a [`Share`] of an embedded store's bound instead, which
//! holds only while identified clients store records too. Then anonymous new keys are refused
//! once the store is that full, and identified clients keep the rest; with nobody identified,
//! the store's bounds are the only limit, as with `client_header = ""`.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::time::Instant;

use crate::key::ClientScope;

/// Scopes counted at once in one instance. Only scopes that stored a record in the current
/// window are counted, so the table only fills if the store itself holds this many clients'
/// records; past it, new scopes are not counted (the store's own bounds still hold) and a
/// warning is logged.
const MAX_SCOPES: usize = 1_000_000;

/// Which counter a request counts in: its route and client scope, hashed together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QuotaId([u8; 32]);

impl QuotaId {
    pub fn new(route: &str, scope: &ClientScope) -> Self {
        let mut h = Sha256::new();
        h.update(b"idemgate/quota/v1\x00");
        h.update((route.len() as u64).to_be_bytes());
        h.update(route.as_bytes());
        h.update(scope.as_bytes());
        QuotaId(h.finalize().into())
    }
}

/// One request's quota: its counter, and how many records it allows per `window`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    pub id: QuotaId,
    pub limit: u64,
    pub window: Duration,
}

/// Where a caller stands on a store whose bound it shares with other callers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Share {
    /// An identified client: its stored records mark identified clients as present.
    Identified,
    /// An anonymous caller on a route that identifies clients: its new keys are refused once
    /// the store is this many percent full, while identified clients are present.
    Anonymous(u8),
    /// One scope for every caller by choice, or a consumer's messages: the store's bounds are
    /// the only limit.
    Unshared,
}

/// When an anonymous caller refused for the store's share may try again: records expire all
/// the time, and nothing tells when enough have.
pub const SHARE_RETRY: Duration = Duration::from_secs(60);

/// The scope is at its quota until `retry_after` has passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OverQuota {
    pub retry_after: Duration,
}

#[derive(Clone, Copy)]
struct Window {
    started: Instant,
    stored: u64,
    /// Its route's window, so that a purge knows when it is over.
    ends: Instant,
}

/// The counters of one process.
#[derive(Default)]
pub struct Quotas {
    windows: Mutex<Table>,
    /// Until when identified clients count as present: the end of the longest window in which
    /// one of them stored a record.
    identified_until: Mutex<Option<Instant>>,
}

#[derive(Default)]
struct Table {
    windows: HashMap<QuotaId, Window>,
    /// Scopes added since the last purge of windows that are over.
    added: usize,
}

impl Quotas {
    pub fn new() -> Self {
        Self::default()
    }

    /// May this scope store one more record?
    pub fn check(&self, quota: &Quota) -> Result<(), OverQuota> {
        let now = Instant::now();
        let table = self.windows.lock().unwrap_or_else(PoisonError::into_inner);
        match table.windows.get(&quota.id) {
            Some(w) if now < w.started + quota.window && w.stored >= quota.limit => {
                Err(OverQuota {
                    retry_after: (w.started + quota.window).saturating_duration_since(now),
                })
            }
            _ => Ok(()),
        }
    }

    /// Whether an anonymous new key is refused for the store's share: `fill` says how full the
    /// store is ([`crate::store::Store::fill`]), asked only for an anonymous caller.
    pub fn share_refuses(&self, share: Share, fill: impl FnOnce() -> Option<f64>) -> bool {
        let Share::Anonymous(percent) = share else {
            return false;
        };
        let Some(fill) = fill() else {
            return false;
        };
        let until = *self
            .identified_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        percent < 100
            && until.is_some_and(|t| Instant::now() < t)
            && fill * 100.0 >= f64::from(percent)
    }

    /// Counts a record stored by a caller with these quota and share, for `window`.
    pub fn stored_by(&self, quota: Option<&Quota>, share: Share, window: Duration) {
        if let Some(quota) = quota {
            self.stored(quota);
        }
        if share == Share::Identified {
            let until = Instant::now() + window;
            let mut present = self
                .identified_until
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if present.is_none_or(|t| t < until) {
                *present = Some(until);
            }
        }
    }

    /// Counts a record this scope stored.
    pub fn stored(&self, quota: &Quota) {
        let now = Instant::now();
        let mut table = self.windows.lock().unwrap_or_else(PoisonError::into_inner);
        if !table.windows.contains_key(&quota.id) {
            // Windows that are over go as new scopes come: after as many new scopes as half the
            // table (at least 1024), so the scan costs a constant per new scope.
            table.added += 1;
            if table.added >= (table.windows.len() / 2).max(1024) {
                table.windows.retain(|_, w| now < w.ends);
                table.added = 0;
            }
            if table.windows.len() >= MAX_SCOPES {
                tracing::warn!(
                    scopes = table.windows.len(),
                    "too many client scopes to count their quotas; this one is not counted"
                );
                return;
            }
        }
        let fresh = Window {
            started: now,
            stored: 0,
            ends: now + quota.window,
        };
        let w = table.windows.entry(quota.id).or_insert(fresh);
        if now >= w.ends {
            *w = fresh;
        }
        w.stored += 1;
    }

    /// Scopes counted.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.windows
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .windows
            .len()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quota(client: &[u8], limit: u64) -> Quota {
        Quota {
            id: QuotaId::new("payments", &ClientScope::from_value(client)),
            limit,
            window: Duration::from_secs(60),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_scope_at_its_quota_waits_for_the_next_window() {
        let q = Quotas::new();
        let a = quota(b"a", 2);
        q.check(&a).unwrap();
        q.stored(&a);
        q.check(&a).unwrap();
        q.stored(&a);
        let over = q.check(&a).unwrap_err();
        assert_eq!(over.retry_after, Duration::from_secs(60));
        tokio::time::advance(Duration::from_secs(45)).await;
        assert_eq!(
            q.check(&a).unwrap_err().retry_after,
            Duration::from_secs(15)
        );
        tokio::time::advance(Duration::from_secs(15)).await;
        q.check(&a).unwrap();
        q.stored(&a);
        q.check(&a).unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn scopes_and_routes_count_apart() {
        let q = Quotas::new();
        let a = quota(b"a", 1);
        q.stored(&a);
        assert!(q.check(&a).is_err());
        q.check(&quota(b"b", 1)).unwrap();
        let other_route = Quota {
            id: QuotaId::new("refunds", &ClientScope::from_value(b"a")),
            ..a
        };
        q.check(&other_route).unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn windows_that_are_over_are_purged_as_new_scopes_come() {
        let q = Quotas::new();
        for i in 0..2000u32 {
            q.stored(&quota(&i.to_be_bytes(), 1));
        }
        assert_eq!(q.len(), 2000);
        tokio::time::advance(Duration::from_secs(61)).await;
        for i in 2000..3100u32 {
            q.stored(&quota(&i.to_be_bytes(), 1));
        }
        assert!(q.len() < 2000, "{} scopes still counted", q.len());
    }

    #[tokio::test(start_paused = true)]
    async fn anonymous_callers_keep_out_of_the_share_only_while_identified_clients_store() {
        let q = Quotas::new();
        let window = Duration::from_secs(60);
        let half = Share::Anonymous(50);
        // Nobody identified: anonymous callers may fill the store to its bound.
        assert!(!q.share_refuses(half, || Some(0.99)));
        q.stored_by(None, Share::Identified, window);
        assert!(!q.share_refuses(half, || Some(0.49)));
        assert!(q.share_refuses(half, || Some(0.5)));
        // Identified clients, a store without a known bound, 100 %, or not anonymous: no share.
        assert!(!q.share_refuses(half, || None));
        assert!(!q.share_refuses(Share::Anonymous(100), || Some(0.99)));
        assert!(!q.share_refuses(Share::Identified, || Some(0.99)));
        assert!(!q.share_refuses(Share::Unshared, || Some(0.99)));
        // Once no identified client stored anything for a whole window, the share is lifted.
        tokio::time::advance(window).await;
        assert!(!q.share_refuses(half, || Some(0.9)));
    }

    #[tokio::test(start_paused = true)]
    async fn checking_alone_counts_nothing() {
        let q = Quotas::new();
        for i in 0..100u32 {
            q.check(&quota(&i.to_be_bytes(), 1)).unwrap();
        }
        assert!(q.is_empty());
    }
}
