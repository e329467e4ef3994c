//! Traces (`[telemetry]`): spans exported over OTLP/HTTP to a receiver that decodes them with the
//! official protobuf types; the caller's trace continued and the upstream given the gateway's.

use opentelemetry_proto::tonic::trace::v1::Span;

use crate::support::otlp::{attribute, hex, Collector};
use crate::support::redis::{free_port, RedisServer};
use crate::support::*;

/// A loopback address free now.
fn free_addr() -> std::net::SocketAddr {
    std::net::SocketAddr::from(([127, 0, 0, 1], free_port(false)))
}

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
        ("url.scheme", "http"),
    ] {
        assert_eq!(attribute(&server, key).as_deref(), Some(value), "{key}");
    }
    assert_eq!(
        attribute(&server, "idemgate.key.id").map(|k| k.len()),
        Some(16)
    );
    // The phases: the store's calls and the upstream call, children of the request's span.
    let child = |name: &'static str| {
        let server = server.span_id.clone();
        move |s: &Span| s.name == name && s.parent_span_id == server
    };
    for op in ["reserve", "complete"] {
        let store = collector
            .span(child(if op == "reserve" {
                "store reserve"
            } else {
                "store complete"
            }))
            .await;
        assert_eq!(attribute(&store, "db.system").as_deref(), Some("memory"));
        assert_eq!(attribute(&store, "db.operation.name").as_deref(), Some(op));
        assert_eq!(store.kind, 3, "SPAN_KIND_CLIENT");
    }
    let call = collector.span(child("upstream")).await;
    assert_eq!(call.kind, 3, "SPAN_KIND_CLIENT");
    assert_eq!(hex(&call.trace_id), TRACE);
    assert_eq!(
        attribute(&call, "http.response.status_code").as_deref(),
        Some("201")
    );
    assert_eq!(
        attribute(&call, "server.address").as_deref(),
        Some("127.0.0.1")
    );
    let port = up.url().rsplit(':').next().unwrap().to_string();
    assert_eq!(attribute(&call, "server.port"), Some(port));
    // The upstream's traceparent: the same trace, the gateway's upstream call as parent.
    let seen = up.seen();
    let sent = seen[0].headers["traceparent"].to_str().unwrap().to_string();
    assert_eq!(sent, format!("00-{TRACE}-{}-01", hex(&call.span_id)));
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
    // In a trace of its own (it came without a traceparent), linked to the execution it replays.
    assert_ne!(hex(&replayed.trace_id), TRACE);
    assert_eq!(replayed.links.len(), 1, "{:?}", replayed.links);
    assert_eq!(hex(&replayed.links[0].trace_id), TRACE);
    assert_eq!(replayed.links[0].span_id, server.span_id);
    assert_eq!(
        attribute(&replayed, "idemgate.original_trace_id").as_deref(),
        Some(TRACE)
    );
    // The link is the gateway's: the replay's content-length is its own, the link is not sent.
    assert!(!retry
        .headers
        .get_all("content-length")
        .iter()
        .any(|v| v.as_bytes().starts_with(b"00-")));
    assert_eq!(up.executions(), 1);
    // Nothing of the key or the credential in any span: names, attributes, events, links.
    let dump = format!("{:?}", collector.spans());
    assert!(
        !dump.contains("order-secret-key-1") && !dump.contains("sekrit"),
        "{dump}"
    );
}

/// A collector that takes the connection and never answers costs no request anything, the
/// spans its queue cannot hold are counted, and shutdown still ends (its last export is
/// bounded).
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
    let gw = Running::start(config(&up.url(), &text).with_admin())
        .await
        .unwrap();
    let http = Http::new(gw.addr());
    // About 6 spans each (2 requests, their store and upstream calls): past the queue's 2048
    // while the first export waits out its deadline.
    for i in 0..400 {
        let got = http.post("/payments", &format!("k{i}"), "{}").await;
        assert_eq!(got.status, 201);
        assert!(http
            .post("/payments", &format!("k{i}"), "{}")
            .await
            .is_replay());
    }
    assert_eq!(up.executions(), 400);
    let metrics = scrape(gw.admin_addr().unwrap()).await;
    let full = metrics["idemgate_trace_spans_dropped_total{reason=\"queue_full\"}"];
    assert!(full > 0.0, "the queue's overflow counted: {full}");
    let ended = tokio::time::timeout(std::time::Duration::from_secs(30), gw.shutdown()).await;
    assert!(ended.is_ok(), "shutdown waited on the collector");
}

/// A collector that is down: every request still answered, and the spans it did not take
/// counted in `/metrics`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_a_down_collector_did_not_take_are_counted() {
    let down = free_addr();
    let up = Upstream::counting().await;
    let text = format!("[telemetry]\notlp_endpoint = \"http://{down}\"\n{PAYMENTS}");
    let gw = Running::start(config(&up.url(), &text).with_admin())
        .await
        .unwrap();
    let admin = gw.admin_addr().unwrap();
    let http = Http::new(gw.addr());
    for i in 0..20 {
        assert_eq!(
            http.post("/payments", &format!("k{i}"), "{}").await.status,
            201
        );
    }
    let dropped = || async {
        scrape(admin)
            .await
            .get("idemgate_trace_spans_dropped_total{reason=\"export_failed\"}")
            .copied()
            .unwrap_or(0.0)
    };
    // Each request made a server span and at least its store and upstream calls' spans.
    let counted = eventually(|| async { dropped().await >= 20.0 * 4.0 }).await;
    assert!(counted, "dropped: {}", dropped().await);
    let metrics = scrape(admin).await;
    assert_eq!(
        metrics.get("idemgate_trace_spans_dropped_total{reason=\"queue_full\"}"),
        Some(&0.0)
    );
    assert_eq!(up.executions(), 20);
}

/// A message's span continues the producer's trace (a Redis stream field), the handler's
/// call is its child and the handler's `traceparent`; a duplicate delivery, in a trace of its
/// own, links to the attempt that ran the handler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_messages_span_continues_the_producers_trace() {
    const PRODUCER_SPAN: &str = "1111111111111111";
    const OTHER_TRACE: &str = "5bf92f3577b34da6a3ce929d0e0e4737";
    let collector = Collector::start().await;
    let redis = RedisServer::start();
    let up = Upstream::counting().await;
    let admin = free_addr();
    let text = format!(
        r#"[server]
listen = "127.0.0.1:0"
admin = "{admin}"
[store]
backend = "redis"
url = "{redis}"
[upstream]
url = "{up}"
[telemetry]
otlp_endpoint = "{otlp}"
[[consumers]]
name = "orders"
source = {{ redis_stream = "orders", group = "g" }}
handler = "{up}/orders"
key = {{ json = "/messageId" }}
"#,
        redis = redis.url(),
        up = up.url(),
        otlp = collector.url,
    );
    let _gw = GatewayProcess::start(&text);
    let body = r#"{"messageId": "m-secret-1"}"#;
    let first = format!("00-{TRACE}-{PRODUCER_SPAN}-01");
    redis.cli(&["XADD", "orders", "*", "body", body, "traceparent", &first]);
    let message = collector
        .span(|s| s.name == "process orders" && hex(&s.trace_id) == TRACE)
        .await;
    assert_eq!(message.kind, 5, "SPAN_KIND_CONSUMER");
    assert_eq!(
        attribute(&message, "messaging.system").as_deref(),
        Some("redis")
    );
    assert_eq!(
        attribute(&message, "messaging.destination.name").as_deref(),
        Some("orders")
    );
    assert_eq!(hex(&message.parent_span_id), PRODUCER_SPAN);
    assert_eq!(
        attribute(&message, "idemgate.outcome").as_deref(),
        Some("delivered")
    );
    let handler_span = message.span_id.clone();
    let call = collector
        .span(|s| s.name == "handler" && s.parent_span_id == handler_span)
        .await;
    let seen = up.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(
        seen[0].headers["traceparent"],
        format!("00-{TRACE}-{}-01", hex(&call.span_id)).as_str(),
        "the handler's parent is the gateway's call, in the producer's trace"
    );
    let again = format!("00-{OTHER_TRACE}-{PRODUCER_SPAN}-01");
    redis.cli(&["XADD", "orders", "*", "body", body, "traceparent", &again]);
    let duplicate = collector
        .span(|s| s.name == "process orders" && hex(&s.trace_id) == OTHER_TRACE)
        .await;
    assert_eq!(
        attribute(&duplicate, "idemgate.outcome").as_deref(),
        Some("deduplicated")
    );
    assert_eq!(duplicate.links.len(), 1);
    assert_eq!(duplicate.links[0].span_id, message.span_id);
    assert_eq!(up.executions(), 1);
    let dump = format!("{:?}", collector.spans());
    assert!(!dump.contains("m-secret-1"), "{dump}");
}

/// Requests outside the idempotent routes: untouched (the caller's `traceparent` goes on as it
/// came) unless `trace_passthrough` is on, when they get a span of their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pass_through_requests_are_traced_only_when_asked() {
    let collector = Collector::start().await;
    let caller = format!("00-{TRACE}-{CALLER_SPAN}-01");
    for on in [false, true] {
        let up = Upstream::counting().await;
        let text = format!(
            "[telemetry]\notlp_endpoint = \"{}\"\ntrace_passthrough = {on}\n{PAYMENTS}",
            collector.url
        );
        let gw = Running::start(config(&up.url(), &text)).await.unwrap();
        let got = Http::new(gw.addr())
            .request("GET", "/elsewhere")
            .header("traceparent", &caller)
            .send()
            .await;
        assert_eq!(got.status, 201, "the counting upstream's answer");
        let sent = up.seen()[0].headers["traceparent"]
            .to_str()
            .unwrap()
            .to_string();
        if !on {
            assert_eq!(sent, caller, "passed on untouched");
            continue;
        }
        let span = collector
            .span(|s| s.name == "GET" && hex(&s.parent_span_id) == CALLER_SPAN)
            .await;
        assert_eq!(sent, format!("00-{TRACE}-{}-01", hex(&span.span_id)));
        assert_eq!(
            attribute(&span, "idemgate.outcome").as_deref(),
            Some("passthrough")
        );
        assert_eq!(attribute(&span, "url.path").as_deref(), Some("/elsewhere"));
        // A method of the client's own invention names no span.
        let odd = Http::new(gw.addr())
            .request("FROBNICATE", "/odd")
            .send()
            .await;
        assert_eq!(odd.status, 201);
        let other = collector
            .span(|s| attribute(s, "url.path").as_deref() == Some("/odd"))
            .await;
        assert_eq!(other.name, "HTTP");
        assert_eq!(
            attribute(&other, "http.request.method").as_deref(),
            Some("_OTHER")
        );
        gw.shutdown().await;
    }
    assert!(
        collector.spans().iter().filter(|s| s.name == "GET").count() == 1,
        "no span while it was off"
    );
}

/// An execution that goes on after its client hung up keeps the request's trace ids on its log
/// lines: here the line that names it, cut off by the end of the shutdown grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_detached_executions_log_lines_keep_the_requests_ids() {
    let collector = Collector::start().await;
    let up = Upstream::start(|_, _| Reply::Hang).await;
    let admin = free_addr();
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin = \"{admin}\"\nshutdown_grace = \"1s\"\n[upstream]\nurl = \"{}\"\n[telemetry]\notlp_endpoint = \"{}\"\n{PAYMENTS}",
        up.url(),
        collector.url
    );
    let gw = GatewayProcess::start(&text);
    let http = Http::new(gw.addr);
    let held = tokio::spawn(async move {
        http.request("POST", "/payments")
            .header("idempotency-key", "cut-1")
            .header("traceparent", &format!("00-{TRACE}-{CALLER_SPAN}-01"))
            .json("{}")
            .send()
            .await
    });
    up.next_arrival().await;
    // The client hangs up: the execution goes on in a task of its own.
    held.abort();
    let _ = held.await;
    // The gateway has seen it go (the request's future dropped): only the execution is left.
    let gone = eventually(|| async {
        scrape(admin).await.get("idemgate_requests_in_flight") == Some(&0.0)
    })
    .await;
    assert!(gone, "the hang-up was never noticed");
    gw.signal("-TERM");
    let line = gw.wait_log("cut off by the end of the shutdown grace");
    assert!(line.contains(&format!("trace_id={TRACE}")), "{line}");
    gw.wait_log("shut down");
}
