//! The Redis store: one shared, atomic store for many gateway instances, or a Redis Cluster.
//!
//! - `reserve` is one round trip: `SET key <pending> NX GET PX <ttl>` creates the record or
//!   returns the existing one. The Redis TTL of a pending record is the full `ttl`, not the
//!   lease: an abandoned key never silently vanishes and lets a retry execute again.
//! - `complete`, `mark_unknown`, `renew` and `release` are Lua scripts that check the state byte
//!   and owner token in place (see [`super::codec`]) before writing, so a stale owner can never
//!   overwrite or delete another's record; the ones that end a pending state also `PUBLISH` the
//!   key in the same round trip, but only if a waiter flagged the record (one byte appended to
//!   the pending record by `get_watched`, see [`super::codec`]): most keys are never waited on,
//!   and then nothing is sent and nothing else is touched.
//! - Waiters are woken through one pub/sub subscriber connection per instance, fanned out in
//!   process; after every (re)subscription all local waiters re-read, since messages sent while
//!   disconnected are lost. The gateway also re-reads on a timer, as a last resort.
//! - Commands go over multiplexed, auto-reconnecting connections (redis-rs `ConnectionManager`,
//!   one per thread that uses the store; or the shared cluster connection), each bounded by
//!   `command_timeout`. Waiting never holds a connection.
//! - Every record of one operation is one key, `<prefix>{<hash>}`: one slot in a cluster.
//! - Redis down at startup is not fatal: commands fail with `Unavailable` (and readiness says
//!   so) until it is reachable; no restart is needed when it comes back.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Script, Value};
use tokio::sync::OnceCell;
use tokio::task::AbortHandle;

use super::codec;
use super::wait::{Subscription, Waiters};
use super::{
    ms_after, now_ms, OwnerToken, Record, RecordState, Reservation, Store, StoreError,
    StoredResponse, UnknownReason,
};
use crate::config::{RedisSettings, RedisTarget};
use crate::fingerprint::Fingerprint;
use crate::key::StoreKey;

/// Checks that KEYS[1] is pending and owned by ARGV[1]; every owner-only script starts with it.
const OWNED: &str = r"
local v = redis.call('GET', KEYS[1])
if (not v) or string.byte(v, 2) ~= 1 or string.sub(v, 43, 58) ~= ARGV[1] then return 0 end
";

fn owner_script(body: &str) -> Script {
    script(&format!("{OWNED}{body}"))
}

/// A script whose `{ANNOUNCE}` placeholder is replaced by [`ANNOUNCE`].
fn script(body: &str) -> Script {
    Script::new(&body.replace("{ANNOUNCE}", ANNOUNCE))
}

/// Announces the end of pending record `v`, only if a waiter flagged it (a byte past the pending
/// length, set by `get_watched`): with no one waiting, as for almost every request, nothing is
/// published. The flag is read from the record the script already holds; a separate flag key
/// cost one more `redis.call` per completion, about a quarter of the script.
const ANNOUNCE: &str = "if #v > 66 then redis.call('PUBLISH', ARGV[#ARGV - 1], ARGV[#ARGV]) end\n";

/// Every script takes one key, KEYS[1], the record. Offsets and the pending length (66) are the
/// codec's: see [`codec::PENDING_LEN`].
struct Scripts {
    /// ARGV: owner, completed tail, ttl ms, channel, message.
    complete: Script,
    /// ARGV: owner, unknown tail, channel, message.
    mark_unknown: Script,
    /// ARGV: owner, new lease (8 bytes). Keeps a waiter's flag.
    renew: Script,
    /// ARGV: owner, channel, message.
    release: Script,
    /// ARGV: channel, message.
    delete: Script,
    /// ARGV: expected record, new record, ttl ms. A waiter's flag on the expected record is not
    /// a change: it is kept on the new one.
    take_over: Script,
    /// No ARGV. The record as it was; if it is pending, also flags it as waited on.
    get_watched: Script,
}

impl Scripts {
    fn new() -> Self {
        Scripts {
            complete: owner_script(
                r"redis.call('SET', KEYS[1], string.sub(v, 1, 1) .. '\2' .. string.sub(v, 3, 42) .. ARGV[2], 'PX', ARGV[3])
{ANNOUNCE}return 1",
            ),
            mark_unknown: owner_script(
                r"redis.call('SET', KEYS[1], string.sub(v, 1, 1) .. '\3' .. string.sub(v, 3, 42) .. ARGV[2], 'KEEPTTL')
{ANNOUNCE}return 1",
            ),
            renew: owner_script(
                r"redis.call('SET', KEYS[1], string.sub(v, 1, 58) .. ARGV[2] .. string.sub(v, 67), 'KEEPTTL')
return 1",
            ),
            release: owner_script(
                r"redis.call('DEL', KEYS[1])
{ANNOUNCE}return 1",
            ),
            delete: script(
                r"local v = redis.call('GET', KEYS[1])
if not v then return 0 end
redis.call('DEL', KEYS[1])
if string.byte(v, 2) == 1 then
{ANNOUNCE}end
return 1",
            ),
            take_over: Script::new(
                r"local v = redis.call('GET', KEYS[1])
if v ~= ARGV[1] and v ~= ARGV[1] .. '\1' then return 0 end
redis.call('SET', KEYS[1], ARGV[2] .. string.sub(v, #ARGV[1] + 1), 'PX', ARGV[3])
return 1",
            ),
            get_watched: Script::new(
                r"local v = redis.call('GET', KEYS[1])
if v and string.byte(v, 2) == 1 and #v == 66 then redis.call('SETRANGE', KEYS[1], 66, '\1') end
return v",
            ),
        }
    }
}

/// One connection handle for either deployment; cheap to clone (both are multiplexed).
#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// Connections to a single Redis, one per thread that uses the store.
///
/// A multiplexed connection is driven by a task on the runtime that first used it. Shared by the
/// gateway's worker threads, every command would hop to that one thread and back, and that thread
/// would carry all the Redis traffic; per thread, each worker talks to Redis on its own event
/// loop, and a worker that stops at shutdown takes no one else's connection with it. Redis sees
/// one connection per worker (plus one for readiness and one for pub/sub).
struct PerThread {
    client: redis::Client,
    config: ConnectionManagerConfig,
    /// Which store a thread's cached connection belongs to (a process may open several).
    id: u64,
    /// Cached connections of stores that were dropped are pruned when they are seen dead.
    alive: Arc<()>,
}

static NEXT_STORE_ID: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static THREAD_CONNECTIONS: RefCell<Vec<(u64, Weak<()>, ConnectionManager)>> =
        const { RefCell::new(Vec::new()) };
}

impl PerThread {
    fn connection(&self) -> Result<ConnectionManager, StoreError> {
        THREAD_CONNECTIONS.with(|cell| {
            let mut cached = cell.borrow_mut();
            if let Some((_, _, c)) = cached.iter().find(|(id, _, _)| *id == self.id) {
                return Ok(c.clone());
            }
            cached.retain(|(_, alive, _)| alive.strong_count() > 0);
            let c =
                ConnectionManager::new_lazy_with_config(self.client.clone(), self.config.clone())
                    .map_err(|e| StoreError::Unavailable(format!("connect: {e}")))?;
            cached.push((self.id, Arc::downgrade(&self.alive), c.clone()));
            Ok(c)
        })
    }
}

pub struct RedisStore {
    /// A single Redis: one connection per thread (see [`PerThread`]).
    single: Option<PerThread>,
    /// A cluster: one shared connection, set once the cluster answers.
    conn: Arc<OnceCell<Conn>>,
    /// Shared with a [`ReleaseOnDrop`] guard, which builds its strings only when it fires.
    prefix: Arc<str>,
    channel: Arc<str>,
    timeout: Duration,
    waiters: Waiters,
    scripts: Arc<Scripts>,
    /// Background tasks (cluster connect, pub/sub listener), stopped with the store.
    tasks: Vec<AbortHandle>,
    /// Whether the pub/sub subscriber is listening now (see [`RedisStore::is_subscribed`]).
    subscribed: Arc<AtomicBool>,
}

#[derive(Debug, thiserror::Error)]
#[error("invalid Redis URL: {0}")]
pub struct RedisUrlError(String);

impl RedisStore {
    /// Creates the store. Never waits for Redis: connections are made in the background.
    pub fn new(settings: &RedisSettings) -> Result<Self, RedisUrlError> {
        let conn = Arc::new(OnceCell::new());
        let waiters = Waiters::new();
        let channel = format!("{}done", settings.key_prefix);
        let mut tasks = Vec::new();
        let mut single = None;
        let timeout = settings.command_timeout;
        let certs = match &settings.tls_ca_file {
            None => None,
            Some(path) => Some(redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(std::fs::read(path).map_err(|e| {
                    RedisUrlError(format!("cannot read tls_ca_file {}: {e}", path.display()))
                })?),
            }),
        };
        let open = |url: &str| -> Result<redis::Client, RedisUrlError> {
            match &certs {
                None => redis::Client::open(url),
                Some(c) => redis::Client::build_with_tls(url, c.clone()),
            }
            .map_err(|e| RedisUrlError(e.to_string()))
        };
        let subscriber_client = match &settings.target {
            RedisTarget::Single(url) => {
                let client = open(url)?;
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(timeout.max(Duration::from_secs(1))))
                    // No response timeout of its own: `call` bounds every command by
                    // `command_timeout` already, and a second timer per command is work for
                    // nothing (it never triggered a reconnect either).
                    .set_response_timeout(None)
                    .set_number_of_retries(2)
                    .set_max_delay(Duration::from_secs(1));
                // Fails here, not per thread later, if the settings are unusable.
                ConnectionManager::new_lazy_with_config(client.clone(), config.clone())
                    .map_err(|e| RedisUrlError(e.to_string()))?;
                single = Some(PerThread {
                    client: client.clone(),
                    config,
                    id: NEXT_STORE_ID.fetch_add(1, Ordering::Relaxed),
                    alive: Arc::new(()),
                });
                client
            }
            RedisTarget::Cluster(nodes) => {
                let mut builder =
                    redis::cluster::ClusterClientBuilder::new(nodes.iter().map(String::as_str))
                        .connection_timeout(timeout.max(Duration::from_secs(1)))
                        .response_timeout(timeout);
                if let Some(c) = &certs {
                    builder = builder.certs(c.clone());
                }
                let cluster = builder.build().map_err(|e| RedisUrlError(e.to_string()))?;
                tasks
                    .push(tokio::spawn(connect_cluster(cluster, Arc::clone(&conn))).abort_handle());
                open(nodes.first().map(String::as_str).unwrap_or_default())?
            }
        };
        let subscribed = Arc::new(AtomicBool::new(false));
        tasks.push(
            tokio::spawn(listen(
                subscriber_client,
                channel.clone(),
                waiters.clone(),
                Arc::clone(&subscribed),
            ))
            .abort_handle(),
        );
        Ok(RedisStore {
            single,
            conn,
            prefix: settings.key_prefix.as_str().into(),
            channel: channel.as_str().into(),
            timeout,
            waiters,
            scripts: Arc::new(Scripts::new()),
            tasks,
            subscribed,
        })
    }

    /// Whether the pub/sub subscriber is listening: until it is, waiters learn of results only
    /// from their once-a-second re-read (and all of them re-read when it starts listening).
    pub fn is_subscribed(&self) -> bool {
        self.subscribed.load(Ordering::Acquire)
    }

    fn redis_key(&self, key: &StoreKey) -> Vec<u8> {
        record_key(&self.prefix, key)
    }

    fn conn(&self) -> Result<Conn, StoreError> {
        if let Some(single) = &self.single {
            return single.connection().map(Conn::Single);
        }
        self.conn
            .get()
            .cloned()
            .ok_or_else(|| StoreError::Unavailable("not connected to the Redis cluster yet".into()))
    }

    /// Runs one Redis call within `command_timeout`.
    async fn call<T>(
        &self,
        what: &str,
        fut: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(self.timeout, fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(StoreError::Unavailable(format!("{what}: {e}"))),
            Err(_) => Err(StoreError::Unavailable(format!(
                "{what}: no answer within {:?}",
                self.timeout
            ))),
        }
    }

    /// Runs an owner-only script: 1 = done, 0 = not the owner.
    async fn owned(
        &self,
        what: &str,
        script: &Script,
        key: &StoreKey,
        args: &[&[u8]],
    ) -> Result<(), StoreError> {
        let mut conn = self.conn()?;
        let done: i64 = self
            .call(what, eval(&mut conn, script, &self.redis_key(key), args))
            .await?;
        if done == 1 {
            Ok(())
        } else {
            Err(StoreError::NotOwner)
        }
    }
}

impl Drop for RedisStore {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// `<prefix>{<hex>}`, built by hand: `format!` cost more than the command it names.
fn record_key(prefix: &str, key: &StoreKey) -> Vec<u8> {
    let mut out = Vec::with_capacity(prefix.len() + 66);
    out.extend_from_slice(prefix.as_bytes());
    out.push(b'{');
    out.extend_from_slice(&key.hex_digits());
    out.push(b'}');
    out
}

/// `EVALSHA` of a script on its one key (every script here takes the record, KEYS[1]) with
/// `args`, loading the script first if Redis does not know it (a restarted or new Redis). Built
/// as one command, where redis-rs's `ScriptInvocation` copies every key and argument into a
/// vector of its own first.
async fn eval<T: redis::FromRedisValue>(
    conn: &mut Conn,
    script: &Script,
    key: &[u8],
    args: &[&[u8]],
) -> redis::RedisResult<T> {
    let size = 80 + key.len() + args.iter().map(|a| a.len() + 16).sum::<usize>();
    let mut cmd = Cmd::with_capacity(4 + args.len(), size);
    cmd.arg("EVALSHA").arg(script.get_hash()).arg(1).arg(key);
    for a in args {
        cmd.arg(*a);
    }
    match cmd.query_async(conn).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            script.load_async(conn).await?;
            cmd.query_async(conn).await
        }
        other => other,
    }
}

/// A record as Redis returned it (`nil`: none).
fn decode_reply(raw: Option<Vec<u8>>) -> Result<Option<Record>, StoreError> {
    raw.map(|r| codec::decode(&Bytes::from(r))).transpose()
}

/// Releases a reservation whose answer was lost, unless disarmed: see [`RedisStore::reserve`].
struct ReleaseOnDrop {
    armed: Option<Armed>,
}

/// Everything the release needs, owned, as it may run after the store call is gone. Cheap to
/// build (nearly every guard is disarmed): the strings are made only when it fires.
struct Armed {
    scripts: Arc<Scripts>,
    prefix: Arc<str>,
    channel: Arc<str>,
    conn: Conn,
    key: StoreKey,
    owner: OwnerToken,
}

impl ReleaseOnDrop {
    fn new(store: &RedisStore, key: &StoreKey, owner: OwnerToken, conn: Conn) -> Self {
        ReleaseOnDrop {
            armed: Some(Armed {
                scripts: Arc::clone(&store.scripts),
                prefix: Arc::clone(&store.prefix),
                channel: Arc::clone(&store.channel),
                conn,
                key: *key,
                owner,
            }),
        }
    }

    fn disarm(mut self) {
        self.armed = None;
    }
}

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        let Some(Armed {
            scripts,
            prefix,
            channel,
            mut conn,
            key,
            owner,
        }) = self.armed.take()
        else {
            return;
        };
        // Best effort, in the background: if Redis is unreachable the record keeps its lease
        // and then reads as an unknown outcome, which is the safe side.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let args: [&[u8]; 3] = [
                    &codec::owner_bytes(owner),
                    channel.as_bytes(),
                    &key.hex_digits(),
                ];
                let released: redis::RedisResult<i64> = tokio::time::timeout(
                    Duration::from_secs(5),
                    eval(
                        &mut conn,
                        &scripts.release,
                        &record_key(&prefix, &key),
                        &args,
                    ),
                )
                .await
                .unwrap_or_else(|_| Err((redis::ErrorKind::Io, "release timed out").into()));
                if let Ok(1) = released {
                    tracing::info!("released a reservation whose answer was lost");
                }
            });
        }
    }
}

/// Keeps trying to reach the cluster until it answers once; the connection then reconnects by
/// itself.
async fn connect_cluster(client: redis::cluster::ClusterClient, cell: Arc<OnceCell<Conn>>) {
    let mut backoff = Duration::from_millis(100);
    loop {
        match client.get_async_connection().await {
            Ok(c) => {
                let _ = cell.set(Conn::Cluster(c));
                tracing::info!("connected to the Redis cluster");
                return;
            }
            Err(e) => tracing::warn!(error = %e, "cannot reach the Redis cluster yet; retrying"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

/// The pub/sub subscriber: turns "key done" messages into local wake-ups.
async fn listen(
    client: redis::Client,
    channel: String,
    waiters: Waiters,
    subscribed: Arc<AtomicBool>,
) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let connected = tokio::time::timeout(Duration::from_secs(5), async {
            let mut ps = client.get_async_pubsub().await?;
            ps.subscribe(&channel).await?;
            Ok::<_, redis::RedisError>(ps)
        })
        .await;
        match connected {
            Ok(Ok(mut ps)) => {
                backoff = Duration::from_millis(100);
                // Anything published while we were not subscribed is lost: re-check everyone.
                waiters.notify_all();
                subscribed.store(true, Ordering::Release);
                let mut messages = ps.on_message();
                while let Some(msg) = messages.next().await {
                    if let Some(key) = std::str::from_utf8(msg.get_payload_bytes())
                        .ok()
                        .and_then(StoreKey::from_hex)
                    {
                        waiters.notify(&key);
                    }
                }
                subscribed.store(false, Ordering::Release);
                tracing::warn!("Redis pub/sub connection lost; reconnecting");
            }
            Ok(Err(e)) => tracing::warn!(error = %e, "cannot subscribe to Redis; retrying"),
            Err(_) => tracing::warn!("Redis subscription timed out; retrying"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

fn ms_arg(d: Duration) -> u64 {
    d.as_millis().clamp(1, u64::MAX as u128) as u64
}

#[async_trait]
impl Store for RedisStore {
    async fn reserve(
        &self,
        key: &StoreKey,
        fingerprint: Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Reservation, StoreError> {
        let (owner, record) = super::pending(fingerprint, lease);
        let record = codec::encode(&record);
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
        let guard = ReleaseOnDrop::new(self, key, owner, conn.clone());
        let existing: Option<Vec<u8>> = self.call("reserve", cmd.query_async(&mut conn)).await?;
        guard.disarm();
        match existing {
            None => Ok(Reservation::Owner(owner)),
            Some(raw) => Ok(Reservation::Existing(codec::decode(&Bytes::from(raw))?)),
        }
    }

    async fn get(&self, key: &StoreKey) -> Result<Option<Record>, StoreError> {
        let mut conn = self.conn()?;
        let mut cmd = redis::cmd("GET");
        cmd.arg(self.redis_key(key));
        let raw: Option<Vec<u8>> = self.call("get", cmd.query_async(&mut conn)).await?;
        decode_reply(raw)
    }

    async fn get_watched(&self, key: &StoreKey) -> Result<Option<Record>, StoreError> {
        let mut conn = self.conn()?;
        let raw: Option<Vec<u8>> = self
            .call(
                "get",
                eval(
                    &mut conn,
                    &self.scripts.get_watched,
                    &self.redis_key(key),
                    &[],
                ),
            )
            .await?;
        decode_reply(raw)
    }

    async fn complete(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        response: StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let tail = codec::encode_state(&RecordState::Completed(Arc::new(response)));
        let ttl = ms_arg(ttl).to_string();
        self.owned(
            "complete",
            &self.scripts.complete,
            key,
            &[
                &codec::owner_bytes(owner),
                &tail,
                ttl.as_bytes(),
                self.channel.as_bytes(),
                &key.hex_digits(),
            ],
        )
        .await
    }

    async fn mark_unknown(
        &self,
        key: &StoreKey,
        owner: OwnerToken,
        reason: UnknownReason,
    ) -> Result<(), StoreError> {
        let tail = codec::encode_state(&RecordState::Unknown {
            since_ms: now_ms(),
            reason,
        });
        self.owned(
            "mark_unknown",
            &self.scripts.mark_unknown,
            key,
            &[
                &codec::owner_bytes(owner),
                &tail,
                self.channel.as_bytes(),
                &key.hex_digits(),
            ],
        )
        .await
    }

    async fn release(&self, key: &StoreKey, owner: OwnerToken) -> Result<(), StoreError> {
        self.owned(
            "release",
            &self.scripts.release,
            key,
            &[
                &codec::owner_bytes(owner),
                self.channel.as_bytes(),
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
            "renew",
            &self.scripts.renew,
            key,
            &[&codec::owner_bytes(owner), &lease_until],
        )
        .await
    }

    async fn take_over(
        &self,
        key: &StoreKey,
        expected: &Record,
        fingerprint: Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Option<OwnerToken>, StoreError> {
        // The codec is deterministic, so the expected record encodes to the stored bytes (but for
        // a waiter's flag byte, which the script accepts and keeps).
        let expected = codec::encode(expected);
        let (owner, record) = super::pending(fingerprint, lease);
        let record = codec::encode(&record);
        let mut conn = self.conn()?;
        let ttl = ms_arg(ttl).to_string();
        let args: [&[u8]; 3] = [&expected, &record, ttl.as_bytes()];
        let guard = ReleaseOnDrop::new(self, key, owner, conn.clone());
        let done: i64 = self
            .call(
                "take_over",
                eval(
                    &mut conn,
                    &self.scripts.take_over,
                    &self.redis_key(key),
                    &args,
                ),
            )
            .await?;
        guard.disarm();
        Ok((done == 1).then_some(owner))
    }

    async fn delete(&self, key: &StoreKey) -> Result<bool, StoreError> {
        let mut conn = self.conn()?;
        let args: [&[u8]; 2] = [self.channel.as_bytes(), &key.hex_digits()];
        let n: i64 = self
            .call(
                "delete",
                eval(&mut conn, &self.scripts.delete, &self.redis_key(key), &args),
            )
            .await?;
        Ok(n == 1)
    }

    fn subscribe(&self, key: &StoreKey) -> Subscription {
        self.waiters.subscribe(key)
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
}
