//! `[[consumers]]` on a real RabbitMQ node (Debian's `rabbitmq-server`, its own node on free
//! ports), the real binary and a real handler: published twice, applied once; 300 messages with
//! duplicates; a message without its key dead-lettered with its reason; 503s retried up to
//! `max_attempts`, then dead-lettered; `kill -9` mid-handler and a restart; two instances on one
//! queue; the broker killed and restarted under the gateway. Nothing is left unacknowledged at
//! the end of any test (with the gateway stopped, the queue holds nothing).

use super::*;
use lapin::types::{AMQPValue, LongString};

use crate::support::amqp_raw::publish_raw;
use crate::support::rabbitmq::RabbitMq;
use crate::support::TempDir;

const QUEUE: &str = "orders";
const DEAD: &str = "orders.dead";

fn source(rabbit: &RabbitMq) -> String {
    format!(
        "{{ rabbitmq_queue = \"{QUEUE}\", url = \"{}\", dead_letter = \"{DEAD}\" }}",
        rabbit.url()
    )
}

/// A gateway on the disk store in `dir`, with one consumer of [`QUEUE`] posting to `handler`.
fn config(
    rabbit: &RabbitMq,
    dir: &TempDir,
    handler: &str,
    admin: SocketAddr,
    extra: &str,
) -> String {
    let store = format!("backend = \"disk\"\npath = \"{}\"", dir.path.display());
    gateway_config(&store, &source(rabbit), handler, admin, extra)
}

/// A node with the two queues: a quorum queue to read (it counts deliveries) and the
/// dead-letter queue.
async fn node() -> RabbitMq {
    let rabbit = RabbitMq::start().await;
    rabbit.declare(QUEUE, true).await;
    rabbit.declare(DEAD, true).await;
    rabbit
}

fn message(id: &str, extra: &str) -> (String, Vec<u8>) {
    (
        format!("amqp-{id}"),
        format!(r#"{{"messageId": "{id}"{extra}}}"#).into_bytes(),
    )
}

/// Stops the gateway and checks that the queue holds nothing: every message it was handed was
/// acknowledged (what is not would come back to the queue when its connection closes).
async fn nothing_left(rabbit: &RabbitMq, gw: GatewayProcess) {
    assert!(gw.signal_and_wait("-TERM").success());
    assert_eq!(rabbit.ready(QUEUE).await, 0, "messages left unacknowledged");
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> &'a str {
    headers
        .iter()
        .find(|(n, _)| n == name)
        .map_or("", |(_, v)| v.as_str())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_published_twice_is_applied_once() {
    let rabbit = node().await;
    let dir = TempDir::new("rabbit-once");
    let up = Upstream::counting().await;
    let admin = free_addr();
    let gw = GatewayProcess::start(&config(&rabbit, &dir, &up.url(), admin, ""));
    let m = message("r-1", r#", "amount": 5"#);
    rabbit.publish(QUEUE, &[m.clone(), m]).await;
    wait_metric(admin, "delivered", 1.0).await;
    wait_metric(admin, "deduplicated", 1.0).await;
    assert_eq!(applied(&up), vec!["r-1"]);
    let seen = &up.seen()[0];
    assert_eq!(
        seen.headers["message-id"], "amqp-r-1",
        "the message's properties as headers"
    );
    assert_eq!(seen.headers["idemgate-deliveries"], "1");
    assert_eq!(admin_get(admin, "/readyz").await.0, 200);
    nothing_left(&rabbit, gw).await;
    assert!(rabbit.drain(DEAD).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hundred_messages_with_duplicates_are_each_applied_once() {
    let rabbit = node().await;
    let dir = TempDir::new("rabbit-300");
    let up = Upstream::counting().await;
    let admin = free_addr();
    let gw = GatewayProcess::start(&config(&rabbit, &dir, &up.url(), admin, "concurrency = 16"));
    // 300 messages; every fifth one published a second time (20 % duplicates).
    let mut batch = Vec::new();
    for i in 0..300 {
        let m = message(&format!("b-{i}"), "");
        if i % 5 == 0 {
            batch.push(m.clone());
        }
        batch.push(m);
    }
    rabbit.publish(QUEUE, &batch).await;
    wait_metric(admin, "delivered", 300.0).await;
    wait_metric(admin, "deduplicated", 60.0).await;
    let applied = applied(&up);
    assert_eq!(applied.len(), 300);
    assert_eq!(
        applied.iter().collect::<BTreeSet<_>>().len(),
        300,
        "each once"
    );
    nothing_left(&rabbit, gw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_retried_then_dead_lettered_and_a_keyless_message_too() {
    let rabbit = node().await;
    let dir = TempDir::new("rabbit-retry");
    let up = Upstream::start(|seen, _| {
        if String::from_utf8_lossy(&seen.body).contains("poison") {
            Reply::json(503, "{}")
        } else {
            Reply::json(201, "{}")
        }
    })
    .await;
    let admin = free_addr();
    let gw = GatewayProcess::start(&config(&rabbit, &dir, &up.url(), admin, "max_attempts = 4"));
    let keyless = ("amqp-none".to_string(), br#"{"no": "key"}"#.to_vec());
    rabbit
        .publish(QUEUE, &[message("p-1", r#", "kind": "poison""#), keyless])
        .await;
    wait_metric(admin, "dead_lettered", 2.0).await;
    assert_eq!(
        applied(&up),
        vec!["p-1"; 4],
        "max_attempts deliveries to the handler"
    );
    let dead = rabbit.drain(DEAD).await;
    assert_eq!(dead.len(), 2, "{dead:?}");
    let poison = dead.iter().find(|(b, _)| b.contains("poison")).unwrap();
    let reason = header(&poison.1, "idemgate-reason");
    assert!(
        reason.contains("503") && reason.contains("4 attempts"),
        "{reason}"
    );
    assert_eq!(header(&poison.1, "idemgate-queue"), QUEUE);
    let keyless = dead.iter().find(|(b, _)| b.contains("\"no\"")).unwrap();
    assert!(
        header(&keyless.1, "idemgate-reason").starts_with("missing-key"),
        "{keyless:?}"
    );
    nothing_left(&rabbit, gw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_while_the_handler_works_the_message_is_not_applied_twice() {
    let rabbit = node().await;
    let dir = TempDir::new("rabbit-kill");
    let (up, gate) = Upstream::gated().await;
    let admin = free_addr();
    let cfg = config(&rabbit, &dir, &up.url(), admin, "lock_timeout = \"1s\"");
    let gw = GatewayProcess::start(&cfg);
    rabbit
        .publish(QUEUE, &[message("k-1", ""), message("k-2", "")])
        .await;
    // Both calls are under way (a message reserved but not yet sent when the kill comes is as
    // unknown to the next instance as one that was sent, and would never reach the handler).
    up.next_arrival().await;
    up.next_arrival().await;
    gw.signal_and_wait("-KILL");
    gate.add_permits(100);
    // The broker gives both back when the connection dies; the restarted gateway finds both
    // leases expired mid-call: neither is called again.
    let gw = GatewayProcess::start(&cfg);
    let done = eventually_within(Duration::from_secs(30), || async {
        metric(admin, "dead_lettered").await
            + metric(admin, "delivered").await
            + metric(admin, "deduplicated").await
            >= 2.0
    })
    .await;
    assert!(done, "{:?}", scrape(admin).await);
    up.assert_at_most_once();
    let dead = rabbit.drain(DEAD).await;
    assert!(
        dead.iter().any(|(body, _)| body.contains("\"k-1\"")),
        "the message cut off mid-call is dead-lettered: {dead:?}"
    );
    for (_, headers) in &dead {
        assert!(
            header(headers, "idemgate-reason").starts_with("outcome-unknown"),
            "{dead:?}"
        );
        assert_eq!(
            header(headers, "idemgate-deliveries"),
            "2",
            "the quorum queue's count"
        );
    }
    // Nothing lost: each message reached the handler, once.
    let handled = applied(&up).into_iter().collect::<BTreeSet<_>>();
    assert_eq!(
        handled,
        BTreeSet::from(["k-1".to_string(), "k-2".to_string()])
    );
    nothing_left(&rabbit, gw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_on_one_queue_apply_a_thousand_messages_with_duplicates_exactly_once() {
    let rabbit = node().await;
    let redis = RedisServer::start();
    let up = Upstream::counting().await;
    let (a, b) = (free_addr(), free_addr());
    let [ga, gb] = two_instances(&redis, &source(&rabbit), &up.url(), (a, b));
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
    rabbit.publish(QUEUE, &batch).await;
    let handled = eventually_within(Duration::from_secs(60), || async {
        let n = |admin| async move {
            metric(admin, "delivered").await + metric(admin, "deduplicated").await
        };
        n(a).await + n(b).await == 1000.0
    })
    .await;
    assert!(handled, "{:?} {:?}", scrape(a).await, scrape(b).await);
    applied_once_by_both(&up, &ids, a, b).await;
    assert!(ga.signal_and_wait("-TERM").success());
    nothing_left(&rabbit, gb).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_broker_killed_and_restarted_under_the_gateway_is_read_again() {
    let mut rabbit = node().await;
    let dir = TempDir::new("rabbit-restart");
    let up = Upstream::counting().await;
    let admin = free_addr();
    let gw = GatewayProcess::start(&config(&rabbit, &dir, &up.url(), admin, ""));
    rabbit.publish(QUEUE, &[message("before", "")]).await;
    wait_metric(admin, "delivered", 1.0).await;
    rabbit.restart().await;
    // The gateway connects again by itself; meanwhile readiness said the broker was gone or
    // is back already.
    rabbit
        .publish(QUEUE, &[message("after", ""), message("before", "")])
        .await;
    wait_metric(admin, "delivered", 2.0).await;
    wait_metric(admin, "deduplicated", 1.0).await;
    assert_eq!(applied(&up), vec!["before", "after"]);
    let ready = eventually_within(Duration::from_secs(10), || async {
        admin_get(admin, "/readyz").await.0 == 200
    })
    .await;
    assert!(ready);
    nothing_left(&rabbit, gw).await;
}

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_property_that_is_not_utf8_is_dead_lettered_by_the_delivery_limit_and_the_rest_applied() {
    let rabbit = RabbitMq::start().await;
    rabbit.declare(DEAD, true).await;
    // What the README asks of a queue: a quorum queue whose delivery limit dead-letters a
    // message the consumer cannot read (lapin fails its whole connection on it).
    rabbit
        .declare_with(
            QUEUE,
            &[
                ("x-queue-type", text("quorum")),
                ("x-delivery-limit", AMQPValue::LongInt(2)),
                ("x-dead-letter-exchange", text("")),
                ("x-dead-letter-routing-key", text(DEAD)),
            ],
        )
        .await;
    let dir = TempDir::new("rabbit-utf8");
    let up = Upstream::counting().await;
    let admin = free_addr();
    let gw = GatewayProcess::start(&config(&rabbit, &dir, &up.url(), admin, ""));
    wait_ready(admin).await;
    let published = tokio::time::timeout(
        Duration::from_secs(10),
        publish_raw(
            rabbit.port,
            QUEUE,
            b"\xff\xfeid",
            b"\xffname",
            br#"{"messageId": "bad"}"#,
        ),
    )
    .await;
    assert!(matches!(published, Ok(Ok(()))), "{published:?}");
    rabbit
        .publish(QUEUE, &[message("ok-1", ""), message("ok-2", "")])
        .await;
    wait_metric(admin, "delivered", 2.0).await;
    let mut applied = applied(&up);
    applied.sort();
    assert_eq!(
        applied,
        vec!["ok-1", "ok-2"],
        "each once, the bad one never"
    );
    let dead = eventually_within(Duration::from_secs(30), || async {
        rabbit.ready(DEAD).await == 1
    })
    .await;
    assert!(dead, "the broker dead-lettered the unreadable message");
    gw.wait_log("cannot read");
    wait_ready(admin).await;
    nothing_left(&rabbit, gw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_dead_letter_queue_makes_the_consumer_unready_and_the_message_waits_for_it() {
    let rabbit = RabbitMq::start().await;
    rabbit.declare(QUEUE, true).await;
    rabbit
        .declare_with(
            DEAD,
            &[
                ("x-max-length", AMQPValue::LongInt(1)),
                ("x-overflow", text("reject-publish")),
            ],
        )
        .await;
    rabbit
        .publish(DEAD, &[("filler".to_string(), b"{}".to_vec())])
        .await;
    let dir = TempDir::new("rabbit-dead-full");
    let up = Upstream::counting().await;
    let admin = free_addr();
    let gw = GatewayProcess::start(&config(&rabbit, &dir, &up.url(), admin, ""));
    wait_ready(admin).await;
    let keyless = ("amqp-none".to_string(), br#"{"no": "key"}"#.to_vec());
    rabbit.publish(QUEUE, &[keyless]).await;
    let unready = eventually_within(Duration::from_secs(30), || async {
        let (status, body) = admin_get(admin, "/readyz").await;
        status == 503 && body.contains("dead-letter")
    })
    .await;
    assert!(unready, "{:?}", admin_get(admin, "/readyz").await);
    // Held in one slot while it is owed; the others take the next messages meanwhile.
    rabbit.publish(QUEUE, &[message("ok-1", "")]).await;
    wait_metric(admin, "delivered", 1.0).await;
    assert_eq!(metric(admin, "dead_lettered").await, 0.0);
    let (status, _) = admin_get(admin, "/readyz").await;
    assert_eq!(status, 503, "still owed");
    // Room in the dead-letter queue: the message goes there, and the consumer is ready.
    let filler = rabbit.drain(DEAD).await;
    assert_eq!(filler.len(), 1);
    wait_metric(admin, "dead_lettered", 1.0).await;
    wait_ready(admin).await;
    let dead = rabbit.drain(DEAD).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert!(header(&dead[0].1, "idemgate-reason").starts_with("missing-key"));
    nothing_left(&rabbit, gw).await;
}
