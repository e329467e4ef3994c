//! WebSockets outside the routes: an HTTP/1.1 upgrade relayed as it is, and an HTTP/2 one
//! (RFC 8441 extended CONNECT) relayed to the upstream as an HTTP/1.1 upgrade. Either way both
//! sockets are copied to each other until one closes, in a task that shutdown waits for.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response};

use super::forward::upstream_problem;
use super::{ClientConn, Gateway, Route};
use crate::body::{self, Body};
use crate::config::UpstreamUrl;
use crate::conn::{ClientBody, Hold, StreamHold};
use crate::metrics::Outcome;
use crate::problem::{self, Problem};
use crate::upstream::{prepare_request, UpstreamBody};

impl Gateway {
    /// A CONNECT: only an HTTP/2 WebSocket (RFC 8441 extended CONNECT, `:protocol websocket`)
    /// is served, as the HTTP/1.1 upgrade its `GET` would be. Any other tunnel would take the
    /// connection out of every rule here; plain CONNECT is for forward proxies, which this is
    /// not.
    pub(super) async fn connect(
        &self,
        req: Request<ClientBody>,
        conn: &Arc<ClientConn>,
    ) -> Response<Body> {
        let websocket = req
            .extensions()
            .get::<hyper::ext::Protocol>()
            .is_some_and(|p| p.as_str().eq_ignore_ascii_case("websocket"));
        // One config for the whole decision, and its answers: `[defaults]`' outside the
        // routes, a route's about its own path.
        let routing = self.routing.load_full();
        if !websocket {
            self.metrics
                .request(self.metrics.unrouted(), Outcome::BadRequest);
            return problem::restyle(Problem::MethodNotAllowed.into_response(), &routing.answers);
        }
        if let Some(route) = routing.router.find(&Method::GET, req.uri().path()) {
            self.metrics.request(&route.metrics, Outcome::BadRequest);
            return route.refuse(Problem::UpgradeRefused);
        }
        // A tunnel to a signed or client-checked route's path would pass it unchecked.
        if let Some(guard) =
            (routing.router).guarded(req.uri().path(), Route::guards_its_path, None)
        {
            self.metrics.request(&guard.metrics, Outcome::BadRequest);
            return super::guarded_path(guard);
        }
        let target = routing.default_upstream.clone();
        let timeout = routing.default_timeout;
        let answers = routing.answers.clone();
        drop(routing);
        let resp = self.tunnel_h2(req, conn, &target, timeout).await;
        self.metrics
            .request(self.metrics.unrouted(), Outcome::Passthrough);
        problem::restyle(resp, &answers)
    }

    /// An HTTP/2 WebSocket: its stream relayed to an HTTP/1.1 WebSocket upgrade of the upstream.
    /// The gateway makes the handshake's `Sec-WebSocket-Key` (HTTP/2 has none); the client gets
    /// `200` and the upstream's WebSocket headers once the upstream switched.
    async fn tunnel_h2(
        &self,
        mut req: Request<ClientBody>,
        conn: &Arc<ClientConn>,
        target: &UpstreamUrl,
        timeout: Duration,
    ) -> Response<Body> {
        let client_side = hyper::upgrade::on(&mut req);
        let hold = req.extensions_mut().remove::<StreamHold>();
        let (mut parts, _) = req.into_parts();
        parts.method = Method::GET;
        parts.extensions = http::Extensions::new();
        if prepare_request(&mut parts, target, &conn.addr).is_err() {
            return Problem::UpstreamUnreachable.into_response();
        }
        let h = &mut parts.headers;
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        if let Ok(key) = HeaderValue::from_str(&websocket_key()) {
            h.insert(header::SEC_WEBSOCKET_KEY, key);
        }
        if !h.contains_key(header::SEC_WEBSOCKET_VERSION) {
            h.insert(
                header::SEC_WEBSOCKET_VERSION,
                HeaderValue::from_static("13"),
            );
        }
        let req = Request::from_parts(parts, body::full(Bytes::new()));
        let mut resp = match switch_upstream(conn, req, timeout).await {
            Ok(switched) => switched,
            Err(answer) => return answer,
        };
        let upstream_side = hyper::upgrade::on(&mut resp);
        let mut accepted = Response::new(body::full(Bytes::new()));
        for (name, value) in resp.headers() {
            // What a 101 says about the connection, and the answer to a key the client never
            // sent, are the HTTP/1.1 hop's own.
            if name != header::UPGRADE
                && name != header::CONNECTION
                && name != header::SEC_WEBSOCKET_ACCEPT
            {
                accepted.headers_mut().append(name.clone(), value.clone());
            }
        }
        self.relay(client_side, upstream_side, hold.map(Hold::Stream));
        accepted
    }

    /// Relays the two sides of a WebSocket to each other until either closes, in a task that
    /// shutdown waits for (up to its grace); `hold` (the client connection's slot, or its
    /// stream's hold) lives as long.
    fn relay(
        &self,
        client_side: hyper::upgrade::OnUpgrade,
        upstream_side: hyper::upgrade::OnUpgrade,
        hold: Option<Hold>,
    ) {
        let open = self.metrics.tunnels();
        let closing = self.tunnels.clone();
        let relayed = async move {
            let (client, upstream) = match tokio::try_join!(client_side, upstream_side) {
                Ok(both) => both,
                Err(e) => {
                    tracing::debug!(error = %e, "upgrade not completed");
                    return;
                }
            };
            let _open = Counted::new(open);
            let mut client = hyper_util::rt::TokioIo::new(client);
            let mut upstream = hyper_util::rt::TokioIo::new(upstream);
            if let Err(e) = tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
                tracing::debug!(error = %e, "tunnel ended");
            }
        };
        self.core.tasks().spawn(async move {
            let _hold = hold;
            tokio::select! {
                () = relayed => {}
                // Both sockets close with the relay: the client reconnects elsewhere.
                () = closing.cancelled() => tracing::debug!("tunnel closed for shutdown"),
            }
        });
    }

    /// A protocol upgrade (WebSocket) outside any route: forwarded with its `Upgrade`; if the
    /// upstream switches (101), both sockets are relayed to each other until either side
    /// closes, in a task that shutdown waits for (up to its grace).
    pub(super) async fn tunnel(
        &self,
        mut req: Request<ClientBody>,
        conn: &Arc<ClientConn>,
        target: &UpstreamUrl,
        timeout: Duration,
    ) -> Response<Body> {
        let client_side = hyper::upgrade::on(&mut req);
        let protocol = req.headers().get(header::UPGRADE).cloned();
        let (mut parts, body) = req.into_parts();
        if prepare_request(&mut parts, target, &conn.addr).is_err() {
            return Problem::UpstreamUnreachable.into_response();
        }
        // Hop-by-hop as they are, these two are the request here.
        if let Some(protocol) = protocol {
            parts.headers.insert(header::UPGRADE, protocol);
            parts
                .headers
                .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        }
        let req = Request::from_parts(parts, body::boxed(body));
        let mut resp = match switch_upstream(conn, req, timeout).await {
            Ok(switched) => switched,
            Err(answer) => return answer,
        };
        let upstream_side = hyper::upgrade::on(&mut resp);
        // The client connection's slot (server.max_connections) stays taken while the tunnel
        // lives: its socket does.
        self.relay(
            client_side,
            upstream_side,
            conn.take_slot().map(Hold::Connection),
        );
        resp.map(body::boxed)
    }
}

/// An HTTP/1.1 request to switch to WebSocket (`Connection: upgrade`, `Upgrade: websocket`).
/// Other protocols (`h2c`, ...) are not relayed: a raw connection to the upstream in another
/// protocol would bypass every rule here.
pub(super) fn wants_upgrade<B>(req: &Request<B>) -> bool {
    is_websocket(req.headers())
        && req
            .headers()
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
}

/// `Upgrade` names WebSocket (and nothing else).
fn is_websocket(headers: &http::HeaderMap) -> bool {
    let mut values = headers.get_all(header::UPGRADE).iter();
    match (values.next(), values.next()) {
        (Some(v), None) => v.as_bytes().eq_ignore_ascii_case(b"websocket"),
        _ => false,
    }
}

/// Sends a WebSocket upgrade request to the upstream: its `101` (to relay), or else what the
/// client gets instead (the upstream's refusal, 401 or 404 say, as it is; or a problem).
async fn switch_upstream(
    conn: &ClientConn,
    req: Request<Body>,
    timeout: Duration,
) -> Result<Response<UpstreamBody>, Response<Body>> {
    let resp = match conn.worker.upstream.send_upgrade(req, timeout).await {
        Ok(resp) => resp,
        Err(e) => {
            tracing::warn!(error = %e, "upgrade request failed");
            return Err(upstream_problem(e).into_response());
        }
    };
    if resp.status() != http::StatusCode::SWITCHING_PROTOCOLS {
        return Err(resp.map(body::boxed));
    }
    if !is_websocket(resp.headers()) {
        tracing::warn!("the upstream switched to another protocol than WebSocket; not relayed");
        return Err(Problem::UpstreamFailed.into_response());
    }
    Ok(resp)
}

/// A fresh `Sec-WebSocket-Key`: 16 random bytes in base64 (RFC 6455 4.1).
fn websocket_key() -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(rand::random::<[u8; 16]>())
}

/// A relayed tunnel, counted in the open tunnels' gauge for as long as it lives (however it
/// ends: closed by a side, or dropped at shutdown).
struct Counted(prometheus_client::metrics::gauge::Gauge);

impl Counted {
    fn new(open: prometheus_client::metrics::gauge::Gauge) -> Counted {
        open.inc();
        Counted(open)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.dec();
    }
}
