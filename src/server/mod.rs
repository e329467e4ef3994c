//! The listener: accepts connections (HTTP/1.1 and h2c), hands requests to the gateway, and shuts
//! down gracefully.
//!
//! The runtime that calls [`Server::run`] accepts connections ([`acceptor`]) and hands each to
//! the least busy of `server.workers` threads, each running a single-threaded runtime
//! ([`worker`]); it also runs the consumers, the admin listener and the signals ([`reload`]).
//!
//! Shutdown order: readiness turns false, every worker stops accepting, lets its open connections
//! finish their requests (up to `shutdown_grace`), then waits for detached owner executions to
//! store their results, so nothing a client was promised is lost.

mod acceptor;
mod reconciling;
mod reload;
mod worker;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::admin::Operator;
use crate::config::{Config, ConsumerConfig, ServerConfig, StoreConfig};
use crate::consumer::{self as consumers, AnySource, BrokerHealth, ConsumerError};
use crate::gateway::{Gateway, GatewayParts, Routing};
use crate::jwt::Verifiers;
use crate::metrics::Metrics;
use crate::store;
use crate::store::seal::Sealer;
use crate::tls::{ListenerTls, ListenerTlsError};
use crate::upstream::{ConnectionLimits, PoolTimeouts, TlsSetupError, UpstreamTlsConnector};
use acceptor::{accept, WorkerHandle};
use worker::Worker;

pub use reload::{reload_on_sighup, shutdown_signal, Hangups};

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot open the store: {0}")]
    Store(#[from] store::OpenError),
    #[error("store.encryption_keys_*: {0}")]
    StoreKeys(#[from] store::seal::KeysError),
    #[error("cannot start the worker threads: {0}")]
    Workers(std::io::Error),
    #[error("{0}")]
    UpstreamTls(#[from] TlsSetupError),
    #[error("{0}")]
    ListenerTls(#[from] ListenerTlsError),
    #[error("{0}")]
    Consumer(#[from] ConsumerError),
    #[error("{0}")]
    AdminToken(#[from] crate::admin::TokenError),
    #[error("{0}")]
    Traces(#[from] crate::telemetry::traces::TracesError),
}

/// How long the spans still queued at shutdown may take to reach the collector.
const TRACES_FLUSH: std::time::Duration = std::time::Duration::from_secs(2);

/// A bound, not yet serving gateway.
pub struct Server {
    listener: TcpListener,
    admin: Option<TcpListener>,
    /// The operator API on the admin listener, if a token is configured.
    operator: Option<Arc<Operator>>,
    gateway: Arc<Gateway>,
    settings: ServerConfig,
    /// `[[consumers]]` and their sources, started with the workers.
    consumers: Vec<(ConsumerConfig, AnySource)>,
    /// TLS on the traffic listener, when configured.
    tls: Option<Arc<ListenerTls>>,
}

impl Server {
    /// Opens the store and binds the listeners. Must run inside a tokio runtime.
    pub async fn bind(config: Config) -> Result<Server, ServerError> {
        let bind = |addr: SocketAddr| async move {
            TcpListener::bind(addr)
                .await
                .map_err(|source| ServerError::Bind { addr, source })
        };
        let listener = bind(config.server.listen).await?;
        let admin = match config.server.admin {
            Some(addr) => Some(bind(addr).await?),
            None => None,
        };
        let operator = match &config.server.admin_token {
            Some(source) => Some(Arc::new(Operator::load(source, config.longest_ttl())?)),
            None => None,
        };
        let metrics = Arc::new(Metrics::new());
        let sealer = Sealer::configured(config.store_keys.as_ref())?;
        let store = store::open(&config.store, sealer.clone())?;
        // Half the shortest upstream_timeout: a connect attempt always fails before the request
        // could time out, so "not sent" is never mistaken for "unknown".
        let connect_timeout = config.shortest_upstream_timeout() / 2;
        let upstream_tls = UpstreamTlsConnector::new(&config.upstream_tls)?;
        let verifiers = Arc::new(Verifiers::new(
            Arc::clone(&upstream_tls),
            Arc::clone(&metrics),
        ));
        let traces = match &config.telemetry {
            Some(t) => Some(Arc::new(crate::telemetry::traces::Traces::from_config(t)?)),
            None => None,
        };
        let routing = Routing::new(
            config.routes,
            config.upstream,
            &config.defaults,
            &config.server,
            &verifiers,
        );
        let gateway = Arc::new(Gateway::new(GatewayParts {
            routing,
            store,
            metrics,
            pool_timeouts: PoolTimeouts {
                connect: connect_timeout,
                idle: config.upstream_idle_timeout,
            },
            upstream_limits: ConnectionLimits::new(config.upstream_max_connections),
            upstream_tls,
            max_buffered: config.server.max_buffered,
            verifiers,
            durable_store: !matches!(config.store, StoreConfig::Memory { .. }),
            traces,
            sealer,
        }));
        let sources = consumers::sources(&config.consumers)?;
        let consumers = config.consumers.into_iter().zip(sources).collect();
        let tls = match &config.server.tls {
            Some((cert, key)) => Some(Arc::new(ListenerTls::new(
                cert,
                key,
                config.server.tls_client_ca.as_deref(),
            )?)),
            None => None,
        };
        Ok(Server {
            listener,
            admin,
            operator,
            gateway,
            settings: config.server,
            consumers,
            tls,
        })
    }

    /// The admin listener's address, if one is configured.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin.as_ref().and_then(|l| l.local_addr().ok())
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().unwrap_or(self.settings.listen)
    }

    pub fn gateway(&self) -> &Arc<Gateway> {
        &self.gateway
    }

    /// The listener's TLS, for reloading its certificate.
    pub fn listener_tls(&self) -> Option<Arc<ListenerTls>> {
        self.tls.clone()
    }

    /// Serves until `shutdown` resolves, then drains. Returns once everything has finished or the
    /// grace period is over, or at once if the worker threads cannot start.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), ServerError> {
        let Server {
            listener,
            admin,
            operator,
            gateway,
            settings,
            consumers,
            tls,
        } = self;
        let (workers, mut all_done) = start_workers(&gateway, &settings, tls).await?;
        let policies = (consumers.iter())
            .map(|(c, _)| (c.name.clone(), c.policy.clone()))
            .collect();
        let consumers = start_consumers(consumers, &gateway, &settings);
        let reconciling = reconciling::start(&gateway, policies, consumers.stop.clone());
        let admin_task = admin.map(|l| {
            if let Ok(addr) = l.local_addr() {
                tracing::info!(%addr, operator_api = operator.is_some(), "admin listening (/healthz /readyz /metrics; /keys/{{id}} with operator_api)");
            }
            tokio::spawn(crate::admin::serve(
                l,
                Arc::clone(&gateway),
                Arc::clone(&consumers.brokers),
                operator,
                settings.deadlines,
            ))
        });
        tracing::info!(
            addr = %listener.local_addr().unwrap_or(settings.listen),
            workers = settings.workers,
            "idemgate listening"
        );
        let delay = settings.drain_delay;
        let signalled = async {
            shutdown.await;
            // Readiness turns false first, so load balancers stop sending; until they notice,
            // what they still send is accepted and served as usual.
            gateway.begin_shutdown();
            if !delay.is_zero() {
                tracing::info!(drain_delay = ?delay, "shutting down: /readyz is 503; still accepting for drain_delay");
                tokio::time::sleep(delay).await;
            }
        };
        accept(listener, &workers, &settings, signalled).await;

        gateway.begin_shutdown();
        tracing::info!(grace = ?settings.shutdown_grace, "shutting down: draining connections");
        // A WebSocket may stay open for hours: closed now (its client reconnects, to another
        // instance), so that it never holds the drain to the end of the grace.
        gateway.close_tunnels();
        // Closing the hand-off channels tells each worker to drain; the consumers stop reading
        // and finish the messages they hold.
        drop(workers);
        consumers.stop.cancel();
        // Owner executions may still start while connections drain; closing the tracker only
        // lets `wait` finish once none is left.
        gateway.tasks().close();
        let _ = all_done.recv().await;
        for task in consumers.tasks {
            let _ = task.await;
        }
        if !gateway.tasks().is_empty() {
            tracing::warn!(
                running = gateway.tasks().len(),
                "grace period over with upstream calls still running; their keys stay pending"
            );
        }
        // What the store answered but syncs later (the disk store with sync = "batch") reaches
        // the disk before the process exits.
        if let Err(e) = gateway.store().flush().await {
            tracing::error!(error = %e, "the store could not sync its last changes");
        }
        if let Some(t) = admin_task {
            t.abort();
        }
        if let Some(t) = reconciling {
            t.abort();
        }
        if let Some(traces) = gateway.traces() {
            // On a thread of its own: the exporter blocks while it sends.
            let traces = Arc::clone(traces);
            let _ = tokio::task::spawn_blocking(move || traces.shutdown(TRACES_FLUSH)).await;
        }
        tracing::info!("shut down");
        Ok(())
    }
}

/// Starts the worker threads. Returns their hand-off channels (dropping them makes the workers
/// drain and stop) and a receiver that ends once the last worker has stopped.
async fn start_workers(
    gateway: &Arc<Gateway>,
    settings: &ServerConfig,
    tls: Option<Arc<ListenerTls>>,
) -> Result<(Vec<WorkerHandle>, mpsc::Receiver<()>), ServerError> {
    // Every worker thread holds a `done` sender.
    let (done, all_done) = mpsc::channel::<()>(1);
    let mut workers = Vec::with_capacity(settings.workers);
    let mut started = Vec::with_capacity(settings.workers);
    for index in 0..settings.workers {
        let (handoff, incoming) = mpsc::unbounded_channel();
        let load = gateway.metrics().worker_connections(index);
        let worker = Worker {
            incoming,
            gateway: Arc::clone(gateway),
            grace: settings.shutdown_grace,
            deadlines: settings.deadlines,
            max_streams: settings.max_streams,
            max_header_bytes: settings.max_header_bytes,
            tls: tls.clone(),
            verify_clients: settings.tls_client_ca.is_some(),
            _done: done.clone(),
        };
        let (ready, is_ready) = oneshot::channel();
        std::thread::Builder::new()
            .name(format!("idemgate-worker-{index}"))
            .spawn(move || worker.run(ready))
            .map_err(ServerError::Workers)?;
        started.push(is_ready);
        workers.push(WorkerHandle { handoff, load });
    }
    for is_ready in started {
        match is_ready.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(ServerError::Workers(e)),
            Err(_) => {
                return Err(ServerError::Workers(std::io::Error::other(
                    "a worker thread ended while starting",
                )))
            }
        }
    }
    Ok((workers, all_done))
}

/// The running consumers: their brokers' health (for readiness), their tasks, and what stops
/// them.
struct Consumers {
    brokers: Arc<[Arc<BrokerHealth>]>,
    tasks: Vec<JoinHandle<()>>,
    stop: CancellationToken,
}

/// The consumers run on the server's runtime, beside the acceptor, each with its own pool and
/// store handle; readiness waits for each broker to answer.
fn start_consumers(
    consumers: Vec<(ConsumerConfig, AnySource)>,
    gateway: &Arc<Gateway>,
    settings: &ServerConfig,
) -> Consumers {
    let stop = CancellationToken::new();
    let mut brokers = Vec::with_capacity(consumers.len());
    let mut tasks = Vec::with_capacity(consumers.len());
    for (config, source) in consumers {
        let health = BrokerHealth::new(&config.name);
        brokers.push(Arc::clone(&health));
        tracing::info!(consumer = %config.name, source = %source.describe(), "consumer starting");
        let ctx = consumers::Context {
            core: Arc::clone(gateway.core()),
            store: gateway.store().for_worker(),
            metrics: Arc::clone(gateway.metrics()),
            pool: gateway.upstream_pool(),
            legacy: gateway.legacy(),
            traces: gateway.traces().cloned(),
        };
        tasks.push(tokio::spawn(consumers::supervise(
            config,
            source,
            AnySource::of,
            ctx,
            health,
            stop.clone(),
            settings.shutdown_grace,
        )));
    }
    Consumers {
        brokers: brokers.into(),
        tasks,
        stop,
    }
}

/// A gateway serving in the background: for tests and embedding.
pub struct Running {
    addr: SocketAddr,
    admin: Option<SocketAddr>,
    gateway: Arc<Gateway>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), ServerError>>,
}

impl Running {
    /// Binds and starts serving in a background task.
    pub async fn start(config: Config) -> Result<Running, ServerError> {
        let server = Server::bind(config).await?;
        let addr = server.local_addr();
        let admin = server.admin_addr();
        let gateway = Arc::clone(server.gateway());
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(server.run(async move {
            let _ = stopped.await;
        }));
        Ok(Running {
            addr,
            admin,
            gateway,
            stop: Some(stop),
            task,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn gateway(&self) -> &Arc<Gateway> {
        &self.gateway
    }

    /// The admin listener's address, when `[server] admin` is set.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin
    }

    /// Shuts down gracefully and waits until done.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.task).await;
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}
