//! A tiny, deliberately non-idempotent API to put behind idemgate in the quick start.
//!
//! `POST /payments` "charges a card": every execution gets a new payment id and is printed, so you
//! can see that retries through the gateway do not charge twice. Everything else answers 200 with
//! the path. Listens on 127.0.0.1:3000, or on the address given as the first argument.
//!
//! A `Demo-Delay-Ms: N` request header makes the charge take N milliseconds (at most 60 s), to
//! watch a duplicate wait for the original, or a shutdown drain a request still running
//! (scripts/test-containers).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr: SocketAddr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:3000".into())
        .parse()?;
    let listener = TcpListener::bind(addr).await?;
    println!("demo upstream listening on http://{addr} (POST /payments executes a 'charge')");
    let executions = Arc::new(AtomicU64::new(0));
    // As PID 1 of a container, a process without a SIGTERM handler ignores SIGTERM, and
    // `docker compose stop` would wait its whole grace period before killing it.
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => accepted?,
            _ = terminate.recv() => return Ok(()),
            _ = tokio::signal::ctrl_c() => return Ok(()),
        };
        let executions = Arc::clone(&executions);
        tokio::spawn(async move {
            let svc = service_fn(move |req| handle(req, Arc::clone(&executions)));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

async fn handle(
    req: Request<Incoming>,
    executions: Arc<AtomicU64>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let (parts, body) = req.into_parts();
    let delay = parts
        .headers
        .get("demo-delay-ms")
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
        .map_or(0, |ms| ms.min(60_000));
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let (status, json) = if parts.method == Method::POST && parts.uri.path() == "/payments" {
        tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
        let n = executions.fetch_add(1, Ordering::SeqCst) + 1;
        let amount = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v.get("amount").cloned())
            .unwrap_or(serde_json::Value::Null);
        println!("EXECUTED charge #{n}: amount {amount}");
        (
            StatusCode::CREATED,
            serde_json::json!({ "id": format!("pay_{n}"), "amount": amount, "status": "captured" }),
        )
    } else {
        (
            StatusCode::OK,
            serde_json::json!({ "method": parts.method.as_str(), "path": parts.uri.path() }),
        )
    };
    let mut resp = Response::new(Full::new(Bytes::from(json.to_string())));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        "content-type",
        http::HeaderValue::from_static("application/json"),
    );
    Ok(resp)
}
