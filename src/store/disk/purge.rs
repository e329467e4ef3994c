//! Purging expired records: the writer's work between batches, in small passes through the
//! expiry index, oldest first.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant as StdInstant};

use super::writer::Writer;
use super::{cost, expiry_key, split};
use crate::key::StoreKey;
use crate::store::now_ms;

/// Expired records removed in one purge pass at most. A pass runs after a batch once a tick, and
/// after every batch while expired records are left over: small passes keep any one batch's
/// callers from waiting behind a long purge, and keep up with new keys (a pass per batch).
const PURGE_CHUNK: usize = 64;
/// How long one purge runs at most, chunk after chunk, before the writer takes the next batch.
const PURGE_BUDGET: Duration = Duration::from_millis(2);

impl Writer {
    /// Purges in chunks for at most [`PURGE_BUDGET`], so a backlog (after a burst, or a
    /// restart) is worked off quickly without holding the next batch up for long; says whether
    /// expired records were left.
    pub(super) fn purge(&mut self) -> bool {
        let started = StdInstant::now();
        loop {
            let more = self.purge_chunk();
            if !more || started.elapsed() >= PURGE_BUDGET {
                return more;
            }
        }
    }

    /// Removes what expired, oldest first, up to [`PURGE_CHUNK`], as a batch of its own; says
    /// whether it stopped at the chunk (more may be due).
    fn purge_chunk(&mut self) -> bool {
        let now = now_ms();
        // A wall clock stepped back: entries filed since may sort before the cursor.
        if now < self.purged_at {
            self.purged_to = None;
        }
        self.purged_at = now;
        let end = expiry_key(now, &[0xff; 32]);
        let mut batch = self.db.db.batch();
        let mut purged = 0u64;
        let mut freed = 0u64;
        let mut seen = 0;
        let mut last = None;
        let mut removed = Vec::new();
        // A key filed twice (released, then reserved again) is purged once.
        let mut handled = std::collections::HashSet::new();
        let from = match &self.purged_to {
            Some(k) => std::ops::Bound::Excluded(k.clone()),
            None => std::ops::Bound::Unbounded,
        };
        let scanned = (|| -> Result<(), fjall::Error> {
            let range: (std::ops::Bound<Vec<u8>>, _) = (from, std::ops::Bound::Included(end));
            for entry in self.db.expiry.range(range).take(PURGE_CHUNK) {
                seen += 1;
                let filed_key = entry.key()?;
                last = Some(filed_key.to_vec());
                batch.remove(&self.db.expiry, filed_key.clone());
                let key = &filed_key[8..];
                if !handled.insert(key.to_vec()) {
                    continue;
                }
                // The record as it is now: gone (released, deleted), expired, or rewritten since
                // it was filed, with a later expiry: filed again then.
                if let Some(v) = self.db.records.get(key)? {
                    if let Ok((at, _)) = split(&v) {
                        if at <= now {
                            batch.remove(&self.db.records, key.to_vec());
                            removed
                                .extend(<[u8; 32]>::try_from(key).ok().map(StoreKey::from_bytes));
                            freed += cost(key.len(), v.len());
                            purged += 1;
                        } else {
                            batch.insert(&self.db.expiry, expiry_key(at, key), Vec::new());
                        }
                    }
                }
            }
            Ok(())
        })();
        let done = scanned.and_then(|()| batch.commit());
        self.batches += 1;
        match done {
            Ok(()) => {
                for key in removed {
                    self.recent.wrote(self.batches, key, None);
                }
                if last.is_some() {
                    self.purged_to = last;
                }
                let used = self.counters.used.load(Ordering::Relaxed);
                self.counters
                    .used
                    .store(used.saturating_sub(freed), Ordering::Relaxed);
                self.counters.purged.fetch_add(purged, Ordering::Relaxed);
                // Not synced: a purge lost in a crash is done again after the restart.
                if self.unsynced_since.is_none() && purged > 0 {
                    self.unsynced_since = Some(StdInstant::now());
                }
            }
            Err(e) => {
                self.recent.clear(self.batches + 1);
                tracing::warn!(error = %e, "disk store: purging expired records failed; retrying later");
                return false;
            }
        }
        seen == PURGE_CHUNK
    }
}
