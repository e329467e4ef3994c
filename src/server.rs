//! The listener: accepts connections (HTTP/1.1 and h2c), hands requests to the gateway, and shuts
//! down gracefully.
//!
//! The runtime that calls [`Server::run`] accepts connections and hands each to the least busy of
//! `server.workers` threads, each running a single-threaded runtime (see [`Worker`]); it also
//! keeps the admin listener and signals.
//!
//! Shutdown order: readiness turns false, every worker stops accepting, lets its open connections
//! finish their requests (up to `shutdown_grace`), then waits for detached owner executions to
//! store their results, so nothing a client was promised is lost.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{Config, Deadlines, ServerConfig, CLIENT_SUBJECT_HEADER};

/// [`CLIENT_SUBJECT_HEADER`] as CGI, Rack and their kind would read it too.
const CLIENT_SUBJECT_UNDERSCORED: &str = "x_client_cert_subject";
const SUBJECT_LEN: usize = CLIENT_SUBJECT_HEADER.len();
const _: () = assert!(CLIENT_SUBJECT_UNDERSCORED.len() == SUBJECT_LEN);
use crate::config::ConsumerConfig;
use crate::conn::{self, ClientBody, ConnectionSlot};
use crate::consumer::{self as consumers, AnySource, BrokerHealth, ConsumerError};
use crate::gateway::{ClientConn, Gateway, GatewayParts, Routing, WorkerContext};
use crate::metrics::Metrics;
use crate::store;
use crate::tls::{ListenerTls, ListenerTlsError};
use crate::upstream::{ClientAddr, ConnectionLimits, TlsSetupError, UpstreamTlsConnector};
use http::{HeaderValue, Request};

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot open the store: {0}")]
    Store(#[from] store::OpenError),
    #[error("cannot start the worker threads: {0}")]
    Workers(std::io::Error),
    #[error("{0}")]
    UpstreamTls(#[from] TlsSetupError),
    #[error("{0}")]
    ListenerTls(#[from] ListenerTlsError),
    #[error("{0}")]
    Consumer(#[from] ConsumerError),
}

/// A bound, not yet serving gateway.
pub struct Server {
    listener: TcpListener,
    admin: Option<TcpListener>,
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
        let metrics = Arc::new(Metrics::new());
        let store = store::open(&config.store)?;
        // Half the shortest upstream_timeout: a connect attempt always fails before the request
        // could time out, so "not sent" is never mistaken for "unknown".
        let connect_timeout = config.shortest_upstream_timeout() / 2;
        let routing = Routing::new(
            config.routes,
            config.upstream,
            &config.defaults,
            config.server.case_sensitive_routes,
        );
        let gateway = Arc::new(Gateway::new(GatewayParts {
            routing,
            store,
            metrics,
            connect_timeout,
            upstream_limits: ConnectionLimits::new(config.upstream_max_connections),
            upstream_tls: UpstreamTlsConnector::new(&config.upstream_tls)?,
            max_buffered: config.server.max_buffered,
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
            gateway,
            settings,
            consumers,
            tls,
        } = self;
        // Every worker thread holds a `done` sender: `all_done` ends when the last one has stopped.
        let (done, mut all_done) = mpsc::channel::<()>(1);
        // The hand-off senders: dropping them (below, or with this future) makes the workers
        // drain and stop.
        let mut workers = Vec::with_capacity(settings.workers);
        let mut started = Vec::with_capacity(settings.workers);
        for index in 0..settings.workers {
            let (handoff, incoming) = mpsc::unbounded_channel();
            let load = gateway.metrics().worker_connections(index);
            let worker = Worker {
                incoming,
                gateway: Arc::clone(&gateway),
                grace: settings.shutdown_grace,
                deadlines: settings.deadlines,
                max_streams: settings.max_streams,
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
        drop(done);
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

        // The consumers run on this runtime, beside the acceptor, each with its own pool and
        // store handle; readiness waits for each broker to answer.
        let stop_consumers = CancellationToken::new();
        let mut brokers = Vec::with_capacity(consumers.len());
        let mut consumer_tasks = Vec::with_capacity(consumers.len());
        for (config, source) in consumers {
            let health = BrokerHealth::new(&config.name);
            brokers.push(Arc::clone(&health));
            tracing::info!(consumer = %config.name, source = %source.describe(), "consumer starting");
            let ctx = consumers::Context {
                core: Arc::clone(gateway.core()),
                store: gateway.store().for_worker(),
                metrics: Arc::clone(gateway.metrics()),
                pool: gateway.upstream_pool(),
            };
            consumer_tasks.push(tokio::spawn(consumers::run(
                config,
                source,
                ctx,
                health,
                stop_consumers.clone(),
                settings.shutdown_grace,
            )));
        }
        let brokers: Arc<[Arc<BrokerHealth>]> = brokers.into();
        let admin_task = admin.map(|l| {
            if let Ok(addr) = l.local_addr() {
                tracing::info!(%addr, "admin listening (/healthz /readyz /metrics)");
            }
            tokio::spawn(crate::admin::serve(
                l,
                Arc::clone(&gateway),
                Arc::clone(&brokers),
                settings.deadlines,
            ))
        });
        tracing::info!(
            addr = %listener.local_addr().unwrap_or(settings.listen),
            workers = settings.workers,
            "idemgate listening"
        );
        accept(listener, &workers, &settings, shutdown).await;

        // Readiness turns false first, so load balancers stop sending while we drain.
        gateway.begin_shutdown();
        tracing::info!(grace = ?settings.shutdown_grace, "shutting down: draining connections");
        // Closing the hand-off channels tells each worker to drain; the consumers stop reading
        // and finish the messages they hold.
        drop(workers);
        stop_consumers.cancel();
        // Owner executions may still start while connections drain; closing the tracker only
        // lets `wait` finish once none is left.
        gateway.tasks().close();
        let _ = all_done.recv().await;
        for task in consumer_tasks {
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
        tracing::info!("shut down");
        Ok(())
    }
}

/// Accepts until `shutdown` resolves, handing each connection to the least busy worker.
///
/// One acceptor rather than every worker accepting from the socket: whichever thread happened to
/// be awake would win most connections, and a keep-alive connection stays where it lands.
async fn accept(
    listener: TcpListener,
    workers: &[WorkerHandle],
    settings: &ServerConfig,
    shutdown: impl Future<Output = ()>,
) {
    let connections = Arc::new(Semaphore::new(settings.max_connections));
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            p = Arc::clone(&connections).acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => return,
            },
            () = &mut shutdown => return,
        };
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(conn) => conn,
                Err(e) => {
                    // Typically EMFILE: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => return,
        };
        let _ = stream.set_nodelay(true);
        // Moves to the worker's event loop; a failure here only loses this one connection.
        let stream = match stream.into_std() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, %peer, "cannot hand the connection to a worker");
                continue;
            }
        };
        let Some(worker) = workers.iter().min_by_key(|w| w.load.get()) else {
            return;
        };
        worker.load.inc();
        let accepted = Accepted {
            stream,
            peer,
            trusted: settings.is_trusted_proxy(peer.ip()),
            slot: ConnectionSlot::new(permit, worker.load.clone()),
        };
        if worker.handoff.send(accepted).is_err() {
            tracing::error!("a worker thread is gone; connection dropped");
        }
    }
}

/// The acceptor's side of a worker.
struct WorkerHandle {
    handoff: mpsc::UnboundedSender<Accepted>,
    /// Connections the worker is serving now (also exported as a metric).
    load: Gauge,
}

/// A connection on its way to, then served by, a worker.
struct Accepted {
    stream: std::net::TcpStream,
    peer: SocketAddr,
    /// From one of `server.trusted_proxies`.
    trusted: bool,
    slot: ConnectionSlot,
}

/// How far ahead a worker always has a timer armed: see [`heartbeat`].
const HEARTBEAT: Duration = Duration::from_millis(100);

/// How often a worker closes its upstream connections that sat idle too long.
const PRUNE_EVERY: u32 = 100;

/// Keeps a timer armed at most [`HEARTBEAT`] ahead on the worker's runtime, for ever; on every
/// beat closes idle upstream connections another request waits to take the slot of, and every
/// [`PRUNE_EVERY`] beats prunes the worker's idle upstream connections.
///
/// Registering a timer that runs out sooner than every timer already armed makes tokio wake the
/// event loop through its eventfd (a system call, and one more loop turn), in case it is asleep.
/// The timers a worker arms otherwise were hyper's 30 s header timers on idle connections, so the
/// lease renewal timer of every new key (a third of `lock_timeout`, 10 s by default) and every
/// Redis command's `command_timeout` (500 ms by default) were "sooner": about one eventfd write
/// for every four requests on the embedded store and every two on Redis, about 5 % of the CPU of
/// a new key. With this timer no request timer longer than `HEARTBEAT` is ever the soonest. The
/// cost is ten wake-ups a second per worker.
async fn heartbeat(worker: Arc<WorkerContext>) {
    let mut tick = tokio::time::interval(HEARTBEAT);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut beats = 0u32;
    loop {
        tick.tick().await;
        beats = beats.wrapping_add(1);
        worker.upstream.yield_idle();
        if beats.is_multiple_of(PRUNE_EVERY) {
            worker.upstream.prune_idle();
        }
    }
}

/// One worker thread: its own single-threaded runtime, serving the connections handed to it.
///
/// Like nginx's worker processes, each worker serves its connections start to finish, with its
/// own upstream pool: a request, its upstream connection and its owner execution (detached only
/// if its client goes away) all run on one thread, so the hot path needs no wake-ups across
/// threads.
struct Worker {
    incoming: mpsc::UnboundedReceiver<Accepted>,
    gateway: Arc<Gateway>,
    grace: Duration,
    deadlines: Deadlines,
    max_streams: u32,
    tls: Option<Arc<ListenerTls>>,
    /// `server.tls_client_ca` is set: the subject header is set from certificates only.
    verify_clients: bool,
    /// Dropped when the thread ends; the server waits for all of them.
    _done: mpsc::Sender<()>,
}

impl Worker {
    fn run(self, ready: oneshot::Sender<std::io::Result<()>>) {
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                let _ = ready.send(Err(e));
                return;
            }
        };
        let _ = ready.send(Ok(()));
        let Worker {
            mut incoming,
            gateway,
            grace,
            deadlines,
            max_streams,
            tls,
            verify_clients,
            _done,
        } = self;
        runtime.block_on(async move {
            // Made here, on the worker's own runtime: its store connection is driven by it.
            let context = Arc::new(gateway.worker_context());
            let heartbeat = tokio::spawn(heartbeat(Arc::clone(&context)));
            let builder = conn::builder(max_streams);
            let stop = CancellationToken::new();
            let connections = TaskTracker::new();

            // Until the acceptor closes the channel, which is the signal to drain.
            while let Some(Accepted {
                stream,
                peer,
                trusted,
                slot,
            }) = incoming.recv().await
            {
                let stream = match TcpStream::from_std(stream) {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!(error = %e, %peer, "cannot serve the connection");
                        continue;
                    }
                };
                let gw = Arc::clone(&gateway);
                let conn = Arc::new(ClientConn::new(
                    ClientAddr::new(peer, trusted).over_tls(tls.is_some()),
                    Arc::clone(&context),
                    slot,
                ));
                let held = Arc::clone(&conn);
                // With client certificates verified, the subject header is the gateway's alone:
                // whatever a client sent under that name is replaced.
                let handler_with = move |subject: Option<HeaderValue>| {
                    move |mut req: Request<ClientBody>| {
                        let gw = Arc::clone(&gw);
                        let conn = Arc::clone(&conn);
                        // Always the gateway's: a client's value (or its underscore twin, which
                        // CGI-style servers read as the same) never reaches anyone.
                        let headers = req.headers_mut();
                        // Both names are 21 bytes: one pass over the names (a few, and no
                        // hashing) spares nearly every request two lookups.
                        if headers.keys().any(|n| n.as_str().len() == SUBJECT_LEN) {
                            headers.remove(CLIENT_SUBJECT_HEADER);
                            headers.remove(CLIENT_SUBJECT_UNDERSCORED);
                        }
                        if verify_clients {
                            if let Some(s) = &subject {
                                headers.insert(CLIENT_SUBJECT_HEADER, s.clone());
                            }
                        }
                        async move { gw.handle(req, &conn).await }
                    }
                };
                let builder = builder.clone();
                let stop = stop.clone();
                let metrics = Arc::clone(gateway.metrics());
                let tls = tls.clone();
                connections.spawn(async move {
                    let served = match tls {
                        None => {
                            conn::serve(stream, &builder, deadlines, &stop, handler_with(None))
                                .await
                        }
                        // The handshake is part of getting to a request head: header_timeout.
                        Some(tls) => {
                            match tokio::time::timeout(
                                deadlines.header,
                                tls.acceptor().accept(stream),
                            )
                            .await
                            {
                                Ok(Ok(s)) => {
                                    let subject = crate::tls::client_subject(s.get_ref().1);
                                    let handler = handler_with(subject);
                                    conn::serve(s, &builder, deadlines, &stop, handler).await
                                }
                                Ok(Err(e)) => {
                                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                                    Some(conn::Expiry::Handshake)
                                }
                                Err(_) => Some(conn::Expiry::Header),
                            }
                        }
                    };
                    if let Some(why) = served {
                        tracing::debug!(%peer, reason = why.as_str(), "connection closed");
                        metrics.connection_closed(why);
                    }
                    // Unless a tunnel took it over.
                    drop(held.take_slot());
                });
            }

            let deadline = Instant::now() + grace;
            stop.cancel();
            connections.close();
            if tokio::time::timeout_at(deadline, connections.wait())
                .await
                .is_err()
            {
                tracing::warn!("grace period over with connections still open");
            }
            // Owner tasks this worker spawned run on this runtime: keep it turning until they
            // have stored their results.
            let _ = tokio::time::timeout_at(deadline, gateway.tasks().wait()).await;
            heartbeat.abort();
        });
        // The runtime, and with it every task still holding this worker's context (its store
        // handle), goes before `_done` tells the server this worker has stopped.
        drop(runtime);
        drop(_done);
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

/// Reloads routes, defaults and the default upstream from `path` on every SIGHUP. The new file is
/// validated first; on any error the running config stays and the error is logged. Requests
/// already running finish with the routing they started with. Store and server settings cannot
/// change without a restart, and a reload that changes them says so.
pub async fn reload_on_sighup(
    path: std::path::PathBuf,
    gateway: Arc<Gateway>,
    running: Config,
    tls: Option<Arc<ListenerTls>>,
) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut hup = match signal(SignalKind::hangup()) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGHUP; config reload disabled");
                return;
            }
        };
        while hup.recv().await.is_some() {
            // The listener's certificate first: rotated files are picked up even if the config
            // has an error.
            if let Some(tls) = &tls {
                match tls.reload() {
                    Ok(()) => tracing::info!("TLS certificate reloaded"),
                    Err(e) => {
                        tracing::error!(error = %e, "TLS certificate reload failed; keeping the one in use")
                    }
                }
            }
            let new = match Config::load(&path) {
                Ok(c) => c,
                Err(e) => {
                    tracing::error!(error = %e, "config reload failed; keeping the running config");
                    continue;
                }
            };
            if new.store != running.store
                || new.server != running.server
                || new.upstream_max_connections != running.upstream_max_connections
                || new.upstream_tls != running.upstream_tls
            {
                tracing::warn!("[store], [server], upstream.max_connections and upstream.tls_* changes take effect only after a restart; reloading routes, defaults and upstream only");
            }
            // The body budget stays the running one: a route whose bodies could never fit in it
            // would answer 503 to each of them.
            let budget = running.server.max_buffered;
            if let Some(r) = new.routes.iter().find(|r| r.policy.max_body > budget) {
                tracing::error!(
                    route = %r.name,
                    max_body = r.policy.max_body,
                    max_buffered = budget,
                    "config reload refused: a route's max_body is over the running server.max_buffered (a restart applies a new one); keeping the running config"
                );
                continue;
            }
            let routes = new.routes.len();
            gateway.reload(Routing::new(
                new.routes,
                new.upstream,
                &new.defaults,
                // A [server] setting: as the warning above says, it waits for a restart.
                running.server.case_sensitive_routes,
            ));
            tracing::info!(routes, "config reloaded");
        }
    }
    #[cfg(not(unix))]
    {
        let _ = (path, gateway, running, tls);
    }
}

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM; only Ctrl-C stops the gateway");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
