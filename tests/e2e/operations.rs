//! Operations: metrics move per outcome, readiness follows the store and shutdown, SIGHUP reloads
//! under traffic, JSON logs never carry keys or credentials.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;

use crate::support::redis::RedisServer;
use crate::support::*;

fn delta(before: &HashMap<String, f64>, after: &HashMap<String, f64>, name: &str) -> f64 {
    after.get(name).copied().unwrap_or(0.0) - before.get(name).copied().unwrap_or(0.0)
}

fn requests(route: &str, outcome: &str) -> String {
    format!("idemgate_requests_total{{route=\"{route}\",outcome=\"{outcome}\"}}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_every_outcome() {
    let gate = Arc::new(Semaphore::new(0));
    let g = Arc::clone(&gate);
    let up = Upstream::start(move |seen, n| match seen.path_and_query.as_str() {
        "/slow" | "/busy" => Reply::json(201, "{}").gated(&g),
        "/reset" => Reply::Reset,
        "/limited" => Reply::json(429, "{}"),
        _ => Reply::json(201, &format!("{{\"n\":{n}}}")),
    })
    .await;
    let closed = closed_port().await;
    let gw = Running::start(
        config(
            &up.url(),
            &format!(
                "[[routes]]\nname = \"payments\"\npath = \"/payments\"\nmax_body = 64\n\
             [[routes]]\nname = \"slow\"\npath = \"/slow\"\n\
             [[routes]]\nname = \"busy\"\npath = \"/busy\"\nupstream = \"{}\"\nwait = \"0s\"\n\
             [[routes]]\nname = \"down\"\npath = \"/down\"\nupstream = \"http://{closed}\"\n\
             [[routes]]\nname = \"reset\"\npath = \"/reset\"\n\
             [[routes]]\nname = \"limited\"\npath = \"/limited\"\n",
                up.url()
            ),
        )
        .with_admin(),
    )
    .await
    .unwrap();
    let admin = gw.admin_addr().unwrap();
    let http = Http::new(gw.addr());
    let before = scrape(admin).await;

    http.post("/payments", "a", "{}").await; // executed
    http.post("/payments", "a", "{}").await; // replayed
    http.post("/payments", "a", "{\"x\":1}").await; // mismatch
    http.request("POST", "/payments").send().await; // missing_key
    http.post("/payments", "a b", "{}").await; // invalid_key
    http.post(
        "/payments",
        "big",
        &format!("{{\"p\":\"{}\"}}", "x".repeat(100)),
    )
    .await; // too_large
    http.request("GET", "/elsewhere").send().await; // passthrough
    http.post("/down", "d", "{}").await; // upstream_error
    http.post("/reset", "r", "{}").await; // unknown
    http.post("/limited", "l", "{}").await; // released
                                            // waited: a duplicate that waits for the original.
    let (h1, h2) = (http.clone(), http.clone());
    let original = tokio::spawn(async move { h1.post("/slow", "s", "{}").await });
    up.arrival_at("/slow").await;
    let waiter = tokio::spawn(async move { h2.post("/slow", "s", "{}").await });
    // in_flight_rejected: wait = 0s on a held key.
    let busy_original = tokio::spawn({
        let http = http.clone();
        async move { http.post("/busy", "b", "{}").await }
    });
    up.arrival_at("/busy").await;
    assert_eq!(http.post("/busy", "b", "{}").await.status, 409);
    // The two held originals and the waiter: open the gate only once the waiter waits (being in
    // flight is not enough: it may not have reached the store yet), or it would count as a
    // replay.
    let waiting = || async {
        scrape(admin)
            .await
            .get("idemgate_waiting_requests")
            .copied()
            .unwrap_or(0.0)
    };
    assert!(
        eventually(|| async { waiting().await == 1.0 }).await,
        "the duplicate never waited"
    );
    assert_eq!(
        scrape(admin).await["idemgate_requests_in_flight"],
        3.0,
        "held requests and the waiter are in flight"
    );
    gate.add_permits(10);
    original.await.unwrap();
    waiter.await.unwrap();
    busy_original.await.unwrap();

    let after = scrape(admin).await;
    for (route, outcome, n) in [
        ("payments", "executed", 1.0),
        ("payments", "replayed", 1.0),
        ("payments", "mismatch", 1.0),
        ("payments", "missing_key", 1.0),
        ("payments", "invalid_key", 1.0),
        ("payments", "too_large", 1.0),
        ("", "passthrough", 1.0),
        ("down", "upstream_error", 1.0),
        ("reset", "unknown", 1.0),
        ("limited", "released", 1.0),
        ("limited", "upstream_error", 0.0),
        ("slow", "executed", 1.0),
        ("slow", "waited", 1.0),
        ("busy", "in_flight_rejected", 1.0),
        ("busy", "executed", 1.0),
    ] {
        assert_eq!(
            delta(&before, &after, &requests(route, outcome)),
            n,
            "{route} {outcome}"
        );
    }
    assert!(
        delta(
            &before,
            &after,
            "idemgate_upstream_duration_seconds_count{route=\"payments\"}"
        ) >= 1.0
    );
    assert!(
        delta(
            &before,
            &after,
            "idemgate_store_duration_seconds_count{op=\"reserve\"}"
        ) >= 8.0
    );
    assert_eq!(after["idemgate_requests_in_flight"], 0.0);
    assert!(after.contains_key("idemgate_records_purged_total"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_follows_redis_and_store_errors_are_counted() {
    let mut redis = RedisServer::start();
    let up = Upstream::counting().await;
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n[store]\nbackend = \"redis\"\nurl = \"{}\"\ncommand_timeout = \"300ms\"\n[upstream]\nurl = \"{}\"\n{PAYMENTS}",
        redis.url(),
        up.url()
    );
    let gw = Running::start(idemgate::config::Config::parse(&text).unwrap())
        .await
        .unwrap();
    let admin = gw.admin_addr().unwrap();
    assert_eq!(poll_status(admin, "/readyz", 200).await, 200);

    redis.kill();
    assert_eq!(poll_status(admin, "/readyz", 503).await, 503);
    assert_eq!(
        admin_get(admin, "/healthz").await.0,
        200,
        "alive even without the store"
    );
    let before = scrape(admin).await;
    let got = Http::new(gw.addr()).post("/payments", "k", "{}").await;
    assert_eq!(got.status, 503);
    let after = scrape(admin).await;
    assert_eq!(
        delta(&before, &after, &requests("payments", "store_error")),
        1.0
    );
    assert!(
        delta(
            &before,
            &after,
            "idemgate_store_errors_total{op=\"reserve\"}"
        ) >= 1.0
    );

    redis.restart();
    assert_eq!(poll_status(admin, "/readyz", 200).await, 200);
}

/// Polls an admin path until it answers `want` (at most 20 s); returns the last status.
async fn poll_status(admin: std::net::SocketAddr, path: &str, want: u16) -> u16 {
    let mut last = 0;
    for _ in 0..400 {
        last = admin_get(admin, path).await.0;
        if last == want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    last
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_turns_false_as_soon_as_shutdown_begins() {
    let gate = Arc::new(Semaphore::new(0));
    let g = Arc::clone(&gate);
    let up = Upstream::start(move |_, _| Reply::json(201, "{}").gated(&g)).await;
    let gw = Running::start(config(&up.url(), PAYMENTS).with_admin())
        .await
        .unwrap();
    let admin = gw.admin_addr().unwrap();
    assert_eq!(admin_get(admin, "/readyz").await.0, 200);
    let http = Http::new(gw.addr());
    let held = tokio::spawn(async move { http.post("/payments", "k", "{}").await });
    up.next_arrival().await;
    let stopping = tokio::spawn(gw.shutdown());
    // Draining: the held request keeps the gateway up, and readiness says it is going away.
    assert_eq!(poll_status(admin, "/readyz", 503).await, 503);
    assert_eq!(admin_get(admin, "/readyz").await.1, "shutting down\n");
    gate.add_permits(1);
    assert_eq!(held.await.unwrap().status, 201);
    stopping.await.unwrap();
}

/// A bound that a busy deployment outgrows is seen coming: from 80 % full, readiness stays
/// 200 but warns, and `idemgate_store_fill_ratio` says how full; at the bound, 503 store-full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_warns_before_an_embedded_store_is_full() {
    let up = Upstream::counting().await;
    let mut config = config(&up.url(), PAYMENTS).with_admin();
    config.store = idemgate::config::StoreConfig::Memory {
        max_keys: 10,
        max_bytes: 64 << 20,
    };
    let gw = Running::start(config).await.unwrap();
    let (http, admin) = (Http::new(gw.addr()), gw.admin_addr().unwrap());
    for i in 0..7 {
        assert_eq!(
            http.post("/payments", &format!("f{i}"), "{}").await.status,
            201
        );
    }
    assert_eq!(
        admin_get(admin, "/readyz").await,
        (200, "ready\n".to_string())
    );
    assert_eq!(http.post("/payments", "f7", "{}").await.status, 201);
    let (status, text) = admin_get(admin, "/readyz").await;
    assert_eq!(status, 200);
    assert!(
        text.starts_with("ready; warning: the store is 80% full"),
        "{text}"
    );
    assert_eq!(scrape(admin).await["idemgate_store_fill_ratio"], 0.8);
    assert_eq!(http.post("/payments", "f8", "{}").await.status, 201);
    assert_eq!(http.post("/payments", "f9", "{}").await.status, 201);
    let full = http.post("/payments", "f10", "{}").await;
    assert_eq!(full.status, 503);
    assert_eq!(full.problem_type(), "store-full");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_routes_under_traffic_and_keeps_the_old_config_on_error() {
    let up = Upstream::counting().await;
    let base = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nurl = \"{}\"\n{PAYMENTS}",
        up.url()
    );
    let gw = GatewayProcess::start(&base);
    let http = Http::new(gw.addr);

    // Traffic that runs through both reloads: every request must succeed.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sent = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let traffic = tokio::spawn({
        let (http, stop, sent) = (http.clone(), Arc::clone(&stop), Arc::clone(&sent));
        async move {
            let mut statuses = Vec::new();
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) && i < 20_000 {
                statuses.push(
                    http.post("/payments", &format!("t{i}"), "{}")
                        .await
                        .status
                        .as_u16(),
                );
                sent.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                i += 1;
            }
            statuses
        }
    });
    let traffic_reaches = |n: usize| {
        let sent = Arc::clone(&sent);
        async move {
            for _ in 0..2000 {
                if sent.load(std::sync::atomic::Ordering::SeqCst) >= n {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            panic!("traffic stalled below {n} requests");
        }
    };
    traffic_reaches(20).await;

    assert_eq!(
        http.request("POST", "/refunds").send().await.status,
        201,
        "not idempotent yet"
    );
    std::fs::write(
        &gw.config_path,
        format!("{base}[[routes]]\nname = \"refunds\"\npath = \"/refunds\"\n"),
    )
    .unwrap();
    gw.signal("-HUP");
    gw.wait_log("config reloaded");
    let refused = http.request("POST", "/refunds").send().await;
    assert_eq!(
        refused.problem_type(),
        "missing-key",
        "the new route is in force"
    );

    std::fs::write(&gw.config_path, "[server]\nlisten = 5\n").unwrap();
    gw.signal("-HUP");
    gw.wait_log("config reload failed");
    assert_eq!(
        http.request("POST", "/refunds").send().await.problem_type(),
        "missing-key",
        "old config kept"
    );

    // A store change is reported as needing a restart, and routes still reload.
    std::fs::write(
        &gw.config_path,
        format!("{base}[store]\nbackend = \"memory\"\nmax_keys = 10\n"),
    )
    .unwrap();
    gw.signal("-HUP");
    gw.wait_log("only after a restart");
    gw.wait_log("config reloaded");
    assert_eq!(
        http.request("POST", "/refunds").send().await.status,
        201,
        "route removed again"
    );

    // So is a consumers change (none is started or stopped by a reload).
    std::fs::write(
        &gw.config_path,
        format!("{base}[store]\nbackend = \"memory\"\nmax_keys = 10\n[[consumers]]\nname = \"orders\"\nsource = {{ nats_stream = \"ORDERS\", url = \"nats://127.0.0.1:1\", dead_letter = \"dead.orders\" }}\nhandler = \"http://127.0.0.1:1/orders\"\nkey = {{ json = \"/id\" }}\n"),
    )
    .unwrap();
    gw.signal("-HUP");
    gw.wait_log("they take effect only after a restart");

    let so_far = sent.load(std::sync::atomic::Ordering::SeqCst);
    traffic_reaches(so_far + 20).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let statuses = traffic.await.unwrap();
    assert!(statuses.len() >= 40);
    assert!(
        statuses.iter().all(|s| *s == 201),
        "traffic was disturbed: {statuses:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_parse_and_never_carry_keys_or_credentials() {
    let up = Upstream::counting().await;
    let gw = GatewayProcess::start_with_args(
        &format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nurl = \"{}\"\n{PAYMENTS}",
            up.url()
        ),
        &["--log-format", "json"],
    );
    let http = Http::new(gw.addr);
    const KEY: &str = "super-secret-key-8e03978e";
    const TOKEN: &str = "Bearer topsecret-token-42";
    for body in ["{}", "{}", "{\"changed\":true}"] {
        http.request("POST", "/payments")
            .header("idempotency-key", KEY)
            .header("authorization", TOKEN)
            .json(body)
            .send()
            .await;
    }
    http.request("POST", "/payments")
        .header("idempotency-key", "bad key with spaces")
        .header("authorization", TOKEN)
        .send()
        .await;
    let mut lines = vec![gw.wait_log("idempotent request")];
    for _ in 0..3 {
        lines.push(gw.wait_log("idempotent request"));
    }
    lines.extend(gw.drain_logs());
    let mut outcomes = Vec::new();
    for line in &lines {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(!line.contains(KEY), "raw key logged: {line}");
        assert!(!line.contains("topsecret"), "credential logged: {line}");
        assert!(!line.contains("spaces"), "raw invalid key logged: {line}");
        if v["message"] == "idempotent request" {
            assert_eq!(v["route"], "payments");
            assert!(v["status"].is_number() && v["elapsed_ms"].is_number());
            // Only the request that went upstream has an upstream duration.
            assert_eq!(
                v["upstream_ms"].is_number(),
                v["outcome"] == "executed",
                "{line}"
            );
            outcomes.push(v["outcome"].as_str().unwrap().to_string());
        }
    }
    assert_eq!(
        outcomes,
        vec!["executed", "replayed", "mismatch", "invalid_key"]
    );
}

/// The acceptor gives each new connection to the worker with the fewest: four keep-alive
/// connections on two workers end up two and two, and closing them brings both back to zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_spread_over_the_workers() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let up = Upstream::start(|_, _| Reply::json(200, "{}")).await;
    let mut cfg = config(&up.url(), PAYMENTS).with_admin();
    cfg.server.workers = 2;
    let gw = Running::start(cfg).await.unwrap();
    let admin = gw.admin_addr().unwrap();
    let mut open = Vec::new();
    for _ in 0..4 {
        let mut s = tokio::net::TcpStream::connect(gw.addr()).await.unwrap();
        // One full exchange: the connection has been accepted and handed over by then.
        s.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 1024];
        let n = s.read(&mut buf).await.unwrap();
        assert!(
            buf[..n].starts_with(b"HTTP/1.1 200"),
            "{:?}",
            String::from_utf8_lossy(&buf[..n])
        );
        open.push(s);
    }
    let m = scrape(admin).await;
    for w in ["0", "1"] {
        let name = format!("idemgate_worker_connections{{worker=\"{w}\"}}");
        assert_eq!(m.get(&name), Some(&2.0), "{name} in {m:?}");
    }
    drop(open);
    // Closing is seen by the workers asynchronously: wait for the gauges to drop.
    let connections = || async {
        scrape(admin)
            .await
            .iter()
            .filter(|(k, _)| k.starts_with("idemgate_worker_connections"))
            .map(|(_, v)| v)
            .sum::<f64>()
    };
    eventually(|| async { connections().await == 0.0 }).await;
    assert_eq!(connections().await, 0.0, "worker connections back to 0");
}

/// A SIGHUP while the gateway is still starting (its store connecting, say) does not end the
/// process: it is caught from the first instant, and reloads the config once it serves.
#[tokio::test]
async fn a_sighup_during_a_slow_start_does_not_kill_the_gateway() {
    let up = Upstream::counting().await;
    let dir = TempDir::new("slow-start");
    let config = dir.path.join("idemgate.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nurl = \"{}\"\n[store]\nbackend = \"memory\"\n[[routes]]\npath = \"/payments\"\n",
            up.url()
        ),
    )
    .unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["run", "--config"])
        .arg(&config)
        .env("RUST_LOG", "info")
        .env("FAILPOINTS", "startup=sleep(1500)")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let rx = follow_logs(&mut child);
    // Killed however the test ends.
    struct Killed(std::process::Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut child = Killed(child);
    // Waits for a line with each of `needles`, in any order.
    let wait_for = |needles: &[&str]| {
        let mut left: Vec<&str> = needles.to_vec();
        while !left.is_empty() {
            let line = rx
                .recv_timeout(Duration::from_secs(20))
                .unwrap_or_else(|_| panic!("no {left:?} line within 20s"));
            left.retain(|needle| !line.contains(needle));
        }
    };
    wait_for(&["starting"]);
    // Inside the slow start now (it sleeps 1.5 s after that line).
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.0.id() as i32),
        nix::sys::signal::Signal::SIGHUP,
    )
    .unwrap();
    wait_for(&["idemgate listening", "config reloaded"]);
    assert!(child.0.try_wait().unwrap().is_none(), "still running");
}
