//! A small HTTP/1.1 client, the responses it saw, and raw requests over TCP.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;

/// A response as the client saw it.
#[derive(Debug, Clone)]
pub struct Got {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Got {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn is_replay(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    /// The `type` of a problem+json body (asserting it is one).
    pub fn problem_type(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "not a problem response: {self:?}"
        );
        let v: serde_json::Value = serde_json::from_slice(&self.body).unwrap();
        assert_eq!(v["status"].as_u64(), Some(u64::from(self.status.as_u16())));
        let t = v["type"].as_str().unwrap().to_string();
        t.strip_prefix("https://idemgate.dev/problems/")
            .unwrap_or(&t)
            .to_string()
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// A plain HTTP/1.1 client.
#[derive(Clone)]
pub struct Http {
    client: Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    base: String,
}

impl Http {
    pub fn new(addr: SocketAddr) -> Http {
        Http {
            client: Client::builder(TokioExecutor::new()).build_http(),
            base: format!("http://{addr}"),
        }
    }

    pub fn request(&self, method: &str, path: &str) -> Req {
        Req {
            http: self.clone(),
            builder: Request::builder()
                .method(method)
                .uri(format!("{}{path}", self.base)),
            body: Bytes::new(),
        }
    }

    /// `POST path` with a JSON body and an idempotency key.
    pub async fn post(&self, path: &str, key: &str, json: &str) -> Got {
        self.request("POST", path)
            .header("idempotency-key", key)
            .json(json)
            .send()
            .await
    }
}

pub struct Req {
    http: Http,
    builder: http::request::Builder,
    body: Bytes,
}

impl Req {
    pub fn header(mut self, k: &str, v: &str) -> Req {
        self.builder = self.builder.header(k, v);
        self
    }

    pub fn json(mut self, body: &str) -> Req {
        self.builder = self.builder.header("content-type", "application/json");
        self.body = Bytes::copy_from_slice(body.as_bytes());
        self
    }

    pub fn body(mut self, body: impl Into<Bytes>) -> Req {
        self.body = body.into();
        self
    }

    /// Sends with a client-side timeout; `None` when it ran out or the connection failed (a
    /// client that gives up, as real ones do).
    pub async fn try_send(self, timeout: Duration) -> Option<Got> {
        let req = self.builder.body(Full::new(self.body)).ok()?;
        let resp = tokio::time::timeout(timeout, self.http.client.request(req))
            .await
            .ok()?
            .ok()?;
        let (parts, body) = resp.into_parts();
        let body = tokio::time::timeout(timeout, body.collect())
            .await
            .ok()?
            .ok()?
            .to_bytes();
        Some(Got {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    }

    pub async fn send(self) -> Got {
        let req = self.builder.body(Full::new(self.body)).unwrap();
        let resp = tokio::time::timeout(Duration::from_secs(30), self.http.client.request(req))
            .await
            .expect("no response within 30s")
            .expect("request failed");
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.unwrap().to_bytes();
        Got {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }
}

/// A free loopback port with nothing listening on it.
pub async fn closed_port() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    l.local_addr().unwrap()
}

/// Sends a raw HTTP/1.1 request over TCP and returns the raw response (for chunked bodies and
/// connection-level behaviour the client above hides).
pub async fn raw(addr: SocketAddr, request: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(request).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

pub fn infallible<T>(t: T) -> Result<T, Infallible> {
    Ok(t)
}

/// POSTs `{}` to /payments with `key`, in the background, tolerating the gateway dying under it.
pub fn spawn_post_to_be_killed(http: &Http, key: &str) -> tokio::task::JoinHandle<Option<Got>> {
    let (http, key) = (http.clone(), key.to_string());
    tokio::spawn(async move {
        http.request("POST", "/payments")
            .header("idempotency-key", &key)
            .json("{}")
            .try_send(Duration::from_secs(10))
            .await
    })
}

/// Retries until the answer is no longer `409 in-flight` (bounded): waits on what the gateway
/// says, not on a guessed sleep.
pub async fn retry_while_in_flight(http: &Http, key: &str) -> Got {
    for _ in 0..400 {
        let got = http.post("/payments", key, "{}").await;
        if got.status != 409 {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{key} stayed in flight for 20s");
}
