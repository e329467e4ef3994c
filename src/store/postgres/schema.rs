//! The table, its index and its schema version: created at first use if missing, under an
//! advisory lock so that instances starting together do not race, and checked on every start so
//! that a gateway never writes rows laid out for another version. `idemgate check --print-ddl`
//! prints the same statements for teams that apply schema changes themselves; a gateway then
//! only reads the version.

use deadpool_postgres::Object;

use crate::store::StoreError;

/// The layout this gateway reads and writes. A later gateway that changes it migrates from
/// the version it finds (under the same lock); an older gateway refuses a newer layout.
/// 2: `origin` (the route or consumer and the client's key of an open record), for the
/// operator API's listing. Added as a nullable column: no rewrite of the table, and a
/// version-1 gateway still running reads and writes rows as before (it refuses to start on
/// the table, so upgrade every instance before restarting an old one).
pub const VERSION: i32 = 2;

/// The statements that create the store's tables in `table`'s schema, each ending in `;`.
pub fn ddl(table: &str) -> String {
    let index = format!("{}_expires", unqualified(table));
    format!(
        "-- idemgate's records (schema version {VERSION}). One row per key: the pending owner and\n\
         -- its lease, or the stored outcome (idemgate's binary record form).\n\
         CREATE TABLE IF NOT EXISTS {table} (\n\
         \x20   key bytea PRIMARY KEY,            -- SHA-256 of client scope, route and key\n\
         \x20   state smallint NOT NULL,          -- 1 pending, 2 completed, 3 unknown\n\
         \x20   fingerprint bytea NOT NULL,       -- SHA-256 of the request's parameters\n\
         \x20   created_ms bigint NOT NULL,       -- database clock, ms since the Unix epoch\n\
         \x20   owner bytea,                      -- pending: the owner's random token\n\
         \x20   lease_until_ms bigint,            -- pending: the owner's lease\n\
         \x20   outcome bytea,                    -- completed or unknown: the whole record\n\
         \x20   watched boolean NOT NULL DEFAULT false, -- a waiter wants a NOTIFY\n\
         \x20   expires_ms bigint NOT NULL,       -- ignored after, purged in batches\n\
         \x20   origin bytea                      -- open records: route or consumer, client's key\n\
         );\n\
         -- From version 1: the origin column.\n\
         ALTER TABLE {table} ADD COLUMN IF NOT EXISTS origin bytea;\n\
         CREATE INDEX IF NOT EXISTS {index} ON {table} (expires_ms);\n\
         CREATE TABLE IF NOT EXISTS {table}_schema (version integer NOT NULL);\n\
         INSERT INTO {table}_schema (version) SELECT {VERSION} WHERE NOT EXISTS (SELECT 1 FROM {table}_schema);\n\
         UPDATE {table}_schema SET version = {VERSION} WHERE version < {VERSION};\n"
    )
}

/// The table's name without its schema (for the index and the notification channel).
pub(super) fn unqualified(table: &str) -> &str {
    table.rsplit('.').next().unwrap_or(table)
}

/// Makes sure the tables exist at [`VERSION`]: a read when they do; otherwise created, or
/// brought up from an earlier version, in one transaction under an advisory lock keyed by the
/// table's name.
pub(super) async fn ensure(client: &mut Object, table: &str) -> Result<(), StoreError> {
    if let Some(found) = version(client, table).await? {
        if found >= VERSION {
            return check(found, table);
        }
        tracing::info!(
            table,
            from = found,
            to = VERSION,
            "upgrading the store's table"
        );
    }
    let tx = client.transaction().await.map_err(unavailable)?;
    tx.execute(
        "SELECT pg_advisory_xact_lock(hashtext($1))",
        &[&format!("idemgate schema {table}")],
    )
    .await
    .map_err(unavailable)?;
    tx.batch_execute(&ddl(table)).await.map_err(|e| {
        StoreError::Unavailable(format!(
            "cannot create the store's table {table} (apply the output of `idemgate check --print-ddl` as a user allowed to): {e}"
        ))
    })?;
    let found: i32 = tx
        .query_one(&format!("SELECT max(version) FROM {table}_schema"), &[])
        .await
        .map_err(unavailable)?
        .try_get(0)
        .map_err(unavailable)?;
    tx.commit().await.map_err(unavailable)?;
    check(found, table)
}

/// The version recorded beside `table`, or `None` if there is no such table yet.
async fn version(client: &Object, table: &str) -> Result<Option<i32>, StoreError> {
    let exists: bool = client
        .query_one(
            "SELECT to_regclass($1) IS NOT NULL",
            &[&format!("{table}_schema")],
        )
        .await
        .map_err(unavailable)?
        .try_get(0)
        .map_err(unavailable)?;
    if !exists {
        return Ok(None);
    }
    let row = client
        .query_one(&format!("SELECT max(version) FROM {table}_schema"), &[])
        .await
        .map_err(unavailable)?;
    row.try_get::<_, Option<i32>>(0).map_err(unavailable)
}

fn check(found: i32, table: &str) -> Result<(), StoreError> {
    if found == VERSION {
        Ok(())
    } else {
        Err(StoreError::Unsafe(format!(
            "the table {table} has schema version {found}; this gateway reads and writes version {VERSION} only (upgrade the gateway, or use another store.table)"
        )))
    }
}

fn unavailable(e: tokio_postgres::Error) -> StoreError {
    StoreError::Unavailable(format!("schema: {e}"))
}
