//! The admin listener (`[server] admin`): `/healthz`, `/readyz` and `/metrics`, and the
//! operator API (`/keys`, `/keys/{id}`, [`keys`]) when a token is configured.
//!
//! Kept off the traffic port so probes and scrapes never compete with, or get mistaken for,
//! client requests.

mod keys;

use std::sync::Arc;
use std::time::Duration;

pub use keys::{read_token, resolution_of, Operator, TokenError};

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::body::{self, Body};
use crate::config::identity::KeyIdentity;
use crate::config::Deadlines;
use crate::conn::{self, ClientBody};
use crate::consumer::BrokerHealth;
use crate::gateway::Gateway;
use crate::metrics::text as exposition;
use crate::store::{Readiness, StoreError, StoreOp};

/// How full an embedded store may be before readiness warns: at its bound new keys get
/// `503 store-full`, and a default bound can be too small for a busy deployment.
const FILL_WARNING: f64 = 0.8;

/// The store's readiness, with a warning once an embedded store is [`FILL_WARNING`] full.
fn with_fill(readiness: Readiness, fill: Option<f64>) -> Readiness {
    let Some(fill) = fill.filter(|f| *f >= FILL_WARNING) else {
        return readiness;
    };
    let full = format!(
        "the store is {:.0}% full: at 100% new keys get 503 store-full (raise max_disk, max_keys or max_bytes, or lower ttl)",
        fill * 100.0
    );
    match readiness {
        Readiness::Fine => Readiness::Warning(full),
        Readiness::Warning(w) => Readiness::Warning(format!("{w}; {full}")),
        not_ready => not_ready,
    }
}

/// A readiness check fails if the store does not answer within this.
const READY_TIMEOUT: Duration = Duration::from_secs(2);

/// Admin connections served at once; more wait in the accept queue. Probes and scrapes need a
/// handful, and a client that opens many cannot take the process's file descriptors.
const MAX_CONNECTIONS: usize = 64;

/// Serves admin requests until the task is aborted, each connection under the same deadlines as
/// the traffic port's.
/// `brokers`: the consumers' brokers, each of which must be reachable for `/readyz`.
/// `operator`: the operator API's settings, `None` when it is off.
pub async fn serve(
    listener: TcpListener,
    gateway: Arc<Gateway>,
    brokers: Arc<[Arc<BrokerHealth>]>,
    operator: Option<Arc<Operator>>,
    deadlines: Deadlines,
) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    // Admin connections are not drained at shutdown: the task is aborted.
    let never = CancellationToken::new();
    let builder = conn::builder(4, 64 << 10);
    loop {
        let Ok(slot) = Arc::clone(&slots).acquire_owned().await else {
            return;
        };
        let Ok((stream, peer)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let gw = Arc::clone(&gateway);
        let brokers = Arc::clone(&brokers);
        let operator = operator.clone();
        let builder = builder.clone();
        let never = never.clone();
        tokio::spawn(async move {
            let handler = move |req: Request<ClientBody>| {
                let gw = Arc::clone(&gw);
                let brokers = Arc::clone(&brokers);
                let operator = operator.clone();
                async move {
                    if req.uri().path() == "/keys" || req.uri().path().starts_with("/keys/") {
                        // A reload may have made a route's ttl longer than at startup.
                        let ttl = gw.routes().iter().map(|r| r.config.policy.ttl).max();
                        let store = &**gw.store();
                        let span = gw.traces().and_then(|t| keys::change_span(t, &req));
                        let resp = keys::handle(operator.as_deref(), (store, ttl), req, peer).await;
                        if let Some(span) = span {
                            keys::end_change_span(&span, &resp);
                        }
                        return resp;
                    }
                    handle(&gw, &brokers, req).await
                }
            };
            conn::serve(stream, &builder, deadlines, &never, handler).await;
            drop(slot);
        });
    }
}

async fn handle(
    gw: &Gateway,
    brokers: &[Arc<BrokerHealth>],
    req: Request<ClientBody>,
) -> Response<Body> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut resp = text(StatusCode::METHOD_NOT_ALLOWED, "use GET\n");
        resp.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return resp;
    }
    match req.uri().path() {
        // The process is up and serving: nothing else, so a slow store never gets it restarted.
        "/healthz" => text(StatusCode::OK, "ok\n"),
        "/readyz" => {
            if gw.is_shutting_down() {
                return text(StatusCode::SERVICE_UNAVAILABLE, "shutting down\n");
            }
            if let Some(why) = gw.tokens_not_ready() {
                return owned_text(StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n"));
            }
            if let Some(why) = gw.sealer().and_then(|s| s.not_ready()) {
                return owned_text(StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n"));
            }
            if let Some(why) = brokers.iter().find_map(|b| b.not_ready()) {
                return owned_text(StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n"));
            }
            let started = tokio::time::Instant::now();
            let ping = tokio::time::timeout(READY_TIMEOUT, gw.store().ping()).await;
            if let Ok(answer) = &ping {
                let failed = answer.as_ref().is_err_and(StoreError::is_failure);
                gw.metrics()
                    .store_call(StoreOp::Ping, started.elapsed(), failed);
            }
            match ping {
                Ok(Ok(())) => match with_fill(gw.store().readiness(), gw.store().fill()) {
                    Readiness::Fine => text(StatusCode::OK, "ready\n"),
                    Readiness::Warning(w) => {
                        owned_text(StatusCode::OK, format!("ready; warning: {w}\n"))
                    }
                    Readiness::NotReady(why) => {
                        owned_text(StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n"))
                    }
                },
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "not ready");
                    text(StatusCode::SERVICE_UNAVAILABLE, "store unreachable\n")
                }
                Err(_) => text(StatusCode::SERVICE_UNAVAILABLE, "store not answering\n"),
            }
        }
        "/metrics" => metrics(gw, &req),
        // What the running routes' stored keys are derived from, and every route's served
        // since startup, for `idemgate check --running`: names, paths and header names, no
        // secret.
        "/routes" => {
            let routes: Vec<KeyIdentity> = (gw.routes().iter())
                .map(|r| KeyIdentity::of(&r.config))
                .collect();
            let served = gw.served();
            let json = serde_json::json!({ "routes": routes, "served": served }).to_string();
            let mut resp = Response::new(body::full(Bytes::from(json)));
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            resp
        }
        // The contract of this listener (docs/openapi.yaml, as JSON: scripts/openapi).
        "/openapi.json" => {
            let mut resp = Response::new(body::full(Bytes::from_static(OPENAPI.as_bytes())));
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            resp
        }
        _ => text(
            StatusCode::NOT_FOUND,
            "not found: /healthz, /readyz, /metrics, /routes, /openapi.json, /keys, /keys/{id}\n",
        ),
    }
}

/// The admin API's OpenAPI document, generated from docs/openapi.yaml by scripts/openapi.
const OPENAPI: &str = include_str!("openapi.json");

/// `GET /metrics`: the figures read at scrape time set, then the exposition in the format the
/// reader asked for.
fn metrics(gw: &Gateway, req: &Request<ClientBody>) -> Response<Body> {
    let metrics = gw.metrics();
    metrics.set_store_stats(gw.store().stats());
    metrics.set_store_fill(gw.store().fill());
    if let Some(traces) = gw.traces() {
        metrics.set_spans_dropped(traces.dropped());
    }
    if let Some(sealer) = gw.sealer() {
        metrics.set_sealed(sealer.stats());
    }
    let (encoded, media) = if exposition::wants_openmetrics(req.headers()) {
        (metrics.encode(), exposition::OPENMETRICS)
    } else {
        (exposition::classic(&metrics.encode()), exposition::CLASSIC)
    };
    let mut resp = Response::new(body::full(Bytes::from(encoded)));
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(media));
    resp
}

fn text(status: StatusCode, msg: &'static str) -> Response<Body> {
    owned_text(status, msg.to_string())
}

fn owned_text(status: StatusCode, msg: String) -> Response<Body> {
    let mut resp = Response::new(body::full(Bytes::from(msg)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}
