//! Scenario 4: a gateway cut from the upstream mid-request, on a route with `reconcile`: the
//! upstream executes, its answer is lost; the key becomes an unknown outcome, which the other
//! gateway (still reaching the upstream) settles by asking the upstream's lookup; healed, the
//! first gateway replays it too. Executed once, never again.

use std::time::{Duration, Instant};

use super::redis::Setup;
use super::Ledger;

/// Posts `key` through `gw` until it gets a 2xx answer (an unknown outcome is retried after
/// a pause, as a client following `Retry-After` would), within `limit`.
async fn until_2xx(ledger: &mut Ledger, gw: std::net::SocketAddr, key: &str, limit: Duration) {
    let started = Instant::now();
    loop {
        if let Some(s) = ledger.post(gw, key).await {
            if (200..300).contains(&s) {
                return;
            }
        }
        assert!(
            started.elapsed() < limit,
            "{key}: no 2xx answer within {limit:?}: {:?}",
            ledger.answers(key)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_answer_lost_between_upstream_and_gateway_is_reconciled_and_runs_once() {
    let s = Setup::start_reconciling().await;
    let mut ledger = Ledger::default();
    let gw1 = s.gw("gw1");
    let first = tokio::spawn(async move {
        let mut ledger = Ledger::default();
        ledger.post(gw1, "cut-from-upstream").await;
        ledger
    });
    // The upstream has the request (and executed it); its answer is held, then lost.
    s.up.next_arrival().await;
    s.net.cut("gw1", "up");
    s.gate.add_permits(1);
    ledger.merge(first.await.unwrap());
    let first_answer = ledger.answers("cut-from-upstream").to_vec();
    assert!(
        matches!(first_answer.as_slice(), [Some(502 | 504)]),
        "the first request's outcome is unknown to the gateway: {first_answer:?}"
    );
    // gw2 reaches the upstream: a retry there has the lookup asked, and gets its answer.
    let started = Instant::now();
    until_2xx(
        &mut ledger,
        s.gw("gw2"),
        "cut-from-upstream",
        Duration::from_secs(30),
    )
    .await;
    let reconciled = started.elapsed();
    // gw1, still cut from the upstream, replays it from the store.
    until_2xx(
        &mut ledger,
        s.gw("gw1"),
        "cut-from-upstream",
        Duration::from_secs(10),
    )
    .await;
    s.net.heal();
    let served = ledger.settle(s.gw("gw1"), Duration::from_secs(30)).await;
    println!(
        "partition 4: the unknown outcome reconciled through gw2 {:.1} s after the first retry",
        reconciled.as_secs_f64()
    );
    s.report(
        "4 (gateway cut from the upstream, reconcile)",
        &ledger,
        served,
    );
    let posts =
        s.up.seen()
            .iter()
            .filter(|seen| seen.method == http::Method::POST)
            .count();
    assert_eq!(posts, 1, "the key executed {posts} times");
    assert!(
        ledger.lost().is_empty(),
        "a 2xx answer was not kept: {:?}",
        ledger.lost_with_answers()
    );
}
