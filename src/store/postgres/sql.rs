//! The statements, written once per table at open (the table's name is checked to be a plain
//! identifier, so it can be part of the text) and prepared once per connection.
//!
//! Every time that decides something (a lease, an expiry) is the database's clock,
//! `statement_timestamp()` in milliseconds, never a gateway's: instances whose clocks drift
//! still agree on when a lease ran out, as they do with Redis's TTLs. A record past its
//! `expires_ms` is ignored at once by every statement and removed later by the purge.

use crate::store::codec;

/// The database's clock, in milliseconds since the Unix epoch; one value per statement.
const NOW: &str = "(extract(epoch from statement_timestamp()) * 1000)::bigint";

/// The columns a record is read from, in [`super::rows`]'s order.
/// The codec's first two bytes (version, state) of a completed or unknown record: the rest of
/// its header (fingerprint, created_ms) comes from the row, so `outcome` holds the whole
/// record in [`crate::store::codec`]'s form and is read back without assembling.
fn header(state: u8) -> String {
    format!(
        "'\\x{:02x}{state:02x}'::bytea || fingerprint || int8send(created_ms)",
        codec::VERSION
    )
}

const RECORD: &str =
    "r.state, r.fingerprint, r.created_ms, r.owner, r.lease_until_ms, r.outcome, r.origin";

pub(super) struct Sql {
    /// `$1` key, `$2` fingerprint, `$3` owner, `$4` lease ms, `$5` ttl ms, `$6` origin: one
    /// row of `made`, `now_ms`, `expires_ms`, then the existing record's columns (null when
    /// made).
    pub reserve: String,
    /// Same parameters: takes over a record past its expiry that the purge has not removed.
    pub replace_expired: String,
    /// `$1` key: `now_ms`, then the record's columns, then `expires_ms`.
    pub get: String,
    /// `$1` key: flags a pending record so that the end of its pending state is notified.
    /// `flagged`, `now_ms`, `watched`, then the record's columns.
    pub watch: String,
    /// `$1` key, `$2` owner, `$3` the completed state (the codec's part after the header),
    /// `$4` ttl ms: `done`, `woke`.
    pub complete: String,
    /// `$1` key, `$2` owner, `$3` the unknown state: `done`, `woke`.
    pub mark_unknown: String,
    /// `$1` key, `$2` owner: `done`, `woke`.
    pub release: String,
    /// `$1` key, `$2` owner, `$3` lease ms: rows changed.
    pub renew: String,
    /// `$1` key, `$2`..`$7` the expected record's columns, `$8` fingerprint, `$9` owner,
    /// `$10` lease ms, `$11` ttl ms, `$12` origin: rows changed.
    pub take_over: String,
    /// `$1` key: `done` (a live record was deleted), `woke`.
    pub delete: String,
    /// `$1` batch size: rows removed.
    pub purge: String,
    /// `$1` the last key of the previous page (empty at first), `$2` rows at most: `key`,
    /// `now_ms`, `expires_ms`, then the record's columns, a completed one's outcome left out.
    pub scan: String,
}

impl Sql {
    pub(super) fn new(table: &str, channel: &str) -> Sql {
        let t = table;
        let notifying = |dml: &str, live: &str| {
            format!(
                "WITH done AS ({dml} RETURNING watched, {live} AS live), \
                 woke AS (SELECT pg_notify('{channel}', encode($1, 'hex')) FROM done WHERE watched) \
                 SELECT (SELECT count(*) FROM done WHERE live) AS done, (SELECT count(*) FROM woke) AS woke"
            )
        };
        let completed = header(codec::STATE_COMPLETED);
        let unknown = header(codec::STATE_UNKNOWN);
        let owned = format!("key = $1 AND owner = $2 AND expires_ms > {NOW}");
        Sql {
            reserve: format!(
                "WITH ins AS (\
                   INSERT INTO {t} (key, state, fingerprint, created_ms, owner, lease_until_ms, expires_ms, origin) \
                   VALUES ($1, 1, $2, {NOW}, $3, {NOW} + $4, {NOW} + $5, $6) \
                   ON CONFLICT (key) DO NOTHING RETURNING 1) \
                 SELECT (SELECT count(*) FROM ins) AS made, {NOW} AS now_ms, r.expires_ms, {RECORD} \
                 FROM (SELECT 1) AS one LEFT JOIN {t} AS r ON r.key = $1"
            ),
            replace_expired: format!(
                "UPDATE {t} SET state = 1, fingerprint = $2, created_ms = {NOW}, owner = $3, \
                   lease_until_ms = {NOW} + $4, outcome = NULL, watched = false, expires_ms = {NOW} + $5, \
                   origin = $6 \
                 WHERE key = $1 AND expires_ms <= {NOW}"
            ),
            get: format!(
                "SELECT {NOW} AS now_ms, {RECORD}, r.expires_ms FROM {t} AS r WHERE r.key = $1 AND r.expires_ms > {NOW}"
            ),
            watch: format!(
                "WITH flag AS (\
                   UPDATE {t} AS r SET watched = true \
                   WHERE key = $1 AND state = 1 AND NOT watched AND expires_ms > {NOW} \
                   RETURNING {RECORD}) \
                 SELECT true AS flagged, {NOW} AS now_ms, true AS watched, f.* FROM flag AS f \
                 UNION ALL \
                 SELECT false, {NOW}, r.watched, {RECORD} FROM {t} AS r \
                 WHERE r.key = $1 AND r.expires_ms > {NOW} AND NOT EXISTS (SELECT 1 FROM flag)"
            ),
            complete: notifying(
                &format!(
                    "UPDATE {t} SET state = 2, owner = NULL, lease_until_ms = NULL, origin = NULL, \
                       outcome = {completed} || $3, expires_ms = {NOW} + $4 WHERE {owned}"
                ),
                "true",
            ),
            mark_unknown: notifying(
                &format!(
                    "UPDATE {t} SET state = 3, owner = NULL, lease_until_ms = NULL, \
                       outcome = {unknown} || $3 || coalesce(origin, ''::bytea) WHERE {owned}"
                ),
                "true",
            ),
            release: notifying(&format!("DELETE FROM {t} WHERE {owned}"), "true"),
            renew: format!("UPDATE {t} SET lease_until_ms = {NOW} + $3 WHERE {owned}"),
            take_over: format!(
                "UPDATE {t} SET state = 1, fingerprint = $8, created_ms = {NOW}, owner = $9, \
                   lease_until_ms = {NOW} + $10, outcome = NULL, expires_ms = {NOW} + $11, origin = $12 \
                 WHERE key = $1 AND expires_ms > {NOW} AND state = $2 AND fingerprint = $3 \
                   AND created_ms = $4 AND owner IS NOT DISTINCT FROM $5 \
                   AND lease_until_ms IS NOT DISTINCT FROM $6 AND outcome IS NOT DISTINCT FROM $7"
            ),
            delete: notifying(
                &format!("DELETE FROM {t} WHERE key = $1"),
                &format!("expires_ms > {NOW}"),
            ),
            purge: format!(
                "DELETE FROM {t} WHERE key IN (\
                   SELECT key FROM {t} WHERE expires_ms <= {NOW} \
                   ORDER BY expires_ms LIMIT $1 FOR UPDATE SKIP LOCKED)"
            ),
            scan: format!(
                "SELECT r.key, {NOW} AS now_ms, r.expires_ms, r.state, r.fingerprint, r.created_ms, \
                   r.owner, r.lease_until_ms, CASE WHEN r.state = 2 THEN NULL ELSE r.outcome END, \
                   r.origin \
                 FROM {t} AS r WHERE r.key > $1 ORDER BY r.key LIMIT $2"
            ),
        }
    }
}
