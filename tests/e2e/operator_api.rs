//! The operator API (`/keys` on the admin listener) through the real binary while it runs:
//! unknown outcomes left by a gateway killed mid-flight, listed by the keys the client sent
//! (`GET /keys?state=unknown`, and `idemgate keys list`), resolved (PUT: retries replay that) or
//! released (DELETE: the next retry executes once); a live request refused unless forced; no
//! token or a wrong one refused with nothing changed; the token never in the log. On the disk
//! store (held by the running gateway, so `idemgate keys` cannot open it) and on Redis.

use std::net::SocketAddr;

use idemgate::config::Config;

use crate::support::redis::{free_port, RedisServer};
use crate::support::*;

const TOKEN: &str = "op-token-7c1b9e4d2f0a8e6b5c3d";

/// A config on `store` (its `[store]` lines) with the admin listener at `admin`, the token in
/// a file in `dir`, and a payments route whose leases run out in 1 s.
fn config_text(upstream: &str, store: &str, admin: SocketAddr, dir: &TempDir) -> String {
    let token_file = dir.path.join("admin-token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    TomlConfig::parse(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[store]\n{store}\n[upstream]\nurl = \"{upstream}\"\n[[routes]]\nname = \"payments\"\npath = \"/payments\"\nlock_timeout = \"1s\"\nwait = \"0s\"\n"
    ))
    .set("server.admin", admin.to_string())
    .set("server.admin_token_file", token_file.display().to_string())
    .text()
}

/// The id of the anonymous client's key `key` on the payments route, as `idemgate keys get`
/// prints it.
fn id(config: &str, key: &str) -> String {
    let config = Config::parse(config).unwrap();
    idemgate::operator::locate(&config, "payments", &[key.to_string()], &Default::default())
        .unwrap()
        .hex()
}

fn keys_request(admin: SocketAddr, method: &str, id: &str, token: Option<&str>) -> Req {
    let req = Http::new(admin).request(method, &format!("/keys/{id}"));
    match token {
        Some(t) => req.header("authorization", &format!("Bearer {t}")),
        None => req,
    }
}

/// Every unknown outcome `GET /keys?{query}` lists, following its cursor page by page; and
/// how many pages that took.
async fn listed(admin: SocketAddr, query: &str) -> (Vec<serde_json::Value>, usize) {
    let (mut found, mut cursor, mut pages) = (Vec::new(), None::<String>, 0);
    loop {
        let path = match &cursor {
            Some(c) => format!("/keys?{query}&cursor={c}"),
            None => format!("/keys?{query}"),
        };
        let got = Http::new(admin)
            .request("GET", &path)
            .header("authorization", &format!("Bearer {TOKEN}"))
            .send()
            .await;
        assert_eq!(got.status, 200, "{}", got.text());
        let page: serde_json::Value = serde_json::from_slice(&got.body).unwrap();
        found.extend(page["keys"].as_array().unwrap().iter().cloned());
        pages += 1;
        assert!(pages < 10_000, "the listing never ended");
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => return (found, pages),
        }
    }
}

/// The client keys of `listed` entries, sorted.
fn client_keys(entries: &[serde_json::Value]) -> Vec<&str> {
    let mut keys: Vec<&str> = entries.iter().filter_map(|e| e["key"].as_str()).collect();
    keys.sort();
    keys
}

async fn state_of(admin: SocketAddr, id: &str) -> serde_json::Value {
    let got = keys_request(admin, "GET", id, Some(TOKEN)).send().await;
    assert_eq!(got.status, 200, "{}", got.text());
    serde_json::from_slice(&got.body).unwrap()
}

/// The record's state, or "none" while there is no record yet (the consumer has not read the
/// message): for waiting on it.
async fn state_or_none(admin: SocketAddr, id: &str) -> String {
    let got = keys_request(admin, "GET", id, Some(TOKEN)).send().await;
    if got.status == 404 {
        return "none".into();
    }
    assert_eq!(got.status, 200, "{}", got.text());
    let v: serde_json::Value = serde_json::from_slice(&got.body).unwrap();
    v["state"].as_str().unwrap_or_default().to_string()
}

async fn unknown_outcomes_resolved_while_the_gateway_runs(store: &str) {
    let (up, gate) = Upstream::gated().await;
    let dir = TempDir::new("operator");
    let admin: SocketAddr = format!("127.0.0.1:{}", free_port(false)).parse().unwrap();
    let config = config_text(&up.url(), store, admin, &dir);
    let gw = GatewayProcess::start(&config);
    let http = Http::new(gw.addr);
    let k1 = spawn_post_to_be_killed(&http, "k1");
    up.next_arrival().await;
    let k2 = spawn_post_to_be_killed(&http, "k2");
    up.next_arrival().await;
    gw.signal_and_wait("-KILL");
    assert!(k1.await.unwrap().is_none() && k2.await.unwrap().is_none());
    gate.add_permits(100);

    let gw = GatewayProcess::start(&config);
    let http = Http::new(gw.addr);
    let (id1, id2) = (id(&config, "k1"), id(&config, "k2"));
    // What the operator runs to learn a key's id, beside the running gateway on every store.
    let printed = keys_cmd(&gw.config_path, "id", "payments", &["k1"]);
    assert_eq!(String::from_utf8_lossy(&printed.stdout).trim(), id1);
    // Both are unknown outcomes once the dead owner's lease ran out.
    for id in [&id1, &id2] {
        let unknown =
            eventually(|| async { state_of(admin, id).await["state"] == "unknown" }).await;
        assert!(unknown, "{}", state_of(admin, id).await);
    }
    assert_eq!(state_of(admin, &id1).await["reason"], "abandoned");
    // The operator finds them by the keys the client sent, here one per page.
    let (found, pages) = listed(admin, "state=unknown&route=payments&limit=1").await;
    assert_eq!(client_keys(&found), ["k1", "k2"], "{found:?}");
    assert!(pages >= 2, "a page holds at most its limit");
    for entry in &found {
        let expected = id(&config, entry["key"].as_str().unwrap());
        assert_eq!(entry["id"], expected.as_str());
        assert_eq!(entry["route"], "payments");
        assert_eq!(entry["state"], "unknown");
        assert_eq!(entry["reason"], "abandoned");
        assert!(
            entry["expires"].is_string() && entry["created"].is_string(),
            "{entry}"
        );
    }
    assert!(listed(admin, "state=unknown&consumer=payments")
        .await
        .0
        .is_empty());
    // The same through `idemgate keys list`, which asks the running gateway.
    assert_eq!(
        client_keys(&keys_list(&gw.config_path, &["--route", "payments"])),
        ["k1", "k2"]
    );
    // Without the token, nothing is listed; a query it does not know is refused.
    let refused = Http::new(admin)
        .request("GET", "/keys?state=unknown")
        .send()
        .await;
    assert_eq!(refused.status, 401);
    for bad in [
        "state=completed",
        "state=unknown&limit=0",
        "state=unknown&cursor=zz",
        "state=unknown&x=1",
    ] {
        let got = Http::new(admin)
            .request("GET", &format!("/keys?{bad}"))
            .header("authorization", &format!("Bearer {TOKEN}"))
            .send()
            .await;
        assert_eq!(got.status, 400, "{bad}: {}", got.text());
        assert_eq!(got.problem_type(), "bad-operator-request");
    }
    // A method a path does not answer: 405 with the ones it does.
    for (method, path, allow) in [
        ("POST", "/keys".to_string(), "GET, HEAD"),
        ("PATCH", format!("/keys/{id1}"), "GET, HEAD, PUT, DELETE"),
    ] {
        let got = Http::new(admin)
            .request(method, &path)
            .header("authorization", &format!("Bearer {TOKEN}"))
            .send()
            .await;
        assert_eq!(got.status, 405, "{method} {path}: {}", got.text());
        assert_eq!(got.problem_type(), "method-not-allowed");
        assert_eq!(got.header("allow"), Some(allow));
    }
    // `idemgate keys get` goes through the running gateway's API (the disk store is the
    // gateway's while it runs).
    let got = keys_cmd(&gw.config_path, "get", "payments", &["k1"]);
    let shown = String::from_utf8_lossy(&got.stdout);
    assert!(
        got.status.success(),
        "{shown}{}",
        String::from_utf8_lossy(&got.stderr)
    );
    assert!(shown.contains("\"state\":\"unknown\""), "{shown}");

    // No token, or a wrong one: 401, and nothing changes.
    for token in [None, Some("wrong-token-wrong-token")] {
        let refused = keys_request(admin, "DELETE", &id1, token).send().await;
        assert_eq!(refused.status, 401);
        assert_eq!(refused.problem_type(), "unauthorized");
        assert_eq!(refused.header("www-authenticate"), Some("Bearer"));
    }
    assert_eq!(state_of(admin, &id1).await["state"], "unknown");

    // Resolved as completed: retries replay exactly that, nothing executes again.
    let resolved = keys_request(admin, "PUT", &id1, Some(TOKEN))
        .json(r#"{"status": 201, "headers": [["content-type", "application/json"]], "body": "{\"payment\":\"pay_1\"}"}"#)
        .send()
        .await;
    assert_eq!(resolved.status, 200, "{}", resolved.text());
    let view: serde_json::Value = serde_json::from_slice(&resolved.body).unwrap();
    assert_eq!(
        (view["state"].as_str(), view["status"].as_u64()),
        (Some("completed"), Some(201))
    );
    // When a retry would execute again, as a read would say.
    assert!(
        view["expires"].as_str().is_some_and(|e| e.ends_with('Z')),
        "{view}"
    );
    // A completed record says when it goes: when a retry would execute again.
    let read = state_of(admin, &id1).await;
    assert!(read["expires"].is_string(), "{read}");
    let replay = http.post("/payments", "k1", "{}").await;
    assert_eq!(replay.status, 201);
    assert!(replay.is_replay());
    assert_eq!(replay.body, "{\"payment\":\"pay_1\"}");
    assert_eq!(replay.header("content-type"), Some("application/json"));
    assert_eq!(up.executions(), 2);

    // Released, here with `idemgate keys release` through the API: the next retry executes,
    // once.
    let released = keys_cmd(&gw.config_path, "release", "payments", &["k2"]);
    assert!(
        released.status.success(),
        "{}",
        String::from_utf8_lossy(&released.stderr)
    );
    assert!(String::from_utf8_lossy(&released.stdout).contains("\"state\":\"released\""));
    assert_eq!(http.post("/payments", "k2", "{}").await.status, 201);
    assert!(http.post("/payments", "k2", "{}").await.is_replay());
    assert_eq!(up.executions(), 3);
    // Resolved and released: nothing unknown is left to list.
    assert!(listed(admin, "state=unknown").await.0.is_empty());
    let gone = keys_request(admin, "DELETE", &id(&config, "never-used"), Some(TOKEN))
        .send()
        .await;
    assert_eq!(gone.status, 404);

    // A request still running is not released unless forced.
    let (held_up, held_gate) = (&up, &gate);
    let _ = held_gate.acquire_many(100).await.map(|p| p.forget());
    let k3 = spawn_post_to_be_killed(&http, "k3");
    // Arrivals of earlier keys may still be queued: wait for k3's.
    while held_up.next_arrival().await.headers["idempotency-key"] != "k3" {}
    let id3 = id(&config, "k3");
    let live = keys_request(admin, "DELETE", &id3, Some(TOKEN))
        .send()
        .await;
    assert_eq!(live.status, 409);
    assert_eq!(live.problem_type(), "record-live");
    assert_eq!(state_of(admin, &id3).await["state"], "pending");
    let forced = Http::new(admin)
        .request("DELETE", &format!("/keys/{id3}?force=true"))
        .header("authorization", &format!("Bearer {TOKEN}"))
        .send()
        .await;
    assert_eq!(forced.status, 200, "{}", forced.text());
    gate.add_permits(100);
    k3.await.unwrap();

    // Every change is an audit line; the token is in none.
    let logs = gw.drain_logs().join("\n");
    assert!(logs.contains("operator change"), "{logs}");
    assert!(
        logs.contains("action=\"release\"") && logs.contains("action=\"resolve\""),
        "{logs}"
    );
    assert!(logs.contains("operator request refused"), "{logs}");
    // With the change's status, written before the answer's follow-up read.
    assert!(
        logs.contains("status=200") && logs.contains("status=409"),
        "{logs}"
    );
    assert!(!logs.contains(TOKEN), "the token reached the log");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_the_disk_store_while_the_gateway_runs() {
    let dir = TempDir::new("operator-disk");
    let store = format!("backend = \"disk\"\npath = \"{}\"", dir.path.display());
    unknown_outcomes_resolved_while_the_gateway_runs(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_while_the_gateway_runs() {
    let redis = RedisServer::start();
    let store = format!("backend = \"redis\"\nurl = \"{}\"", redis.url());
    unknown_outcomes_resolved_while_the_gateway_runs(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_the_operator_api_is_off() {
    let up = Upstream::counting().await;
    let admin: SocketAddr = format!("127.0.0.1:{}", free_port(false)).parse().unwrap();
    let config = TomlConfig::parse(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[store]\nbackend = \"memory\"\n[upstream]\nurl = \"{}\"\n{PAYMENTS}",
        up.url()
    ))
    .set("server.admin", admin.to_string())
    .text();
    let _gw = GatewayProcess::start(&config);
    let got = keys_request(admin, "DELETE", &"0".repeat(64), Some(TOKEN))
        .send()
        .await;
    assert_eq!(got.status, 404);
    assert_eq!(got.problem_type(), "operator-api-off", "{}", got.text());
}

/// A consumer's message whose handler call had no complete answer is dead-lettered as an unknown
/// outcome and kept; the operator names it by the consumer and the message's key, and resolves
/// it: a redelivery then replays what the operator stored, and the handler is not called again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumers_unknown_outcome_is_resolved_the_same_way() {
    let redis = RedisServer::start();
    // The first call hangs past upstream_timeout (an unknown outcome); any later one answers.
    let up = Upstream::start(|_, n| {
        if n == 1 {
            Reply::Hang
        } else {
            Reply::json(201, "{\"handled\":true}")
        }
    })
    .await;
    let dir = TempDir::new("operator-consumer");
    let admin: SocketAddr = format!("127.0.0.1:{}", free_port(false)).parse().unwrap();
    let token_file = dir.path.join("admin-token");
    std::fs::write(&token_file, TOKEN).unwrap();
    let config = TomlConfig::parse(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[store]\nbackend = \"redis\"\nurl = \"{}\"\n[upstream]\nurl = \"{}\"\n[[consumers]]\nname = \"orders\"\nsource = {{ redis_stream = \"orders\", group = \"idemgate\" }}\nhandler = \"{}/orders\"\nkey = {{ json = \"/messageId\" }}\nupstream_timeout = \"1s\"\nbackoff = \"50ms\"\nmax_backoff = \"200ms\"\n",
        redis.url(),
        up.url(),
        up.url()
    ))
    .set("server.admin", admin.to_string())
    .set("server.admin_token_file", token_file.display().to_string())
    .text();
    let gw = GatewayProcess::start(&config);
    let publish = || redis.cli(&["XADD", "orders", "*", "body", r#"{"messageId": "m-1"}"#]);
    publish();
    let printed = keys_cmd(&gw.config_path, "id", "orders", &["m-1"]);
    let id = String::from_utf8_lossy(&printed.stdout).trim().to_string();
    assert_eq!(id.len(), 64, "{}", String::from_utf8_lossy(&printed.stderr));
    let unknown = eventually_within(std::time::Duration::from_secs(20), || async {
        state_or_none(admin, &id).await == "unknown"
    })
    .await;
    assert!(unknown, "{}", state_of(admin, &id).await);
    let (found, _) = listed(admin, "state=unknown&consumer=orders").await;
    assert_eq!(client_keys(&found), ["m-1"]);
    assert_eq!(found[0]["id"], id.as_str());
    assert_eq!(found[0]["consumer"], "orders");
    assert_eq!(found[0]["reason"], "timeout");
    let resolved = keys_request(admin, "PUT", &id, Some(TOKEN))
        .json(r#"{"status": 200, "body": "resolved by an operator"}"#)
        .send()
        .await;
    assert_eq!(resolved.status, 200, "{}", resolved.text());
    // The producer sends it again: the stored answer is the result, the handler is not called.
    publish();
    let deduplicated =
        "idemgate_consumer_messages_total{consumer=\"orders\",outcome=\"deduplicated\"}";
    let replayed = eventually_within(std::time::Duration::from_secs(20), || async {
        scrape(admin).await.get(deduplicated).copied() == Some(1.0)
    })
    .await;
    assert!(replayed, "the second delivery got the stored answer");
    let acked = eventually_within(std::time::Duration::from_secs(20), || async {
        redis
            .cli(&["XPENDING", "orders", "idemgate"])
            .starts_with('0')
    })
    .await;
    assert!(acked, "{}", redis.cli(&["XPENDING", "orders", "idemgate"]));
    assert_eq!(
        up.executions(),
        1,
        "the handler ran once, for the first delivery"
    );
    assert_eq!(state_of(admin, &id).await["status"], 200);
}
