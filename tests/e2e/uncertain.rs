//! Answers that may follow a commit, and changes whose own answer is lost: each one kept as what
//! it may be (an unknown outcome, or the record as it was), never as a free key. Through the real
//! gateway, with real parts where the failure comes from: nginx in front of the application, a
//! relay that stalls a Redis replica, a Postgres whose commits wait for a standby, an HTTP/2
//! upstream that resets a stream mid-body, an upstream that closes idle connections after 2 s,
//! and a reload that would change how keys are derived.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idemgate::config::{Config, TokenSource};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::support::nginx::Nginx;
use crate::support::redis::{cli, free_port, RedisServer};
use crate::support::relay::Relay;
use crate::support::*;

const TOKEN: &str = "op-token-3f9a1c7e5b2d4a6c8e0f";

/// A config with the operator API on, its token in a file of `dir`.
fn with_operator(mut config: Config, dir: &TempDir) -> Config {
    let token_file = dir.path.join("admin-token");
    std::fs::write(&token_file, TOKEN).unwrap();
    config.server.admin_token = Some(TokenSource::File(token_file));
    config.with_admin()
}

/// The id of the anonymous client's key `key` on the payments route.
fn id(config: &Config, key: &str) -> String {
    idemgate::operator::locate(config, "payments", &[key.to_string()], &Default::default())
        .unwrap()
        .hex()
}

async fn operator(admin: SocketAddr, method: &str, path: &str, body: Option<&str>) -> Got {
    let req = Http::new(admin)
        .request(method, path)
        .header("authorization", &format!("Bearer {TOKEN}"));
    match body {
        Some(b) => req.json(b).send().await,
        None => req.send().await,
    }
}

/// A wrong id in a runbook must not re-enable a payment that completed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completed_record_is_released_or_overwritten_only_with_force() {
    let up = Upstream::counting().await;
    let dir = TempDir::new("completed");
    let config = with_operator(config(&up.url(), PAYMENTS), &dir);
    let gw = Running::start(config.clone()).await.unwrap();
    let (http, admin) = (Http::new(gw.addr()), gw.admin_addr().unwrap());
    assert_eq!(http.post("/payments", "k", "{}").await.status, 201);
    let path = format!("/keys/{}", id(&config, "k"));
    let released = operator(admin, "DELETE", &path, None).await;
    assert_eq!(released.status, 409, "{}", released.text());
    assert_eq!(released.problem_type(), "record-completed");
    let resolution = r#"{"status": 200, "body": "other"}"#;
    let resolved = operator(admin, "PUT", &path, Some(resolution)).await;
    assert_eq!(resolved.status, 409, "{}", resolved.text());
    assert_eq!(resolved.problem_type(), "record-completed");
    let retry = http.post("/payments", "k", "{}").await;
    assert!(retry.is_replay() && retry.status == 201, "{retry:?}");
    assert_eq!(up.executions(), 1);
    // Forced, on purpose: the next retry runs.
    let forced = operator(admin, "DELETE", &format!("{path}?force=true"), None).await;
    assert_eq!(forced.status, 200, "{}", forced.text());
    let again = http.post("/payments", "k", "{}").await;
    assert!(!again.is_replay() && again.status == 201, "{again:?}");
    assert_eq!(up.executions(), 2);
}

/// gateway -> nginx -> application: the application commits, then outlives nginx's
/// `proxy_read_timeout` (504) or drops its connection (502). Either may follow a commit: the key
/// is kept unknown and the retry never runs it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxys_502_or_504_after_a_commit_is_never_run_again() {
    let up = Upstream::start(|seen, _| {
        match seen.headers.get("idempotency-key").map(|v| v.as_bytes()) {
            Some(b"slow") => Reply::Delayed(
                Duration::from_secs(3),
                Box::new(Reply::json(201, r#"{"id":"pay_1"}"#)),
            ),
            Some(b"dropped") => Reply::Reset,
            _ => Reply::json(201, r#"{"id":"pay_2"}"#),
        }
    })
    .await;
    let nginx = Nginx::start(up.addr.port(), Duration::from_millis(500));
    let gw = Running::start(config(&nginx.url(), PAYMENTS))
        .await
        .unwrap();
    let http = Http::new(gw.addr());
    for (key, status) in [("slow", 504), ("dropped", 502)] {
        let first = http.post("/payments", key, "{}").await;
        assert_eq!(first.status, status, "nginx's own answer: {first:?}");
        let retry = http.post("/payments", key, "{}").await;
        assert_eq!(retry.status, status, "{retry:?}");
        assert_eq!(retry.problem_type(), "outcome-unknown");
    }
    // A 2xx through the same proxy is stored and replayed as ever.
    assert_eq!(http.post("/payments", "fine", "{}").await.status, 201);
    assert!(http.post("/payments", "fine", "{}").await.is_replay());
    let per_key = up.executions_per_key();
    for key in ["slow", "dropped", "fine"] {
        assert_eq!(per_key.get(key), Some(&1), "{key}: {per_key:?}");
    }
}

/// Reads one HTTP/1.1 request (its head and `Content-Length` body) from `sock`; `None` when the
/// connection ended, or nothing came within `idle`.
async fn read_request(sock: &mut TcpStream, idle: Duration) -> Option<()> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if buf.len() >= end + 4 + length {
                return Some(());
            }
        }
        match tokio::time::timeout(idle, sock.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&chunk[..n]),
            _ => return None,
        }
    }
}

/// A raw HTTP/1.1 upstream on loopback: `serve` handles each connection, counting the requests
/// it executes in the counter it is given.
async fn raw_upstream<F, Fut>(serve: F) -> (String, Arc<AtomicUsize>)
where
    F: Fn(TcpStream, Arc<AtomicUsize>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let count = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&count);
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            tokio::spawn(serve(sock, Arc::clone(&seen)));
        }
    });
    (url, count)
}

/// An HTTP/1.1 upstream that answers every request with `answer` and closes the connection.
async fn cutting_upstream(answer: &'static [u8]) -> (String, Arc<AtomicUsize>) {
    raw_upstream(move |mut sock, seen| async move {
        if read_request(&mut sock, Duration::from_secs(10))
            .await
            .is_some()
        {
            seen.fetch_add(1, Ordering::SeqCst);
            let _ = sock.write_all(answer).await;
            let _ = sock.shutdown().await;
        }
    })
    .await
}

/// An HTTP/2 (h2c) upstream that sends a head declaring 40 bytes, 14 of them, then resets the
/// stream with `NO_ERROR`, which hyper reads as the body's end.
async fn resetting_h2_upstream() -> (String, Arc<AtomicUsize>) {
    raw_upstream(|sock, seen| async move {
        let Ok(mut conn) = h2::server::handshake(sock).await else {
            return;
        };
        while let Some(Ok((_req, mut respond))) = conn.accept().await {
            seen.fetch_add(1, Ordering::SeqCst);
            // Its own task: the connection is driven by `accept` meanwhile.
            tokio::spawn(async move {
                let head = http::Response::builder()
                    .status(201)
                    .header("content-type", "application/json")
                    .header("content-length", "40")
                    .body(())
                    .unwrap();
                let mut send = respond.send_response(head, false).unwrap();
                let _ = send.send_data(Bytes::from_static(b"{\"id\":\"pay_1\","), false);
                tokio::time::sleep(Duration::from_millis(50)).await;
                send.send_reset(h2::Reason::NO_ERROR);
            });
        }
    })
    .await
}

/// A body cut short is never stored as the whole answer: one shorter than its
/// `Content-Length`, and an HTTP/2 stream reset mid-body, are unknown outcomes
/// (`502 outcome-unknown`); an HTTP/1.1 answer with no framing that tells its end, cut by a FIN,
/// reaches its client as it came and is kept as its status and headers only (replays say the
/// body was not kept). The retry is never run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_cut_short_are_never_replayed_as_complete() {
    let close_delimited: &[u8] =
        b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\n\r\n{\"id\":\"pay_1\",\"sta";
    let short: &[u8] = b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ncontent-length: 40\r\n\r\n{\"id\":\"pay_1\"";
    let mut upstreams = Vec::new();
    for (answer, first_status) in [(close_delimited, 201), (short, 502)] {
        // 201: the status it said, its body as it came; replays: the status, no body.
        let (url, count) = cutting_upstream(answer).await;
        upstreams.push((url, "", count, first_status));
    }
    let (url, count) = resetting_h2_upstream().await;
    upstreams.push((url, "protocol = \"http2\"\n", count, 502));
    for (url, upstream_extra, count, first_status) in upstreams {
        // `upstream_extra` lands in [upstream], which `config` leaves open.
        let gw = Running::start(config(&url, &format!("{upstream_extra}{PAYMENTS}")))
            .await
            .unwrap();
        let http = Http::new(gw.addr());
        let first = http.post("/payments", "k", "{}").await;
        assert_eq!(first.status, first_status, "{url}: {first:?}");
        if first_status == 502 {
            assert_eq!(first.problem_type(), "outcome-unknown");
        }
        let retry = http.post("/payments", "k", "{}").await;
        if first_status == 502 {
            assert_eq!(retry.status, 502, "{url}: {retry:?}");
            assert_eq!(retry.problem_type(), "outcome-unknown");
            assert!(!retry.is_replay());
        } else {
            assert!(first.text().starts_with("{\"id\":\"pay_1\""), "{first:?}");
            assert!(retry.is_replay() && retry.status == 201, "{url}: {retry:?}");
            assert_eq!(retry.header("idemgate-body-omitted"), Some("true"));
            assert!(retry.body.is_empty(), "never the cut body: {retry:?}");
        }
        assert_eq!(count.load(Ordering::SeqCst), 1, "{url}: run once");
    }
}

/// An upstream that closes connections idle for 2 s (gunicorn's keep-alive), under steady
/// traffic whose gaps straddle 2 s: the gateway (idle_timeout 1 s by default) never writes a
/// request on a connection the upstream is closing, so no request becomes an unknown outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_closing_idle_connections_after_2s_leaves_no_unknown_outcome() {
    let (url, count) = raw_upstream(|mut sock, seen| async move {
        while read_request(&mut sock, Duration::from_secs(2)).await.is_some() {
            seen.fetch_add(1, Ordering::SeqCst);
            let answer = b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
            if sock.write_all(answer).await.is_err() {
                return;
            }
        }
        // Idle for 2 s: closed, as gunicorn does; its FIN takes 100 ms to reach the gateway (a
        // network's latency, which loopback lacks), and a request that arrives meanwhile is
        // never read: the close resets it.
        tokio::time::sleep(Duration::from_millis(100)).await;
    })
    .await;
    let gw = Running::start(config(&url, PAYMENTS)).await.unwrap();
    let http = Http::new(gw.addr());
    let gaps_ms = [1990, 2010, 2030, 2050, 2070, 2090];
    for (i, gap) in gaps_ms.into_iter().enumerate() {
        let got = http.post("/payments", &format!("k{i}"), "{}").await;
        assert_eq!(got.status, 201, "request {i}: {got:?}");
        tokio::time::sleep(Duration::from_millis(gap)).await;
    }
    assert_eq!(count.load(Ordering::SeqCst), gaps_ms.len());
}

/// A primary whose replica is reached through a relay the test stalls, with
/// `min_replicas = 1`: an operator's resolution (a take-over) that its replica does not
/// acknowledge is refused, and leaves the unknown outcome as it was: the retry does not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_take_over_its_replica_does_not_acknowledge_leaves_the_outcome_unknown() {
    let redis = Replicated::start().await;
    let relay = &redis.relay;
    let up = Upstream::start(|_, _| Reply::Reset).await;
    let dir = TempDir::new("take-over");
    let config = with_operator(config(&up.url(), &redis.store(PAYMENTS)), &dir);
    let gw = Running::start(config.clone()).await.unwrap();
    let (http, admin) = (Http::new(gw.addr()), gw.admin_addr().unwrap());
    ready(admin).await;
    let first = http.post("/payments", "k", "{}").await;
    assert_eq!(first.problem_type(), "outcome-unknown", "{first:?}");
    let path = format!("/keys/{}", id(&config, "k"));

    relay.stall();
    let resolution = r#"{"status": 201, "body": "{\"id\":\"pay_1\"}"}"#;
    let refused = operator(admin, "PUT", &path, Some(resolution)).await;
    assert_eq!(refused.status, 503, "{}", refused.text());
    assert!(refused.text().contains("never freed"), "{}", refused.text());
    let state = operator(admin, "GET", &path, None).await;
    assert_eq!(state.status, 200, "{}", state.text());
    let state: serde_json::Value = serde_json::from_slice(&state.body).unwrap();
    assert_eq!(state["state"], "unknown", "{state}");
    let retry = http.post("/payments", "k", "{}").await;
    assert_eq!(retry.problem_type(), "outcome-unknown", "{retry:?}");

    // Once the replica has caught up: still unknown, still not run.
    relay.resume();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let retry = http.post("/payments", "k", "{}").await;
    assert_eq!(retry.problem_type(), "outcome-unknown", "{retry:?}");
    assert_eq!(up.executions(), 1, "never run a second time");
    // The operator tries again with the replica back: resolved, and replayed.
    let resolved = operator(admin, "PUT", &path, Some(resolution)).await;
    assert_eq!(resolved.status, 200, "{}", resolved.text());
    assert!(http.post("/payments", "k", "{}").await.is_replay());
    assert_eq!(up.executions(), 1);
}

/// The same for a retry's reconciliation: the upstream's lookup says the payment happened, and
/// the take-over that would store its answer is not acknowledged by the replica. The outcome
/// stays unknown and the retry does not run; once the replica is back, a retry gets the
/// lookup's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconciliation_its_replica_does_not_acknowledge_leaves_the_outcome_unknown() {
    let redis = Replicated::start().await;
    let up = Upstream::start(
        |seen, _| match seen.path_and_query.starts_with("/lookup/") {
            true => Reply::json(200, r#"{"id":"pay_1"}"#),
            false => Reply::Reset,
        },
    )
    .await;
    let route = format!(
        "[[routes]]\nname = \"payments\"\npath = \"/payments\"\nreconcile = {{ url = \"{}/lookup/{{key}}\", after = \"1s\" }}\n",
        up.url()
    );
    let config = config(&up.url(), &redis.store(&route)).with_admin();
    let gw = Running::start(config).await.unwrap();
    let http = Http::new(gw.addr());
    ready(gw.admin_addr().unwrap()).await;
    let first = http.post("/payments", "k", "{}").await;
    assert_eq!(first.problem_type(), "outcome-unknown", "{first:?}");
    redis.relay.stall();
    // Past `after`: the background's lookup and this retry's both find it happened, and
    // neither can store the answer.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let retry = http.post("/payments", "k", "{}").await;
    assert_eq!(retry.problem_type(), "outcome-unknown", "{retry:?}");
    redis.relay.resume();
    let replayed = eventually(|| async {
        let got = http.post("/payments", "k", "{}").await;
        assert!(got.status != 201 || got.is_replay(), "ran again: {got:?}");
        got.is_replay() && got.header("idemgate-reconciled") == Some("true")
    })
    .await;
    assert!(replayed, "the lookup's answer was never stored");
    assert_eq!(up.executions_per_key().get("k"), Some(&1));
}

/// A Redis primary with one replica reached through a relay the test stalls.
struct Replicated {
    primary: RedisServer,
    relay: Relay,
    _replica: RedisServer,
}

impl Replicated {
    async fn start() -> Replicated {
        let primary = RedisServer::start();
        let sync_at_once = ["CONFIG", "SET", "repl-diskless-sync-delay", "0"];
        cli(primary.port, &sync_at_once);
        let relay = Relay::start(primary.port).await;
        let replica =
            RedisServer::start_with(&["--replicaof", "127.0.0.1", &relay.port.to_string()]);
        let at = replica.port;
        let following = eventually_within(Duration::from_secs(20), || async move {
            cli(at, &["INFO", "replication"]).contains("master_link_status:up")
        })
        .await;
        assert!(following, "the replica never caught up");
        Replicated {
            primary,
            relay,
            _replica: replica,
        }
    }

    /// Config lines for a store on it whose writes wait 300 ms for the replica, then `rest`.
    fn store(&self, rest: &str) -> String {
        format!(
            "[store]\nbackend = \"redis\"\nurl = \"{}\"\nmin_replicas = 1\nreplica_timeout = \"300ms\"\n{rest}",
            self.primary.url()
        )
    }
}

/// Waits until the gateway whose admin listener is `admin` is ready.
async fn ready(admin: SocketAddr) {
    let ready = eventually_within(Duration::from_secs(20), || async {
        admin_get(admin, "/readyz").await.0 == 200
    })
    .await;
    assert!(ready, "{:?}", admin_get(admin, "/readyz").await);
}

/// A reload that would change how a route's keys are derived (its name, the one it takes from
/// its path, its client header) is refused: the running config stays and retries replay.
/// `idemgate check --running` says the same before the reload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_changes_how_keys_are_derived_is_refused() {
    let up = Upstream::counting().await;
    let admin = format!("127.0.0.1:{}", free_port(false));
    let text = |route: &str| {
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nadmin = \"{admin}\"\n[upstream]\nurl = \"{}\"\n[[routes]]\n{route}",
            up.url()
        )
    };
    let unnamed = text("path = \"/payments\"\n");
    let gw = GatewayProcess::start(&unnamed);
    let http = Http::new(gw.addr);
    assert_eq!(http.post("/payments", "k", "{}").await.status, 201);
    let check = |config: &str| {
        let dir = TempDir::new("check");
        let path = dir.path.join("proxy.toml");
        std::fs::write(&path, config).unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemgate"))
            .args(["check", "--config"])
            .arg(&path)
            .args(["--running", &admin])
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (code, said) = check(&unnamed);
    assert_eq!(code, Some(0), "{said}");
    assert!(
        said.contains("has no name"),
        "the unnamed route is pointed out: {said}"
    );

    let changes = [
        text("name = \"payments\"\npath = \"/payments\"\n"),
        text("path = \"/payments\"\nclient_header = \"X-Api-Key\"\n"),
    ];
    for (i, changed) in changes.iter().enumerate() {
        let (code, said) = check(changed);
        assert_eq!(code, Some(1), "{said}");
        assert!(said.contains("refused"), "{said}");
        std::fs::write(&gw.config_path, changed).unwrap();
        gw.signal("-HUP");
        let line = gw.wait_log("config reload refused");
        assert!(line.contains("/payments"), "names the route: {line}");
        let retry = http.post("/payments", "k", "{}").await;
        assert!(retry.is_replay(), "change {i}: {retry:?}");
    }
    assert_eq!(up.executions(), 1);
    // A change that keeps the keys is applied.
    let harmless = text("path = \"/payments\"\nwait = \"5s\"\n");
    assert_eq!(check(&harmless).0, Some(0));
    std::fs::write(&gw.config_path, &harmless).unwrap();
    gw.signal("-HUP");
    gw.wait_log("config reloaded");
    assert!(http.post("/payments", "k", "{}").await.is_replay());
    // In two steps that each look harmless: the route removed (applied: its requests pass
    // through from now on), then brought back under another name (refused: it would not find
    // the keys it stored before).
    std::fs::write(&gw.config_path, text("path = \"/refunds\"\n")).unwrap();
    gw.signal("-HUP");
    gw.wait_log("config reloaded");
    let renamed = text("name = \"payments\"\npath = \"/payments\"\n");
    assert_eq!(check(&renamed).0, Some(1));
    std::fs::write(&gw.config_path, &renamed).unwrap();
    gw.signal("-HUP");
    gw.wait_log("config reload refused");
    assert_eq!(up.executions(), 1);
}

/// A gateway on Postgres whose routes' leases run 10 s and whose statements get 1 s.
fn pg_gateway(upstream: &str, url: &str) -> Config {
    let extra = format!(
        "[store]\nbackend = \"postgres\"\nurl = \"{url}\"\ncommand_timeout = \"1s\"\n[[routes]]\nname = \"payments\"\npath = \"/payments\"\nlock_timeout = \"10s\"\nwait = \"0s\"\n"
    );
    config(upstream, &extra)
}

/// A reservation whose insert waits for a synchronous standby that never answers: the gateway
/// gives up after `command_timeout` (503, nothing forwarded), and the insert commits later, once
/// the standby requirement is dropped. Its give-back is tried again until it deletes that row:
/// the key is free again within the lease, and the retry runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_committing_after_command_timeout_is_given_back_within_its_lease() {
    let pg = crate::support::postgres::Postgres::start();
    let up = Upstream::counting().await;
    let gw = Running::start(pg_gateway(&up.url(), &pg.url()))
        .await
        .unwrap();
    let http = Http::new(gw.addr());
    let warm = eventually(|| async { http.post("/payments", "warm", "{}").await.status == 201 });
    assert!(warm.await, "the store never answered");
    pg.psql("ALTER SYSTEM SET synchronous_standby_names = 'nobody'");
    pg.psql("SELECT pg_reload_conf()");
    let waiting = eventually(|| async { pg.psql("SHOW synchronous_standby_names") == "nobody" });
    assert!(waiting.await);
    let stuck = http.post("/payments", "k", "{}").await;
    assert_eq!(stuck.status, 503, "{stuck:?}");
    assert_eq!(stuck.problem_type(), "store-unavailable");
    assert_eq!(up.executions_per_key().get("k"), None, "nothing forwarded");
    // The statement that ran out of time was cancelled, so its commit completed locally at once
    // instead of whenever a standby answers, and the give-back deleted its row (its own delete
    // waiting for the standby is cancelled the same way): only the warm-up's row is left.
    let waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'";
    let given_back = eventually_within(Duration::from_secs(9), || async {
        pg.psql(waiting) == "0" && pg.psql("SELECT count(*) FROM idemgate_records") == "1"
    })
    .await;
    assert!(given_back, "still waiting: {}", pg.psql(waiting));
    // The standby requirement goes; the key is free.
    pg.psql("ALTER SYSTEM RESET synchronous_standby_names");
    pg.psql("SELECT pg_reload_conf()");
    let ran = eventually_within(Duration::from_secs(9), || async {
        http.post("/payments", "k", "{}").await.status == 201
    })
    .await;
    assert!(
        ran,
        "the key stayed taken: {:?}",
        http.post("/payments", "k", "{}").await
    );
    assert_eq!(up.executions_per_key().get("k"), Some(&1));
}

/// Two Postgres nodes in `store.url`; the one in use turns read-only (as a demoted primary does):
/// the statements it refuses close their connections, and the pool's next connections go to the
/// writable node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_node_turned_read_only_is_left() {
    use crate::support::postgres::Postgres;
    let (a, b) = (Postgres::start(), Postgres::start());
    // The gateway makes its table once, on the node it reaches first: the other has it already.
    b.psql(&idemgate::store::postgres::schema::ddl("idemgate_records"));
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres",
        a.port, b.port
    );
    let up = Upstream::counting().await;
    let gw = Running::start(pg_gateway(&up.url(), &url).with_admin())
        .await
        .unwrap();
    let http = Http::new(gw.addr());
    let first = eventually(|| async { http.post("/payments", "k0", "{}").await.status == 201 });
    assert!(first.await, "the store never answered");
    assert_eq!(a.psql("SELECT count(*) FROM idemgate_records"), "1");
    a.psql("ALTER SYSTEM SET default_transaction_read_only = on");
    a.psql("SELECT pg_reload_conf()");
    let read_only = eventually(|| async { a.psql("SHOW default_transaction_read_only") == "on" });
    assert!(read_only.await);
    let n = AtomicUsize::new(1);
    let moved = eventually(|| async {
        let key = format!("k{}", n.fetch_add(1, Ordering::SeqCst));
        http.post("/payments", &key, "{}").await.status == 201
    })
    .await;
    assert!(moved, "new keys kept being refused on the read-only node");
    assert_eq!(b.psql("SELECT count(*) FROM idemgate_records"), "1");
    // And it stays there.
    assert_eq!(http.post("/payments", "after", "{}").await.status, 201);
    let admin = gw.admin_addr().unwrap();
    assert_eq!(admin_get(admin, "/readyz").await.0, 200);
}

/// A three-primary Redis Cluster with `require_noeviction`: one primary switched to
/// `allkeys-lru` is found at the next check (every primary is asked), and new keys are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_with_one_evicting_primary_refuses_new_keys() {
    use crate::support::redis::RedisCluster;
    let cluster = RedisCluster::start();
    let up = Upstream::counting().await;
    let nodes: Vec<String> = cluster.urls().iter().map(|u| format!("\"{u}\"")).collect();
    let extra = format!(
        "[store]\nbackend = \"redis\"\ncluster = [{}]\nrequire_noeviction = true\n{PAYMENTS}",
        nodes.join(", ")
    );
    let gw = Running::start(config(&up.url(), &extra).with_admin())
        .await
        .unwrap();
    let (http, admin) = (Http::new(gw.addr()), gw.admin_addr().unwrap());
    let ready = eventually_within(Duration::from_secs(20), || async {
        admin_get(admin, "/readyz").await.0 == 200
    })
    .await;
    assert!(ready, "{:?}", admin_get(admin, "/readyz").await);
    assert_eq!(http.post("/payments", "before", "{}").await.status, 201);
    let evicting = cluster.ports[1];
    cli(
        evicting,
        &["CONFIG", "SET", "maxmemory-policy", "allkeys-lru"],
    );
    // Within the check interval (30 s), whichever node the client would have picked.
    let n = AtomicUsize::new(0);
    let refused = eventually_within(Duration::from_secs(35), || async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let key = format!("new{}", n.fetch_add(1, Ordering::SeqCst));
        let got = http.post("/payments", &key, "{}").await;
        got.status == 503 && got.problem_type() == "store-unavailable"
    })
    .await;
    assert!(refused, "new keys still accepted with an evicting primary");
    let (status, why) = admin_get(admin, "/readyz").await;
    assert_eq!(status, 503, "{why}");
    assert!(why.contains("allkeys-lru"), "{why}");
    assert!(http.post("/payments", "before", "{}").await.is_replay());
}
