//! The gateway on a shared Redis: several real gateway processes, Redis outages, and startup
//! without Redis. Real `redis-server`, real upstream, real gateways, over loopback.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;

use crate::support::redis::{free_port, RedisServer};
use crate::support::*;

fn redis_config(upstream: &str, redis_url: &str, extra: &str) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nshutdown_grace = \"5s\"\n[store]\nbackend = \"redis\"\nurl = \"{redis_url}\"\ncommand_timeout = \"2s\"\n[upstream]\nurl = \"{upstream}\"\n{extra}"
    )
}

/// Waits (bounded) until the upstream has executed `n` requests in all.
async fn executions_reach(up: &Upstream, n: usize) {
    let reached = eventually(|| async { up.executions() >= n }).await;
    assert!(
        reached,
        "the upstream executed {} requests, not {n}",
        up.executions()
    );
}

async fn in_process(upstream: &str, redis_url: &str, extra: &str) -> idemgate::server::Running {
    let config =
        idemgate::config::Config::parse(&redis_config(upstream, redis_url, extra)).unwrap();
    idemgate::server::Running::start(config).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateway_processes_on_one_redis_execute_once_and_a_third_replays() {
    let redis = RedisServer::start();
    let gate = Arc::new(Semaphore::new(0));
    let g = Arc::clone(&gate);
    let up =
        Upstream::start(move |_, n| Reply::json(201, &format!("{{\"execution\":{n}}}")).gated(&g))
            .await;
    let config = redis_config(&up.url(), &redis.url(), PAYMENTS);
    // Each with its admin listener, to see when every duplicate is inside.
    let admins: [std::net::SocketAddr; 2] =
        std::array::from_fn(|_| format!("127.0.0.1:{}", free_port(false)).parse().unwrap());
    let with_admin = |admin: std::net::SocketAddr| {
        TomlConfig::parse(&config)
            .set("server.admin", admin.to_string())
            .text()
    };
    let gw1 = GatewayProcess::start(&with_admin(admins[0]));
    let gw2 = GatewayProcess::start(&with_admin(admins[1]));

    let mut calls = Vec::new();
    for i in 0..40 {
        let http = Http::new(if i % 2 == 0 { gw1.addr } else { gw2.addr });
        calls.push(tokio::spawn(async move {
            http.post("/payments", "shared-across-instances", r#"{"amount":100}"#)
                .await
        }));
    }
    // The first is held at the upstream; open the gate only once all 40 are inside the two
    // gateways, so the duplicates on the other instance really race the held key.
    up.next_arrival().await;
    let in_flight = || async {
        let mut total = 0.0;
        for admin in admins {
            total += scrape(admin).await["idemgate_requests_in_flight"];
        }
        total
    };
    eventually(|| async { in_flight().await >= 40.0 }).await;
    assert_eq!(
        in_flight().await,
        40.0,
        "all 40 are in flight across both instances"
    );
    gate.add_permits(100);
    let mut bodies = Vec::new();
    for c in calls {
        let got = c.await.unwrap();
        assert_eq!(got.status, 201, "{got:?}");
        bodies.push(got.body);
    }
    assert_eq!(up.executions(), 1, "one execution across both instances");
    assert!(bodies.iter().all(|b| b == &bodies[0]));

    // An instance started afterwards replays what the others stored.
    let gw3 = GatewayProcess::start(&config);
    let late = Http::new(gw3.addr)
        .post("/payments", "shared-across-instances", r#"{"amount":100}"#)
        .await;
    assert!(late.is_replay());
    assert_eq!(late.body, bodies[0]);
    assert_eq!(up.executions(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_gateway_loses_nothing() {
    let redis = RedisServer::start();
    let up = Upstream::counting().await;
    let config = redis_config(&up.url(), &redis.url(), PAYMENTS);
    let gw = GatewayProcess::start(&config);
    let first = Http::new(gw.addr).post("/payments", "k", "{}").await;
    assert_eq!(first.status, 201);
    assert!(gw.signal_and_wait("-KILL").code().is_none());
    let gw = GatewayProcess::start(&config);
    let again = Http::new(gw.addr).post("/payments", "k", "{}").await;
    assert!(again.is_replay());
    assert_eq!(again.body, first.body);
    assert_eq!(up.executions(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_and_restarted_under_traffic_never_executes_twice() {
    let mut redis = RedisServer::start_durable();
    let up = Upstream::counting().await;
    let gw = in_process(
        &up.url(),
        &redis.url(),
        &format!("{PAYMENTS}lock_timeout = \"1s\"\nwait = \"1s\"\n"),
    )
    .await;
    let http = Http::new(gw.addr());

    // Keys settled before the outage.
    let mut before = HashMap::new();
    for i in 0..5 {
        let got = http.post("/payments", &format!("before-{i}"), "{}").await;
        assert_eq!(got.status, 201);
        before.insert(i, got.body);
    }

    // Clients that work through keys one after another, retrying each until a final answer,
    // until told to stop (bounded either way).
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut clients = Vec::new();
    for c in 0..8 {
        let (http, stop) = (http.clone(), Arc::clone(&stop));
        clients.push(tokio::spawn(async move {
            let mut results = Vec::new();
            for j in 0..200 {
                if stop.load(std::sync::atomic::Ordering::SeqCst) {
                    break;
                }
                let key = format!("during-{c}-{j}");
                let mut answers = Vec::new();
                for _ in 0..400 {
                    let got = http.post("/payments", &key, "{}").await;
                    let status = got.status.as_u16();
                    let unknown = got.header("content-type") == Some("application/problem+json")
                        && got.problem_type() == "outcome-unknown";
                    answers.push(got);
                    if status == 201 || unknown {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                results.push((key, answers));
            }
            results
        }));
    }

    // Outage: Redis dies while the clients run (once some of their keys reached the upstream).
    executions_reach(&up, up.executions() + 8).await;
    redis.kill();
    let during = http.post("/payments", "while-down", "{}").await;
    assert_eq!(during.status, 503);
    assert_eq!(during.problem_type(), "store-unavailable");
    assert!(during.header("retry-after").is_some());
    // Pass-through traffic does not need the store.
    assert_eq!(http.request("GET", "/status").send().await.status, 201);
    tokio::time::sleep(Duration::from_millis(300)).await;
    redis.restart();
    // Clients get through again: keys keep reaching the upstream after the restart. Twice the
    // clients' number, so that new keys, not only the ones retried through the outage, have run
    // (with 8, all 8 could be the retried ones, and the count of keys below came out even).
    executions_reach(&up, up.executions() + 16).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);

    let mut saw_503 = false;
    let mut keys = 0;
    for c in clients {
        for (key, answers) in c.await.unwrap() {
            keys += 1;
            saw_503 |= answers.iter().any(|a| a.status == 503);
            let last = answers.last().unwrap();
            assert!(
                last.status == 201 || last.problem_type() == "outcome-unknown",
                "{key} never got a final answer: {last:?}"
            );
            let oks: Vec<_> = answers.iter().filter(|a| a.status == 201).collect();
            assert!(
                oks.iter().all(|a| a.body == oks[0].body),
                "{key}: different 2xx bodies"
            );
        }
    }
    assert!(saw_503, "the outage was visible to the clients as 503s");
    assert!(
        keys > 16,
        "traffic ran before, during and after the outage ({keys} keys)"
    );

    // At most one execution per key, over the whole run.
    up.assert_at_most_once();

    // Service resumed without restarting the gateway, and nothing stored before was lost.
    for (i, body) in before {
        let again = http.post("/payments", &format!("before-{i}"), "{}").await;
        assert!(again.is_replay(), "before-{i} lost: {again:?}");
        assert_eq!(again.body, body);
    }
    assert_eq!(http.post("/payments", "after", "{}").await.status, 201);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_starts_without_redis_and_recovers_when_it_comes() {
    let port = free_port(false);
    let up = Upstream::counting().await;
    let gw = in_process(&up.url(), &format!("redis://127.0.0.1:{port}"), PAYMENTS).await;
    let http = Http::new(gw.addr());
    let got = http.post("/payments", "k", "{}").await;
    assert_eq!(got.status, 503);
    assert_eq!(got.problem_type(), "store-unavailable");
    assert_eq!(up.executions(), 0);

    let _redis = RedisServer::start_on(port, &[]);
    let mut last = got;
    for _ in 0..200 {
        last = http.post("/payments", "k", "{}").await;
        if last.status != 503 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(last.status, 201, "{last:?}");
    assert!(http.post("/payments", "k", "{}").await.is_replay());
    assert_eq!(up.executions(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_store_error_pass_forwards_without_idempotency() {
    let port = free_port(false);
    let up = Upstream::counting().await;
    let gw = in_process(
        &up.url(),
        &format!("redis://127.0.0.1:{port}"),
        "[[routes]]\npath = \"/payments\"\non_store_error = \"pass\"\n[[routes]]\npath = \"/refunds\"\n",
    )
    .await;
    let http = Http::new(gw.addr());
    for _ in 0..2 {
        let got = http.post("/payments", "k", "{}").await;
        assert_eq!(got.status, 201);
        assert!(!got.is_replay());
        assert_eq!(
            got.header("idempotency-bypassed"),
            Some("true"),
            "the client is told the answer had no idempotency"
        );
    }
    assert_eq!(up.executions(), 2, "fail-open: both were forwarded");
    assert_eq!(
        http.post("/refunds", "k", "{}").await.status,
        503,
        "the default stays fail-closed"
    );
    assert_eq!(up.executions(), 2);
}

/// Watches Redis with `MONITOR` and counts the commands clients send (a script's own commands,
/// tagged `lua`, are part of its one round trip and not counted; they are kept in `in_scripts`).
struct RoundTrips {
    lines: std::sync::mpsc::Receiver<String>,
    child: std::process::Child,
    port: u16,
    marks: u32,
    in_scripts: Vec<String>,
}

impl RoundTrips {
    fn watch(redis: &RedisServer) -> RoundTrips {
        use std::io::BufRead;
        let mut child = std::process::Command::new("redis-cli")
            .args(["-p", &redis.port.to_string(), "monitor"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("redis-cli is needed (apt-get install redis-server)");
        let out = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        // MONITOR answers "OK" once the server streams commands to it: only then is it watching.
        loop {
            let line = lines
                .recv_timeout(Duration::from_secs(10))
                .expect("redis-cli monitor did not start");
            if line == "OK" {
                break;
            }
        }
        let mut rt = RoundTrips {
            lines,
            child,
            port: redis.port,
            marks: 0,
            in_scripts: Vec::new(),
        };
        rt.take(); // anything already in flight
        rt
    }

    /// Commands seen since the last call: waits for a marker sent after them, so nothing in
    /// flight is missed and nothing is guessed.
    fn take(&mut self) -> Vec<String> {
        self.marks += 1;
        let mark = format!("round-trip-mark-{}", self.marks);
        crate::support::redis::cli(self.port, &["echo", &mark]);
        let mut seen = Vec::new();
        self.in_scripts.clear();
        loop {
            let line = self
                .lines
                .recv_timeout(Duration::from_secs(10))
                .expect("MONITOR went quiet");
            if line.contains(&mark) {
                return seen;
            }
            if line.contains(" lua]") {
                self.in_scripts.push(line);
                continue;
            }
            if line == "OK" || line.contains("round-trip-mark-") {
                continue;
            }
            seen.push(line);
        }
    }
}

impl Drop for RoundTrips {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_round_trips_new_key_2_replay_1_passthrough_0() {
    let redis = RedisServer::start();
    let up = Upstream::counting().await;
    // One worker: a client connection handed to another worker would show that worker's first
    // Redis connection being set up among the commands counted.
    let mut config =
        idemgate::config::Config::parse(&redis_config(&up.url(), &redis.url(), PAYMENTS)).unwrap();
    config.server.workers = 1;
    let gw = idemgate::server::Running::start(config).await.unwrap();
    let http = Http::new(gw.addr());
    // Warm up: connections made, scripts loaded into Redis's script cache.
    assert_eq!(http.post("/payments", "warm-up", "{}").await.status, 201);
    let mut monitor = RoundTrips::watch(&redis);

    assert_eq!(http.post("/payments", "new-key", "{}").await.status, 201);
    let cmds = monitor.take();
    assert_eq!(
        cmds.len(),
        2,
        "a new key: reserve + complete, got {cmds:#?}"
    );
    assert!(
        cmds[0].contains("\"SET\"") && cmds[0].contains("\"NX\""),
        "{cmds:#?}"
    );
    assert!(cmds[1].contains("\"EVALSHA\""), "{cmds:#?}");
    // Nobody waited on it, so nothing was published (pub/sub costs Redis a message per waiter).
    assert!(
        !monitor.in_scripts.is_empty()
            && !monitor.in_scripts.iter().any(|l| l.contains("\"PUBLISH\"")),
        "{:#?}",
        monitor.in_scripts
    );

    assert!(http.post("/payments", "new-key", "{}").await.is_replay());
    let cmds = monitor.take();
    assert_eq!(
        cmds.len(),
        1,
        "a replay: one reserve that returns the record, got {cmds:#?}"
    );

    assert_eq!(http.request("GET", "/elsewhere").send().await.status, 201);
    let cmds = monitor.take();
    assert!(
        cmds.is_empty(),
        "pass-through never touches Redis, got {cmds:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_get_finds_records_of_routes_keyed_by_body_fields() {
    let redis = RedisServer::start();
    let up = Upstream::counting().await;
    let routes = "[defaults]\nclient_header = \"\"\n[[routes]]\nname = \"biz\"\npath = \"/events\"\nkey = { json = [\"/data/object/id\", \"/type\"] }\ncheck_fingerprint = false\n";
    let text = redis_config(&up.url(), &redis.url(), routes);
    let gw = in_process(&up.url(), &redis.url(), routes).await;
    let got = Http::new(gw.addr())
        .request("POST", "/events")
        .json(r#"{"id":"evt_1","type":"payment_intent.succeeded","data":{"object":{"id":"pi_1"}}}"#)
        .send()
        .await;
    assert_eq!(got.status, 201);

    let dir = TempDir::new("keys-parts");
    let path = dir.path.join("proxy.toml");
    std::fs::write(&path, text).unwrap();
    let keys = |parts: &[&str]| keys_cmd(&path, "get", "biz", parts);
    let found = keys(&["pi_1", "payment_intent.succeeded"]);
    let shown = String::from_utf8_lossy(&found.stdout);
    assert!(
        found.status.success(),
        "{shown}{}",
        String::from_utf8_lossy(&found.stderr)
    );
    assert!(
        shown.contains("state        completed") && shown.contains("status       201"),
        "{shown}"
    );
    assert_eq!(
        keys(&["pi_2", "payment_intent.succeeded"]).status.code(),
        Some(1),
        "another operation"
    );
    let wrong = keys(&["pi_1"]);
    assert_eq!(wrong.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&wrong.stderr).contains("2 part(s)"));
}

/// Key parts keep their JSON type (issue 45): the number 10 and the string "1e1", `true` and
/// `"true"`, are different keys; a record the previous version stored under a number part's
/// text (its derivation) still answers that number's retry across the upgrade.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_parts_keep_their_type_and_find_what_the_previous_version_stored() {
    use idemgate::store::{Claim, Reservation};
    let redis = RedisServer::start();
    let up = Upstream::counting().await;
    let routes = "[defaults]\nclient_header = \"\"\n[[routes]]\nname = \"typed\"\npath = \"/orders\"\nkey = { json = [\"/order\", \"/n\"] }\ncheck_fingerprint = false\n";
    let text = redis_config(&up.url(), &redis.url(), routes);
    let config = idemgate::config::Config::parse(&text).unwrap();
    // What the previous version stored for {"order":"ord_1","n":10}: the parts as text.
    let old_key = idemgate::operator::locate(
        &config,
        "typed",
        &["ord_1".into(), "1e1".into()],
        &Default::default(),
    )
    .unwrap();
    let store = idemgate::operator::open_store(&config).await.unwrap();
    let ttl = Duration::from_secs(3600);
    store_completed(&*store, &old_key, b"stored by the previous version", ttl).await;
    let claim = Claim::from(idemgate::fingerprint::Fingerprint([9; 32]));

    let gw = in_process(&up.url(), &redis.url(), routes).await;
    let http = Http::new(gw.addr());
    let post = |body: &'static str| http.request("POST", "/orders").json(body).send();
    let across = post(r#"{"order":"ord_1","n":10}"#).await;
    assert!(across.is_replay(), "{across:?}");
    assert_eq!(across.body, "stored by the previous version");
    assert_eq!(up.executions(), 0);

    // New keys: each type its own.
    for body in [
        r#"{"order":"ord_2","n":10}"#,
        r#"{"order":"ord_2","n":"1e1"}"#,
        r#"{"order":"ord_2","n":true}"#,
        r#"{"order":"ord_2","n":"true"}"#,
    ] {
        let got = post(body).await;
        assert_eq!(
            (got.status.as_u16(), got.is_replay()),
            (201, false),
            "{body}: {got:?}"
        );
    }
    assert_eq!(up.executions(), 4);
    let again = post(r#"{"order":"ord_2","n":1e1}"#).await;
    assert!(again.is_replay(), "numbers compare by value");
    assert_eq!(up.executions(), 4);

    // The previous version's request still in flight under the older key: a retry waits on it,
    // and when it is released (its upstream did not run it), the retry runs under this
    // version's key, never writing under the older one (a record there would outlive the
    // window in which older keys are looked up).
    let in_flight = idemgate::operator::locate(
        &config,
        "typed",
        &["ord_3".into(), "1e1".into()],
        &Default::default(),
    )
    .unwrap();
    let Reservation::Owner(previous) = store
        .reserve(&in_flight, &claim, Duration::from_secs(30), ttl)
        .await
        .unwrap()
    else {
        panic!("a fresh key");
    };
    let retry = {
        let http = Http::new(gw.addr());
        tokio::spawn(async move {
            (http.request("POST", "/orders"))
                .json(r#"{"order":"ord_3","n":10}"#)
                .send()
                .await
        })
    };
    let waiting = || async {
        let m = gw.gateway().metrics().encode();
        m.lines().any(|l| l == "idemgate_waiting_requests 1")
    };
    assert!(
        eventually(waiting).await,
        "the retry waits on the older key"
    );
    store.release(&in_flight, previous).await.unwrap();
    let ran = retry.await.unwrap();
    assert_eq!(
        (ran.status.as_u16(), ran.is_replay()),
        (201, false),
        "{ran:?}"
    );
    assert_eq!(up.executions(), 5);
    assert!(
        store.get(&in_flight).await.unwrap().is_none(),
        "nothing written under the older key"
    );

    // Operators name a number part in JSON.
    let dir = TempDir::new("keys-typed");
    let path = dir.path.join("proxy.toml");
    std::fs::write(&path, &text).unwrap();
    let id = |parts: &[&str], json: bool| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_idemgate"));
        cmd.args(["keys", "id", "--route", "typed", "--config"])
            .arg(&path);
        if json {
            cmd.arg("--json-parts");
        }
        for part in parts {
            cmd.args(["--key", part]);
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let number = id(&["\"ord_2\"", "10"], true);
    let string = id(&["ord_2", "1e1"], false);
    assert_ne!(number, string);
    assert_eq!(string, id(&["\"ord_2\"", "\"1e1\""], true));
    let listed = keys_cmd(&path, "get", "typed", &["ord_2", "true"]);
    assert!(
        listed.status.success(),
        "the string part's record: {listed:?}"
    );
}

/// The gateway in-process on `redis_url` with an admin listener; `store_extra` are more `[store]`
/// settings.
async fn with_admin(
    upstream: &str,
    redis_url: &str,
    store_extra: &[(&str, bool)],
) -> idemgate::server::Running {
    let mut config = TomlConfig::parse(&redis_config(upstream, redis_url, PAYMENTS))
        .set("server.admin", "127.0.0.1:0");
    for (key, value) in store_extra {
        config = config.set(&format!("store.{key}"), *value);
    }
    let config = idemgate::config::Config::parse(&config.text()).unwrap();
    idemgate::server::Running::start(config).await.unwrap()
}

/// A Redis that may evict live records is reported at startup: an error in the log, a warning on
/// `/readyz`, and `idemgate_store_eviction_risk 1`; a Redis that keeps them reports 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicting_redis_is_reported() {
    let evicting =
        RedisServer::start_with(&["--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru"]);
    let safe = RedisServer::start_with(&["--appendonly", "yes"]);
    let up = Upstream::counting().await;
    let risky = with_admin(&up.url(), &evicting.url(), &[]).await;
    let fine = with_admin(&up.url(), &safe.url(), &[]).await;
    let risk = |admin, policy: &'static str| async move {
        scrape(admin)
            .await
            .get(&format!(
                "idemgate_store_eviction_risk{{policy=\"{policy}\"}}"
            ))
            .copied()
    };
    let (risky_admin, fine_admin) = (risky.admin_addr().unwrap(), fine.admin_addr().unwrap());
    assert!(eventually(|| async { risk(risky_admin, "allkeys-lru").await == Some(1.0) }).await);
    assert!(eventually(|| async { risk(fine_admin, "noeviction").await == Some(0.0) }).await);
    let (status, body) = admin_get(risky_admin, "/readyz").await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("warning") && body.contains("allkeys-lru"),
        "{body}"
    );
    assert_eq!(
        admin_get(fine_admin, "/readyz").await,
        (200, "ready\n".to_string())
    );
    // Reported, not refused: requests are served on both.
    assert_eq!(
        Http::new(risky.addr())
            .post("/payments", "k", "{}")
            .await
            .status,
        201
    );
    // A Redis without persistence forgets every key when it restarts: a warning too.
    let forgetful = RedisServer::start();
    let gw = with_admin(&up.url(), &forgetful.url(), &[]).await;
    let admin = gw.admin_addr().unwrap();
    assert!(
        eventually(|| async {
            admin_get(admin, "/readyz")
                .await
                .1
                .contains("appendonly yes")
        })
        .await,
        "{:?}",
        admin_get(admin, "/readyz").await
    );
}

/// With `store.require_noeviction = true`, an evicting Redis gets no new keys (503) and the
/// instance is not ready; a Redis set to `noeviction` is found within the recheck and used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_noeviction_refuses_an_evicting_redis() {
    let redis = RedisServer::start_with(&["--maxmemory-policy", "volatile-lru"]);
    let up = Upstream::counting().await;
    let gw = with_admin(&up.url(), &redis.url(), &[("require_noeviction", true)]).await;
    let admin = gw.admin_addr().unwrap();
    assert!(
        eventually(|| async {
            let (status, body) = admin_get(admin, "/readyz").await;
            status == 503 && body.contains("volatile-lru")
        })
        .await,
        "{:?}",
        admin_get(admin, "/readyz").await
    );
    let refused = Http::new(gw.addr()).post("/payments", "k", "{}").await;
    assert_eq!(refused.status, 503);
    assert_eq!(refused.problem_type(), "store-unavailable");
    assert_eq!(up.executions(), 0);
    // A key stored while Redis was set right still replays.
    redis.cli(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
    let before = with_admin(&up.url(), &redis.url(), &[("require_noeviction", true)]).await;
    let http = Http::new(before.addr());
    assert!(
        eventually(|| async { http.post("/payments", "stored", "{}").await.status == 201 }).await
    );
    redis.cli(&["CONFIG", "SET", "maxmemory-policy", "volatile-lru"]);
    assert!(
        eventually(|| async {
            admin_get(admin, "/readyz").await.0 == 503
                && Http::new(gw.addr())
                    .post("/payments", "stored", "{}")
                    .await
                    .is_replay()
        })
        .await
    );
    assert_eq!(up.executions(), 1);
}

/// `on_store_error = "pass"` is for a store that cannot be reached, not for one that may lose
/// records: with `require_noeviction` an evicting Redis still gets nothing forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_noeviction_is_never_passed_through() {
    let redis = RedisServer::start_with(&["--maxmemory-policy", "allkeys-lfu"]);
    let up = Upstream::counting().await;
    let text = redis_config(
        &up.url(),
        &redis.url(),
        &format!("[defaults]\non_store_error = \"pass\"\n{PAYMENTS}"),
    );
    let text = TomlConfig::parse(&text)
        .set("store.require_noeviction", true)
        .text();
    let gw = idemgate::server::Running::start(idemgate::config::Config::parse(&text).unwrap())
        .await
        .unwrap();
    let http = Http::new(gw.addr());
    for i in 0..5 {
        let got = http.post("/payments", &format!("k{i}"), "{}").await;
        assert_eq!(got.status, 503);
        assert_eq!(got.problem_type(), "store-unavailable");
    }
    assert_eq!(up.executions(), 0, "forwarded without idempotency");
}
