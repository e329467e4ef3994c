//! Redis Sentinel: the primary found through the sentinels, and followed through failovers
//! without a restart.
//!
//! A task asks the sentinels for the primary named `master` (redis-rs's `SentinelClient`, which
//! also checks with `ROLE` that the node it is told of is a primary) every [`RECHECK`], and at
//! once when a sentinel announces a failover (`+switch-master`, heard on one sentinel's pub/sub)
//! or a command failed the way a failover makes commands fail (connection lost or refused,
//! `READONLY`, no answer). When the address changes, each handle connects to the new
//! primary on its next command ([`super::conn::HandleConn`]) and the pub/sub subscriber
//! subscribes there.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;
use futures_util::StreamExt;
use redis::aio::ConnectionManagerConfig;
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo, ProtocolVersion, TlsMode};
use tokio::sync::{watch, Notify};
use tokio_util::task::AbortOnDropHandle;

use crate::store::OpenError;

/// How often the sentinels are asked when nothing failed.
const RECHECK: Duration = Duration::from_secs(1);
/// Longest wait for the sentinels' answer.
const ASK_TIMEOUT: Duration = Duration::from_secs(5);

/// The primary as last found; shared by every handle of one store.
pub struct Follower {
    current: ArcSwapOption<Primary>,
    /// Bumped each time the primary moves.
    moved: watch::Sender<u64>,
    ask_now: Notify,
    /// For each handle's connections to the primary.
    pub config: ConnectionManagerConfig,
    /// Connections per handle (see [`super::conn::Lanes`]).
    pub lanes: usize,
}

/// One primary, as found: its client, and which one it is.
pub struct Primary {
    pub generation: u64,
    pub client: redis::Client,
}

impl Follower {
    pub fn current(&self) -> Option<Arc<Primary>> {
        self.current.load_full()
    }

    /// Changes each time the primary moves.
    pub fn moved(&self) -> watch::Receiver<u64> {
        self.moved.subscribe()
    }

    /// Whether `e` is how commands fail when the primary has moved: if so, ask the sentinels
    /// now rather than at the next recheck.
    pub fn failed(&self, e: Option<&redis::RedisError>) {
        let moved = e.is_none_or(|e| {
            e.is_io_error()
                || e.is_connection_dropped()
                || e.is_connection_refusal()
                || e.is_timeout()
                || e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly)
        });
        if moved {
            self.ask_now.notify_one();
        }
    }
}

/// What [`follow`] needs: the sentinels' client, and how to reach a primary they name.
pub struct Sentinels {
    client: SentinelClient,
    /// The first sentinel URL: the primary is reached with its credentials, database and TLS.
    template: ConnectionInfo,
    certs: Option<redis::TlsCertificates>,
    /// One client per sentinel, to hear `+switch-master` on.
    announcers: Vec<redis::Client>,
    /// Whether the primary is spoken to in RESP3 (the store's commands) or RESP2 (the streams').
    resp3: bool,
}

/// The sentinels of `urls`, watching `master`; a follower that knows no primary yet.
pub fn open(
    urls: &[String],
    master: &str,
    certs: Option<&redis::TlsCertificates>,
    (config, lanes): (ConnectionManagerConfig, usize),
    resp3: bool,
) -> Result<(Sentinels, Arc<Follower>), OpenError> {
    let bad = |e: redis::RedisError| OpenError::RedisUrl(e.to_string());
    let infos = urls
        .iter()
        .map(|u| u.as_str().into_connection_info())
        .collect::<Result<Vec<_>, _>>()
        .map_err(bad)?;
    let template = infos
        .first()
        .cloned()
        .ok_or_else(|| OpenError::RedisUrl("no sentinel".into()))?;
    let settings = template.redis_settings();
    let mut builder = SentinelClientBuilder::new(
        infos.iter().map(|i| i.addr().clone()),
        master,
        SentinelServerType::Master,
    )
    .map_err(bad)?
    .set_client_to_redis_db(settings.db())
    .set_client_to_redis_protocol(ProtocolVersion::RESP3);
    if let Some(user) = settings.username() {
        builder = builder
            .set_client_to_sentinel_username(user)
            .set_client_to_redis_username(user);
    }
    if let Some(password) = settings.password() {
        builder = builder
            .set_client_to_sentinel_password(password)
            .set_client_to_redis_password(password);
    }
    if matches!(template.addr(), ConnectionAddr::TcpTls { .. }) {
        builder = builder
            .set_client_to_sentinel_tls_mode(TlsMode::Secure)
            .set_client_to_redis_tls_mode(TlsMode::Secure);
    }
    if let Some(certs) = certs {
        builder = builder
            .set_client_to_sentinel_certificates(certs.clone())
            .set_client_to_redis_certificates(certs.clone());
    }
    let client = builder.build().map_err(bad)?;
    let announcers = infos
        .iter()
        .map(|info| match certs {
            None => redis::Client::open(info.clone()),
            Some(c) => redis::Client::build_with_tls(info.clone(), c.clone()),
        })
        .collect::<Result<_, _>>()
        .map_err(bad)?;
    let follower = Arc::new(Follower {
        current: ArcSwapOption::empty(),
        moved: watch::channel(0).0,
        ask_now: Notify::new(),
        config,
        lanes,
    });
    let sentinels = Sentinels {
        client,
        template,
        certs: certs.cloned(),
        announcers,
        resp3,
    };
    Ok((sentinels, follower))
}

/// Asks the sentinels for the primary until the store is dropped, and moves `follower` to
/// each new one.
pub async fn follow(mut sentinels: Sentinels, follower: Arc<Follower>) {
    let announcers = std::mem::take(&mut sentinels.announcers);
    let _hearing = AbortOnDropHandle::new(tokio::spawn(hear_switches(
        announcers,
        Arc::clone(&follower),
    )));
    let mut addr: Option<ConnectionAddr> = None;
    let mut unreachable_logged = false;
    loop {
        match tokio::time::timeout(ASK_TIMEOUT, sentinels.client.async_get_client()).await {
            Ok(Ok(found)) => {
                unreachable_logged = false;
                let found = found.get_connection_info().addr().clone();
                if addr.as_ref() != Some(&found) {
                    match sentinels.client_for(&found) {
                        Ok(client) => {
                            let generation = *follower.moved.borrow() + 1;
                            follower
                                .current
                                .store(Some(Arc::new(Primary { generation, client })));
                            follower.moved.send_replace(generation);
                            tracing::info!(primary = %found, "the sentinels name a new Redis primary");
                            addr = Some(found);
                        }
                        Err(e) => {
                            tracing::error!(error = %e, "cannot make a client for the Redis primary")
                        }
                    }
                }
            }
            failed => {
                if !unreachable_logged {
                    let error = match failed {
                        Ok(Err(e)) => e.to_string(),
                        _ => format!("no answer within {ASK_TIMEOUT:?}"),
                    };
                    tracing::warn!(%error, "the sentinels name no reachable Redis primary; asking again");
                    unreachable_logged = true;
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(RECHECK) => {}
            _ = follower.ask_now.notified() => {}
        }
    }
}

/// Wakes the follower at each `+switch-master` a sentinel announces, listening on one sentinel
/// at a time (the next one when it cannot be reached).
async fn hear_switches(announcers: Vec<redis::Client>, follower: Arc<Follower>) {
    for client in announcers.iter().cycle() {
        let subscribed = tokio::time::timeout(ASK_TIMEOUT, async {
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe("+switch-master").await?;
            Ok::<_, redis::RedisError>(pubsub)
        })
        .await;
        if let Ok(Ok(mut pubsub)) = subscribed {
            let mut announced = pubsub.on_message();
            while announced.next().await.is_some() {
                follower.ask_now.notify_one();
            }
        }
        tokio::time::sleep(RECHECK).await;
    }
}

impl Sentinels {
    /// A client of the primary at `addr`, with the first sentinel URL's credentials, database
    /// and TLS files (RESP3 for the store: see [`super::conn::commands_client`]).
    fn client_for(&self, addr: &ConnectionAddr) -> redis::RedisResult<redis::Client> {
        let protocol = if self.resp3 {
            ProtocolVersion::RESP3
        } else {
            ProtocolVersion::RESP2
        };
        let settings = self
            .template
            .redis_settings()
            .clone()
            .set_protocol(protocol);
        let info = self
            .template
            .clone()
            .set_addr(addr.clone())
            .set_redis_settings(settings);
        match &self.certs {
            None => redis::Client::open(info),
            Some(c) => redis::Client::build_with_tls(info, c.clone()),
        }
    }
}
