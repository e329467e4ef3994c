//! The acceptor: one task that accepts every connection, under `server.max_connections`, and
//! hands each to the least busy worker.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, Semaphore};

use crate::config::ServerConfig;
use crate::conn::ConnectionSlot;

/// Accepts until `shutdown` resolves, handing each connection to the least busy worker.
///
/// One acceptor rather than every worker accepting from the socket: whichever thread happened to
/// be awake would win most connections, and a keep-alive connection stays where it lands.
pub(super) async fn accept(
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
pub(super) struct WorkerHandle {
    pub(super) handoff: mpsc::UnboundedSender<Accepted>,
    /// Connections the worker is serving now (also exported as a metric).
    pub(super) load: Gauge,
}

/// A connection on its way to, then served by, a worker.
pub(super) struct Accepted {
    pub(super) stream: std::net::TcpStream,
    pub(super) peer: SocketAddr,
    /// From one of `server.trusted_proxies`.
    pub(super) trusted: bool,
    pub(super) slot: ConnectionSlot,
}
