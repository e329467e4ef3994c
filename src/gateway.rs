//! The HTTP front: what happens to one request, phase by phase, in front of the idempotency
//! core ([`crate::idempotency`]).
//!
//! ```text
//! classify ─ no route ───────────────────────────────────────────────▶ pass_through (streams)
//!    │ idempotent route
//! identify ──── no client header + require_client ─▶ 401 problem
//! verify ────── signed route, signature fails ──────▶ 401 problem (body read first, nothing stored)
//! extract_key ─ missing/invalid ─▶ 400 problem   (missing + require_key=false ▶ pass_through)
//! read_body ─── over max_body ───▶ 413 problem   (counted while reading, upstream not called)
//!               over max_buffered ▶ 503 problem
//! fingerprint
//! core ─────── Owned ──▶ the upstream's answer (stored), or its problem (unreachable, unknown)
//!    │         Replay ─▶ the stored response, byte for byte, marked
//!    │         Refused ▶ problem (mismatch, in flight, outcome unknown, store down/full)
//!    └──────── Bypass ─▶ pass_through (on_store_error = "pass")
//! ```
//! The core executes through [`Forward`]: send upstream and capture the answer within
//! `upstream_timeout`. Every response the gateway makes itself comes from [`Problem`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{header, request, HeaderValue, Method, Request, Response};
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use crate::body::{self, Body, Budget, Captured, Lease, OverBudget, ReadError};
use crate::config::{Policy, RouteConfig, UpstreamProtocol, UpstreamUrl};
use crate::conn::{BodyTimeout, ClientBody, StreamHold};
use crate::fingerprint::{fingerprint, RequestParts};
use crate::grpc;
use crate::idempotency::{Attempt, Core, Decision, Execute, Refusal, Rules, Settled};
use crate::key::{ClientScope, StoreKey};
use crate::metrics::{Metrics, Outcome, RouteMetrics};
use crate::problem::{self, Problem};
use crate::quota::{Quota, QuotaId};
use crate::route::{RoutePattern, Routed, Router};
use crate::signature;
use crate::store::{Store, StoredResponse, UnknownReason};
use crate::upstream::{
    prepare_request, ClientAddr, ConnectionLimits, NoConnectionSlot, UpstreamBody, UpstreamError,
    UpstreamPool, UpstreamTlsConnector,
};

/// Header on a replay whose body was too large to keep: the body is deliberately empty.
pub const BODY_OMITTED_HEADER: &str = "idemgate-body-omitted";

/// A route as the gateway runs it: its config, and its live metric series beside it.
pub struct Route {
    pub config: RouteConfig,
    pub metrics: RouteMetrics,
}

impl Routed for Route {
    fn pattern(&self) -> &RoutePattern {
        &self.config.pattern
    }

    fn methods(&self) -> &[Method] {
        &self.config.methods
    }
}

/// What a config reload replaces: the routes, the default upstream and its timeout.
pub struct Routing {
    router: Router<Route>,
    default_upstream: UpstreamUrl,
    /// `[defaults] upstream_timeout`, for pass-through traffic outside any route.
    default_timeout: Duration,
}

impl Routing {
    /// What a config says about routing: at startup and on every reload. A reload starts every
    /// route's metric handles afresh (a renamed route is another series).
    pub fn new(
        routes: Vec<RouteConfig>,
        default_upstream: UpstreamUrl,
        defaults: &Policy,
        case_sensitive: bool,
    ) -> Self {
        Routing {
            router: Router::new(
                routes.into_iter().map(|config| Route {
                    metrics: RouteMetrics::new(&config.name),
                    config,
                }),
                case_sensitive,
            ),
            default_upstream,
            default_timeout: defaults.upstream_timeout,
        }
    }
}

/// One worker thread's own parts, built on that thread when it starts and handed to every
/// request it serves: a request, its store commands and its upstream connection all run on one
/// thread, with no hand-off between threads on the hot path.
pub struct WorkerContext {
    pub upstream: UpstreamPool,
    /// This worker's store handle ([`Store::for_worker`]).
    pub store: Arc<dyn Store>,
}

/// One client connection: who is asking, on which worker.
pub struct ClientConn {
    pub addr: ClientAddr,
    pub worker: Arc<WorkerContext>,
    /// What the connection holds while it lives (its `server.max_connections` slot); a tunnel
    /// takes it over, since its socket outlives the HTTP connection.
    pub hold: std::sync::Mutex<Option<Box<dyn std::any::Any + Send>>>,
}

impl ClientConn {
    /// Takes over what the connection holds (see [`ClientConn::hold`]).
    pub fn take_hold(&self) -> Option<Box<dyn std::any::Any + Send>> {
        self.hold
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }
}

/// Everything a request needs; shared by all workers.
pub struct Gateway {
    /// Swapped whole on SIGHUP; each request works on the snapshot it started with.
    routing: ArcSwap<Routing>,
    /// The store as opened: for readiness and for making each worker's handle.
    store: Arc<dyn Store>,
    core: Arc<Core>,
    /// For the upstream pools the workers create ([`Gateway::worker_context`]).
    connect_timeout: Duration,
    /// The cap on connections per upstream that every worker's pool shares.
    upstream_limits: Arc<ConnectionLimits>,
    /// TLS for `https://` upstreams, shared by every worker's pool (and its session cache).
    upstream_tls: Arc<UpstreamTlsConnector>,
    /// Request bodies buffered at once, all requests together.
    budget: Arc<Budget>,
    metrics: Arc<Metrics>,
    /// Set when shutdown begins, so readiness turns false before the listener closes.
    shutting_down: AtomicBool,
}

/// What became of a request: the response, what to count it as, and its key if it had one.
struct Answer {
    response: Response<Body>,
    outcome: Outcome,
    key: Option<StoreKey>,
}

impl Answer {
    fn problem(p: Problem) -> Self {
        Answer {
            outcome: outcome_of(&p),
            response: p.into_response(),
            key: None,
        }
    }
}

impl Gateway {
    /// `connect_timeout` should be below every route's `upstream_timeout`, so that a connection
    /// that could not be made is reported as such (the key released), not as a timeout (unknown).
    pub fn new(
        routing: Routing,
        store: Arc<dyn Store>,
        metrics: Arc<Metrics>,
        connect_timeout: Duration,
        upstream_limits: Arc<ConnectionLimits>,
        upstream_tls: Arc<UpstreamTlsConnector>,
        max_buffered: usize,
    ) -> Self {
        Gateway {
            upstream_limits,
            upstream_tls,
            budget: Budget::new(max_buffered, metrics.buffered()),
            routing: ArcSwap::from_pointee(routing),
            store,
            core: Arc::new(Core::new(Arc::clone(&metrics))),
            connect_timeout,
            metrics,
            shutting_down: AtomicBool::new(false),
        }
    }

    /// A worker's own upstream pool and store handle; called on the worker's thread.
    pub fn worker_context(&self) -> WorkerContext {
        WorkerContext {
            upstream: UpstreamPool::new(
                self.connect_timeout,
                Arc::clone(&self.upstream_limits),
                Arc::clone(&self.upstream_tls),
            ),
            store: self.store.for_worker(),
        }
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Replaces routes and default upstream; requests already running keep their snapshot.
    pub fn reload(&self, routing: Routing) {
        self.routing.store(Arc::new(routing));
    }

    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    /// The idempotency core, for the other fronts (the broker consumers).
    pub fn core(&self) -> &Arc<Core> {
        &self.core
    }

    /// A new upstream pool on the gateway's connection caps and TLS, for a front of its own
    /// (each consumer has one, on the runtime that uses it).
    pub fn upstream_pool(&self) -> UpstreamPool {
        UpstreamPool::new(
            self.connect_timeout,
            Arc::clone(&self.upstream_limits),
            Arc::clone(&self.upstream_tls),
        )
    }

    /// Owner executions still running (detached from their clients).
    pub fn tasks(&self) -> &TaskTracker {
        self.core.tasks()
    }

    /// One request in, one response out; a gRPC client gets the gateway's own answers as gRPC
    /// statuses.
    pub async fn handle(&self, req: Request<ClientBody>, conn: &Arc<ClientConn>) -> Response<Body> {
        // One await point: two would give this future two copies of `classify`'s state to move.
        let grpc = grpc::is_grpc(req.headers());
        let resp = self.classify(req, conn).await;
        if grpc {
            problem::for_grpc(resp)
        } else {
            resp
        }
    }

    /// Phase `classify`: which path a request takes.
    async fn classify(&self, req: Request<ClientBody>, conn: &Arc<ClientConn>) -> Response<Body> {
        let _in_flight = self.metrics.in_flight();
        // Boxed, as the upgrade below: rare paths that would otherwise make every request's
        // future larger, and costlier to move.
        if req.method() == Method::CONNECT {
            return Box::pin(self.connect(req, conn)).await;
        }
        let routing = self.routing.load_full();
        let upgrade = wants_upgrade(&req);
        let Some(route) = routing.router.find(req.method(), req.uri().path()).cloned() else {
            if upgrade {
                let resp = Box::pin(self.tunnel(
                    req,
                    conn,
                    &routing.default_upstream,
                    routing.default_timeout,
                ))
                .await;
                self.metrics
                    .request(self.metrics.unrouted(), Outcome::Passthrough);
                return resp;
            }
            let resp = self
                .pass_through(
                    req.map(body::boxed),
                    conn,
                    &routing.default_upstream,
                    routing.default_timeout,
                    self.metrics.unrouted(),
                )
                .await;
            self.metrics
                .request(self.metrics.unrouted(), Outcome::Passthrough);
            return resp;
        };
        drop(routing);
        if upgrade {
            self.metrics.request(&route.metrics, Outcome::BadRequest);
            return Problem::UpgradeRefused.into_response();
        }
        let started = Instant::now();
        // Boxed: the idempotent path's future is many times the size of the pass-through one,
        // and every future of a request is moved a few times (into hyper's connection state,
        // into the deadline wrapper): unboxed, every pass-through request paid to copy it.
        let answer = Box::pin(self.idempotent(&route, req, conn)).await;
        self.metrics.request(&route.metrics, answer.outcome);
        let resp = answer.response;
        tracing::info!(
            route = %route.config.name,
            key = %answer.key.as_ref().map(StoreKey::short).unwrap_or_else(|| "-".into()),
            outcome = %answer.outcome.as_str(),
            status = resp.status().as_u16(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            upstream_ms = resp.extensions().get::<UpstreamTime>().map(|t| t.0.as_millis() as u64),
            "idempotent request"
        );
        resp
    }

    async fn idempotent(
        &self,
        route: &Arc<Route>,
        req: Request<ClientBody>,
        conn: &Arc<ClientConn>,
    ) -> Answer {
        let config = &route.config;
        let policy = &config.policy;
        let (parts, incoming) = req.into_parts();

        // Phase `identify`: whose operation this is, before anything is read or stored.
        let (scope, quota) = match ClientScope::identify(&parts.headers, &policy.client_headers) {
            Some(scope) => (scope, policy.max_keys_per_client),
            None if policy.require_client => {
                return Answer::problem(Problem::ClientRequired {
                    what: describe_headers(&policy.client_headers),
                })
            }
            // One scope for every caller by the operator's choice: the store's bounds are its
            // quota.
            None if policy.client_headers.is_empty() => (ClientScope::shared(), 0),
            None => (ClientScope::anonymous(), policy.max_keys_anonymous),
        };
        let quota = (quota > 0).then(|| Quota {
            id: QuotaId::new(&config.name, &scope),
            limit: quota,
            window: policy.ttl,
        });

        // Phase `read_body`, first when the key lives in the body (deliveries keyed by message or
        // business id) or the body is signed; otherwise only once the key is known to be valid.
        let mut body = ReqBody::Unread(incoming);
        if config.key.needs_body() || config.signature.is_some() {
            body = match body.read(policy.max_body, &self.budget).await {
                Ok((b, lease)) => ReqBody::Read(b, lease),
                Err(p) => return Answer::problem(p),
            };
        }

        // Phase `verify`: a delivery that its sender did not sign claims no key and reaches no
        // handler.
        if let Some(sig) = &config.signature {
            let checked = signature::verify(sig, &parts.headers, body.bytes(), now_s());
            self.metrics.signature(
                &route.metrics,
                checked.map_or_else(|why| why.as_str(), |()| "verified"),
            );
            if let Err(why) = checked {
                tracing::info!(route = %config.name, scheme = sig.scheme.name(), why = why.as_str(), "delivery signature rejected");
                return Answer::problem(Problem::SignatureRejected { why: why.as_str() });
            }
        }

        // Phase `extract_key`.
        let key = match config.key.extract(&parts.headers, body.bytes()) {
            Ok(Some(k)) => k,
            Ok(None) if !policy.require_key => {
                let response = self
                    .pass_through_route(route, parts, body.into_body(), conn)
                    .await;
                return Answer {
                    response,
                    outcome: Outcome::Passthrough,
                    key: None,
                };
            }
            Ok(None) => {
                return Answer::problem(Problem::MissingKey {
                    what: config.key.describe(),
                })
            }
            Err(reason) => {
                return Answer::problem(Problem::InvalidKey {
                    what: config.key.describe(),
                    reason,
                })
            }
        };
        let store_key = StoreKey::new(&scope, &config.name, &key);
        drop(key);

        let mut answer = match body.read(policy.max_body, &self.budget).await {
            Ok(body) => {
                self.keyed(route, parts, body, conn, &store_key, quota)
                    .await
            }
            Err(p) => Answer::problem(p),
        };
        answer.key = Some(store_key);
        answer
    }

    /// Phase `fingerprint`, then the core.
    async fn keyed(
        &self,
        route: &Arc<Route>,
        parts: request::Parts,
        (body, lease): (Bytes, Lease),
        conn: &Arc<ClientConn>,
        key: &StoreKey,
        quota: Option<Quota>,
    ) -> Answer {
        let config = &route.config;
        let fp = fingerprint(
            &RequestParts {
                method: &parts.method,
                route: &config.name,
                path: parts.uri.path(),
                query: parts.uri.query(),
                headers: &parts.headers,
                body: &body,
            },
            &config.fingerprint_ignore,
        );
        let rules = Rules {
            quota,
            ..Rules::new(&config.policy, config.check_fingerprint)
        };
        let forward = Forward {
            route: Arc::clone(route),
            parts,
            body,
            conn: Arc::clone(conn),
            metrics: Arc::clone(&self.metrics),
            key: *key,
            _lease: lease,
        };
        let decision = self
            .core
            .run(&conn.worker.store, key, fp, rules, forward)
            .await;
        match decision {
            Decision::Owned { settled, took } => {
                let (mut response, outcome) = match settled {
                    Settled::Stored(r) => (r, Outcome::Executed),
                    Settled::Released(r) => (r, Outcome::Released),
                    Settled::NotSent(e) => {
                        let problem = not_sent_problem(&*e);
                        let outcome = outcome_of(&problem);
                        (problem.into_response(), outcome)
                    }
                    Settled::Unknown { reason, retryable } => (
                        Problem::OutcomeUnknown { reason, retryable }.into_response(),
                        Outcome::Unknown,
                    ),
                };
                // For the request's log line; extensions never go on the wire.
                response.extensions_mut().insert(UpstreamTime(took));
                Answer {
                    response,
                    outcome,
                    key: None,
                }
            }
            Decision::Replay { response, waited } => Answer {
                response: replay(&config.policy, &response),
                outcome: if waited {
                    Outcome::Waited
                } else {
                    Outcome::Replayed
                },
                key: None,
            },
            Decision::Refused(refusal) => Answer::problem(refusal_problem(&config.policy, refusal)),
            Decision::Bypass(Forward {
                route, parts, body, ..
            }) => {
                let response = self
                    .pass_through_route(&route, parts, body::full(body), conn)
                    .await;
                Answer {
                    response,
                    outcome: Outcome::StoreError,
                    key: None,
                }
            }
        }
    }

    /// Forwards a request on an idempotent route without idempotency (no key where none is
    /// required, or the store down with `on_store_error = "pass"`).
    async fn pass_through_route(
        &self,
        route: &Route,
        parts: request::Parts,
        body: Body,
        conn: &Arc<ClientConn>,
    ) -> Response<Body> {
        let req = Request::from_parts(parts, body);
        let timeout = route.config.policy.upstream_timeout;
        self.pass_through(req, conn, &route.config.upstream, timeout, &route.metrics)
            .await
    }

    /// A CONNECT: only an HTTP/2 WebSocket (RFC 8441 extended CONNECT, `:protocol websocket`)
    /// is served, as the HTTP/1.1 upgrade its `GET` would be. Any other tunnel would take the
    /// connection out of every rule here; plain CONNECT is for forward proxies, which this is
    /// not.
    async fn connect(&self, req: Request<ClientBody>, conn: &Arc<ClientConn>) -> Response<Body> {
        let websocket = req
            .extensions()
            .get::<hyper::ext::Protocol>()
            .is_some_and(|p| p.as_str().eq_ignore_ascii_case("websocket"));
        if !websocket {
            self.metrics
                .request(self.metrics.unrouted(), Outcome::BadRequest);
            return Problem::MethodNotAllowed.into_response();
        }
        let routing = self.routing.load_full();
        if let Some(route) = routing.router.find(&Method::GET, req.uri().path()) {
            self.metrics.request(&route.metrics, Outcome::BadRequest);
            return Problem::UpgradeRefused.into_response();
        }
        let target = routing.default_upstream.clone();
        let timeout = routing.default_timeout;
        drop(routing);
        let resp = self.tunnel_h2(req, conn, &target, timeout).await;
        self.metrics
            .request(self.metrics.unrouted(), Outcome::Passthrough);
        resp
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
        self.relay(
            client_side,
            upstream_side,
            hold.map(|h| Box::new(h) as Box<dyn std::any::Any + Send>),
        );
        accepted
    }

    /// Relays the two sides of a WebSocket to each other until either closes, in a task that
    /// shutdown waits for (up to its grace); `hold` (the client connection's slot, or its
    /// stream's hold) lives as long.
    fn relay(
        &self,
        client_side: hyper::upgrade::OnUpgrade,
        upstream_side: hyper::upgrade::OnUpgrade,
        hold: Option<Box<dyn std::any::Any + Send>>,
    ) {
        let open = self.metrics.tunnels();
        self.core.tasks().spawn(async move {
            let _hold = hold;
            let (client, upstream) = match tokio::try_join!(client_side, upstream_side) {
                Ok(both) => both,
                Err(e) => {
                    tracing::debug!(error = %e, "upgrade not completed");
                    return;
                }
            };
            open.inc();
            let mut client = hyper_util::rt::TokioIo::new(client);
            let mut upstream = hyper_util::rt::TokioIo::new(upstream);
            if let Err(e) = tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
                tracing::debug!(error = %e, "tunnel ended");
            }
            open.dec();
        });
    }

    /// A protocol upgrade (WebSocket) outside any route: forwarded with its `Upgrade`; if the
    /// upstream switches (101), both sockets are relayed to each other until either side
    /// closes, in a task that shutdown waits for (up to its grace).
    async fn tunnel(
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
        self.relay(client_side, upstream_side, conn.take_hold());
        resp.map(body::boxed)
    }

    /// Forwards a request that is not made idempotent, streaming both ways.
    async fn pass_through(
        &self,
        req: Request<Body>,
        conn: &Arc<ClientConn>,
        target: &UpstreamUrl,
        timeout: Duration,
        metrics: &RouteMetrics,
    ) -> Response<Body> {
        let (mut parts, body) = req.into_parts();
        if prepare_request(&mut parts, target, &conn.addr).is_err() {
            return Problem::UpstreamUnreachable.into_response();
        }
        let req = Request::from_parts(parts, body);
        let started = Instant::now();
        let sent = conn
            .worker
            .upstream
            .send(req, target.protocol, timeout)
            .await;
        self.metrics.upstream(metrics, started.elapsed());
        match sent {
            Ok(resp) => resp.map(body::boxed),
            Err(e) => {
                tracing::warn!(error = %e, "pass-through request failed");
                match e {
                    UpstreamError::NotSent(e) => not_sent_problem(&*e),
                    UpstreamError::Timeout(_) => Problem::UpstreamTimeout,
                    UpstreamError::Failed(_) => Problem::UpstreamFailed,
                }
                .into_response()
            }
        }
    }
}

/// A request body on an idempotent route: still on the wire, or buffered (phase `read_body`)
/// with its share of the memory budget.
enum ReqBody {
    Unread(ClientBody),
    Read(Bytes, Lease),
}

impl ReqBody {
    /// What was buffered so far (nothing while unread).
    fn bytes(&self) -> &[u8] {
        match self {
            ReqBody::Unread(_) => &[],
            ReqBody::Read(b, _) => b,
        }
    }

    /// The whole body, reading it (up to `limit`, within `budget`) unless already read.
    async fn read(self, limit: usize, budget: &Arc<Budget>) -> Result<(Bytes, Lease), Problem> {
        match self {
            ReqBody::Read(b, lease) => Ok((b, lease)),
            ReqBody::Unread(incoming) => {
                let mut lease = budget.lease();
                let read = body::read_within(incoming, limit, &mut lease).await;
                let bytes = read.map_err(|e| match e {
                    ReadError::TooLarge(limit) => Problem::BodyTooLarge { limit },
                    ReadError::Failed(e) if e.is::<BodyTimeout>() => Problem::BodyTimeout,
                    ReadError::Failed(e) if e.is::<OverBudget>() => Problem::Overloaded {
                        what: "memory for request bodies",
                    },
                    ReadError::Failed(_) => Problem::BadRequestBody,
                })?;
                Ok((bytes, lease))
            }
        }
    }

    /// For forwarding as is: streaming if unread.
    fn into_body(self) -> Body {
        match self {
            ReqBody::Unread(incoming) => body::boxed(incoming),
            ReqBody::Read(b, _) => body::full(b),
        }
    }
}

/// How long the upstream took, on responses to requests this gateway executed.
#[derive(Clone, Copy)]
struct UpstreamTime(Duration);

/// How the core executes a request on an idempotent route: forward it and capture the answer,
/// all within `upstream_timeout`.
struct Forward {
    route: Arc<Route>,
    parts: request::Parts,
    body: Bytes,
    conn: Arc<ClientConn>,
    /// Upstream time is counted here, inside the execution, so it is counted too when the
    /// execution finishes on its own after its client left.
    metrics: Arc<Metrics>,
    /// For the log, should the request not even be made.
    key: StoreKey,
    /// The request body's share of `server.max_buffered`, held until the execution is over.
    _lease: Lease,
}

impl Execute for Forward {
    type Output = Response<Body>;

    async fn execute(self) -> Attempt<Response<Body>> {
        let Forward {
            route,
            mut parts,
            body,
            conn,
            metrics,
            key,
            _lease,
        } = self;
        let policy = &route.config.policy;
        if let Err(e) = prepare_request(&mut parts, &route.config.upstream, &conn.addr) {
            tracing::error!(key = key.short(), error = %e, "cannot build upstream request");
            return Attempt::NotSent(Box::new(e));
        }
        let req = Request::from_parts(parts, body::full(body));
        let started = Instant::now();
        let forwarded = forward_and_capture(
            &conn.worker.upstream,
            req,
            route.config.upstream.protocol,
            policy,
        )
        .await;
        metrics.upstream(&route.metrics, started.elapsed());
        let forwarded = match forwarded {
            Ok(f) => f,
            Err(UpstreamError::NotSent(e)) => return Attempt::NotSent(e),
            Err(e) => {
                let reason = match e {
                    UpstreamError::Timeout(_) => UnknownReason::Timeout,
                    _ => UnknownReason::Interrupted,
                };
                return Attempt::Unknown {
                    reason,
                    error: Box::new(e),
                };
            }
        };
        let response = StoredResponse {
            status: forwarded.head.status,
            headers: forwarded
                .head
                .headers
                .iter()
                .map(|(n, v)| (n.clone(), v.clone()))
                .collect(),
            trailers: match &forwarded.body {
                ForwardedBody::Complete(_, Some(t)) => {
                    t.iter().map(|(n, v)| (n.clone(), v.clone())).collect()
                }
                _ => Vec::new(),
            },
            body: match &forwarded.body {
                ForwardedBody::Complete(b, _) => b.clone(),
                ForwardedBody::Streaming { .. } => Bytes::new(),
            },
            body_kept: matches!(forwarded.body, ForwardedBody::Complete(..)),
            completed_ms: 0,
        };
        if grpc::ended_without_status(&response) {
            return Attempt::Unknown {
                reason: UnknownReason::Interrupted,
                error: "the gRPC answer ended without a grpc-status".into(),
            };
        }
        // The upstream's own framing headers still hold: the body is the same bytes.
        let output = Response::from_parts(
            forwarded.head,
            match forwarded.body {
                ForwardedBody::Complete(b, trailers) => body::with_trailers(b, trailers),
                ForwardedBody::Streaming { head, rest } => body::prepend(head, rest),
            },
        );
        Attempt::Answered { response, output }
    }
}

/// Upstream's answer to the owner.
struct Forwarded {
    head: http::response::Parts,
    body: ForwardedBody,
}

enum ForwardedBody {
    /// Within `max_stored_response`: stored and sent as one, with its trailers (gRPC's status).
    Complete(Bytes, Option<http::HeaderMap>),
    /// Too large to store: streamed to the client, replays carry status and headers only.
    Streaming {
        head: Vec<Bytes>,
        rest: UpstreamBody,
    },
}

/// Sends the request and reads the response, all within `upstream_timeout`.
async fn forward_and_capture(
    upstream: &UpstreamPool,
    req: Request<Body>,
    protocol: UpstreamProtocol,
    policy: &Policy,
) -> Result<Forwarded, UpstreamError> {
    let exchange = async {
        let (head, body) = upstream.exchange(req, protocol).await?.into_parts();
        let captured = body::capture(body, policy.max_stored_response)
            .await
            // A body cut off mid-way: the upstream ran, but we do not know what it said.
            .map_err(|e| UpstreamError::Failed(Box::new(e)))?;
        let body = match captured {
            Captured::Complete(b, trailers) => ForwardedBody::Complete(b, trailers),
            Captured::TooLarge { head, rest } => ForwardedBody::Streaming { head, rest },
        };
        Ok(Forwarded { head, body })
    };
    tokio::time::timeout(policy.upstream_timeout, exchange)
        .await
        .unwrap_or(Err(UpstreamError::Timeout(policy.upstream_timeout)))
}

/// The stored response, byte for byte (trailers too), marked as a replay.
fn replay(policy: &Policy, stored: &StoredResponse) -> Response<Body> {
    let trailers = (!stored.trailers.is_empty()).then(|| {
        let mut t = http::HeaderMap::with_capacity(stored.trailers.len());
        for (name, value) in &stored.trailers {
            t.append(name.clone(), value.clone());
        }
        t
    });
    let mut resp = Response::new(body::with_trailers(stored.body.clone(), trailers));
    *resp.status_mut() = stored.status;
    let headers = resp.headers_mut();
    for (name, value) in &stored.headers {
        headers.append(name.clone(), value.clone());
    }
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(stored.body.len()));
    if !stored.body_kept {
        headers.insert(BODY_OMITTED_HEADER, HeaderValue::from_static("true"));
    }
    headers.insert(
        policy.replay_header.clone(),
        HeaderValue::from_static("true"),
    );
    resp
}

/// The problem a refusal is answered with.
fn refusal_problem(policy: &Policy, refusal: Refusal) -> Problem {
    match refusal {
        Refusal::KeyReused => Problem::KeyReused {
            status: policy.mismatch_status,
        },
        Refusal::InFlight => Problem::InFlight {
            retry_after: Duration::from_secs(1),
        },
        Refusal::OutcomeUnknown(reason) => Problem::OutcomeUnknown {
            reason,
            retryable: false,
        },
        Refusal::StoreUnavailable => Problem::StoreUnavailable,
        Refusal::StoreFull => Problem::StoreFull,
        Refusal::OverQuota { retry_after } => Problem::KeyQuota { retry_after },
    }
}

/// An HTTP/1.1 request to switch to WebSocket (`Connection: upgrade`, `Upgrade: websocket`).
/// Other protocols (`h2c`, ...) are not relayed: a raw connection to the upstream in another
/// protocol would bypass every rule here.
fn wants_upgrade<B>(req: &Request<B>) -> bool {
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
            return Err(match e {
                UpstreamError::NotSent(e) => not_sent_problem(&*e),
                UpstreamError::Timeout(_) => Problem::UpstreamTimeout,
                UpstreamError::Failed(_) => Problem::UpstreamFailed,
            }
            .into_response());
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

/// Seconds since the Unix epoch, for signed timestamps (0 if the clock is before 1970).
fn now_s() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// Why a request was not sent: the upstream's connection cap, or the upstream unreachable.
fn not_sent_problem(e: &(dyn std::error::Error + 'static)) -> Problem {
    if e.is::<NoConnectionSlot>() {
        Problem::Overloaded {
            what: "connections to the upstream",
        }
    } else {
        Problem::UpstreamUnreachable
    }
}

/// What a response the gateway made itself counts as.
fn outcome_of(p: &Problem) -> Outcome {
    match p {
        Problem::MissingKey { .. } => Outcome::MissingKey,
        Problem::InvalidKey { .. } => Outcome::InvalidKey,
        Problem::KeyReused { .. } => Outcome::Mismatch,
        Problem::InFlight { .. } => Outcome::InFlightRejected,
        Problem::BodyTooLarge { .. } => Outcome::TooLarge,
        Problem::BadRequestBody
        | Problem::BodyTimeout
        | Problem::MethodNotAllowed
        | Problem::ClientRequired { .. }
        | Problem::SignatureRejected { .. }
        | Problem::UpgradeRefused => Outcome::BadRequest,
        Problem::StoreUnavailable | Problem::StoreFull => Outcome::StoreError,
        Problem::KeyQuota { .. } | Problem::Overloaded { .. } => Outcome::Limited,
        Problem::UpstreamUnreachable | Problem::UpstreamTimeout | Problem::UpstreamFailed => {
            Outcome::UpstreamError
        }
        Problem::OutcomeUnknown { .. } => Outcome::Unknown,
    }
}

/// "the Authorization header", "the Authorization or Cookie header".
fn describe_headers(names: &[http::HeaderName]) -> String {
    let names: Vec<&str> = names.iter().map(http::HeaderName::as_str).collect();
    format!("the {} header", names.join(" or "))
}
