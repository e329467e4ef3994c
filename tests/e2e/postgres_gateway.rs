//! The gateway on Postgres: real servers (started as an unprivileged user), real upstream, real
//! gateways in process and as processes; duplicates woken by NOTIFY, several instances on one
//! database, a gateway killed mid-flight, Postgres restarted under traffic, a failover to a
//! synchronous standby, expiry, and the schema's creation and version.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idemgate::config::{Config, PostgresSettings, StoreConfig};
use idemgate::server::Running;
use idemgate::store::postgres::PostgresStore;
use idemgate::store::Store;
use tokio::sync::Semaphore;

use crate::support::postgres::Postgres;
use crate::support::redis::free_port;
use crate::support::*;

fn settings(url: String) -> PostgresSettings {
    PostgresSettings {
        url,
        table: "idemgate_records".into(),
        pool_size: 8,
        workers: 2,
        command_timeout: Duration::from_secs(2),
        max_clock_skew: Duration::ZERO,
        tls_ca_file: None,
        tls_client: None,
        allow_async_commit: false,
    }
}

/// A typed gateway config on Postgres at `url`.
fn pg_config(upstream: &str, url: String, extra: &str) -> Config {
    let mut config = config(upstream, extra);
    config.store = StoreConfig::Postgres(settings(url));
    config
}

/// The same as a file for the binary.
fn pg_config_text(upstream: &str, url: &str, extra: &str) -> String {
    TomlConfig::parse(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nshutdown_grace = \"5s\"\n[upstream]\nurl = \"{upstream}\"\n{extra}"
    ))
    .set("store.backend", "postgres")
    .set("store.url", url)
    .set("store.command_timeout", "2s")
    .text()
}

async fn in_process(upstream: &str, url: String, extra: &str) -> Running {
    Running::start(pg_config(upstream, url, extra))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn executes_once_replays_byte_for_byte_and_refuses_other_parameters() {
    let pg = Postgres::start();
    let up = Upstream::counting().await;
    let gw = in_process(&up.url(), pg.url(), PAYMENTS).await;
    let http = Http::new(gw.addr());
    let first = http.post("/payments", "k1", r#"{"amount":100}"#).await;
    assert_eq!(first.status, 201);
    assert!(!first.is_replay());
    let again = http.post("/payments", "k1", r#"{"amount":100}"#).await;
    assert!(again.is_replay(), "{again:?}");
    assert_eq!(again.status, first.status);
    assert_eq!(again.body, first.body, "byte for byte");
    assert_eq!(again.header("set-cookie"), first.header("set-cookie"));
    let other = http.post("/payments", "k1", r#"{"amount":999}"#).await;
    assert_eq!(other.status, 409);
    assert_eq!(other.problem_type(), "key-reused");
    // The stored result stays.
    let after = http.post("/payments", "k1", r#"{"amount":100}"#).await;
    assert_eq!(after.body, first.body);
    assert_eq!(up.executions(), 1);
    // The record is a row of the table, completed.
    assert_eq!(
        pg.psql("SELECT count(*), min(state) FROM idemgate_records"),
        "1|2"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_wait_and_are_woken_by_notify() {
    let pg = Postgres::start();
    let (up, gate) = Upstream::gated().await;
    let gw = in_process(
        &up.url(),
        pg.url(),
        &format!("{PAYMENTS}wait = \"20s\"\nlock_timeout = \"30s\"\n"),
    )
    .await;
    let http = Http::new(gw.addr());
    let original = {
        let http = http.clone();
        tokio::spawn(async move { http.post("/payments", "held", "{}").await })
    };
    up.next_arrival().await;
    let mut duplicates = Vec::new();
    for _ in 0..5 {
        let http = http.clone();
        duplicates.push(tokio::spawn(async move {
            let got = http.post("/payments", "held", "{}").await;
            (got, Instant::now())
        }));
    }
    // Every duplicate is waiting once the row is flagged by a waiter.
    let flagged =
        eventually(|| async { pg.psql("SELECT watched FROM idemgate_records") == "t" }).await;
    assert!(flagged, "a waiter flagged the pending row");
    gate.add_permits(1);
    let first = original.await.unwrap();
    let answered = Instant::now();
    assert_eq!(first.status, 201);
    let mut latencies = Vec::new();
    for d in duplicates {
        let (got, at) = d.await.unwrap();
        assert!(got.is_replay(), "{got:?}");
        assert_eq!(got.body, first.body);
        latencies.push(at.saturating_duration_since(answered));
    }
    latencies.sort();
    let slowest = latencies[latencies.len() - 1];
    println!("NOTIFY wake-up after the original's answer: {latencies:?}");
    // The fallback re-read is once a second; woken by NOTIFY, they answer at once.
    assert!(
        slowest < Duration::from_millis(500),
        "duplicates woke {slowest:?} after the original's answer"
    );
    assert_eq!(up.executions(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateway_processes_on_one_database_execute_once() {
    let pg = Postgres::start();
    let gate = Arc::new(Semaphore::new(0));
    let g = Arc::clone(&gate);
    let up =
        Upstream::start(move |_, n| Reply::json(201, &format!("{{\"execution\":{n}}}")).gated(&g))
            .await;
    let admins: [std::net::SocketAddr; 2] =
        std::array::from_fn(|_| format!("127.0.0.1:{}", free_port(false)).parse().unwrap());
    let config = pg_config_text(&up.url(), &pg.url(), PAYMENTS);
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
            http.post("/payments", "across-instances", r#"{"amount":100}"#)
                .await
        }));
    }
    up.next_arrival().await;
    let in_flight = || async {
        let mut total = 0.0;
        for admin in admins {
            total += scrape(admin).await["idemgate_requests_in_flight"];
        }
        total
    };
    assert!(eventually(|| async { in_flight().await >= 40.0 }).await);
    gate.add_permits(100);
    let mut bodies = Vec::new();
    for c in calls {
        let got = c.await.unwrap();
        assert_eq!(got.status, 201, "{got:?}");
        bodies.push(got.body);
    }
    assert_eq!(up.executions(), 1, "one execution across both instances");
    assert!(bodies.iter().all(|b| b == &bodies[0]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_killed_mid_flight_never_executes_again() {
    let pg = Postgres::start();
    let (up, gate) = Upstream::gated().await;
    let config = pg_config_text(
        &up.url(),
        &pg.url(),
        "[[routes]]\nname = \"payments\"\npath = \"/payments\"\nlock_timeout = \"3s\"\nwait = \"0s\"\n",
    );
    let gw = GatewayProcess::start(&config);
    let doomed = spawn_post_to_be_killed(&Http::new(gw.addr), "k");
    up.next_arrival().await;
    gw.signal_and_wait("-KILL");
    assert!(
        doomed.await.unwrap().is_none(),
        "the client lost its connection"
    );

    let gw = GatewayProcess::start(&config);
    let http = Http::new(gw.addr);
    let late = retry_while_in_flight(&http, "k").await;
    assert_eq!(late.status, 502, "{late:?}");
    assert_eq!(late.problem_type(), "outcome-unknown");
    gate.add_permits(10);
    assert_eq!(
        http.post("/payments", "k", "{}").await.problem_type(),
        "outcome-unknown"
    );
    assert_eq!(up.executions(), 1, "never executed a second time");

    // The operator reads the record from the database while the gateway runs, then releases
    // it: the next retry executes.
    let get = keys_cmd(&gw.config_path, "get", "payments", &["k"]);
    let shown = String::from_utf8_lossy(&get.stdout);
    assert!(
        get.status.success(),
        "{shown}{}",
        String::from_utf8_lossy(&get.stderr)
    );
    assert!(shown.contains("lease expired"), "{shown}");
    let del = keys_cmd(&gw.config_path, "delete", "payments", &["k"]);
    assert!(del.status.success());
    assert_eq!(
        keys_cmd(&gw.config_path, "get", "payments", &["k"])
            .status
            .code(),
        Some(1)
    );
    assert_eq!(http.post("/payments", "k", "{}").await.status, 201);
    assert_eq!(up.executions(), 2);
}

/// A client's keys, each with every answer it got.
type Client = tokio::task::JoinHandle<Vec<(String, Vec<Got>)>>;

/// Clients working through keys, each retried until a final answer (201 or outcome-unknown),
/// until `stop`: what every key got, in order.
fn clients(http: &Http, n: usize, stop: &Arc<AtomicBool>) -> Vec<Client> {
    (0..n)
        .map(|c| {
            let (http, stop) = (http.clone(), Arc::clone(stop));
            tokio::spawn(async move {
                let mut results = Vec::new();
                for j in 0..500 {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let key = format!("during-{c}-{j}");
                    let mut answers = Vec::new();
                    for _ in 0..1000 {
                        let got = http.post("/payments", &key, "{}").await;
                        let done = got.status == 201 || got.problem_type() == "outcome-unknown";
                        answers.push(got);
                        if done {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    results.push((key, answers));
                }
                results
            })
        })
        .collect()
}

/// Every key got a final answer, its 2xx answers all alike; whether any 503 was seen.
async fn settled(clients: Vec<Client>) -> (bool, usize) {
    let (mut saw_503, mut keys) = (false, 0);
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
    (saw_503, keys)
}

async fn executions_reach(up: &Upstream, n: usize) {
    let reached =
        eventually_within(Duration::from_secs(60), || async { up.executions() >= n }).await;
    assert!(
        reached,
        "the upstream executed {} requests, not {n}",
        up.executions()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restarted_under_traffic_fails_closed_then_recovers() {
    let mut pg = Postgres::start();
    let up = Upstream::counting().await;
    let gw = in_process(
        &up.url(),
        pg.url(),
        &format!("{PAYMENTS}lock_timeout = \"1s\"\nwait = \"1s\"\n"),
    )
    .await;
    let http = Http::new(gw.addr());
    let mut before = HashMap::new();
    for i in 0..5 {
        let got = http.post("/payments", &format!("before-{i}"), "{}").await;
        assert_eq!(got.status, 201);
        before.insert(i, got.body);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let running = clients(&http, 8, &stop);
    executions_reach(&up, up.executions() + 8).await;
    pg.stop();
    let during = http.post("/payments", "while-down", "{}").await;
    assert_eq!(during.status, 503);
    assert_eq!(during.problem_type(), "store-unavailable");
    assert!(during.header("retry-after").is_some());
    pg.start_again();
    executions_reach(&up, up.executions() + 16).await;
    stop.store(true, Ordering::SeqCst);
    let (saw_503, keys) = settled(running).await;
    assert!(saw_503, "the outage was visible to the clients as 503s");
    assert!(
        keys > 16,
        "traffic ran before, during and after ({keys} keys)"
    );
    up.assert_at_most_once();
    for (i, body) in before {
        let again = http.post("/payments", &format!("before-{i}"), "{}").await;
        assert!(again.is_replay(), "before-{i} lost: {again:?}");
        assert_eq!(again.body, body);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_to_a_synchronous_standby_serves_again_and_runs_nothing_twice() {
    let mut primary = Postgres::start();
    let standby = Postgres::standby_of(&primary, "standby1");
    primary.require_sync_standby("standby1");
    let up = Upstream::counting().await;
    // Both hosts in one URL: the driver connects to whichever accepts writes.
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write",
        primary.port, standby.port
    );
    let gw = in_process(
        &up.url(),
        url,
        &format!("{PAYMENTS}lock_timeout = \"1s\"\nwait = \"1s\"\n"),
    )
    .await;
    let http = Http::new(gw.addr());
    let settled_before = http.post("/payments", "before", "{}").await;
    assert_eq!(settled_before.status, 201);
    let stop = Arc::new(AtomicBool::new(false));
    let running = clients(&http, 8, &stop);
    executions_reach(&up, up.executions() + 8).await;
    primary.kill();
    let killed = Instant::now();
    standby.promote();
    // The same gateway process serves new keys again, through the promoted standby.
    let mut served = None;
    while killed.elapsed() < Duration::from_secs(30) {
        let got = http
            .post(
                "/payments",
                &format!("after-{}", killed.elapsed().as_millis()),
                "{}",
            )
            .await;
        if got.status == 201 {
            served = Some(killed.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let served = served.expect("served again within 30 s of the failover");
    println!("served again {served:?} after the primary was killed");
    executions_reach(&up, up.executions() + 8).await;
    stop.store(true, Ordering::SeqCst);
    settled(running).await;
    up.assert_at_most_once();
    // What was stored before the failover is on the standby, and replays.
    let again = http.post("/payments", "before", "{}").await;
    assert!(again.is_replay(), "{again:?}");
    assert_eq!(again.body, settled_before.body);
}

async fn ready(settings: &PostgresSettings) -> Arc<PostgresStore> {
    let store = Arc::new(PostgresStore::new(settings, None).unwrap());
    let answered = eventually(|| async { store.ping().await.is_ok() }).await;
    assert!(
        answered,
        "the store never answered: {:?}",
        store.ping().await
    );
    store
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_keeps_the_table_bounded() {
    use idemgate::fingerprint::Fingerprint;
    use idemgate::key::{ClientScope, StoreKey};
    let pg = Postgres::start();
    let store = ready(&settings(pg.url())).await;
    let ttl = Duration::from_millis(500);
    let rows = || {
        pg.psql("SELECT count(*) FROM idemgate_records")
            .parse::<u64>()
            .unwrap()
    };
    let scope = ClientScope::from_value(b"expiry");
    // A stream of short-lived keys, for many times their ttl plus the purge's period: after
    // each round the table comes back down to the last two rounds' worth (what is not expired
    // yet, or waits for the purge's next pass), however slow the machine is.
    for round in 0..8 {
        for i in 0..300 {
            let key = StoreKey::new(&scope, "route", &format!("{round}-{i}"));
            store
                .reserve(&key, &Fingerprint([1; 32]).into(), ttl, ttl)
                .await
                .unwrap();
        }
        let bounded = eventually_within(Duration::from_secs(10), || async { rows() <= 600 }).await;
        assert!(bounded, "round {round}: the table holds {} rows", rows());
    }
    let emptied = eventually_within(Duration::from_secs(10), || async { rows() == 0 }).await;
    assert!(emptied, "expired rows were purged: {} left", rows());
    assert!(store.purged() >= 2_000, "purged {}", store.purged());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_starting_together_create_the_schema_once_and_a_newer_one_is_refused() {
    let pg = Postgres::start();
    let mut stores = Vec::new();
    for _ in 0..4 {
        stores.push(tokio::spawn({
            let settings = settings(pg.url());
            async move { ready(&settings).await }
        }));
    }
    for s in stores {
        let store = s.await.unwrap();
        assert!(store
            .get(&idemgate::key::StoreKey::from_hex(&"0".repeat(64)).unwrap())
            .await
            .unwrap()
            .is_none());
    }
    assert_eq!(pg.psql("SELECT version FROM idemgate_records_schema"), "2");
    // A later gateway's layout: this one refuses to touch it, and says why in readiness.
    pg.psql("UPDATE idemgate_records_schema SET version = 3");
    let store = PostgresStore::new(&settings(pg.url()), None).unwrap();
    let refused = store.ping().await.unwrap_err().to_string();
    assert!(refused.contains("schema version 3"), "{refused}");
    match store.readiness() {
        idemgate::store::Readiness::NotReady(why) => assert!(why.contains("version 3"), "{why}"),
        other => panic!("ready on a newer schema: {other:?}"),
    }
}

/// A table made by a gateway of schema version 1 (before records kept their origin), holding
/// a row that gateway left pending when it died: a gateway of version 2 adds the column,
/// records the version, reads the old row as the abandoned record it is, and lists it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_1_table_is_upgraded_in_place() {
    let pg = Postgres::start();
    let up = Upstream::counting().await;
    let config = pg_config(&up.url(), pg.url(), PAYMENTS);
    let id = idemgate::operator::locate(&config, "payments", &["old".into()], &Default::default())
        .unwrap();
    pg.psql(&format!(
        "CREATE TABLE idemgate_records (key bytea PRIMARY KEY, state smallint NOT NULL, \
           fingerprint bytea NOT NULL, created_ms bigint NOT NULL, owner bytea, \
           lease_until_ms bigint, outcome bytea, watched boolean NOT NULL DEFAULT false, \
           expires_ms bigint NOT NULL); \
         CREATE INDEX idemgate_records_expires ON idemgate_records (expires_ms); \
         CREATE TABLE idemgate_records_schema (version integer NOT NULL); \
         INSERT INTO idemgate_records_schema VALUES (1); \
         INSERT INTO idemgate_records VALUES ('\\x{id}', 1, '\\x{fp}', 1, '\\x{owner}', 2, \
           NULL, false, 9000000000000);",
        fp = "07".repeat(32),
        owner = "01".repeat(16),
    ));
    let gw = Running::start(config).await.unwrap();
    let http = Http::new(gw.addr());
    assert_eq!(http.post("/payments", "new", "{}").await.status, 201);
    assert_eq!(pg.psql("SELECT version FROM idemgate_records_schema"), "2");
    // Another request with the old key (its fingerprint is made up here) is refused, and the
    // record stays as it was.
    assert_eq!(
        http.post("/payments", "old", "{}").await.problem_type(),
        "key-reused"
    );
    let store = ready(&settings(pg.url())).await;
    assert!(store.get(&id).await.unwrap().unwrap().is_unknown());
    let page = store.scan_unknown(None, 10).await.unwrap();
    assert_eq!(page.records.len(), 1, "{page:?}");
    assert_eq!(page.records[0].key, id);
    assert_eq!(
        page.records[0].record.origin, None,
        "written before origins were"
    );
    assert_eq!(up.executions(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_created_from_the_printed_ddl_is_used_as_it_is() {
    let pg = Postgres::start();
    pg.psql(&idemgate::store::postgres::schema::ddl("payments_keys"));
    let store = ready(&PostgresSettings {
        table: "payments_keys".into(),
        ..settings(pg.url())
    })
    .await;
    let up = Upstream::counting().await;
    let mut config = pg_config(&up.url(), pg.url(), PAYMENTS);
    config.store = StoreConfig::Postgres(PostgresSettings {
        table: "payments_keys".into(),
        ..settings(pg.url())
    });
    let gw = Running::start(config).await.unwrap();
    let http = Http::new(gw.addr());
    assert_eq!(http.post("/payments", "k", "{}").await.status, 201);
    assert!(http.post("/payments", "k", "{}").await.is_replay());
    assert_eq!(pg.psql("SELECT count(*) FROM payments_keys"), "1");
    drop(store);
}

/// What replication promises across a failover, measured: a standby that lags behind (the
/// primary's WAL sender stopped) and is promoted after the primary is killed. Asynchronous: every key the
/// gateway executed meanwhile is gone, and its retry executes again. Synchronous: the commit
/// waits for the standby, the gateway answers 503 with nothing forwarded, and after the
/// failover the retry executes once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asynchronous_replication_loses_reservations_in_a_failover_synchronous_does_not() {
    for synchronous in [false, true] {
        let mut primary = Postgres::start();
        let standby = Postgres::standby_of(&primary, "standby1");
        if synchronous {
            primary.require_sync_standby("standby1");
        }
        let up = Upstream::counting().await;
        let url = format!(
            "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write",
            primary.port, standby.port
        );
        let gw = in_process(&up.url(), url, PAYMENTS).await;
        let http = Http::new(gw.addr());
        assert_eq!(http.post("/payments", "warm-up", "{}").await.status, 201);
        primary.signal_wal_sender("STOP");
        let keys: Vec<String> = (0..3).map(|i| format!("lagging-{i}")).collect();
        for key in &keys {
            let got = http.post("/payments", key, "{}").await;
            if synchronous {
                assert_eq!(got.status, 503, "{got:?}");
                assert_eq!(got.problem_type(), "store-unavailable");
            } else {
                assert_eq!(got.status, 201, "{got:?}");
            }
        }
        let before = up.executions();
        primary.kill();
        standby.promote();
        for key in &keys {
            let mut got = http.post("/payments", key, "{}").await;
            for _ in 0..300 {
                if got.status != 503 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                got = http.post("/payments", key, "{}").await;
            }
            assert_eq!(got.status, 201, "{got:?}");
        }
        let per_key = up.executions_per_key();
        let twice = keys.iter().filter(|k| per_key.get(*k) == Some(&2)).count();
        println!(
            "synchronous = {synchronous}: {before} executions before the failover, {twice} of {} keys executed twice",
            keys.len()
        );
        if synchronous {
            assert_eq!(twice, 0);
            up.assert_at_most_once();
        } else {
            assert_eq!(twice, keys.len(), "an asynchronous standby lost them");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_postgres_routes_fail_closed_unless_they_pass() {
    let up = Upstream::counting().await;
    let url = format!(
        "postgres://postgres@127.0.0.1:{}/postgres",
        free_port(false)
    );
    let gw = Running::start(
        pg_config(
            &up.url(),
            url,
            "[[routes]]\npath = \"/payments\"\n[[routes]]\npath = \"/refunds\"\non_store_error = \"pass\"\n",
        )
        .with_admin(),
    )
    .await
    .unwrap();
    let http = Http::new(gw.addr());
    let closed = http.post("/payments", "k", "{}").await;
    assert_eq!(closed.status, 503);
    assert_eq!(closed.problem_type(), "store-unavailable");
    assert!(closed.header("retry-after").is_some());
    assert_eq!(up.executions(), 0);
    let passed = http.post("/refunds", "k", "{}").await;
    assert_eq!(passed.status, 201);
    assert_eq!(up.executions(), 1);
    let (status, body) = admin_get(gw.admin_addr().unwrap(), "/readyz").await;
    assert_eq!(status, 503, "{body}");
}

/// Statements a request costs, as the server logs them (`log_statement = all`): a new key is its
/// reservation and its result, a replay only the reservation, which reads the existing row in
/// the same statement (the background purge and each new connection's check are left out of the
/// count).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_key_costs_two_statements_and_a_replay_one() {
    let pg = Postgres::start_with(&["log_statement=all"]);
    let up = Upstream::counting().await;
    let gw = in_process(&up.url(), pg.url(), PAYMENTS).await;
    let http = Http::new(gw.addr());
    assert_eq!(http.post("/payments", "warm-up", "{}").await.status, 201);
    let statements = || {
        pg.log()
            .lines()
            .filter(|l| {
                l.contains("LOG:  execute")
                    && !l.contains("DELETE FROM idemgate_records WHERE key IN (")
                    // Each new connection's check, not the requests'.
                    && !l.contains("pg_is_in_recovery()")
            })
            .count()
    };
    let start = statements();
    for i in 0..20 {
        assert_eq!(
            http.post("/payments", &format!("new-{i}"), "{}")
                .await
                .status,
            201
        );
    }
    let counted = eventually(|| async { statements() >= start + 40 }).await;
    assert!(
        counted,
        "{} statements for 20 new keys",
        statements() - start
    );
    let after_new = statements();
    assert_eq!(after_new - start, 40, "two statements per new key");
    for i in 0..20 {
        assert!(http
            .post("/payments", &format!("new-{i}"), "{}")
            .await
            .is_replay());
    }
    let counted = eventually(|| async { statements() >= after_new + 20 }).await;
    assert!(
        counted,
        "{} statements for 20 replays",
        statements() - after_new
    );
    assert_eq!(statements() - after_new, 20, "one statement per replay");
    assert_eq!(up.executions(), 21);
}
