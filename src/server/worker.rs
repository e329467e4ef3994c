//! One worker thread: its own single-threaded runtime, serving the connections the acceptor
//! hands it, start to finish.
//!
//! Like nginx's worker processes, each worker serves its connections with its own upstream
//! pool: a request, its upstream connection and its owner execution (detached only if its
//! client goes away) all run on one thread, so the hot path needs no wake-ups across threads.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::acceptor::Accepted;
use crate::config::Deadlines;
use crate::conn::{self, ClientBody, ConnectionSlot};
use crate::gateway::{ClientConn, Gateway, WorkerContext};
use crate::tls::{CertificateIds, ListenerTls};
use crate::upstream::ClientAddr;

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
/// Without this timer, the lease renewal timer of every new key and every Redis command's
/// `command_timeout` would often be the soonest, and pay for that wake-up (bench/README.md,
/// "bench/callgrind"). With it, no request timer longer than `HEARTBEAT` is ever the soonest;
/// the cost is ten wake-ups a second per worker.
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

pub(super) struct Worker {
    pub(super) incoming: mpsc::UnboundedReceiver<Accepted>,
    pub(super) gateway: Arc<Gateway>,
    pub(super) grace: Duration,
    pub(super) deadlines: Deadlines,
    pub(super) max_streams: u32,
    pub(super) max_header_bytes: usize,
    pub(super) tls: Option<Arc<ListenerTls>>,
    /// The listener verifies client certificates: their subjects name the clients.
    pub(super) verify_clients: bool,
    /// Dropped when the thread ends; the server waits for all of them.
    pub(super) _done: mpsc::Sender<()>,
}

/// What every connection of a worker is served with.
#[derive(Clone)]
struct Serving {
    gateway: Arc<Gateway>,
    context: Arc<WorkerContext>,
    builder: conn::Builder,
    deadlines: Deadlines,
    stop: CancellationToken,
    tls: Option<Arc<ListenerTls>>,
    verify_clients: bool,
}

impl Worker {
    pub(super) fn run(self, ready: oneshot::Sender<std::io::Result<()>>) {
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
            max_header_bytes,
            tls,
            verify_clients,
            _done,
        } = self;
        runtime.block_on(async move {
            // Made here, on the worker's own runtime: its store connection is driven by it.
            let context = Arc::new(gateway.worker_context());
            let heartbeat = tokio::spawn(heartbeat(Arc::clone(&context)));
            let serving = Serving {
                gateway: Arc::clone(&gateway),
                context,
                builder: conn::builder(max_streams, max_header_bytes),
                deadlines,
                stop: CancellationToken::new(),
                tls,
                verify_clients,
            };
            let connections = TaskTracker::new();
            // Until the acceptor closes the channel, which is the signal to drain.
            while let Some(accepted) = incoming.recv().await {
                connections.spawn(serving.clone().serve(accepted));
            }
            let deadline = Instant::now() + grace;
            serving.stop.cancel();
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
        // connection among them), is dropped here, on the thread that drove it: before `_done`,
        // so that the process does not exit while the executions it cuts off log their keys.
        // Bounded: dropping a runtime waits for its blocking tasks (a slow DNS lookup of an
        // upstream's name) without end; its async tasks, with them the executions that log
        // being cut off, are dropped first either way.
        runtime.shutdown_timeout(Duration::from_secs(1));
        drop(_done);
    }
}

impl Serving {
    /// One connection, from the TLS handshake (the first part of getting to a request head:
    /// `header_timeout`) to its close.
    async fn serve(self, accepted: Accepted) {
        let Accepted {
            stream,
            peer,
            trusted,
            slot,
        } = accepted;
        let stream = match TcpStream::from_std(stream) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, %peer, "cannot serve the connection");
                return;
            }
        };
        let addr = ClientAddr::new(peer, trusted).over_tls(self.tls.is_some());
        let served = match self.tls.clone() {
            None => {
                self.http(
                    stream,
                    ClientConn::new(addr, Arc::clone(&self.context), slot),
                )
                .await
            }
            Some(tls) => {
                match tokio::time::timeout(self.deadlines.header, tls.acceptor().accept(stream))
                    .await
                {
                    Ok(Ok(s)) => {
                        let ids = crate::tls::client_certificate(s.get_ref().1);
                        let conn = self.client(addr, slot, ids);
                        self.http(s, conn).await
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
            self.gateway.metrics().connection_closed(why);
        }
    }

    /// A TLS client: named by its certificate's subject and URIs where the listener verifies
    /// them.
    fn client(&self, addr: ClientAddr, slot: ConnectionSlot, ids: CertificateIds) -> ClientConn {
        let conn = ClientConn::new(addr, Arc::clone(&self.context), slot);
        match self.verify_clients {
            true => conn.with_certificate(ids),
            false => conn,
        }
    }

    /// HTTP on the connection until it closes; why, if a deadline closed it.
    async fn http<IO>(&self, io: IO, conn: ClientConn) -> Option<conn::Expiry>
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let conn = Arc::new(conn);
        let gateway = Arc::clone(&self.gateway);
        let client = Arc::clone(&conn);
        let handler = move |req: http::Request<ClientBody>| {
            let gateway = Arc::clone(&gateway);
            let conn = Arc::clone(&client);
            async move { gateway.handle(req, &conn).await }
        };
        let served = conn::serve(io, &self.builder, self.deadlines, &self.stop, handler).await;
        // Unless a tunnel took it over, the connection's slot is free once it is served.
        drop(conn.take_slot());
        served
    }
}
