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
//! - Redis down at startup is not fatal: commands fail with `Unavailable` (and readiness says
//!   so) until it is reachable; no restart is needed when it comes back.

mod conn;
mod safety;
mod scripts;
mod subscriber;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use redis::aio::ConnectionManagerConfig;
use redis::Script;
use tokio::sync::OnceCell;
use tokio::task::AbortHandle;

use self::conn::{eval, Connector, HandleConn, RedisConn};
use self::safety::{Eviction, Safety};
use self::scripts::Scripts;
use super::changes::Waiters;
use super::codec;
use super::{
    ms_after, now_ms, OpenError, OwnerToken, Readiness, Record, RecordState, Reservation, Store,
    StoreError, StoreStats, StoredResponse, UnknownReason, Watch,
};
use crate::config::{RedisSettings, RedisTarget};
use crate::fingerprint::Fingerprint;
use crate::key::StoreKey;

/// A handle to the store: the state every handle shares, and this handle's connection.
pub struct RedisStore {
    shared: Arc<Shared>,
    /// `Err` only if a worker's lazy connection could not even be set up (settings that worked
    /// at open); every call then answers `Unavailable`.
    conn: Result<HandleConn, StoreError>,
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
}

impl Drop for Shared {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// The CA and client certificate `settings` name, read from their files; `None` without TLS
/// files (a `rediss://` URL then trusts the system's roots).
pub fn certificates(settings: &RedisSettings) -> Result<Option<redis::TlsCertificates>, OpenError> {
    let read = |path: &std::path::PathBuf| {
        std::fs::read(path).map_err(|source| OpenError::TlsCaFile {
            path: path.clone(),
            source,
        })
    };
    let client_tls = match &settings.tls_client {
        None => None,
        Some((cert, key)) => Some(redis::ClientTlsConfig {
            client_cert: read(cert)?,
            client_key: read(key)?,
        }),
    };
    let root_cert = settings.tls_ca_file.as_ref().map(read).transpose()?;
    Ok(
        (client_tls.is_some() || root_cert.is_some()).then_some(redis::TlsCertificates {
            client_tls,
            root_cert,
        }),
    )
}

/// A client of the single Redis at `url`, with `certs` for TLS.
pub fn client(
    url: &str,
    certs: Option<&redis::TlsCertificates>,
) -> Result<redis::Client, OpenError> {
    match certs {
        None => redis::Client::open(url),
        Some(c) => redis::Client::build_with_tls(url, c.clone()),
    }
    .map_err(|e| OpenError::RedisUrl(e.to_string()))
}

impl RedisStore {
    /// Creates the store. Never waits for Redis: connections are made in the background.
    pub fn new(settings: &RedisSettings) -> Result<Self, OpenError> {
        let waiters = Waiters::new();
        let channel = format!("{}done", settings.key_prefix);
        let mut tasks = Vec::new();
        let timeout = settings.command_timeout;
        let certs = certificates(settings)?;
        let open = |url: &str| client(url, certs.as_ref());
        let (connector, subscriber_client) = match &settings.target {
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
                let connector = Connector::Single {
                    client: client.clone(),
                    config,
                };
                (connector, client)
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
                (Connector::Cluster(cell), first)
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
        tasks.push(
            tokio::spawn(safety::watch(checker, Arc::clone(&safety), timeout)).abort_handle(),
        );
        let subscribed = Arc::new(AtomicBool::new(false));
        tasks.push(
            tokio::spawn(subscriber::listen(
                subscriber_client,
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
            }),
            conn: Ok(conn),
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
        match tokio::time::timeout(self.shared.timeout, fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(StoreError::Unavailable(format!("{what}: {e}"))),
            Err(_) => Err(StoreError::Unavailable(format!(
                "{what}: no answer within {:?}",
                self.shared.timeout
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

/// `<prefix>{<hex>}`, built by hand: `format!` cost more than the command it names.
fn record_key(prefix: &str, key: &StoreKey) -> Vec<u8> {
    let mut out = Vec::with_capacity(prefix.len() + 66);
    out.extend_from_slice(prefix.as_bytes());
    out.push(b'{');
    out.extend_from_slice(&key.hex_digits());
    out.push(b'}');
    out
}

/// A record as Redis returned it, as the contract returns it (its lease checked).
fn decode(raw: Vec<u8>) -> Result<Record, StoreError> {
    Ok(codec::decode(&Bytes::from(raw))?.checked_lease())
}

/// [`decode`] of a reply that may be `nil` (no record).
fn decode_reply(raw: Option<Vec<u8>>) -> Result<Option<Record>, StoreError> {
    raw.map(decode).transpose()
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
    conn: RedisConn,
    key: StoreKey,
    owner: OwnerToken,
}

impl ReleaseOnDrop {
    fn new(store: &RedisStore, key: &StoreKey, owner: OwnerToken, conn: RedisConn) -> Self {
        ReleaseOnDrop {
            armed: Some(Armed {
                scripts: Arc::clone(&store.shared.scripts),
                prefix: Arc::clone(&store.shared.prefix),
                channel: Arc::clone(&store.shared.channel),
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
        if self.shared.require_noeviction && self.shared.safety.eviction() != Eviction::Safe {
            // Records already there are still answered; only new ones are not made.
            return match self.get(key).await? {
                Some(record) => Ok(Reservation::Existing(record)),
                None => Err(StoreError::Unsafe(
                    "Redis is not known to keep records (store.require_noeviction): its maxmemory-policy is not noeviction, or cannot be read yet".into(),
                )),
            };
        }
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
            Some(raw) => Ok(Reservation::Existing(decode(raw)?)),
        }
    }

    async fn get(&self, key: &StoreKey) -> Result<Option<Record>, StoreError> {
        let mut conn = self.conn()?;
        let mut cmd = redis::cmd("GET");
        cmd.arg(self.redis_key(key));
        let raw: Option<Vec<u8>> = self.call("get", cmd.query_async(&mut conn)).await?;
        decode_reply(raw)
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
            record: decode_reply(raw)?,
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
        let tail = codec::encode_state(&RecordState::Completed(Arc::new(response)));
        let ttl = ms_arg(ttl).to_string();
        self.owned(
            "complete",
            &self.shared.scripts.complete,
            key,
            &[
                &codec::owner_bytes(owner),
                &tail,
                ttl.as_bytes(),
                self.shared.channel.as_bytes(),
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
            "release",
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
            "renew",
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
                    &self.shared.scripts.take_over,
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
        let args: [&[u8]; 2] = [self.shared.channel.as_bytes(), &key.hex_digits()];
        let n: i64 = self
            .call(
                "delete",
                eval(
                    &mut conn,
                    &self.shared.scripts.delete,
                    &self.redis_key(key),
                    &args,
                ),
            )
            .await?;
        Ok(n == 1)
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

    fn stats(&self) -> StoreStats {
        // Redis expires records itself.
        StoreStats {
            eviction_policy: self.shared.safety.policy(),
            ..StoreStats::default()
        }
    }

    fn readiness(&self) -> Readiness {
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
            conn: self.shared.connector.handle(),
        })
    }
}
