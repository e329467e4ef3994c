//! The idempotency state machine: what happens to one request, phase by phase.
//!
//! ```text
//! classify ─ no route ───────────────────────────────────────────────▶ pass_through (streams)
//!    │ idempotent route
//! extract_key ─ missing/invalid ─▶ 400 problem   (missing + require_key=false ▶ pass_through)
//! read_body ─── over max_body ───▶ 413 problem   (counted while reading, upstream not called)
//! fingerprint
//! reserve ───── store down/full ─▶ 503 problem
//!    ├─ Owner ──▶ execute: forward (lease renewed) ─▶ settle: complete | release | mark_unknown
//!    └─ Existing ▶ resolve: other fingerprint ─▶ mismatch problem (record untouched)
//!                   completed ─▶ replay (byte for byte, marked)
//!                   unknown ───▶ outcome-unknown problem (never re-executed)
//!                   pending ───▶ wait (woken by the store) ─▶ replay | 409 in-flight | reserve again
//! ```
//! The owner's work outlives its client: if the client disconnects, the work moves to a task of
//! its own ([`Detachable`]), the upstream call still finishes and its result is stored for the
//! retry that is surely coming.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{header, request, HeaderValue, Request, Response, StatusCode};
use hyper::body::Incoming;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use crate::body::{self, Body, Captured, ReadError};
use crate::config::{OnStoreError, OnUnknown, Policy, RouteConfig, UpstreamUrl};
use crate::fingerprint::{fingerprint, Fingerprint, RequestParts};
use crate::key::{ClientScope, StoreKey};
use crate::metrics::{Metrics, RouteMetrics};
use crate::problem::Problem;
use crate::route::Router;
use crate::store::{
    now_ms, OwnerToken, Record, RecordState, Reservation, Store, StoreError, StoredResponse,
    UnknownReason,
};
use crate::upstream::{prepare_request, Peer, UpstreamBody, UpstreamClient, UpstreamError};

/// How often a waiting duplicate re-reads the record even without a signal: catches an owner
/// whose lease ran out (it sends no signal when it dies).
const RECHECK: Duration = Duration::from_secs(1);
/// Header on a replay whose body was too large to keep: the body is deliberately empty.
pub const BODY_OMITTED_HEADER: &str = "idemgate-body-omitted";
/// A waiter whose key keeps being released and re-taken gives up after this many rounds.
const MAX_RESERVE_ROUNDS: usize = 8;

/// What became of a request, for logs and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Executed,
    Replayed,
    Waited,
    Mismatch,
    InFlightRejected,
    MissingKey,
    InvalidKey,
    TooLarge,
    BadRequest,
    StoreError,
    UpstreamError,
    Unknown,
    Passthrough,
}

impl Outcome {
    /// How many outcomes there are, for per-route metric handles indexed by `outcome as usize`
    /// (`Passthrough` stays the last variant).
    pub const COUNT: usize = Outcome::Passthrough as usize + 1;

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Executed => "executed",
            Outcome::Replayed => "replayed",
            Outcome::Waited => "waited",
            Outcome::Mismatch => "mismatch",
            Outcome::InFlightRejected => "in_flight_rejected",
            Outcome::MissingKey => "missing_key",
            Outcome::InvalidKey => "invalid_key",
            Outcome::TooLarge => "too_large",
            Outcome::BadRequest => "bad_request",
            Outcome::StoreError => "store_error",
            Outcome::UpstreamError => "upstream_error",
            Outcome::Unknown => "unknown",
            Outcome::Passthrough => "passthrough",
        }
    }

    fn of_problem(p: &Problem) -> Self {
        match p {
            Problem::MissingKey { .. } => Outcome::MissingKey,
            Problem::InvalidKey { .. } => Outcome::InvalidKey,
            Problem::KeyReused { .. } => Outcome::Mismatch,
            Problem::InFlight { .. } => Outcome::InFlightRejected,
            Problem::BodyTooLarge { .. } => Outcome::TooLarge,
            Problem::BadRequestBody => Outcome::BadRequest,
            Problem::StoreUnavailable | Problem::StoreFull => Outcome::StoreError,
            Problem::UpstreamUnreachable | Problem::UpstreamTimeout | Problem::UpstreamFailed => {
                Outcome::UpstreamError
            }
            Problem::OutcomeUnknown { .. } => Outcome::Unknown,
        }
    }
}

/// What a config reload replaces: the routes, the default upstream and its timeout.
pub struct Routing {
    pub router: Router,
    pub default_upstream: UpstreamUrl,
    /// `[defaults] upstream_timeout`, for pass-through traffic outside any route.
    pub default_timeout: Duration,
}

impl Routing {
    /// What a config says about routing: at startup and on every reload.
    pub fn new(routes: Vec<RouteConfig>, default_upstream: UpstreamUrl, defaults: &Policy) -> Self {
        Routing {
            router: Router::new(routes),
            default_upstream,
            default_timeout: defaults.upstream_timeout,
        }
    }
}

/// One client connection as the gateway sees it: who is asking, and the upstream pool of the
/// worker thread that serves the connection.
pub struct Conn {
    pub peer: Peer,
    pub upstream: UpstreamClient,
}

/// Everything a request needs; shared by all connections.
pub struct Gateway {
    /// Swapped whole on SIGHUP; each request works on the snapshot it started with.
    routing: ArcSwap<Routing>,
    store: Arc<dyn Store>,
    /// For the upstream pools the workers create ([`Gateway::upstream_pool`]).
    connect_timeout: Duration,
    metrics: Arc<Metrics>,
    /// Set when shutdown begins, so readiness turns false before the listener closes.
    shutting_down: AtomicBool,
    /// Owner executions, detached from their client connections; shutdown waits for them.
    tasks: TaskTracker,
}

/// What the store says about a key that already exists, once waited on if need be.
enum Resolved {
    Respond(Response<Body>, Outcome),
    /// The key was released while we waited: the request may run now.
    Released,
    /// Abandoned or unknown, and the route allows running it again: take over this record.
    TakeOver(Record),
}

impl Gateway {
    /// `store` should already be wrapped for metrics ([`crate::store::instrumented`]).
    /// `connect_timeout` should be below every route's `upstream_timeout`, so that a connection
    /// that could not be made is reported as such (the key released), not as a timeout (unknown).
    pub fn new(
        routing: Routing,
        store: Arc<dyn Store>,
        metrics: Arc<Metrics>,
        connect_timeout: Duration,
    ) -> Self {
        Gateway {
            routing: ArcSwap::from_pointee(routing),
            store,
            connect_timeout,
            metrics,
            shutting_down: AtomicBool::new(false),
            tasks: TaskTracker::new(),
        }
    }

    /// A new upstream connection pool. Each worker thread makes its own, so a request and the
    /// upstream connection that carries it are served by the same thread (no hand-off between
    /// threads on the hot path); the cost is one idle pool per worker.
    pub fn upstream_pool(&self) -> UpstreamClient {
        UpstreamClient::new(self.connect_timeout)
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The routing in force now.
    pub fn routing(&self) -> Arc<Routing> {
        self.routing.load_full()
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

    /// Owner executions still running (detached from their clients).
    pub fn tasks(&self) -> &TaskTracker {
        &self.tasks
    }

    /// Phase `classify`: one request in, one response out.
    pub async fn handle(
        self: &Arc<Self>,
        req: Request<Incoming>,
        conn: &Arc<Conn>,
    ) -> Response<Body> {
        let _in_flight = self.metrics.in_flight();
        let routing = self.routing.load_full();
        let Some(route) = routing.router.find(req.method(), req.uri().path()).cloned() else {
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
        let started = Instant::now();
        let (resp, outcome, key) = self.idempotent(route.clone(), req, conn).await;
        self.metrics.request(&route.metrics, outcome);
        tracing::info!(
            route = %route.name,
            key = %key.as_ref().map(StoreKey::short).unwrap_or_else(|| "-".into()),
            outcome = %outcome.as_str(),
            status = resp.status().as_u16(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            upstream_ms = resp.extensions().get::<UpstreamTime>().map(|t| t.0.as_millis() as u64),
            "idempotent request"
        );
        resp
    }

    async fn idempotent(
        self: &Arc<Self>,
        route: Arc<RouteConfig>,
        req: Request<Incoming>,
        conn: &Arc<Conn>,
    ) -> (Response<Body>, Outcome, Option<StoreKey>) {
        let policy = &route.policy;
        let (parts, incoming) = req.into_parts();

        // Phase `read_body`, first when the key lives in the body (deliveries keyed by message or
        // business id); otherwise only once the key is known to be valid.
        let mut body = ReqBody::Unread(incoming);
        if route.key.needs_body() {
            body = match body.read(policy.max_body).await {
                Ok(b) => ReqBody::Read(b),
                Err(p) => return problem(p),
            };
        }

        // Phase `extract_key`.
        let key = match route.key.extract(&parts.headers, body.bytes()) {
            Ok(Some(k)) => k,
            Ok(None) if !policy.require_key => {
                let resp = self
                    .pass_through_route(&route, parts, body.into_body(), conn)
                    .await;
                return (resp, Outcome::Passthrough, None);
            }
            Ok(None) => {
                return problem(Problem::MissingKey {
                    what: route.key.describe(),
                })
            }
            Err(reason) => {
                return problem(Problem::InvalidKey {
                    what: route.key.describe(),
                    reason,
                })
            }
        };
        let scope = ClientScope::of(&parts.headers, policy.client_header.as_ref());
        let store_key = StoreKey::new(&scope, &route.name, &key);
        drop(key);

        let done = match body.read(policy.max_body).await {
            Ok(body) => self.run_keyed(&route, parts, body, conn, &store_key).await,
            Err(p) => Err(p),
        };
        let (resp, outcome) = done.unwrap_or_else(answer);
        (resp, outcome, Some(store_key))
    }

    async fn run_keyed(
        self: &Arc<Self>,
        route: &Arc<RouteConfig>,
        parts: request::Parts,
        body: Bytes,
        conn: &Arc<Conn>,
        key: &StoreKey,
    ) -> Result<(Response<Body>, Outcome), Problem> {
        let policy = &route.policy;

        // Phase `fingerprint`.
        let fp = fingerprint(
            &RequestParts {
                method: &parts.method,
                route: &route.name,
                path: parts.uri.path(),
                query: parts.uri.query(),
                headers: &parts.headers,
                body: &body,
            },
            &route.fingerprint_ignore,
        );

        // Phase `reserve`, then `execute` or `resolve`.
        let wait_until = Instant::now() + policy.wait;
        for _ in 0..MAX_RESERVE_ROUNDS {
            let reservation = match self
                .store
                .reserve(key, fp, policy.lock_timeout, policy.ttl)
                .await
            {
                Ok(r) => r,
                // A record that exists but cannot be read: its outcome is unknown, and it must
                // never be forwarded, whatever on_store_error says.
                Err(StoreError::Corrupt(e)) => {
                    tracing::error!(key = key.short(), error = %e, "unreadable record");
                    return Err(Problem::OutcomeUnknown {
                        reason: UnknownReason::Interrupted,
                        retryable: false,
                    });
                }
                Err(e) if policy.on_store_error == OnStoreError::Pass => {
                    // The operator chose availability over duplicates for this route.
                    tracing::warn!(key = key.short(), error = %e, "store unavailable; forwarding without idempotency (on_store_error = \"pass\")");
                    let resp = self
                        .pass_through_route(route, parts, body::full(body), conn)
                        .await;
                    return Ok((resp, Outcome::StoreError));
                }
                Err(e) => return Err(store_problem(key, e)),
            };
            match reservation {
                Reservation::Owner(token) => {
                    return Ok(self.execute(route, parts, body, key, token, conn).await);
                }
                Reservation::Existing(record) => {
                    match self.resolve(route, key, fp, record, wait_until).await? {
                        Resolved::Respond(resp, outcome) => return Ok((resp, outcome)),
                        Resolved::Released => continue,
                        Resolved::TakeOver(old) => {
                            let taken = self
                                .store
                                .take_over(key, &old, fp, policy.lock_timeout, policy.ttl)
                                .await
                                .map_err(|e| store_problem(key, e))?;
                            if let Some(token) = taken {
                                tracing::warn!(key = key.short(), "taking over an abandoned or unknown key (on_unknown = \"retry\")");
                                return Ok(self
                                    .execute(route, parts, body, key, token, conn)
                                    .await);
                            }
                        }
                    }
                }
            }
        }
        Err(Problem::InFlight {
            retry_after: Duration::from_secs(1),
        })
    }

    /// Phase `resolve`: answer from an existing record, waiting while it is pending.
    async fn resolve(
        &self,
        route: &RouteConfig,
        key: &StoreKey,
        fp: Fingerprint,
        record: Record,
        wait_until: Instant,
    ) -> Result<Resolved, Problem> {
        if let Some(done) = settled(route, fp, &record, false)? {
            return Ok(done);
        }
        // Pending: subscribe first, then re-read (saying we wait), so a completion in between is
        // not missed.
        let mut sub = self.store.subscribe(key);
        loop {
            let record = self
                .store
                .get_watched(key)
                .await
                .map_err(|e| store_problem(key, e))?;
            let Some(record) = record else {
                return Ok(Resolved::Released);
            };
            if let Some(done) = settled(route, fp, &record, true)? {
                return Ok(done);
            }
            let now = Instant::now();
            if now >= wait_until {
                return Err(Problem::InFlight {
                    retry_after: Duration::from_secs(1),
                });
            }
            let wake = wait_until.min(now + RECHECK);
            tokio::select! {
                () = sub.changed() => {}
                () = tokio::time::sleep_until(wake) => {}
            }
        }
    }

    /// Phase `execute`: the owner forwards the request and stores the result. Runs in the
    /// request's own task while the client waits, and on its own if the client goes away
    /// ([`Detachable`]).
    async fn execute(
        self: &Arc<Self>,
        route: &Arc<RouteConfig>,
        parts: request::Parts,
        body: Bytes,
        key: &StoreKey,
        token: OwnerToken,
        conn: &Arc<Conn>,
    ) -> (Response<Body>, Outcome) {
        let this = Arc::clone(self);
        let route = Arc::clone(route);
        let key = *key;
        let conn = Arc::clone(conn);
        let run = async move {
            this.execute_detached(&route, parts, body, &key, token, &conn)
                .await
        };
        Detachable::new(run, self.tasks.clone()).await
    }

    async fn execute_detached(
        &self,
        route: &RouteConfig,
        mut parts: request::Parts,
        body: Bytes,
        key: &StoreKey,
        token: OwnerToken,
        conn: &Arc<Conn>,
    ) -> (Response<Body>, Outcome) {
        let policy = &route.policy;
        if let Err(e) = prepare_request(&mut parts, &route.upstream, &conn.peer) {
            tracing::error!(key = key.short(), error = %e, "cannot build upstream request");
            self.settle_release(key, token).await;
            return (
                Problem::UpstreamUnreachable.into_response(),
                Outcome::UpstreamError,
            );
        }
        let req = Request::from_parts(parts, body::full(body));
        let started = Instant::now();
        let forward = forward_and_capture(&conn.upstream, req, policy);
        tokio::pin!(forward);
        let result = tokio::select! {
            r = &mut forward => r,
            () = self.renew_lease(key, token, policy.lock_timeout) => forward.await,
        };
        let upstream_time = started.elapsed();
        self.metrics.upstream(&route.metrics, upstream_time);
        let (mut resp, outcome) = self.settle(policy, key, token, result).await;
        // For the request's log line; extensions never go on the wire.
        resp.extensions_mut().insert(UpstreamTime(upstream_time));
        (resp, outcome)
    }

    /// Keeps the lease alive while the upstream works; returns only if ownership was lost.
    async fn renew_lease(&self, key: &StoreKey, token: OwnerToken, lease: Duration) {
        let period = (lease / 3).max(Duration::from_millis(10));
        let mut tick = tokio::time::interval_at(Instant::now() + period, period);
        loop {
            tick.tick().await;
            match self.store.renew(key, token, lease).await {
                Ok(()) => {}
                Err(StoreError::NotOwner) => {
                    tracing::warn!(
                        key = key.short(),
                        "lease lost while the upstream was working"
                    );
                    return;
                }
                Err(e) => tracing::warn!(key = key.short(), error = %e, "lease renewal failed"),
            }
        }
    }

    /// Phase `settle`: record what the upstream did, then answer the owner.
    async fn settle(
        &self,
        policy: &Policy,
        key: &StoreKey,
        token: OwnerToken,
        result: Result<Forwarded, UpstreamError>,
    ) -> (Response<Body>, Outcome) {
        let forwarded = match result {
            Ok(f) => f,
            Err(UpstreamError::NotSent(e)) => {
                tracing::warn!(key = key.short(), error = %e, "upstream unreachable; key released");
                self.settle_release(key, token).await;
                return (
                    Problem::UpstreamUnreachable.into_response(),
                    Outcome::UpstreamError,
                );
            }
            Err(e) => {
                let reason = match e {
                    UpstreamError::Timeout(_) => UnknownReason::Timeout,
                    _ => UnknownReason::Interrupted,
                };
                let retryable = policy.on_unknown == OnUnknown::Retry;
                if retryable {
                    tracing::warn!(key = key.short(), error = %e, "outcome unknown; key released (on_unknown = \"retry\")");
                    self.settle_release(key, token).await;
                } else {
                    tracing::warn!(key = key.short(), error = %e, "outcome unknown; key kept");
                    if let Err(e) = self.store.mark_unknown(key, token, reason).await {
                        tracing::error!(key = key.short(), error = %e, "cannot mark outcome unknown; the lease will expire instead");
                    }
                }
                return (
                    Problem::OutcomeUnknown { reason, retryable }.into_response(),
                    Outcome::Unknown,
                );
            }
        };

        let status = forwarded.head.status;
        let released = not_executed(status, policy.store_server_errors);
        if released {
            self.settle_release(key, token).await;
        } else {
            let stored = StoredResponse {
                status,
                headers: forwarded
                    .head
                    .headers
                    .iter()
                    .map(|(n, v)| (n.clone(), v.clone()))
                    .collect(),
                body: match &forwarded.body {
                    ForwardedBody::Complete(b) => b.clone(),
                    ForwardedBody::Streaming { .. } => Bytes::new(),
                },
                body_kept: matches!(forwarded.body, ForwardedBody::Complete(_)),
                completed_ms: now_ms(),
            };
            if let Err(e) = self.store.complete(key, token, stored, policy.ttl).await {
                // The client still gets the real response; retries will see the pending record,
                // then (lease expired) an unknown outcome: never a second execution.
                tracing::error!(key = key.short(), error = %e, "cannot store the response");
            }
        }

        // The upstream's own framing headers still hold: the body is the same bytes.
        let resp = Response::from_parts(
            forwarded.head,
            match forwarded.body {
                ForwardedBody::Complete(b) => body::full(b),
                ForwardedBody::Streaming { head, rest } => body::prepend(head, rest),
            },
        );
        let outcome = if released {
            Outcome::UpstreamError
        } else {
            Outcome::Executed
        };
        (resp, outcome)
    }

    async fn settle_release(&self, key: &StoreKey, token: OwnerToken) {
        if let Err(e) = self.store.release(key, token).await {
            tracing::error!(key = key.short(), error = %e, "cannot release the key; it stays pending until its lease expires");
        }
    }

    /// Forwards a request on an idempotent route without idempotency (no key where none is
    /// required, or the store down with `on_store_error = "pass"`).
    async fn pass_through_route(
        &self,
        route: &RouteConfig,
        parts: request::Parts,
        body: Body,
        conn: &Arc<Conn>,
    ) -> Response<Body> {
        let req = Request::from_parts(parts, body);
        let timeout = route.policy.upstream_timeout;
        self.pass_through(req, conn, &route.upstream, timeout, &route.metrics)
            .await
    }

    /// Forwards a request that is not made idempotent, streaming both ways.
    async fn pass_through(
        &self,
        req: Request<Body>,
        conn: &Arc<Conn>,
        target: &UpstreamUrl,
        timeout: Duration,
        metrics: &RouteMetrics,
    ) -> Response<Body> {
        let (mut parts, body) = req.into_parts();
        if prepare_request(&mut parts, target, &conn.peer).is_err() {
            return Problem::UpstreamUnreachable.into_response();
        }
        let req = Request::from_parts(parts, body);
        let started = Instant::now();
        let sent = conn.upstream.send(req, timeout).await;
        self.metrics.upstream(metrics, started.elapsed());
        match sent {
            Ok(resp) => resp.map(body::boxed),
            Err(e) => {
                tracing::warn!(error = %e, "pass-through request failed");
                match e {
                    UpstreamError::NotSent(_) => Problem::UpstreamUnreachable,
                    UpstreamError::Timeout(_) => Problem::UpstreamTimeout,
                    UpstreamError::Failed(_) => Problem::UpstreamFailed,
                }
                .into_response()
            }
        }
    }
}

/// A request body on an idempotent route: still on the wire, or buffered (phase `read_body`).
enum ReqBody {
    Unread(Incoming),
    Read(Bytes),
}

impl ReqBody {
    /// What was buffered so far (nothing while unread).
    fn bytes(&self) -> &[u8] {
        match self {
            ReqBody::Unread(_) => &[],
            ReqBody::Read(b) => b,
        }
    }

    /// The whole body, reading it (up to `limit`) unless already read.
    async fn read(self, limit: usize) -> Result<Bytes, Problem> {
        match self {
            ReqBody::Read(b) => Ok(b),
            ReqBody::Unread(incoming) => {
                body::read_capped(incoming, limit)
                    .await
                    .map_err(|e| match e {
                        ReadError::TooLarge(limit) => Problem::BodyTooLarge { limit },
                        ReadError::Failed(_) => Problem::BadRequestBody,
                    })
            }
        }
    }

    /// For forwarding as is: streaming if unread.
    fn into_body(self) -> Body {
        match self {
            ReqBody::Unread(incoming) => body::boxed(incoming),
            ReqBody::Read(b) => body::full(b),
        }
    }
}

/// How long the upstream took, on responses to requests this gateway executed.
#[derive(Clone, Copy)]
struct UpstreamTime(Duration);

/// Upstream's answer to the owner.
struct Forwarded {
    head: http::response::Parts,
    body: ForwardedBody,
}

enum ForwardedBody {
    /// Within `max_stored_response`: stored and sent as one.
    Complete(Bytes),
    /// Too large to store: streamed to the client, replays carry status and headers only.
    Streaming {
        head: Vec<Bytes>,
        rest: UpstreamBody,
    },
}

/// An owner's execution, run inside the request's task while its client waits. If the client
/// goes away first (hyper then drops the request's future), the execution moves to a task of its
/// own, so the upstream call still completes and its result is still stored; shutdown waits for
/// such tasks ([`Gateway::tasks`]). Spawning every execution up front cost a task, a wake-up
/// and a hand-off per request (about 5,000 instructions) for the rare client that hangs up.
struct Detachable<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    /// `None` once finished. Boxed so that, half-run, it can still be moved to a task.
    run: Option<Pin<Box<F>>>,
    tasks: TaskTracker,
}

impl<F> Detachable<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn new(run: F, tasks: TaskTracker) -> Self {
        Detachable {
            run: Some(Box::pin(run)),
            tasks,
        }
    }
}

impl<F> Future for Detachable<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let Some(run) = self.run.as_mut() else {
            // Polled again after finishing: a caller's bug, and nothing left to give.
            return Poll::Pending;
        };
        let done = ready!(run.as_mut().poll(cx));
        self.run = None;
        Poll::Ready(done)
    }
}

impl<F> Drop for Detachable<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn drop(&mut self) {
        let Some(run) = self.run.take() else { return };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                self.tasks.spawn_on(run, &runtime);
            }
            // Only when the runtime itself is being torn down, past the shutdown grace: the
            // record stays pending until its lease runs out, then reads as unknown.
            Err(_) => tracing::warn!("an upstream call was cut off by the end of its runtime"),
        }
    }
}

/// Sends the request and reads the response, all within `upstream_timeout`.
async fn forward_and_capture(
    upstream: &UpstreamClient,
    req: Request<Body>,
    policy: &Policy,
) -> Result<Forwarded, UpstreamError> {
    let exchange = async {
        let (head, body) = upstream.exchange(req).await?.into_parts();
        let captured = body::capture(body, policy.max_stored_response)
            .await
            // A body cut off mid-way: the upstream ran, but we do not know what it said.
            .map_err(|e| UpstreamError::Failed(Box::new(e)))?;
        let body = match captured {
            Captured::Complete(b) => ForwardedBody::Complete(b),
            Captured::TooLarge { head, rest } => ForwardedBody::Streaming { head, rest },
        };
        Ok(Forwarded { head, body })
    };
    tokio::time::timeout(policy.upstream_timeout, exchange)
        .await
        .unwrap_or(Err(UpstreamError::Timeout(policy.upstream_timeout)))
}

/// Decides from an existing record, or returns `None` while it is pending with a live lease.
fn settled(
    route: &RouteConfig,
    fp: Fingerprint,
    record: &Record,
    waited: bool,
) -> Result<Option<Resolved>, Problem> {
    let policy = &route.policy;
    if route.check_fingerprint && record.fingerprint != fp {
        return Err(Problem::KeyReused {
            status: policy.mismatch_status,
        });
    }
    match &record.state {
        RecordState::Completed(stored) => {
            let outcome = if waited {
                Outcome::Waited
            } else {
                Outcome::Replayed
            };
            Ok(Some(Resolved::Respond(replay(policy, stored), outcome)))
        }
        RecordState::Unknown { .. } | RecordState::Pending { .. }
            if policy.on_unknown == OnUnknown::Retry && is_unknown(record) =>
        {
            Ok(Some(Resolved::TakeOver(record.clone())))
        }
        RecordState::Unknown { reason, .. } => Err(Problem::OutcomeUnknown {
            reason: *reason,
            retryable: false,
        }),
        RecordState::Pending { .. } if is_unknown(record) => Err(Problem::OutcomeUnknown {
            reason: UnknownReason::Abandoned,
            retryable: false,
        }),
        RecordState::Pending { .. } => Ok(None),
    }
}

/// Unknown, or pending with a lease that ran out (its owner died mid-flight).
fn is_unknown(record: &Record) -> bool {
    match &record.state {
        RecordState::Unknown { .. } => true,
        RecordState::Pending { lease_until_ms, .. } => *lease_until_ms < now_ms(),
        RecordState::Completed(_) => false,
    }
}

/// The stored response, byte for byte, marked as a replay.
fn replay(policy: &Policy, stored: &StoredResponse) -> Response<Body> {
    let mut resp = Response::new(body::full(stored.body.clone()));
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

/// Statuses that say the upstream did not execute the request: the key is released so a retry
/// runs. 5xx only when `store_server_errors = false`; 408, 425 and 429 always (the request was
/// refused before it was processed, and storing it would make every retry fail).
fn not_executed(status: StatusCode, store_server_errors: bool) -> bool {
    (status.is_server_error() && !store_server_errors) || matches!(status.as_u16(), 408 | 425 | 429)
}

fn store_problem(key: &StoreKey, e: StoreError) -> Problem {
    tracing::warn!(key = key.short(), error = %e, "store error");
    match e {
        StoreError::Full(_) => Problem::StoreFull,
        _ => Problem::StoreUnavailable,
    }
}

/// The gateway's own answer, and what to count it as.
fn answer(p: Problem) -> (Response<Body>, Outcome) {
    let outcome = Outcome::of_problem(&p);
    (p.into_response(), outcome)
}

fn problem(p: Problem) -> (Response<Body>, Outcome, Option<StoreKey>) {
    let (resp, outcome) = answer(p);
    (resp, outcome, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_that_release_the_key() {
        assert!(not_executed(StatusCode::INTERNAL_SERVER_ERROR, false));
        assert!(!not_executed(StatusCode::INTERNAL_SERVER_ERROR, true));
        assert!(not_executed(StatusCode::TOO_MANY_REQUESTS, true));
        assert!(!not_executed(StatusCode::CREATED, false));
        assert!(!not_executed(StatusCode::BAD_REQUEST, false));
        assert!(!not_executed(StatusCode::CONFLICT, false));
    }
}
