//! End-to-end behaviour of the gateway on the embedded store: a real upstream, the real gateway,
//! real HTTP over loopback. Each test names the numbered behaviour of the core issue it covers.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Semaphore;

use crate::support::*;

// 1. Key parsing -------------------------------------------------------------------------------

#[tokio::test]
async fn bare_and_quoted_keys_are_the_same_key() {
    let up = Upstream::counting().await;
    let gw = gateway(&up.url(), PAYMENTS).await;
    let http = Http::new(gw.addr());
    let first = http.post("/payments", "abc", r#"{"amount":100}"#).await;
    let second = http.post("/payments", "\"abc\"", r#"{"amount":100}"#).await;
    assert_eq!(first.status, 201);
    assert!(second.is_replay());
    assert_eq!(first.body, second.body);
    assert_eq!(up.executions(), 1);
}

#[tokio::test]
async fn missing_and_invalid_keys_are_refused_before_the_upstream() {
    let up = Upstream::counting().await;
    let gw = gateway(&up.url(), PAYMENTS).await;
    let http = Http::new(gw.addr());

    let missing = http.request("POST", "/payments").json("{}").send().await;
    assert_eq!(missing.status, 400);
    assert_eq!(missing.problem_type(), "missing-key");
    assert!(missing.text().contains("Idempotency-Key"));

    let long = "k".repeat(256);
    for bad in [
        "",
        "\"\"",
        "a b",
        "\"unterminated",
        long.as_str(),
        "\"a\";p=1",
    ] {
        let got = http.post("/payments", bad, "{}").await;
        assert_eq!(got.status, 400, "key {bad:?}");
        assert_eq!(got.problem_type(), "invalid-key", "key {bad:?}");
    }
    let twice = http
        .request("POST", "/payments")
        .header("idempotency-key", "a")
        .header("idempotency-key", "b")
        .json("{}")
        .send()
        .await;
    assert_eq!(twice.problem_type(), "invalid-key");
    assert_eq!(up.executions(), 0);
}

#[tokio::test]
async fn key_header_name_is_case_insensitive_and_configurable() {
    let up = Upstream::counting().await;
    let gw = gateway(
        &up.url(),
        "[defaults]\nkey_header = \"X-Request-Key\"\n[[routes]]\npath = \"/payments\"\n",
    )
    .await;
    let http = Http::new(gw.addr());
    let a = http
        .request("POST", "/payments")
        .header("X-REQUEST-KEY", "k")
        .json("{}")
        .send()
        .await;
    let b = http
        .request("POST", "/payments")
        .header("x-request-key", "k")
        .json("{}")
        .send()
        .await;
    assert_eq!(a.status, 201);
    assert!(b.is_replay());
    assert_eq!(up.executions(), 1);
}

#[tokio::test]
async fn without_require_key_a_keyless_request_passes_through() {
    let up = Upstream::counting().await;
    let gw = gateway(
        &up.url(),
        "[[routes]]\npath = \"/payments\"\nrequire_key = false\n",
    )
    .await;
    let http = Http::new(gw.addr());
    for _ in 0..2 {
        let got = http.request("POST", "/payments").json("{}").send().await;
        assert_eq!(got.status, 201);
        assert!(!got.is_replay());
    }
    assert_eq!(up.executions(), 2);
}

// 2. Scope ---------------------------------------------------------------------------------------

#[tokio::test]
async fn one_client_can_never_replay_block_or_detect_another_clients_key() {
    let up = Upstream::counting().await;
    let gw = gateway(&up.url(), PAYMENTS).await;
    let http = Http::new(gw.addr());
    let send = |auth: &'static str, body: &'static str| {
        http.request("POST", "/payments")
            .header("authorization", auth)
            .header("idempotency-key", "shared-key")
            .json(body)
            .send()
    };
    let alice = send("Bearer alice", r#"{"amount":1}"#).await;
    // Same key, other client, other body: neither a replay nor a mismatch.
    let bob = send("Bearer bob", r#"{"amount":2}"#).await;
    assert_eq!(alice.status, 201);
    assert_eq!(bob.status, 201);
    assert!(!bob.is_replay());
    assert_ne!(alice.body, bob.body);
    assert_eq!(up.executions(), 2);
    // Each still replays their own.
    assert_eq!(
        send("Bearer alice", r#"{"amount":1}"#).await.body,
        alice.body
    );
    assert_eq!(send("Bearer bob", r#"{"amount":2}"#).await.body, bob.body);
    assert_eq!(up.executions(), 2);
}

#[tokio::test]
async fn an_empty_client_header_setting_makes_one_scope() {
    let up = Upstream::counting().await;
    let gw = gateway(
        &up.url(),
        "[defaults]\nclient_header = \"\"\n[[routes]]\npath = \"/payments\"\n",
    )
    .await;
    let http = Http::new(gw.addr());
    let a = http
        .request("POST", "/payments")
        .header("authorization", "a")
        .header("idempotency-key", "k")
        .json("{}")
        .send()
        .await;
    let b = http
        .request("POST", "/payments")
        .header("authorization", "b")
        .header("idempotency-key", "k")
        .json("{}")
        .send()
        .await;
    assert_eq!(a.status, 201);
    assert!(b.is_replay());
    assert_eq!(up.executions(), 1);
}

// 3. Fingerprint ---------------------------------------------------------------------------------

#[tokio::test]
async fn the_same_json_in_another_layout_replays() {
    let up = Upstream::counting().await;
    let gw = gateway(&up.url(), PAYMENTS).await;
    let http = Http::new(gw.addr());
    let a = http
        .post(
            "/payments",
            "k1",
            r#"{"amount":100,"currency":"EUR","meta":{"a":1,"b":[1,2]}}"#,
        )
        .await;
    let b = http
        .post("/payments", "k1", "{\n  \"meta\": {\"b\": [1, 2], \"a\": 1.0},\n  \"currency\": \"EUR\",\n  \"amount\": 1e2\n}")
        .await;
    assert_eq!(a.status, 201);
    assert!(b.is_replay(), "{b:?}");
    assert_eq!(up.executions(), 1);
}

#[tokio::test]
async fn fingerprint_ignore_leaves_out_the_named_fields() {
    let up = Upstream::counting().await;
    let gw = gateway(
        &up.url(),
        "[[routes]]\npath = \"/payments\"\nfingerprint_ignore = [\"/meta/sentAt\"]\n",
    )
    .await;
    let http = Http::new(gw.addr());
    let a = http
        .post(
            "/payments",
            "k",
            r#"{"amount":1,"meta":{"sentAt":"10:00"}}"#,
        )
        .await;
    let b = http
        .post(
            "/payments",
            "k",
            r#"{"amount":1,"meta":{"sentAt":"10:05"}}"#,
        )
        .await;
    let c = http
        .post(
            "/payments",
            "k",
            r#"{"amount":2,"meta":{"sentAt":"10:05"}}"#,
        )
        .await;
    assert_eq!(a.status, 201);
    assert!(b.is_replay());
    assert_eq!(c.status, 409);
    assert_eq!(up.executions(), 1);
}

#[tokio::test]
async fn path_and_query_are_part_of_the_fingerprint() {
    let up = Upstream::counting().await;
    let gw = gateway(&up.url(), "[[routes]]\npath = \"/orders/*/capture\"\n").await;
    let http = Http::new(gw.addr());
    assert_eq!(
        http.post("/orders/1/capture?full=1", "k", "{}")
            .await
            .status,
        201
    );
    assert_eq!(
        http.post("/orders/2/capture?full=1", "k", "{}")
            .await
            .problem_type(),
        "key-reused"
    );
    assert_eq!(
        http.post("/orders/1/capture?full=0", "k", "{}")
            .await
            .problem_type(),
        "key-reused"
    );
    assert!(http
        .post("/orders/1/capture?full=1", "k", "{}")
        .await
        .is_replay());
    assert_eq!(up.executions(), 1);
}

// 4 + 7. Atomic reservation, concurrent duplicates ---------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forty_concurrent_duplicates_execute_once_and_all_get_the_same_body() {
    let gate = Arc::new(Semaphore::new(0));
    let g = Arc::clone(&gate);
    let up =
        Upstream::start(move |_, n| Reply::json(201, &format!("{{\"execution\":{n}}}")).gated(&g))
            .await;
    let gw = gateway(&up.url(), PAYMENTS).await;
    let http = Http::new(gw.addr());

    let mut calls = Vec::new();
    for _ in 0..40 {
        let http = http.clone();
        calls.push(tokio::spawn(async move {
            http.post("/payments", "same-key", r#"{"amount":100}"#)
                .await
        }));
    }
    // The first request is held at the upstream; open the gate only once all 40 are inside the
    // gateway, so the other 39 really are concurrent duplicates waiting on the held key.
    up.next_arrival().await;
    let metrics = gw.gateway().metrics();
    eventually(|| async { metrics.in_flight_now() >= 40 }).await;
    assert_eq!(
        gw.gateway().metrics().in_flight_now(),
        40,
        "all 40 are in flight together"
    );
    gate.add_permits(100);

    let mut bodies = Vec::new();
    let mut originals = 0;
    for c in calls {
        let got = c.await.unwrap();
        assert_eq!(got.status, 201, "{got:?}");
        if !got.is_replay() {
            originals += 1;
        }
        bodies.push(got.body);
    }
    assert_eq!(up.executions(), 1, "exactly one upstream execution");
    assert_eq!(
        originals, 1,
        "exactly one caller gets the unmarked original"
    );
    assert!(
        bodies.iter().all(|b| b == &bodies[0]),
        "every caller gets the same body"
    );
    assert_eq!(&bodies[0][..], br#"{"execution":1}"#);
}

#[tokio::test]
async fn a_waiting_duplicate_gets_the_originals_result_when_it_lands() {
    let (up, gate) = Upstream::gated().await;
    let gw = gateway(&up.url(), PAYMENTS).await;
    let http = Http::new(gw.addr());
    let h1 = http.clone();
    let original = tokio::spawn(async move { h1.post("/payments", "k", "{}").await });
    up.next_arrival().await;
    let h2 = http.clone();
    let duplicate = tokio::spawn(async move { h2.post("/payments", "k", "{}").await });
    // The duplicate cannot finish while the original is held: once both are inside the
    // gateway, it is still waiting.
    let metrics = gw.gateway().metrics();
    eventually(|| async { metrics.in_flight_now() >= 2 }).await;
    assert_eq!(metrics.in_flight_now(), 2);
    assert!(!duplicate.is_finished());
    gate.add_permits(1);
    let (original, duplicate) = (original.await.unwrap(), duplicate.await.unwrap());
    assert_eq!(original.status, 201);
    assert!(!original.is_replay(), "the original is never marked");
    assert_eq!(duplicate.status, 201);
    assert!(duplicate.is_replay());
    assert_eq!(original.body, duplicate.body);
    assert_eq!(up.executions(), 1);
}

#[tokio::test]
async fn with_wait_zero_a_duplicate_in_flight_gets_409_with_retry_after() {
    let gate = Arc::new(Semaphore::new(0));
    let g = Arc::clone(&gate);
    let up = Upstream::start(move |_, _| Reply::json(201, "{}").gated(&g)).await;
    let gw = gateway(
        &up.url(),
        "[[routes]]\npath = \"/payments\"\nwait = \"0s\"\n",
    )
    .await;
    let http = Http::new(gw.addr());
    let h1 = http.clone();
    let original = tokio::spawn(async move { h1.post("/payments", "k", "{}").await });
    up.next_arrival().await;
    let dup = http.post("/payments", "k", "{}").await;
    assert_eq!(dup.status, 409);
    assert_eq!(dup.problem_type(), "in-flight");
    assert!(dup.header("retry-after").is_some());
    gate.add_permits(1);
    assert_eq!(original.await.unwrap().status, 201);
    assert!(http.post("/payments", "k", "{}").await.is_replay());
    assert_eq!(up.executions(), 1);
}

#[tokio::test]
async fn a_duplicate_past_its_wait_gets_409_and_the_original_still_completes() {
    let gate = Arc::new(Semaphore::new(0));
    let g = Arc::clone(&gate);
    let up = Upstream::start(move |_, _| Reply::json(201, "{\"ok\":true}").gated(&g)).await;
    let gw = gateway(
        &up.url(),
        "[[routes]]\npath = \"/payments\"\nwait = \"300ms\"\n",
    )
    .await;
    let http = Http::new(gw.addr());
    let h1 = http.clone();
    let original = tokio::spawn(async move { h1.post("/payments", "k", "{}").await });
    up.next_arrival().await;
    let asked = std::time::Instant::now();
    let dup = http.post("/payments", "k", "{}").await;
    assert_eq!(dup.status, 409);
    assert_eq!(dup.problem_type(), "in-flight");
    assert!(
        asked.elapsed() >= Duration::from_millis(300),
        "the duplicate waited its 300ms first"
    );
    gate.add_permits(1);
    assert_eq!(original.await.unwrap().status, 201);
    assert_eq!(up.executions(), 1);
}

#[tokio::test]
async fn a_different_request_while_in_flight_is_a_mismatch_at_once() {
    let gate = Arc::new(Semaphore::new(0));
    let g = Arc::clone(&gate);
    let up = Upstream::start(move |_, _| Reply::json(201, "{}").gated(&g)).await;
    let gw = gateway(&up.url(), PAYMENTS).await;
    let http = Http::new(gw.addr());
    let h1 = http.clone();
    let original = tokio::spawn(async move { h1.post("/payments", "k", r#"{"a":1}"#).await });
    up.next_arrival().await;
    let other = http.post("/payments", "k", r#"{"a":2}"#).await;
    assert_eq!(other.problem_type(), "key-reused");
    gate.add_permits(1);
    assert_eq!(original.await.unwrap().status, 201);
}

// 5 + 6. Capture, replay, mismatch ---------------------------------------------------------------

#[tokio::test]
async fn replays_are_byte_for_byte_and_marked_and_the_original_is_not() {
    let up = Upstream::start(|_, _| Reply::Respond {
        status: 201,
        headers: vec![
            ("content-type", "application/json; charset=utf-8".into()),
            ("location", "/payments/pay_1".into()),
            ("x-custom", "one".into()),
            ("set-cookie", "a=1".into()),
            ("connection", "x-hop".into()),
            ("x-hop", "secret".into()),
        ],
        body: Bytes::from_static(b"{\"id\":\"pay_1\",  \"amount\": 100 }\n"),
    })
    .await;
    let gw = gateway(&up.url(), PAYMENTS).await;
    let http = Http::new(gw.addr());
    let first = http.post("/payments", "k", r#"{"amount":100}"#).await;
    let again = http.post("/payments", "k", r#"{"amount":100}"#).await;
    assert_eq!(first.status, 201);
    assert_eq!(first.header("idempotent-replayed"), None);
    assert_eq!(again.status, 201);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(first.body, again.body);
    assert_eq!(&again.body[..], b"{\"id\":\"pay_1\",  \"amount\": 100 }\n");
    for h in ["content-type", "location", "x-custom", "set-cookie"] {
        assert_eq!(first.header(h), again.header(h), "header {h}");
        assert!(again.header(h).is_some(), "header {h} replayed");
    }
    assert_eq!(
        again.header("x-hop"),
        None,
        "headers named by Connection are hop-by-hop"
    );
    assert_eq!(first.header("x-hop"), None);
    assert_eq!(up.executions(), 1);
}

#[tokio::test]
async fn the_replay_header_name_is_configurable() {
    let up = Upstream::counting().await;
    let gw = gateway(
        &up.url(),
        "[defaults]\nreplay_header = \"X-Replayed\"\n[[routes]]\npath = \"/payments\"\n",
    )
    .await;
    let http = Http::new(gw.addr());
    http.post("/payments", "k", "{}").await;
    let again = http.post("/payments", "k", "{}").await;
    assert_eq!(again.header("x-replayed"), Some("true"));
    assert_eq!(again.header("idempotent-replayed"), None);
}

#[tokio::test]
async fn a_mismatch_leaves_the_stored_result_for_the_correct_retry() {
    let up = Upstream::counting().await;
    let gw = gateway(&up.url(), PAYMENTS).await;
    let http = Http::new(gw.addr());
    let first = http.post("/payments", "k", r#"{"amount":100}"#).await;
    let wrong = http.post("/payments", "k", r#"{"amount":999}"#).await;
    assert_eq!(wrong.status, 409);
    assert_eq!(wrong.problem_type(), "key-reused");
    let retry = http.post("/payments", "k", r#"{"amount":100}"#).await;
    assert!(retry.is_replay());
    assert_eq!(retry.body, first.body);
    assert_eq!(up.executions(), 1);
}

#[tokio::test]
async fn mismatch_status_422_when_configured() {
    let up = Upstream::counting().await;
    let gw = gateway(
        &up.url(),
        "[defaults]\nmismatch_status = 422\n[[routes]]\npath = \"/payments\"\n",
    )
    .await;
    let http = Http::new(gw.addr());
    http.post("/payments", "k", r#"{"a":1}"#).await;
    let wrong = http.post("/payments", "k", r#"{"a":2}"#).await;
    assert_eq!(wrong.status, 422);
    assert_eq!(wrong.problem_type(), "key-reused");
}

#[tokio::test]
async fn client_errors_are_stored_and_replayed() {
    let up = Upstream::start(|_, _| Reply::json(400, r#"{"error":"card declined"}"#)).await;
    let gw = gateway(&up.url(), PAYMENTS).await;
    let http = Http::new(gw.addr());
    let a = http.post("/payments", "k", "{}").await;
    let b = http.post("/payments", "k", "{}").await;
    assert_eq!(a.status, 400);
    assert_eq!(b.status, 400);
    assert!(b.is_replay());
    assert_eq!(up.executions(), 1);
}

#[tokio::test]
async fn server_errors_release_the_key_by_default() {
    let up = Upstream::start(|_, n| {
        if n == 1 {
            Reply::json(503, r#"{"error":"busy"}"#)
        } else {
            Reply::json(201, r#"{"ok":true}"#)
        }
    })
    .await;
    let gw = gateway(&up.url(), PAYMENTS).await;
    let http = Http::new(gw.addr());
    let a = http.post("/payments", "k", "{}").await;
    assert_eq!(a.status, 503, "the upstream's own 5xx reaches the client");
    assert_eq!(&a.body[..], br#"{"error":"busy"}"#);
    let b = http.post("/payments", "k", "{}").await;
    assert_eq!(b.status, 201);
    assert!(!b.is_replay());
    assert!(http.post("/payments", "k", "{}").await.is_replay());
    assert_eq!(up.executions(), 2);
}

#[tokio::test]
async fn server_errors_are_replayed_when_store_server_errors_is_set() {
    let up = Upstream::start(|_, _| Reply::json(500, r#"{"error":"boom"}"#)).await;
    let gw = gateway(
        &up.url(),
        "[[routes]]\npath = \"/payments\"\nstore_server_errors = true\n",
    )
    .await;
    let http = Http::new(gw.addr());
    assert_eq!(http.post("/payments", "k", "{}").await.status, 500);
    let b = http.post("/payments", "k", "{}").await;
    assert_eq!(b.status, 500);
    assert!(b.is_replay());
    assert_eq!(up.executions(), 1);
}

#[tokio::test]
async fn rate_limited_requests_are_not_stored() {
    let up = Upstream::start(|_, n| {
        if n == 1 {
            Reply::json(429, "{}")
        } else {
            Reply::json(201, "{}")
        }
    })
    .await;
    let gw = gateway(&up.url(), PAYMENTS).await;
    let http = Http::new(gw.addr());
    assert_eq!(http.post("/payments", "k", "{}").await.status, 429);
    assert_eq!(http.post("/payments", "k", "{}").await.status, 201);
    assert_eq!(up.executions(), 2);
}

// 9. Bodies, streaming, forwarding headers --------------------------------------------------------

#[tokio::test]
async fn a_body_over_max_body_is_refused_without_calling_the_upstream() {
    let up = Upstream::counting().await;
    let gw = gateway(
        &up.url(),
        "[[routes]]\npath = \"/payments\"\nmax_body = 1024\n",
    )
    .await;
    let http = Http::new(gw.addr());
    let big = "x".repeat(1025);
    let got = http
        .request("POST", "/payments")
        .header("idempotency-key", "k")
        .body(big)
        .send()
        .await;
    assert_eq!(got.status, 413);
    assert_eq!(got.problem_type(), "body-too-large");
    let ok = http
        .request("POST", "/payments")
        .header("idempotency-key", "k2")
        .body("x".repeat(1024))
        .send()
        .await;
    assert_eq!(ok.status, 201);
    assert_eq!(up.executions(), 1);
}

#[tokio::test]
async fn a_chunked_body_over_max_body_is_refused_while_reading() {
    let up = Upstream::counting().await;
    let gw = gateway(
        &up.url(),
        "[[routes]]\npath = \"/payments\"\nmax_body = 10\n",
    )
    .await;
    let resp = raw(
        gw.addr(),
        b"POST /payments HTTP/1.1\r\nhost: x\r\nidempotency-key: k\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n6\r\n123456\r\n6\r\n789012\r\n0\r\n\r\n",
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 413"), "{resp}");
    assert!(resp.contains("body-too-large"));
    assert_eq!(up.executions(), 0);
}

#[tokio::test]
async fn a_chunked_body_within_the_cap_is_forwarded_whole() {
    let up = Upstream::counting().await;
    let gw = gateway(&up.url(), PAYMENTS).await;
    let resp = raw(
        gw.addr(),
        b"POST /payments HTTP/1.1\r\nhost: x\r\nidempotency-key: k\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n3\r\nabc\r\n3\r\ndef\r\n0\r\n\r\n",
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 201"), "{resp}");
    assert_eq!(&up.seen()[0].body[..], b"abcdef");
}

#[tokio::test]
async fn everything_else_passes_through_untouched() {
    let up = Upstream::counting().await;
    let gw = gateway(
        &up.url(),
        "[[routes]]\npath = \"/payments\"\nmax_body = 16\n",
    )
    .await;
    let http = Http::new(gw.addr());
    // Another method on the idempotent path, and another path: no key needed, no cap, run each time.
    for _ in 0..2 {
        let got = http.request("GET", "/payments?page=2").send().await;
        assert_eq!(got.status, 201);
        assert!(!got.is_replay());
    }
    let big = http
        .request("POST", "/other")
        .header("idempotency-key", "k")
        .body("y".repeat(100_000))
        .send()
        .await;
    assert_eq!(big.status, 201);
    let again = http
        .request("POST", "/other")
        .header("idempotency-key", "k")
        .body("y".repeat(100_000))
        .send()
        .await;
    assert!(!again.is_replay());
    assert_eq!(up.executions(), 4);
    let seen = up.seen();
    assert_eq!(seen[0].path_and_query, "/payments?page=2");
    assert_eq!(seen[2].body.len(), 100_000);
}

#[tokio::test]
async fn pass_through_streams_the_response() {
    let gate = Arc::new(Semaphore::new(0));
    let g = Arc::clone(&gate);
    let up = Upstream::start(move |_, _| Reply::Stream {
        first: Bytes::from_static(b"first-chunk"),
        gate: Arc::clone(&g),
        second: Bytes::from_static(b"second-chunk"),
    })
    .await;
    let gw = gateway(&up.url(), PAYMENTS).await;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(gw.addr()).await.unwrap();
    s.write_all(b"GET /feed HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    // The first chunk arrives while the upstream is still holding the second one back.
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("first-chunk") {
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "connection closed early");
        seen.extend_from_slice(&buf[..n]);
    }
    assert!(!String::from_utf8_lossy(&seen).contains("second-chunk"));
    gate.add_permits(1);
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest))
        .await
        .unwrap()
        .unwrap();
    assert!(String::from_utf8_lossy(&rest).contains("second-chunk"));
}

#[tokio::test]
async fn forwarding_headers_are_set_and_hop_by_hop_headers_removed() {
    // The client is not a trusted proxy (none is by default): its X-Forwarded-For is replaced.
    let up = Upstream::counting().await;
    let gw = gateway(&up.url(), PAYMENTS).await;
    let http = Http::new(gw.addr());
    http.request("POST", "/payments")
        .header("idempotency-key", "k")
        .header("x-forwarded-for", "203.0.113.9")
        .header("connection", "x-private")
        .header("x-private", "hop")
        .header("proxy-authorization", "Basic c2VjcmV0")
        .header("x-end-to-end", "kept")
        .json("{}")
        .send()
        .await;
    let h = &up.seen()[0].headers;
    assert_eq!(h["x-forwarded-for"], "127.0.0.1");
    assert_eq!(h["x-forwarded-proto"], "http");
    assert_eq!(h["x-forwarded-host"], gw.addr().to_string());
    assert_eq!(h["x-end-to-end"], "kept");
    assert_eq!(
        h["idempotency-key"], "k",
        "the key is forwarded for the upstream's own use"
    );
    // Named in Connection, kept (as nginx does): see hostile.rs for why.
    assert_eq!(h["x-private"], "hop");
    assert!(h.get("proxy-authorization").is_none());
}

// 10. Responses too large to keep -------------------------------------------------------------

#[tokio::test]
async fn a_response_over_max_stored_response_streams_and_replays_are_explicit() {
    let big = "z".repeat(5000);
    let b2 = big.clone();
    let up = Upstream::start(move |_, _| Reply::Respond {
        status: 201,
        headers: vec![("content-type", "text/plain".into()), ("x-id", "42".into())],
        body: Bytes::from(b2.clone()),
    })
    .await;
    let gw = gateway(
        &up.url(),
        "[[routes]]\npath = \"/payments\"\nmax_stored_response = 1024\n",
    )
    .await;
    let http = Http::new(gw.addr());
    let first = http.post("/payments", "k", "{}").await;
    assert_eq!(first.status, 201);
    assert_eq!(first.text(), big, "the first client gets the whole body");
    let replay = http.post("/payments", "k", "{}").await;
    assert_eq!(replay.status, 201);
    assert!(replay.is_replay());
    assert_eq!(replay.header("x-id"), Some("42"));
    assert!(replay.body.is_empty());
    assert_eq!(replay.header("content-length"), Some("0"));
    assert_eq!(replay.header("idemgate-body-omitted"), Some("true"));
    assert_eq!(up.executions(), 1, "never executes again");
}

// 11. Upstream unreachable ----------------------------------------------------------------------

#[tokio::test]
async fn an_unreachable_upstream_releases_the_key_and_a_retry_runs() {
    let addr = closed_port().await;
    let gw = gateway(&format!("http://{addr}"), PAYMENTS).await;
    let http = Http::new(gw.addr());
    let got = http.post("/payments", "k", "{}").await;
    assert_eq!(got.status, 502);
    assert_eq!(got.problem_type(), "upstream-unreachable");
    // The upstream comes up: the same key now executes.
    let up = Upstream::start_on(addr, |_, _| Reply::json(201, "{\"ok\":1}")).await;
    let retry = http.post("/payments", "k", "{}").await;
    assert_eq!(retry.status, 201);
    assert!(!retry.is_replay());
    assert_eq!(up.executions(), 1);
}

#[tokio::test]
async fn pass_through_to_an_unreachable_upstream_is_a_502_problem() {
    let addr = closed_port().await;
    let gw = gateway(&format!("http://{addr}"), PAYMENTS).await;
    let got = Http::new(gw.addr())
        .request("GET", "/anything")
        .send()
        .await;
    assert_eq!(got.status, 502);
    assert_eq!(got.problem_type(), "upstream-unreachable");
}

// Unknown outcomes: sent, but no complete answer ------------------------------------------------

#[tokio::test]
async fn a_reset_after_the_request_was_sent_is_an_unknown_outcome_never_rerun() {
    let up = Upstream::start(|_, _| Reply::Reset).await;
    let gw = gateway(&up.url(), PAYMENTS).await;
    let http = Http::new(gw.addr());
    let a = http.post("/payments", "k", "{}").await;
    assert_eq!(a.status, 502);
    assert_eq!(a.problem_type(), "outcome-unknown");
    let b = http.post("/payments", "k", "{}").await;
    assert_eq!(b.problem_type(), "outcome-unknown");
    assert_eq!(up.executions(), 1, "the retry is not executed");
}

#[tokio::test]
async fn an_upstream_timeout_is_an_unknown_outcome() {
    let up = Upstream::start(|_, _| Reply::Hang).await;
    let gw = gateway(
        &up.url(),
        "[[routes]]\npath = \"/payments\"\nupstream_timeout = \"200ms\"\n",
    )
    .await;
    let http = Http::new(gw.addr());
    let a = http.post("/payments", "k", "{}").await;
    assert_eq!(a.status, 504);
    assert_eq!(a.problem_type(), "outcome-unknown");
    let b = http.post("/payments", "k", "{}").await;
    assert_eq!(b.status, 504);
    assert_eq!(up.executions(), 1);
}

// Nothing lost ----------------------------------------------------------------------------------

#[tokio::test]
async fn a_client_that_hangs_up_mid_flight_still_gets_its_result_on_retry() {
    let (up, gate) = Upstream::gated().await;
    let gw = gateway(&up.url(), PAYMENTS).await;
    let http = Http::new(gw.addr());
    let h1 = http.clone();
    let original = tokio::spawn(async move { h1.post("/payments", "k", "{}").await });
    up.next_arrival().await;
    original.abort(); // the client gives up and closes its connection
    let _ = original.await;
    gate.add_permits(1);
    let retry = http.post("/payments", "k", "{}").await;
    assert_eq!(retry.status, 201);
    assert!(
        retry.is_replay(),
        "the result of the abandoned original was stored"
    );
    assert_eq!(&retry.body[..], b"{\"n\":1}");
    assert_eq!(up.executions(), 1);
}

#[tokio::test]
async fn graceful_shutdown_lets_in_flight_requests_finish() {
    let gate = Arc::new(Semaphore::new(0));
    let g = Arc::clone(&gate);
    let up = Upstream::start(move |_, _| Reply::json(201, "{\"done\":true}").gated(&g)).await;
    let gw = gateway(&up.url(), PAYMENTS).await;
    let addr = gw.addr();
    let http = Http::new(addr);
    let h1 = http.clone();
    let in_flight = tokio::spawn(async move { h1.post("/payments", "k", "{}").await });
    up.next_arrival().await;
    let stopping = tokio::spawn(gw.shutdown());
    // Wait until the listener is closed: new connections are refused.
    eventually(|| async { tokio::net::TcpStream::connect(addr).await.is_err() }).await;
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "listener still open"
    );
    gate.add_permits(1);
    let got = in_flight.await.unwrap();
    assert_eq!(got.status, 201);
    assert_eq!(&got.body[..], b"{\"done\":true}");
    tokio::time::timeout(Duration::from_secs(10), stopping)
        .await
        .unwrap()
        .unwrap();
}

// 12. The memory store's bound ------------------------------------------------------------------

#[tokio::test]
async fn at_the_memory_bound_new_keys_get_503_and_old_ones_still_replay() {
    let up = Upstream::counting().await;
    let gw = gateway(
        &up.url(),
        &format!("[store]\nbackend = \"memory\"\nmax_keys = 2\n{PAYMENTS}"),
    )
    .await;
    let http = Http::new(gw.addr());
    assert_eq!(http.post("/payments", "a", "{}").await.status, 201);
    assert_eq!(http.post("/payments", "b", "{}").await.status, 201);
    let c = http.post("/payments", "c", "{}").await;
    assert_eq!(c.status, 503);
    assert_eq!(c.problem_type(), "store-full");
    assert!(c.header("retry-after").is_some());
    assert!(http.post("/payments", "a", "{}").await.is_replay());
    assert!(http.post("/payments", "b", "{}").await.is_replay());
    assert_eq!(up.executions(), 2);
}

// Protocols -------------------------------------------------------------------------------------

#[tokio::test]
async fn http2_clients_are_served() {
    let up = Upstream::counting().await;
    let gw = gateway(&up.url(), PAYMENTS).await;
    let client: hyper_util::client::legacy::Client<_, http_body_util::Full<Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .http2_only(true)
            .build_http();
    let mut statuses = Vec::new();
    for _ in 0..2 {
        let req = http::Request::post(format!("http://{}/payments", gw.addr()))
            .header("idempotency-key", "h2")
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(Bytes::from_static(b"{}")))
            .unwrap();
        let resp = client.request(req).await.unwrap();
        statuses.push((
            resp.status().as_u16(),
            resp.headers().get("idempotent-replayed").is_some(),
        ));
    }
    assert_eq!(statuses, vec![(201, false), (201, true)]);
    assert_eq!(up.executions(), 1);
    assert_eq!(up.seen()[0].headers["host"], gw.addr().to_string());
}

/// An upstream that switches to an echo protocol on `Upgrade: websocket` (101), then sends back
/// every byte it gets.
pub(crate) async fn echo_upstream() -> std::net::SocketAddr {
    use hyper::service::service_fn;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            tokio::spawn(async move {
                let service = service_fn(
                    |mut req: hyper::Request<hyper::body::Incoming>| async move {
                        let upgraded = hyper::upgrade::on(&mut req);
                        tokio::spawn(async move {
                            if let Ok(io) = upgraded.await {
                                let mut io = hyper_util::rt::TokioIo::new(io);
                                let (mut r, mut w) = tokio::io::split(&mut io);
                                let _ = tokio::io::copy(&mut r, &mut w).await;
                            }
                        });
                        let resp = hyper::Response::builder()
                            .status(101)
                            .header("upgrade", "websocket")
                            .header("connection", "Upgrade")
                            .header("sec-websocket-accept", "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=")
                            .body(http_body_util::Empty::<Bytes>::new())
                            .unwrap();
                        Ok::<_, std::convert::Infallible>(resp)
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(sock), service)
                    .with_upgrades()
                    .await;
            });
        }
    });
    addr
}

/// `idemgate_tunnels_open` now.
fn tunnels_open(gw: &Running) -> Option<String> {
    gw.gateway()
        .metrics()
        .encode()
        .lines()
        .find_map(|l| l.strip_prefix("idemgate_tunnels_open "))
        .map(|v| v.trim().to_string())
}

/// Sends a few messages (a frame, 3000 bytes) through a tunnel to the echo upstream and checks
/// each comes back whole.
async fn echoes<S>(s: &mut S)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    for message in [&b"hello"[..], b"\x81\x05world", &[7u8; 3000]] {
        s.write_all(message).await.unwrap();
        let mut back = vec![0u8; message.len()];
        tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut back))
            .await
            .expect("no echo through the tunnel")
            .unwrap();
        assert_eq!(back, message);
    }
}

/// A WebSocket handshake outside any route is passed through, and once the upstream switches
/// protocols the bytes flow both ways until the client closes; on an idempotent route an
/// upgrade is refused.
#[tokio::test]
async fn websocket_upgrades_pass_through_and_are_refused_on_idempotent_routes() {
    let echo = echo_upstream().await;
    let gw = gateway(&format!("http://{echo}"), PAYMENTS).await;
    let (mut s, head) = websocket(gw.addr()).await;
    let head = head.to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 101"), "{head}");
    assert!(head.contains("upgrade: websocket"), "{head}");
    assert!(
        head.contains("sec-websocket-accept: s3pplmbitxaq9kygzzhzrbk+xoo="),
        "{head}"
    );
    echoes(&mut s).await;
    assert_eq!(tunnels_open(&gw).as_deref(), Some("1"));
    drop(s);
    assert!(
        eventually(|| async { tunnels_open(&gw).as_deref() == Some("0") }).await,
        "the tunnel outlived its client"
    );

    let refused = raw(
        gw.addr(),
        b"POST /payments HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k\r\nUpgrade: websocket\r\nConnection: Upgrade, close\r\nContent-Length: 0\r\n\r\n",
    )
    .await;
    assert!(refused.starts_with("HTTP/1.1 400"), "{refused}");
    assert!(refused.contains("upgrade-refused"), "{refused}");
}

/// A WebSocket over HTTP/2 (RFC 8441 extended CONNECT) is relayed to the upstream as an
/// HTTP/1.1 upgrade: the client gets 200, then bytes flow both ways; a route's path refuses it,
/// and a plain CONNECT stays refused.
#[tokio::test]
async fn websockets_over_http2_are_relayed_as_http1_upgrades() {
    use hyper::client::conn::http2;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let echo = echo_upstream().await;
    let mut cfg = config(
        &format!("http://{echo}"),
        &format!("{PAYMENTS}[[routes]]\nname = \"feed\"\npath = \"/feed\"\nmethods = [\"GET\"]\n"),
    );
    // A short idle deadline, which the tunnel must outlive: its stream keeps the connection busy.
    cfg.server.deadlines.idle = Duration::from_millis(500);
    let gw = Running::start(cfg).await.unwrap();
    let tcp = tokio::net::TcpStream::connect(gw.addr()).await.unwrap();
    let (mut h2, conn) = http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let empty = || http_body_util::Empty::<Bytes>::new();
    // Answered by the gateway itself: by then its SETTINGS (which allow extended CONNECT) are in.
    let first = h2
        .send_request(
            hyper::Request::post(format!("http://{}/payments", gw.addr()))
                .body(empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(first.status(), 400);
    let websocket = |path: &str| {
        let mut req = hyper::Request::connect(format!("http://{}{path}", gw.addr()))
            .header("sec-websocket-version", "13")
            .body(empty())
            .unwrap();
        req.extensions_mut()
            .insert(hyper::ext::Protocol::from_static("websocket"));
        req
    };

    let mut resp = h2.send_request(websocket("/chat")).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers().get("sec-websocket-accept").is_none());
    let stream = hyper::upgrade::on(&mut resp).await.unwrap();
    let mut stream = hyper_util::rt::TokioIo::new(stream);
    echoes(&mut stream).await;
    assert_eq!(tunnels_open(&gw).as_deref(), Some("1"));
    // Silent for three idle deadlines: no signal can say "nothing happened", so this one waits.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    stream.write_all(b"still there").await.unwrap();
    let mut back = [0u8; 11];
    tokio::time::timeout(Duration::from_secs(5), stream.read_exact(&mut back))
        .await
        .expect("the tunnel's connection was closed as idle")
        .unwrap();
    assert_eq!(&back, b"still there");
    drop(stream);
    assert!(
        eventually(|| async { tunnels_open(&gw).as_deref() == Some("0") }).await,
        "the tunnel outlived its stream"
    );

    // On a route's path: refused, nothing relayed.
    let refused = h2.send_request(websocket("/feed")).await.unwrap();
    assert_eq!(refused.status(), 400);
    let body = http_body_util::BodyExt::collect(refused.into_body())
        .await
        .unwrap()
        .to_bytes();
    assert!(String::from_utf8_lossy(&body).contains("upgrade-refused"));
    // A CONNECT without :protocol is a forward proxy's, never served.
    let plain = h2
        .send_request(
            hyper::Request::connect(gw.addr().to_string())
                .body(empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(plain.status(), 405);
}

/// The certificate-subject header is the gateway's alone: sent by a client (or its underscore
/// twin, which CGI-style servers read as the same), it never reaches the upstream, on a route or
/// not; other headers of that length pass.
#[tokio::test]
async fn a_client_cannot_send_the_certificate_subject_header() {
    let up = Upstream::counting().await;
    let gw = gateway(&up.url(), PAYMENTS).await;
    let http = Http::new(gw.addr());
    for (method, path) in [("POST", "/payments"), ("GET", "/elsewhere")] {
        let got = http
            .request(method, path)
            .header("idempotency-key", "subject-spoof")
            .header("x-client-cert-subject", "CN=alice")
            .header("x_client_cert_subject", "CN=alice")
            .header("x-twenty-one-bytes-ok", "kept")
            .json("{}")
            .send()
            .await;
        assert!(got.status.is_success(), "{got:?}");
        let seen = up.arrival_at(path).await;
        assert!(
            seen.headers.get("x-client-cert-subject").is_none(),
            "{seen:?}"
        );
        assert!(
            seen.headers.get("x_client_cert_subject").is_none(),
            "{seen:?}"
        );
        assert_eq!(seen.headers["x-twenty-one-bytes-ok"], "kept");
    }
}
