//! `client_jwt` through the real binary: a JWKS served by a real HTTP server with keys made
//! here; a client that refreshes its token keeps its keys, forgeries of every kind are refused
//! before anything runs, the issuer rotates its key without a restart, a key set endpoint that
//! goes down changes nothing for known keys, and no token reaches a log line.

use serde_json::{json, Value};

use crate::support::issuer::{hs256, now_s, unsigned, Jwks, SigningKey};
use crate::support::*;

const ISSUER: &str = "https://auth.example/";

fn claims(sub: &str, iat: u64, exp: u64) -> Value {
    json!({"iss": ISSUER, "sub": sub, "aud": ["payments-api"], "iat": iat, "exp": exp})
}

fn config(upstream: &str, jwks: &str) -> String {
    let admin = crate::support::redis::free_port(false);
    TomlConfig::parse(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:{admin}\"\n[upstream]\nurl = \"{upstream}\"\n[store]\nbackend = \"memory\"\n{PAYMENTS}"
    ))
    .set("defaults.client_jwt.jwks_url", jwks)
    .set("defaults.client_jwt.issuer", ISSUER)
    .set("defaults.client_jwt.audience", "payments-api")
    .text()
}

/// Waits until `/readyz` answers 200: the key set has loaded.
async fn ready(config: &str) {
    let admin: std::net::SocketAddr = toml::from_str::<toml::Table>(config).unwrap()["server"]
        ["admin"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        eventually(|| async { admin_get(admin, "/readyz").await.0 == 200 }).await,
        "the key set never loaded: {:?}",
        admin_get(admin, "/readyz").await
    );
}

async fn pay(http: &Http, key: &str, token: &str) -> Got {
    http.request("POST", "/payments")
        .header("idempotency-key", key)
        .header("authorization", &format!("Bearer {token}"))
        .json("{\"amount\":100}")
        .send()
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refreshed_token_replays_and_forgeries_run_nothing() {
    let k1 = SigningKey::rsa("k1");
    let jwks = Jwks::serve(&[&k1]).await;
    let up = Upstream::counting().await;
    let text = config(&up.url(), &jwks.url);
    let gw = GatewayProcess::start(&text);
    ready(&text).await;
    let http = Http::new(gw.addr);
    let now = now_s();
    let mut tokens = Vec::new();
    let mut sign = |key: &SigningKey, c: Value| {
        let t = key.sign(&c);
        tokens.push(t.clone());
        t
    };

    let first = pay(
        &http,
        "pay-1",
        &sign(&k1, claims("alice", now - 3000, now + 60)),
    )
    .await;
    assert_eq!(first.status, 201);
    // The client lost the answer, refreshed its token (new iat and exp) and retried.
    let refreshed = sign(&k1, claims("alice", now, now + 3600));
    let retry = pay(&http, "pay-1", &refreshed).await;
    assert!(retry.is_replay(), "a refreshed token is the same client");
    assert_eq!(retry.body, first.body);
    assert_eq!(up.executions(), 1);
    // Another subject with the same key executes its own.
    let bob = pay(&http, "pay-1", &sign(&k1, claims("bob", now, now + 600))).await;
    assert_eq!(bob.status, 201);
    assert!(!bob.is_replay());
    assert_eq!(up.executions(), 2);

    // Forgeries: each 401 client-unverified, nothing replayed, nothing executed.
    let forger = SigningKey::rsa("k1");
    let forged = [
        (
            "another key under the same kid",
            sign(&forger, claims("alice", now, now + 600)),
        ),
        ("alg none", unsigned("k1", &claims("alice", now, now + 600))),
        (
            "HS256 keyed with the RSA public key",
            hs256("k1", &k1.public_pem, &claims("alice", now, now + 600)),
        ),
        (
            "expired",
            sign(&k1, claims("alice", now - 7200, now - 3600)),
        ),
        (
            "another issuer",
            sign(
                &k1,
                json!({"iss": "https://evil.example/", "sub": "alice", "aud": "payments-api", "exp": now + 600}),
            ),
        ),
        (
            "another audience",
            sign(
                &k1,
                json!({"iss": ISSUER, "sub": "alice", "aud": "billing", "exp": now + 600}),
            ),
        ),
        (
            "no subject",
            sign(
                &k1,
                json!({"iss": ISSUER, "aud": "payments-api", "exp": now + 600}),
            ),
        ),
    ];
    for (what, token) in &forged {
        let got = pay(&http, "pay-1", token).await;
        assert_eq!(got.status, 401, "{what}: {}", got.text());
        assert_eq!(got.problem_type(), "client-unverified", "{what}");
        assert_eq!(
            got.header("www-authenticate"),
            Some("Bearer error=\"invalid_token\""),
            "{what}"
        );
        assert!(!got.is_replay(), "{what}");
    }
    assert_eq!(up.executions(), 2, "a forgery reached the upstream");

    // The issuer rotates to a new EC key: the same subject's retry under it replays, no restart.
    let k2 = SigningKey::ec("k2");
    jwks.publish(&[&k2]);
    let rotated = pay(&http, "pay-1", &sign(&k2, claims("alice", now, now + 600))).await;
    assert!(rotated.is_replay(), "{} {}", rotated.status, rotated.text());
    assert_eq!(rotated.body, first.body);

    // The key set endpoint goes down: tokens of known keys still verify.
    jwks.take_down();
    let fetched = jwks.fetches();
    let later = pay(
        &http,
        "pay-1",
        &sign(&k2, claims("alice", now + 1, now + 900)),
    )
    .await;
    assert!(later.is_replay());
    // A forged kid cannot make the gateway hammer the issuer: one fetch per 30 s at most. Within
    // those 30 s an unknown kid is answered 503 (a real rotation may be on its way: a 401 would
    // end a real client's retries); nothing runs either way.
    for i in 0..5 {
        let unknown = SigningKey::ec(&format!("forged-{i}"));
        let token = sign(&unknown, claims("alice", now, now + 600));
        let got = pay(&http, "pay-2", &token).await;
        assert_eq!(got.status, 503, "{}", got.text());
        assert_eq!(got.problem_type(), "client-keys-unavailable");
    }
    assert!(
        jwks.fetches() <= fetched + 1,
        "{} fetches after {fetched}",
        jwks.fetches()
    );
    assert_eq!(up.executions(), 2);

    // No token in any log line, not even a part of one.
    let logs = gw.drain_logs().join("\n");
    assert!(
        logs.contains("client token not verified"),
        "refusals are logged"
    );
    for token in tokens.iter().chain(forged.iter().map(|(_, t)| t)) {
        let signature = token.rsplit('.').next().unwrap();
        let payload = token.split('.').nth(1).unwrap();
        assert!(!logs.contains(payload), "a token's claims were logged");
        assert!(
            signature.is_empty() || !logs.contains(signature),
            "a token's signature was logged"
        );
    }
}

/// Until the key set has loaded, keyed requests get 503 (retryable) and nothing runs; no token
/// on a route without `require_client` is the anonymous scope, with it `401 client-required`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_not_loaded_yet_answer_503_and_no_token_is_anonymous() {
    let k1 = SigningKey::ec("k1");
    let jwks = Jwks::serve(&[&k1]).await;
    jwks.take_down();
    let up = Upstream::counting().await;
    let text = config(&up.url(), &jwks.url);
    let gw = GatewayProcess::start(&text);
    let admin: std::net::SocketAddr = toml::from_str::<toml::Table>(&text).unwrap()["server"]
        ["admin"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let (status, why) = admin_get(admin, "/readyz").await;
    assert_eq!(status, 503);
    assert!(
        why.contains("client_jwt keys from") && why.contains("not loaded yet"),
        "{why}"
    );
    let http = Http::new(gw.addr);
    let now = now_s();
    let got = pay(&http, "k", &k1.sign(&claims("alice", now, now + 600))).await;
    assert_eq!(got.status, 503);
    assert_eq!(got.problem_type(), "client-keys-unavailable");
    assert!(got.header("retry-after").is_some());
    assert_eq!(up.executions(), 0);
    let anonymous = http.post("/payments", "k", "{}").await;
    assert_eq!(
        anonymous.status, 201,
        "no token: the anonymous scope, as before"
    );
    drop(gw);

    let required = TomlConfig::parse(&config(&up.url(), &jwks.url))
        .set("defaults.require_client", true)
        .text();
    let gw = GatewayProcess::start(&required);
    let got = Http::new(gw.addr).post("/payments", "k", "{}").await;
    assert_eq!(got.status, 401);
    assert_eq!(got.problem_type(), "client-required");
    assert_eq!(up.executions(), 1);
}

/// An operator names a JWT client's key by its claims, as the gateway derives it: `keys get`
/// with `--jwt-claim sub=alice` finds alice's record, with bob's subject it finds none; and
/// `--client` on such a route is refused with what to give instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_names_a_jwt_clients_key_by_its_claims() {
    let k1 = SigningKey::ec("k1");
    let jwks = Jwks::serve(&[&k1]).await;
    let up = Upstream::counting().await;
    let dir = TempDir::new("jwt-operator");
    let text = TomlConfig::parse(&config(&up.url(), &jwks.url))
        .set("store.backend", "disk")
        .set("store.path", format!("{}/store", dir.path.display()))
        .text();
    let gw = GatewayProcess::start(&text);
    ready(&text).await;
    let now = now_s();
    let got = pay(
        &Http::new(gw.addr),
        "op-1",
        &k1.sign(&claims("alice", now, now + 600)),
    )
    .await;
    assert_eq!(got.status, 201);
    gw.signal_and_wait("-TERM");
    let path = dir.path.join("proxy.toml");
    std::fs::write(&path, &text).unwrap();
    let get = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemgate"))
            .args([
                "keys", "get", "--route", "payments", "--key", "op-1", "--config",
            ])
            .arg(&path)
            .args(args)
            .output()
            .unwrap();
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (out.status.success(), text(&out.stdout), text(&out.stderr))
    };
    let (ok, stdout, stderr) = get(&["--jwt-claim", "sub=alice"]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("completed"), "{stdout}");
    assert!(
        stderr.contains("the JWT client iss=https://auth.example/ sub=alice"),
        "{stderr}"
    );
    let (_, stdout, _) = get(&["--jwt-claim", "sub=bob"]);
    assert!(stdout.contains("no record"), "{stdout}");
    let (ok, _, stderr) = get(&["--client", "Bearer x"]);
    assert!(!ok);
    assert!(stderr.contains("--jwt-claim"), "{stderr}");
}
