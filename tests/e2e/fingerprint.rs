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
