//! Traces (`[telemetry]`): spans exported over OTLP/HTTP to a receiver that decodes them with the
//! official protobuf types; the caller's trace continued and the upstream given the gateway's.

use crate::support::otlp::{attribute, hex, Collector};
use crate::support::*;

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_request_continues_the_callers_trace_and_hands_its_own_span_on() {
    let collector = Collector::start().await;
    let up = Upstream::counting().await;
    let text = format!(
        "[telemetry]\notlp_endpoint = \"{}\"\nservice_name = \"idemgate-test\"\n{PAYMENTS}",
        collector.url
    );
    let gw = Running::start(config(&up.url(), &text)).await.unwrap();
    let http = Http::new(gw.addr());
    let got = http
        .request("POST", "/payments")
        .header("idempotency-key", "order-secret-key-1")
        .header("authorization", "Bearer sekrit-token")
        .header("traceparent", &format!("00-{TRACE}-{CALLER_SPAN}-01"))
        .header("tracestate", &format!("big={}", "x".repeat(600)))
        .json("{\"amount\":1}")
        .send()
        .await;
    assert_eq!(got.status, 201);
    let server = collector
        .span(|s| attribute(s, "idemgate.route").as_deref() == Some("payments"))
        .await;
    assert_eq!(hex(&server.trace_id), TRACE, "the caller's trace");
    assert_eq!(
        hex(&server.parent_span_id),
        CALLER_SPAN,
        "the caller's span is its parent"
    );
    assert_eq!(server.name, "POST /payments");
    assert_eq!(server.kind, 2, "SPAN_KIND_SERVER");
    assert!(collector.services().iter().all(|s| s == "idemgate-test"));
    for (key, value) in [
        ("http.request.method", "POST"),
        ("http.route", "/payments"),
        ("url.path", "/payments"),
        ("http.response.status_code", "201"),
        ("idemgate.outcome", "executed"),
        ("idemgate.replayed", "false"),
        ("network.protocol.version", "1.1"),
    ] {
        assert_eq!(attribute(&server, key).as_deref(), Some(value), "{key}");
    }
    assert_eq!(
        attribute(&server, "idemgate.key.id").map(|k| k.len()),
        Some(16)
    );
    // The upstream's traceparent: the same trace, the gateway's span as parent.
    let seen = up.seen();
    let sent = seen[0].headers["traceparent"].to_str().unwrap().to_string();
    assert_eq!(sent, format!("00-{TRACE}-{}-01", hex(&server.span_id)));
    // An oversized tracestate is not kept, nor sent on.
    assert!(
        !seen[0].headers.contains_key("tracestate") || seen[0].headers["tracestate"].is_empty()
    );
    assert!(server.trace_state.is_empty(), "{}", server.trace_state);
    // The retry's span: replayed.
    let retry = http
        .request("POST", "/payments")
        .header("idempotency-key", "order-secret-key-1")
        .header("authorization", "Bearer sekrit-token")
        .json("{\"amount\":1}")
        .send()
        .await;
    assert!(retry.is_replay());
    let replayed = collector
        .span(|s| attribute(s, "idemgate.outcome").as_deref() == Some("replayed"))
        .await;
    assert_eq!(
        attribute(&replayed, "idemgate.replayed").as_deref(),
        Some("true")
    );
    assert_eq!(up.executions(), 1);
    // Nothing of the key or the credential in any span.
    let dump = format!("{:?}", collector.spans());
    assert!(
        !dump.contains("order-secret-key-1") && !dump.contains("sekrit"),
        "{dump}"
    );
}

/// A collector that takes the connection and never answers costs no request anything, and
/// shutdown still ends (its last export is bounded).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_never_answers_never_holds_a_request() {
    let hung = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = hung.local_addr().unwrap();
    let _held = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = hung.accept().await {
            held.push(conn);
        }
    });
    let up = Upstream::counting().await;
    let text = format!("[telemetry]\notlp_endpoint = \"http://{addr}\"\n{PAYMENTS}");
    let gw = Running::start(config(&up.url(), &text)).await.unwrap();
    let http = Http::new(gw.addr());
    for i in 0..50 {
        let got = http.post("/payments", &format!("k{i}"), "{}").await;
        assert_eq!(got.status, 201);
        assert!(http
            .post("/payments", &format!("k{i}"), "{}")
            .await
            .is_replay());
    }
    assert_eq!(up.executions(), 50);
    let ended = tokio::time::timeout(std::time::Duration::from_secs(30), gw.shutdown()).await;
    assert!(ended.is_ok(), "shutdown waited on the collector");
}
