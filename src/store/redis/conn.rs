//! Connections to Redis: clients with their TLS files; one multiplexed connection per worker on
//! a single Redis, one shared connection to a cluster; and `EVALSHA` with its fallback.
//!
//! A multiplexed connection is driven by a task on the runtime that first used it. Shared by the
//! gateway's worker threads, every command would hop to that one thread and back, and that
//! thread would carry all the Redis traffic; so on a single Redis each worker gets a connection
//! of its own ([`crate::store::Store::for_worker`]) and talks to Redis on its own event loop,
//! and a worker that stops at shutdown takes no one else's connection with it. Redis sees one
//! connection per worker, plus one for readiness and one for pub/sub.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Script, Value};
use tokio::sync::OnceCell;

use super::sentinel::Follower;
use crate::config::RedisSettings;
use crate::key::StoreKey;
use crate::store::{OpenError, StoreError};

/// One connection handle for either deployment; cheap to clone (both are multiplexed).
#[derive(Clone)]
pub enum RedisConn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            RedisConn::Single(c) => c.req_packed_command(cmd),
            RedisConn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            RedisConn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            RedisConn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConn::Single(c) => c.get_db(),
            RedisConn::Cluster(c) => c.get_db(),
        }
    }
}

/// How a store handle gets connections: the deployment, as the store was opened.
// One per store, made once: the size of the single variant costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum Connector {
    /// A single Redis: each handle makes its own connection, lazily, on first use.
    Single {
        client: redis::Client,
        config: ConnectionManagerConfig,
        /// Connections per handle ([`Lanes`]).
        lanes: usize,
    },
    /// A cluster: one shared connection, set once the cluster first answers
    /// ([`connect_cluster`]).
    Cluster(Arc<OnceCell<RedisConn>>),
    /// The primary the sentinels name: each handle connects to it, and again when it moves.
    Sentinel(Arc<Follower>),
}

/// One handle's connection.
pub enum HandleConn {
    Single(Lanes),
    Cluster(Arc<OnceCell<RedisConn>>),
    /// The connections to the primary of a generation, made on first use after it moved.
    Sentinel {
        follower: Arc<Follower>,
        mine: Mutex<Option<(u64, Arc<Lanes>)>>,
    },
}

/// A handle's connections to one Redis, taken in turn: one, or with `store.min_replicas`
/// several, since a `WAIT` holds up every command queued behind it on its connection.
pub struct Lanes {
    first: ConnectionManager,
    rest: Vec<ConnectionManager>,
    next: AtomicUsize,
}

impl Lanes {
    fn new(
        client: &redis::Client,
        config: &ConnectionManagerConfig,
        lanes: usize,
    ) -> Result<Lanes, StoreError> {
        let connect = || {
            ConnectionManager::new_lazy_with_config(client.clone(), config.clone())
                .map_err(|e| StoreError::Unavailable(format!("connect: {e}")))
        };
        Ok(Lanes {
            first: connect()?,
            rest: (1..lanes).map(|_| connect()).collect::<Result<_, _>>()?,
            next: AtomicUsize::new(0),
        })
    }

    fn pick(&self) -> RedisConn {
        if self.rest.is_empty() {
            return RedisConn::Single(self.first.clone());
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed) % (self.rest.len() + 1);
        let conn = i
            .checked_sub(1)
            .and_then(|i| self.rest.get(i))
            .unwrap_or(&self.first);
        RedisConn::Single(conn.clone())
    }
}

impl Connector {
    /// A connection for a new handle, made on the runtime that will use it (redis-rs starts its
    /// driver there); it connects on first use.
    pub fn handle(&self) -> Result<HandleConn, StoreError> {
        match self {
            Connector::Single {
                client,
                config,
                lanes,
            } => Lanes::new(client, config, *lanes).map(HandleConn::Single),
            Connector::Cluster(cell) => Ok(HandleConn::Cluster(Arc::clone(cell))),
            Connector::Sentinel(follower) => Ok(HandleConn::Sentinel {
                follower: Arc::clone(follower),
                mine: Mutex::new(None),
            }),
        }
    }

    /// Told of a failed command: with Sentinel, the primary may have moved.
    pub fn failed(&self, e: Option<&redis::RedisError>) {
        if let Connector::Sentinel(follower) = self {
            follower.failed(e);
        }
    }
}

impl HandleConn {
    pub fn get(&self) -> Result<RedisConn, StoreError> {
        match self {
            HandleConn::Single(lanes) => Ok(lanes.pick()),
            HandleConn::Cluster(cell) => cell.get().cloned().ok_or_else(|| {
                StoreError::Unavailable("not connected to the Redis cluster yet".into())
            }),
            HandleConn::Sentinel { follower, mine } => {
                let primary = follower.current().ok_or_else(|| {
                    StoreError::Unavailable("the sentinels have named no Redis primary yet".into())
                })?;
                let lanes = {
                    let mut mine = mine.lock().unwrap_or_else(PoisonError::into_inner);
                    match &*mine {
                        Some((generation, lanes)) if *generation == primary.generation => {
                            Arc::clone(lanes)
                        }
                        _ => {
                            let lanes = Arc::new(Lanes::new(
                                &primary.client,
                                &follower.config,
                                follower.lanes,
                            )?);
                            *mine = Some((primary.generation, Arc::clone(&lanes)));
                            lanes
                        }
                    }
                };
                Ok(lanes.pick())
            }
        }
    }
}

/// `EVALSHA` of a script on its one key (every script here takes the record, KEYS[1]) with
/// `args`, loading the script first if Redis does not know it (a restarted or new Redis). Built
/// as one command, where redis-rs's `ScriptInvocation` copies every key and argument into a
/// vector of its own first.
pub async fn eval<T: redis::FromRedisValue>(
    conn: &mut RedisConn,
    script: &Script,
    key: &[u8],
    args: &[&[u8]],
) -> redis::RedisResult<T> {
    let cmd = evalsha(script, key, args);
    match cmd.query_async(conn).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            script.load_async(conn).await?;
            cmd.query_async(conn).await
        }
        other => other,
    }
}

/// `EVALSHA` of `script` on `key` with `args`.
pub fn evalsha(script: &Script, key: &[u8], args: &[&[u8]]) -> Cmd {
    let size = 80 + key.len() + args.iter().map(|a| a.len() + 16).sum::<usize>();
    let mut cmd = Cmd::with_capacity(4 + args.len(), size);
    cmd.arg("EVALSHA").arg(script.get_hash()).arg(1).arg(key);
    for a in args {
        cmd.arg(*a);
    }
    cmd
}

/// Keeps trying to reach the cluster until it answers once; the connection then reconnects by
/// itself.
pub async fn connect_cluster(
    client: redis::cluster::ClusterClient,
    cell: Arc<OnceCell<RedisConn>>,
) {
    let mut backoff = Duration::from_millis(100);
    loop {
        match client.get_async_connection().await {
            Ok(c) => {
                let _ = cell.set(RedisConn::Cluster(c));
                tracing::info!("connected to the Redis cluster");
                return;
            }
            Err(e) => tracing::warn!(error = %e, "cannot reach the Redis cluster yet; retrying"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
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

/// A client for the store's commands to the single Redis at `url`: as [`client`], speaking
/// RESP3. A connection Redis closes (a restart, a failover) is then replaced at once: redis-rs
/// reconnects on the disconnection push, which only RESP3 carries, where with RESP2 the next
/// command would fail on the dead connection first (a 503 for its client). Needs Redis 6 or
/// later.
pub fn commands_client(
    url: &str,
    certs: Option<&redis::TlsCertificates>,
) -> Result<redis::Client, OpenError> {
    use redis::IntoConnectionInfo;
    let info = url
        .into_connection_info()
        .map_err(|e| OpenError::RedisUrl(e.to_string()))?;
    let resp3 = info
        .redis_settings()
        .clone()
        .set_protocol(redis::ProtocolVersion::RESP3);
    let info = info.set_redis_settings(resp3);
    match certs {
        None => redis::Client::open(info),
        Some(c) => redis::Client::build_with_tls(info, c.clone()),
    }
    .map_err(|e| OpenError::RedisUrl(e.to_string()))
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

/// How each handle's connection to a single Redis (or a Sentinel's primary) behaves.
pub(super) fn manager_config(timeout: Duration) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(timeout.max(Duration::from_secs(1))))
        // No response timeout of its own: `call` bounds every command by `command_timeout`
        // already, and a second timer per command is work for nothing (it never triggered a
        // reconnect either).
        .set_response_timeout(None)
        .set_number_of_retries(2)
        .set_max_delay(Duration::from_secs(1))
}

/// `<prefix>{<hex>}`, built by hand: `format!` cost more than the command it names.
pub(super) fn record_key(prefix: &str, key: &StoreKey) -> Vec<u8> {
    let mut out = Vec::with_capacity(prefix.len() + 66);
    out.extend_from_slice(prefix.as_bytes());
    out.push(b'{');
    out.extend_from_slice(&key.hex_digits());
    out.push(b'}');
    out
}
