//! A real HTTP/1.1 upstream on loopback that records what it executes and answers as told.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
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

/// [`Upstream::counting`]'s answer: 201 with a JSON body numbering the execution.
fn counting_reply(seen: &Seen, n: usize) -> Reply {
    Reply::Respond {
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
    }
}

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
        Self::start(counting_reply).await
    }

    /// An upstream with `handler` on a listener of the caller's (one bound in another network
    /// namespace; non-blocking).
    pub fn start_on_listener(
        listener: std::net::TcpListener,
        handler: impl Fn(&Seen, usize) -> Reply + Send + Sync + 'static,
    ) -> Upstream {
        Self::serve(TcpListener::from_std(listener).unwrap(), Arc::new(handler))
    }

    /// [`Upstream::counting`] on a listener of the caller's (one bound in another network
    /// namespace; non-blocking), answering only with a permit of `gate` (held while answering).
    pub fn counting_gated_on(listener: std::net::TcpListener, gate: &Arc<Semaphore>) -> Upstream {
        let gate = Arc::clone(gate);
        Self::serve(
            TcpListener::from_std(listener).unwrap(),
            Arc::new(move |seen: &Seen, n| counting_reply(seen, n).gated(&gate)),
        )
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

    /// Executions per `Idempotency-Key` (requests without one aside).
    pub fn executions_per_key(&self) -> std::collections::HashMap<String, usize> {
        let mut per_key = std::collections::HashMap::new();
        for s in self.seen.lock().unwrap().iter() {
            if let Some(k) = s.headers.get("idempotency-key") {
                *per_key.entry(k.to_str().unwrap().to_string()).or_default() += 1;
            }
        }
        per_key
    }

    /// Fails naming the first key the upstream executed more than once.
    pub fn assert_at_most_once(&self) {
        for (k, n) in self.executions_per_key() {
            assert_eq!(n, 1, "key {k} executed {n} times");
        }
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
