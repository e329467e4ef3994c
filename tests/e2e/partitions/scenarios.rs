//! The scenarios that play the same on Redis and on Postgres (each store's module has a test of
//! each): a reservation's reply lost, a completion cut off, the gateway cut from the upstream
//! with `reconcile`, and a lossy link between a gateway and the primary under load.

use std::time::{Duration, Instant};

use super::cluster::Cluster;
use super::Ledger;

/// Scenario 1: gw1 cut from the primary's replies (its reservations land, their answers are
/// lost) while it reserves 3 new keys, then healed. Each key runs at most once; once served it
/// replays.
pub async fn reply_lost(s: &impl Cluster) {
    let mut ledger = Ledger::default();
    assert_eq!(ledger.post(s.gw("gw1"), "before").await, Some(201));
    s.net().cut_inbound("gw1", s.primary());
    for i in 0..3 {
        ledger.post(s.gw("gw1"), &format!("cut-{i}")).await;
    }
    s.net().heal();
    let served = ledger.settle(s.gw("gw1"), Duration::from_secs(90)).await;
    s.report("1 (reply lost)", &ledger, served);
    s.up().assert_at_most_once();
    assert!(
        ledger.lost().is_empty(),
        "lost: {:?}",
        ledger.lost_with_answers()
    );
}

/// Scenario 1 at the other end of the request: gw1 cut from the primary (what it sends is
/// dropped) from the moment the upstream answers, for 3 s. The client gets the answer; the
/// completion, written again in the background once the link heals, makes the retry through
/// gw2 a replay of it (not a wait for the lease, then `outcome-unknown`). Needs a gated upstream
/// with no permit.
pub async fn completion_cut_off(s: &impl Cluster) {
    let mut ledger = Ledger::default();
    let gw = s.gw("gw1");
    let first = tokio::spawn(async move {
        let mut ledger = Ledger::default();
        ledger.post(gw, "cut-at-completion").await;
        ledger
    });
    s.up().next_arrival().await;
    s.net().cut_inbound(s.primary(), "gw1");
    s.front().gate.add_permits(1);
    ledger.merge(first.await.unwrap());
    assert_eq!(
        ledger.answers("cut-at-completion"),
        [Some(201)],
        "the client gets the upstream's answer, stored or not"
    );
    // Long enough for the gateway to give up on its connection and for its next completion
    // attempt to be cut off too.
    tokio::time::sleep(Duration::from_secs(3)).await;
    s.net().heal();
    let healed = Instant::now();
    ledger.post(s.gw("gw2"), "cut-at-completion").await;
    let served = healed.elapsed();
    s.report("1b (completion cut off)", &ledger, served);
    s.up().assert_at_most_once();
    assert!(
        ledger.lost().is_empty(),
        "not replayed: {:?}",
        ledger.lost_with_answers()
    );
    assert!(
        served < Duration::from_secs(10),
        "the replay waited {served:?}"
    );
}

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

/// Scenario 4: gw1 cut from the upstream mid-request, on a route with `reconcile` (a
/// reconciling set-up): the upstream executes, its answer is lost; the key becomes an unknown
/// outcome, which gw2 (still reaching the upstream) settles by asking the upstream's lookup;
/// gw1, still cut, replays it from the store. Executed once, never again.
pub async fn upstream_cut(s: &impl Cluster) {
    let mut ledger = Ledger::default();
    let gw1 = s.gw("gw1");
    let first = tokio::spawn(async move {
        let mut ledger = Ledger::default();
        ledger.post(gw1, "cut-from-upstream").await;
        ledger
    });
    // The upstream has the request (and executed it); its answer is held, then lost.
    s.up().next_arrival().await;
    s.net().cut("gw1", "up");
    s.front().gate.add_permits(1);
    ledger.merge(first.await.unwrap());
    let first_answer = ledger.answers("cut-from-upstream").to_vec();
    assert!(
        matches!(first_answer.as_slice(), [Some(502 | 504)]),
        "the first request's outcome is unknown to the gateway: {first_answer:?}"
    );
    let started = Instant::now();
    until_2xx(
        &mut ledger,
        s.gw("gw2"),
        "cut-from-upstream",
        Duration::from_secs(30),
    )
    .await;
    let reconciled = started.elapsed();
    until_2xx(
        &mut ledger,
        s.gw("gw1"),
        "cut-from-upstream",
        Duration::from_secs(10),
    )
    .await;
    s.net().heal();
    let served = ledger.settle(s.gw("gw1"), Duration::from_secs(30)).await;
    println!(
        "partition 4 ({}): the unknown outcome reconciled through gw2 {:.1} s after the first retry",
        s.store(),
        reconciled.as_secs_f64()
    );
    s.report(
        "4 (gateway cut from the upstream, reconcile)",
        &ledger,
        served,
    );
    let posts = s
        .up()
        .seen()
        .iter()
        .filter(|seen| seen.method == http::Method::POST)
        .count();
    assert_eq!(posts, 1, "the key executed {posts} times");
    assert!(
        ledger.lost().is_empty(),
        "not kept: {:?}",
        ledger.lost_with_answers()
    );
}

/// Scenario 5: a lossy link between gw1 and the primary under load: 10 % of the packets each
/// way dropped (TCP retransmits them after 200 ms and more: a slow link too), 8 clients at once,
/// each key retried on a 503 or no answer.
pub async fn lossy_link(s: &impl Cluster) {
    s.net().lossy("gw1", s.primary(), 0.1);
    s.net().lossy(s.primary(), "gw1", 0.1);
    let gw = s.gw("gw1");
    let started = Instant::now();
    let clients: Vec<_> = (0..8)
        .map(|c| {
            tokio::spawn(async move {
                let mut ledger = Ledger::default();
                for i in 0..10 {
                    let key = format!("lossy-{c}-{i}");
                    // A client retries a 503 or a request that got no answer, twice.
                    for _ in 0..3 {
                        match ledger.post(gw, &key).await {
                            Some(s) if s != 503 => break,
                            _ => {}
                        }
                    }
                }
                ledger
            })
        })
        .collect();
    let mut ledger = Ledger::default();
    for c in clients {
        ledger.merge(c.await.unwrap());
    }
    let under_load = started.elapsed();
    s.net().heal();
    let served = ledger.settle(gw, Duration::from_secs(90)).await;
    println!(
        "partition 5 ({}): 80 keys from 8 clients through the lossy link (10 % each way) in {:.1} s",
        s.store(),
        under_load.as_secs_f64()
    );
    s.report("5 (lossy link)", &ledger, served);
    s.up().assert_at_most_once();
    // This scenario found a completion whose write got no answer left pending (its retries
    // waited out the lease, then got `outcome-unknown`): now written again in the background.
    assert!(
        ledger.lost().is_empty(),
        "lost: {:?}",
        ledger.lost_with_answers()
    );
}
