//! The per-worker pool of upstream connections (see the module doc of [`super`]): HTTP/1.1
//! connections idle between requests, and HTTP/2 connections that requests share, each up to
//! the number of streams its upstream allows; past that, a request opens another connection
//! (under `max_connections`) rather than queue inside one, where a request still waiting for a
//! stream at its deadline could not be told from one the upstream was working on.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use http::header::{self, HeaderValue};
use http::uri::{Authority, PathAndQuery};
use http::{Request, Response, Uri};
use hyper::client::conn::http1::{self, SendRequest};
use hyper::client::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::limit::{ConnectionLimits, Gate};
use super::rewrite::strip_hop_by_hop;
use super::tls::UpstreamTlsConnector;
use super::{UpstreamError, MAX_CONNECT_TIMEOUT};

mod body;

use crate::body::Body;
use crate::config::UpstreamProtocol;
use crate::error::BoxError;
pub use body::UpstreamBody;

/// Idle connections kept per upstream and worker; more are closed when they come back.
const MAX_IDLE_PER_UPSTREAM: usize = 256;
/// The most header bytes (HPACK-decoded) an HTTP/2 upstream may send in one response head or
/// trailer block: a bound on what a response can make the gateway hold before its body.
const MAX_H2_HEADER_LIST: u32 = 256 * 1024;
/// Streams assumed open-able on a new HTTP/2 connection until the upstream's SETTINGS arrive:
/// only the one its maker sends. Assuming more (RFC 9113 suggests 100) let requests take streams
/// on a connection whose upstream then allowed fewer, and those queued inside hyper. h2 applies
/// the upstream's limit when its SETTINGS arrive, or none if they name none.
const STREAMS_BEFORE_SETTINGS: usize = 1;
/// A PING this often on an HTTP/2 connection, idle or not, and closed if the answer takes longer
/// than this too: an upstream that vanished without a FIN (a pod gone, a NAT entry dropped) is
/// found within 40 s, not when TCP gives up minutes later.
const H2_KEEPALIVE: Duration = Duration::from_secs(20);

/// A pool's deadlines: for a new connection (waiting for a slot, then connecting), and how long
/// an idle one may be reused (`upstream.idle_timeout`).
#[derive(Debug, Clone, Copy)]
pub struct PoolTimeouts {
    pub connect: Duration,
    pub idle: Duration,
}

/// A pooled HTTP/1.1 and HTTP/2 client; each worker thread has its own (see [`crate::server`]).
#[derive(Clone)]
pub struct UpstreamPool {
    pool: Arc<Pool>,
}

struct Pool {
    /// For a new connection: waiting for a slot, then connecting.
    connect_timeout: Duration,
    /// Idle connections older than this are closed rather than reused (`upstream.idle_timeout`):
    /// below the upstream's own keep-alive timeout, so that it never closes one just as a
    /// request is written on it (a request sent, then reset, is an unknown outcome though it
    /// never ran).
    idle_timeout: Duration,
    limits: Arc<ConnectionLimits>,
    /// For `https://` upstreams.
    tls: Arc<UpstreamTlsConnector>,
    /// Per upstream, its gate and its idle connections, the most recently used last. A route
    /// has one upstream and a config a handful, so a list beats a map.
    idle: Mutex<Vec<Upstream>>,
}

struct Upstream {
    authority: Authority,
    /// Connections to it are TLS.
    secure: bool,
    /// The protocol its connections were made with: a reload that changes it makes new ones.
    protocol: UpstreamProtocol,
    gate: Arc<Gate>,
    conns: VecDeque<Idle>,
    /// Its HTTP/2 connections, which requests share.
    shared: Vec<Shared>,
}

/// An HTTP/2 connection in the pool.
struct Shared {
    sender: http2::SendRequest<Body>,
    streams: Arc<Streams>,
    /// When a request last took a stream on it.
    since: Instant,
}

/// The streams open on one HTTP/2 connection, and the connection, to ask how many its upstream
/// allows now (`SETTINGS_MAX_CONCURRENT_STREAMS`).
struct Streams {
    open: AtomicUsize,
    /// Read live at each checkout: hyper applies the upstream's SETTINGS in a task of its own,
    /// so a copy kept from this connection's own polls could be stale in either direction.
    limit: Arc<dyn StreamLimit>,
}

impl Streams {
    fn has_room(&self) -> bool {
        self.open.load(Ordering::Relaxed) < self.limit.max_send_streams()
    }
}

/// An HTTP/2 connection's current limit on the streams it may open.
trait StreamLimit: Send + Sync {
    fn max_send_streams(&self) -> usize;
}

/// The connection is polled by its task and read by checkouts, each under the lock for a
/// moment.
type SharedH2<IO> = Mutex<Pin<Box<http2::Connection<IO, Body, TokioExecutor>>>>;

impl<IO> StreamLimit for SharedH2<IO>
where
    IO: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    fn max_send_streams(&self) -> usize {
        self.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .current_max_send_streams()
    }
}

/// One request's stream on an HTTP/2 connection, given back when dropped (with the response
/// body, or with the request that failed).
struct Stream(Arc<Streams>);

impl Stream {
    fn take(streams: &Arc<Streams>) -> Stream {
        streams.open.fetch_add(1, Ordering::Relaxed);
        Stream(Arc::clone(streams))
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A connection of either protocol, as checked out or made.
enum Conn {
    H1(SendRequest<Body>),
    H2(http2::SendRequest<Body>, Stream),
}

struct Idle {
    sender: SendRequest<Body>,
    since: Instant,
}

impl UpstreamPool {
    /// `connect_timeout` (waiting for a connection slot, then connecting) is capped at
    /// [`MAX_CONNECT_TIMEOUT`]; `limits` are shared by every worker's pool.
    pub fn new(
        timeouts: PoolTimeouts,
        limits: Arc<ConnectionLimits>,
        tls: Arc<UpstreamTlsConnector>,
    ) -> Self {
        UpstreamPool {
            pool: Arc::new(Pool {
                connect_timeout: timeouts.connect.min(MAX_CONNECT_TIMEOUT),
                idle_timeout: timeouts.idle,
                limits,
                tls,
                idle: Mutex::new(Vec::new()),
            }),
        }
    }

    /// Closes the idle connections to every upstream that someone waits to connect to, so the
    /// slots they hold go to where they are needed. The worker calls this on each heartbeat.
    pub fn yield_idle(&self) {
        let mut idle = self.pool.idle();
        for upstream in idle.iter_mut() {
            if upstream.gate.is_wanted() {
                upstream.conns.clear();
            }
        }
    }

    /// Closes connections idle for longer than the idle timeout, to every upstream, and forgets
    /// upstreams with none left: an upstream that a reload removed is never checked out again,
    /// so checkout alone would keep its connections open for ever. The worker calls this now
    /// and then.
    pub fn prune_idle(&self) {
        let Some(stale) = Instant::now().checked_sub(self.pool.idle_timeout) else {
            return;
        };
        let mut idle = self.pool.idle();
        for upstream in idle.iter_mut() {
            upstream.conns.retain(|c| c.since >= stale);
            // Dropping the pool's handle closes the connection once nothing uses it.
            upstream.shared.retain(|c| {
                !c.sender.is_closed()
                    && (c.since >= stale || c.streams.open.load(Ordering::Relaxed) > 0)
            });
        }
        idle.retain(|upstream| !upstream.conns.is_empty() || !upstream.shared.is_empty());
    }

    /// Upstreams with idle connections now (for tests).
    pub fn idle_upstreams(&self) -> usize {
        self.pool.idle().len()
    }

    /// Sends `req` and waits for the response head for at most `timeout`; the response comes back
    /// without hop-by-hop headers.
    pub async fn send(
        &self,
        req: Request<Body>,
        protocol: UpstreamProtocol,
        timeout: Duration,
    ) -> Result<Response<UpstreamBody>, UpstreamError> {
        tokio::time::timeout(timeout, self.exchange(req, protocol))
            .await
            .unwrap_or(Err(UpstreamError::Timeout(timeout)))
    }

    /// [`UpstreamPool::send`] with no timeout: for a caller whose own deadline covers more
    /// than the response head (one timer per request, not one per step). `req` carries the
    /// upstream in its URI ([`prepare_request`]); `protocol` is that upstream's (used when a
    /// connection is made).
    pub async fn exchange(
        &self,
        mut req: Request<Body>,
        protocol: UpstreamProtocol,
    ) -> Result<Response<UpstreamBody>, UpstreamError> {
        let (authority, secure) = upstream_of(&req)?;
        loop {
            let (conn, reused) = match self.pool.checkout(&authority, secure, protocol) {
                Some(conn) => (conn, true),
                None => (
                    self.pool
                        .connect(&authority, secure, protocol, false)
                        .await?,
                    false,
                ),
            };
            let mut sender = match conn {
                Conn::H1(sender) => sender,
                Conn::H2(mut sender, stream) => {
                    h2_form(&mut req, &authority, secure);
                    match sender.try_send_request(req).await {
                        Ok(mut resp) => {
                            strip_hop_by_hop(resp.headers_mut());
                            return Ok(resp.map(|body| UpstreamBody::on_stream(body, stream)));
                        }
                        Err(mut e) => match e.take_message() {
                            // Handed back unsent: the connection closed under it (GOAWAY, the
                            // upstream gone), and checkout no longer offers it; on another.
                            // Each round uses up one connection, and a new one ends the loop.
                            Some(unsent) if reused => {
                                req = unsent;
                                continue;
                            }
                            Some(_) => return Err(UpstreamError::NotSent(e.into_error().into())),
                            None if refused(e.error()) => {
                                return Err(UpstreamError::NotSent(e.into_error().into()))
                            }
                            None => return Err(UpstreamError::Failed(e.into_error().into())),
                        },
                    }
                }
            };
            h1_form(&mut req, &authority, secure);
            let head_request = req.method() == http::Method::HEAD;
            match sender.try_send_request(req).await {
                Ok(mut resp) => {
                    // Read before the framing headers go.
                    if !head_request && close_delimited(&resp) {
                        resp.extensions_mut().insert(CloseDelimited);
                    }
                    // A body framed by Transfer-Encoding ignores any Content-Length beside it
                    // (RFC 9112 6.3), and a proxy removes it: it must not be checked against.
                    if resp.headers().contains_key(header::TRANSFER_ENCODING) {
                        resp.headers_mut().remove(header::CONTENT_LENGTH);
                    }
                    // Connection-specific on the way back too: what the client gets is ours to
                    // frame.
                    strip_hop_by_hop(resp.headers_mut());
                    let pool = Arc::clone(&self.pool);
                    let key = (authority, secure, protocol);
                    return Ok(resp.map(|body| UpstreamBody::new(body, pool, key, sender)));
                }
                Err(mut e) => match e.take_message() {
                    // Handed back unwritten by a connection the upstream had closed while it sat
                    // idle: send it on another. Each round uses up one idle connection, and a
                    // new connection ends the loop either way.
                    Some(unsent) if reused => req = unsent,
                    Some(_) => return Err(UpstreamError::NotSent(e.into_error().into())),
                    None => return Err(UpstreamError::Failed(e.into_error().into())),
                },
            }
        }
    }
}

impl UpstreamPool {
    /// A protocol upgrade (WebSocket): sent on a connection of its own, never pooled, whose
    /// socket the upstream's `101` hands over ([`hyper::upgrade::on`] on the response).
    pub async fn send_upgrade(
        &self,
        mut req: Request<Body>,
        timeout: Duration,
    ) -> Result<Response<UpstreamBody>, UpstreamError> {
        let exchange = async {
            let (authority, secure) = upstream_of(&req)?;
            let conn = self
                .pool
                .connect(&authority, secure, UpstreamProtocol::Http1, true)
                .await?;
            let Conn::H1(mut sender) = conn else {
                return Err(UpstreamError::NotSent(
                    "the upstream would not speak HTTP/1.1 for an upgrade".into(),
                ));
            };
            h1_form(&mut req, &authority, secure);
            match sender.send_request(req).await {
                Ok(mut resp) => {
                    // A 101's `Upgrade` and `Connection` are what the client must see.
                    if resp.status() != http::StatusCode::SWITCHING_PROTOCOLS {
                        strip_hop_by_hop(resp.headers_mut());
                    }
                    Ok(resp.map(UpstreamBody::unpooled))
                }
                Err(e) if e.is_canceled() => Err(UpstreamError::NotSent(e.into())),
                Err(e) => Err(UpstreamError::Failed(e.into())),
            }
        };
        tokio::time::timeout(timeout, exchange)
            .await
            .unwrap_or(Err(UpstreamError::Timeout(timeout)))
    }
}

/// Marks an HTTP/1.1 answer whose body ends where the connection does (no `Content-Length`, not
/// chunked): a connection cut mid-body reads as its end, so such a body can never be known
/// complete.
#[derive(Debug, Clone, Copy)]
pub struct CloseDelimited;

/// Whether an HTTP/1.1 answer's body is delimited by the connection's close (RFC 9112 6.3).
fn close_delimited<B>(resp: &Response<B>) -> bool {
    let status = resp.status();
    let bodiless = status.is_informational()
        || status == http::StatusCode::NO_CONTENT
        || status == http::StatusCode::NOT_MODIFIED;
    let headers = resp.headers();
    let codings = headers.get_all(header::TRANSFER_ENCODING);
    // The final coding decides (as hyper reads it): chunked, or read until the close.
    // A value hyper cannot read as text makes it read until the close.
    let chunked = codings.iter().all(|v| v.to_str().is_ok())
        && codings.iter().next_back().is_some_and(|v| {
            (v.as_bytes().rsplit(|b| *b == b',').next())
                .is_some_and(|last| last.trim_ascii().eq_ignore_ascii_case(b"chunked"))
        });
    let encoded = codings.iter().next().is_some();
    !bodiless && !chunked && (encoded || !headers.contains_key(header::CONTENT_LENGTH))
}

/// The upstream a prepared request names, and whether it is `https://`.
fn upstream_of(req: &Request<Body>) -> Result<(Authority, bool), UpstreamError> {
    let Some(authority) = req.uri().authority().cloned() else {
        return Err(UpstreamError::NotSent(
            "the request names no upstream".into(),
        ));
    };
    let secure = req.uri().scheme() == Some(&http::uri::Scheme::HTTPS);
    Ok((authority, secure))
}

/// The request as HTTP/1.1 puts it on the wire: origin form, the name the client used in
/// `Host` (or, without one, the upstream's). Works on a request already put in
/// [`h2_form`], for one resent on another connection.
fn h1_form(req: &mut Request<Body>, upstream: &Authority, secure: bool) {
    if !req.headers().contains_key(header::HOST) {
        let host = match req.uri().authority() {
            Some(a) if a != upstream => HeaderValue::from_str(a.as_str()).ok(),
            _ => HeaderValue::from_str(&host_header(upstream, secure)).ok(),
        };
        if let Some(host) = host {
            req.headers_mut().insert(header::HOST, host);
        }
    }
    let origin_form = req
        .uri()
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    *req.uri_mut() = Uri::from(origin_form);
    // Kept by the rewrite for HTTP/2 (gRPC needs it); over HTTP/1.1 it would have to be named
    // in `Connection` too, and a pass-through relays trailers without it anyway.
    req.headers_mut().remove(header::TE);
}

/// The request as HTTP/2 puts it on the wire: the name the client used (its `Host`) as
/// `:authority`, and no `Host` beside it.
fn h2_form(req: &mut Request<Body>, upstream: &Authority, secure: bool) {
    let authority = req
        .headers_mut()
        .remove(header::HOST)
        .and_then(|h| Authority::try_from(h.as_bytes()).ok())
        .or_else(|| req.uri().authority().cloned())
        .unwrap_or_else(|| upstream.clone());
    let mut parts = http::uri::Parts::default();
    parts.scheme = Some(if secure {
        http::uri::Scheme::HTTPS
    } else {
        http::uri::Scheme::HTTP
    });
    parts.authority = Some(authority);
    parts.path_and_query = Some(
        req.uri()
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/")),
    );
    if let Ok(uri) = Uri::from_parts(parts) {
        *req.uri_mut() = uri;
    }
}

/// An HTTP/2 stream the upstream reset with `REFUSED_STREAM`: RFC 9113 8.7 says it was not
/// processed, so it counts as not sent. (A stream cut by a `GOAWAY` is not: the error does not
/// say whether it was above the last stream the upstream processed.)
fn refused(e: &hyper::Error) -> bool {
    let mut source = std::error::Error::source(e);
    while let Some(err) = source {
        if let Some(h2) = err.downcast_ref::<h2::Error>() {
            return h2.is_reset()
                && h2.is_remote()
                && h2.reason() == Some(h2::Reason::REFUSED_STREAM);
        }
        source = err.source();
    }
    false
}

impl Pool {
    fn idle(&self) -> std::sync::MutexGuard<'_, Vec<Upstream>> {
        // Every change under the lock is one push or pop: a panic elsewhere cannot leave it torn.
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A stream on an HTTP/2 connection to `authority` that has one free, or its most
    /// recently used idle HTTP/1.1 connection that is ready for a request.
    fn checkout(
        &self,
        authority: &Authority,
        secure: bool,
        protocol: UpstreamProtocol,
    ) -> Option<Conn> {
        let mut idle = self.idle();
        let upstream = idle
            .iter_mut()
            .find(|u| u.authority == *authority && u.secure == secure && u.protocol == protocol)?;
        upstream.shared.retain(|c| !c.sender.is_closed());
        let free = upstream.shared.iter_mut().find(|c| c.streams.has_room());
        if let Some(c) = free {
            c.since = Instant::now();
            return Some(Conn::H2(c.sender.clone(), Stream::take(&c.streams)));
        }
        let conns = &mut upstream.conns;
        let stale = Instant::now().checked_sub(self.idle_timeout);
        while conns
            .front()
            .is_some_and(|c| stale.is_some_and(|s| c.since < s))
        {
            conns.pop_front();
        }
        // Only ready connections are pooled ([`UpstreamBody`]); one that is not ready any more
        // has been closed since.
        while let Some(Idle { sender, .. }) = conns.pop_back() {
            if sender.is_ready() {
                return Some(Conn::H1(sender));
            }
        }
        None
    }

    /// The entry of an upstream, made if there is none.
    fn upstream<'a>(&self, idle: &'a mut Vec<Upstream>, key: Key) -> &'a mut Upstream {
        let (authority, secure, protocol) = key;
        let i = match idle
            .iter()
            .position(|u| u.authority == authority && u.secure == secure && u.protocol == protocol)
        {
            Some(i) => i,
            None => {
                let gate = self.limits.gate(&authority);
                idle.push(Upstream {
                    authority,
                    secure,
                    protocol,
                    gate,
                    conns: VecDeque::new(),
                    shared: Vec::new(),
                });
                idle.len() - 1
            }
        };
        &mut idle[i]
    }

    /// Offers a new HTTP/2 connection's other streams to the requests that follow.
    fn share(&self, key: Key, sender: &http2::SendRequest<Body>, streams: &Arc<Streams>) {
        let mut idle = self.idle();
        let upstream = self.upstream(&mut idle, key);
        upstream.shared.push(Shared {
            sender: sender.clone(),
            streams: Arc::clone(streams),
            since: Instant::now(),
        });
    }

    /// Pools `sender`, which must be ready ([`UpstreamBody`] sees to it).
    fn give_back(&self, key: Key, sender: SendRequest<Body>) {
        let since = Instant::now();
        let mut idle = self.idle();
        let upstream = self.upstream(&mut idle, key);
        if upstream.gate.is_wanted() {
            // Its slot is worth more to the request waiting for one (perhaps on another worker)
            // than a connection kept idle here.
            return;
        }
        let conns = &mut upstream.conns;
        if conns.len() >= MAX_IDLE_PER_UPSTREAM {
            conns.pop_front();
        }
        conns.push_back(Idle { sender, since });
    }

    /// A new connection to `authority` in `protocol` (an HTTP/2 one is shared from now on); any
    /// failure here means nothing was sent. With `upgrades`, the connection can be handed over
    /// by a `101` (HTTP/1.1 only, never pooled).
    ///
    /// Boxed: the TLS and HTTP/2 handshakes make this future about 7 KiB, which every request's
    /// future would otherwise carry, and copy each time hyper moves it (measured: twice the
    /// instructions of a pass-through request), for a step that most requests skip.
    fn connect<'a>(
        &'a self,
        authority: &'a Authority,
        secure: bool,
        protocol: UpstreamProtocol,
        upgrades: bool,
    ) -> Pin<Box<impl std::future::Future<Output = Result<Conn, UpstreamError>> + Send + 'a>> {
        Box::pin(self.make_connection(authority, secure, protocol, upgrades))
    }

    async fn make_connection(
        &self,
        authority: &Authority,
        secure: bool,
        protocol: UpstreamProtocol,
        upgrades: bool,
    ) -> Result<Conn, UpstreamError> {
        // `[::1]` in a URI is `::1` to the resolver.
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        let port = authority
            .port_u16()
            .unwrap_or(if secure { 443 } else { 80 });
        let deadline = Instant::now() + self.connect_timeout;
        let gate = self.limits.gate(authority);
        let slot = gate
            .slot(deadline)
            .await
            .map_err(|e| UpstreamError::NotSent(Box::new(e)))?;
        let connecting = async {
            let stream = TcpStream::connect((host, port)).await?;
            stream.set_nodelay(true)?;
            if secure {
                let (stream, h2) = self.tls.connect(host, stream, protocol).await?;
                start(TokioIo::new(stream), slot, h2, upgrades).await
            } else {
                let h2 = protocol == UpstreamProtocol::Http2;
                start(TokioIo::new(stream), slot, h2, upgrades).await
            }
        };
        match tokio::time::timeout_at(deadline, connecting).await {
            Ok(Ok(conn)) => {
                if let Conn::H2(sender, stream) = &conn {
                    self.share((authority.clone(), secure, protocol), sender, &stream.0);
                }
                Ok(conn)
            }
            Ok(Err(e)) => Err(UpstreamError::NotSent(e)),
            Err(_) => Err(UpstreamError::NotSent(
                format!("connecting took longer than {:?}", self.connect_timeout).into(),
            )),
        }
    }
}

/// The HTTP/1.1 or HTTP/2 handshake on a new connection, whose task holds the connection's
/// `slot`.
async fn start<IO>(
    io: IO,
    slot: tokio::sync::OwnedSemaphorePermit,
    h2: bool,
    upgrades: bool,
) -> Result<Conn, BoxError>
where
    IO: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    if h2 {
        let (sender, conn) = http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .max_header_list_size(MAX_H2_HEADER_LIST)
            .initial_max_send_streams(STREAMS_BEFORE_SETTINGS)
            .keep_alive_interval(H2_KEEPALIVE)
            .keep_alive_timeout(H2_KEEPALIVE)
            .keep_alive_while_idle(true)
            .handshake(io)
            .await?;
        let conn: Arc<SharedH2<IO>> = Arc::new(Mutex::new(Box::pin(conn)));
        let streams = Arc::new(Streams {
            open: AtomicUsize::new(0),
            limit: Arc::clone(&conn) as Arc<dyn StreamLimit>,
        });
        tokio::spawn(async move {
            // Ends when the connection does, or when no handle to it is left (the pool dropped
            // its own); streams still open then finish in hyper's own task.
            let _slot = slot;
            let ended = std::future::poll_fn(|cx| {
                let mut conn = conn.lock().unwrap_or_else(PoisonError::into_inner);
                std::future::Future::poll(conn.as_mut(), cx)
            })
            .await;
            if let Err(e) = ended {
                tracing::debug!(error = %e, "upstream HTTP/2 connection ended");
            }
        });
        let stream = Stream::take(&streams);
        return Ok(Conn::H2(sender, stream));
    }
    let (sender, conn) = http1::handshake(io).await?;
    tokio::spawn(async move {
        // The slot is the socket's: given back when the connection has ended, however long
        // after its last request that is (or when it was handed over to a tunnel).
        let _slot = slot;
        let ended = if upgrades {
            conn.with_upgrades().await
        } else {
            conn.await
        };
        if let Err(e) = ended {
            tracing::debug!(error = %e, "upstream connection ended");
        }
    });
    Ok(Conn::H1(sender))
}

/// `Host` for a request that came without one (an HTTP/2 client that sent no `:authority`):
/// the upstream's, with the port unless it is the scheme's.
fn host_header(authority: &Authority, secure: bool) -> String {
    let default = if secure { 443 } else { 80 };
    match authority.port_u16() {
        Some(port) if port != default => format!("{}:{port}", authority.host()),
        _ => authority.host().to_string(),
    }
}

/// Which pool entry a connection belongs to: the upstream, TLS or not, and the protocol.
type Key = (Authority, bool, UpstreamProtocol);

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http_body::{Body as HttpBody, Frame};
    use std::task::{Context, Poll};

    fn test_tls() -> Arc<UpstreamTlsConnector> {
        UpstreamTlsConnector::new(&crate::config::UpstreamTls::default()).unwrap()
    }
    use std::net::SocketAddr;

    #[test]
    fn a_body_without_framing_that_tells_its_end_is_close_delimited() {
        let resp = |status: u16, headers: &[(&str, &str)]| {
            let mut b = Response::builder().status(status);
            for (n, v) in headers {
                b = b.header(*n, *v);
            }
            b.body(()).unwrap()
        };
        assert!(close_delimited(&resp(201, &[])));
        assert!(!close_delimited(&resp(201, &[("content-length", "2")])));
        assert!(!close_delimited(&resp(
            201,
            &[("transfer-encoding", "chunked")]
        )));
        assert!(!close_delimited(&resp(
            201,
            &[("transfer-encoding", "gzip, chunked")]
        )));
        // The final coding decides, as hyper reads it.
        let gzip_last = [
            ("transfer-encoding", "chunked"),
            ("transfer-encoding", "gzip"),
        ];
        assert!(close_delimited(&resp(201, &gzip_last)));
        let not_chunked = [("transfer-encoding", "gzip"), ("content-length", "2")];
        assert!(close_delimited(&resp(201, &not_chunked)));
        assert!(!close_delimited(&resp(204, &[])));
        assert!(!close_delimited(&resp(304, &[])));
    }

    /// A raw HTTP/1.1 upstream on loopback that counts its connections and answers each request
    /// by `answer(path)`: (response bytes, close after it).
    struct RawUpstream {
        addr: SocketAddr,
        accepted: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl RawUpstream {
        async fn start(answer: fn(&str) -> (Vec<u8>, bool)) -> RawUpstream {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let count = Arc::clone(&accepted);
            tokio::spawn(async move {
                while let Ok((mut sock, _)) = listener.accept().await {
                    count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    tokio::spawn(async move {
                        let mut buf = Vec::new();
                        loop {
                            let mut chunk = [0u8; 4096];
                            let Ok(read) = sock.read(&mut chunk).await else {
                                return;
                            };
                            if read == 0 {
                                return;
                            }
                            buf.extend_from_slice(&chunk[..read]);
                            // Requests here have no body: each ends at its blank line.
                            while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                                let head = String::from_utf8_lossy(&buf[..end]).to_string();
                                buf.drain(..end + 4);
                                let path = head.split(' ').nth(1).unwrap_or("").to_string();
                                let (bytes, close) = answer(&path);
                                if sock.write_all(&bytes).await.is_err() || close {
                                    return;
                                }
                            }
                        }
                    });
                }
            });
            RawUpstream { addr, accepted }
        }

        fn connections(&self) -> usize {
            self.accepted.load(std::sync::atomic::Ordering::SeqCst)
        }

        fn request(&self, path: &str) -> Request<Body> {
            Request::get(format!("http://{}{path}", self.addr))
                .body(crate::body::full(Bytes::new()))
                .unwrap()
        }
    }

    const OK: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";

    async fn read_all(resp: Response<UpstreamBody>) -> Bytes {
        use http_body_util::BodyExt;
        resp.into_body().collect().await.unwrap().to_bytes()
    }

    #[tokio::test]
    async fn sequential_requests_share_one_connection() {
        let up = RawUpstream::start(|_| (OK.to_vec(), false)).await;
        let client = UpstreamPool::new(
            PoolTimeouts {
                connect: Duration::from_secs(1),
                idle: Duration::from_secs(60),
            },
            ConnectionLimits::new(64),
            test_tls(),
        );
        for _ in 0..3 {
            let resp = client
                .exchange(up.request("/x"), UpstreamProtocol::Auto)
                .await
                .unwrap();
            assert_eq!(read_all(resp).await, "ok");
        }
        assert_eq!(up.connections(), 1);
    }

    #[tokio::test]
    async fn a_connection_the_upstream_closed_while_idle_is_replaced_unseen() {
        // Closes after every answer without saying so: each pooled connection is dead when
        // reused, and the request must still go through, on a new one.
        let up = RawUpstream::start(|_| (OK.to_vec(), true)).await;
        let client = UpstreamPool::new(
            PoolTimeouts {
                connect: Duration::from_secs(1),
                idle: Duration::from_secs(60),
            },
            ConnectionLimits::new(64),
            test_tls(),
        );
        for _ in 0..3 {
            let resp = client
                .exchange(up.request("/x"), UpstreamProtocol::Auto)
                .await
                .unwrap();
            assert_eq!(read_all(resp).await, "ok");
        }
        assert_eq!(up.connections(), 3);
    }

    #[tokio::test]
    async fn a_body_still_streaming_keeps_its_connection_and_a_dropped_one_closes_it() {
        // `/stream` starts a chunked answer that never ends.
        fn answer(path: &str) -> (Vec<u8>, bool) {
            match path {
                "/stream" => (
                    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n".to_vec(),
                    false,
                ),
                _ => (OK.to_vec(), false),
            }
        }
        let up = RawUpstream::start(answer).await;
        let client = UpstreamPool::new(
            PoolTimeouts {
                connect: Duration::from_secs(1),
                idle: Duration::from_secs(60),
            },
            ConnectionLimits::new(64),
            test_tls(),
        );
        let mut streaming = client
            .exchange(up.request("/stream"), UpstreamProtocol::Auto)
            .await
            .unwrap();
        {
            use http_body_util::BodyExt;
            let first = streaming.body_mut().frame().await.unwrap().unwrap();
            assert_eq!(first.into_data().unwrap(), "abc");
        }
        // Not queued behind the unfinished body: a second connection, answered at once.
        let second = tokio::time::timeout(
            Duration::from_secs(5),
            client.exchange(up.request("/x"), UpstreamProtocol::Auto),
        )
        .await
        .expect("queued behind a body still streaming")
        .unwrap();
        assert_eq!(read_all(second).await, "ok");
        assert_eq!(up.connections(), 2);
        // Dropped half-read: that connection is closed, and the next request takes the idle one.
        drop(streaming);
        let third = client
            .exchange(up.request("/x"), UpstreamProtocol::Auto)
            .await
            .unwrap();
        assert_eq!(read_all(third).await, "ok");
        assert_eq!(up.connections(), 2);
        // Dropped before its body was read: not pooled either, so one more connection.
        let unread = client
            .exchange(up.request("/x"), UpstreamProtocol::Auto)
            .await
            .unwrap();
        drop(unread);
        let fourth = client
            .exchange(up.request("/x"), UpstreamProtocol::Auto)
            .await
            .unwrap();
        assert_eq!(read_all(fourth).await, "ok");
        assert_eq!(up.connections(), 3);
    }

    /// A request body that ends only when its sender is dropped.
    struct Trickle(tokio::sync::mpsc::Receiver<Bytes>);

    impl HttpBody for Trickle {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            self.0
                .poll_recv(cx)
                .map(|chunk| chunk.map(|c| Ok(Frame::data(c))))
        }
    }

    #[tokio::test]
    async fn a_connection_still_sending_its_request_body_is_not_handed_out() {
        // The upstream answers as soon as it has the head, as one refusing an upload does.
        let up = RawUpstream::start(|_| (OK.to_vec(), false)).await;
        let client = UpstreamPool::new(
            PoolTimeouts {
                connect: Duration::from_secs(1),
                idle: Duration::from_secs(60),
            },
            ConnectionLimits::new(64),
            test_tls(),
        );
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        tx.send(Bytes::from_static(b"part")).await.unwrap();
        let upload = Request::post(format!("http://{}/upload", up.addr))
            .header(header::TRANSFER_ENCODING, "chunked")
            .body(crate::body::boxed(Trickle(rx)))
            .unwrap();
        let answered = client
            .exchange(upload, UpstreamProtocol::Auto)
            .await
            .unwrap();
        assert_eq!(read_all(answered).await, "ok");
        // Its response is read, but its request body is not sent yet: the next request must not
        // wait behind it.
        let next = tokio::time::timeout(
            Duration::from_secs(5),
            client.exchange(up.request("/x"), UpstreamProtocol::Auto),
        )
        .await
        .expect("queued behind an unfinished upload")
        .unwrap();
        assert_eq!(read_all(next).await, "ok");
        assert_eq!(up.connections(), 2);
        drop(tx);
    }

    #[tokio::test]
    async fn idle_connections_of_an_upstream_no_longer_used_are_closed() {
        let up = RawUpstream::start(|_| (OK.to_vec(), false)).await;
        let client = UpstreamPool::new(
            PoolTimeouts {
                connect: Duration::from_secs(1),
                idle: Duration::from_secs(60),
            },
            ConnectionLimits::new(64),
            test_tls(),
        );
        let resp = client
            .exchange(up.request("/a"), UpstreamProtocol::Auto)
            .await
            .unwrap();
        assert_eq!(read_all(resp).await, "ok");
        assert_eq!(client.idle_upstreams(), 1);
        client.prune_idle();
        assert_eq!(
            client.idle_upstreams(),
            1,
            "a fresh idle connection is kept"
        );
        tokio::time::pause();
        tokio::time::advance(Duration::from_secs(61)).await;
        client.prune_idle();
        assert_eq!(
            client.idle_upstreams(),
            0,
            "the stale one is closed, the upstream forgotten"
        );
    }

    #[tokio::test]
    async fn nothing_listening_means_not_sent() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let client = UpstreamPool::new(
            PoolTimeouts {
                connect: Duration::from_secs(1),
                idle: Duration::from_secs(60),
            },
            ConnectionLimits::new(64),
            test_tls(),
        );
        let req = Request::get(format!("http://{addr}/x"))
            .body(crate::body::full(Bytes::new()))
            .unwrap();
        match client.exchange(req, UpstreamProtocol::Auto).await {
            Err(UpstreamError::NotSent(_)) => {}
            Err(e) => panic!("not NotSent: {e}"),
            Ok(resp) => panic!("an answer from nowhere: {}", resp.status()),
        }
    }

    #[tokio::test]
    async fn a_response_without_a_body_returns_its_connection_at_once() {
        let up = RawUpstream::start(|_| (b"HTTP/1.1 204 No Content\r\n\r\n".to_vec(), false)).await;
        let client = UpstreamPool::new(
            PoolTimeouts {
                connect: Duration::from_secs(1),
                idle: Duration::from_secs(60),
            },
            ConnectionLimits::new(64),
            test_tls(),
        );
        for _ in 0..3 {
            let resp = client
                .exchange(up.request("/x"), UpstreamProtocol::Auto)
                .await
                .unwrap();
            assert_eq!(resp.status(), 204);
            // The body is never polled, as hyper's server does for a 204.
        }
        assert_eq!(up.connections(), 1);
    }
}
