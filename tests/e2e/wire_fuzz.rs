//! The raw-socket fuzz run: random and mutated HTTP/1.1 and HTTP/2 bytes against the real
//! gateway binary, in front of a strict upstream. During the run the gateway must keep serving
//! and never crash, and the upstream must receive only requests it can parse, and on the
//! payments route only requests with a key.
//!
//! `WIRE_FUZZ_CASES` sets the number of connections (default 1500, about ten seconds);
//! `WIRE_FUZZ_SEED` replays a run (each run prints its seed).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::support::*;

/// An upstream that parses strictly (hyper's HTTP/1.1 server) and keeps score.
struct StrictUpstream {
    addr: SocketAddr,
    /// Requests it parsed and answered.
    served: Arc<AtomicUsize>,
    /// Connections hyper gave up on because what came was not HTTP.
    malformed: Arc<AtomicUsize>,
    /// Requests on the payments route without a valid key: each one a bypass.
    unchecked: Arc<Mutex<Vec<String>>>,
}

impl StrictUpstream {
    async fn start() -> StrictUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let up = StrictUpstream {
            addr: listener.local_addr().unwrap(),
            served: Arc::default(),
            malformed: Arc::default(),
            unchecked: Arc::default(),
        };
        let (served, malformed, unchecked) = (
            Arc::clone(&up.served),
            Arc::clone(&up.malformed),
            Arc::clone(&up.unchecked),
        );
        tokio::spawn(async move {
            while let Ok((sock, _)) = listener.accept().await {
                let (served, malformed, unchecked) = (
                    Arc::clone(&served),
                    Arc::clone(&malformed),
                    Arc::clone(&unchecked),
                );
                tokio::spawn(async move {
                    let service = service_fn(move |req: Request<hyper::body::Incoming>| {
                        let served = Arc::clone(&served);
                        let unchecked = Arc::clone(&unchecked);
                        async move {
                            if is_payments(&req) && !has_valid_key(&req) {
                                unchecked.lock().unwrap().push(format!(
                                    "{} {}",
                                    req.method(),
                                    req.uri()
                                ));
                            }
                            let _ = req.into_body().collect().await;
                            served.fetch_add(1, Ordering::SeqCst);
                            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(
                                b"{\"ok\":true}",
                            ))))
                        }
                    });
                    let served = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(sock), service)
                        .await;
                    if let Err(e) = served {
                        if e.is_parse() || e.is_parse_too_large() || e.is_parse_status() {
                            malformed.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                });
            }
        });
        up
    }
}

/// The route as any framework might read the path: case and `;params` ignored, trailing `/`.
fn is_payments<B>(req: &Request<B>) -> bool {
    let path = req.uri().path().to_ascii_lowercase();
    let path = path.split(';').next().unwrap_or_default();
    req.method() == http::Method::POST && path.trim_end_matches('/') == "/payments"
}

fn has_valid_key<B>(req: &Request<B>) -> bool {
    let mut keys = req.headers().get_all("idempotency-key").iter();
    match (keys.next(), keys.next()) {
        (Some(k), None) => idemgate::key::parse_key_value(k.as_bytes()).is_ok(),
        _ => false,
    }
}

/// HTTP/1.1 requests as clients send them, the mutations' starting points.
fn h1_seeds() -> Vec<Vec<u8>> {
    vec![
        b"POST /payments HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k1\r\nContent-Type: application/json\r\nContent-Length: 13\r\n\r\n{\"amount\":10}".to_vec(),
        b"POST /payments HTTP/1.1\r\nHost: x\r\nIdempotency-Key: \"k2\"\r\nTransfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n5\r\n{\"a\":\r\n2\r\n1}\r\n0\r\n\r\n".to_vec(),
        b"GET /status?x=1 HTTP/1.1\r\nHost: x\r\n\r\nGET /other HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".to_vec(),
        b"POST /payments HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k3\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n{}".to_vec(),
        b"PUT /items/1 HTTP/1.0\r\nContent-Length: 3\r\n\r\nabc".to_vec(),
    ]
}

/// An HTTP/2 frame.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// HPACK "literal header field without indexing, new name" for each pair (lengths under 127).
fn hpack(headers: &[(&str, &str)]) -> Vec<u8> {
    let mut block = Vec::new();
    for (n, v) in headers {
        block.push(0);
        block.push(n.len() as u8);
        block.extend_from_slice(n.as_bytes());
        block.push(v.len() as u8);
        block.extend_from_slice(v.as_bytes());
    }
    block
}

/// Cleartext HTTP/2 with prior knowledge: preface, SETTINGS, a POST and its body.
fn h2_seeds() -> Vec<Vec<u8>> {
    let mut with_body = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    with_body.extend(frame(4, 0, 0, &[]));
    with_body.extend(frame(
        1,
        0x4,
        1,
        &hpack(&[
            (":method", "POST"),
            (":scheme", "http"),
            (":path", "/payments"),
            (":authority", "x"),
            ("content-type", "application/json"),
            ("idempotency-key", "h2-k"),
        ]),
    ));
    with_body.extend(frame(0, 0x1, 1, b"{\"amount\":1}"));
    let mut get = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    get.extend(frame(4, 0, 0, &[]));
    get.extend(frame(
        1,
        0x5,
        1,
        &hpack(&[
            (":method", "GET"),
            (":scheme", "http"),
            (":path", "/status"),
            (":authority", "x"),
        ]),
    ));
    vec![with_body, get]
}

/// One fuzz case: a seed changed in one to four ways, or random bytes.
fn mutate(rng: &mut StdRng, seeds: &[Vec<u8>]) -> Vec<u8> {
    if rng.random_ratio(1, 20) {
        let n = rng.random_range(0..512);
        return (0..n).map(|_| rng.random()).collect();
    }
    let mut b = seeds[rng.random_range(0..seeds.len())].clone();
    for _ in 0..rng.random_range(1..=4) {
        if b.is_empty() {
            b.push(rng.random());
            continue;
        }
        let i = rng.random_range(0..b.len());
        match rng.random_range(0..9) {
            0 => b[i] ^= 1 << rng.random_range(0..8),
            1 => b[i] = rng.random(),
            2 => b.insert(i, rng.random()),
            3 => {
                let end = (i + rng.random_range(1..16)).min(b.len());
                b.drain(i..end);
            }
            4 => {
                let end = (i + rng.random_range(1..32)).min(b.len());
                let copy = b[i..end].to_vec();
                b.splice(i..i, copy);
            }
            5 => b.truncate(i),
            6 => {
                let piece: &[u8] = [
                    &b"\r\n"[..],
                    b"\r\n\r\n",
                    b"\n",
                    b" ",
                    b":",
                    b"%00",
                    b"%2F..%2F",
                    b";x=1",
                    b"\r\nContent-Length: 99999999999999999999\r\n",
                    b"\r\nTransfer-Encoding: chunked\r\n",
                    b"\r\nIdempotency-Key: k1\r\n",
                    b"\r\nConnection: idempotency-key, content-length\r\n",
                    b"ffffffffffffffff\r\n",
                ][rng.random_range(0..13)];
                b.splice(i..i, piece.iter().copied());
            }
            7 => {
                // A length or number made huge.
                let digits = "9".repeat(rng.random_range(1..30));
                b.splice(i..i, digits.bytes());
            }
            _ => {
                let other = &seeds[rng.random_range(0..seeds.len())];
                let j = rng.random_range(0..other.len());
                b.truncate(i);
                b.extend_from_slice(&other[j..]);
            }
        }
    }
    b
}

async fn send_case(addr: SocketAddr, bytes: Vec<u8>) {
    let Ok(mut s) = TcpStream::connect(addr).await else {
        return;
    };
    let _ = s.write_all(&bytes).await;
    let mut buf = [0u8; 4096];
    // Whatever comes back, briefly: the case is what was sent, not how long it is kept.
    let _ = tokio::time::timeout(Duration::from_millis(200), async {
        while let Ok(n) = s.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_fuzzed_http_neither_crashes_the_gateway_nor_reaches_the_upstream_malformed() {
    let cases: usize = std::env::var("WIRE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1500);
    let seed: u64 = std::env::var("WIRE_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("wire fuzz: {cases} cases, WIRE_FUZZ_SEED={seed}");
    let up = StrictUpstream::start().await;
    let gw = GatewayProcess::start(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nheader_timeout = \"1s\"\nbody_timeout = \"1s\"\nidle_timeout = \"1s\"\n[upstream]\nurl = \"http://{}\"\n[store]\nbackend = \"memory\"\n[defaults]\nmax_body = \"64KiB\"\n{PAYMENTS}",
        up.addr
    ));
    let mut seeds = h1_seeds();
    seeds.extend(h2_seeds());
    let mut rng = StdRng::seed_from_u64(seed);
    let mut running = tokio::task::JoinSet::new();
    for _ in 0..cases {
        running.spawn(send_case(gw.addr, mutate(&mut rng, &seeds)));
        if running.len() >= 32 {
            running.join_next().await;
        }
    }
    while running.join_next().await.is_some() {}

    let served = Http::new(gw.addr)
        .request("POST", "/payments")
        .header("idempotency-key", "after-the-fuzz")
        .json("{}")
        .try_send(Duration::from_secs(10))
        .await
        .unwrap_or_else(|| panic!("the gateway stopped serving (WIRE_FUZZ_SEED={seed})"));
    assert_eq!(served.status, 200);
    // Every line the run made, a panic's included: read until the log has been quiet for a
    // while (the lines come through a reader thread).
    let mut logs = Vec::new();
    let mut quiet = 0;
    while quiet < 5 {
        let more = gw.drain_logs();
        quiet = if more.is_empty() { quiet + 1 } else { 0 };
        logs.extend(more);
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    assert!(
        !logs.iter().any(|l| l.contains("panicked")),
        "the gateway panicked (WIRE_FUZZ_SEED={seed}): {logs:?}"
    );
    assert_eq!(
        up.malformed.load(Ordering::SeqCst),
        0,
        "the upstream got requests it could not parse (WIRE_FUZZ_SEED={seed})"
    );
    let unchecked = up.unchecked.lock().unwrap().clone();
    assert!(
        unchecked.is_empty(),
        "requests reached the payments handler without a key (WIRE_FUZZ_SEED={seed}): {unchecked:?}"
    );
    assert!(
        up.served.load(Ordering::SeqCst) > 10,
        "so few fuzzed requests got through that the run checked little (WIRE_FUZZ_SEED={seed})"
    );
    eprintln!(
        "wire fuzz: the upstream served {} requests, none malformed",
        up.served.load(Ordering::SeqCst)
    );
}
