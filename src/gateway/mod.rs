//! The HTTP front: what happens to one request, phase by phase, in front of the idempotency
//! core ([`crate::idempotency`]).
//!
//! ```text
//! classify ─ no route (routed as a POST's method override) ──────────▶ pass_through (streams)
//!    │ idempotent route   (override unreadable ▶ 400 problem)
//! identify ──── no client header + require_client ─▶ 401 problem
//! verify ────── signed route, signature fails ──────▶ 401 problem (body read first, nothing stored)
//! extract_key ─ missing/invalid ─▶ 400 problem   (missing + require_key=false ▶ pass_through)
//! verify_token  client_jwt, token does not verify ▶ 401 problem (keys not loaded ▶ 503)
//! read_body ─── over max_body ───▶ 413 problem   (counted while reading, upstream not called)
//!               over max_buffered ▶ 503 problem
//! decode ────── Content-Encoding (after verify, before a key in the body is read):
//!               over max_body decoded ▶ 413, unknown or over 2 codings ▶ 415, broken ▶ 400
//! fingerprint
//! core ─────── Owned ──▶ the upstream's answer (stored), or its problem (unreachable, unknown)
//!    │         Replay ─▶ the stored response, byte for byte, marked
//!    │         Refused ▶ problem (mismatch, in flight, outcome unknown, store down/full)
//!    └──────── Bypass ─▶ pass_through (on_store_error = "pass")
//! ```
//! The phases are in [`phases`] ([`method_override`] for classify, [`received`] and [`coding`]
//! for read_body and decode); the core executes through [`forward`] (send upstream and
//! capture the answer within `upstream_timeout`); WebSockets outside the routes are relayed by
//! [`tunnel`]. Every response the gateway makes itself comes from [`Problem`].

mod coding;
mod forward;
mod method_override;
mod phases;
mod received;
mod spans;
mod tunnel;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use arc_swap::ArcSwap;
use http::{request, HeaderName, Method, Request, Response};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::body::{self, Body, Budget};
use crate::config::answers::Answers;
use crate::config::identity::KeyIdentity;
use crate::config::{
    Policy, RouteConfig, ServerConfig, UpstreamUrl, CLIENT_SUBJECT_HEADER, CLIENT_URI_HEADER,
};
use crate::conn::{ClientBody, ConnectionSlot};
use crate::grpc;
use crate::idempotency::legacy::LegacyWindow;
use crate::idempotency::Core;
use crate::jwt::{Verifier, Verifiers};
use crate::key::StoreKey;
use crate::metrics::{Metrics, Outcome, RouteMetrics};
use crate::problem::{self, Problem};
use crate::reconcile::Reconciler;
use crate::route::{RoutePattern, Routed, Router};
use crate::store::seal::Sealer;
use crate::store::Store;
use crate::telemetry::span::Trace;
use crate::telemetry::traces::Traces;
use crate::tls::CertificateIds;
use crate::upstream::{
    prepare_request, ClientAddr, ConnectionLimits, PoolTimeouts, UpstreamPool, UpstreamTlsConnector,
};
use forward::{upstream_problem, UpstreamTime};
use method_override::{Overridden, Override};
use spans::{end_span, log_span, request_span};
use tracing::Instrument as _;
use tunnel::wants_upgrade;

/// A route as the gateway runs it: its config, and its live metric series beside it.
pub struct Route {
    pub config: RouteConfig,
    pub metrics: RouteMetrics,
    /// Verifies the route's client tokens (`client_jwt`); shared with routes of the same table.
    jwt: Option<Arc<Verifier>>,
    /// Whether the log has said that this route's client header carries JWTs.
    jwt_noticed: AtomicBool,
}

/// A request to a guarded path no handler acts on: a GET, HEAD or OPTIONS without a body (a CORS
/// preflight, a sender's URL challenge such as Meta's `hub.challenge`).
fn harmless<B: http_body::Body>(req: &Request<B>) -> bool {
    // The headers, and the body itself: an HTTP/2 request may carry DATA frames with neither
    // `Content-Length` nor `Transfer-Encoding`; only one whose stream ended with its headers
    // has none.
    // `Content-Length: 0` is enforced by HTTP/2 too, whenever its END_STREAM comes.
    let bodiless = !req.headers().contains_key(http::header::TRANSFER_ENCODING)
        && match req.headers().get(http::header::CONTENT_LENGTH) {
            Some(length) => length.as_bytes() == b"0",
            None => req.body().is_end_stream(),
        };
    bodiless && matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS)
}

/// A refusal made before a request has its route: boxed, as it is rare and a response is large.
type Refused = Box<Response<Body>>;

/// `405 method-not-allowed` for a request to `guard`'s path that is not its own, in that
/// route's answers.
fn guarded_path(guard: &Route) -> Response<Body> {
    let allow: Vec<&str> = guard.config.methods.iter().map(Method::as_str).collect();
    guard.refuse(Problem::GuardedPath {
        allow: allow.join(", "),
    })
}

impl Route {
    /// The route's answer to `problem`: its hint headers and error body.
    fn refuse(&self, problem: Problem) -> Response<Body> {
        problem::restyle(problem.into_response(), &self.config.policy.answers)
    }

    /// Whether the route protects its path against other methods and spellings: it verifies
    /// its sender (`signature`) or requires its client (`require_client`).
    fn guards_its_path(&self) -> bool {
        self.config.signature.is_some() || self.config.policy.require_client
    }
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
    /// `server.method_override_header`.
    method_override: Option<HeaderName>,
    /// `[defaults]`' hint headers and error body, for answers outside any route.
    answers: Answers,
}

impl Routing {
    /// What a config says about routing: at startup and on every reload. A reload starts every
    /// route's metric handles afresh (a renamed route is another series), and keeps the
    /// verifiers (their key sets and caches) of `client_jwt` tables that did not change.
    pub fn new(
        routes: Vec<RouteConfig>,
        default_upstream: UpstreamUrl,
        defaults: &Policy,
        server: &ServerConfig,
        verifiers: &Verifiers,
    ) -> Self {
        Routing {
            router: Router::new(
                routes.into_iter().map(|config| Route {
                    metrics: RouteMetrics::new(&config.name),
                    jwt: config.policy.client_jwt.as_ref().map(|j| verifiers.get(j)),
                    jwt_noticed: AtomicBool::new(false),
                    config,
                }),
                server.case_sensitive_routes,
            ),
            default_upstream,
            default_timeout: defaults.upstream_timeout,
            method_override: server.method_override_header.clone(),
            answers: defaults.answers.clone(),
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
    /// The connection's `server.max_connections` slot while it lives; a tunnel takes it over,
    /// since its socket outlives the HTTP connection.
    slot: std::sync::Mutex<Option<ConnectionSlot>>,
    /// The subject and URIs of the client's certificate, where the listener verified it: what
    /// every request of the connection carries as [`CLIENT_SUBJECT_HEADER`] and
    /// [`CLIENT_URI_HEADER`].
    certificate: CertificateIds,
}

impl ClientConn {
    pub fn new(addr: ClientAddr, worker: Arc<WorkerContext>, slot: ConnectionSlot) -> Self {
        ClientConn {
            addr,
            worker,
            slot: std::sync::Mutex::new(Some(slot)),
            certificate: CertificateIds::default(),
        }
    }

    /// A client whose certificate the listener verified (`server.tls_client_ca`).
    pub fn with_certificate(self, certificate: CertificateIds) -> Self {
        ClientConn {
            certificate,
            ..self
        }
    }

    /// Takes over the connection's slot (see [`ClientConn::new`]); `None` once taken.
    pub fn take_slot(&self) -> Option<ConnectionSlot> {
        self.slot
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
    pool_timeouts: PoolTimeouts,
    /// The cap on connections per upstream that every worker's pool shares.
    upstream_limits: Arc<ConnectionLimits>,
    /// TLS for `https://` upstreams, shared by every worker's pool (and its session cache).
    upstream_tls: Arc<UpstreamTlsConnector>,
    /// Request bodies buffered at once, all requests together.
    budget: Arc<Budget>,
    metrics: Arc<Metrics>,
    /// Set when shutdown begins, so readiness turns false before the listener closes.
    shutting_down: AtomicBool,
    /// Cancelled when draining starts: every relayed WebSocket closes.
    tunnels: CancellationToken,
    /// How every route this process has served since it started derived its keys, removed
    /// routes too ([`Gateway::served`]).
    served: std::sync::Mutex<Vec<KeyIdentity>>,
    /// The `client_jwt` verifiers the routes use, for reloads to share.
    verifiers: Arc<Verifiers>,
    /// When keys of older derivations (client scope, typed key parts) are looked up too.
    legacy: LegacyWindow,
    /// Spans over OTLP (`[telemetry]`); `None`: none made.
    traces: Option<Arc<Traces>>,
    /// The keys the store seals with (`store.encryption_keys_*`), for reloads, readiness and
    /// metrics; `None`: records in the clear.
    sealer: Option<Arc<Sealer>>,
}

/// What a gateway is made of; [`Gateway::new`] takes it.
pub struct GatewayParts {
    pub routing: Routing,
    pub store: Arc<dyn Store>,
    pub metrics: Arc<Metrics>,
    /// The connect timeout should be below every route's `upstream_timeout`, so that a
    /// connection that could not be made is reported as such (the key released), not as a
    /// timeout (unknown); the idle one is `upstream.idle_timeout`.
    pub pool_timeouts: PoolTimeouts,
    pub upstream_limits: Arc<ConnectionLimits>,
    pub upstream_tls: Arc<UpstreamTlsConnector>,
    /// `server.max_buffered`.
    pub max_buffered: usize,
    /// The registry `routing` took its `client_jwt` verifiers from.
    pub verifiers: Arc<Verifiers>,
    /// Whether the store keeps records across restarts (all but `memory`).
    pub durable_store: bool,
    /// `[telemetry]`'s spans, when configured.
    pub traces: Option<Arc<Traces>>,
    /// The keys `store` seals with, when configured.
    pub sealer: Option<Arc<Sealer>>,
}

impl Gateway {
    pub fn new(parts: GatewayParts) -> Self {
        let GatewayParts {
            routing,
            store,
            metrics,
            pool_timeouts,
            upstream_limits,
            upstream_tls,
            max_buffered,
            verifiers,
            durable_store,
            traces,
            sealer,
        } = parts;
        let legacy = LegacyWindow::new(durable_store);
        let reconciler = Reconciler::new(
            Arc::clone(&metrics),
            Arc::clone(&upstream_tls),
            Arc::clone(&upstream_limits),
        );
        let core = Arc::new(Core::new(Arc::clone(&metrics), Arc::new(reconciler)));
        Gateway {
            upstream_limits,
            upstream_tls,
            budget: Budget::new(max_buffered, metrics.buffered()),
            served: std::sync::Mutex::new(identities(&routing)),
            routing: ArcSwap::from_pointee(routing),
            store,
            core,
            pool_timeouts,
            metrics,
            shutting_down: AtomicBool::new(false),
            tunnels: CancellationToken::new(),
            verifiers,
            legacy,
            traces,
            sealer,
        }
    }

    /// The keys the store seals with, when `store.encryption_keys_*` is set.
    pub fn sealer(&self) -> Option<&Arc<Sealer>> {
        self.sealer.as_ref()
    }

    /// A worker's own upstream pool and store handle; called on the worker's thread.
    pub fn worker_context(&self) -> WorkerContext {
        WorkerContext {
            upstream: UpstreamPool::new(
                self.pool_timeouts,
                Arc::clone(&self.upstream_limits),
                Arc::clone(&self.upstream_tls),
            ),
            store: self.store.for_worker(),
        }
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// The `client_jwt` verifiers, for a reload's routing to share.
    pub fn verifiers(&self) -> &Verifiers {
        &self.verifiers
    }

    /// Why a route cannot verify client tokens yet (its key set not loaded), for `/readyz`.
    pub fn tokens_not_ready(&self) -> Option<String> {
        (self.routes().iter())
            .find_map(|r| {
                r.jwt
                    .as_ref()
                    .and_then(|v| v.not_ready())
                    .map(|why| (r, why))
            })
            .map(|(r, why)| format!("route {:?}: {why}", r.config.name))
    }

    /// The routes as they are now (a reload replaces them).
    pub fn routes(&self) -> Vec<Arc<Route>> {
        self.routing.load().router.routes().to_vec()
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Replaces routes and default upstream; requests already running keep their snapshot.
    pub fn reload(&self, routing: Routing) {
        let mut served = self.served.lock().unwrap_or_else(PoisonError::into_inner);
        for id in identities(&routing) {
            if !served.contains(&id) {
                served.push(id);
            }
        }
        drop(served);
        self.routing.store(Arc::new(routing));
    }

    /// How every route served since startup derived its keys, removed ones too: a reload is
    /// checked against all of them, since a route removed by one reload and brought back under
    /// another name by the next would change its keys in two steps that each look harmless.
    pub fn served(&self) -> Vec<KeyIdentity> {
        self.served
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }

    /// Closes every relayed WebSocket, and any that completes its upgrade from now on.
    pub fn close_tunnels(&self) {
        self.tunnels.cancel();
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    /// The idempotency core, for the other fronts (the broker consumers).
    pub fn core(&self) -> &Arc<Core> {
        &self.core
    }

    /// When keys of older derivations are looked up too (consumers share it).
    pub fn legacy(&self) -> LegacyWindow {
        self.legacy
    }

    /// A new upstream pool on the gateway's connection caps and TLS, for a front of its own
    /// (each consumer has one, on the runtime that uses it).
    pub fn upstream_pool(&self) -> UpstreamPool {
        UpstreamPool::new(
            self.pool_timeouts,
            Arc::clone(&self.upstream_limits),
            Arc::clone(&self.upstream_tls),
        )
    }

    /// The spans exporter, when `[telemetry]` is configured.
    pub fn traces(&self) -> Option<&Arc<Traces>> {
        self.traces.as_ref()
    }

    /// Owner executions still running (detached from their clients).
    pub fn tasks(&self) -> &TaskTracker {
        self.core.tasks()
    }

    /// One request in, one response out; a gRPC client gets the gateway's own answers as gRPC
    /// statuses.
    pub async fn handle(
        &self,
        mut req: Request<ClientBody>,
        conn: &Arc<ClientConn>,
    ) -> Response<Body> {
        certificate_headers(req.headers_mut(), &conn.certificate);
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
    async fn classify(
        &self,
        mut req: Request<ClientBody>,
        conn: &Arc<ClientConn>,
    ) -> Response<Body> {
        let _in_flight = self.metrics.in_flight();
        // Boxed, as the upgrade below: rare paths that would otherwise make every request's
        // future larger, and costlier to move.
        if req.method() == Method::CONNECT {
            // In the answers of the config it was decided by (restyled there).
            return Box::pin(self.connect(req, conn)).await;
        }
        let routing = self.routing.load_full();
        let upgrade = wants_upgrade(&req);
        let (found, over) = match self.route_of(&routing, &req) {
            Ok(routed) => routed,
            Err(refused) => return *refused,
        };
        let Some(route) = found else {
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
                return problem::restyle(resp, &routing.answers);
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
            return problem::restyle(resp, &routing.answers);
        };
        drop(routing);
        if upgrade {
            self.metrics.request(&route.metrics, Outcome::BadRequest);
            return route.refuse(Problem::UpgradeRefused);
        }
        match over {
            Override::None => {}
            Override::To(method) => {
                req.extensions_mut().insert(Overridden(method));
            }
            Override::Unreadable => {
                self.metrics.request(&route.metrics, Outcome::BadRequest);
                return route.refuse(Problem::InvalidMethodOverride);
            }
        }
        let started = Instant::now();
        // Boxed: the idempotent path's future is many times the size of the pass-through one,
        // and every future of a request is moved a few times (into hyper's connection state,
        // into the deadline wrapper): unboxed, every pass-through request paid to copy it.
        let span = self
            .traces
            .as_deref()
            .map(|t| request_span(t, &route, &mut req, conn));
        // With traces on, the request's log lines carry its trace_id and span_id.
        let logs = span.as_ref().map(log_span);
        let idempotent = self.idempotent(&route, req, conn);
        let answer = match &logs {
            Some(logs) => Box::pin(idempotent.instrument(logs.clone())).await,
            None => Box::pin(idempotent).await,
        };
        self.metrics.request(&route.metrics, answer.outcome);
        if let Some(trace) = &span {
            end_span(trace, &answer);
        }
        let resp = answer.response;
        let _logs = logs.as_ref().map(tracing::Span::enter);
        tracing::info!(
            route = %route.config.name,
            key = %answer.key.as_ref().map(StoreKey::short).unwrap_or_else(|| "-".into()),
            outcome = %answer.outcome.as_str(),
            status = resp.status().as_u16(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            upstream_ms = resp.extensions().get::<UpstreamTime>().map(|t| t.0.as_millis() as u64),
            "idempotent request"
        );
        problem::restyle(resp, &route.config.policy.answers)
    }

    /// The routing decision of `classify`: the route the request belongs to (none: pass-through)
    /// and what its override header says, or the refusal when the override would loosen the
    /// POST's own route, or the path is a guarded route's that this request is not (in the
    /// answers of the route it concerns).
    fn route_of<B: http_body::Body>(
        &self,
        routing: &Routing,
        req: &Request<B>,
    ) -> Result<(Option<Arc<Route>>, Override), Refused> {
        let over = method_override::of(
            req.method(),
            req.headers(),
            routing.method_override.as_ref(),
        );
        // An override finds the route of the method it names; a POST it names no route for
        // stays on its own (its key, signature and client checks), never passed through.
        let path = req.uri().path();
        let own = routing.router.find(req.method(), path);
        let found = match &over {
            Override::To(method) => match routing.router.find(method, path) {
                Some(named)
                    if own.is_some_and(|own| !method_override::keeps_guards(named, own)) =>
                {
                    self.metrics.request(&named.metrics, Outcome::BadRequest);
                    return Err(Box::new(named.refuse(Problem::InvalidMethodOverride)));
                }
                named => named.or(own),
            },
            Override::None | Override::Unreadable => own,
        };
        // A path a signed or client-checked route protects is refused to anything but that
        // route, so no other method or spelling reaches its upstream unchecked: asked when no
        // route was found, or when a looser reading of the path could be another route's.
        let loose = path.contains(['%', '\\', ';']);
        if found.is_none() || loose {
            if let Some(guard) = routing.router.guarded(path, Route::guards_its_path, found) {
                if !harmless(req) {
                    self.metrics.request(&guard.metrics, Outcome::BadRequest);
                    return Err(Box::new(guarded_path(guard)));
                }
            }
        }
        Ok((found.cloned(), over))
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
        let span = match parts.extensions.get::<Trace>() {
            // A keyed request sent on without idempotency (`on_store_error = "pass"`): its
            // span is the upstream's parent, and ends with it.
            Some(trace) => {
                trace.hand_on(&mut parts.headers);
                None
            }
            None => (self.traces.as_deref())
                .filter(|t| t.passthrough())
                .map(|t| spans::passthrough_span(t, &mut parts, conn)),
        };
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
        let resp = match sent {
            Ok(resp) => resp.map(body::boxed),
            Err(e) => {
                tracing::warn!(error = %e, "pass-through request failed");
                upstream_problem(e).into_response()
            }
        };
        if let Some(span) = span {
            spans::end_passthrough_span(&span, resp.status().as_u16());
        }
        resp
    }
}

/// The certificate headers are the gateway's alone: whatever a client sent under those names
/// (or any spelling with `_` for `-`, which CGI-style servers read as the same) never reaches
/// anyone, and a verified client's certificate subject and URIs take their place.
fn certificate_headers(headers: &mut http::HeaderMap, certificate: &CertificateIds) {
    // A length first: one pass over the names (a few, and no hashing) spares nearly every
    // request the comparisons.
    let twin = |n: &http::HeaderName| {
        let n = n.as_str();
        (n.len() == SUBJECT_LEN || n.len() == URI_LEN)
            && [CLIENT_SUBJECT_HEADER, CLIENT_URI_HEADER].iter().any(|h| {
                n.bytes()
                    .zip(h.bytes())
                    .all(|(a, b)| a == b || (a == b'_' && b == b'-'))
                    && n.len() == h.len()
            })
    };
    if headers.keys().any(twin) {
        let names: Vec<http::HeaderName> = headers.keys().filter(|n| twin(n)).cloned().collect();
        for name in names {
            headers.remove(name);
        }
    }
    if let Some(subject) = &certificate.subject {
        headers.insert(CLIENT_SUBJECT_HEADER, subject.clone());
    }
    if let Some(uri) = &certificate.uri {
        headers.insert(CLIENT_URI_HEADER, uri.clone());
    }
}

const SUBJECT_LEN: usize = CLIENT_SUBJECT_HEADER.len();
const URI_LEN: usize = CLIENT_URI_HEADER.len();

/// How the routes of `routing` derive their keys.
fn identities(routing: &Routing) -> Vec<KeyIdentity> {
    (routing.router.routes().iter())
        .map(|r| KeyIdentity::of(&r.config))
        .collect()
}
