//! `[[consumers]]` on a real Kafka-protocol broker (`tansu`, its own on a free port), the real
//! binary and a real handler: produced twice, applied once (keyed by the Kafka key); 300
//! messages with duplicates over four partitions; a message without its key dead-lettered with
//! its reason; 503s retried up to `max_attempts`, then dead-lettered; `kill -9` mid-handler and
//! a restart; two instances in one group, the second joining while the first has messages in
//! flight (a rebalance), 1,000 messages with duplicates exactly once. At the end of each test,
//! with the gateway stopped, the group has committed every partition to its end: nothing was left
//! unfinished.

use super::*;
use crate::support::kafka::{Kafka, Record};
use crate::support::kafka_raw::{produce_raw, RawRecord};
use crate::support::redis::free_port;
use crate::support::relay::Relay;
use crate::support::Semaphore;
use crate::support::TempDir;

const TOPIC: &str = "orders";
const DEAD: &str = "orders.dead";
const GROUP: &str = "idemgate";

/// The source, with librdkafka `options` (a TOML inline table's inside).
fn source(kafka: &Kafka, options: &str) -> String {
    format!(
        "{{ kafka_topic = \"{TOPIC}\", brokers = [\"{}\"], group = \"{GROUP}\", dead_letter = \"{DEAD}\", options = {{ {options} }} }}",
        kafka.brokers()
    )
}

fn disk(dir: &TempDir) -> String {
    format!("backend = \"disk\"\npath = \"{}\"", dir.path.display())
}

/// A gateway on the disk store in `dir`, with one consumer of [`TOPIC`] keyed by `key`.
fn config(
    kafka: &Kafka,
    dir: &TempDir,
    handler: &str,
    admin: SocketAddr,
    (key, extra): (&str, &str),
) -> String {
    keyed_config(&disk(dir), &source(kafka, ""), handler, admin, key, extra)
}

const BY_JSON: &str = r#"{ json = "/messageId" }"#;

/// A broker with the topic read (`partitions` of them) and the dead-letter topic.
async fn broker(partitions: i32) -> Kafka {
    let kafka = Kafka::start().await;
    kafka.create_topic(TOPIC, partitions).await;
    kafka.create_topic(DEAD, 1).await;
    kafka
}

fn message(id: &str, extra: &str) -> Record {
    Record {
        key: Some(format!("key-{id}")),
        value: format!(r#"{{"messageId": "{id}"{extra}}}"#),
        headers: vec![("source".into(), "test".into())],
    }
}

/// Stops the gateway and checks that the group committed every partition to its end.
async fn nothing_left(kafka: &Kafka, gw: GatewayProcess) {
    assert!(gw.signal_and_wait("-TERM").success());
    if let Err(e) = kafka.all_committed(TOPIC, GROUP) {
        panic!("messages left uncommitted: {e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_produced_twice_is_applied_once_keyed_by_its_kafka_key() {
    let kafka = broker(3).await;
    let dir = TempDir::new("kafka-once");
    let up = Upstream::counting().await;
    let admin = free_addr();
    let key = r#"{ field = "kafka-key" }"#;
    let gw = GatewayProcess::start(&config(&kafka, &dir, &up.url(), admin, (key, "")));
    let m = message("r-1", r#", "amount": 5"#);
    kafka.produce(TOPIC, &[m.clone(), m]).await;
    wait_metric(admin, "delivered", 1.0).await;
    wait_metric(admin, "deduplicated", 1.0).await;
    assert_eq!(applied(&up), vec!["r-1"]);
    let seen = &up.seen()[0];
    assert_eq!(seen.headers["idempotency-key"], "key-r-1", "the Kafka key");
    assert_eq!(seen.headers["source"], "test", "the message's headers");
    assert_eq!(admin_get(admin, "/readyz").await.0, 200);
    nothing_left(&kafka, gw).await;
    // A dead letter is produced before its original is committed: none can come later.
    let dead = kafka.read_for(DEAD, 1, Duration::from_secs(2)).await;
    assert!(dead.is_empty(), "{dead:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hundred_messages_with_duplicates_are_each_applied_once() {
    let kafka = broker(4).await;
    let dir = TempDir::new("kafka-300");
    let up = Upstream::counting().await;
    let admin = free_addr();
    let cfg = config(
        &kafka,
        &dir,
        &up.url(),
        admin,
        (BY_JSON, "concurrency = 16"),
    );
    let gw = GatewayProcess::start(&cfg);
    // 300 messages; every fifth one produced a second time (20 % duplicates), later.
    let mut batch = Vec::new();
    for i in 0..300 {
        batch.push(message(&format!("b-{i}"), ""));
    }
    for i in (0..300).step_by(5) {
        batch.push(message(&format!("b-{i}"), ""));
    }
    kafka.produce(TOPIC, &batch).await;
    wait_metric(admin, "delivered", 300.0).await;
    wait_metric(admin, "deduplicated", 60.0).await;
    let applied = applied(&up);
    assert_eq!(applied.len(), 300);
    assert_eq!(
        applied.iter().collect::<BTreeSet<_>>().len(),
        300,
        "each once"
    );
    nothing_left(&kafka, gw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_retried_then_dead_lettered_and_a_message_without_its_header_too() {
    let kafka = broker(2).await;
    let dir = TempDir::new("kafka-retry");
    let up = Upstream::start(|seen, _| {
        if String::from_utf8_lossy(&seen.body).contains("poison") {
            Reply::json(503, "{}")
        } else {
            Reply::json(201, "{}")
        }
    })
    .await;
    let admin = free_addr();
    let key = r#"{ field = "order-id" }"#;
    let cfg = config(&kafka, &dir, &up.url(), admin, (key, "max_attempts = 4"));
    let gw = GatewayProcess::start(&cfg);
    let mut poison = message("p-1", r#", "kind": "poison""#);
    poison.headers.push(("order-id".into(), "o-1".into()));
    let keyless = message("none", "");
    let mut fine = message("ok-1", "");
    fine.headers.push(("order-id".into(), "o-2".into()));
    kafka.produce(TOPIC, &[poison, keyless, fine]).await;
    wait_metric(admin, "dead_lettered", 2.0).await;
    wait_metric(admin, "delivered", 1.0).await;
    let mut applied = applied(&up);
    applied.sort();
    assert_eq!(
        applied,
        vec!["ok-1", "p-1", "p-1", "p-1", "p-1"],
        "max_attempts deliveries to the handler"
    );
    let dead = kafka.read(DEAD, 2).await;
    assert_eq!(dead.len(), 2, "{dead:?}");
    let poison = dead.iter().find(|r| r.value.contains("poison")).unwrap();
    let reason = poison.header("idemgate-reason");
    assert!(
        reason.contains("503") && reason.contains("4 attempts"),
        "{reason}"
    );
    assert_eq!(poison.header("idemgate-topic"), TOPIC);
    assert_eq!(poison.header("idemgate-deliveries"), "4");
    let (partition, offset) = (
        poison.header("idemgate-partition"),
        poison.header("idemgate-offset"),
    );
    assert!(
        partition.parse::<i32>().is_ok_and(|p| (0..2).contains(&p))
            && offset.parse::<i64>().is_ok(),
        "where the original was: {partition} {offset}"
    );
    assert_eq!(poison.key.as_deref(), Some("key-p-1"), "the original key");
    assert_eq!(poison.header("order-id"), "o-1", "the original headers");
    let keyless = dead.iter().find(|r| r.value.contains("none")).unwrap();
    assert!(
        keyless.header("idemgate-reason").starts_with("missing-key"),
        "{keyless:?}"
    );
    nothing_left(&kafka, gw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_while_the_handler_works_the_message_is_not_applied_twice() {
    let kafka = broker(1).await;
    let dir = TempDir::new("kafka-kill");
    let (up, gate) = Upstream::gated().await;
    let admin = free_addr();
    // tansu 0.6 forms a group with nothing assigned when a killed member's successor joins
    // before the broker has dropped it: the killed member's session (librdkafka's default 45 s,
    // 6 s here) is waited out before the restart.
    let short_session = source(&kafka, "\"session.timeout.ms\" = \"6000\"");
    let lease = "lock_timeout = \"1s\"";
    let cfg = keyed_config(
        &disk(&dir),
        &short_session,
        &up.url(),
        admin,
        BY_JSON,
        lease,
    );
    let gw = GatewayProcess::start(&cfg);
    kafka
        .produce(TOPIC, &[message("k-1", ""), message("k-2", "")])
        .await;
    // Both calls are under way (a message reserved but not yet sent when the kill comes is as
    // unknown to the next instance as one that was sent, and would never reach the handler).
    up.next_arrival().await;
    up.next_arrival().await;
    gw.signal_and_wait("-KILL");
    gate.add_permits(100);
    tokio::time::sleep(Duration::from_secs(7)).await;
    let gw = GatewayProcess::start(&cfg);
    let done = eventually_within(Duration::from_secs(60), || async {
        metric(admin, "dead_lettered").await
            + metric(admin, "delivered").await
            + metric(admin, "deduplicated").await
            >= 2.0
    })
    .await;
    assert!(done, "{:?}", scrape(admin).await);
    up.assert_at_most_once();
    let dead = kafka.read(DEAD, 1).await;
    assert!(
        dead.iter().any(|r| r.value.contains("\"k-1\"")),
        "the message cut off mid-call is dead-lettered: {dead:?}"
    );
    for r in &dead {
        assert!(
            r.header("idemgate-reason").starts_with("outcome-unknown"),
            "{dead:?}"
        );
    }
    let handled = applied(&up).into_iter().collect::<BTreeSet<_>>();
    assert_eq!(
        handled,
        BTreeSet::from(["k-1".to_string(), "k-2".to_string()])
    );
    nothing_left(&kafka, gw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_instance_joining_mid_stream_takes_partitions_and_nothing_is_applied_twice() {
    let kafka = broker(4).await;
    let redis = RedisServer::start();
    // A handler that takes 50 ms: the first instance is busy with eight messages at any time.
    let up = Upstream::start(|_, _| {
        Reply::Delayed(Duration::from_millis(50), Box::new(Reply::json(201, "{}")))
    })
    .await;
    let (a, b) = (free_addr(), free_addr());
    let on_redis = |admin| {
        gateway_config(
            &redis_store(&redis),
            &source(&kafka, ""),
            &up.url(),
            admin,
            "concurrency = 8",
        )
    };
    let mut batch = Vec::new();
    let mut ids = BTreeSet::new();
    for i in 0..800 {
        let m = message(&format!("bulk-{i}"), &format!(r#", "n": {i}"#));
        if i % 4 == 0 {
            batch.push(m.clone());
        }
        batch.push(m);
        ids.insert(format!("bulk-{i}"));
    }
    let ga = GatewayProcess::start(&on_redis(a));
    kafka.produce(TOPIC, &batch).await;
    let started = eventually_within(Duration::from_secs(30), || async {
        metric(a, "delivered").await >= 8.0
    })
    .await;
    assert!(started, "{:?}", scrape(a).await);
    // The second instance joins: the group rebalances, and the first instance's partitions are
    // revoked under the messages it is handling.
    let gb = GatewayProcess::start(&on_redis(b));
    ga.wait_log("partitions revoked");
    gb.wait_log("partitions assigned");
    let counted = |outcome| async move { metric(a, outcome).await + metric(b, outcome).await };
    let handled = eventually_within(Duration::from_secs(90), || async {
        counted("delivered").await == 800.0 && counted("deduplicated").await >= 200.0
    })
    .await;
    assert!(handled, "{:?} {:?}", scrape(a).await, scrape(b).await);
    let applied = applied(&up);
    assert_eq!(applied.len(), 800, "every message applied once");
    assert_eq!(applied.into_iter().collect::<BTreeSet<_>>(), ids);
    let (da, db) = (metric(a, "delivered").await, metric(b, "delivered").await);
    assert!(da > 0.0 && db > 0.0, "both shared the work: {da} and {db}");
    assert!(ga.signal_and_wait("-TERM").success());
    nothing_left(&kafka, gb).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_fails_until_the_topic_exists() {
    let kafka = Kafka::start().await;
    let dir = TempDir::new("kafka-ready");
    let up = Upstream::counting().await;
    let admin = free_addr();
    let gw = GatewayProcess::start(&config(&kafka, &dir, &up.url(), admin, (BY_JSON, "")));
    // The log says which topic is missing; readiness fails meanwhile.
    gw.wait_log("topic \"orders\" does not exist");
    let unready = eventually_within(Duration::from_secs(20), || async {
        let (status, body) = admin_get(admin, "/readyz").await;
        status == 503 && body.contains("broker unreachable")
    })
    .await;
    assert!(unready, "{:?}", admin_get(admin, "/readyz").await);
    kafka.create_topic(TOPIC, 1).await;
    kafka.create_topic(DEAD, 1).await;
    kafka.produce(TOPIC, &[message("late", "")]).await;
    wait_metric(admin, "delivered", 1.0).await;
    assert_eq!(admin_get(admin, "/readyz").await.0, 200);
    nothing_left(&kafka, gw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_name_that_is_not_utf8_is_dead_lettered_and_the_next_messages_applied() {
    let kafka = broker(1).await;
    let dir = TempDir::new("kafka-utf8");
    let up = Upstream::counting().await;
    let admin = free_addr();
    let gw = GatewayProcess::start(&config(&kafka, &dir, &up.url(), admin, (BY_JSON, "")));
    wait_ready(admin).await;
    // What a Go or C producer can write, and rdkafka's header reader panics on.
    let headers: &[(&[u8], &[u8])] = &[(b"order-id", b"o-9"), (b"\xffname", b"v")];
    let bad = RawRecord {
        key: Some(b"key-bad"),
        value: br#"{"messageId": "bad"}"#,
        headers,
    };
    produce_raw(&kafka.brokers(), TOPIC, 0, &bad).await;
    // Odd but readable: a binary key, an empty header name, a 64 KiB header value.
    let big = vec![b'x'; 64 * 1024];
    let odd_headers: &[(&[u8], &[u8])] = &[(b"", b"empty-name"), (b"big", &big)];
    let odd = RawRecord {
        key: Some(b"\x00\xff\xfe"),
        value: br#"{"messageId": "odd"}"#,
        headers: odd_headers,
    };
    produce_raw(&kafka.brokers(), TOPIC, 0, &odd).await;
    kafka
        .produce(TOPIC, &[message("ok-1", ""), message("ok-2", "")])
        .await;
    wait_metric(admin, "dead_lettered", 1.0).await;
    wait_metric(admin, "delivered", 3.0).await;
    let mut applied = applied(&up);
    applied.sort();
    assert_eq!(
        applied,
        vec!["odd", "ok-1", "ok-2"],
        "the bad one never ran"
    );
    let dead = kafka.read(DEAD, 1).await;
    let reason = dead[0].header("idemgate-reason");
    assert!(
        reason.starts_with("invalid-message") && reason.contains("not UTF-8"),
        "{reason}"
    );
    assert_eq!(dead[0].header("order-id"), "o-9", "the original headers");
    assert_eq!(
        dead[0].header("\u{fffd}name"),
        "v",
        "the bad name, written lossily"
    );
    assert_eq!(
        consumer_series(admin, "idemgate_consumer_restarts_total").await,
        0.0,
        "nothing stopped the consumer"
    );
    assert_eq!(admin_get(admin, "/readyz").await.0, 200);
    nothing_left(&kafka, gw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_the_brokers_do_not_take_is_owed_until_they_do_and_nothing_is_lost() {
    // Every client reaches the broker through a relay the test stalls, as in a partition.
    // (A deleted dead-letter topic would not do: tansu 0.6 still takes records for it.)
    let port = free_port(false);
    let relay = Relay::start(port).await;
    let kafka = Kafka::start_advertised(port, relay.port).await;
    kafka.create_topic(TOPIC, 1).await;
    kafka.create_topic(DEAD, 1).await;
    let dir = TempDir::new("kafka-dead-owed");
    let gate = Arc::new(Semaphore::new(0));
    let g = Arc::clone(&gate);
    let up = Upstream::start(move |seen, _| {
        if String::from_utf8_lossy(&seen.body).contains("poison") {
            Reply::json(503, "{}").gated(&g)
        } else {
            Reply::json(201, "{}")
        }
    })
    .await;
    let admin = free_addr();
    let cfg = config(
        &kafka,
        &dir,
        &up.url(),
        admin,
        (BY_JSON, "max_attempts = 1"),
    );
    let gw = GatewayProcess::start(&cfg);
    wait_ready(admin).await;
    kafka
        .produce(TOPIC, &[message("p-1", r#", "kind": "poison""#)])
        .await;
    up.next_arrival().await;
    // The handler holds the message while the brokers go out of reach; then it fails for good.
    relay.stall();
    gate.add_permits(1);
    let owed = eventually_within(Duration::from_secs(30), || async {
        consumer_series(admin, "idemgate_consumer_dead_letters_owed").await == 1.0
    })
    .await;
    assert!(owed, "the dead letter is owed");
    let (status, body) = admin_get(admin, "/readyz").await;
    assert_eq!(status, 503, "{body}");
    relay.resume();
    kafka.produce(TOPIC, &[message("ok-1", "")]).await;
    wait_metric(admin, "dead_lettered", 1.0).await;
    wait_metric(admin, "delivered", 1.0).await;
    wait_ready(admin).await;
    assert_eq!(
        consumer_series(admin, "idemgate_consumer_dead_letters_owed").await,
        0.0
    );
    let dead = kafka.read(DEAD, 1).await;
    assert!(
        dead[0].header("idemgate-reason").contains("503"),
        "{dead:?}"
    );
    // The offset moved past both: nothing frozen behind the dead letter.
    nothing_left(&kafka, gw).await;
}
