//! Clocks that differ between gateways sharing a store (issue 50): a Redis lease is written by
//! its owner's clock and read by another gateway's. Two real gateway processes on one Redis,
//! the second's clock ahead (`IDEMGATE_TEST_CLOCK_OFFSET_MS`, honoured by test builds only), a
//! retry through it while the first still executes, on a route that takes over abandoned keys
//! (`on_unknown = "retry"`). Within `store.max_clock_skew` the retry waits for the original and
//! replays it; the same skew with `max_clock_skew = "0s"` takes over the live owner's key and
//! executes a second time: the bound docs/lifecycle.md states is the one that holds.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use crate::support::redis::{free_port, RedisServer};
use crate::support::*;

/// The second gateway's clock, ahead of the first's. With `lock_timeout = "1500ms"` a live
/// owner's lease ends at least 1 s after its clock's now (renewed every 500 ms): 3 s ahead is
/// 2 s past it.
const AHEAD_MS: i64 = 3000;

struct Pair {
    _redis: RedisServer,
    up: Upstream,
    gate: Arc<Semaphore>,
    first: GatewayProcess,
    second: GatewayProcess,
    second_admin: std::net::SocketAddr,
}

fn config(redis: &RedisServer, up: &Upstream, admin: std::net::SocketAddr, skew: &str) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin = \"{admin}\"\n\
         [store]\nbackend = \"redis\"\nurl = \"{}\"\nmax_clock_skew = \"{skew}\"\n\
         [upstream]\nurl = \"{}\"\n\
         [[routes]]\nname = \"payments\"\npath = \"/payments\"\nmethods = [\"POST\"]\n\
         lock_timeout = \"1500ms\"\nwait = \"20s\"\nupstream_timeout = \"30s\"\non_unknown = \"retry\"\n",
        redis.url(),
        up.url()
    )
}

fn admin() -> std::net::SocketAddr {
    format!("127.0.0.1:{}", free_port(false)).parse().unwrap()
}

async fn pair(max_clock_skew: &str) -> Pair {
    if !cfg!(feature = "failpoints") {
        panic!("these tests set a gateway's clock ahead: run them with `cargo test --features failpoints` (scripts/test does)");
    }
    let redis = RedisServer::start();
    let (up, gate) = Upstream::gated().await;
    let first = GatewayProcess::start(&config(&redis, &up, admin(), max_clock_skew));
    let second_admin = admin();
    let offset = AHEAD_MS.to_string();
    let second = GatewayProcess::start_with_env(
        &config(&redis, &up, second_admin, max_clock_skew),
        &[("IDEMGATE_TEST_CLOCK_OFFSET_MS", &offset)],
    );
    Pair {
        _redis: redis,
        up,
        gate,
        first,
        second,
        second_admin,
    }
}

/// The original runs through the first gateway, held at the upstream; returns its request.
async fn original(p: &Pair) -> tokio::task::JoinHandle<Got> {
    let http = Http::new(p.first.addr);
    let call =
        tokio::spawn(async move { http.post("/payments", "skewed", "{\"amount\":1}").await });
    p.up.next_arrival().await;
    call
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clock_ahead_within_max_clock_skew_waits_for_the_live_owner() {
    let p = pair("4s").await;
    let first = original(&p).await;
    // Past two renewals of the owner's lease: what the second gateway reads is renewed.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let http = Http::new(p.second.addr);
    let retry =
        tokio::spawn(async move { http.post("/payments", "skewed", "{\"amount\":1}").await });
    let admin = p.second_admin;
    let waiting = || async move {
        scrape(admin)
            .await
            .get("idemgate_waiting_requests")
            .copied()
            == Some(1.0)
    };
    assert!(
        eventually(waiting).await,
        "the retry did not wait for the original"
    );
    p.gate.add_permits(2);
    let (first, retry) = (first.await.unwrap(), retry.await.unwrap());
    assert_eq!(first.status, 201, "{}", first.text());
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert!(retry.is_replay(), "{:?}", retry.headers);
    assert_eq!(retry.body, first.body);
    assert_eq!(p.up.executions(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_skew_without_the_margin_takes_over_a_live_owner() {
    let p = pair("0s").await;
    let first = original(&p).await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let http = Http::new(p.second.addr);
    let retry =
        tokio::spawn(async move { http.post("/payments", "skewed", "{\"amount\":1}").await });
    // The second gateway reads the renewed lease as run out, takes the key over and executes
    // while the original is still held at the upstream.
    p.up.next_arrival().await;
    p.gate.add_permits(2);
    let retry = retry.await.unwrap();
    first.await.unwrap();
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert!(!retry.is_replay());
    assert_eq!(p.up.executions(), 2);
}
