//! The disk store under what production does to a single instance: real gateway processes
//! restarted and killed with SIGKILL, idle, mid-flight and under concurrent load. Nothing ever
//! executes twice, and with `sync = "always"` every answer a client received replays afterwards.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::redis::free_port;
use crate::support::*;

fn disk_config(upstream: &str, data: &std::path::Path, listen: &str, extra: &str) -> String {
    format!(
        "[server]\nlisten = \"{listen}\"\nshutdown_grace = \"5s\"\n[store]\nbackend = \"disk\"\npath = \"{}\"\n[upstream]\nurl = \"{upstream}\"\n{extra}",
        data.display()
    )
}

const PAYMENTS_ROUTE: &str =
    "[[routes]]\nname = \"payments\"\npath = \"/payments\"\nlock_timeout = \"1s\"\nwait = \"0s\"\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_outlives_a_restart_and_a_kill_9_and_operators_can_read_it_stopped() {
    let data = TempDir::new("disk-data");
    let up = Upstream::counting().await;
    let config = disk_config(&up.url(), &data.path, "127.0.0.1:0", PAYMENTS_ROUTE);

    let gw = GatewayProcess::start(&config);
    let first = Http::new(gw.addr).post("/payments", "k", "{\"a\":1}").await;
    assert_eq!(first.status, 201);
    // While the gateway runs, the file is its own: `keys` says to stop it first.
    let cfg = data.path.join("proxy.toml");
    std::fs::write(&cfg, &config).unwrap();
    let busy = keys_cmd(&cfg, "get", "payments", &["k"]);
    assert!(!busy.status.success());
    let said = String::from_utf8_lossy(&busy.stderr);
    assert!(said.contains("stop the gateway"), "{said}");

    // A graceful restart.
    assert!(gw.signal_and_wait("-TERM").success());
    let gw = GatewayProcess::start(&config);
    let again = Http::new(gw.addr).post("/payments", "k", "{\"a\":1}").await;
    assert!(again.is_replay(), "{again:?}");
    assert_eq!(again.body, first.body);

    // And a SIGKILL.
    gw.signal_and_wait("-KILL");
    let gw = GatewayProcess::start(&config);
    let after_kill = Http::new(gw.addr).post("/payments", "k", "{\"a\":1}").await;
    assert!(after_kill.is_replay(), "{after_kill:?}");
    assert_eq!(after_kill.body, first.body);
    assert_eq!(up.executions(), 1, "one execution across two restarts");

    // Stopped, the operator can read and release the key.
    gw.signal_and_wait("-KILL");
    let shown = keys_cmd(&cfg, "get", "payments", &["k"]);
    let text = String::from_utf8_lossy(&shown.stdout);
    assert!(
        shown.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&shown.stderr)
    );
    assert!(text.contains("completed"), "{text}");
    // A completed record is released only on purpose.
    let refused = keys_cmd(&cfg, "delete", "payments", &["k"]);
    assert_eq!(refused.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--force"));
    let forced = std::process::Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args([
            "keys", "delete", "--route", "payments", "--key", "k", "--force", "--config",
        ])
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(forced.status.success(), "{forced:?}");
    let gw = GatewayProcess::start(&config);
    assert_eq!(
        Http::new(gw.addr)
            .post("/payments", "k", "{\"a\":1}")
            .await
            .status,
        201
    );
    assert_eq!(up.executions(), 2, "the released key ran again, once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_killed_mid_flight_never_runs_the_request_again() {
    let data = TempDir::new("disk-data");
    let (up, gate) = Upstream::gated().await;
    let config = disk_config(&up.url(), &data.path, "127.0.0.1:0", PAYMENTS_ROUTE);
    let gw = GatewayProcess::start(&config);
    let http = Http::new(gw.addr);
    let doomed = spawn_post_to_be_killed(&http, "k");
    up.next_arrival().await;
    gw.signal_and_wait("-KILL");
    assert!(
        doomed.await.unwrap().is_none(),
        "the client lost its connection"
    );
    // With no gateway running, `idemgate keys list` opens the store itself and lists the key
    // as the client sent it, once the dead owner's lease has run out.
    let cfg = data.path.join("proxy.toml");
    std::fs::write(&cfg, &config).unwrap();
    let list = || keys_list(&cfg, &[]);
    let listed = eventually_within(Duration::from_secs(10), || async {
        list().iter().any(|e| e["key"] == "k")
    })
    .await;
    assert!(listed, "{:?}", list());
    assert_eq!(list()[0]["reason"], "abandoned");

    let gw = GatewayProcess::start(&config);
    let http = Http::new(gw.addr);
    // Until the dead owner's lease runs out: in flight; then: unknown, never run again.
    let last = retry_while_in_flight(&http, "k").await;
    assert_eq!(last.status, 502, "{last:?}");
    assert_eq!(last.problem_type(), "outcome-unknown");
    gate.add_permits(10);
    assert_eq!(
        http.post("/payments", "k", "{}").await.problem_type(),
        "outcome-unknown"
    );
    assert_eq!(up.executions(), 1, "never executed a second time");
}

/// Clients with their own keys, retrying until a final answer, while the gateway is killed
/// with SIGKILL and restarted again and again. At the end: at most one execution per key, and
/// every 2xx a client received replays byte for byte (`sync = "always"`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_kills_under_load_lose_no_answer_and_run_nothing_twice() {
    let data = TempDir::new("disk-data");
    let up = Upstream::start(|_, n| {
        Reply::Delayed(
            Duration::from_millis(5),
            Box::new(Reply::json(201, &format!("{{\"execution\":{n}}}"))),
        )
    })
    .await;
    let port = free_port(false);
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let config = disk_config(
        &up.url(),
        &data.path,
        &addr.to_string(),
        "[[routes]]\npath = \"/payments\"\nlock_timeout = \"1s\"\nwait = \"2s\"\n",
    );
    let mut gw = Some(GatewayProcess::start(&config));

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let answers: Arc<Mutex<HashMap<String, bytes::Bytes>>> = Arc::default();
    let mut clients = Vec::new();
    for c in 0..8 {
        let (stop, answers) = (Arc::clone(&stop), Arc::clone(&answers));
        clients.push(tokio::spawn(async move {
            for j in 0..100_000 {
                let key = format!("c{c}-{j}");
                for _ in 0..400 {
                    if stop.load(std::sync::atomic::Ordering::SeqCst) {
                        return;
                    }
                    let got = Http::new(addr)
                        .request("POST", "/payments")
                        .header("idempotency-key", &key)
                        .json("{}")
                        .try_send(Duration::from_secs(3))
                        .await;
                    match got {
                        Some(g) if g.status.is_success() => {
                            answers.lock().unwrap().insert(key.clone(), g.body.clone());
                            break;
                        }
                        Some(g)
                            if g.header("content-type") == Some("application/problem+json")
                                && g.problem_type() == "outcome-unknown" =>
                        {
                            break
                        }
                        _ => tokio::time::sleep(Duration::from_millis(20)).await,
                    }
                }
            }
        }));
    }

    let mut kills = 0;
    for _ in 0..4 {
        // Kill once traffic has been flowing since the last restart.
        let target = up.executions() + 40;
        assert!(
            eventually(|| async { up.executions() >= target }).await,
            "traffic stalled after {kills} kills"
        );
        if let Some(g) = gw.take() {
            tokio::task::spawn_blocking(move || g.signal_and_wait("-KILL"))
                .await
                .unwrap();
            kills += 1;
        }
        let config = config.clone();
        gw = Some(
            tokio::task::spawn_blocking(move || GatewayProcess::start(&config))
                .await
                .unwrap(),
        );
    }
    let target = up.executions() + 40;
    assert!(eventually(|| async { up.executions() >= target }).await);
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    for c in clients {
        c.await.unwrap();
    }

    let mut per_key: HashMap<String, usize> = HashMap::new();
    for s in up.seen() {
        let k = s.headers["idempotency-key"].to_str().unwrap().to_string();
        *per_key.entry(k).or_default() += 1;
    }
    let twice: Vec<_> = per_key.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "executed more than once: {twice:?}");

    let answers = answers.lock().unwrap().clone();
    eprintln!(
        "disk kills: {kills} SIGKILLs, {} keys answered 2xx, {} upstream executions",
        answers.len(),
        up.executions()
    );
    assert!(answers.len() > 150, "{} answers", answers.len());
    let http = Http::new(addr);
    for (key, body) in &answers {
        let replay = http.post("/payments", key, "{}").await;
        assert!(replay.is_replay(), "{key} lost its answer: {replay:?}");
        assert_eq!(
            &replay.body, body,
            "{key}: the replay differs from the answer"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_share_fsyncs_and_metrics_show_it() {
    let data = TempDir::new("disk-data");
    let up = Upstream::counting().await;
    let gw = Running::start(
        idemgate::config::Config::parse(&disk_config(
            &up.url(),
            &data.path,
            "127.0.0.1:0",
            "[[routes]]\npath = \"/payments\"\n",
        ))
        .unwrap()
        .with_admin(),
    )
    .await
    .unwrap();
    let http = Http::new(gw.addr());
    let mut tasks = Vec::new();
    for i in 0..200 {
        let http = http.clone();
        tasks.push(tokio::spawn(async move {
            http.post("/payments", &format!("m{i}"), "{}").await.status
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 201);
    }
    let m = scrape(gw.admin_addr().unwrap()).await;
    let syncs = m["idemgate_store_syncs_total"];
    eprintln!("disk store through the gateway: {syncs} fsyncs for 200 concurrent new keys");
    assert!(syncs >= 1.0, "new keys are synced");
    assert!(syncs < 200.0, "{syncs} fsyncs for 200 requests: not shared");
}

/// With `sync = "batch"`, a result answered just before a SIGTERM is synced by the graceful
/// shutdown, not lost with the process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_shutdown_syncs_what_batch_mode_held() {
    let data = TempDir::new("disk-data");
    let up = Upstream::counting().await;
    let config = TomlConfig::parse(&disk_config(
        &up.url(),
        &data.path,
        "127.0.0.1:0",
        "[[routes]]\npath = \"/payments\"\n",
    ))
    .set("store.sync", "batch")
    .set("store.sync_interval", "10s")
    .text();
    let gw = GatewayProcess::start(&config);
    let first = Http::new(gw.addr).post("/payments", "b", "{}").await;
    assert_eq!(first.status, 201);
    assert!(gw.signal_and_wait("-TERM").success());
    let gw = GatewayProcess::start(&config);
    let again = Http::new(gw.addr).post("/payments", "b", "{}").await;
    assert!(again.is_replay(), "{again:?}");
    assert_eq!(again.body, first.body);
    assert_eq!(up.executions(), 1);
}
