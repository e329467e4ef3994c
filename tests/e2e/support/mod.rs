//! Test harness: a real upstream and the real gateway on loopback port 0, a small client, and
//! real Redis servers ([`redis`]).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod nats;
pub mod redis;

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use idemgate::config::Config;
pub use idemgate::server::Running;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
pub use tokio::sync::Semaphore;

/// A request the upstream received (its body read in full).
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: Method,
    pub path_and_query: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// How the upstream answers one request.
pub enum Reply {
    /// Answer at once.
    Respond {
        status: u16,
        headers: Vec<(&'static str, String)>,
        body: Bytes,
    },
    /// Wait for one permit of the gate, then answer.
    Gated(Arc<Semaphore>, Box<Reply>),
    /// Close the connection after reading the request, without answering.
    Reset,
    /// Never answer.
    Hang,
    /// Wait, then answer.
    Delayed(Duration, Box<Reply>),
    /// Send the head and the first chunk, wait for the gate, then send the second chunk.
    Stream {
        first: Bytes,
        gate: Arc<Semaphore>,
        second: Bytes,
    },
}

impl Reply {
    pub fn json(status: u16, body: &str) -> Reply {
        Reply::Respond {
            status,
            headers: vec![("content-type", "application/json".into())],
            body: Bytes::copy_from_slice(body.as_bytes()),
        }
    }

    pub fn gated(self, gate: &Arc<Semaphore>) -> Reply {
        Reply::Gated(Arc::clone(gate), Box::new(self))
    }
}

type Handler = Arc<dyn Fn(&Seen, usize) -> Reply + Send + Sync>;

/// A real HTTP/1.1 upstream on 127.0.0.1:0 that records every request it executes.
pub struct Upstream {
    pub addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    arrivals: tokio::sync::Mutex<mpsc::UnboundedReceiver<Seen>>,
    task: tokio::task::JoinHandle<()>,
}

impl Upstream {
    /// Starts an upstream whose handler gets each request and its 1-based execution number.
    pub async fn start(
        handler: impl Fn(&Seen, usize) -> Reply + Send + Sync + 'static,
    ) -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        Self::serve(listener, Arc::new(handler))
    }

    /// Starts on a given address (to bring an upstream up where one was missing).
    pub async fn start_on(
        addr: SocketAddr,
        handler: impl Fn(&Seen, usize) -> Reply + Send + Sync + 'static,
    ) -> Upstream {
        let listener = TcpListener::bind(addr).await.unwrap();
        Self::serve(listener, Arc::new(handler))
    }

    /// An upstream that answers 201 `{"n":N}` (N the execution number) only once the returned
    /// gate gives it a permit: how tests hold a request in flight.
    pub async fn gated() -> (Upstream, Arc<Semaphore>) {
        let gate = Arc::new(Semaphore::new(0));
        let g = Arc::clone(&gate);
        let up =
            Self::start(move |_, n| Reply::json(201, &format!("{{\"n\":{n}}}")).gated(&g)).await;
        (up, gate)
    }

    /// An upstream answering 201 with a JSON body numbering the execution.
    pub async fn counting() -> Upstream {
        Self::start(|seen, n| Reply::Respond {
            status: 201,
            headers: vec![
                ("content-type", "application/json".into()),
                ("x-execution", n.to_string()),
                ("set-cookie", format!("session={n}; HttpOnly")),
            ],
            body: Bytes::from(format!(
                "{{\"execution\":{n},\"path\":\"{}\",\"bytes\":{}}}",
                seen.path_and_query,
                seen.body.len()
            )),
        })
        .await
    }

    fn serve(listener: TcpListener, handler: Handler) -> Upstream {
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::unbounded_channel();
        let seen2 = Arc::clone(&seen);
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let handler = Arc::clone(&handler);
                let seen = Arc::clone(&seen2);
                let tx = tx.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req: Request<Incoming>| {
                        let handler = Arc::clone(&handler);
                        let seen = Arc::clone(&seen);
                        let tx = tx.clone();
                        async move {
                            let (parts, body) = req.into_parts();
                            let body = body
                                .collect()
                                .await
                                .map(|b| b.to_bytes())
                                .unwrap_or_default();
                            let s = Seen {
                                method: parts.method,
                                path_and_query: parts
                                    .uri
                                    .path_and_query()
                                    .map(|p| p.to_string())
                                    .unwrap_or_default(),
                                headers: parts.headers,
                                body,
                            };
                            let n = {
                                let mut all = seen.lock().unwrap();
                                all.push(s.clone());
                                all.len()
                            };
                            let _ = tx.send(s.clone());
                            let reply = handler(&s, n);
                            respond(reply).await
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Upstream {
            addr,
            seen,
            arrivals: tokio::sync::Mutex::new(rx),
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// How many requests reached the upstream (executions).
    pub fn executions(&self) -> usize {
        self.seen.lock().unwrap().len()
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// Waits until the next request reaches the upstream (at most 10 s).
    pub async fn next_arrival(&self) -> Seen {
        tokio::time::timeout(Duration::from_secs(10), self.arrivals.lock().await.recv())
            .await
            .expect("no request reached the upstream within 10s")
            .expect("upstream stopped")
    }
}

impl Upstream {
    /// Waits until a request for `path_and_query` reaches the upstream, skipping other arrivals.
    pub async fn arrival_at(&self, path_and_query: &str) -> Seen {
        loop {
            let seen = self.next_arrival().await;
            if seen.path_and_query == path_and_query {
                return seen;
            }
        }
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type UpBody = http_body_util::combinators::BoxBody<Bytes, std::io::Error>;

fn respond(
    reply: Reply,
) -> std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<Response<UpBody>, std::io::Error>> + Send>,
> {
    Box::pin(async move {
        match reply {
            Reply::Respond {
                status,
                headers,
                body,
            } => {
                let mut b = Response::builder().status(status);
                for (k, v) in headers {
                    b = b.header(k, v);
                }
                Ok(
                    b.body(Full::new(body).map_err(|never| match never {}).boxed())
                        .unwrap(),
                )
            }
            Reply::Gated(gate, inner) => {
                let _permit = gate.acquire().await.unwrap();
                respond(*inner).await
            }
            Reply::Reset => Err(std::io::Error::other("upstream resets the connection")),
            Reply::Delayed(d, inner) => {
                tokio::time::sleep(d).await;
                respond(*inner).await
            }
            Reply::Hang => {
                std::future::pending::<()>().await;
                unreachable!()
            }
            Reply::Stream {
                first,
                gate,
                second,
            } => {
                let stream = futures_util::stream::unfold(0u8, move |state| {
                    let (first, gate, second) = (first.clone(), Arc::clone(&gate), second.clone());
                    async move {
                        match state {
                            0 => Some((Ok(Frame::data(first)), 1)),
                            1 => {
                                let _p = gate.acquire().await.unwrap();
                                Some((Ok(Frame::data(second)), 2))
                            }
                            _ => None,
                        }
                    }
                });
                Ok(Response::builder()
                    .status(200)
                    .body(StreamBody::new(stream).boxed())
                    .unwrap())
            }
        }
    })
}

/// A gateway config for tests: listens on port 0, `extra` is appended (defaults and routes).
pub fn config(upstream: &str, extra: &str) -> Config {
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nshutdown_grace = \"5s\"\n[upstream]\nurl = \"{upstream}\"\n{extra}"
    );
    Config::parse(&text).unwrap_or_else(|e| panic!("test config invalid: {e}\n{text}"))
}

/// Test-only additions to a parsed config.
pub trait ConfigExt {
    /// Serves the admin endpoints on a free loopback port.
    fn with_admin(self) -> Config;
}

impl ConfigExt for Config {
    fn with_admin(mut self) -> Config {
        self.server.admin = Some("127.0.0.1:0".parse().unwrap());
        self
    }
}

/// Starts the real gateway in-process on loopback port 0.
pub async fn gateway(upstream: &str, extra: &str) -> Running {
    Running::start(config(upstream, extra)).await.unwrap()
}

/// The standard payments route.
pub const PAYMENTS: &str =
    "[[routes]]\nname = \"payments\"\npath = \"/payments\"\nmethods = [\"POST\"]\n";

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

/// The real `idemgate` binary running `run --config` on a written config. Killed on drop.
pub struct GatewayProcess {
    pub addr: SocketAddr,
    pub config_path: std::path::PathBuf,
    child: std::process::Child,
    logs: std::sync::mpsc::Receiver<String>,
    _dir: TempDir,
}

impl GatewayProcess {
    /// Writes `config` and starts the binary; returns once it logged where it listens.
    pub fn start(config: &str) -> GatewayProcess {
        Self::start_with_args(config, &[])
    }

    /// The same, with extra command-line arguments (e.g. `--log-format json`).
    pub fn start_with_args(config: &str, args: &[&str]) -> GatewayProcess {
        let dir = TempDir::new("gw");
        let config_path = dir.path.join("proxy.toml");
        std::fs::write(&config_path, config).unwrap();
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_idemgate"))
            .args(args)
            .args(["run", "--config"])
            .arg(&config_path)
            .env("RUST_LOG", "info")
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let (addr, logs) = wait_listening(&mut child);
        GatewayProcess {
            addr,
            config_path,
            child,
            logs,
            _dir: dir,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal (e.g. "-TERM", "-KILL") and waits for the exit status.
    pub fn signal_and_wait(mut self, signal: &str) -> std::process::ExitStatus {
        self.signal(signal);
        self.child.wait().unwrap()
    }

    /// Sends a signal without waiting.
    pub fn signal(&self, signal: &str) {
        let pid = self.child.id().to_string();
        std::process::Command::new("kill")
            .args([signal, &pid])
            .status()
            .unwrap();
    }

    /// Waits (at most 20 s) for a log line containing `needle` and returns it.
    pub fn wait_log(&self, needle: &str) -> String {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.logs.recv_timeout(left) {
                Ok(line) if line.contains(needle) => return line,
                Ok(_) => {}
                Err(_) => panic!("no log line containing {needle:?} within 20s"),
            }
        }
    }

    /// Log lines received so far (without waiting).
    pub fn drain_logs(&self) -> Vec<String> {
        self.logs.try_iter().collect()
    }
}

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Reads the child's stderr until the "listening" line and returns the address it names (text
/// or JSON logs), and the channel on which the following lines keep arriving (also echoed, for
/// failing tests).
pub fn wait_listening(
    child: &mut std::process::Child,
) -> (SocketAddr, std::sync::mpsc::Receiver<String>) {
    use std::io::BufRead;
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            eprintln!("[gateway] {line}");
            let _ = tx.send(line);
        }
    });
    loop {
        let line = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("the gateway printed no 'listening' line within 20s");
        if line.contains("idemgate listening") {
            let addr = if line.trim_start().starts_with('{') {
                let v: serde_json::Value = serde_json::from_str(&line).unwrap();
                v["addr"].as_str().unwrap().to_string()
            } else {
                line.split("addr=")
                    .nth(1)
                    .unwrap()
                    .split_whitespace()
                    .next()
                    .unwrap()
                    .to_string()
            };
            return (addr.parse().unwrap(), rx);
        }
    }
}

/// GETs an admin path; returns status and body.
pub async fn admin_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let got = Http::new(addr).request("GET", path).send().await;
    (got.status.as_u16(), got.text())
}

/// Scrapes `/metrics` into `name{labels}` -> value.
pub async fn scrape(admin: SocketAddr) -> HashMap<String, f64> {
    let (status, text) = admin_get(admin, "/metrics").await;
    assert_eq!(status, 200);
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            Some((name.to_string(), value.parse().ok()?))
        })
        .collect()
}

/// Polls `check` every 10 ms for at most 10 s: a test waits on a condition, not on a guessed
/// duration. Returns whether the condition came true.
pub async fn eventually<F, Fut>(check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    eventually_within(Duration::from_secs(10), check).await
}

/// [`eventually`] with another limit, for conditions that take long on a slow machine.
pub async fn eventually_within<F, Fut>(limit: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..limit.as_millis().div_ceil(10) {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

/// Runs `idemgate keys <action> --route <route> --key <part>... --config <config>`.
pub fn keys_cmd(
    config: &std::path::Path,
    action: &str,
    route: &str,
    key_parts: &[&str],
) -> std::process::Output {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_idemgate"));
    cmd.args(["keys", action, "--route", route, "--config"])
        .arg(config);
    for part in key_parts {
        cmd.args(["--key", part]);
    }
    cmd.output().unwrap()
}

/// A scratch directory (tempfile's), removed on drop.
pub struct TempDir {
    pub path: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let dir = tempfile::Builder::new()
            .prefix(&format!("idemgate-{tag}-"))
            .tempdir()
            .unwrap();
        TempDir {
            path: dir.path().to_path_buf(),
            _dir: dir,
        }
    }
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
