//! What "the same request" is, through the real binary (issue 44): requests that upstreams read
//! differently are never taken for one another (a `409 key-reused`, never another's stored
//! answer), while the same bytes again still replay.

use crate::support::*;

/// The real binary on the memory store, with one route, `/payments`.
fn binary(up: &Upstream) -> GatewayProcess {
    GatewayProcess::start(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nurl = \"{}\"\n[store]\nbackend = \"memory\"\n[[routes]]\npath = \"/payments\"\n",
        up.url()
    ))
}

#[tokio::test]
async fn json_an_upstream_reads_differently_is_never_replayed_for_it() {
    let up = Upstream::counting().await;
    let gw = binary(&up);
    let http = Http::new(gw.addr);
    let pairs = [
        // Go's encoding/json, ASP.NET Core and case-insensitive Jackson read 1000, then 1.
        (
            r#"{"amount":1,"Amount":1000}"#,
            r#"{"Amount":1000,"amount":1}"#,
        ),
        // The last of repeated keys for some upstreams, the first or a 400 for others.
        (r#"{"amount":1,"amount":1000}"#, r#"{"amount":1000}"#),
        (r#"{"amount":1000}"#, r#"{"amount":1,"amount":1000}"#),
        // serde_json's private number marker, written by a client, is not the number 1000.
        (r#"{"$serde_json::private::Number":"1e3"}"#, "1000"),
    ];
    for (i, (first, second)) in pairs.iter().enumerate() {
        let key = format!("k{i}");
        assert_eq!(http.post("/payments", &key, first).await.status, 201);
        let again = http.post("/payments", &key, first).await;
        assert!(again.is_replay(), "the same bytes again replay: {first}");
        let other = http.post("/payments", &key, second).await;
        assert_eq!(other.status, 409, "{first} then {second}: {other:?}");
        assert_eq!(other.problem_type(), "key-reused");
    }
    assert_eq!(
        up.executions(),
        pairs.len(),
        "each first request once, nothing else"
    );
}

#[tokio::test]
async fn the_same_body_as_another_media_type_is_another_request() {
    let up = Upstream::counting().await;
    let gw = binary(&up);
    let http = Http::new(gw.addr);
    let send = |key: &str, content_type: &str, body: &str| {
        http.request("POST", "/payments")
            .header("idempotency-key", key)
            .header("content-type", content_type)
            .body(body.to_string())
            .send()
    };
    let pairs = [
        (
            "application/json",
            "application/merge-patch+json",
            r#"{"amount":1}"#,
        ),
        (
            "application/x-www-form-urlencoded",
            "text/plain",
            "amount=1",
        ),
    ];
    for (i, (first, second, body)) in pairs.iter().enumerate() {
        let key = format!("m{i}");
        assert_eq!(send(&key, first, body).await.status, 201);
        let again = send(&key, &first.to_uppercase(), body).await;
        assert!(
            again.is_replay(),
            "the same media type in capitals: the same request"
        );
        let other = send(&key, second, body).await;
        assert_eq!(other.status, 409, "{first} then {second}: {other:?}");
    }
    assert_eq!(up.executions(), pairs.len());
}

/// Across a restart on a store that keeps records (Redis): the same JSON replays, and the
/// variants an upstream reads differently are still refused, whichever process stored the key.
#[tokio::test]
async fn across_a_restart_the_same_request_replays_and_its_variants_are_refused() {
    let redis = crate::support::redis::RedisServer::start();
    let up = Upstream::counting().await;
    let config = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nurl = \"{}\"\n[store]\nbackend = \"redis\"\nurl = \"{}\"\n[[routes]]\npath = \"/payments\"\n",
        up.url(),
        redis.url()
    );
    let body = r#"{"amount":1000}"#;
    let send = |http: Http, content_type: &'static str, body: &'static str| async move {
        http.request("POST", "/payments")
            .header("idempotency-key", "k-restart")
            .header("content-type", content_type)
            .body(body)
            .send()
            .await
    };
    let before = GatewayProcess::start(&config);
    assert_eq!(
        send(Http::new(before.addr), "application/json", body)
            .await
            .status,
        201
    );
    assert!(before.signal_and_wait("-TERM").success());
    let after = GatewayProcess::start(&config);
    let http = || Http::new(after.addr);
    assert!(send(http(), "application/json", body).await.is_replay());
    for (content_type, variant) in [
        ("application/merge-patch+json", body),
        ("application/json", r#"{"amount":1,"amount":1000}"#),
        (
            "application/json",
            r#"{"amount":{"$serde_json::private::Number":"1000"}}"#,
        ),
        ("text/plain", body),
    ] {
        let got = send(http(), content_type, variant).await;
        assert_eq!(got.status, 409, "{content_type} {variant}: {got:?}");
    }
    assert_eq!(up.executions(), 1);
}

#[tokio::test]
async fn a_header_named_in_fingerprint_headers_tells_requests_apart() {
    let up = Upstream::counting().await;
    let gw = GatewayProcess::start(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nurl = \"{}\"\n[store]\nbackend = \"memory\"\n[defaults]\nfingerprint_headers = [\"x-tenant\"]\n[[routes]]\npath = \"/payments\"\n",
        up.url()
    ));
    let http = Http::new(gw.addr);
    let send = |tenant: &str| {
        http.request("POST", "/payments")
            .header("idempotency-key", "k-tenant")
            .header("x-tenant", tenant)
            .json(r#"{"amount":1}"#)
            .send()
    };
    assert_eq!(send("t1").await.status, 201);
    assert!(send("t1").await.is_replay());
    let other = send("t2").await;
    assert_eq!(other.status, 409, "{other:?}");
    assert_eq!(up.executions(), 1);
}
