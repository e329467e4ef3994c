//! What the writer knows of its own recent batches, so that most changes need no read of fjall.
//!
//! Every change reads the record it changes first (insert-if-absent, owner checks), and a read
//! of fjall is a search of its memtables' skip lists and its tables: under load, the largest
//! part of the writer's time per change (a profile of `bench/run`'s disk target). Two reads
//! are answered here instead:
//! - a key the writer wrote in a recent batch: its stored value is kept (when small, as every
//!   pending record is), so completing, releasing or renewing a reservation reads nothing;
//! - a new key: the caller read the published snapshot of batch `B` and found nothing there, so
//!   the key is still absent unless a batch after `B` wrote it, and every key those batches
//!   wrote is here (unless so many came since that the oldest were dropped: then fjall is read).
//!
//! Only the writer thread writes the store, so what is kept here is exactly what fjall holds.

use std::collections::{HashMap, VecDeque};

use bytes::Bytes;

use crate::key::StoreKey;

/// Keys remembered at most. Under load the batches that matter are the last few (a caller's
/// snapshot is at most a batch or two old), so this is ample, and bounds the memory to a few MB.
const KEYS: usize = 8192;
/// A stored value longer than this is remembered as present, not kept (a completed record with
/// its response): only the pending records the next change reads back are worth the memory.
const VALUE: usize = 512;

/// A key's stored value as of its last write in a recent batch.
enum Known {
    /// The stored value (expiry, then codec bytes).
    Value(Bytes),
    /// Removed (released, deleted, purged).
    Removed,
    /// Written, with a value too long to keep: read it from fjall.
    Present,
}

/// What a read of the writer's recent batches says about a key.
#[derive(Debug, PartialEq)]
pub(super) enum Lookup {
    /// The stored value, or `None`: no record.
    Known(Option<Bytes>),
    /// Not known here: read fjall.
    Read,
}

pub(super) struct Recent {
    /// Each key's state after its last write, with that write's batch number.
    keys: HashMap<StoreKey, (u64, Known)>,
    /// Writes in batch order, to forget the oldest; an entry whose key was written again since
    /// is stale, and forgetting it forgets nothing.
    order: VecDeque<(u64, StoreKey)>,
    /// Every write of the batches numbered from here on is in `keys`.
    complete_from: u64,
}

impl Recent {
    pub(super) fn new() -> Self {
        Recent {
            keys: HashMap::new(),
            order: VecDeque::new(),
            complete_from: 1,
        }
    }

    /// What the recent batches say of `key`; `absent_at`: the number of the published batch in
    /// whose snapshot the caller found no record for it, if it did.
    pub(super) fn lookup(&self, key: &StoreKey, absent_at: Option<u64>) -> Lookup {
        match self.keys.get(key) {
            Some((_, Known::Value(v))) => Lookup::Known(Some(v.clone())),
            Some((_, Known::Removed)) => Lookup::Known(None),
            Some((_, Known::Present)) => Lookup::Read,
            // Absent then, and written by no batch since (all of which are here).
            None if absent_at.is_some_and(|b| b.saturating_add(1) >= self.complete_from) => {
                Lookup::Known(None)
            }
            None => Lookup::Read,
        }
    }

    /// Records what the committed batch `batch` wrote under `key` (`None`: removed).
    pub(super) fn wrote(&mut self, batch: u64, key: StoreKey, value: Option<Vec<u8>>) {
        let known = match value {
            None => Known::Removed,
            Some(v) if v.len() <= VALUE => Known::Value(Bytes::from(v)),
            Some(_) => Known::Present,
        };
        self.keys.insert(key, (batch, known));
        self.order.push_back((batch, key));
        while self.keys.len() > KEYS || self.order.len() > 2 * KEYS {
            let Some((b, k)) = self.order.pop_front() else {
                break;
            };
            if self.keys.get(&k).is_some_and(|(last, _)| *last == b) {
                self.keys.remove(&k);
            }
            // Some write of batch `b` may be forgotten now: only later batches are complete.
            self.complete_from = self.complete_from.max(b + 1);
        }
    }

    /// Forgets everything: after a failed batch, whose writes may or may not be in fjall.
    pub(super) fn clear(&mut self, next_batch: u64) {
        self.keys.clear();
        self.order.clear();
        self.complete_from = next_batch;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u8) -> StoreKey {
        StoreKey::from_bytes([n; 32])
    }

    #[test]
    fn a_written_key_is_known_and_an_unwritten_one_only_with_a_snapshot_recent_enough() {
        let mut r = Recent::new();
        r.wrote(1, key(1), Some(b"pending".to_vec()));
        r.wrote(2, key(2), None);
        assert_eq!(
            r.lookup(&key(1), None),
            Lookup::Known(Some(Bytes::from_static(b"pending")))
        );
        assert_eq!(r.lookup(&key(2), None), Lookup::Known(None));
        // Never written since batch 0's snapshot, which had no record.
        assert_eq!(r.lookup(&key(3), Some(0)), Lookup::Known(None));
        // No snapshot said it was absent: fjall must be read.
        assert_eq!(r.lookup(&key(3), None), Lookup::Read);
    }

    #[test]
    fn a_long_value_is_read_from_fjall() {
        let mut r = Recent::new();
        r.wrote(1, key(1), Some(vec![0u8; VALUE + 1]));
        assert_eq!(r.lookup(&key(1), Some(0)), Lookup::Read);
    }

    #[test]
    fn once_the_oldest_writes_are_forgotten_an_older_snapshot_is_not_trusted() {
        let mut r = Recent::new();
        for i in 0..=KEYS as u64 {
            let mut k = [0u8; 32];
            k[..8].copy_from_slice(&i.to_be_bytes());
            r.wrote(i + 1, StoreKey::from_bytes(k), Some(b"v".to_vec()));
        }
        // Batch 1's write is forgotten: a snapshot from before it says nothing any more.
        assert_eq!(r.lookup(&key(9), Some(0)), Lookup::Read);
        // A snapshot of batch 1 or later is still complete.
        assert_eq!(r.lookup(&key(9), Some(1)), Lookup::Known(None));
        assert!(r.keys.len() <= KEYS);
    }

    #[test]
    fn the_last_write_of_a_key_wins_and_stale_order_entries_forget_nothing() {
        let mut r = Recent::new();
        r.wrote(1, key(1), Some(b"a".to_vec()));
        r.wrote(2, key(1), Some(b"b".to_vec()));
        assert_eq!(
            r.lookup(&key(1), None),
            Lookup::Known(Some(Bytes::from_static(b"b")))
        );
        // After a failed batch (number 3), only snapshots from then on are trusted.
        r.clear(4);
        assert_eq!(r.lookup(&key(1), None), Lookup::Read);
        assert_eq!(r.lookup(&key(2), Some(2)), Lookup::Read);
        assert_eq!(r.lookup(&key(2), Some(3)), Lookup::Known(None));
    }
}
