//! What "the same request" is, through the real binary (issue 44): requests that upstreams read
//! differently are never taken for one another (a `409 key-reused`, never another's stored
//! answer), while the same bytes again still replay.

use crate::support::redis::RedisServer;
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

/// Records the previous version (b339059, before issue 44) stored on Redis, byte for byte as
/// its binary wrote them: (Redis key, `Idempotency-Key` of an anonymous client on `/payments`,
/// the request's `Content-Type` and body, the record), answered `201` with `{"id":"pay_1","amount":1000}`.
const STORED_BY_PREVIOUS: [(&str, &str, &str, &str, &str); 2] = [
    (
        "idemgate:{194a91de8c5d546383a3e90d015f2ea0dd264b6f473581ed289cb987bf526260}",
        "k-upgrade",
        "application/json",
        r#"{"amount":1000,"currency":"EUR"}"#,
        "010291715198b05cd565f9844d32ad29715d312df17378c3293da1da6c0151c28bc9000001a24a240e7900c9000001a24a240e7d01000400067365727665720000001a42617365485454502f302e3620507974686f6e2f332e31312e370004646174650000001d53756e2c2030362044656320323032362030363a35363a343620474d54000c636f6e74656e742d74797065000000106170706c69636174696f6e2f6a736f6e000e636f6e74656e742d6c656e6774680000000232387b226964223a227061795f31222c22616d6f756e74223a313030307d",
    ),
    (
        "idemgate:{884da9084e5aa91c01538b743618de73270c709db1c3076976526c5ee0fa338d}",
        "k-upgrade-form",
        "application/x-www-form-urlencoded",
        "amount=1000&currency=EUR",
        "01028371a4a46a1f39822cd4daca7160b1e59465507cce5b97bb6e8da0259ad399f6000001a24a25b03900c9000001a24a25b03c01000400067365727665720000001a42617365485454502f302e3620507974686f6e2f332e31312e370004646174650000001d53756e2c2030362044656320323032362030363a35383a333320474d54000c636f6e74656e742d74797065000000106170706c69636174696f6e2f6a736f6e000e636f6e74656e742d6c656e6774680000000232387b226964223a227061795f31222c22616d6f756e74223a313030307d",
    ),
];
/// This version on a Redis holding `records` (store key, value) as the previous version left
/// them, in front of a counting upstream, with one route, `/payments`.
async fn upgraded(records: &[(&str, Vec<u8>)]) -> (RedisServer, Upstream, GatewayProcess) {
    let redis = RedisServer::start();
    let mut conn = ::redis::Client::open(redis.url())
        .unwrap()
        .get_connection()
        .unwrap();
    for (key, value) in records {
        let () = ::redis::cmd("SET")
            .arg(*key)
            .arg(value.as_slice())
            .arg("PX")
            .arg(3_600_000)
            .query(&mut conn)
            .unwrap();
    }
    let up = Upstream::counting().await;
    let gw = GatewayProcess::start(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nurl = \"{}\"\n[store]\nbackend = \"redis\"\nurl = \"{}\"\n[[routes]]\npath = \"/payments\"\n",
        up.url(),
        redis.url()
    ));
    (redis, up, gw)
}

/// After the upgrade, a key the previous version stored still replays for the same request
/// (its fingerprint of the earlier form), and another request with it is still refused.
#[tokio::test]
async fn a_key_the_previous_version_stored_replays_after_the_upgrade() {
    let records: Vec<(&str, Vec<u8>)> = STORED_BY_PREVIOUS
        .iter()
        .map(|(key, _, _, _, value)| (*key, hex::decode(value).unwrap()))
        .collect();
    let (_redis, up, gw) = upgraded(&records).await;
    let http = Http::new(gw.addr);
    let send = |key: &'static str, content_type: &'static str, body: &'static str| {
        http.request("POST", "/payments")
            .header("idempotency-key", key)
            .header("content-type", content_type)
            .body(body)
            .send()
    };
    for (_, key, content_type, body, _) in STORED_BY_PREVIOUS {
        let retry = send(key, content_type, body).await;
        assert!(retry.is_replay(), "{key}: {retry:?}");
        assert_eq!(retry.status, 201);
        assert_eq!(retry.text(), r#"{"id":"pay_1","amount":1000}"#);
    }
    let json = |body| send("k-upgrade", "application/json", body);
    let relaid = json(r#"{ "currency": "EUR", "amount": 1e3 }"#).await;
    assert!(
        relaid.is_replay(),
        "the same JSON laid out otherwise: {relaid:?}"
    );
    let other = json(r#"{"amount":2000,"currency":"EUR"}"#).await;
    assert_eq!(other.status, 409, "{other:?}");
    assert_eq!(other.problem_type(), "key-reused");
    let form = send(
        "k-upgrade-form",
        "application/x-www-form-urlencoded",
        "amount=2000&currency=EUR",
    )
    .await;
    assert_eq!(form.status, 409, "{form:?}");
    assert_eq!(up.executions(), 0, "nothing ran again");
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

/// With `server.method_override_header`, a POST is routed and fingerprinted as the method its
/// header names, as the upstream runs it, and forwarded as it came.
#[tokio::test]
async fn a_method_override_routes_as_the_upstreams_method() {
    let up = Upstream::counting().await;
    let gw = GatewayProcess::start(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nmethod_override_header = \"X-HTTP-Method-Override\"\n[upstream]\nurl = \"{}\"\n[store]\nbackend = \"memory\"\n[[routes]]\nname = \"cancel\"\npath = \"/payments/*\"\nmethods = [\"DELETE\"]\nrequire_key = true\n[[routes]]\nname = \"create\"\npath = \"/payments\"\nmethods = [\"POST\"]\n",
        up.url()
    ));
    let http = Http::new(gw.addr);
    let send = |method: &str, path: &str, key: Option<&str>, over: Option<&str>| {
        let mut req = http
            .request(method, path)
            .header("content-type", "application/json");
        if let Some(key) = key {
            req = req.header("idempotency-key", key);
        }
        if let Some(over) = over {
            req = req.header("x-http-method-override", over);
        }
        req.body("{}").send()
    };
    // A POST overridden to DELETE is the DELETE route's: it needs a key ...
    let keyless = send("POST", "/payments/p1", None, Some("DELETE")).await;
    assert_eq!(keyless.status, 400, "{keyless:?}");
    assert_eq!(keyless.problem_type(), "missing-key");
    // ... runs once, forwarded as it came, and a real DELETE with the key is its retry.
    let first = send("POST", "/payments/p1", Some("c1"), Some("delete")).await;
    assert_eq!(first.status, 201, "{first:?}");
    let seen = up.seen();
    assert_eq!(seen.last().unwrap().method, http::Method::POST);
    assert_eq!(
        seen.last().unwrap().headers["x-http-method-override"],
        "delete"
    );
    assert!(send("DELETE", "/payments/p1", Some("c1"), None)
        .await
        .is_replay());
    // The same POST without the override is no route's: passed through, not replayed.
    let plain = send("POST", "/payments/p1", Some("c1"), None).await;
    assert!(!plain.is_replay(), "{plain:?}");
    // A POST overridden to a method no route has stays on its own route (the upstream may not
    // honour the header): keyed and replayed, and told from the plain POST.
    let before = up.executions();
    let got = send("POST", "/payments", Some("g1"), Some("GET")).await;
    assert_eq!(got.status, 201, "{got:?}");
    assert!(send("POST", "/payments", Some("g1"), Some("GET"))
        .await
        .is_replay());
    let plain = send("POST", "/payments", Some("g1"), None).await;
    assert_eq!(plain.status, 409, "{plain:?}");
    assert_eq!(up.executions(), before + 1);
    // An override the upstream might read otherwise, on an idempotent route: refused.
    for over in ["PURGE", "DELETE, PUT"] {
        let got = send("POST", "/payments", Some("x1"), Some(over)).await;
        assert_eq!(got.status, 400, "{over}: {got:?}");
        assert_eq!(got.problem_type(), "invalid-method-override");
    }
    assert_eq!(up.executions(), before + 1, "nothing more forwarded");
}

/// The previous version fingerprinted a compressed body as the bytes it came in (it decoded
/// nothing): a key it stored for one still replays for the same bytes after the upgrade.
#[tokio::test]
async fn a_compressed_request_the_previous_version_stored_replays_for_its_bytes() {
    use sha2::Digest;
    use std::io::Write;
    let mut e = flate2::GzBuilder::new()
        .mtime(7)
        .write(Vec::new(), flate2::Compression::default());
    e.write_all(br#"{"amount":1000,"currency":"EUR"}"#).unwrap();
    let gzipped = e.finish().unwrap();
    // The previous version's fingerprint (b339059): the JSON does not parse, so the bytes.
    let mut h = sha2::Sha256::new();
    h.update(b"idemgate/fingerprint/v1\x00");
    for field in ["POST", "/payments", "/payments", ""] {
        h.update((field.len() as u64).to_be_bytes());
        h.update(field.as_bytes());
    }
    h.update([0]);
    h.update(b"bytes\x00");
    h.update(&gzipped);
    // The record of key `k-upgrade` that version wrote, with this request's fingerprint.
    let (store_key, key, _, _, value) = STORED_BY_PREVIOUS[0];
    let mut record = hex::decode(value).unwrap();
    record[2..34].copy_from_slice(&h.finalize());
    let (_redis, up, gw) = upgraded(&[(store_key, record)]).await;
    let retry = Http::new(gw.addr)
        .request("POST", "/payments")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .header("content-encoding", "gzip")
        .body(gzipped)
        .send()
        .await;
    assert!(retry.is_replay(), "{retry:?}");
    assert_eq!(up.executions(), 0);
}
