//! Client scopes from headers and certificates: the same value in two headers is two clients, an
//! `Authorization` scheme is one credential in any spelling, keys stored before the derivation
//! changed still replay, and workloads that share a certificate subject are told apart by their
//! SPIFFE IDs.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use rcgen::DnType;

use crate::support::certs::Ca;
use crate::support::*;

async fn pay(http: &Http, key: &str, header: (&str, &str)) -> Got {
    http.request("POST", "/payments")
        .header("idempotency-key", key)
        .header(header.0, header.1)
        .json("{\"amount\":100}")
        .send()
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_value_in_two_headers_is_two_clients_and_a_scheme_is_one_credential() {
    let up = Upstream::counting().await;
    // A memory store holds no key of the previous version: nothing older is looked up (on a
    // durable store, for one ttl after the upgrade: keys_stored_before_..._still_replay).
    let listed = "[defaults]\nclient_header = [\"X-Api-Key\", \"Authorization\"]\n";
    let gw = gateway(&up.url(), &format!("{listed}{PAYMENTS}")).await;
    let http = Http::new(gw.addr());
    assert_eq!(pay(&http, "k", ("x-api-key", "V")).await.status, 201);
    let other = pay(&http, "k", ("authorization", "V")).await;
    assert_eq!(other.status, 201);
    assert!(
        !other.is_replay(),
        "a value in another header is another client"
    );
    assert_eq!(up.executions(), 2);
    drop(gw);

    let gw = gateway(&up.url(), PAYMENTS).await;
    let http = Http::new(gw.addr());
    let first = pay(&http, "k", ("authorization", "Bearer abc")).await;
    assert_eq!(first.status, 201);
    for spelled in ["bearer abc", "BEARER abc", "Bearer  abc"] {
        let retry = pay(&http, "k", ("authorization", spelled)).await;
        assert!(retry.is_replay(), "{spelled:?} is the same credential");
        assert_eq!(retry.body, first.body);
    }
    assert_eq!(up.executions(), 3);
}

/// A retry of a key stored before this version still replays. The store is written by the
/// gateway itself under a config whose derivation is, byte for byte, the previous version's for
/// these requests: it hashed a client header's value as sent, whichever header of the list it
/// came in, which is what the first header of a list other than `Authorization` still gets.
/// A route scoped by a header that carries JWTs (the default `Authorization` in front of an
/// OAuth API): counted per route, and the log says once what to set instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jwts_in_a_client_header_are_counted_and_warned_about_once() {
    let up = Upstream::counting().await;
    let admin =
        std::net::SocketAddr::from(([127, 0, 0, 1], crate::support::redis::free_port(false)));
    let gw = GatewayProcess::start(&TomlConfig::parse(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin = \"{admin}\"\n[upstream]\nurl = \"{}\"\n[store]\nbackend = \"memory\"\n{PAYMENTS}",
        up.url()
    )).text());
    let http = Http::new(gw.addr);
    let jwt = "Bearer eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJhbGljZSJ9.c2lnbmF0dXJl";
    for key in ["j1", "j2"] {
        assert_eq!(pay(&http, key, ("authorization", jwt)).await.status, 201);
    }
    assert_eq!(
        pay(&http, "j3", ("authorization", "Bearer sk_live_static"))
            .await
            .status,
        201
    );
    let (_, metrics) = admin_get(admin, "/metrics").await;
    assert!(
        metrics.contains("idemgate_client_header_jwt_total{route=\"payments\"} 2"),
        "{metrics}"
    );
    let warnings = gw
        .drain_logs()
        .iter()
        .filter(|l| l.contains("set client_jwt"))
        .count();
    assert_eq!(warnings, 1, "once per route");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_stored_before_the_scope_derivation_changed_still_replay() {
    let up = Upstream::counting().await;
    let dir = TempDir::new("scope-upgrade");
    let config = |client_header: toml::Value| {
        TomlConfig::parse(&format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nurl = \"{}\"\n[store]\nbackend = \"disk\"\npath = \"{}/store\"\n{PAYMENTS}",
            up.url(),
            dir.path.display()
        ))
        .set("defaults.client_header", client_header)
        .text()
    };
    // What the previous version stored for `Authorization: bearer abc` (a scheme spelled in lower
    // case) and for `Authorization: Bearer V` on a route listing ["X-Api-Key", "Authorization"].
    let before = GatewayProcess::start(&config("X-Api-Key".into()));
    let http = Http::new(before.addr);
    let lower = pay(&http, "u1", ("x-api-key", "bearer abc")).await;
    let second = pay(&http, "u2", ("x-api-key", "Bearer V")).await;
    assert_eq!(lower.status, 201);
    assert_eq!(second.status, 201);
    before.signal_and_wait("-TERM");

    let list = toml::Value::Array(vec!["X-Api-Key".into(), "Authorization".into()]);
    let after = GatewayProcess::start(&config(list));
    let http = Http::new(after.addr);
    let retry = pay(&http, "u1", ("authorization", "bearer abc")).await;
    assert!(retry.is_replay(), "{} {}", retry.status, retry.text());
    assert_eq!(retry.body, lower.body);
    let retry = pay(&http, "u2", ("authorization", "Bearer V")).await;
    assert!(retry.is_replay());
    assert_eq!(retry.body, second.body);
    // A new key is stored under today's derivation, and replays under it.
    assert_eq!(
        pay(&http, "u3", ("authorization", "bearer V")).await.status,
        201
    );
    assert!(pay(&http, "u3", ("authorization", "Bearer V"))
        .await
        .is_replay());
    assert_eq!(up.executions(), 3);
}

/// Mesh certificates: two workloads whose certificates share a subject (`O=SPIRE`) and differ in
/// their SPIFFE IDs are two scopes with `client_header = "X-Client-Cert-URI"`; a workload's
/// retry with its next certificate (same ID, new key) replays; a client-sent
/// `X-Client-Cert-URI` is ignored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workloads_sharing_a_subject_are_told_apart_by_their_spiffe_ids() {
    let ca = Ca::new("mesh CA");
    let (cert, key) = ca.leaf(&["localhost"], false);
    let dir = TempDir::new("spiffe");
    let write = |name: &str, text: &str| {
        let path = dir.path.join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    let up = Upstream::counting().await;
    let config = TomlConfig::parse(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nurl = \"{}\"\n[store]\nbackend = \"memory\"\n{PAYMENTS}",
        up.url()
    ))
    .set("server.tls_cert", write("cert.pem", &cert))
    .set("server.tls_key", write("key.pem", &key))
    .set("server.tls_client_ca", write("ca.pem", &ca.cert.pem()))
    .set("defaults.client_header", "X-Client-Cert-URI")
    .text();
    let gw = GatewayProcess::start(&config);
    let subject = [
        (DnType::OrganizationName, "SPIRE"),
        (DnType::CountryName, "US"),
    ];
    let (id_a, id_b) = (
        "spiffe://example.org/ns/pay/sa/a",
        "spiffe://example.org/ns/pay/sa/b",
    );
    let post = |sender: &mut hyper::client::conn::http1::SendRequest<Full<Bytes>>,
                spoof: Option<&str>| {
        let mut req = hyper::Request::post("/payments")
            .header("host", "localhost")
            .header("idempotency-key", "same-key")
            .header("content-type", "application/json");
        if let Some(s) = spoof {
            // Both spellings an upstream may read as X-Client-Cert-URI.
            req = req
                .header("x-client-cert-uri", s)
                .header("x-client_cert-uri", s);
        }
        let sent = sender.send_request(req.body(Full::new(Bytes::from_static(b"{}"))).unwrap());
        async move {
            let resp = sent.await.unwrap();
            let replay = resp.headers().contains_key("idempotent-replayed");
            let status = resp.status().as_u16();
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            (status, replay, body)
        }
    };

    let mut a = ca
        .session(gw.addr, Some(ca.client(&subject, &[id_a])))
        .await
        .unwrap();
    let first = post(&mut a, None).await;
    assert_eq!((first.0, first.1), (201, false));
    assert_eq!(up.next_arrival().await.headers["x-client-cert-uri"], id_a);
    // Same subject, another workload, claiming to be the first: its own scope and execution.
    let mut b = ca
        .session(gw.addr, Some(ca.client(&subject, &[id_b])))
        .await
        .unwrap();
    let other = post(&mut b, Some(id_a)).await;
    assert_eq!(
        (other.0, other.1),
        (201, false),
        "a workload was handed another's answer or refused"
    );
    let seen = up.next_arrival().await;
    assert_eq!(seen.headers["x-client-cert-uri"], id_b);
    assert!(
        seen.headers.get("x-client_cert-uri").is_none(),
        "a spoofed spelling reached the upstream"
    );
    // The first workload's retry, after its certificate rotated (a new key, the same ID).
    let mut rotated = ca
        .session(gw.addr, Some(ca.client(&subject, &[id_a])))
        .await
        .unwrap();
    let retry = post(&mut rotated, None).await;
    assert!(retry.1, "the rotated certificate is the same workload");
    assert_eq!(retry.2, first.2);
    assert_eq!(up.executions(), 2);
}
