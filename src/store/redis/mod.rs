//! The Redis store: one shared, atomic store for many gateway instances, or a Redis Cluster.
//!
//! - `reserve` is one round trip: `SET key <pending> NX GET PX <ttl>` creates the record or
//!   returns the existing one. The Redis TTL of a pending record is the full `ttl`, not the
//!   lease: an abandoned key never silently vanishes and lets a retry execute again.
//! - `complete`, `mark_unknown`, `renew` and `release` are Lua scripts ([`scripts`]) that check
//!   the state byte and owner token in place before writing, so a stale owner can never
//!   overwrite or delete another's record; the ones that end a pending state also `PUBLISH` the
//!   key in the same round trip, but only if a waiter flagged the record (`watch`).
//! - Waiters are woken through one pub/sub subscriber connection per store ([`subscriber`]),
//!   fanned out in process.
//! - Commands go over multiplexed, auto-reconnecting connections ([`conn`]: one per worker on a
//!   single Redis, one shared for a cluster), each bounded by `command_timeout`. Waiting never
//!   holds a connection.
//! - Every record of one operation is one key, `<prefix>{<hash>}`: one slot in a cluster.
//! - With `store.min_replicas`, each write is acknowledged by that many replicas before it is
//!   acted on ([`replicas`]).
//! - Redis down at startup is not fatal: commands fail with `Unavailable` (and readiness says
//!   so) until it is reachable; no restart is needed when it comes back.

mod conn;
mod guard;
mod replicas;
mod safety;
mod scan;
mod scripts;
mod sentinel;
mod streams;
mod subscriber;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use redis::Script;
use tokio::sync::OnceCell;
use tokio::task::AbortHandle;

pub use self::conn::{certificates, client};
pub use self::streams::{StreamConn, StreamRedis};

use self::conn::{
    commands_client, eval, manager_config, record_key, Connector, HandleConn, RedisConn,
};
use self::guard::ReleaseOnDrop;
use self::replicas::{Replicas, Shortfall};
use self::safety::{Eviction, Safety};
use self::scripts::Scripts;
use self::subscriber::Source;
use super::changes::Waiters;
use super::codec::{self, Seal};
use super::seal::Sealer;
use super::{
    ms_after, now_ms, Claim, OpenError, OwnerToken, Readiness, Record, RecordState, Reservation,
    ScanPage, Store, StoreError, StoreOp, StoreStats, StoredResponse, UnknownReason, Watch,
};
use crate::config::{RedisSettings, RedisTarget};
use crate::key::StoreKey;

/// A handle to the store: the state every handle shares, and this handle's connection.
pub struct RedisStore {
    shared: Arc<Shared>,
    /// `Err` only if a worker's lazy connection could not even be set up (settings that worked
    /// at open); every call then answers `Unavailable`. Shared with the background work this
    /// handle starts ([`RedisStore::complete_later`]), which opens no connection of its own.
    conn: Result<Arc<HandleConn>, StoreError>,
}

/// What every handle of one store shares.
struct Shared {
    connector: Connector,
    /// Shared with a [`ReleaseOnDrop`] guard, which builds its strings only when it fires.
    prefix: Arc<str>,
    channel: Arc<str>,
    timeout: Duration,
    waiters: Waiters,
    scripts: Arc<Scripts>,
    /// Background tasks (cluster connect, pub/sub listener), stopped with the last handle.
    tasks: Vec<AbortHandle>,
    /// Whether the pub/sub subscriber is listening now (see [`RedisStore::is_subscribed`]).
    subscribed: Arc<AtomicBool>,
    /// What Redis's configuration says about evicting and forgetting records ([`safety`]).
    safety: Arc<Safety>,
    /// `store.require_noeviction`: new keys only once Redis is known not to evict.
    require_noeviction: bool,
    /// `store.max_clock_skew`: a lease is written by its owner's clock and read by this one.
    skew: Duration,
    /// `store.min_replicas` above 0.
    replicas: Option<Replicas>,
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

impl RedisStore {
    /// Creates the store. Never waits for Redis: connections are made in the background.
    pub fn new(settings: &RedisSettings, sealer: Option<Arc<Sealer>>) -> Result<Self, OpenError> {
        let waiters = Waiters::new();
        let channel = format!("{}done", settings.key_prefix);
        let mut tasks = Vec::new();
        let timeout = settings.command_timeout;
        let certs = certificates(settings)?;
        let open = |url: &str| client(url, certs.as_ref());
        // With min_replicas, commands spread over several connections per handle: a `WAIT`
        // holds up everything behind it on its own.
        let lanes = settings.replicas.map_or(1, |_| REPLICATED_LANES);
        let (connector, subscriber_source) = match &settings.target {
            RedisTarget::Single(url) => {
                let client = commands_client(url, certs.as_ref())?;
                let config = manager_config(timeout);
                let connector = Connector::Single {
                    client,
                    config,
                    lanes,
                };
                (connector, Source::Fixed(open(url)?))
            }
            RedisTarget::Sentinel { sentinels, master } => {
                let config = manager_config(timeout);
                let (sentinels, follower) =
                    sentinel::open(sentinels, master, certs.as_ref(), (config, lanes), true)?;
                tasks.push(
                    tokio::spawn(sentinel::follow(sentinels, Arc::clone(&follower))).abort_handle(),
                );
                let source = Source::Following(Arc::clone(&follower));
                (Connector::Sentinel(follower), source)
            }
            RedisTarget::Cluster(nodes) => {
                let mut builder =
                    redis::cluster::ClusterClientBuilder::new(nodes.iter().map(String::as_str))
                        .connection_timeout(timeout.max(Duration::from_secs(1)))
                        .response_timeout(timeout);
                if let Some(c) = &certs {
                    builder = builder.certs(c.clone());
                }
                let cluster = builder
                    .build()
                    .map_err(|e| OpenError::RedisUrl(e.to_string()))?;
                let cell = Arc::new(OnceCell::new());
                tasks.push(
                    tokio::spawn(conn::connect_cluster(cluster, Arc::clone(&cell))).abort_handle(),
                );
                let first = open(nodes.first().map(String::as_str).unwrap_or_default())?;
                (Connector::Cluster(cell), Source::Fixed(first))
            }
        };
        // This first handle's connection: made here, so settings that cannot make one fail at
        // open rather than in every worker later.
        let conn = connector
            .handle()
            .map_err(|e| OpenError::RedisConnection(e.to_string()))?;
        let safety = Arc::new(Safety::default());
        let checker = connector
            .handle()
            .map_err(|e| OpenError::RedisConnection(e.to_string()))?;
        let checker = Arc::new(checker);
        if settings.replicas.is_some() {
            let counter =
                safety::count_replicas(Arc::clone(&checker), Arc::clone(&safety), timeout);
            tasks.push(tokio::spawn(counter).abort_handle());
        }
        tasks.push(
            tokio::spawn(safety::watch(checker, Arc::clone(&safety), timeout)).abort_handle(),
        );
        let subscribed = Arc::new(AtomicBool::new(false));
        tasks.push(
            tokio::spawn(subscriber::listen(
                subscriber_source,
                channel.clone(),
                waiters.clone(),
                Arc::clone(&subscribed),
            ))
            .abort_handle(),
        );
        Ok(RedisStore {
            shared: Arc::new(Shared {
                connector,
                prefix: settings.key_prefix.as_str().into(),
                channel: channel.as_str().into(),
                timeout,
                waiters,
                scripts: Arc::new(Scripts::new()),
                tasks,
                subscribed,
                safety,
                require_noeviction: settings.require_noeviction,
                skew: settings.max_clock_skew,
                replicas: settings.replicas.map(Replicas::new),
                sealer,
            }),
            conn: Ok(Arc::new(conn)),
        })
    }

    /// Whether the pub/sub subscriber is listening: until it is, waiters learn of results only
    /// from their once-a-second re-read (and all of them re-read when it starts listening).
    pub fn is_subscribed(&self) -> bool {
        self.shared.subscribed.load(Ordering::Acquire)
    }

    fn redis_key(&self, key: &StoreKey) -> Vec<u8> {
        record_key(&self.shared.prefix, key)
    }

    fn conn(&self) -> Result<RedisConn, StoreError> {
        match &self.conn {
            Ok(c) => c.get(),
            Err(e) => Err(e.clone()),
        }
    }

    /// Runs one Redis call within `command_timeout`.
    async fn call<T>(
        &self,
        what: &str,
        fut: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, StoreError> {
        self.call_within(what, self.shared.timeout, fut).await
    }

    /// Runs one write with the replicas' acknowledgement, within `command_timeout` plus
    /// `replica_timeout`.
    async fn call_acked<T>(
        &self,
        replicas: &Replicas,
        op: StoreOp,
        fut: impl std::future::Future<Output = redis::RedisResult<(T, i64)>>,
    ) -> Result<(T, i64), StoreError> {
        let within = self.shared.timeout + replicas.timeout();
        self.call_within(op.as_str(), within, fut).await
    }

    async fn call_within<T>(
        &self,
        what: &str,
        within: Duration,
        fut: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(within, fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                self.shared.connector.failed(Some(&e));
                Err(StoreError::Unavailable(format!("{what}: {e}")))
            }
            Err(_) => {
                self.shared.connector.failed(None);
                Err(StoreError::Unavailable(format!(
                    "{what}: no answer within {within:?}"
                )))
            }
        }
    }

    /// Runs a script on `key`: its answer, and with `min_replicas` how many replicas
    /// acknowledged it.
    async fn script_acked(
        &self,
        op: StoreOp,
        script: &Script,
        key: &StoreKey,
        args: &[&[u8]],
    ) -> Result<(i64, Option<i64>), StoreError> {
        let mut conn = self.conn()?;
        let key = self.redis_key(key);
        match &self.shared.replicas {
            None => {
                let done = self.call(op.as_str(), eval(&mut conn, script, &key, args));
                Ok((done.await?, None))
            }
            Some(replicas) => {
                let (done, acked) = self
                    .call_acked(replicas, op, replicas.eval(&mut conn, script, &key, args))
                    .await?;
                Ok((done, Some(acked)))
            }
        }
    }

    /// [`Self::script_acked`] for a write that stands whatever the replicas say: a shortfall
    /// is noted (see [`replicas`]).
    async fn script(
        &self,
        op: StoreOp,
        script: &Script,
        key: &StoreKey,
        args: &[&[u8]],
    ) -> Result<i64, StoreError> {
        let (done, acked) = self.script_acked(op, script, key, args).await?;
        if let (1, Some(acked), Some(replicas)) = (done, acked, &self.shared.replicas) {
            replicas.enough(op, acked, Shortfall::Note);
        }
        Ok(done)
    }

    /// Runs an owner-only script: 1 = done, 0 = not the owner.
    async fn owned(
        &self,
        op: StoreOp,
        script: &Script,
        key: &StoreKey,
        args: &[&[u8]],
    ) -> Result<(), StoreError> {
        match self.script(op, script, key, args).await? {
            1 => Ok(()),
            _ => Err(StoreError::NotOwner),
        }
    }
}

/// Connections per handle to a single Redis or a Sentinel's primary with `min_replicas`.
const REPLICATED_LANES: usize = 8;

type OptionalRecord = Result<Option<Record>, StoreError>;

impl RedisStore {
    /// How the record under `key` is sealed.
    pub(super) fn seal<'a>(&'a self, key: &'a StoreKey) -> Seal<'a> {
        Seal::new(self.shared.sealer.as_deref(), key)
    }

    /// A record as Redis returned it, as the contract returns it (its lease checked).
    fn decode(&self, key: &StoreKey, raw: Vec<u8>) -> Result<Record, StoreError> {
        let record = codec::decode(&Bytes::from(raw), self.seal(key))?;
        Ok(record.checked_lease_skewed(self.shared.skew))
    }

    /// [`RedisStore::decode`] of a reply that may be `nil` (no record).
    fn decode_reply(&self, key: &StoreKey, raw: Option<Vec<u8>>) -> OptionalRecord {
        raw.map(|raw| self.decode(key, raw)).transpose()
    }
}

/// Whether `record` is pending under `owner`'s token.
fn holds(record: &Record, owner: OwnerToken) -> bool {
    matches!(
        record.state,
        RecordState::Pending { owner: o, .. } | RecordState::Abandoned { owner: o, .. } if o == owner
    )
}

fn ms_arg(d: Duration) -> u64 {
    d.as_millis().clamp(1, u64::MAX as u128) as u64
}

#[async_trait]
impl Store for RedisStore {
    async fn reserve(
        &self,
        key: &StoreKey,
        claim: &Claim,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Reservation, StoreError> {
        if self.shared.require_noeviction && self.shared.safety.eviction() != Eviction::Safe {
            // Records already there are still answered; only new ones are not made.
            return match self.get(key).await? {
                Some(record) => Ok(Reservation::Existing(record)),
                None => Err(StoreError::Unsafe(
                    "Redis is not known to keep records (store.require_noeviction): its maxmemory-policy is not noeviction, or cannot be read yet".into(),
                )),
            };
        }
        let (owner, record) = super::pending(claim, lease);
        let record = codec::encode(&record, self.seal(key));
        let mut conn = self.conn()?;
        let mut cmd = redis::cmd("SET");
        cmd.arg(self.redis_key(key))
            .arg(&record[..])
            .arg("NX")
            .arg("GET")
            .arg("PX")
            .arg(ms_arg(ttl));
        // If the SET reached Redis but its answer did not reach us (timeout, or this future
        // dropped because the client hung up), a pending record would be left that nobody owns:
        // retries would see it as in flight, then as an unknown outcome, though nothing was sent
        // upstream. The guard releases it (the script only deletes our own token's record).
        let guard = ReleaseOnDrop::new(self, key, owner, conn.clone(), lease);
        let (existing, acked): (Option<Vec<u8>>, Option<i64>) = match &self.shared.replicas {
            None => (
                self.call("reserve", cmd.query_async(&mut conn)).await?,
                None,
            ),
            Some(replicas) => {
                let op = StoreOp::Reserve;
                let (existing, acked) = self
                    .call_acked(replicas, op, replicas.send(&mut conn, cmd))
                    .await?;
                (existing, Some(acked))
            }
        };
        // Another's record (told from ours by the owner token, in the clear): no give-back,
        // whatever reading it comes to (a record the keys do not open is refused, not ours).
        let existing = match existing {
            Some(raw) if !codec::pending_of(&raw, owner) => {
                guard.disarm();
                return Ok(Reservation::Existing(self.decode(key, raw)?));
            }
            ours_or_none => ours_or_none,
        };
        match self.decode_reply(key, existing)? {
            Some(record) if !holds(&record, owner) => {
                guard.disarm();
                Ok(Reservation::Existing(record))
            }
            // Made now; or with our own token, when the cluster client sent the command again
            // after losing a reply, and the first one made it: ours, not another's in flight.
            _ => {
                self.act_or_give_back(StoreOp::Reserve, acked, guard)
                    .await?;
                Ok(Reservation::Owner(owner))
            }
        }
    }

    async fn get(&self, key: &StoreKey) -> Result<Option<Record>, StoreError> {
        let mut conn = self.conn()?;
        let mut cmd = redis::cmd("GET");
        cmd.arg(self.redis_key(key));
        let raw: Option<Vec<u8>> = self.call("get", cmd.query_async(&mut conn)).await?;
        self.decode_reply(key, raw)
    }

    async fn expires_ms(&self, key: &StoreKey) -> Result<Option<u64>, StoreError> {
        let mut conn = self.conn()?;
        let mut cmd = redis::cmd("PTTL");
        cmd.arg(self.redis_key(key));
        // -2: no key; -1: no expiry (never written so by the gateway).
        let left: i64 = self.call("get", cmd.query_async(&mut conn)).await?;
        Ok(u64::try_from(left)
            .ok()
            .map(|ms| now_ms().saturating_add(ms)))
    }

    async fn watch(&self, key: &StoreKey) -> Result<Watch, StoreError> {
        // Subscribed before the read, so a change in between still wakes the caller; the read
        // flags a pending record so that the end of its pending state is published.
        let changes = self.shared.waiters.subscribe(key);
        let mut conn = self.conn()?;
        let raw: Option<Vec<u8>> = self
            .call(
                "get",
                eval(
                    &mut conn,
                    &self.shared.scripts.watch,
                    &self.redis_key(key),
                    &[],
                ),
            )
            .await?;
        Ok(Watch {
            record: self.decode_reply(key, raw)?,
            changes,
        })
    }

    async fn complete(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        response: StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let tail = codec::encode_state(&RecordState::Completed(Arc::new(response)), self.seal(key));
        let (owner, ttl, digits) = (
            codec::owner_bytes(owner),
            ms_arg(ttl).to_string(),
            key.hex_digits(),
        );
        let args: [&[u8]; 5] = [
            &owner,
            &tail,
            ttl.as_bytes(),
            self.shared.channel.as_bytes(),
            &digits,
        ];
        let script = &self.shared.scripts.complete;
        let done = self.owned(StoreOp::Complete, script, key, &args).await;
        if let Err(StoreError::Unavailable(_)) = &done {
            self.complete_later(*key, args.map(<[u8]>::to_vec));
        }
        done
    }

    async fn mark_unknown(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        reason: UnknownReason,
    ) -> Result<(), StoreError> {
        let tail = codec::encode_state(
            &RecordState::Unknown {
                since_ms: now_ms(),
                reason,
            },
            self.seal(key),
        );
        self.owned(
            StoreOp::MarkUnknown,
            &self.shared.scripts.mark_unknown,
            key,
            &[
                &codec::owner_bytes(owner),
                &tail,
                self.shared.channel.as_bytes(),
                &key.hex_digits(),
            ],
        )
        .await
    }

    async fn release(&self, key: &StoreKey, owner: OwnerToken) -> Result<(), StoreError> {
        self.owned(
            StoreOp::Release,
            &self.shared.scripts.release,
            key,
            &[
                &codec::owner_bytes(owner),
                self.shared.channel.as_bytes(),
                &key.hex_digits(),
            ],
        )
        .await
    }

    async fn renew(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let lease_until = ms_after(lease).to_be_bytes();
        self.owned(
            StoreOp::Renew,
            &self.shared.scripts.renew,
            key,
            &[&codec::owner_bytes(owner), &lease_until],
        )
        .await
    }

    async fn take_over(
        &self,
        key: &StoreKey,
        expected: &Record,
        claim: &Claim,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Option<OwnerToken>, StoreError> {
        // The codec is deterministic, so the expected record encodes to the stored bytes (but for
        // a waiter's flag byte, which the script ignores in the comparison and keeps).
        let expected_bytes = codec::encode(expected, self.seal(key));
        let (owner, record) = super::pending(claim, lease);
        let record = codec::encode(&record, self.seal(key));
        let ttl_ms = ms_arg(ttl).to_string();
        let args: [&[u8]; 3] = [&expected_bytes, &record, ttl_ms.as_bytes()];
        let script = &self.shared.scripts.take_over;
        // No give-back guard: releasing the new record would free the key along with the
        // outcome it replaced. An uncertain answer writes that outcome back instead; a dropped
        // future leaves the new record to read as abandoned once its lease ends.
        let answered = self
            .script_acked(StoreOp::TakeOver, script, key, &args)
            .await;
        let failed = match answered {
            Ok((done, _)) if done != 1 => return Ok(None),
            Ok((_, acked)) => match self.may_act(StoreOp::TakeOver, acked) {
                Ok(()) => return Ok(Some(owner)),
                Err(refused) => refused,
            },
            Err(e) => e,
        };
        let taker = (owner, &claim.fingerprint);
        Err(super::give_back_replaced(self, key, taker, expected, ttl, failed).await)
    }

    async fn delete(&self, key: &StoreKey) -> Result<bool, StoreError> {
        let args: [&[u8]; 2] = [self.shared.channel.as_bytes(), &key.hex_digits()];
        let n = self
            .script(StoreOp::Delete, &self.shared.scripts.delete, key, &args)
            .await?;
        Ok(n == 1)
    }

    async fn scan_unknown(
        &self,
        cursor: Option<&str>,
        want: usize,
    ) -> Result<ScanPage, StoreError> {
        self.unknown_page(cursor, want).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let mut conn = self.conn()?;
        let pong: String = self
            .call("ping", redis::cmd("PING").query_async(&mut conn))
            .await?;
        if pong == "PONG" {
            Ok(())
        } else {
            Err(StoreError::Unavailable(format!(
                "unexpected PING answer {pong:?}"
            )))
        }
    }

    async fn flush(&self) -> Result<(), StoreError> {
        // Every change was answered by Redis; its persistence is Redis's (docs/stores.md).
        Ok(())
    }

    fn max_clock_skew(&self) -> Duration {
        self.shared.skew
    }

    fn system(&self) -> &'static str {
        "redis"
    }

    fn stats(&self) -> StoreStats {
        // Redis expires records itself.
        StoreStats {
            eviction_policy: self.shared.safety.policy(),
            replica_acks_missed: self
                .shared
                .replicas
                .as_ref()
                .map(Replicas::missed)
                .unwrap_or_default(),
            ..StoreStats::default()
        }
    }

    fn readiness(&self) -> Readiness {
        if let Some(replicas) = &self.shared.replicas {
            let connected = self.shared.safety.replicas();
            if connected.is_none_or(|n| n < replicas.min()) {
                let counted = connected.map_or("not counted yet".into(), |n| n.to_string());
                return Readiness::NotReady(format!(
                    "Redis's primary has fewer connected replicas ({counted}) than store.min_replicas ({}): new keys are refused",
                    replicas.min()
                ));
            }
        }
        let eviction = self.shared.safety.eviction();
        let note = self.shared.safety.note();
        if self.shared.require_noeviction && eviction != Eviction::Safe {
            return Readiness::NotReady(note.unwrap_or_else(|| {
                "Redis's maxmemory-policy not checked yet (store.require_noeviction)".into()
            }));
        }
        match note {
            Some(n) => Readiness::Warning(n),
            None => Readiness::Fine,
        }
    }

    fn for_worker(&self) -> Arc<dyn Store> {
        Arc::new(RedisStore {
            shared: Arc::clone(&self.shared),
            conn: self.shared.connector.handle().map(Arc::new),
        })
    }
}
