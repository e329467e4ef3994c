//! The operator's listing on the disk store: the records keyspace read in key order from the
//! published snapshot, on a blocking thread (a page reads up to [`SCAN_BUDGET`] records from
//! the disk, which is no work for a worker's runtime). Completed records are recognised by
//! their state byte and skipped without being decoded.

use std::sync::Arc;

use bytes::Bytes;
use fjall::Readable;

use super::{read_error, split, Db};
use crate::key::StoreKey;
use crate::store::{codec, now_ms, ScanPage, Scanned, StoreError, SCAN_BUDGET};

/// Up to `want` unknown outcomes after `after`, reading at most [`SCAN_BUDGET`].
pub(super) fn unknown_after(
    db: &Arc<Db>,
    after: Option<StoreKey>,
    want: usize,
) -> Result<ScanPage, StoreError> {
    let published = db.published.load();
    let snapshot = &published.snapshot;
    let from = match after {
        Some(k) => std::ops::Bound::Excluded(k.as_bytes().to_vec()),
        None => std::ops::Bound::Unbounded,
    };
    let now = now_ms();
    let mut page = ScanPage::default();
    let mut last = None;
    for (read, entry) in snapshot
        .range(&db.records, (from, std::ops::Bound::Unbounded))
        .enumerate()
    {
        if read == SCAN_BUDGET || page.records.len() == want {
            page.cursor = last.map(|k: StoreKey| k.hex());
            return Ok(page);
        }
        let (key, value) = entry.into_inner().map_err(read_error)?;
        let Ok(raw) = <[u8; 32]>::try_from(key.as_ref()) else {
            continue;
        };
        let key = StoreKey::from_bytes(raw);
        last = Some(key);
        let (expires_ms, record) = split(&value)?;
        if expires_ms <= now || record.get(1) == Some(&codec::STATE_COMPLETED) {
            continue;
        }
        let record = match codec::decode(&Bytes::copy_from_slice(record), db.seal(&key)) {
            Ok(record) => record.checked_lease_at(now),
            // Shown by `GET /keys/{id}` as unreadable; a page goes on without it.
            Err(StoreError::Unreadable { key_id, .. }) => {
                tracing::warn!(id = key.hex(), key_id = ?key_id, "listing: a record that does not open with this gateway's keys (GET /keys/{{id}})");
                continue;
            }
            Err(e) => return Err(e),
        };
        if record.is_unknown() {
            page.records.push(Scanned {
                key,
                record,
                expires_ms: Some(expires_ms),
            });
        }
    }
    Ok(page)
}
