//! Official SDKs as the gateway's clients: stripe-python, a Stainless-generated SDK
//! (modern-treasury) and gocardless-pro, each driven by `tests/sdk/call.py` as an application
//! would, against the real gateway and an upstream that speaks its create call. What is tested
//! is what each SDK does with the gateway's answers: its retry rules against the retry hints,
//! its error parser against the route's `error_body`. The SDKs come from the virtualenv
//! `scripts/test` makes (`IDEMGATE_SDK_PYTHON`, pinned in `tests/sdk/requirements.txt`).

use std::collections::HashMap;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::support::redis::RedisServer;
use crate::support::relay::Relay;
use crate::support::*;

/// Stripe's envelope: `IdempotencyError` for a 400 of type `idempotency_error`.
const STRIPE: &str = r#"
[[routes]]
name = "customers"
path = "/v1/customers"
methods = ["POST"]
wait = "100ms"
mismatch_status = 400
retry_hint_headers = ["x-should-retry", "stripe-should-retry"]
error_body = { template = '{"error": {"type": "idempotency_error", "code": "{code}", "message": "{detail}", "doc_url": "{type}"}}' }
"#;

/// A Stainless-generated SDK reads the built-in answers: hints and problem+json as they are.
const MODERN_TREASURY: &str = r#"
[[routes]]
name = "customers"
path = "/api/counterparties"
methods = ["POST"]
wait = "100ms"
"#;

/// GoCardless's envelope: `InvalidStateError` for type `invalid_state` (with no
/// `idempotent_creation_conflict` reason, which would make the SDK fetch a resource by id).
const GOCARDLESS: &str = r#"
[[routes]]
name = "customers"
path = "/customers"
methods = ["POST"]
error_body = { template = '{"error": {"type": "invalid_state", "code": {status}, "message": "{detail}", "documentation_url": "{type}", "request_id": "", "errors": [{"reason": "{code}", "message": "{title}"}]}}' }
"#;

#[derive(Clone, Copy)]
struct Sdk {
    name: &'static str,
    routes: &'static str,
    /// The id the upstream gives its first object.
    first_id: &'static str,
    /// The SDK's error for a key reused with other parameters.
    reused_error: &'static str,
}

const SDKS: [Sdk; 3] = [
    Sdk {
        name: "stripe",
        routes: STRIPE,
        first_id: "cus_1",
        reused_error: "IdempotencyError",
    },
    Sdk {
        name: "moderntreasury",
        routes: MODERN_TREASURY,
        first_id: "cp_1",
        reused_error: "ConflictError",
    },
    Sdk {
        name: "gocardless",
        routes: GOCARDLESS,
        first_id: "CU1",
        reused_error: "InvalidStateError",
    },
];

fn sdk(name: &str) -> Sdk {
    SDKS.into_iter().find(|s| s.name == name).unwrap()
}

/// The virtualenv's interpreter, or a failure that says how to get one.
fn python() -> String {
    match std::env::var("IDEMGATE_SDK_PYTHON") {
        Ok(p) if std::path::Path::new(&p).exists() => p,
        _ => panic!(
            "IDEMGATE_SDK_PYTHON is not set to a Python with the SDKs: run scripts/test, which makes the virtualenv, or: python3 -m venv /tmp/sdk && /tmp/sdk/bin/pip install -r tests/sdk/requirements.txt && export IDEMGATE_SDK_PYTHON=/tmp/sdk/bin/python"
        ),
    }
}

/// What the upstream does with its first execution.
#[derive(Clone, Copy)]
enum First {
    Answer,
    /// Answers after this long.
    Delay(Duration),
    /// Reads the request and closes the connection: the outcome is unknown.
    Reset,
}

/// An upstream that speaks the three create calls, numbering its objects.
async fn upstream(first: First) -> Upstream {
    Upstream::start(move |seen, n| {
        let reply = match seen.path_and_query.as_str() {
            "/v1/customers" => Reply::json(
                200,
                &format!(
                    r#"{{"id": "cus_{n}", "object": "customer", "email": "buyer@example.com"}}"#
                ),
            ),
            "/api/counterparties" => Reply::json(
                200,
                &format!(r#"{{"id": "cp_{n}", "object": "counterparty", "name": "Buyer"}}"#),
            ),
            "/customers" => Reply::json(
                201,
                &format!(r#"{{"customers": {{"id": "CU{n}", "email": "buyer@example.com"}}}}"#),
            ),
            _ => Reply::json(404, "{}"),
        };
        match (n, first) {
            (1, First::Delay(wait)) => Reply::Delayed(wait, Box::new(reply)),
            (1, First::Reset) => Reply::Reset,
            _ => reply,
        }
    })
    .await
}

/// The SDK's run of one scenario: its results, once it printed them.
struct Run {
    child: tokio::process::Child,
    lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
}

impl Run {
    fn start(sdk: Sdk, scenario: &str, base: &str) -> Run {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/sdk/call.py");
        let mut child = tokio::process::Command::new(python())
            .args([script, sdk.name, scenario, base])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        Run { child, lines }
    }

    /// The next JSON line it prints, within a minute.
    async fn line(&mut self) -> Value {
        let line = tokio::time::timeout(Duration::from_secs(60), self.lines.next_line())
            .await
            .expect("the SDK script printed nothing for a minute")
            .unwrap()
            .expect("the SDK script ended without a result (its stderr is above)");
        serde_json::from_str(&line).unwrap()
    }

    async fn results(mut self) -> Vec<Value> {
        let out = self.line().await;
        let _ = self.child.wait().await;
        out["results"].as_array().unwrap().clone()
    }

    /// Lets an `again` run make its second call.
    async fn go_on(&mut self) {
        let stdin = self.child.stdin.as_mut().unwrap();
        stdin.write_all(b"\n").await.unwrap();
        stdin.flush().await.unwrap();
    }
}

/// The gateway's requests on the route, by outcome.
async fn outcomes(admin: std::net::SocketAddr) -> HashMap<String, f64> {
    let prefix = "idemgate_requests_total{route=\"customers\",outcome=\"";
    scrape(admin)
        .await
        .into_iter()
        .filter_map(|(k, v)| {
            Some((
                k.strip_prefix(prefix)?.trim_end_matches("\"}").to_string(),
                v,
            ))
        })
        .collect()
}

async fn gateway_for(sdk: Sdk, up: &Upstream) -> Running {
    Running::start(config(&up.url(), sdk.routes).with_admin())
        .await
        .unwrap()
}

fn id(result: &Value) -> &str {
    result["id"]
        .as_str()
        .unwrap_or_else(|| panic!("the SDK raised: {result}"))
}

async fn key_reused(sdk: Sdk) {
    let up = upstream(First::Answer).await;
    let gw = gateway_for(sdk, &up).await;
    let base = format!("http://{}", gw.addr());
    let results = Run::start(sdk, "reused", &base).results().await;
    assert_eq!(id(&results[0]), sdk.first_id);
    assert_eq!(
        results[1]["error"], sdk.reused_error,
        "{}: the SDK's own typed error: {}",
        sdk.name, results[1]
    );
    let seen = outcomes(gw.admin_addr().unwrap()).await;
    assert_eq!(seen.get("mismatch"), Some(&1.0), "{seen:?}");
    assert_eq!(
        seen.values().sum::<f64>(),
        2.0,
        "{}: the refused call is one request, never retried: {seen:?}",
        sdk.name
    );
    assert_eq!(up.executions(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripe_a_reused_key_is_one_request_and_an_idempotency_error() {
    key_reused(sdk("stripe")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stainless_a_reused_key_is_one_request_and_a_conflict_error() {
    key_reused(sdk("moderntreasury")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gocardless_a_reused_key_is_one_request_and_an_invalid_state_error() {
    key_reused(sdk("gocardless")).await;
}

/// The create reached the upstream and its outcome is unknown (no `reconcile`): answered `502
/// outcome-unknown` with `false`, which the SDK raises at once instead of retrying a 5xx
/// into the same answer five more times.
async fn outcome_unknown(sdk: Sdk, error: &str) {
    let up = upstream(First::Reset).await;
    let gw = gateway_for(sdk, &up).await;
    let base = format!("http://{}", gw.addr());
    let results = Run::start(sdk, "once", &base).results().await;
    assert_eq!(results[0]["error"], error, "{}", results[0]);
    assert_eq!(results[0]["status"], 502, "{}", results[0]);
    let seen = outcomes(gw.admin_addr().unwrap()).await;
    assert_eq!(
        seen.values().sum::<f64>(),
        1.0,
        "{}: one request, not retried: {seen:?}",
        sdk.name
    );
    assert_eq!(up.executions(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripe_does_not_retry_an_unknown_outcome() {
    outcome_unknown(sdk("stripe"), "APIError").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stainless_does_not_retry_an_unknown_outcome() {
    outcome_unknown(sdk("moderntreasury"), "InternalServerError").await;
}

/// Two calls with one key at once: the second, refused `409 in-flight` with `true` and
/// `Retry-After`, is retried by the SDK itself until it gets the first's object.
async fn duplicate_in_flight(sdk: Sdk) {
    // 2 s: the duplicate's tries (0.3 s, then about every second) are not due just as it
    // answers.
    let up = upstream(First::Delay(Duration::from_secs(2))).await;
    let gw = gateway_for(sdk, &up).await;
    let base = format!("http://{}", gw.addr());
    let results = Run::start(sdk, "concurrent", &base).results().await;
    assert_eq!(id(&results[0]), sdk.first_id);
    assert_eq!(id(&results[1]), sdk.first_id, "the original's object");
    let seen = outcomes(gw.admin_addr().unwrap()).await;
    assert!(
        seen.get("in_flight_rejected").copied().unwrap_or(0.0) >= 1.0,
        "{seen:?}"
    );
    // The SDK's last try finds the result stored, or waits for it.
    let count = |outcome: &str| seen.get(outcome).copied().unwrap_or(0.0);
    assert_eq!(
        count("replayed") + count("waited"),
        1.0,
        "retried by the SDK: {seen:?}"
    );
    assert_eq!(up.executions(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripe_retries_a_duplicate_in_flight_into_the_original_s_object() {
    duplicate_in_flight(sdk("stripe")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stainless_retries_a_duplicate_in_flight_into_the_original_s_object() {
    duplicate_in_flight(sdk("moderntreasury")).await;
}

/// gocardless-pro retries no status, only timeouts: its retry after its own 1 s timeout is the
/// duplicate, and waits in the gateway for the original (2 s) to answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gocardless_s_retry_after_a_timeout_waits_for_the_original() {
    let sdk = sdk("gocardless");
    let up = upstream(First::Delay(Duration::from_secs(2))).await;
    let gw = gateway_for(sdk, &up).await;
    let base = format!("http://{}", gw.addr());
    let results = Run::start(sdk, "timeout", &base).results().await;
    assert_eq!(id(&results[0]), sdk.first_id);
    let seen = outcomes(gw.admin_addr().unwrap()).await;
    assert!(
        seen.get("waited").copied().unwrap_or(0.0) >= 1.0,
        "{seen:?}"
    );
    assert_eq!(up.executions(), 1);
}

/// The gateway answered and the answer was lost on the way back (the relay cuts the
/// connection as its first bytes arrive): the SDK's retry gets the same object, replayed.
async fn answer_lost(sdk: Sdk) {
    let up = upstream(First::Answer).await;
    let gw = gateway_for(sdk, &up).await;
    let relay = Relay::start(gw.addr().port()).await;
    relay.cut_next_answer();
    let base = format!("http://127.0.0.1:{}", relay.port);
    let results = Run::start(sdk, "once", &base).results().await;
    assert!(relay.answer_cut(), "the first answer was lost");
    assert_eq!(id(&results[0]), sdk.first_id);
    let seen = outcomes(gw.admin_addr().unwrap()).await;
    assert_eq!(seen.get("executed"), Some(&1.0), "{seen:?}");
    assert_eq!(seen.get("replayed"), Some(&1.0), "{seen:?}");
    assert_eq!(up.executions(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripe_recovers_a_lost_answer_by_replay() {
    answer_lost(sdk("stripe")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stainless_recovers_a_lost_answer_by_replay() {
    answer_lost(sdk("moderntreasury")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gocardless_recovers_a_lost_answer_by_replay() {
    answer_lost(sdk("gocardless")).await;
}

/// The gateway on a Redis store that is down when the call comes, and back a moment later.
async fn store_down(sdk: Sdk, scenario: &str) -> (Vec<Value>, HashMap<String, f64>, Upstream) {
    let mut redis = RedisServer::start();
    let up = upstream(First::Answer).await;
    let text = format!(
        "[store]\nbackend = \"redis\"\nurl = \"{}\"\ncommand_timeout = \"1s\"\n{}",
        redis.url(),
        sdk.routes
    );
    let gw = Running::start(config(&up.url(), &text).with_admin())
        .await
        .unwrap();
    let admin = gw.admin_addr().unwrap();
    redis.kill();
    let base = format!("http://{}", gw.addr());
    let mut run = Run::start(sdk, scenario, &base);
    let refused = eventually(|| async {
        outcomes(admin)
            .await
            .get("store_error")
            .copied()
            .unwrap_or(0.0)
            >= 1.0
    })
    .await;
    assert!(refused, "the first try met the store down");
    redis.restart();
    if scenario == "again" {
        let waiting = run.line().await;
        assert_eq!(waiting["waiting"]["status"], 503, "{waiting}");
        let ready = eventually(|| async { admin_get(admin, "/readyz").await.0 == 200 }).await;
        assert!(ready, "the store is back");
        run.go_on().await;
    }
    let results = run.results().await;
    (results, outcomes(admin).await, up)
}

/// Refused `503 store-unavailable` with `true` and `Retry-After`, the SDK retries by itself
/// until the store is back; the create runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripe_retries_through_a_store_outage() {
    let sdk = sdk("stripe");
    let (results, seen, up) = store_down(sdk, "once").await;
    assert_eq!(id(&results[0]), sdk.first_id, "{seen:?}");
    assert_eq!(seen.get("executed"), Some(&1.0), "{seen:?}");
    assert_eq!(up.executions(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stainless_retries_through_a_store_outage_paced_by_retry_after() {
    let sdk = sdk("moderntreasury");
    let (results, seen, up) = store_down(sdk, "once").await;
    assert_eq!(id(&results[0]), sdk.first_id, "{seen:?}");
    assert_eq!(seen.get("executed"), Some(&1.0), "{seen:?}");
    assert_eq!(up.executions(), 1);
}

/// gocardless-pro does not retry a status: it raises the envelope's error, and the
/// application's own retry with the same key runs the create once the store is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gocardless_raises_a_store_outage_and_its_retry_runs_once() {
    let sdk = sdk("gocardless");
    let (results, seen, up) = store_down(sdk, "again").await;
    assert_eq!(results[0]["error"], "InvalidStateError", "{}", results[0]);
    assert_eq!(id(&results[1]), sdk.first_id, "{seen:?}");
    assert_eq!(seen.get("executed"), Some(&1.0), "{seen:?}");
    assert_eq!(up.executions(), 1);
}

/// The envelope and hints of `[defaults]` reach every answer the gateway makes itself, on the
/// routes and outside them (a guarded path, an unreachable upstream for pass-through traffic),
/// and a route's own settings take their place on its answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_answer_the_gateway_makes_is_in_the_configured_envelope() {
    let closed = closed_port().await;
    let text = r#"
[defaults]
retry_hint_headers = ["x-should-retry", "stripe-should-retry"]
error_body = { template = '{"error": {"type": "idempotency_error", "code": "{code}", "message": "{detail}"}}' }
[[routes]]
name = "hooks"
path = "/hooks"
methods = ["POST"]
require_client = true
error_body = { template = '{"errors": [{"code": "{code}"}]}' }
[[routes]]
name = "quiet"
path = "/quiet"
methods = ["POST"]
retry_hint_headers = []
"#;
    let gw = Running::start(config(&format!("http://{closed}"), text))
        .await
        .unwrap();
    let http = Http::new(gw.addr());
    let envelope = |got: &Got| -> String {
        assert_eq!(
            got.header("content-type"),
            Some("application/json"),
            "{got:?}"
        );
        let v: Value = serde_json::from_slice(&got.body).unwrap();
        assert_eq!(v["error"]["type"], "idempotency_error");
        v["error"]["code"].as_str().unwrap().to_string()
    };
    // A refusal about a route's path is in that route's envelope, with the hints it inherits.
    let guarded = http.request("DELETE", "/hooks").send().await;
    assert_eq!(guarded.status, 405);
    let v: Value = serde_json::from_slice(&guarded.body).unwrap();
    assert_eq!(v["errors"][0]["code"], "method-not-allowed", "{guarded:?}");
    assert_eq!(guarded.header("stripe-should-retry"), Some("false"));
    let unrouted = http.post("/elsewhere", "k1", "{}").await;
    assert_eq!(unrouted.status, 502);
    assert_eq!(envelope(&unrouted), "upstream-unreachable");
    assert_eq!(unrouted.header("stripe-should-retry"), Some("true"));
    assert_eq!(unrouted.header("retry-after"), Some("1"));
    let quiet = http.request("POST", "/quiet").json("{}").send().await;
    assert_eq!(quiet.status, 400);
    assert_eq!(envelope(&quiet), "missing-key");
    assert_eq!(
        quiet.header("x-should-retry"),
        None,
        "no hints on this route"
    );
    assert_eq!(quiet.header("stripe-should-retry"), None);
}
