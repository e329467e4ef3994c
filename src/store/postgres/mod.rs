//! The Postgres store: one table shared by every instance, for teams whose system of record is
//! their database (backed up, replicated synchronously, trusted with money).
//!
//! - `reserve` is one statement: `INSERT ... ON CONFLICT (key) DO NOTHING`, and in the same
//!   statement the existing row for the caller that lost; only a caller whose insert raced a
//!   concurrent one past the statement's snapshot reads once more.
//! - `complete`, `mark_unknown`, `release` and `renew` name the owner token in their `WHERE`, so
//!   a stale owner changes nothing; the ones that end a pending state send `NOTIFY` in the same
//!   transaction when a waiter flagged the row (`watch`), heard by every instance's listening
//!   connection ([`listen`]).
//! - Leases and expiry are decided by the database's clock ([`sql`]); expired rows are ignored
//!   at once and removed in small batches ([`purge`]).
//! - The table is created at first use if missing, under an advisory lock, at a recorded
//!   schema version ([`schema`]).
//! - Statements run on pools of connections ([`connect`]), each bounded by `command_timeout`;
//!   a connection that failed or timed out is closed, never reused. Each worker thread has a
//!   pool of its own, made on its runtime, which drives its connections: no statement hops
//!   threads, and a worker that stops at shutdown takes no other worker's connection with it.
//!   `pool_size` is shared out among the workers. The database down at startup is not fatal:
//!   calls answer `Unavailable` until it is back.

mod connect;
mod listen;
mod purge;
mod rows;
pub mod schema;
mod sql;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::Pool;
use tokio::sync::OnceCell;
use tokio::task::AbortHandle;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use self::connect::{explain, Connect, Lease};
use self::rows::{count, millis, record_at, Expected, Giveback};
use self::sql::Sql;
use super::changes::Waiters;
use super::codec::Seal;
use super::seal::Sealer;
use super::{
    codec, now_ms, Claim, OpenError, OwnerToken, Readiness, Record, RecordState, Reservation,
    ScanPage, Store, StoreError, StoreStats, StoredResponse, UnknownReason, Watch, SCAN_BUDGET,
};
use crate::config::PostgresSettings;
use crate::key::StoreKey;

type Params<'a> = [&'a (dyn ToSql + Sync)];

/// A handle to the store: what every handle shares, and this handle's own pool.
pub struct PostgresStore {
    shared: Arc<Shared>,
    /// `Err` only if a worker's pool could not be made (settings that worked at open).
    pool: Result<Pool, StoreError>,
}

struct Shared {
    connect: Connect,
    /// Connections in each handle's pool.
    share: usize,
    sql: Sql,
    table: String,
    timeout: Duration,
    /// `store.max_clock_skew`: an unknown outcome's time is its gateway's clock.
    skew: Duration,
    waiters: Waiters,
    /// Set once the table is known to be at this gateway's schema version.
    schema: OnceCell<()>,
    /// Why the table cannot be used (a newer schema version, no right to create it).
    schema_problem: Mutex<Option<String>>,
    listening: Arc<AtomicBool>,
    purged: Arc<AtomicU64>,
    /// The listener and the purge, stopped with the last handle.
    tasks: Vec<AbortHandle>,
    /// `store.encryption_keys_*`: records' answers and origins sealed ([`super::seal`]).
    sealer: Option<Arc<Sealer>>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl PostgresStore {
    /// Creates the store. Never waits for the database: connections are made when needed.
    pub fn new(
        settings: &PostgresSettings,
        sealer: Option<Arc<Sealer>>,
    ) -> Result<Self, OpenError> {
        let connect = Connect::new(settings)?;
        let share = settings.pool_size.div_ceil(settings.workers.max(1)).max(2);
        let pool = connect.pool(share, settings.command_timeout)?;
        // The purge's own connection, driven by the runtime it runs on.
        let purge_pool = connect.pool(1, settings.command_timeout)?;
        let channel = format!("idemgate_{}", schema::unqualified(&settings.table));
        let waiters = Waiters::new();
        let listening = Arc::new(AtomicBool::new(false));
        let purged = Arc::new(AtomicU64::new(0));
        let shared = Arc::new_cyclic(|weak| {
            let listener = listen::listen(
                connect.clone(),
                channel.clone(),
                waiters.clone(),
                Arc::clone(&listening),
                settings.command_timeout,
            );
            let purge = purge::purge(weak.clone(), purge_pool, Arc::clone(&purged));
            Shared {
                connect,
                share,
                sql: Sql::new(&settings.table, &channel),
                table: settings.table.clone(),
                timeout: settings.command_timeout,
                skew: settings.max_clock_skew,
                waiters,
                schema: OnceCell::new(),
                schema_problem: Mutex::new(None),
                listening,
                purged,
                tasks: vec![
                    tokio::spawn(listener).abort_handle(),
                    tokio::spawn(purge).abort_handle(),
                ],
                sealer,
            }
        });
        Ok(PostgresStore {
            shared,
            pool: Ok(pool),
        })
    }

    fn pool(&self) -> Result<&Pool, StoreError> {
        self.pool.as_ref().map_err(Clone::clone)
    }

    /// Whether the notification connection is listening: until it is, waiters learn of results
    /// only from their once-a-second re-read.
    pub fn is_listening(&self) -> bool {
        self.shared.listening.load(Ordering::Acquire)
    }

    /// Expired rows this process removed.
    pub fn purged(&self) -> u64 {
        self.shared.purged.load(Ordering::Relaxed)
    }
}

impl Shared {
    /// The table at this gateway's schema version: checked (or created) once per process.
    async fn ready(&self, pool: &Pool) -> Result<(), StoreError> {
        if self.schema.initialized() {
            return Ok(());
        }
        let result = self
            .schema
            .get_or_try_init(|| async {
                let mut lease = Lease::take(pool).await?;
                // Creating the table may wait on another instance's lock: a few timeouts long.
                let within = self.timeout * 5;
                let ensured =
                    tokio::time::timeout(within, schema::ensure(lease.client()?, &self.table))
                        .await
                        .map_err(|_| {
                            StoreError::Unavailable(format!("schema: no answer within {within:?}"))
                        })?;
                lease.keep();
                ensured
            })
            .await
            .map(|_| ());
        let problem = match &result {
            Err(StoreError::Unsafe(why)) => Some(why.clone()),
            _ => None,
        };
        *self
            .schema_problem
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = problem;
        result
    }

    /// Runs one prepared statement within `command_timeout` (waiting for a connection
    /// included): its rows, or with `count` the number of rows it changed. A statement that runs
    /// out of time is cancelled on the server, not only left behind with its closed connection:
    /// one that waits for a lock ends there, and a commit that waits for a synchronous standby
    /// completes locally at once, so that a give-back of it finds it within its lease.
    async fn run(
        &self,
        pool: &Pool,
        what: &str,
        sql: &str,
        params: &Params<'_>,
        count: bool,
    ) -> Result<(Vec<Row>, u64), StoreError> {
        self.ready(pool).await?;
        let deadline = tokio::time::Instant::now() + self.timeout;
        let late =
            || StoreError::Unavailable(format!("{what}: no answer within {:?}", self.timeout));
        let mut lease = tokio::time::timeout_at(deadline, Lease::take(pool))
            .await
            .map_err(|_| late())??;
        let client = lease.client()?;
        let work = async {
            let result = async {
                let statement = client.prepare_cached(sql).await?;
                if count {
                    client
                        .execute(&statement, params)
                        .await
                        .map(|n| (Vec::new(), n))
                } else {
                    client.query(&statement, params).await.map(|rows| (rows, 0))
                }
            }
            .await;
            (result, !client.is_closed())
        };
        let Ok((result, healthy)) = tokio::time::timeout_at(deadline, work).await else {
            // The lease closes the connection when it drops; the statement is cancelled too.
            if let Ok(client) = lease.client() {
                self.connect.cancel(client.cancel_token());
            }
            return Err(late());
        };
        match result {
            Ok(done) => {
                lease.keep();
                Ok(done)
            }
            Err(e) => {
                // An SQL error leaves the connection usable; anything else closes it, and so
                // does a node that refuses writes (a standby, or a primary turned read-only):
                // the pool's next connection looks for the writable node.
                let read_only = e.code() == Some(&SqlState::READ_ONLY_SQL_TRANSACTION);
                if healthy && e.as_db_error().is_some() && !read_only {
                    lease.keep();
                }
                Err(StoreError::Unavailable(format!("{what}: {}", explain(&e))))
            }
        }
    }
}

impl PostgresStore {
    /// Runs a statement on this handle's pool: its rows.
    async fn rows(
        &self,
        what: &str,
        sql: &str,
        params: &Params<'_>,
    ) -> Result<Vec<Row>, StoreError> {
        let run = self.shared.run(self.pool()?, what, sql, params, false);
        run.await.map(|(rows, _)| rows)
    }

    /// Runs a statement on this handle's pool: the rows it changed.
    async fn execute(&self, what: &str, sql: &str, params: &Params<'_>) -> Result<u64, StoreError> {
        let run = self.shared.run(self.pool()?, what, sql, params, true);
        run.await.map(|(_, n)| n)
    }

    /// The first row of a statement that always answers one.
    async fn row(&self, what: &str, sql: &str, params: &Params<'_>) -> Result<Row, StoreError> {
        self.rows(what, sql, params)
            .await?
            .into_iter()
            .next()
            .ok_or_else(|| StoreError::Unavailable(format!("{what}: no row in the answer")))
    }

    /// Runs an owner-only statement that answers `done`: 1 = done, 0 = not the owner.
    async fn owned(&self, what: &str, sql: &str, params: &Params<'_>) -> Result<(), StoreError> {
        match count(&self.row(what, sql, params).await?, 0)? {
            1 => Ok(()),
            _ => Err(StoreError::NotOwner),
        }
    }

    /// How the record under `key` is sealed.
    fn seal<'a>(&'a self, key: &'a StoreKey) -> Seal<'a> {
        Seal::new(self.shared.sealer.as_deref(), key)
    }

    async fn read(&self, key: &StoreKey) -> Result<Option<Record>, StoreError> {
        let k: &[u8] = key.as_bytes();
        match self.rows("get", &self.shared.sql.get, &[&k]).await?.first() {
            Some(row) => record_at(row, 1, count(row, 0)?, self.seal(key)),
            None => Ok(None),
        }
    }

    /// Another handle on the same pool (for work that outlives a call).
    fn handle(&self) -> PostgresStore {
        PostgresStore {
            shared: Arc::clone(&self.shared),
            pool: self.pool.clone(),
        }
    }
}

/// Tries for a reservation or a watch whose row keeps changing under it.
const TRIES: usize = 3;

#[async_trait]
impl Store for PostgresStore {
    async fn reserve(
        &self,
        key: &StoreKey,
        claim: &Claim,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Reservation, StoreError> {
        let shared = &self.shared;
        let owner = OwnerToken::random();
        let (k, fp, token): (&[u8], &[u8], [u8; 16]) = (
            key.as_bytes(),
            &claim.fingerprint.0,
            codec::owner_bytes(owner),
        );
        // If the insert committed but its answer was lost (a timeout, the caller gone), the
        // guard gives the row back: a key nobody owns would read as in flight, then unknown.
        let guard = Giveback::new(self.handle(), key, owner, lease);
        let (lease, ttl) = (millis(lease), millis(ttl));
        let origin =
            (claim.origin.as_deref()).and_then(|o| codec::encode_origin(o, self.seal(key)));
        let params: [&(dyn ToSql + Sync); 6] = [&k, &fp, &&token[..], &lease, &ttl, &origin];
        for _ in 0..TRIES {
            let row = self.row("reserve", &shared.sql.reserve, &params).await?;
            if count(&row, 0)? == 1 {
                guard.disarm();
                return Ok(Reservation::Owner(owner));
            }
            let now = count(&row, 1)?;
            let expires: Option<i64> = rows::get(&row, 2)?;
            // Another's live row (the insert did nothing): no give-back, whatever reading it
            // comes to; an expired one is replaced without being read.
            if expires.is_some_and(|e| e > now) {
                guard.disarm();
                return match record_at(&row, 3, now, self.seal(key))? {
                    Some(record) => Ok(Reservation::Existing(record)),
                    None => Err(StoreError::Corrupt("a live row without its record".into())),
                };
            }
            match expires {
                // Past its expiry but not purged yet: the key is free.
                Some(_) => {
                    if self
                        .execute("reserve", &shared.sql.replace_expired, &params)
                        .await?
                        == 1
                    {
                        guard.disarm();
                        return Ok(Reservation::Owner(owner));
                    }
                }
                // Inserted by a transaction that committed after this statement's snapshot.
                None => match self.read(key).await {
                    Ok(None) => {}
                    Ok(Some(record)) => {
                        guard.disarm();
                        return Ok(Reservation::Existing(record));
                    }
                    // Another's, whatever it reads as: nothing of ours to give back.
                    Err(e @ StoreError::Unreadable { .. }) => {
                        guard.disarm();
                        return Err(e);
                    }
                    Err(e) => return Err(e),
                },
            }
        }
        guard.disarm();
        Err(StoreError::Unavailable(
            "reserve: the key changed under every try".into(),
        ))
    }

    async fn get(&self, key: &StoreKey) -> Result<Option<Record>, StoreError> {
        self.read(key).await
    }

    async fn expires_ms(&self, key: &StoreKey) -> Result<Option<u64>, StoreError> {
        let k: &[u8] = key.as_bytes();
        let rows = self.rows("get", &self.shared.sql.get, &[&k]).await?;
        let Some(row) = rows.first() else {
            return Ok(None);
        };
        let ms: i64 = row.try_get("expires_ms").map_err(|e| {
            StoreError::Unavailable(format!("the record's expiry could not be read: {e}"))
        })?;
        Ok(u64::try_from(ms).ok())
    }

    async fn watch(&self, key: &StoreKey) -> Result<Watch, StoreError> {
        // Subscribed before the read: a notification in between still wakes the caller.
        let changes = self.shared.waiters.subscribe(key);
        let k: &[u8] = key.as_bytes();
        let mut record = None;
        for _ in 0..TRIES {
            let rows = self.rows("get", &self.shared.sql.watch, &[&k]).await?;
            let Some(row) = rows.first() else {
                return Ok(Watch {
                    record: None,
                    changes,
                });
            };
            let flagged: bool = rows::get(row, 0)?;
            let watched: bool = rows::get(row, 2)?;
            record = record_at(row, 3, count(row, 1)?, self.seal(key))?;
            let pending = matches!(
                record.as_ref().map(|r| &r.state),
                Some(RecordState::Pending { .. } | RecordState::Abandoned { .. })
            );
            // A pending row that is not flagged, though the flag did not find it: it changed
            // after this statement's snapshot, so read it again.
            if flagged || watched || !pending {
                break;
            }
        }
        Ok(Watch { record, changes })
    }

    async fn complete(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        response: StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let state =
            codec::encode_state(&RecordState::Completed(Arc::new(response)), self.seal(key));
        let (k, token, ttl): (&[u8], [u8; 16], i64) =
            (key.as_bytes(), codec::owner_bytes(owner), millis(ttl));
        let sql = &self.shared.sql.complete;
        let done = self
            .owned("complete", sql, &[&k, &&token[..], &&state[..], &ttl])
            .await;
        if let Err(StoreError::Unavailable(_)) = &done {
            // The statement may have committed (its answer lost, or cancelled after it did):
            // the completion, owner-only, is run again in the background until it stands.
            let store = self.handle();
            let key = *key;
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(async move {
                    crate::store::complete_later(key, || async {
                        let k: &[u8] = key.as_bytes();
                        let sql = &store.shared.sql.complete;
                        let params: [&(dyn ToSql + Sync); 4] = [&k, &&token[..], &&state[..], &ttl];
                        store.owned("complete", sql, &params).await
                    })
                    .await;
                });
            }
        }
        done
    }

    async fn mark_unknown(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        reason: UnknownReason,
    ) -> Result<(), StoreError> {
        let state = codec::encode_state(
            &RecordState::Unknown {
                since_ms: now_ms(),
                reason,
            },
            self.seal(key),
        );
        let (k, token): (&[u8], [u8; 16]) = (key.as_bytes(), codec::owner_bytes(owner));
        let sql = &self.shared.sql.mark_unknown;
        self.owned("mark_unknown", sql, &[&k, &&token[..], &&state[..]])
            .await
    }

    async fn release(&self, key: &StoreKey, owner: OwnerToken) -> Result<(), StoreError> {
        let (k, token): (&[u8], [u8; 16]) = (key.as_bytes(), codec::owner_bytes(owner));
        let sql = &self.shared.sql.release;
        self.owned("release", sql, &[&k, &&token[..]]).await
    }

    async fn renew(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let (k, token, lease): (&[u8], [u8; 16], i64) =
            (key.as_bytes(), codec::owner_bytes(owner), millis(lease));
        let sql = &self.shared.sql.renew;
        match self
            .execute("renew", sql, &[&k, &&token[..], &lease])
            .await?
        {
            1 => Ok(()),
            _ => Err(StoreError::NotOwner),
        }
    }

    async fn take_over(
        &self,
        key: &StoreKey,
        expected: &Record,
        claim: &Claim,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Option<OwnerToken>, StoreError> {
        let shared = &self.shared;
        let was = Expected::of(expected, self.seal(key));
        let owner = OwnerToken::random();
        let (k, fp, token): (&[u8], &[u8], [u8; 16]) = (
            key.as_bytes(),
            &claim.fingerprint.0,
            codec::owner_bytes(owner),
        );
        let (lease, ttl_ms) = (millis(lease), millis(ttl));
        let origin =
            (claim.origin.as_deref()).and_then(|o| codec::encode_origin(o, self.seal(key)));
        let params: [&(dyn ToSql + Sync); 12] = [
            &k,
            &was.state,
            &was.fingerprint,
            &was.created_ms,
            &was.owner,
            &was.lease_until_ms,
            &was.outcome,
            &fp,
            &&token[..],
            &lease,
            &ttl_ms,
            &origin,
        ];
        // No give-back guard: releasing the new row would free the key along with the outcome
        // it replaced. An uncertain answer writes that outcome back instead; a dropped future
        // leaves the new row to read as abandoned once its lease ends.
        match self
            .execute("take_over", &shared.sql.take_over, &params)
            .await
        {
            Ok(changed) => Ok((changed == 1).then_some(owner)),
            Err(e) => Err(super::give_back_replaced(
                self,
                key,
                (owner, &claim.fingerprint),
                expected,
                ttl,
                e,
            )
            .await),
        }
    }

    async fn scan_unknown(
        &self,
        cursor: Option<&str>,
        want: usize,
    ) -> Result<ScanPage, StoreError> {
        let after = super::after_cursor(cursor)?.map_or(Vec::new(), |k| k.as_bytes().to_vec());
        let budget = SCAN_BUDGET as i64;
        let rows = self
            .rows("scan", &self.shared.sql.scan, &[&after, &budget])
            .await?;
        rows::unknown_page(&rows, (want, SCAN_BUDGET), self.shared.sealer.as_deref())
    }

    async fn delete(&self, key: &StoreKey) -> Result<bool, StoreError> {
        let k: &[u8] = key.as_bytes();
        let row = self.row("delete", &self.shared.sql.delete, &[&k]).await?;
        Ok(count(&row, 0)? == 1)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.execute("ping", "SELECT 1", &[]).await.map(|_| ())
    }

    async fn flush(&self) -> Result<(), StoreError> {
        // Every change was committed before it was answered; its durability is the
        // database's (`synchronous_commit`, docs/stores.md).
        Ok(())
    }

    fn max_clock_skew(&self) -> Duration {
        self.shared.skew
    }

    fn system(&self) -> &'static str {
        "postgresql"
    }

    fn stats(&self) -> StoreStats {
        StoreStats {
            purged: self.purged(),
            ..StoreStats::default()
        }
    }

    fn readiness(&self) -> Readiness {
        let problem = self
            .shared
            .schema_problem
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        match problem {
            Some(why) => Readiness::NotReady(why),
            None if !self.is_listening() => Readiness::Warning(
                "not listening for Postgres notifications yet: waiters re-read once a second"
                    .into(),
            ),
            None => Readiness::Fine,
        }
    }

    fn for_worker(&self) -> Arc<dyn Store> {
        // Made here, on the worker's runtime, which then drives its connections.
        let shared = &self.shared;
        let pool = shared.connect.pool(shared.share, shared.timeout);
        Arc::new(PostgresStore {
            shared: Arc::clone(shared),
            pool: pool.map_err(|e| StoreError::Unavailable(e.to_string())),
        })
    }
}
