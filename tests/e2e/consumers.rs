//! `[[consumers]]` on a real `redis-server` stream, the real `idemgate` binary and a real
//! handler: a message is applied once however often it is published or delivered, acknowledged
//! only once its result is stored, retried with backoff, dead-lettered with its reason, and
//! nothing is left pending at the end of any test.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::support::redis::RedisServer;

mod failures;
mod kafka;
mod rabbitmq;
use crate::support::{
    admin_get, eventually_within, scrape, store_completed, GatewayProcess, Reply, Upstream,
};

const STREAM: &str = "orders";
const GROUP: &str = "idemgate";

/// A port free now, for the admin listener.
fn free_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], crate::support::redis::free_port(false)))
}

/// A gateway config with `store` (its `[store]` lines) and one consumer named "orders" reading
/// `source` (the `source = ...` value) and posting to `handler`/orders, retrying fast unless
/// `extra` sets its own backoff.
fn gateway_config(
    store: &str,
    source: &str,
    handler: &str,
    admin: SocketAddr,
    extra: &str,
) -> String {
    keyed_config(
        store,
        source,
        handler,
        admin,
        r#"{ json = "/messageId" }"#,
        extra,
    )
}

/// [`gateway_config`] with the consumer's `key` (its TOML value) given.
fn keyed_config(
    store: &str,
    source: &str,
    handler: &str,
    admin: SocketAddr,
    key: &str,
    extra: &str,
) -> String {
    let fast = if extra.contains("backoff") {
        ""
    } else {
        "backoff = \"50ms\"\nmax_backoff = \"200ms\""
    };
    format!(
        r#"[server]
listen = "127.0.0.1:0"
admin = "{admin}"
shutdown_grace = "5s"
[store]
{store}
[upstream]
url = "{handler}"
[[consumers]]
name = "orders"
source = {source}
handler = "{handler}/orders"
key = {key}
{fast}
{extra}
"#
    )
}

/// Two gateway processes sharing their records through `redis`, each reading `source` 32
/// messages at a time; their admin listeners are `a` and `b`.
fn two_instances(
    redis: &RedisServer,
    source: &str,
    handler: &str,
    (a, b): (SocketAddr, SocketAddr),
) -> [GatewayProcess; 2] {
    let on_redis = |admin| {
        gateway_config(
            &redis_store(redis),
            source,
            handler,
            admin,
            "concurrency = 32",
        )
    };
    [
        GatewayProcess::start(&on_redis(a)),
        GatewayProcess::start(&on_redis(b)),
    ]
}

fn redis_store(redis: &RedisServer) -> String {
    format!("backend = \"redis\"\nurl = \"{}\"", redis.url())
}

/// A gateway on `redis` as its store, with one consumer of [`STREAM`] posting to `handler`.
fn config(redis: &RedisServer, handler: &str, admin: SocketAddr, extra: &str) -> String {
    let source =
        format!("{{ redis_stream = \"{STREAM}\", group = \"{GROUP}\", claim_idle = \"1s\" }}");
    gateway_config(&redis_store(redis), &source, handler, admin, extra)
}

fn publish(redis: &RedisServer, body: &str) -> String {
    redis
        .cli(&["XADD", STREAM, "*", "body", body])
        .trim()
        .to_string()
}

/// `XINFO GROUPS` of a stream as name -> field -> value.
fn groups(redis: &RedisServer, stream: &str) -> HashMap<String, HashMap<String, String>> {
    let out = redis.cli(&["XINFO", "GROUPS", stream]);
    let lines: Vec<&str> = out.lines().collect();
    let mut all = HashMap::new();
    let mut current: HashMap<String, String> = HashMap::new();
    for pair in lines.chunks(2) {
        if let [k, v] = pair {
            if *k == "name" && !current.is_empty() {
                let name = current.get("name").cloned().unwrap_or_default();
                all.insert(name, std::mem::take(&mut current));
            }
            current.insert((*k).to_string(), (*v).to_string());
        }
    }
    if let Some(name) = current.get("name").cloned() {
        all.insert(name, current);
    }
    all
}

/// The group has read `entries` entries and none is left unacknowledged.
fn all_acked(redis: &RedisServer, entries: usize) -> bool {
    groups(redis, STREAM).get(GROUP).is_some_and(|g| {
        g.get("entries-read").map(String::as_str) == Some(&entries.to_string())
            && g.get("pending").map(String::as_str) == Some("0")
    })
}

async fn wait_all_acked(redis: &RedisServer, entries: usize) {
    let done = eventually_within(Duration::from_secs(30), || async {
        all_acked(redis, entries)
    })
    .await;
    assert!(
        done,
        "the group did not read and acknowledge {entries} entries: {:?}",
        groups(redis, STREAM)
    );
}

/// The dead-letter stream's entries, each as field -> value (read one at a time: in redis-cli's
/// raw output nothing tells where an entry ends).
fn dead_letters(redis: &RedisServer) -> Vec<HashMap<String, String>> {
    let mut entries = Vec::new();
    let mut from = "-".to_string();
    loop {
        let out = redis.cli(&["XRANGE", "orders:dead", &from, "+", "COUNT", "1"]);
        let mut lines = out.lines();
        let Some(id) = lines.next().filter(|l| !l.is_empty()) else {
            return entries;
        };
        let mut entry = HashMap::new();
        while let (Some(k), Some(v)) = (lines.next(), lines.next()) {
            entry.insert(k.to_string(), v.to_string());
        }
        entries.push(entry);
        from = format!("({id}");
    }
}

async fn metric(admin: SocketAddr, outcome: &str) -> f64 {
    scrape(admin)
        .await
        .get(&format!(
            "idemgate_consumer_messages_total{{consumer=\"orders\",outcome=\"{outcome}\"}}"
        ))
        .copied()
        .unwrap_or(0.0)
}

/// Waits (at most 20 s) until the consumer has counted `n` messages with `outcome`.
async fn wait_metric(admin: SocketAddr, outcome: &str, n: f64) {
    let reached = eventually_within(Duration::from_secs(20), || async {
        metric(admin, outcome).await == n
    })
    .await;
    assert!(
        reached,
        "{outcome} never reached {n}: {}",
        metric(admin, outcome).await
    );
}

/// A consumer-wide series of consumer "orders" (`idemgate_consumer_restarts_total`,
/// `idemgate_consumer_dead_letters_owed`), 0 when absent.
async fn consumer_series(admin: SocketAddr, name: &str) -> f64 {
    scrape(admin)
        .await
        .get(&format!("{name}{{consumer=\"orders\"}}"))
        .copied()
        .unwrap_or(0.0)
}

/// Waits (at most 30 s) for `/readyz` to say 200.
async fn wait_ready(admin: SocketAddr) {
    let ready = eventually_within(Duration::from_secs(30), || async {
        admin_get(admin, "/readyz").await.0 == 200
    })
    .await;
    assert!(
        ready,
        "never ready: {:?}",
        admin_get(admin, "/readyz").await
    );
}

/// The handler's executions, by the `messageId` of their bodies.
fn applied(up: &Upstream) -> Vec<String> {
    up.seen()
        .iter()
        .filter(|s| s.path_and_query == "/orders")
        .filter_map(|s| {
            let v: serde_json::Value = serde_json::from_slice(&s.body).ok()?;
            Some(v["messageId"].as_str()?.to_string())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_published_twice_is_applied_once_and_both_are_acknowledged() {
    let redis = RedisServer::start();
    let up = Upstream::counting().await;
    let admin = free_addr();
    let _gw = GatewayProcess::start(&config(&redis, &up.url(), admin, ""));
    // A producer's retry: the same message, a second entry with a new stream id.
    let body = r#"{"messageId": "m-1", "amount": 1000}"#;
    publish(&redis, body);
    publish(&redis, body);
    wait_all_acked(&redis, 2).await;
    assert_eq!(applied(&up), vec!["m-1"], "the handler ran once");
    let seen = &up.seen()[0];
    assert_eq!(seen.method, http::Method::POST);
    assert_eq!(seen.headers["content-type"], "application/json");
    // The key's parts combined: stable per message, for the handler's own inbox.
    let key = seen.headers["idempotency-key"].to_str().unwrap();
    assert!(
        key.len() == 64 && key.bytes().all(|b| b.is_ascii_hexdigit()),
        "{key}"
    );
    assert_eq!(seen.headers["idemgate-deliveries"], "1");
    wait_metric(admin, "delivered", 1.0).await;
    wait_metric(admin, "deduplicated", 1.0).await;
    assert!(dead_letters(&redis).is_empty());
    let (status, _) = admin_get(admin, "/readyz").await;
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_failing_three_times_then_succeeding_is_applied_once() {
    let redis = RedisServer::start();
    let up = Upstream::start(|_, n| {
        if n <= 3 {
            Reply::json(503, r#"{"error":"busy"}"#)
        } else {
            Reply::json(201, r#"{"ok":true}"#)
        }
    })
    .await;
    let admin = free_addr();
    let _gw = GatewayProcess::start(&config(&redis, &up.url(), admin, "max_attempts = 5"));
    publish(&redis, r#"{"messageId": "m-2"}"#);
    wait_all_acked(&redis, 1).await;
    // Three 503s (each released its key), then the 201 that was stored.
    assert_eq!(applied(&up).len(), 4);
    let deliveries: Vec<String> = up
        .seen()
        .iter()
        .map(|s| {
            s.headers["idemgate-deliveries"]
                .to_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(deliveries, ["1", "2", "3", "4"], "each attempt counted");
    wait_metric(admin, "retried", 3.0).await;
    wait_metric(admin, "delivered", 1.0).await;
    assert!(dead_letters(&redis).is_empty());
    // The stored answer stands for the message from now on.
    publish(&redis, r#"{"messageId": "m-2"}"#);
    wait_all_acked(&redis, 2).await;
    assert_eq!(applied(&up).len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_is_dead_lettered_after_max_attempts_and_others_go_on() {
    let redis = RedisServer::start();
    let up = Upstream::start(|seen, _| {
        if String::from_utf8_lossy(&seen.body).contains("poison") {
            Reply::json(500, r#"{"error":"boom"}"#)
        } else {
            Reply::json(201, "{}")
        }
    })
    .await;
    let admin = free_addr();
    let _gw = GatewayProcess::start(&config(&redis, &up.url(), admin, "max_attempts = 3"));
    let poison = publish(&redis, r#"{"messageId": "m-3", "kind": "poison"}"#);
    publish(&redis, r#"{"messageId": "m-4"}"#);
    // No key: never delivered unchecked.
    let keyless = publish(&redis, r#"{"amount": 1}"#);
    wait_all_acked(&redis, 3).await;
    let dead = dead_letters(&redis);
    assert_eq!(dead.len(), 2, "{dead:?}");
    let by_id = |id: &str| {
        dead.iter()
            .find(|d| d["idemgate-id"] == id)
            .unwrap()
            .clone()
    };
    let p = by_id(&poison);
    assert!(p["idemgate-reason"].contains("500"), "{p:?}");
    assert!(p["idemgate-reason"].contains("3 attempts"), "{p:?}");
    assert_eq!(p["idemgate-deliveries"], "3");
    assert_eq!(
        p["body"], r#"{"messageId": "m-3", "kind": "poison"}"#,
        "copied whole"
    );
    assert_eq!(p["idemgate-stream"], STREAM);
    let k = by_id(&keyless);
    assert!(k["idemgate-reason"].starts_with("missing-key"), "{k:?}");
    assert_eq!(
        applied(&up).iter().filter(|m| *m == "m-3").count(),
        3,
        "three attempts, then no more"
    );
    assert_eq!(applied(&up).iter().filter(|m| *m == "m-4").count(), 1);
    wait_metric(admin, "dead_lettered", 2.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_while_the_handler_works_the_message_is_redelivered_and_not_applied_twice() {
    let redis = RedisServer::start();
    let (up, gate) = Upstream::gated().await;
    let admin = free_addr();
    let cfg = config(&redis, &up.url(), admin, "lock_timeout = \"1s\"");
    let gw = GatewayProcess::start(&cfg);
    publish(&redis, r#"{"messageId": "m-5"}"#);
    up.next_arrival().await;
    // Killed mid-call: nothing stored, nothing acknowledged.
    gw.signal_and_wait("-KILL");
    gate.add_permits(1);
    assert!(
        eventually_within(Duration::from_secs(5), || async {
            groups(&redis, STREAM)[GROUP]["pending"] == "1"
        })
        .await
    );
    // The restarted instance is a new consumer: it claims the entry once it has been idle for
    // claim_idle, finds the key's lease expired mid-call, and never calls the handler again.
    let _gw = GatewayProcess::start(&cfg);
    wait_all_acked(&redis, 1).await;
    assert_eq!(applied(&up), vec!["m-5"], "applied once");
    let dead = dead_letters(&redis);
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert!(
        dead[0]["idemgate-reason"].starts_with("outcome-unknown"),
        "{dead:?}"
    );
    assert_eq!(dead[0]["idemgate-deliveries"], "2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_answer_was_stored_the_redelivery_replays() {
    let redis = RedisServer::start();
    let up = Upstream::counting().await;
    let admin = free_addr();
    // A message delivered again after its answer was stored (a lost acknowledgement, a
    // consumer group rewound by an operator): played by rewinding the group after a kill.
    let cfg = config(&redis, &up.url(), admin, "");
    let gw = GatewayProcess::start(&cfg);
    let id = publish(&redis, r#"{"messageId": "m-6"}"#);
    wait_all_acked(&redis, 1).await;
    gw.signal_and_wait("-KILL");
    redis.cli(&["XGROUP", "SETID", STREAM, GROUP, "0"]);
    let _gw = GatewayProcess::start(&cfg);
    assert!(
        eventually_within(Duration::from_secs(20), || async {
            groups(&redis, STREAM)[GROUP]["pending"] == "0"
                && groups(&redis, STREAM)[GROUP]["last-delivered-id"] == id
        })
        .await
    );
    assert_eq!(applied(&up), vec!["m-6"]);
    assert!(dead_letters(&redis).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_in_one_group_apply_a_thousand_messages_with_duplicates_exactly_once() {
    let redis = RedisServer::start();
    let up = Upstream::counting().await;
    let (a, b) = (free_addr(), free_addr());
    // Nothing is claimed from the other instance while it works (a stalled machine would make
    // a claimed entry count as one more duplicate): this test is about sharing, not claiming.
    let source =
        format!("{{ redis_stream = \"{STREAM}\", group = \"{GROUP}\", claim_idle = \"60s\" }}");
    let _both = two_instances(&redis, &source, &up.url(), (a, b));
    // 1,000 entries: 800 messages, every fourth one published a second time.
    let mut script = String::new();
    let mut ids = BTreeSet::new();
    for i in 0..800 {
        let body = format!(r#"{{"messageId": "bulk-{i}", "n": {i}}}"#);
        script.push_str(&format!("XADD {STREAM} * body '{body}'\n"));
        if i % 4 == 0 {
            script.push_str(&format!("XADD {STREAM} * body '{body}'\n"));
        }
        ids.insert(format!("bulk-{i}"));
    }
    let mut child = std::process::Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &redis.port.to_string()])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    use std::io::Write as _;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(script.as_bytes())
        .unwrap();
    assert!(child.wait().unwrap().success());
    wait_all_acked(&redis, 1000).await;
    applied_once_by_both(&up, &ids, a, b).await;
}

/// Every one of `ids` applied once, 800 delivered and 200 deduplicated between the instances
/// whose admin ports are `a` and `b`, each of which did some of the work.
async fn applied_once_by_both(up: &Upstream, ids: &BTreeSet<String>, a: SocketAddr, b: SocketAddr) {
    let applied = applied(up);
    assert_eq!(applied.len(), 800, "every message applied once");
    assert_eq!(&applied.iter().cloned().collect::<BTreeSet<_>>(), ids);
    // Each instance counts a message once it is acknowledged: wait for the counts to settle.
    let counted = |outcome| async move { metric(a, outcome).await + metric(b, outcome).await };
    let settled = eventually_within(Duration::from_secs(20), || async {
        counted("delivered").await == 800.0 && counted("deduplicated").await == 200.0
    })
    .await;
    assert!(
        settled,
        "delivered {}, deduplicated {}",
        counted("delivered").await,
        counted("deduplicated").await
    );
    let (da, db) = (metric(a, "delivered").await, metric(b, "delivered").await);
    assert!(
        da > 0.0 && db > 0.0,
        "both instances shared the work: {da} and {db}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_fails_while_the_broker_cannot_be_reached() {
    let store = RedisServer::start();
    let mut broker = RedisServer::start();
    let up = Upstream::counting().await;
    let admin = free_addr();
    // The stream on a Redis of its own: the store's stays up while the broker goes down.
    let source = format!(
        "{{ redis_stream = \"{STREAM}\", url = \"{}\" }}",
        broker.url()
    );
    let cfg = gateway_config(&redis_store(&store), &source, &up.url(), admin, "");
    let _gw = GatewayProcess::start(&cfg);
    let ready = || async { admin_get(admin, "/readyz").await };
    assert!(eventually_within(Duration::from_secs(10), || async { ready().await.0 == 200 }).await);
    broker.kill();
    assert!(eventually_within(Duration::from_secs(10), || async { ready().await.0 == 503 }).await);
    assert!(ready()
        .await
        .1
        .contains("consumer \"orders\": broker unreachable"));
    broker.restart();
    assert!(eventually_within(Duration::from_secs(15), || async { ready().await.0 == 200 }).await);
    broker.cli(&["XADD", STREAM, "*", "body", r#"{"messageId": "m-7"}"#]);
    assert!(
        eventually_within(Duration::from_secs(10), || async {
            applied(&up) == ["m-7"]
        })
        .await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_finishes_the_message_being_handled_and_leaves_a_waiting_retry_pending() {
    let redis = RedisServer::start();
    let gate = Arc::new(crate::support::Semaphore::new(0));
    let g = Arc::clone(&gate);
    let up = Upstream::start(move |seen, _| {
        if String::from_utf8_lossy(&seen.body).contains("later") {
            Reply::json(503, "{}")
        } else {
            Reply::json(201, "{}").gated(&g)
        }
    })
    .await;
    let admin = free_addr();
    let slow_retries = |attempts: u32| {
        let retries =
            format!("max_attempts = {attempts}\nbackoff = \"30s\"\nmax_backoff = \"30s\"");
        config(&redis, &up.url(), admin, &retries)
    };
    let gw = GatewayProcess::start(&slow_retries(5));
    publish(&redis, r#"{"messageId": "s-1"}"#);
    publish(&redis, r#"{"messageId": "s-2", "when": "later"}"#);
    // s-1 is with the handler, s-2 failed once and waits 30 s for its retry.
    assert!(
        eventually_within(Duration::from_secs(10), || async {
            up.executions() == 2 && metric(admin, "retried").await == 1.0
        })
        .await
    );
    gw.signal("-TERM");
    gate.add_permits(1);
    let status = gw.signal_and_wait("-0");
    assert!(status.success(), "{status:?}");
    // s-1 finished, was stored and acknowledged; s-2 was left pending, not lost.
    let g = groups(&redis, STREAM);
    assert_eq!(g[GROUP]["pending"], "1", "{g:?}");
    // Both were handled at once: either may have reached the handler first.
    let mut applied_now = applied(&up);
    applied_now.sort();
    assert_eq!(applied_now, vec!["s-1", "s-2"]);
    assert!(dead_letters(&redis).is_empty());
    // The next instance takes s-2 over once its claim runs out, and its retry is stored (the
    // handler now answers 503 to it again: this only checks that nothing was lost).
    let _gw = GatewayProcess::start(&slow_retries(2));
    wait_all_acked(&redis, 2).await;
    let dead = dead_letters(&redis);
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert!(
        dead[0]["idemgate-reason"].starts_with("failed:"),
        "{dead:?}"
    );
    assert_eq!(applied(&up).iter().filter(|m| *m == "s-1").count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saturated_handler_stops_the_reading_at_concurrency() {
    let redis = RedisServer::start();
    let (up, gate) = Upstream::gated().await;
    let admin = free_addr();
    let _gw = GatewayProcess::start(&config(&redis, &up.url(), admin, "concurrency = 2"));
    for i in 0..10 {
        publish(&redis, &format!(r#"{{"messageId": "bp-{i}"}}"#));
    }
    assert!(eventually_within(Duration::from_secs(10), || async { up.executions() == 2 }).await);
    // Two held by the handler, none more read: the other eight stay in the stream, where
    // another instance could take them.
    let read = || groups(&redis, STREAM)[GROUP]["entries-read"].clone();
    assert_eq!(read(), "2");
    gate.add_permits(10);
    wait_all_acked(&redis, 10).await;
    assert_eq!(up.executions(), 10);
}

// NATS JetStream: the same guarantees through a durable pull consumer, on the disk store.

mod nats {
    use super::*;
    use crate::support::nats::NatsServer;
    use crate::support::{TempDir, TomlConfig};

    fn source(nats: &NatsServer) -> String {
        source_with_ack_wait(nats, "1s")
    }

    fn source_with_ack_wait(nats: &NatsServer, ack_wait: &str) -> String {
        format!(
            "{{ nats_stream = \"ORDERS\", url = \"{}\", dead_letter = \"dead.orders\", ack_wait = \"{ack_wait}\" }}",
            nats.url()
        )
    }

    /// A gateway on the disk store in `dir`, with one consumer of `ORDERS` posting to `handler`.
    fn config(
        nats: &NatsServer,
        dir: &TempDir,
        handler: &str,
        admin: SocketAddr,
        extra: &str,
    ) -> String {
        let store = format!("backend = \"disk\"\npath = \"{}\"", dir.path.display());
        gateway_config(&store, &source(nats), handler, admin, extra)
    }

    async fn streams(nats: &NatsServer) {
        nats.stream("ORDERS", &["orders.>"]).await;
        nats.stream("DEAD", &["dead.orders"]).await;
    }

    async fn wait_done(nats: &NatsServer) {
        let done = eventually_within(Duration::from_secs(30), || async {
            nats.outstanding("ORDERS", "idemgate").await == Some((0, 0))
        })
        .await;
        assert!(
            done,
            "messages left unacknowledged: {:?}",
            nats.outstanding("ORDERS", "idemgate").await
        );
    }

    fn header(h: &async_nats::HeaderMap, name: &str) -> String {
        h.get(name).map(|v| v.to_string()).unwrap_or_default()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_message_published_twice_is_applied_once() {
        let nats = NatsServer::start();
        streams(&nats).await;
        let dir = TempDir::new("nats-once");
        let up = Upstream::counting().await;
        let admin = free_addr();
        let _gw = GatewayProcess::start(&config(&nats, &dir, &up.url(), admin, ""));
        let body = r#"{"messageId": "n-1", "amount": 5}"#;
        nats.publish("orders.created", body).await;
        nats.publish("orders.created", body).await;
        wait_metric(admin, "deduplicated", 1.0).await;
        wait_done(&nats).await;
        assert_eq!(applied(&up), vec!["n-1"]);
        wait_metric(admin, "delivered", 1.0).await;
        assert!(nats.messages("DEAD").await.is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn failures_are_retried_then_applied_once_and_poison_is_dead_lettered() {
        let nats = NatsServer::start();
        streams(&nats).await;
        let dir = TempDir::new("nats-retry");
        let up = Upstream::start(|seen, n| {
            let body = String::from_utf8_lossy(&seen.body);
            if body.contains("poison") {
                Reply::json(500, "{}")
            } else if n <= 3 {
                Reply::json(503, "{}")
            } else {
                Reply::json(201, "{}")
            }
        })
        .await;
        let admin = free_addr();
        let _gw = GatewayProcess::start(&config(&nats, &dir, &up.url(), admin, "max_attempts = 4"));
        nats.publish("orders.created", r#"{"messageId": "n-2"}"#)
            .await;
        wait_metric(admin, "delivered", 1.0).await;
        assert_eq!(applied(&up).len(), 4, "three 503s, then the 201 stored");
        nats.publish(
            "orders.created",
            r#"{"messageId": "n-3", "kind": "poison"}"#,
        )
        .await;
        nats.publish("orders.created", r#"{"no": "key"}"#).await;
        wait_metric(admin, "dead_lettered", 2.0).await;
        wait_done(&nats).await;
        let dead = nats.messages("DEAD").await;
        assert_eq!(dead.len(), 2);
        let poison = dead.iter().find(|(_, p)| p.contains("poison")).unwrap();
        assert!(
            header(&poison.0, "Idemgate-Reason").contains("500"),
            "{poison:?}"
        );
        assert!(
            header(&poison.0, "Idemgate-Reason").contains("4 attempts"),
            "{poison:?}"
        );
        let keyless = dead.iter().find(|(_, p)| p.contains("no")).unwrap();
        assert!(header(&keyless.0, "Idemgate-Reason").starts_with("missing-key"));
        assert_eq!(applied(&up).iter().filter(|m| *m == "n-3").count(), 4);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn killed_while_the_handler_works_the_message_is_not_applied_twice() {
        let nats = NatsServer::start();
        streams(&nats).await;
        let dir = TempDir::new("nats-kill");
        let (up, gate) = Upstream::gated().await;
        let admin = free_addr();
        let cfg = config(&nats, &dir, &up.url(), admin, "lock_timeout = \"1s\"");
        let gw = GatewayProcess::start(&cfg);
        nats.publish("orders.created", r#"{"messageId": "n-4"}"#)
            .await;
        up.next_arrival().await;
        gw.signal_and_wait("-KILL");
        gate.add_permits(1);
        // Redelivered after ack_wait, to the restarted gateway, which finds the key's lease
        // expired mid-call on its disk: never called again.
        let _gw = GatewayProcess::start(&cfg);
        wait_metric(admin, "dead_lettered", 1.0).await;
        wait_done(&nats).await;
        assert_eq!(applied(&up), vec!["n-4"]);
        let dead = nats.messages("DEAD").await;
        assert!(
            header(&dead[0].0, "Idemgate-Reason").starts_with("outcome-unknown"),
            "{dead:?}"
        );
        assert_eq!(header(&dead[0].0, "Idemgate-Deliveries"), "2");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dead_letter_subject_the_stream_captures_is_refused_and_an_outage_fails_readiness() {
        let mut nats = NatsServer::start();
        streams(&nats).await;
        let dir = TempDir::new("nats-ready");
        let up = Upstream::counting().await;
        let admin = free_addr();
        // orders.> would capture every dead letter and hand it back as a new message.
        let looping = TomlConfig::parse(&config(&nats, &dir, &up.url(), admin, ""))
            .set("consumers[0].source.dead_letter", "orders.dead");
        let gw = GatewayProcess::start(&looping.text());
        gw.wait_log("captures the dead-letter subject");
        let (status, body) = admin_get(admin, "/readyz").await;
        assert_eq!(
            (status, body.as_str()),
            (503, "consumer \"orders\": broker unreachable\n")
        );
        drop(gw);
        let dir = TempDir::new("nats-ready-2");
        let _gw = GatewayProcess::start(&config(&nats, &dir, &up.url(), admin, ""));
        let ready = || async { admin_get(admin, "/readyz").await.0 };
        assert!(
            eventually_within(Duration::from_secs(10), || async { ready().await == 200 }).await
        );
        nats.kill();
        assert!(
            eventually_within(Duration::from_secs(10), || async { ready().await == 503 }).await
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_instances_on_one_durable_apply_a_thousand_messages_with_duplicates_exactly_once() {
        let nats = NatsServer::start();
        streams(&nats).await;
        // Two instances share their records through Redis (a disk store is one instance's).
        let redis = RedisServer::start();
        let up = Upstream::counting().await;
        let (a, b) = (free_addr(), free_addr());
        // No redelivery while an instance works (a stalled machine would make one count as one
        // more duplicate): this test is about sharing, not redelivery.
        let source = source_with_ack_wait(&nats, "60s");
        let _both = super::two_instances(&redis, &source, &up.url(), (a, b));
        let js = nats.jetstream().await;
        let mut ids = BTreeSet::new();
        let mut acks = Vec::new();
        for i in 0..800 {
            let body = format!(r#"{{"messageId": "bulk-{i}"}}"#);
            let copies = if i % 4 == 0 { 2 } else { 1 };
            for _ in 0..copies {
                acks.push(
                    js.publish("orders.created", body.clone().into())
                        .await
                        .unwrap(),
                );
            }
            ids.insert(format!("bulk-{i}"));
        }
        for ack in acks {
            ack.await.unwrap();
        }
        let total = || async { metric(a, "delivered").await + metric(b, "delivered").await };
        assert!(
            eventually_within(Duration::from_secs(60), || async { total().await == 800.0 }).await
        );
        wait_done(&nats).await;
        applied_once_by_both(&up, &ids, a, b).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_handler_slower_than_ack_wait_keeps_its_message() {
        let nats = NatsServer::start();
        streams(&nats).await;
        let dir = TempDir::new("nats-slow");
        // 2.5 times ack_wait: without in-progress acks the server would deliver it again.
        let up = Upstream::start(|_, _| {
            Reply::Delayed(
                Duration::from_millis(2500),
                Box::new(Reply::json(201, "{}")),
            )
        })
        .await;
        let admin = free_addr();
        let _gw = GatewayProcess::start(&config(&nats, &dir, &up.url(), admin, ""));
        nats.publish("orders.created", r#"{"messageId": "n-slow"}"#)
            .await;
        wait_metric(admin, "delivered", 1.0).await;
        wait_done(&nats).await;
        assert_eq!(applied(&up), vec!["n-slow"]);
        assert_eq!(
            metric(admin, "deduplicated").await,
            0.0,
            "never delivered twice"
        );
        let js = nats.jetstream().await;
        let mut consumer: async_nats::jetstream::consumer::PullConsumer = js
            .get_stream("ORDERS")
            .await
            .unwrap()
            .get_consumer("idemgate")
            .await
            .unwrap();
        assert_eq!(consumer.info().await.unwrap().num_redelivered, 0);
    }
}

/// The records in Postgres, the stream in Redis: two instances in one group apply 300 messages
/// with duplicates once each, and every entry is acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_the_postgres_store_two_instances_apply_each_message_once() {
    let redis = RedisServer::start();
    let pg = crate::support::postgres::Postgres::start();
    let up = Upstream::counting().await;
    let source = format!(
        "{{ redis_stream = \"{STREAM}\", group = \"{GROUP}\", claim_idle = \"1s\", url = \"{}\" }}",
        redis.url()
    );
    let store = format!("backend = \"postgres\"\nurl = \"{}\"", pg.url());
    let (a, b) = (free_addr(), free_addr());
    let _gws = [a, b].map(|admin| {
        GatewayProcess::start(&gateway_config(
            &store,
            &source,
            &up.url(),
            admin,
            "concurrency = 16",
        ))
    });
    let mut ids = BTreeSet::new();
    let mut entries = 0;
    for i in 0..300 {
        let id = format!("m-{}", i % 240);
        publish(&redis, &format!(r#"{{"messageId": "{id}"}}"#));
        ids.insert(id);
        entries += 1;
    }
    wait_all_acked(&redis, entries).await;
    let mut applied = applied(&up);
    applied.sort();
    assert_eq!(
        applied,
        ids.into_iter().collect::<Vec<_>>(),
        "each message once"
    );
    assert_eq!(
        pg.psql("SELECT count(*) FROM idemgate_records WHERE state = 2"),
        "240"
    );
}

/// A message the previous version stored under a number key part's text (before issue 45, every
/// part was text), delivered again after the upgrade, is acknowledged as the duplicate it is,
/// not applied again; a new message with the same digits as a string is another key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_stored_by_the_previous_version_under_a_number_part_is_not_applied_again() {
    let redis = RedisServer::start();
    let up = Upstream::counting().await;
    let admin = free_addr();
    let source =
        format!("{{ redis_stream = \"{STREAM}\", group = \"{GROUP}\", claim_idle = \"1s\" }}");
    let text = keyed_config(
        &redis_store(&redis),
        &source,
        &up.url(),
        admin,
        r#"{ json = ["/order", "/n"] }"#,
        // The stored fingerprint is made up here, not the message's.
        "check_fingerprint = false",
    );
    let config = idemgate::config::Config::parse(&text).unwrap();
    let old_key = idemgate::operator::locate(
        &config,
        "orders",
        &["o-1".into(), "1e1".into()],
        &Default::default(),
    )
    .unwrap();
    let store = idemgate::operator::open_store(&config).await.unwrap();
    store_completed(&*store, &old_key, b"{}", Duration::from_secs(3600)).await;
    drop(store);

    let _gw = GatewayProcess::start(&text);
    publish(&redis, r#"{"messageId": "m-1", "order": "o-1", "n": 10}"#);
    wait_all_acked(&redis, 1).await;
    wait_metric(admin, "deduplicated", 1.0).await;
    assert!(applied(&up).is_empty(), "not applied again");
    publish(&redis, r#"{"messageId": "m-2", "order": "o-2", "n": 10}"#);
    publish(
        &redis,
        r#"{"messageId": "m-3", "order": "o-2", "n": "1e1"}"#,
    );
    wait_all_acked(&redis, 3).await;
    // In either order: the consumer handles messages concurrently.
    let mut both = applied(&up);
    both.sort();
    assert_eq!(both, vec!["m-2", "m-3"], "a number and a string");
}
