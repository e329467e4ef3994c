//! gRPC through the gateway: a real tonic server (HTTP/2 in cleartext, prior knowledge) behind
//! the real binary with `protocol = "http2"`, and a real tonic client in front. Calls outside
//! any route pass through with their trailers; a unary call on an idempotent route is executed
//! once per `idempotency-key` and replayed with its trailers; the gateway's own refusals reach
//! the client as gRPC statuses. Also the HTTP/2 upstream pool under an upstream's stream limit.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::Stream;
use http::uri::PathAndQuery;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tonic::{Code, Request, Response, Status};
use tonic_prost::ProstCodec;

use crate::support::*;

#[derive(Clone, PartialEq, prost::Message)]
struct ChargeRequest {
    #[prost(string, tag = "1")]
    account: String,
    #[prost(uint64, tag = "2")]
    amount: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ChargeReply {
    #[prost(uint64, tag = "1")]
    charge: u64,
    #[prost(string, tag = "2")]
    account: String,
}

const CHARGE: &str = "/pay.Payments/Charge";
const HISTORY: &str = "/pay.Payments/History";
const LOOKUP: &str = "/pay.Payments/Lookup";

/// The gRPC service: `Charge` counts its executions (account "flaky" answers UNAVAILABLE to
/// the first call), `History` streams `amount` replies, `Lookup` always answers NOT_FOUND.
#[derive(Clone, Default)]
struct Payments {
    charges: Arc<AtomicUsize>,
}

type Reply<T> = Pin<Box<dyn std::future::Future<Output = Result<Response<T>, Status>> + Send>>;

impl tonic::server::UnaryService<ChargeRequest> for Payments {
    type Response = ChargeReply;
    type Future = Reply<ChargeReply>;

    fn call(&mut self, req: Request<ChargeRequest>) -> Self::Future {
        let charges = Arc::clone(&self.charges);
        Box::pin(async move {
            let req = req.into_inner();
            let n = charges.fetch_add(1, Ordering::SeqCst) + 1;
            if req.account == "flaky" && n == 1 {
                return Err(Status::unavailable("warming up"));
            }
            let mut resp = Response::new(ChargeReply {
                charge: n as u64,
                account: req.account,
            });
            resp.metadata_mut()
                .insert("x-charge", n.to_string().parse().unwrap());
            Ok(resp)
        })
    }
}

struct Lookup;

impl tonic::server::UnaryService<ChargeRequest> for Lookup {
    type Response = ChargeReply;
    type Future = Reply<ChargeReply>;

    fn call(&mut self, _: Request<ChargeRequest>) -> Self::Future {
        Box::pin(async { Err(Status::not_found("no such charge")) })
    }
}

struct History;

type ReplyStream = Pin<Box<dyn Stream<Item = Result<ChargeReply, Status>> + Send>>;

impl tonic::server::ServerStreamingService<ChargeRequest> for History {
    type Response = ChargeReply;
    type ResponseStream = ReplyStream;
    type Future = Reply<ReplyStream>;

    fn call(&mut self, req: Request<ChargeRequest>) -> Self::Future {
        Box::pin(async move {
            let req = req.into_inner();
            let replies = (1..=req.amount).map(move |i| {
                Ok(ChargeReply {
                    charge: i,
                    account: req.account.clone(),
                })
            });
            let stream: ReplyStream = Box::pin(futures_util::stream::iter(replies));
            Ok(Response::new(stream))
        })
    }
}

/// The tonic server on a free loopback port, HTTP/2 only (as gRPC servers are).
async fn grpc_upstream() -> (SocketAddr, Payments) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let payments = Payments::default();
    let service = payments.clone();
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            let payments = service.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    let payments = payments.clone();
                    async move {
                        let codec = ProstCodec::<ChargeReply, ChargeRequest>::default();
                        let mut grpc = tonic::server::Grpc::new(codec);
                        let resp = match req.uri().path() {
                            CHARGE => grpc.unary(payments, req).await,
                            LOOKUP => grpc.unary(Lookup, req).await,
                            HISTORY => grpc.server_streaming(History, req).await,
                            _ => Status::unimplemented("").into_http(),
                        };
                        Ok::<_, std::convert::Infallible>(resp)
                    }
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(sock), svc)
                    .await;
            });
        }
    });
    (addr, payments)
}

/// The binary in front of the gRPC server, `Charge` an idempotent route.
fn grpc_gateway(upstream: SocketAddr) -> GatewayProcess {
    grpc_gateway_with(upstream, "")
}

/// The same, with `route` appended to the `Charge` route.
fn grpc_gateway_with(upstream: SocketAddr, route: &str) -> GatewayProcess {
    GatewayProcess::start(&format!(
        r#"[server]
listen = "127.0.0.1:0"
workers = 1
[upstream]
url = "http://{upstream}"
protocol = "http2"
[store]
backend = "memory"
[[routes]]
name = "charge"
path = "{CHARGE}"
methods = ["POST"]
{route}
"#
    ))
}

/// A tonic client of the gateway (HTTP/2 in cleartext).
async fn client(gateway: SocketAddr) -> tonic::client::Grpc<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{gateway}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    tonic::client::Grpc::new(channel)
}

async fn charge(
    grpc: &mut tonic::client::Grpc<tonic::transport::Channel>,
    key: Option<&str>,
    account: &str,
    amount: u64,
) -> Result<Response<ChargeReply>, Status> {
    let mut req = Request::new(ChargeRequest {
        account: account.into(),
        amount,
    });
    if let Some(key) = key {
        req.metadata_mut()
            .insert("idempotency-key", key.parse().unwrap());
    }
    grpc.ready().await.unwrap();
    grpc.unary(
        req,
        PathAndQuery::from_static(CHARGE),
        ProstCodec::<ChargeRequest, ChargeReply>::default(),
    )
    .await
}

/// Outside any route: a unary call, a failing call (its status comes in the trailers) and a
/// server-streaming call all pass through intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_calls_pass_through_with_their_trailers() {
    let (upstream, _) = grpc_upstream().await;
    let gw = grpc_gateway(upstream);
    let mut grpc = client(gw.addr).await;

    grpc.ready().await.unwrap();
    let err = grpc
        .unary(
            Request::new(ChargeRequest::default()),
            PathAndQuery::from_static(LOOKUP),
            ProstCodec::<ChargeRequest, ChargeReply>::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    assert_eq!(err.message(), "no such charge");

    grpc.ready().await.unwrap();
    let mut stream = grpc
        .server_streaming(
            Request::new(ChargeRequest {
                account: "acct".into(),
                amount: 5,
            }),
            PathAndQuery::from_static(HISTORY),
            ProstCodec::<ChargeRequest, ChargeReply>::default(),
        )
        .await
        .unwrap()
        .into_inner();
    let mut got = Vec::new();
    while let Some(reply) = stream.message().await.unwrap() {
        got.push(reply.charge);
    }
    assert_eq!(got, [1, 2, 3, 4, 5]);
    // The stream's end came with grpc-status 0 in the trailers.
    let trailers = stream.trailers().await.unwrap().unwrap();
    assert_eq!(trailers.get("grpc-status").unwrap(), "0");
}

/// A unary call with `idempotency-key` in its metadata runs once; its retry gets the same reply,
/// metadata and trailers, marked as a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unary_call_with_a_key_is_executed_once_and_replayed_with_its_trailers() {
    let (upstream, payments) = grpc_upstream().await;
    let gw = grpc_gateway(upstream);
    let mut grpc = client(gw.addr).await;

    let first = charge(&mut grpc, Some("grpc-1"), "acct-1", 100)
        .await
        .unwrap();
    assert!(first.metadata().get("idempotent-replayed").is_none());
    let retry = charge(&mut grpc, Some("grpc-1"), "acct-1", 100)
        .await
        .unwrap();
    assert_eq!(retry.metadata().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(retry.metadata().get("x-charge").unwrap(), "1");
    assert_eq!(retry.get_ref(), first.get_ref());
    assert_eq!(retry.get_ref().charge, 1);
    assert_eq!(payments.charges.load(Ordering::SeqCst), 1);

    // Another key is another charge.
    let other = charge(&mut grpc, Some("grpc-2"), "acct-1", 100)
        .await
        .unwrap();
    assert_eq!(other.get_ref().charge, 2);
    assert_eq!(payments.charges.load(Ordering::SeqCst), 2);
}

/// The gateway's refusals are gRPC statuses a client can act on, and nothing reaches the
/// upstream: no key (INVALID_ARGUMENT), the key reused with another message
/// (FAILED_PRECONDITION).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateways_refusals_are_grpc_statuses() {
    let (upstream, payments) = grpc_upstream().await;
    let gw = grpc_gateway(upstream);
    let mut grpc = client(gw.addr).await;

    let missing = charge(&mut grpc, None, "acct", 1).await.unwrap_err();
    assert_eq!(missing.code(), Code::InvalidArgument, "{missing:?}");
    assert!(
        missing.message().contains("Idempotency key missing"),
        "{missing:?}"
    );

    charge(&mut grpc, Some("k"), "acct", 1).await.unwrap();
    let reused = charge(&mut grpc, Some("k"), "acct", 2).await.unwrap_err();
    assert_eq!(reused.code(), Code::FailedPrecondition, "{reused:?}");
    assert_eq!(payments.charges.load(Ordering::SeqCst), 1);
}

/// A stored call's `grpc-status` decides like an HTTP status would: UNAVAILABLE is passed on and
/// its key released, as a 503's is, so the retry runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unavailable_answer_releases_its_key() {
    let (upstream, payments) = grpc_upstream().await;
    let gw = grpc_gateway(upstream);
    let mut grpc = client(gw.addr).await;
    let failed = charge(&mut grpc, Some("f"), "flaky", 1).await.unwrap_err();
    assert_eq!(failed.code(), Code::Unavailable, "{failed:?}");
    assert_eq!(failed.message(), "warming up", "the upstream's own status");
    let retried = charge(&mut grpc, Some("f"), "flaky", 1).await.unwrap();
    assert!(retried.metadata().get("idempotent-replayed").is_none());
    assert_eq!(retried.get_ref().charge, 2);
    let replayed = charge(&mut grpc, Some("f"), "flaky", 1).await.unwrap();
    assert_eq!(
        replayed.metadata().get("idempotent-replayed").unwrap(),
        "true"
    );
    assert_eq!(payments.charges.load(Ordering::SeqCst), 2);
}

/// An unreachable gRPC upstream is UNAVAILABLE (nothing was sent: safe to retry).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_grpc_upstream_is_unavailable() {
    let gw = grpc_gateway(closed_port().await);
    let mut grpc = client(gw.addr).await;
    let err = charge(&mut grpc, Some("u"), "acct", 1).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains("Upstream unreachable"), "{err:?}");
}

/// A reply too large to keep (`max_stored_response`) is still an executed call: its
/// `grpc-status` streamed past unseen, and the key is kept, never released for a second charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_too_large_to_keep_is_never_executed_twice() {
    let (upstream, payments) = grpc_upstream().await;
    let gw = grpc_gateway_with(upstream, "max_stored_response = \"1KiB\"");
    let mut grpc = client(gw.addr).await;
    let big = "x".repeat(4096);
    let first = charge(&mut grpc, Some("big"), &big, 1).await.unwrap();
    assert_eq!(
        first.get_ref().account.len(),
        4096,
        "the first client gets it whole"
    );
    // The retry is not executed again: whatever it gets (status and headers only; gRPC clients
    // report the missing body and status as an error), there is no second charge.
    let retry = charge(&mut grpc, Some("big"), &big, 1).await;
    if let Ok(r) = &retry {
        assert_ne!(r.get_ref().charge, 2, "{retry:?}");
    }
    assert_eq!(payments.charges.load(Ordering::SeqCst), 1);
}

/// An HTTP/2 upstream (prior knowledge) that allows 2 streams per connection. It counts the
/// connections it accepts, reports each request's arrival, and answers a request once `gate`
/// gives it a permit.
struct LimitedUpstream {
    addr: SocketAddr,
    connections: Arc<AtomicUsize>,
    gate: Arc<Semaphore>,
    arrived: tokio::sync::mpsc::UnboundedReceiver<()>,
}

impl LimitedUpstream {
    async fn start() -> LimitedUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let gate = Arc::new(Semaphore::new(0));
        let (arrived_tx, arrived) = tokio::sync::mpsc::unbounded_channel::<()>();
        let (counted, gated) = (Arc::clone(&connections), Arc::clone(&gate));
        tokio::spawn(async move {
            while let Ok((sock, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                let (gate, arrived_tx) = (Arc::clone(&gated), arrived_tx.clone());
                tokio::spawn(async move {
                    let svc = service_fn(move |_req: http::Request<hyper::body::Incoming>| {
                        let (gate, arrived_tx) = (Arc::clone(&gate), arrived_tx.clone());
                        async move {
                            let _ = arrived_tx.send(());
                            gate.acquire().await.unwrap().forget();
                            Ok::<_, std::convert::Infallible>(http::Response::new(
                                http_body_util::Full::new(bytes::Bytes::from_static(b"ok")),
                            ))
                        }
                    });
                    let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .max_concurrent_streams(2)
                        .serve_connection(TokioIo::new(sock), svc)
                        .await;
                });
            }
        });
        LimitedUpstream {
            addr,
            connections,
            gate,
            arrived,
        }
    }

    /// Waits until `n` more requests have reached it, failing the test if they have not within
    /// 10 s: those would be queued inside the gateway's connections.
    async fn arrivals(&mut self, n: usize) {
        for i in 0..n {
            tokio::time::timeout(Duration::from_secs(10), self.arrived.recv())
                .await
                .unwrap_or_else(|_| panic!("only {i} of {n} reached the upstream: the rest queued"))
                .unwrap();
        }
    }
}

/// Sends 6 GETs through the gateway at once, in the background.
fn burst(http: &Http) -> Vec<tokio::task::JoinHandle<Got>> {
    (0..6)
        .map(|i| {
            let http = http.clone();
            tokio::spawn(async move { http.request("GET", &format!("/slow/{i}")).send().await })
        })
        .collect()
}

fn http2_gateway_config(upstream: SocketAddr) -> idemgate::config::Config {
    let mut cfg = config(&format!("http://{upstream}"), "protocol = \"http2\"\n");
    cfg.server.workers = 1;
    cfg
}

/// An HTTP/2 upstream that allows 2 streams per connection: 6 requests at once all reach it, on
/// more connections, instead of 4 of them queueing inside one connection for a stream (where a
/// request still waiting at its deadline would count as maybe executed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_past_an_upstreams_stream_limit_open_another_connection() {
    let mut upstream = LimitedUpstream::start().await;
    let gw = Running::start(http2_gateway_config(upstream.addr))
        .await
        .unwrap();
    let http = Http::new(gw.addr());
    // One call first, so the connection has the upstream's SETTINGS (its limit of 2) before the
    // burst.
    upstream.gate.add_permits(1);
    assert_eq!(http.request("GET", "/warm").send().await.status, 200);
    upstream.arrivals(1).await;
    let calls = burst(&http);
    upstream.arrivals(6).await;
    // At least 3 (2 streams each); more when requests arrive while a connection is still being
    // made, since each of them makes its own (at most one per request).
    let made = upstream.connections.load(Ordering::SeqCst);
    assert!((3..=7).contains(&made), "{made} connections for 7 requests");
    upstream.gate.add_permits(6);
    for call in calls {
        assert_eq!(call.await.unwrap().status, 200);
    }
}

/// The cause of requests queueing inside a connection, made certain: the upstream's SETTINGS
/// (its limit of 2) held back on every connection until all 6 requests have reached it. A new
/// connection is used for its maker's request only until its SETTINGS arrive; had the pool
/// assumed more, the requests it put on an unsettled connection past the upstream's limit
/// would have been refused or queued, never reaching the upstream in time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_connection_is_not_shared_before_its_upstreams_settings_arrive() {
    let mut upstream = LimitedUpstream::start().await;
    let relay = HeldReplies::start(upstream.addr).await;
    let gw = Running::start(http2_gateway_config(relay.addr))
        .await
        .unwrap();
    let calls = burst(&Http::new(gw.addr()));
    upstream.arrivals(6).await;
    assert_eq!(
        upstream.connections.load(Ordering::SeqCst),
        6,
        "one connection per request while no SETTINGS have arrived"
    );
    relay.release.add_permits(64);
    upstream.gate.add_permits(6);
    for call in calls {
        assert_eq!(call.await.unwrap().status, 200);
    }
}

/// A TCP relay to `upstream` that forwards what clients send at once and holds everything the
/// upstream sends back (its SETTINGS first) until `release` has permits.
struct HeldReplies {
    addr: SocketAddr,
    release: Arc<Semaphore>,
}

impl HeldReplies {
    async fn start(upstream: SocketAddr) -> HeldReplies {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let release = Arc::new(Semaphore::new(0));
        let held = Arc::clone(&release);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let held = Arc::clone(&held);
                tokio::spawn(async move {
                    let server = tokio::net::TcpStream::connect(upstream).await.unwrap();
                    let (mut from_client, mut to_client) = client.into_split();
                    let (mut from_server, mut to_server) = server.into_split();
                    tokio::spawn(async move {
                        let _ = tokio::io::copy(&mut from_client, &mut to_server).await;
                    });
                    let _open = held.acquire().await.unwrap();
                    let _ = tokio::io::copy(&mut from_server, &mut to_client).await;
                });
            }
        });
        HeldReplies { addr, release }
    }
}
