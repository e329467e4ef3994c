//! What a consumer does when the gateway itself fails under it, on a real `redis-server`
//! stream: an answer the store does not take (the message stays unacknowledged, and the handler
//! never runs it twice, even with `on_unknown = "retry"`), and a consumer task killed by an
//! injected panic (started again; a message whose handling panicked is dead-lettered). The panics need the `failpoints` feature, which scripts/test turns on.

use super::*;

/// A stream on `stream` (the broker) and records on `store`, apart, so that pausing the store
/// leaves the broker answering.
fn config_apart(
    stream: &RedisServer,
    store: &RedisServer,
    handler: &str,
    admin: SocketAddr,
    extra: &str,
) -> String {
    let source = format!(
        "{{ redis_stream = \"{STREAM}\", group = \"{GROUP}\", claim_idle = \"1s\", url = \"{}\" }}",
        stream.url()
    );
    let store = format!("{}\ncommand_timeout = \"500ms\"", redis_store(store));
    gateway_config(&store, &source, handler, admin, extra)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_the_store_refuses_is_not_acknowledged_and_never_run_twice() {
    let stream = RedisServer::start();
    let store = RedisServer::start();
    let (up, gate) = Upstream::gated().await;
    let admin = free_addr();
    // on_unknown = "retry" would take an abandoned key over and call the handler again: not
    // for one whose handler is known to have answered.
    let extra = "lock_timeout = \"2s\"\non_unknown = \"retry\"";
    let cfg = config_apart(&stream, &store, &up.url(), admin, extra);
    let _gw = GatewayProcess::start(&cfg);
    wait_ready(admin).await;
    stream.cli(&["XADD", STREAM, "*", "body", r#"{"messageId": "m-1"}"#]);
    up.next_arrival().await;
    // The store stops taking writes while the handler works: its answer cannot be stored.
    store.cli(&["CLIENT", "PAUSE", "4000", "WRITE"]);
    gate.add_permits(1);
    wait_metric(admin, "not_stored", 1.0).await;
    let pending = &groups(&stream, STREAM)[GROUP]["pending"];
    assert_eq!(pending, "1", "not acknowledged");
    // Once the store is back and the lease has run out, the record reads as an unknown
    // outcome: dead-lettered for an operator, never run again.
    wait_metric(admin, "dead_lettered", 1.0).await;
    assert_eq!(up.executions(), 1, "the handler ran it once");
    assert_eq!(metric(admin, "delivered").await, 0.0);
    let dead = dead_letters(&stream);
    assert!(
        dead[0]["idemgate-reason"].starts_with("outcome-unknown"),
        "{dead:?}"
    );
    wait_all_acked(&stream, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_task_killed_by_a_panic_is_started_again_and_applies_the_message_once() {
    if !cfg!(feature = "failpoints") {
        panic!("this test injects panics: run it with `cargo test --features failpoints` (scripts/test does)");
    }
    let redis = RedisServer::start();
    let up = Upstream::counting().await;
    let admin = free_addr();
    // The first read panics (the task dies), then the first message's task: that message is
    // dead-lettered (it cannot stop the consumer again) and the run stops.
    let gw = GatewayProcess::start_with_env(
        &config(&redis, &up.url(), admin, ""),
        &[(
            "FAILPOINTS",
            "consumer-read=1*panic;consumer-handle=1*panic",
        )],
    );
    wait_ready(admin).await;
    let watching = tokio::spawn(async move {
        let mut unready = Vec::new();
        for _ in 0..400 {
            let (status, body) = admin_get(admin, "/readyz").await;
            if status == 503 {
                unready.push(body);
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        unready
    });
    publish(&redis, r#"{"messageId": "m-1"}"#);
    wait_metric(admin, "dead_lettered", 1.0).await;
    publish(&redis, r#"{"messageId": "m-2"}"#);
    wait_metric(admin, "delivered", 1.0).await;
    wait_all_acked(&redis, 2).await;
    assert_eq!(applied(&up), vec!["m-2"], "applied once");
    let dead = dead_letters(&redis);
    assert!(
        dead[0]["idemgate-reason"].starts_with("panicked") && dead[0]["body"].contains("m-1"),
        "{dead:?}"
    );
    assert_eq!(
        consumer_series(admin, "idemgate_consumer_restarts_total").await,
        2.0
    );
    gw.wait_log("consumer stopped; starting it again");
    let unready = watching.await.unwrap();
    assert!(
        unready.iter().any(|b| b.contains("being restarted")),
        "/readyz failed while the task was down: {unready:?}"
    );
    assert_eq!(admin_get(admin, "/readyz").await.0, 200);
}
