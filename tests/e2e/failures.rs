//! Failure semantics with real processes: gateways killed mid-flight, upstreams that reset or
//! hang, lease renewal, SIGTERM with requests in flight, operator release, and a chaos run.
//! Invariant everywhere: no key executes twice unless the route or an operator says it may.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::Rng;
use tokio::sync::Semaphore;

use crate::support::redis::{free_port, RedisServer};
use crate::support::*;

fn redis_config(upstream: &str, redis_url: &str, listen: &str, extra: &str) -> String {
    format!(
        "[server]\nlisten = \"{listen}\"\nshutdown_grace = \"10s\"\n[store]\nbackend = \"redis\"\nurl = \"{redis_url}\"\n[upstream]\nurl = \"{upstream}\"\n{extra}"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_killed_mid_request_never_leads_to_a_second_execution() {
    let redis = RedisServer::start();
    let (up, gate) = Upstream::gated().await;
    let config = redis_config(
        &up.url(),
        &redis.url(),
        "127.0.0.1:0",
        // Long enough that the restarted gateway is up well within the dead owner's lease.
        "[[routes]]\nname = \"payments\"\npath = \"/payments\"\nlock_timeout = \"6s\"\nwait = \"0s\"\n",
    );
    let gw = GatewayProcess::start(&config);
    let http = Http::new(gw.addr);
    // The dead owner's lease runs at least until this plus lock_timeout.
    let sent = std::time::Instant::now();
    let doomed = spawn_post_to_be_killed(&http, "k");
    up.next_arrival().await;
    gw.signal_and_wait("-KILL");
    assert!(
        doomed.await.unwrap().is_none(),
        "the client lost its connection"
    );

    let gw = GatewayProcess::start(&config);
    let http = Http::new(gw.addr);
    // While the dead owner's lease is still valid: in flight. (Answered after the lease could
    // have run out, on a stalled machine, it may already be unknown, never executed.)
    let early = http.post("/payments", "k", "{}").await;
    if sent.elapsed() < Duration::from_secs(6) {
        assert_eq!(early.status, 409, "{early:?}");
        assert_eq!(early.problem_type(), "in-flight");
    } else {
        assert!(
            ["in-flight", "outcome-unknown"].contains(&early.problem_type().as_str()),
            "{early:?}"
        );
    }
    // Once it ran out: the outcome is unknown, and it says why.
    let late = retry_while_in_flight(&http, "k").await;
    assert_eq!(late.status, 502);
    assert_eq!(late.problem_type(), "outcome-unknown");
    assert!(
        late.text().contains("stopped before the upstream answered"),
        "{}",
        late.text()
    );
    gate.add_permits(10);
    assert_eq!(
        http.post("/payments", "k", "{}").await.problem_type(),
        "outcome-unknown"
    );
    assert_eq!(up.executions(), 1, "never executed a second time");

    // The operator checks the record, then releases it: the next retry executes.
    let dir = TempDir::new("keys");
    let path = dir.path.join("proxy.toml");
    std::fs::write(&path, &config).unwrap();
    let get = keys_cmd(&path, "get", "payments", &["k"]);
    let shown = String::from_utf8_lossy(&get.stdout);
    assert!(
        get.status.success(),
        "{shown}{}",
        String::from_utf8_lossy(&get.stderr)
    );
    assert!(shown.contains("lease expired"), "{shown}");
    let del = keys_cmd(&path, "delete", "payments", &["k"]);
    assert!(del.status.success());
    assert!(String::from_utf8_lossy(&del.stdout).contains("deleted"));
    let gone = keys_cmd(&path, "get", "payments", &["k"]);
    assert_eq!(gone.status.code(), Some(1));
    let after = http.post("/payments", "k", "{}").await;
    assert_eq!(after.status, 201);
    assert_eq!(up.executions(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_on_unknown_retry_an_abandoned_key_is_taken_over() {
    let redis = RedisServer::start();
    let gate = Arc::new(Semaphore::new(0));
    let g = Arc::clone(&gate);
    let up = Upstream::start(move |_, n| {
        let r = Reply::json(201, &format!("{{\"n\":{n}}}"));
        if n == 1 {
            r.gated(&g)
        } else {
            r
        }
    })
    .await;
    let config = redis_config(
        &up.url(),
        &redis.url(),
        "127.0.0.1:0",
        "[[routes]]\npath = \"/payments\"\nlock_timeout = \"1s\"\nwait = \"0s\"\non_unknown = \"retry\"\n",
    );
    let gw = GatewayProcess::start(&config);
    let http = Http::new(gw.addr);
    spawn_post_to_be_killed(&http, "k");
    up.next_arrival().await;
    gw.signal_and_wait("-KILL");
    let gw = GatewayProcess::start(&config);
    let http = Http::new(gw.addr);
    let got = retry_while_in_flight(&http, "k").await;
    assert_eq!(got.status, 201, "{got:?}");
    assert_eq!(&got.body[..], b"{\"n\":2}");
    assert!(http.post("/payments", "k", "{}").await.is_replay());
    assert_eq!(up.executions(), 2);
    gate.add_permits(1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_on_unknown_retry_a_reset_or_timeout_releases_the_key() {
    let up = Upstream::start(|_, n| match n {
        1 => Reply::Reset,
        2 => Reply::Hang,
        _ => Reply::json(201, "{}"),
    })
    .await;
    let gw = gateway(
        &up.url(),
        "[[routes]]\npath = \"/payments\"\non_unknown = \"retry\"\nupstream_timeout = \"1s\"\n",
    )
    .await;
    let http = Http::new(gw.addr());
    let reset = http.post("/payments", "k", "{}").await;
    assert_eq!(reset.problem_type(), "outcome-unknown");
    assert!(reset.text().contains("executes it again"));
    let timeout = http.post("/payments", "k", "{}").await;
    assert_eq!(timeout.status, 504);
    assert_eq!(timeout.problem_type(), "outcome-unknown");
    assert_eq!(http.post("/payments", "k", "{}").await.status, 201);
    assert_eq!(up.executions(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_renewal_keeps_a_slow_upstream_call_from_being_taken_over() {
    let redis = RedisServer::start();
    let (up, gate) = Upstream::gated().await;
    let config = redis_config(
        &up.url(),
        &redis.url(),
        "127.0.0.1:0",
        "[[routes]]\npath = \"/payments\"\nlock_timeout = \"2s\"\nwait = \"0s\"\non_unknown = \"retry\"\n",
    );
    let gw = GatewayProcess::start(&config);
    let http = Http::new(gw.addr);
    let original = tokio::spawn({
        let http = http.clone();
        async move { http.post("/payments", "slow", "{}").await }
    });
    up.next_arrival().await;
    // Well past several leases, the live owner still holds the key (even with on_unknown =
    // "retry", which would take over an expired lease).
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_secs(2)).await;
        // A duplicate that took the key over would be held at the gated upstream.
        let dup = http
            .request("POST", "/payments")
            .header("Idempotency-Key", "slow")
            .json("{}")
            .try_send(Duration::from_secs(10))
            .await
            .expect("a duplicate took over the live owner's key");
        assert_eq!(dup.problem_type(), "in-flight");
    }
    gate.add_permits(1);
    let original = original.await.unwrap();
    assert_eq!(original.status, 201);
    assert!(http.post("/payments", "slow", "{}").await.is_replay());
    assert_eq!(up.executions(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_in_flight_requests_finish_and_their_results_replay_after_restart() {
    let redis = RedisServer::start();
    let (up, gate) = Upstream::gated().await;
    let config = redis_config(&up.url(), &redis.url(), "127.0.0.1:0", PAYMENTS);
    let gw = GatewayProcess::start(&config);
    let addr = gw.addr;
    let http = Http::new(addr);
    let mut in_flight = Vec::new();
    for i in 0..3 {
        let http = http.clone();
        in_flight.push(tokio::spawn(async move {
            http.post("/payments", &format!("k{i}"), "{}").await
        }));
    }
    for _ in 0..3 {
        up.next_arrival().await;
    }
    gw.signal("-TERM");
    // The listener closes first...
    let closed = eventually(|| async { tokio::net::TcpStream::connect(addr).await.is_err() }).await;
    assert!(closed, "the listener closes as shutdown begins");
    // ...then the upstream answers, and every in-flight client gets its result.
    gate.add_permits(3);
    let mut bodies = HashMap::new();
    for (i, t) in in_flight.into_iter().enumerate() {
        let got = t.await.unwrap();
        assert_eq!(got.status, 201);
        bodies.insert(i, got.body);
    }
    let status = tokio::task::spawn_blocking(move || gw.signal_and_wait("-0"))
        .await
        .unwrap();
    assert_eq!(status.code(), Some(0), "exit 0 after draining");

    let gw = GatewayProcess::start(&config);
    let http = Http::new(gw.addr);
    for (i, body) in bodies {
        let again = http.post("/payments", &format!("k{i}"), "{}").await;
        assert!(again.is_replay());
        assert_eq!(again.body, body);
    }
    assert_eq!(up.executions(), 3);
}

/// Many clients retrying aggressively with random timeouts, an upstream with random latency and
/// resets, gateways killed and restarted at random, Redis restarted once. At the end: at most one
/// execution per key, and every 2xx for a key carried the same body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos() {
    const RUN: Duration = Duration::from_secs(25);
    let mut redis = RedisServer::start_durable();
    let up = Upstream::start(|_, n| {
        let mut rng = rand::rng();
        let latency = Duration::from_millis(rng.random_range(0..150));
        if rng.random_bool(0.1) {
            Reply::Delayed(latency, Box::new(Reply::Reset))
        } else {
            Reply::Delayed(
                latency,
                Box::new(Reply::json(201, &format!("{{\"execution\":{n}}}"))),
            )
        }
    })
    .await;
    let ports: Vec<u16> = (0..2).map(|_| free_port(false)).collect();
    let configs: Vec<String> = ports
        .iter()
        .map(|p| {
            redis_config(
                &up.url(),
                &redis.url(),
                &format!("127.0.0.1:{p}"),
                "[[routes]]\npath = \"/payments\"\nlock_timeout = \"1s\"\nwait = \"2s\"\nupstream_timeout = \"1s\"\n",
            )
        })
        .collect();
    let gateways: Arc<Mutex<Vec<Option<GatewayProcess>>>> = Arc::new(Mutex::new(
        configs
            .iter()
            .map(|c| Some(GatewayProcess::start(c)))
            .collect(),
    ));
    let addrs: Vec<SocketAddr> = ports
        .iter()
        .map(|p| format!("127.0.0.1:{p}").parse().unwrap())
        .collect();

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let bodies: Arc<Mutex<HashMap<String, Vec<bytes::Bytes>>>> = Arc::default();
    let mut clients = Vec::new();
    for c in 0..12 {
        let (stop, bodies, addrs) = (Arc::clone(&stop), Arc::clone(&bodies), addrs.clone());
        clients.push(tokio::spawn(async move {
            let mut finished = 0;
            for j in 0..10_000 {
                if stop.load(std::sync::atomic::Ordering::SeqCst) {
                    break;
                }
                let key = format!("c{c}-{j}");
                for _ in 0..100 {
                    if stop.load(std::sync::atomic::Ordering::SeqCst) {
                        break;
                    }
                    let (addr, timeout) = {
                        let mut rng = rand::rng();
                        (
                            addrs[rng.random_range(0..addrs.len())],
                            Duration::from_millis(rng.random_range(50..800)),
                        )
                    };
                    let got = Http::new(addr)
                        .request("POST", "/payments")
                        .header("idempotency-key", &key)
                        .json("{}")
                        .try_send(timeout)
                        .await;
                    let Some(got) = got else { continue };
                    if got.status.is_success() {
                        bodies
                            .lock()
                            .unwrap()
                            .entry(key.clone())
                            .or_default()
                            .push(got.body.clone());
                        finished += 1;
                        break;
                    }
                    let problem = (got.header("content-type") == Some("application/problem+json"))
                        .then(|| got.problem_type());
                    if problem.as_deref() == Some("outcome-unknown") {
                        finished += 1;
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            finished
        }));
    }

    // The chaos: kill -9 and restart gateways at random, and restart Redis once, midway.
    let started = tokio::time::Instant::now();
    let mut redis_restarted = false;
    let mut kills = 0;
    while started.elapsed() < RUN {
        let pause = Duration::from_millis(rand::rng().random_range(500..2000));
        tokio::time::sleep(pause).await;
        if !redis_restarted && started.elapsed() > RUN / 2 {
            redis.restart();
            redis_restarted = true;
            continue;
        }
        let i = rand::rng().random_range(0..configs.len());
        let old = gateways.lock().unwrap()[i].take();
        if let Some(gw) = old {
            tokio::task::spawn_blocking(move || gw.signal_and_wait("-KILL"))
                .await
                .unwrap();
            kills += 1;
        }
        let config = configs[i].clone();
        let fresh = tokio::task::spawn_blocking(move || GatewayProcess::start(&config))
            .await
            .unwrap();
        gateways.lock().unwrap()[i] = Some(fresh);
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut finished = 0;
    for c in clients {
        finished += c.await.unwrap();
    }
    let executions = up.executions();
    eprintln!("chaos: {kills} gateway kills, Redis restarted once, {finished} keys finished, {executions} upstream executions");
    assert!(
        redis_restarted && kills >= 3,
        "the chaos happened ({kills} kills)"
    );
    assert!(
        finished > 50,
        "clients got through the chaos ({finished} keys finished)"
    );

    let mut per_key: HashMap<String, usize> = HashMap::new();
    for s in up.seen() {
        let k = s.headers["idempotency-key"].to_str().unwrap().to_string();
        *per_key.entry(k).or_default() += 1;
    }
    let twice: Vec<_> = per_key.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "keys executed more than once: {twice:?}");

    // Every key that got a 2xx replays exactly that body now, or (if the store lost the race
    // with a kill) says its outcome is unknown (a sample, through either gateway).
    let finished: Vec<(String, bytes::Bytes)> = bodies
        .lock()
        .unwrap()
        .iter()
        .take(200)
        .map(|(k, v)| (k.clone(), v[0].clone()))
        .collect();
    assert!(!finished.is_empty());
    for (i, (key, body)) in finished.iter().enumerate() {
        let replay = Http::new(addrs[i % addrs.len()])
            .request("POST", "/payments")
            .header("idempotency-key", key)
            .json("{}")
            .send()
            .await;
        if replay.status.is_success() {
            assert!(replay.is_replay(), "{key}: {replay:?}");
            assert_eq!(
                &replay.body, body,
                "{key}: the replay differs from the 2xx the client got"
            );
        } else {
            // The client got its answer but storing it failed (Redis or the gateway died right
            // then): the key stays pending, then unknown. Never a second execution.
            let problem = replay.problem_type();
            assert!(
                problem == "outcome-unknown" || problem == "in-flight",
                "{key}: {replay:?}"
            );
        }
    }
    assert_eq!(up.executions(), executions, "replays executed nothing");
}

#[tokio::test]
async fn a_response_body_cut_off_mid_way_is_an_unknown_outcome() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // An upstream that promises 100 bytes, sends 5 and hangs up.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let served = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = Arc::clone(&served);
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let mut buf = vec![0u8; 4096];
            let mut seen = Vec::new();
            while !String::from_utf8_lossy(&seen).contains("\r\n\r\n{}") {
                let n = s.read(&mut buf).await.unwrap_or(0);
                if n == 0 {
                    break;
                }
                seen.extend_from_slice(&buf[..n]);
            }
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let _ = s
                .write_all(b"HTTP/1.1 201 Created\r\ncontent-length: 100\r\n\r\nshort")
                .await;
        }
    });
    let gw = gateway(&format!("http://{addr}"), PAYMENTS).await;
    let http = Http::new(gw.addr());
    let first = http.post("/payments", "k", "{}").await;
    assert_eq!(first.status, 502);
    assert_eq!(first.problem_type(), "outcome-unknown");
    let retry = http.post("/payments", "k", "{}").await;
    assert_eq!(retry.problem_type(), "outcome-unknown");
    assert_eq!(
        served.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the retry was not executed"
    );
}
