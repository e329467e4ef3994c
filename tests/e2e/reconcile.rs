//! Reconciliation with an upstream that can answer "did K happen?" (`reconcile` on a route): a
//! request the upstream executed but whose answer never came back replays the looked-up result;
//! one it never executed (404) is released and runs once; a lookup that fails leaves it unknown;
//! a gateway killed mid-flight reconciles after its restart. In the background too: without any
//! retry, each unknown outcome is settled once `after` has passed, a failing lookup is asked a
//! bounded number of times, and what a killed gateway left is found by the sweep after the
//! restart.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::*;

/// An upstream whose first POST of each key never answers (it "executes" it, but the answer is
/// lost), and whose lookup `GET /payments/by-key/{key}` answers by the key's prefix: `paid-`
/// found (200), `none-` not found (404), anything else 500.
async fn upstream() -> Upstream {
    let first_seen = Arc::new(Mutex::new(HashSet::new()));
    Upstream::start(move |seen, _| {
        if let Some(key) = seen.path_and_query.strip_prefix("/payments/by-key/") {
            return match key {
                k if k.starts_with("paid-") => {
                    Reply::json(200, &format!("{{\"payment\":\"pay_{k}\"}}"))
                }
                k if k.starts_with("none-") => Reply::json(404, "{}"),
                _ => Reply::json(500, "{}"),
            };
        }
        let key = seen.headers["idempotency-key"]
            .to_str()
            .unwrap()
            .to_string();
        if first_seen.lock().unwrap().insert(key) {
            Reply::Hang
        } else {
            Reply::json(201, "{\"payment\":\"executed by the retry\"}")
        }
    })
    .await
}

fn route(up: &Upstream) -> String {
    format!(
        "[[routes]]\nname = \"payments\"\npath = \"/payments\"\nmethods = [\"POST\"]\nupstream_timeout = \"500ms\"\nlock_timeout = \"1s\"\nwait = \"0s\"\nreconcile = {{ url = \"{}/payments/by-key/{{key}}\", after = \"300ms\" }}\n",
        up.url()
    )
}

/// POSTs of `key` the upstream received (lookups aside).
fn posts(up: &Upstream, key: &str) -> usize {
    up.seen()
        .iter()
        .filter(|s| s.method == http::Method::POST)
        .filter(|s| s.headers["idempotency-key"] == key)
        .count()
}

/// The gateway in front of `up` with the reconciling route, on the disk store in `dir`.
fn on_disk(up: &Upstream, dir: &TempDir) -> TomlConfig {
    TomlConfig::parse(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nurl = \"{}\"\n{}",
        up.url(),
        route(up)
    ))
    .set("store.backend", "disk")
    .set("store.path", dir.path.display().to_string())
}

/// Lookups of `key` the upstream received.
fn lookups(up: &Upstream, key: &str) -> usize {
    let path = format!("/payments/by-key/{key}");
    up.seen()
        .iter()
        .filter(|s| s.path_and_query == path)
        .count()
}

/// The `idemgate_reconciliations_total` count for `result` on the admin listener at `admin`.
async fn reconciliations(admin: std::net::SocketAddr, result: &str) -> f64 {
    let m = scrape(admin).await;
    m.get(&format!(
        "idemgate_reconciliations_total{{result=\"{result}\"}}"
    ))
    .copied()
    .unwrap_or(0.0)
}

/// Whether `got` is the `outcome-unknown` problem.
fn unknown(got: &Got) -> bool {
    got.header("content-type") == Some("application/problem+json")
        && got.problem_type() == "outcome-unknown"
}

/// Retries `key` until the answer is no longer `outcome-unknown` (bounded): the lookup is made
/// only once `after` has passed.
async fn retried(http: &Http, key: &str) -> Got {
    for _ in 0..100 {
        let got = http.post("/payments", key, "{}").await;
        if !unknown(&got) {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{key} stayed unknown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_outcomes_are_settled_by_the_upstreams_lookup() {
    let up = upstream().await;
    let gw = Running::start(config(&up.url(), &route(&up)).with_admin())
        .await
        .unwrap();
    let http = Http::new(gw.addr());

    // Executed, the answer lost: the retry gets the looked-up payment, executed once.
    let first = http.post("/payments", "paid-1", "{}").await;
    assert_eq!(first.problem_type(), "outcome-unknown", "{first:?}");
    let early = http.post("/payments", "paid-1", "{}").await;
    assert_eq!(
        early.problem_type(),
        "outcome-unknown",
        "no lookup before `after`"
    );
    let settled = retried(&http, "paid-1").await;
    assert_eq!(settled.status, 200, "{settled:?}");
    assert!(settled.is_replay());
    assert_eq!(settled.header("idemgate-reconciled"), Some("true"));
    assert_eq!(settled.body, "{\"payment\":\"pay_paid-1\"}");
    let again = http.post("/payments", "paid-1", "{}").await;
    assert_eq!(again.body, settled.body);
    assert_eq!(posts(&up, "paid-1"), 1, "executed once");

    // Never executed (404): released, and the retry executes it, once.
    assert_eq!(
        http.post("/payments", "none-1", "{}").await.problem_type(),
        "outcome-unknown"
    );
    let ran = retried(&http, "none-1").await;
    assert_eq!(ran.status, 201, "{ran:?}");
    assert!(!ran.is_replay());
    assert!(http.post("/payments", "none-1", "{}").await.is_replay());
    assert_eq!(posts(&up, "none-1"), 2, "the lost call, then the retry");

    // The lookup fails (500): it stays unknown, however often it is asked.
    assert_eq!(
        http.post("/payments", "err-1", "{}").await.problem_type(),
        "outcome-unknown"
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    for _ in 0..3 {
        let got = http.post("/payments", "err-1", "{}").await;
        assert_eq!(got.problem_type(), "outcome-unknown");
    }
    assert_eq!(posts(&up, "err-1"), 1);

    let m = scrape(gw.admin_addr().unwrap()).await;
    let count = |result: &str| {
        m.get(&format!(
            "idemgate_reconciliations_total{{result=\"{result}\"}}"
        ))
        .copied()
        .unwrap_or(0.0)
    };
    assert_eq!((count("reconciled"), count("released")), (1.0, 1.0));
    assert!(count("unknown") >= 3.0, "{}", count("unknown"));
}

/// The gateway is killed while the upstream holds the request; after the restart, once the dead
/// owner's lease and `after` ran out, the retry gets the looked-up result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_killed_mid_flight_is_reconciled_after_its_restart() {
    let up = upstream().await;
    let dir = TempDir::new("reconcile");
    let text = on_disk(&up, &dir).text();
    let gw = GatewayProcess::start(&text);
    let doomed = spawn_post_to_be_killed(&Http::new(gw.addr), "paid-2");
    up.next_arrival().await;
    gw.signal_and_wait("-KILL");
    assert!(doomed.await.unwrap().is_none());
    let gw = GatewayProcess::start(&text);
    let http = Http::new(gw.addr);
    let mut settled = retry_while_in_flight(&http, "paid-2").await;
    for _ in 0..100 {
        if !unknown(&settled) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        settled = retry_while_in_flight(&http, "paid-2").await;
    }
    assert_eq!(settled.status, 200, "{settled:?}");
    assert_eq!(settled.header("idemgate-reconciled"), Some("true"));
    assert_eq!(posts(&up, "paid-2"), 1, "never executed again");
}

/// Nobody retries: the background asks about each unknown outcome once `after` has passed and
/// settles it, and asks a lookup that keeps failing a bounded number of times, then leaves it
/// to the operator.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_outcomes_are_settled_in_the_background_without_a_retry() {
    let up = upstream().await;
    let gw = Running::start(config(&up.url(), &route(&up)).with_admin())
        .await
        .unwrap();
    let (http, admin) = (Http::new(gw.addr()), gw.admin_addr().unwrap());
    for key in ["paid-b", "none-b", "err-b"] {
        let lost = http.post("/payments", key, "{}").await;
        assert_eq!(lost.problem_type(), "outcome-unknown", "{lost:?}");
    }
    let settled = eventually_within(Duration::from_secs(30), || async {
        reconciliations(admin, "reconciled").await == 1.0
            && reconciliations(admin, "released").await == 1.0
            && reconciliations(admin, "gave_up").await == 1.0
    })
    .await;
    assert!(settled, "{:?}", scrape(admin).await);
    assert_eq!(lookups(&up, "paid-b"), 1);
    assert_eq!(lookups(&up, "none-b"), 1);
    assert_eq!(
        lookups(&up, "err-b"),
        5,
        "a failing lookup is asked a bounded number of times"
    );
    // What the retries find: the looked-up payment, without asking again; a released key,
    // executed once; still unknown.
    let paid = http.post("/payments", "paid-b", "{}").await;
    assert!(paid.is_replay(), "{paid:?}");
    assert_eq!(paid.header("idemgate-reconciled"), Some("true"));
    assert_eq!(lookups(&up, "paid-b"), 1);
    assert_eq!(http.post("/payments", "none-b", "{}").await.status, 201);
    assert_eq!(posts(&up, "none-b"), 2, "the lost call, then the retry");
    assert!(unknown(&http.post("/payments", "err-b", "{}").await));
    assert_eq!(posts(&up, "paid-b") + posts(&up, "err-b"), 2);
}

/// The gateway is killed mid-flight and restarted; nobody retries. The restarted gateway's
/// sweep finds the record its predecessor left once that lease has run out, and settles it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_killed_gateway_left_is_found_and_settled_by_the_sweep() {
    let up = upstream().await;
    let dir = TempDir::new("reconcile-sweep");
    let admin: std::net::SocketAddr =
        format!("127.0.0.1:{}", crate::support::redis::free_port(false))
            .parse()
            .unwrap();
    let text = on_disk(&up, &dir)
        .set("server.admin", admin.to_string())
        .text();
    let gw = GatewayProcess::start(&text);
    let doomed = spawn_post_to_be_killed(&Http::new(gw.addr), "paid-3");
    up.next_arrival().await;
    gw.signal_and_wait("-KILL");
    assert!(doomed.await.unwrap().is_none());
    let gw = GatewayProcess::start(&text);
    let settled = eventually_within(Duration::from_secs(30), || async {
        reconciliations(admin, "reconciled").await == 1.0
    })
    .await;
    assert!(settled, "{}", gw.drain_logs().join("\n"));
    assert_eq!(lookups(&up, "paid-3"), 1);
    let replay = Http::new(gw.addr).post("/payments", "paid-3", "{}").await;
    assert!(replay.is_replay(), "{replay:?}");
    assert_eq!(replay.body, "{\"payment\":\"pay_paid-3\"}");
    assert_eq!(posts(&up, "paid-3"), 1, "never executed again");
}

/// A consumer's handler call without a complete answer: the background asks the handler's
/// lookup with the message's key and stores what it says; the producer's next copy of the
/// message gets that answer, and the handler is not called again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumers_unknown_outcome_is_settled_in_the_background() {
    let redis = crate::support::redis::RedisServer::start();
    let up = Upstream::start(|seen, n| {
        if seen.path_and_query == "/orders/by-key/m-1" {
            return Reply::json(200, "{\"order\":\"o-1\"}");
        }
        if n == 1 {
            Reply::Hang
        } else {
            Reply::json(201, "{\"handled\":true}")
        }
    })
    .await;
    let text = TomlConfig::parse(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nurl = \"{url}\"\n[[consumers]]\nname = \"orders\"\nsource = {{ redis_stream = \"orders\", group = \"idemgate\" }}\nhandler = \"{url}/orders\"\nkey = {{ json = \"/messageId\" }}\nupstream_timeout = \"500ms\"\nbackoff = \"50ms\"\nreconcile = {{ url = \"{url}/orders/by-key/{{key}}\", after = \"300ms\" }}\n",
        url = up.url()
    ))
    .set("store.backend", "redis")
    .set("store.url", redis.url())
    .text();
    let config = idemgate::config::Config::parse(&text).unwrap().with_admin();
    let gw = Running::start(config).await.unwrap();
    let admin = gw.admin_addr().unwrap();
    let publish = || redis.cli(&["XADD", "orders", "*", "body", r#"{"messageId": "m-1"}"#]);
    publish();
    let settled = eventually_within(Duration::from_secs(30), || async {
        reconciliations(admin, "reconciled").await == 1.0
    })
    .await;
    assert!(settled, "{:?}", scrape(admin).await);
    publish();
    let deduplicated =
        "idemgate_consumer_messages_total{consumer=\"orders\",outcome=\"deduplicated\"}";
    let replayed = eventually_within(Duration::from_secs(20), || async {
        scrape(admin).await.get(deduplicated).copied() == Some(1.0)
    })
    .await;
    assert!(replayed, "{:?}", scrape(admin).await);
    let handled = up
        .seen()
        .iter()
        .filter(|s| s.path_and_query == "/orders")
        .count();
    assert_eq!(handled, 1, "the handler ran once, for the first delivery");
}

/// A storm of retries of one unknown outcome (issue 45): with `max_connections = 4` and a lookup
/// that takes seconds, 300 concurrent retries make one lookup between them and all share its
/// answer, with no log line of their own beyond each request's; a lookup that finds the
/// operation gives every waiting retry its result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_retries_shares_one_lookup() {
    let up = Upstream::start(|seen, _| {
        match seen.path_and_query.strip_prefix("/payments/by-key/") {
            // Slow, and unhealthy: the outcome stays unknown.
            Some(k) if k.starts_with("sick-") => {
                Reply::Delayed(Duration::from_secs(3), Box::new(Reply::json(503, "{}")))
            }
            Some(k) => Reply::Delayed(
                Duration::from_secs(1),
                Box::new(Reply::json(200, &format!("{{\"payment\":\"pay_{k}\"}}"))),
            ),
            // A proxy's 504: the outcome is unknown at once.
            None => Reply::json(504, "{}"),
        }
    })
    .await;
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nurl = \"{0}\"\nmax_connections = 4\n[[routes]]\nname = \"payments\"\npath = \"/payments\"\nmethods = [\"POST\"]\nupstream_timeout = \"5s\"\nwait = \"0s\"\nreconcile = {{ url = \"{0}/payments/by-key/{{key}}\", after = \"200ms\" }}\n",
        up.url()
    );
    let gw = GatewayProcess::start(&text);
    let http = Arc::new(Http::new(gw.addr));

    let storm = |key: &'static str, n: usize| {
        let tasks: Vec<_> = (0..n)
            .map(|_| {
                let http = Arc::clone(&http);
                tokio::spawn(async move { http.post("/payments", key, "{}").await })
            })
            .collect();
        async move {
            let mut got = Vec::new();
            for t in tasks {
                got.push(t.await.unwrap());
            }
            got
        }
    };

    let first = http.post("/payments", "sick-1", "{}").await;
    assert_eq!(first.status, 504, "{first:?}");
    tokio::time::sleep(Duration::from_millis(400)).await;
    gw.drain_logs();
    let answers = storm("sick-1", 300).await;
    assert!(
        answers.iter().all(unknown),
        "every retry is told the outcome is unknown: {:?}",
        answers.iter().find(|g| !unknown(g))
    );
    assert!(
        lookups(&up, "sick-1") <= 2,
        "one lookup shared, not one per retry: {}",
        lookups(&up, "sick-1")
    );
    let own: Vec<String> = (gw.drain_logs().into_iter())
        .filter(|l| !l.contains("idempotent request"))
        .collect();
    assert!(own.len() <= 4, "a line per lookup, not per retry: {own:#?}");

    let first = http.post("/payments", "paid-storm", "{}").await;
    assert_eq!(first.status, 504);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let answers = storm("paid-storm", 50).await;
    assert!(
        answers.iter().all(|g| g.status == 200
            && g.header("idemgate-reconciled") == Some("true")
            && g.body == "{\"payment\":\"pay_paid-storm\"}"),
        "every retry gets the looked-up result: {:?}",
        answers.iter().find(|g| g.status != 200)
    );
    assert_eq!(lookups(&up, "paid-storm"), 1, "one lookup");
    assert_eq!(posts(&up, "paid-storm"), 1, "never executed again");
}

/// An unknown outcome tells SDKs to retry the same key where a lookup will settle it (with
/// `Retry-After` when it is due), and not to retry where only an operator can: no SDK repeats
/// a request into the same answer, none gives up on one a retry would recover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_outcome_hints_a_retry_only_where_a_lookup_will_settle_it() {
    let up = upstream().await;
    let routes = format!(
        "{}[[routes]]\nname = \"plain\"\npath = \"/plain\"\nmethods = [\"POST\"]\nupstream_timeout = \"500ms\"\nwait = \"0s\"\n",
        route(&up)
    );
    let gw = Running::start(config(&up.url(), &routes)).await.unwrap();
    let http = Http::new(gw.addr());
    for got in [
        http.post("/payments", "err-hint", "{}").await,
        http.post("/payments", "err-hint", "{}").await,
    ] {
        assert_eq!(got.problem_type(), "outcome-unknown", "{got:?}");
        assert_eq!(got.header("x-should-retry"), Some("true"), "{got:?}");
        assert_eq!(got.header("retry-after"), Some("1"), "{got:?}");
        assert_eq!(got.header("retry-after-ms"), Some("1000"), "{got:?}");
    }
    for got in [
        http.post("/plain", "plain-hint", "{}").await,
        http.post("/plain", "plain-hint", "{}").await,
    ] {
        assert_eq!(got.problem_type(), "outcome-unknown", "{got:?}");
        assert_eq!(got.header("x-should-retry"), Some("false"), "{got:?}");
        assert_eq!(got.header("retry-after"), None, "{got:?}");
    }
}
