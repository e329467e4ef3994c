//! One client connection, served under a deadline in every phase (docs/security.md).
//!
//! hyper bounds none of the phases a hostile client can stretch out as we need: hyper-util reads
//! the first bytes (to tell HTTP/1.1 from h2c) with no deadline at all, and hyper's own HTTP/1.1
//! header timeout runs from the end of one response to the next head, so it cannot tell a client
//! idling on keep-alive from one dribbling a head. So each connection is served beside a
//! watchdog that reads what the connection is doing from [`Activity`], updated by the socket
//! wrapper ([`Watched`]) and by the requests themselves, and closes it when its phase is over:
//!
//! | phase | deadline |
//! |---|---|
//! | accept to the first complete request head (nothing sent, a partial head or h2 preface) | `header_timeout` |
//! | HTTP/1.1: first byte of the next request to its complete head | `header_timeout` |
//! | no request in flight: silent HTTP/1.1 keep-alive, an HTTP/2 connection with no stream | `idle_timeout` |
//! | a gap between two pieces of a request body ([`Deadlined`]) | `body_timeout` |
//! | a response write waiting on a client that does not read | `send_timeout` |
//!
//! The watchdog costs no timer per request: it sleeps until the current phase's deadline (or a
//! quarter of the shortest timeout, so that a phase that starts meanwhile is noticed in time)
//! and looks again.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use bytes::Bytes;
use futures_util::task::AtomicWaker;
use http::{Request, Response, Version};
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;

use crate::body::Body;
use crate::config::Deadlines;
use crate::error::BoxError;

/// The request body handed to the gateway: the client's body, under `body_timeout`.
pub type ClientBody = Deadlined<Incoming>;

/// Why the watchdog closed a connection (the `reason` label of
/// `idemgate_connections_closed_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expiry {
    /// No complete request head within `header_timeout`.
    Header,
    /// No request for `idle_timeout`.
    Idle,
    /// A response write waited `send_timeout` on a client that does not read.
    Send,
    /// The TLS handshake failed (no certificate, a wrong one, not TLS at all).
    Handshake,
}

impl Expiry {
    pub fn as_str(self) -> &'static str {
        match self {
            Expiry::Header => "header_timeout",
            Expiry::Idle => "idle_timeout",
            Expiry::Send => "send_timeout",
            Expiry::Handshake => "tls_handshake",
        }
    }
}

/// What one connection is doing, as the watchdog needs to know it. Times are milliseconds since
/// the connection was accepted; in the `*_since` fields, plus one, so that 0 means "not now".
struct Activity {
    accepted: Instant,
    /// Requests whose response has not been sent in full.
    active: AtomicU32,
    /// Requests so far.
    requests: AtomicU64,
    /// The client speaks HTTP/2 (known from its first request).
    h2: AtomicBool,
    /// When `active` last fell to zero.
    idle_since: AtomicU64,
    /// HTTP/1.1: when the first byte of a request head arrived while nothing was in flight.
    head_since: AtomicU64,
    /// When a write started waiting for the client to read.
    blocked_since: AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Activity {
            accepted: Instant::now(),
            active: AtomicU32::new(0),
            requests: AtomicU64::new(0),
            h2: AtomicBool::new(false),
            idle_since: AtomicU64::new(0),
            head_since: AtomicU64::new(0),
            blocked_since: AtomicU64::new(0),
        }
    }

    fn now_ms(&self) -> u64 {
        self.accepted.elapsed().as_millis() as u64
    }

    fn read_some(&self) {
        if self.active.load(Ordering::Relaxed) == 0 && self.head_since.load(Ordering::Relaxed) == 0
        {
            self.head_since.store(self.now_ms() + 1, Ordering::Relaxed);
        }
    }

    fn write_waits(&self, waits: bool) {
        let since = self.blocked_since.load(Ordering::Relaxed);
        if waits && since == 0 {
            self.blocked_since
                .store(self.now_ms() + 1, Ordering::Relaxed);
        } else if !waits && since != 0 {
            self.blocked_since.store(0, Ordering::Relaxed);
        }
    }

    /// One more stream in use beyond its request's, for as long as the guard lives.
    fn hold(self: &Arc<Self>) -> Finished {
        self.active.fetch_add(1, Ordering::Relaxed);
        Finished(Arc::clone(self))
    }

    fn request_started(self: &Arc<Self>, version: Version) -> Finished {
        if version == Version::HTTP_2 {
            self.h2.store(true, Ordering::Relaxed);
        }
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.active.fetch_add(1, Ordering::Relaxed);
        self.head_since.store(0, Ordering::Relaxed);
        Finished(Arc::clone(self))
    }

    /// When the current phase ends, and which deadline that is; `None` while requests run and
    /// every write goes through.
    fn due(&self, d: &Deadlines) -> Option<(u64, Expiry)> {
        let ms = |t: Duration| t.as_millis() as u64;
        let blocked = self.blocked_since.load(Ordering::Relaxed);
        let send = (blocked != 0).then(|| (blocked - 1 + ms(d.send), Expiry::Send));
        let phase = if self.active.load(Ordering::Relaxed) > 0 {
            None
        } else if self.requests.load(Ordering::Relaxed) == 0 {
            Some((ms(d.header), Expiry::Header))
        } else {
            let head = self.head_since.load(Ordering::Relaxed);
            let idle = self.idle_since.load(Ordering::Relaxed);
            if head != 0 && !self.h2.load(Ordering::Relaxed) {
                Some((head - 1 + ms(d.header), Expiry::Header))
            } else {
                Some((idle + ms(d.idle), Expiry::Idle))
            }
        };
        match (send, phase) {
            (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
            (a, b) => a.or(b),
        }
    }
}

/// Held by a response until it has been sent in full (hyper drops the body then).
struct Finished(Arc<Activity>);

/// A client connection's place under `server.max_connections` and in its worker's load, held
/// while the connection (or a tunnel that took its socket over) lives.
pub struct ConnectionSlot {
    _permit: tokio::sync::OwnedSemaphorePermit,
    load: prometheus_client::metrics::gauge::Gauge,
}

impl ConnectionSlot {
    /// `load` has already been counted up for this connection; it is counted down on drop.
    pub fn new(
        permit: tokio::sync::OwnedSemaphorePermit,
        load: prometheus_client::metrics::gauge::Gauge,
    ) -> Self {
        ConnectionSlot {
            _permit: permit,
            load,
        }
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.load.dec();
    }
}

/// What keeps a client connection counted while a WebSocket relayed from it lives: the
/// connection's slot (an HTTP/1.1 upgrade takes the socket over), or its stream's hold (an
/// HTTP/2 WebSocket is one stream of a connection that goes on). Only ever dropped.
#[allow(dead_code)]
pub enum Hold {
    Connection(ConnectionSlot),
    Stream(StreamHold),
}

/// Given to a CONNECT request (an HTTP/2 WebSocket): whoever keeps it keeps the connection
/// counted as busy, so it is not closed as idle while the stream is relayed after its response
/// (which ends the request as far as the connection can see).
/// (Extensions must be `Clone`: clones share the one guard.)
#[derive(Clone)]
pub struct StreamHold(#[allow(dead_code)] Arc<Finished>);

impl Drop for Finished {
    fn drop(&mut self) {
        let a = &self.0;
        if a.active.fetch_sub(1, Ordering::Relaxed) == 1 {
            a.idle_since.store(a.now_ms(), Ordering::Relaxed);
            a.head_since.store(0, Ordering::Relaxed);
        }
    }
}

/// Waits until the connection's current phase is over.
async fn watchdog(activity: &Activity, d: Deadlines) -> Expiry {
    let shortest = d.header.min(d.idle).min(d.send);
    let look_again = (shortest / 4).clamp(Duration::from_millis(10), Duration::from_secs(5));
    loop {
        let now = activity.now_ms();
        let wait = match activity.due(&d) {
            Some((at, why)) if at <= now => return why,
            Some((at, _)) => Duration::from_millis(at - now).min(look_again),
            None => look_again,
        };
        tokio::time::sleep(wait).await;
    }
}

/// A client socket (TCP, or TLS over it) that tells [`Activity`] when bytes arrive and when
/// writes wait.
struct Watched<S> {
    io: S,
    activity: Arc<Activity>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.read_some();
        }
        polled
    }
}

impl<S> Watched<S> {
    fn track<T>(&self, polled: Poll<T>) -> Poll<T> {
        self.activity.write_waits(polled.is_pending());
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        self.track(polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.track(polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let polled = Pin::new(&mut self.io).poll_flush(cx);
        self.track(polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// The body of a request whose client went quiet for `body_timeout` in the middle of it.
#[derive(Debug, thiserror::Error)]
#[error("no part of the request body arrived for {0:?}")]
pub struct BodyTimeout(pub Duration);

/// A request body that fails with [`BodyTimeout`] when no part of it arrives for `gap`. The
/// timer exists only while the body waits (a body that arrives with its head costs nothing).
pub struct Deadlined<B> {
    inner: B,
    gap: Duration,
    timer: Option<Pin<Box<Sleep>>>,
    /// A frame arrived since the timer was set: restart it at the next wait.
    progressed: bool,
}

impl<B> Deadlined<B> {
    pub fn new(inner: B, gap: Duration) -> Self {
        Deadlined {
            inner,
            gap,
            timer: None,
            progressed: false,
        }
    }
}

impl<B> HttpBody for Deadlined<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                this.progressed = true;
                Poll::Ready(frame.map(|f| f.map_err(Into::into)))
            }
            Poll::Pending => {
                let deadline = Instant::now() + this.gap;
                let timer = match &mut this.timer {
                    Some(t) => {
                        if this.progressed {
                            t.as_mut().reset(deadline);
                        }
                        t
                    }
                    None => this
                        .timer
                        .insert(Box::pin(tokio::time::sleep_until(deadline))),
                };
                this.progressed = false;
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err(Box::new(BodyTimeout(this.gap))))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A response body that marks its request finished once it is sent in full (or dropped).
pub struct Tracked {
    body: Body,
    _finished: Finished,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The HTTP/2 keep-alive: a PING this often on a connection that sent nothing, closed if the
/// answer takes longer than this too (a peer that vanished without a FIN).
const H2_KEEPALIVE: Duration = Duration::from_secs(20);

/// How client connections speak HTTP: every deadline is ours ([`conn`]), so hyper's own
/// HTTP/1.1 header timer (which cannot tell keep-alive from a slow head) is off.
/// How a worker serves its connections (both protocols, with the limits below).
pub type Builder = auto::Builder<TokioExecutor>;

/// `max_header_bytes` bounds a request head on both protocols: on HTTP/1.1 as hyper's read
/// buffer (a head that does not fit in it is answered 431 by hyper, with 100 header fields at
/// most), on HTTP/2 as the decoded header list (h2 answers 431).
pub fn builder(max_streams: u32, max_header_bytes: usize) -> Builder {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(None)
        // hyper asserts at least 8 KiB; the config allows no less.
        .max_buf_size(max_header_bytes.max(8192));
    // Each stream may buffer a body: cap them per connection. Against rapid reset (streams
    // opened and cancelled at once), h2's own bound on pending resets stays on (its default).
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(max_streams)
        .max_header_list_size(u32::try_from(max_header_bytes).unwrap_or(u32::MAX))
        // RFC 8441: WebSocket over HTTP/2, relayed to the upstream as an HTTP/1.1 upgrade.
        .enable_connect_protocol()
        .keep_alive_interval(H2_KEEPALIVE)
        .keep_alive_timeout(H2_KEEPALIVE);
    builder
}

/// The waker of a connection's watchdog: notes that the watchdog has something to look at,
/// and wakes the connection's task, which then polls it.
struct WakeFlag {
    woken: AtomicBool,
    task: AtomicWaker,
}

impl Default for WakeFlag {
    fn default() -> Self {
        WakeFlag {
            // The first poll arms the watchdog's timer.
            woken: AtomicBool::new(true),
            task: AtomicWaker::new(),
        }
    }
}

impl Wake for WakeFlag {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.task.wake();
    }
}

/// How long a connection closed for a deadline gets to send its HTTP/2 GOAWAY (or finish the
/// HTTP/1.1 close) before it is dropped.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// Serves one connection until it ends, a deadline closes it (returned), or `stop` is
/// cancelled (then it finishes the requests it has, for as long as its caller waits).
pub async fn serve<S, H, F>(
    stream: S,
    builder: &Builder,
    deadlines: Deadlines,
    stop: &CancellationToken,
    handler: H,
) -> Option<Expiry>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    H: Fn(Request<ClientBody>) -> F + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let activity = Arc::new(Activity::new());
    let io = TokioIo::new(Watched {
        io: stream,
        activity: Arc::clone(&activity),
    });
    let svc = {
        let activity = Arc::clone(&activity);
        service_fn(move |mut req: Request<Incoming>| {
            let finished = activity.request_started(req.version());
            if req.method() == http::Method::CONNECT {
                req.extensions_mut()
                    .insert(StreamHold(Arc::new(activity.hold())));
            }
            let answer = handler(req.map(|b| Deadlined::new(b, deadlines.body)));
            async move {
                let response = answer.await;
                Ok::<_, Infallible>(response.map(|body| Tracked {
                    body,
                    _finished: finished,
                }))
            }
        })
    };
    // With upgrades: a WebSocket's 101 hands the socket over to the gateway's tunnel.
    let conn = builder.serve_connection_with_upgrades(io, svc);
    tokio::pin!(conn);
    // The watchdog and the stop signal, polled only when one of their own timers or signals
    // fires: polled beside the connection at every wake-up (as `select!` does), they would cost
    // every request work for nothing almost always (bench/README.md, "bench/callgrind").
    let watch = async {
        tokio::select! {
            why = watchdog(&activity, deadlines) => Some(why),
            () = stop.cancelled() => None,
        }
    };
    tokio::pin!(watch);
    let woken = Arc::new(WakeFlag::default());
    let watch_waker = Waker::from(Arc::clone(&woken));
    let expired = std::future::poll_fn(|cx| {
        if let Poll::Ready(served) = conn.as_mut().poll(cx) {
            return Poll::Ready(Err(served));
        }
        // Registered before the flag is read, so a wake-up after the read still wakes us.
        woken.task.register(cx.waker());
        if woken.woken.swap(false, Ordering::AcqRel) {
            if let Poll::Ready(why) = watch.as_mut().poll(&mut Context::from_waker(&watch_waker)) {
                return Poll::Ready(Ok(why));
            }
        }
        Poll::Pending
    })
    .await;
    let expired = match expired {
        Ok(why) => why,
        Err(served) => {
            if let Err(e) = served {
                tracing::debug!(error = %e, "connection ended with an error");
            }
            return None;
        }
    };
    // HTTP/2: GOAWAY, so that a client about to send knows its request was not taken;
    // HTTP/1.1: close once the response under way (if any) is out.
    conn.as_mut().graceful_shutdown();
    match expired {
        // A client that does not read would hold the close up too.
        Some(Expiry::Send) => {}
        Some(_) => {
            let _ = tokio::time::timeout(CLOSE_GRACE, conn).await;
        }
        None => {
            let _ = conn.await;
        }
    }
    expired
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deadlines() -> Deadlines {
        Deadlines {
            header: Duration::from_secs(10),
            body: Duration::from_secs(30),
            idle: Duration::from_secs(60),
            send: Duration::from_secs(20),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn each_phase_has_its_deadline() {
        let d = deadlines();
        let a = Arc::new(Activity::new());
        // Nothing sent yet: the first head is due header_timeout after accept.
        assert_eq!(a.due(&d), Some((10_000, Expiry::Header)));
        let finished = a.request_started(Version::HTTP_11);
        assert_eq!(
            a.due(&d),
            None,
            "a request in flight has no connection deadline"
        );
        a.write_waits(true);
        assert_eq!(a.due(&d), Some((20_000, Expiry::Send)));
        a.write_waits(false);
        tokio::time::advance(Duration::from_secs(5)).await;
        drop(finished);
        // Keep-alive: idle_timeout from the end of the response...
        assert_eq!(a.due(&d), Some((65_000, Expiry::Idle)));
        tokio::time::advance(Duration::from_secs(3)).await;
        // ...until a byte of the next head arrives: then header_timeout from that byte.
        a.read_some();
        assert_eq!(a.due(&d), Some((18_000, Expiry::Header)));
        let _next = a.request_started(Version::HTTP_11);
        assert_eq!(a.due(&d), None);
    }

    #[tokio::test(start_paused = true)]
    async fn http2_is_idle_without_streams_whatever_it_sends() {
        let d = deadlines();
        let a = Arc::new(Activity::new());
        drop(a.request_started(Version::HTTP_2));
        // PINGs and WINDOW_UPDATEs are bytes too, but not a request head.
        a.read_some();
        assert_eq!(a.due(&d), Some((60_000, Expiry::Idle)));
    }

    #[tokio::test(start_paused = true)]
    async fn the_watchdog_fires_at_the_deadline_not_before() {
        let d = deadlines();
        let a = Arc::new(Activity::new());
        let started = Instant::now();
        assert_eq!(watchdog(&a, d).await, Expiry::Header);
        assert_eq!(started.elapsed(), Duration::from_secs(10));
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_stops_arriving_fails_after_the_gap() {
        use http_body_util::BodyExt;
        let (tx, rx) = fed_body();
        let mut body = Deadlined::new(rx, Duration::from_secs(30));
        tx.send(Bytes::from_static(b"part")).unwrap();
        let first = body.frame().await.unwrap().unwrap();
        assert_eq!(first.into_data().unwrap(), Bytes::from_static(b"part"));
        let started = Instant::now();
        let err = body.frame().await.unwrap().unwrap_err();
        assert!(err.is::<BodyTimeout>(), "{err}");
        assert_eq!(started.elapsed(), Duration::from_secs(30));
    }

    /// A body fed by hand through a channel, which then never ends (its sender stays).
    fn fed_body() -> (
        tokio::sync::mpsc::UnboundedSender<Bytes>,
        impl HttpBody<Data = Bytes, Error = Infallible>,
    ) {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Bytes>();
        let frames = futures_util::stream::poll_fn(move |cx| {
            rx.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b))))
        });
        (tx, http_body_util::StreamBody::new(frames))
    }
}
