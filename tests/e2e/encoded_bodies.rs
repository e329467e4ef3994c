//! Request bodies with a `Content-Encoding`, through the real binary (issue 44): compared by what
//! they say (a gzipped retry, whose header carries a new time, replays), bounded by `max_body`
//! once decoded (a bomb gets `413`, nothing forwarded), and forwarded as they came.

use std::io::Write;

use crate::support::*;

/// The real binary on the memory store, with one route, `/payments`, taking bodies up to 64 KiB.
fn binary(up: &Upstream) -> GatewayProcess {
    GatewayProcess::start(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nurl = \"{}\"\n[store]\nbackend = \"memory\"\n[defaults]\nmax_body = \"64KiB\"\n[[routes]]\npath = \"/payments\"\n",
        up.url()
    ))
}

/// `data` gzipped with `mtime` in its header, as two gzips a second apart differ.
fn gzip(data: &[u8], mtime: u32) -> Vec<u8> {
    let mut e = flate2::GzBuilder::new()
        .mtime(mtime)
        .write(Vec::new(), flate2::Compression::default());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

fn deflate(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::best());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

fn brotli(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut w = brotli::CompressorWriter::new(&mut out, 4096, 5, 22);
    w.write_all(data).unwrap();
    drop(w);
    out
}

fn zstd(data: &[u8]) -> Vec<u8> {
    zstd::stream::encode_all(data, 3).unwrap()
}

async fn send(http: &Http, key: &str, coding: Option<&str>, body: Vec<u8>) -> Got {
    let mut req = http
        .request("POST", "/payments")
        .header("idempotency-key", key)
        .header("content-type", "application/json");
    if let Some(coding) = coding {
        req = req.header("content-encoding", coding);
    }
    req.body(body).send().await
}

#[tokio::test]
async fn the_same_content_in_any_coding_is_the_same_request() {
    let up = Upstream::counting().await;
    let gw = binary(&up);
    let http = Http::new(gw.addr);
    let content = br#"{"amount":1000,"currency":"EUR"}"#;
    let first = gzip(content, 1_700_000_000);
    let got = send(&http, "k", Some("gzip"), first.clone()).await;
    assert_eq!(got.status, 201, "{got:?}");
    let seen = up.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].body, first, "forwarded as it came");
    assert_eq!(seen[0].headers["content-encoding"], "gzip");
    let retries = [
        (Some("gzip"), gzip(content, 1_700_000_001)),
        (Some("deflate"), deflate(content)),
        (Some("br"), brotli(content)),
        (Some("zstd"), zstd(content)),
        (Some("gzip, br"), brotli(&gzip(content, 5))),
        (None, br#"{ "currency": "EUR", "amount": 1e3 }"#.to_vec()),
    ];
    for (coding, body) in retries {
        let got = send(&http, "k", coding, body).await;
        assert!(got.is_replay(), "{coding:?}: {got:?}");
    }
    let other = send(&http, "k", Some("gzip"), gzip(br#"{"amount":1}"#, 0)).await;
    assert_eq!(other.status, 409, "{other:?}");
    assert_eq!(up.executions(), 1);
}

#[tokio::test]
async fn a_body_past_max_body_once_decoded_is_refused_and_not_forwarded() {
    let up = Upstream::counting().await;
    let gw = binary(&up);
    let http = Http::new(gw.addr);
    // 4 MiB of JSON in well under 64 KiB.
    let big = format!(r#"{{"pad":"{}"}}"#, "a".repeat(4 << 20));
    for (coding, body) in [
        ("gzip", gzip(big.as_bytes(), 0)),
        ("br", brotli(big.as_bytes())),
        ("zstd", zstd(big.as_bytes())),
        ("gzip, gzip", gzip(&gzip(big.as_bytes(), 0), 0)),
    ] {
        assert!(body.len() < 64 << 10, "{coding}: {}", body.len());
        let key = format!("bomb-{}", coding.replace(", ", "-"));
        let got = send(&http, &key, Some(coding), body).await;
        assert_eq!(got.status, 413, "{coding}: {got:?}");
        assert_eq!(got.problem_type(), "body-too-large");
    }
    assert_eq!(up.executions(), 0, "nothing forwarded");
    // The key was never taken: the same key with a body that fits runs.
    let fits = send(&http, "bomb-gzip", Some("gzip"), gzip(b"{}", 0)).await;
    assert_eq!(fits.status, 201, "{fits:?}");
}

#[tokio::test]
async fn a_coding_the_gateway_cannot_undo_is_refused() {
    let up = Upstream::counting().await;
    let gw = binary(&up);
    let http = Http::new(gw.addr);
    let got = send(&http, "c1", Some("compress"), b"\x1f\x9d\x90".to_vec()).await;
    assert_eq!(got.status, 415, "{got:?}");
    assert_eq!(got.problem_type(), "unsupported-content-encoding");
    assert_eq!(
        got.header("accept-encoding"),
        Some("gzip, deflate, br, zstd")
    );
    let broken = send(&http, "c2", Some("gzip"), b"{\"amount\":1}".to_vec()).await;
    assert_eq!(broken.status, 400, "{broken:?}");
    assert_eq!(broken.problem_type(), "undecodable-body");
    assert_eq!(up.executions(), 0);
}

/// A key taken from a body field is read from the decoded body.
#[tokio::test]
async fn a_key_in_a_compressed_body_is_found() {
    let up = Upstream::counting().await;
    let gw = GatewayProcess::start(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nurl = \"{}\"\n[store]\nbackend = \"memory\"\n[[routes]]\npath = \"/events\"\nkey = {{ json = [\"/id\"] }}\n",
        up.url()
    ));
    let http = Http::new(gw.addr);
    let event = br#"{"id":"evt_1","amount":5}"#;
    let send = |body: Vec<u8>| {
        http.request("POST", "/events")
            .header("content-type", "application/json")
            .header("content-encoding", "gzip")
            .body(body)
            .send()
    };
    assert_eq!(send(gzip(event, 1)).await.status, 201);
    let again = send(gzip(event, 2)).await;
    assert!(again.is_replay(), "{again:?}");
    assert_eq!(up.executions(), 1);
}

/// An upstream that reads no compressed bodies answers `415`: the key is released, so the
/// client's plain retry runs rather than getting that refusal replayed.
#[tokio::test]
async fn an_upstream_415_releases_the_key_for_a_plain_retry() {
    let up = Upstream::start(|seen, _| {
        if seen.headers.contains_key("content-encoding") {
            Reply::json(415, r#"{"error":"unsupported encoding"}"#)
        } else {
            Reply::json(201, r#"{"id":"pay_1"}"#)
        }
    })
    .await;
    let gw = binary(&up);
    let http = Http::new(gw.addr);
    let content = br#"{"amount":1000}"#;
    let refused = send(&http, "k415", Some("gzip"), gzip(content, 0)).await;
    assert_eq!(refused.status, 415, "{refused:?}");
    let plain = send(&http, "k415", None, content.to_vec()).await;
    assert_eq!(plain.status, 201, "{plain:?}");
    assert!(!plain.is_replay());
    let again = send(&http, "k415", Some("gzip"), gzip(content, 9)).await;
    assert!(again.is_replay(), "the same content: {again:?}");
    assert_eq!(up.executions(), 2);
}

/// The decoded body's share of `server.max_buffered` is given back once the fingerprint is
/// made: while the upstream works, only the bytes as sent are held.
#[tokio::test]
async fn the_decoded_body_is_not_held_while_the_upstream_works() {
    let (up, gate) = Upstream::gated().await;
    let admin =
        std::net::SocketAddr::from(([127, 0, 0, 1], crate::support::redis::free_port(false)));
    let gw = GatewayProcess::start(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin = \"{admin}\"\n[upstream]\nurl = \"{}\"\n[store]\nbackend = \"memory\"\n[defaults]\nmax_body = \"2MiB\"\n[[routes]]\npath = \"/payments\"\n",
        up.url()
    ));
    let http = Http::new(gw.addr);
    let content = format!(r#"{{"pad":"{}"}}"#, "a".repeat(1 << 20));
    let body = gzip(content.as_bytes(), 0);
    let sent = body.len() as f64;
    let request = tokio::spawn({
        let http = http.clone();
        async move { send(&http, "held", Some("gzip"), body).await }
    });
    up.next_arrival().await;
    let held = scrape(admin).await["idemgate_buffered_request_bytes"];
    assert!(
        held >= sent && held < sent + 64.0 * 1024.0,
        "{held} bytes held for a {sent}-byte body of {} bytes decoded",
        content.len()
    );
    gate.add_permits(1);
    assert_eq!(request.await.unwrap().status, 201);
}
