//! Between rows and records: reading a record from a row's columns (its lease checked at the
//! database's clock), the columns a compare-and-set expects, and the guard that gives back a
//! reservation whose answer was lost.

use std::time::Duration;

use bytes::Bytes;
use tokio_postgres::types::FromSql;
use tokio_postgres::Row;

use super::PostgresStore;
use crate::fingerprint::Fingerprint;
use crate::key::StoreKey;
use crate::store::codec::{self, Seal};
use crate::store::seal::{Sealer, Sealing};
use crate::store::{OwnerToken, Record, RecordState, ScanPage, Scanned, StoreError};

/// Column `at` of `row`; a column of another type than expected is a corrupt answer.
pub(super) fn get<'a, T: FromSql<'a>>(row: &'a Row, at: usize) -> Result<T, StoreError> {
    row.try_get(at)
        .map_err(|e| StoreError::Corrupt(format!("column {at}: {e}")))
}

/// A `bigint` column (counts, milliseconds).
pub(super) fn count(row: &Row, at: usize) -> Result<i64, StoreError> {
    get(row, at)
}

/// A duration as the statements take it: whole milliseconds, at least 1.
pub(super) fn millis(d: Duration) -> i64 {
    d.as_millis().clamp(1, i64::MAX as u128) as i64
}

fn unsigned(ms: i64) -> u64 {
    ms.max(0) as u64
}

fn array<const N: usize>(bytes: &[u8], what: &str) -> Result<[u8; N], StoreError> {
    bytes
        .try_into()
        .map_err(|_| StoreError::Corrupt(format!("{what}: {} bytes", bytes.len())))
}

/// The record in columns `at..at + 7` (state, fingerprint, created_ms, owner, lease_until_ms,
/// outcome, origin), as the contract returns it at the database's `now_ms`; `None` when the
/// columns are null (a left join that found no row).
pub(super) fn record_at(
    row: &Row,
    at: usize,
    now_ms: i64,
    seal: Seal,
) -> Result<Option<Record>, StoreError> {
    let Some(state) = get::<Option<i16>>(row, at)? else {
        return Ok(None);
    };
    if state != i16::from(codec::STATE_PENDING) {
        // Completed or unknown: the whole record, in the codec's form.
        let outcome: Vec<u8> = get(row, at + 5)?;
        let record = codec::decode(&Bytes::from(outcome), seal)?;
        let held = match record.state {
            RecordState::Completed(_) => codec::STATE_COMPLETED,
            RecordState::Unknown { .. } => codec::STATE_UNKNOWN,
            _ => codec::STATE_PENDING,
        };
        if i16::from(held) != state {
            return Err(StoreError::Corrupt(format!(
                "state {state} holds another record"
            )));
        }
        return Ok(Some(record));
    }
    let fingerprint: &[u8] = get(row, at + 1)?;
    let owner: &[u8] = get(row, at + 3)?;
    let origin: Option<&[u8]> = get(row, at + 6)?;
    let lease_until_ms = unsigned(count(row, at + 4)?);
    let (origin, sealing) = match origin {
        Some(raw) => {
            codec::decode_origin(raw, seal).map_err(|e| codec::leased(e, Some(lease_until_ms)))?
        }
        None => (None, Sealing::Clear),
    };
    let record = Record {
        fingerprint: Fingerprint(array(fingerprint, "fingerprint")?),
        created_ms: unsigned(count(row, at + 2)?),
        state: RecordState::Pending {
            owner: OwnerToken(u128::from_be_bytes(array(owner, "owner")?)),
            lease_until_ms,
        },
        origin,
        sealing,
    };
    Ok(Some(record.checked_lease_at(unsigned(now_ms))))
}

/// A page of the operator's listing from the rows of [`super::sql::Sql::scan`] (`read` asked
/// for): the unknown outcomes, at most `want`, and the cursor after the last row looked at.
pub(super) fn unknown_page(
    rows: &[Row],
    (want, read): (usize, usize),
    sealer: Option<&Sealer>,
) -> Result<ScanPage, StoreError> {
    let mut page = ScanPage::default();
    for (i, row) in rows.iter().enumerate() {
        if page.records.len() == want {
            page.cursor = i
                .checked_sub(1)
                .and_then(|j| rows.get(j))
                .map(key_hex)
                .transpose()?;
            return Ok(page);
        }
        let (now, expires) = (count(row, 1)?, count(row, 2)?);
        let completed = get::<i16>(row, 3)? == i16::from(codec::STATE_COMPLETED);
        if completed || expires <= now {
            continue;
        }
        let key: &[u8] = get(row, 0)?;
        let key = StoreKey::from_bytes(array(key, "key")?);
        let record = match record_at(row, 3, now, Seal::new(sealer, &key)) {
            Ok(Some(record)) => record,
            Ok(None) => continue,
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
                expires_ms: Some(unsigned(expires)),
            });
        }
    }
    if rows.len() == read {
        page.cursor = rows.last().map(key_hex).transpose()?;
    }
    Ok(page)
}

fn key_hex(row: &Row) -> Result<String, StoreError> {
    let key: &[u8] = get(row, 0)?;
    Ok(StoreKey::from_bytes(array(key, "key")?).hex())
}

/// The columns of a record as this store returned it, for `take_over`'s compare-and-set.
pub(super) struct Expected {
    pub state: i16,
    pub fingerprint: Vec<u8>,
    pub created_ms: i64,
    pub owner: Option<Vec<u8>>,
    pub lease_until_ms: Option<i64>,
    pub outcome: Option<Vec<u8>>,
}

impl Expected {
    pub(super) fn of(record: &Record, seal: Seal) -> Expected {
        let signed = |ms: u64| i64::try_from(ms).unwrap_or(i64::MAX);
        let (state, owner, lease_until_ms, outcome) = match &record.state {
            RecordState::Pending {
                owner,
                lease_until_ms,
            }
            | RecordState::Abandoned {
                owner,
                lease_until_ms,
            } => (
                codec::STATE_PENDING,
                Some(codec::owner_bytes(*owner).to_vec()),
                Some(signed(*lease_until_ms)),
                None,
            ),
            // The codec is deterministic: the record encodes to the bytes it was read from.
            RecordState::Completed(_) => (
                codec::STATE_COMPLETED,
                None,
                None,
                Some(codec::encode(record, seal).to_vec()),
            ),
            RecordState::Unknown { .. } => (
                codec::STATE_UNKNOWN,
                None,
                None,
                Some(codec::encode(record, seal).to_vec()),
            ),
        };
        Expected {
            state: i16::from(state),
            fingerprint: record.fingerprint.0.to_vec(),
            created_ms: signed(record.created_ms),
            owner,
            lease_until_ms,
            outcome,
        }
    }
}

/// Gives back a new reservation unless disarmed: see [`super::PostgresStore::reserve`]. An
/// insert whose answer was lost may still commit later (a statement that outlived
/// `command_timeout` is not cancelled by closing its connection, and one waiting for a
/// synchronous standby commits when the standby answers): the give-back is tried again, with
/// the owner's token, until it deletes the row ([`crate::store::give_back`]).
pub(super) struct Giveback {
    armed: Option<(PostgresStore, StoreKey, OwnerToken, Duration)>,
}

impl Giveback {
    /// For a reservation by `owner` with this lease.
    pub(super) fn new(
        store: PostgresStore,
        key: &StoreKey,
        owner: OwnerToken,
        lease: Duration,
    ) -> Giveback {
        Giveback {
            armed: Some((store, *key, owner, lease)),
        }
    }

    pub(super) fn disarm(mut self) {
        self.armed = None;
    }
}

impl Drop for Giveback {
    fn drop(&mut self) {
        let Some((store, key, owner, lease)) = self.armed.take() else {
            return;
        };
        // In the background: if the database stays unreachable the row keeps its lease and
        // then reads as an unknown outcome, which is the safe side.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let token = codec::owner_bytes(owner);
                crate::store::give_back(key, lease, || async {
                    let k: &[u8] = key.as_bytes();
                    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&k, &&token[..]];
                    let release = &store.shared.sql.release;
                    // Not committed (yet), or no answer: false, and tried again.
                    match store.row("release", release, &params).await {
                        Ok(row) => matches!(count(&row, 0), Ok(1)),
                        Err(_) => false,
                    }
                })
                .await;
            });
        }
    }
}
