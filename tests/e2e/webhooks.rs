//! At-least-once deliveries deduplicated by message id or business id, with the documented
//! sender configurations of `examples/webhooks.toml` and realistic deliveries from each sender.

use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::support::*;

/// The senders' signing secrets in these tests (Standard Webhooks', GitHub's and Slack's are
/// the ones their docs use in their examples).
const STANDARD_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const GITHUB_SECRET: &str = "It's a Secret to Everybody";
const STRIPE_SECRET: &str = "whsec_test_5f2b1c3d4e";
const SHOPIFY_SECRET: &str = "hush-shopify-app-secret";
const SLACK_SECRET: &str = "8f742231b10e8888abcd99yyyzzz85a5";

/// The shipped example config, pointed at the test upstream and a free port, with each
/// `secret_env` variable made a file holding the test secret (tests share one process: they
/// never set environment variables).
async fn webhook_gateway(up: &Upstream) -> Running {
    webhook_gateway_with(up, &[]).await
}

/// [`webhook_gateway`] with more settings (`path`, `value`) over the example's.
async fn webhook_gateway_with(up: &Upstream, more: &[(&str, &str)]) -> Running {
    let dir = TempDir::new("webhook-secrets");
    let example = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/webhooks.toml"
    ))
    .unwrap();
    let mut config = TomlConfig::parse(&example)
        .set("server.listen", "127.0.0.1:0")
        .set("upstream.url", up.url());
    for (path, value) in more {
        config = config.set(path, *value);
    }
    let secrets = [
        ("STANDARD_WEBHOOKS_SECRET", STANDARD_SECRET),
        ("GITHUB_WEBHOOK_SECRET", GITHUB_SECRET),
        ("STRIPE_WEBHOOK_SECRET", STRIPE_SECRET),
        ("SHOPIFY_API_SECRET", SHOPIFY_SECRET),
        ("SLACK_SIGNING_SECRET", SLACK_SECRET),
    ];
    let routes = (0..)
        .take_while(|i| config.get(&format!("routes[{i}].path")).is_some())
        .count();
    for i in 0..routes {
        let Some(var) = config.get(&format!("routes[{i}].signature.secret_env")) else {
            continue;
        };
        let (_, secret) = secrets
            .iter()
            .find(|(name, _)| *name == var)
            .unwrap_or_else(|| panic!("a sender without a test secret: {var}"));
        let path = dir.path.join(&var);
        std::fs::write(&path, format!("{secret}\n")).unwrap();
        config = config
            .remove(&format!("routes[{i}].signature.secret_env"))
            .set(
                &format!("routes[{i}].signature.secret_file"),
                path.display().to_string(),
            );
    }
    let text = config.text();
    Running::start(idemgate::config::Config::parse(&text).unwrap())
        .await
        .unwrap()
}

// Each sender's signature, computed here as its docs describe it (not with the gateway's code).

fn hmac(key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    let mut m = Hmac::<Sha256>::new_from_slice(key).unwrap();
    for p in parts {
        m.update(p);
    }
    m.finalize().into_bytes().to_vec()
}

fn b64(b: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(b)
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// Standard Webhooks: base64 HMAC of "id.timestamp.body" under the base64 key after "whsec_".
fn standard_signature(secret: &str, id: &str, ts: u64, body: &str) -> String {
    let key = base64::engine::general_purpose::STANDARD
        .decode(secret.strip_prefix("whsec_").unwrap())
        .unwrap();
    format!(
        "v1,{}",
        b64(&hmac(
            &key,
            &[format!("{id}.{ts}.").as_bytes(), body.as_bytes()]
        ))
    )
}

/// GitHub: "sha256=" and the hex HMAC of the body.
fn github_signature(secret: &str, body: impl AsRef<[u8]>) -> String {
    format!(
        "sha256={}",
        hex::encode(hmac(secret.as_bytes(), &[body.as_ref()]))
    )
}

/// Stripe: "t=<ts>,v1=<hex HMAC of "ts.body">".
fn stripe_signature(secret: &str, ts: u64, body: &str) -> String {
    let sig = hmac(
        secret.as_bytes(),
        &[format!("{ts}.").as_bytes(), body.as_bytes()],
    );
    format!("t={ts},v1={}", hex::encode(sig))
}

/// Shopify: the base64 HMAC of the body.
fn shopify_signature(secret: &str, body: &str) -> String {
    b64(&hmac(secret.as_bytes(), &[body.as_bytes()]))
}

/// Slack: "v0=" and the hex HMAC of "v0:ts:body".
fn slack_signature(secret: &str, ts: u64, body: &str) -> String {
    let sig = hmac(
        secret.as_bytes(),
        &[format!("v0:{ts}:").as_bytes(), body.as_bytes()],
    );
    format!("v0={}", hex::encode(sig))
}

/// A delivery: path, headers, body.
struct Delivery {
    path: &'static str,
    headers: Vec<(&'static str, String)>,
    body: String,
}

impl Delivery {
    async fn send(&self, http: &Http) -> Got {
        let mut req = http.request("POST", self.path);
        for (k, v) in &self.headers {
            req = req.header(k, v);
        }
        req.body(self.body.clone()).send().await
    }
}

/// Delivered twice (as senders redeliver), the handler runs once and both get the same answer;
/// a different message runs the handler again.
async fn check_sender(first: Delivery, redelivery: Delivery, other: Delivery) {
    let up = Upstream::counting().await;
    let gw = webhook_gateway(&up).await;
    let http = Http::new(gw.addr());
    let a = first.send(&http).await;
    assert_eq!(a.status, 201, "{}: {a:?}", first.path);
    let b = redelivery.send(&http).await;
    assert_eq!(b.status, 201, "{}: {b:?}", first.path);
    assert!(
        b.is_replay(),
        "{}: the redelivery must be answered from the store",
        first.path
    );
    assert_eq!(a.body, b.body);
    assert_eq!(up.executions(), 1, "{}: handler ran once", first.path);
    let c = other.send(&http).await;
    assert_eq!(c.status, 201);
    assert!(!c.is_replay());
    assert_eq!(
        up.executions(),
        2,
        "{}: another message runs the handler",
        first.path
    );
}

fn json() -> (&'static str, String) {
    ("content-type", "application/json".into())
}

#[tokio::test]
async fn standard_webhooks_by_webhook_id() {
    let body = r#"{"type":"contact.created","timestamp":"2022-11-03T20:26:10.344522Z","data":{"id":"1f81eb52-5198-4599-803e-771906343485","type":"contact"}}"#;
    let delivery = |id: &str, ts: u64| Delivery {
        path: "/webhooks/standard",
        headers: vec![
            json(),
            ("webhook-id", id.into()),
            ("webhook-timestamp", ts.to_string()),
            (
                "webhook-signature",
                standard_signature(STANDARD_SECRET, id, ts, body),
            ),
        ],
        body: body.into(),
    };
    // A redelivery is signed again, with a new timestamp: only webhook-id stays.
    let t = now();
    check_sender(
        delivery("msg_2KWPBgLlAfxdpx2AI54pPJ85f4W", t - 60),
        delivery("msg_2KWPBgLlAfxdpx2AI54pPJ85f4W", t),
        delivery("msg_2KWPBgLlAfxdpx2AI54pPJ85f5X", t),
    )
    .await;
}

/// The client header does not scope a signed route: a captured delivery sent again with an
/// `Authorization` of its own (a scope of its own, on a route that scoped by it) finds its key
/// and replays, instead of running again.
#[tokio::test]
async fn a_replay_with_a_client_header_of_its_own_finds_its_key() {
    let up = Upstream::counting().await;
    // Scoped by Authorization, as the routes of a config without the example's setting are.
    let gw = webhook_gateway_with(&up, &[("defaults.client_header", "Authorization")]).await;
    let http = Http::new(gw.addr());
    let body = r#"{"action":"opened","number":7}"#;
    let delivery = |authorization: Option<&str>| {
        let mut headers = vec![
            json(),
            ("x-github-event", "pull_request".into()),
            ("x-github-delivery", "d-replayed".into()),
            ("x-hub-signature-256", github_signature(GITHUB_SECRET, body)),
        ];
        if let Some(a) = authorization {
            headers.push(("authorization", a.into()));
        }
        Delivery {
            path: "/webhooks/github",
            headers,
            body: body.into(),
        }
    };
    let first = delivery(None).send(&http).await;
    assert_eq!(first.status, 201, "{first:?}");
    for forged in ["Bearer attacker", "Basic YTpi"] {
        let again = delivery(Some(forged)).send(&http).await;
        assert!(again.is_replay(), "{forged}: {again:?}");
    }
    assert_eq!(up.executions(), 1, "run once");
}

#[tokio::test]
async fn github_by_delivery_guid() {
    let body = r#"{"ref":"refs/heads/main","before":"6113728f27ae82c7b1a177c8d03f9e96e0adf246","after":"0000000000000000000000000000000000000000","repository":{"id":186853002,"full_name":"octo-org/octo-repo"},"pusher":{"name":"octocat"}}"#;
    let delivery = |guid: &str| Delivery {
        path: "/webhooks/github",
        headers: vec![
            json(),
            ("x-github-event", "push".into()),
            ("x-github-delivery", guid.into()),
            ("x-github-hook-id", "292430182".into()),
            ("x-hub-signature-256", github_signature(GITHUB_SECRET, body)),
            ("user-agent", "GitHub-Hookshot/044aadd".into()),
        ],
        body: body.into(),
    };
    check_sender(
        delivery("72d3162e-cc78-11e3-81ab-4c9367dc0958"),
        delivery("72d3162e-cc78-11e3-81ab-4c9367dc0958"),
        delivery("8a2c1e40-cc78-11e3-81ab-4c9367dc0958"),
    )
    .await;
}

fn stripe_event(event_id: &str, created: u64, payment_intent: &str) -> String {
    format!(
        r#"{{"id":"{event_id}","object":"event","api_version":"2024-06-20","created":{created},"data":{{"object":{{"id":"{payment_intent}","object":"payment_intent","amount":2000,"currency":"usd","status":"succeeded"}}}},"livemode":false,"pending_webhooks":1,"request":{{"id":null,"idempotency_key":"b3c1e7f0-5a1d-4c51-9d6b-2f4d8e1a9c37"}},"type":"payment_intent.succeeded"}}"#
    )
}

fn stripe(path: &'static str, body: String) -> Delivery {
    stripe_signed_with(STRIPE_SECRET, path, body)
}

fn stripe_signed_with(secret: &str, path: &'static str, body: String) -> Delivery {
    Delivery {
        path,
        headers: vec![
            ("content-type", "application/json; charset=utf-8".into()),
            ("stripe-signature", stripe_signature(secret, now(), &body)),
            (
                "user-agent",
                "Stripe/1.0 (+https://stripe.com/docs/webhooks)".into(),
            ),
        ],
        body,
    }
}

#[tokio::test]
async fn stripe_events_by_event_id_in_the_body() {
    let event = |id: &str, created| {
        stripe(
            "/webhooks/stripe",
            stripe_event(id, created, "pi_3NG8Dt2eZvKYlo2C0fYLc8Ok"),
        )
    };
    // Stripe redelivers the identical event.
    check_sender(
        event("evt_1NG8Du2eZvKYlo2CUI79vXWy", 1686089970),
        event("evt_1NG8Du2eZvKYlo2CUI79vXWy", 1686089970),
        event("evt_1NG8Du2eZvKYlo2CYyyyyyyy", 1686089999),
    )
    .await;
}

#[tokio::test]
async fn two_messages_about_one_operation_run_once_on_a_business_key_route_and_twice_by_message_id()
{
    let up = Upstream::counting().await;
    let gw = webhook_gateway(&up).await;
    let http = Http::new(gw.addr());
    let first = stripe_event("evt_1", 1686089970, "pi_same");
    let second = stripe_event("evt_2", 1686090012, "pi_same");

    let a = stripe("/webhooks/stripe-business", first.clone())
        .send(&http)
        .await;
    let b = stripe("/webhooks/stripe-business", second.clone())
        .send(&http)
        .await;
    assert_eq!(a.status, 201);
    assert_eq!(
        b.status, 201,
        "the second message gets the stored answer, not a conflict: {b:?}"
    );
    assert!(b.is_replay());
    assert_eq!(a.body, b.body);
    assert_eq!(up.executions(), 1, "one business operation, one execution");

    let c = stripe("/webhooks/stripe", first).send(&http).await;
    let d = stripe("/webhooks/stripe", second).send(&http).await;
    assert!(!c.is_replay() && !d.is_replay());
    assert_eq!(
        up.executions(),
        3,
        "by message id, two messages are two executions"
    );

    // Another operation on the business route runs.
    let other = stripe(
        "/webhooks/stripe-business",
        stripe_event("evt_3", 1686090100, "pi_other"),
    )
    .send(&http)
    .await;
    assert!(!other.is_replay());
    assert_eq!(up.executions(), 4);
}

#[tokio::test]
async fn a_refused_event_does_not_answer_another_with_the_same_business_key() {
    // The handler refuses evt_1 (say, it arrived before the handler knew the payment) and
    // accepts evt_2 about the same payment.
    let up = Upstream::start(|seen, n| {
        let refused = String::from_utf8_lossy(&seen.body).contains("\"evt_1\"");
        match refused {
            true => Reply::json(400, r#"{"error":"unknown payment"}"#),
            false => Reply::json(201, &format!("{{\"execution\":{n}}}")),
        }
    })
    .await;
    let gw = webhook_gateway(&up).await;
    let http = Http::new(gw.addr());
    let first = stripe_event("evt_1", 1686089970, "pi_same");
    let second = stripe_event("evt_2", 1686090012, "pi_same");
    let send = |body: &String| stripe("/webhooks/stripe-business", body.clone());

    let a = send(&first).send(&http).await;
    assert_eq!(a.status, 400);
    let again = send(&first).send(&http).await;
    assert_eq!(again.status, 400);
    assert!(again.is_replay(), "its own redelivery gets its answer");
    assert_eq!(up.executions(), 1);

    let b = send(&second).send(&http).await;
    assert_eq!(b.status, 201, "another event runs: {b:?}");
    assert!(!b.is_replay());
    assert_eq!(up.executions(), 2);
    // From now on the operation is done: both events get its answer.
    for body in [&second, &first] {
        let r = send(body).send(&http).await;
        assert_eq!((r.status.as_u16(), r.is_replay()), (201, true), "{r:?}");
        assert_eq!(r.body, b.body);
    }
    assert_eq!(up.executions(), 2);
}

/// A scope at its quota still gets its replays, but another request's take-over of a stored
/// refusal is a new execution: refused `429 key-quota` like a new key.
#[tokio::test]
async fn a_refusal_is_not_taken_over_past_the_clients_quota() {
    let up = Upstream::start(|seen, n| {
        match String::from_utf8_lossy(&seen.body).contains("\"amount\":1,") {
            true => Reply::json(400, r#"{"error":"too small"}"#),
            false => Reply::json(201, &format!("{{\"execution\":{n}}}")),
        }
    })
    .await;
    let gw = gateway(
        &up.url(),
        "[defaults]\nclient_header = \"X-Client\"\nmax_keys_per_client = 1\n[[routes]]\npath = \"/orders\"\nkey = { json = \"/order\" }\ncheck_fingerprint = false\n",
    )
    .await;
    let http = Http::new(gw.addr());
    let post = |body: &'static str| {
        (http.request("POST", "/orders"))
            .header("x-client", "c1")
            .json(body)
            .send()
    };
    let refused = post(r#"{"order":"o1","amount":1,"n":1}"#).await;
    assert_eq!(refused.status, 400);
    let again = post(r#"{"order":"o1","amount":1,"n":1}"#).await;
    assert!(again.is_replay(), "its own replay: {again:?}");
    let other = post(r#"{"order":"o1","amount":2,"n":1}"#).await;
    assert_eq!(other.status, 429, "{other:?}");
    assert_eq!(other.problem_type(), "key-quota");
    assert_eq!(up.executions(), 1);
}

/// The example's business route: an event whose object has no id (Stripe's balance.available)
/// reaches the handler, verified, instead of `400 missing-key` on every redelivery; unsigned, it
/// does not.
#[tokio::test]
async fn an_event_without_the_business_key_is_verified_and_passed_on() {
    let up = Upstream::counting().await;
    let gw = webhook_gateway(&up).await;
    let http = Http::new(gw.addr());
    let balance = r#"{"id":"evt_bal_1","object":"event","created":1686089970,"data":{"object":{"object":"balance","available":[{"amount":2000,"currency":"usd"}]}},"type":"balance.available"}"#;
    let got = stripe("/webhooks/stripe-business", balance.into())
        .send(&http)
        .await;
    assert_eq!(got.status, 201, "{got:?}");
    assert!(!got.is_replay());
    assert_eq!(up.executions(), 1);
    let forged = stripe_signed_with("whsec_wrong", "/webhooks/stripe-business", balance.into())
        .send(&http)
        .await;
    assert_eq!(forged.status, 401, "{forged:?}");
    assert_eq!(up.executions(), 1);
}

#[tokio::test]
async fn cloudevents_by_id_and_source() {
    let delivery = |id: &str, source: &str| Delivery {
        path: "/events",
        headers: vec![
            json(),
            ("ce-specversion", "1.0".into()),
            ("ce-type", "com.example.order.created".into()),
            ("ce-source", source.into()),
            ("ce-id", id.into()),
            ("ce-time", "2026-12-02T10:00:00Z".into()),
        ],
        body: r#"{"orderId":"ord_42","total":"19.99"}"#.into(),
    };
    // The same id from another source is another event.
    check_sender(
        delivery("A234-1234-1234", "/orders/service"),
        delivery("A234-1234-1234", "/orders/service"),
        delivery("A234-1234-1234", "/billing/service"),
    )
    .await;
}

#[tokio::test]
async fn aws_sns_by_message_id() {
    let delivery = |id: &str| Delivery {
        path: "/sns",
        headers: vec![
            // SNS posts JSON as text/plain.
            ("content-type", "text/plain; charset=UTF-8".into()),
            ("x-amz-sns-message-type", "Notification".into()),
            ("x-amz-sns-message-id", id.into()),
            (
                "x-amz-sns-topic-arn",
                "arn:aws:sns:us-west-2:123456789012:MyTopic".into(),
            ),
            (
                "x-amz-sns-subscription-arn",
                "arn:aws:sns:us-west-2:123456789012:MyTopic:c9135db0-26c4-47ec-8998-413945fb5a96"
                    .into(),
            ),
        ],
        body: format!(
            r#"{{"Type":"Notification","MessageId":"{id}","TopicArn":"arn:aws:sns:us-west-2:123456789012:MyTopic","Subject":"My First Message","Message":"Hello world!","Timestamp":"2012-05-02T00:54:06.655Z","SignatureVersion":"1","Signature":"EXAMPLEw6JRN...","SigningCertURL":"https://sns.us-west-2.amazonaws.com/SimpleNotificationService-f3ecfb7224c7233fe7bb5f59f96de52f.pem","UnsubscribeURL":"https://sns.us-west-2.amazonaws.com/?Action=Unsubscribe"}}"#
        ),
    };
    check_sender(
        delivery("22b80b92-fdea-4c2c-8f9d-bdfb0c7bf324"),
        delivery("22b80b92-fdea-4c2c-8f9d-bdfb0c7bf324"),
        delivery("da41e39f-ea4d-435a-b922-c6aae3915ebe"),
    )
    .await;
}

#[tokio::test]
async fn shopify_by_event_id() {
    let body = r#"{"id":820982911946154508,"email":"jon@example.com","total_price":"598.94","currency":"USD","line_items":[{"id":866550311766439020,"quantity":1}]}"#;
    let delivery = |event_id: &str, webhook_id: &str| Delivery {
        path: "/webhooks/shopify",
        headers: vec![
            json(),
            ("x-shopify-topic", "orders/create".into()),
            ("x-shopify-event-id", event_id.into()),
            ("x-shopify-webhook-id", webhook_id.into()),
            ("x-shopify-shop-domain", "example.myshopify.com".into()),
            (
                "x-shopify-hmac-sha256",
                shopify_signature(SHOPIFY_SECRET, body),
            ),
            ("x-shopify-api-version", "2025-01".into()),
        ],
        body: body.into(),
    };
    // Each retry carries a new X-Shopify-Webhook-Id; the event id stays.
    check_sender(
        delivery(
            "98880550-7158-44d4-b7cd-2c97c8a091b5",
            "b54557e4-bdd9-4b37-8a5f-bf7d70bcd043",
        ),
        delivery(
            "98880550-7158-44d4-b7cd-2c97c8a091b5",
            "0f6d2a8c-1b3e-4f5a-9c7d-8e9f0a1b2c3d",
        ),
        delivery(
            "11111111-7158-44d4-b7cd-2c97c8a091b5",
            "2a3b4c5d-1b3e-4f5a-9c7d-8e9f0a1b2c3d",
        ),
    )
    .await;
}

#[tokio::test]
async fn a_failing_handler_lets_the_redelivery_run_again() {
    let up = Upstream::start(|_, n| {
        if n == 1 {
            Reply::json(500, r#"{"error":"db down"}"#)
        } else {
            Reply::json(200, r#"{"ok":true}"#)
        }
    })
    .await;
    let gw = webhook_gateway(&up).await;
    let http = Http::new(gw.addr());
    let d = stripe("/webhooks/stripe", stripe_event("evt_fail", 1, "pi_1"));
    assert_eq!(
        d.send(&http).await.status,
        500,
        "the sender sees the failure and will redeliver"
    );
    let again = d.send(&http).await;
    assert_eq!(again.status, 200);
    assert!(!again.is_replay());
    assert!(d.send(&http).await.is_replay());
    assert_eq!(up.executions(), 2);
}

#[tokio::test]
async fn a_delivery_without_its_id_is_refused_and_a_nested_object_is_not_an_id() {
    let up = Upstream::counting().await;
    let gw = webhook_gateway(&up).await;
    let http = Http::new(gw.addr());
    let missing = stripe(
        "/webhooks/stripe",
        r#"{"object":"event","type":"x"}"#.into(),
    )
    .send(&http)
    .await;
    assert_eq!(missing.status, 400);
    assert_eq!(missing.problem_type(), "missing-key");
    assert!(
        missing.text().contains("the body field /id"),
        "{}",
        missing.text()
    );
    let nested = stripe("/webhooks/stripe", r#"{"id":{"not":"scalar"}}"#.into())
        .send(&http)
        .await;
    assert_eq!(nested.problem_type(), "invalid-key");
    let no_header = http.request("POST", "/sns").body("{}").send().await;
    assert_eq!(no_header.problem_type(), "missing-key");
    assert!(no_header.text().contains("X-Amz-Sns-Message-Id"));
    assert_eq!(up.executions(), 0);
}

#[tokio::test]
async fn slack_events_by_event_id() {
    let event = |event_id: &str, ts: u64, retry: Option<&str>| {
        let body = format!(
            r#"{{"token":"Jhj5dZrVaK7ZwHHjRyZWjbDl","team_id":"T061EG9RZ","api_app_id":"A0FFV41KK","event":{{"type":"reaction_added","user":"U061F1EUR","reaction":"slightly_smiling_face","item":{{"type":"message","channel":"C061EG9SL","ts":"1464196127.000002"}}}},"type":"event_callback","event_id":"{event_id}","event_time":1599616881}}"#
        );
        let mut headers = vec![
            json(),
            ("x-slack-request-timestamp", ts.to_string()),
            (
                "x-slack-signature",
                slack_signature(SLACK_SECRET, ts, &body),
            ),
        ];
        if let Some(n) = retry {
            headers.push(("x-slack-retry-num", n.into()));
            headers.push(("x-slack-retry-reason", "http_timeout".into()));
        }
        Delivery {
            path: "/slack/events",
            headers,
            body,
        }
    };
    let t = now();
    check_sender(
        event("Ev08MFMKH6", t - 5, None),
        event("Ev08MFMKH6", t, Some("1")),
        event("Ev08MFMKH7", t, None),
    )
    .await;
}

/// The attack from the issue: a forged delivery with a real event id, before the genuine one.
/// It is refused (401) without claiming the key; the genuine delivery executes once, and its
/// redeliveries replay it.
#[tokio::test]
async fn a_forged_delivery_cannot_claim_the_key_of_the_genuine_one() {
    let up = Upstream::counting().await;
    let gw = webhook_gateway(&up).await;
    let http = Http::new(gw.addr());
    let event = stripe_event("evt_real_1", 1686089970, "pi_real");
    let forged = stripe_signed_with("whsec_guessed", "/webhooks/stripe", event.clone())
        .send(&http)
        .await;
    assert_eq!(forged.status, 401);
    assert_eq!(forged.problem_type(), "signature-rejected");
    assert_eq!(up.executions(), 0);
    let genuine = stripe("/webhooks/stripe", event.clone()).send(&http).await;
    assert_eq!(genuine.status, 201, "{genuine:?}");
    assert!(!genuine.is_replay());
    let redelivered = stripe("/webhooks/stripe", event).send(&http).await;
    assert!(redelivered.is_replay());
    assert_eq!(up.executions(), 1);
}

/// Every way a delivery can fail its signature: nothing stored, nothing forwarded, counted.
#[tokio::test]
async fn tampered_stale_unsigned_and_wrongly_signed_deliveries_are_refused() {
    let up = Upstream::counting().await;
    let dir = TempDir::new("rotation");
    let (new, old) = (dir.path.join("new"), dir.path.join("old"));
    std::fs::write(&new, "s3cret-new").unwrap();
    std::fs::write(&old, "s3cret-old\n").unwrap();
    let config = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n[upstream]\nurl = \"{}\"\n[store]\nbackend = \"memory\"\n[[routes]]\nname = \"gh\"\npath = \"/gh\"\nclient_header = \"\"\nkey = {{ header = \"X-GitHub-Delivery\" }}\nsignature = {{ scheme = \"github\", secret_file = [\"{}\", \"{}\"] }}\n[[routes]]\nname = \"slack\"\npath = \"/slack\"\nclient_header = \"\"\nkey = {{ json = \"/event_id\" }}\nsignature = {{ scheme = \"slack\", secret_file = \"{}\", tolerance = \"1m\" }}\n",
        up.url(),
        new.display(),
        old.display(),
        new.display()
    );
    let gw = Running::start(idemgate::config::Config::parse(&config).unwrap())
        .await
        .unwrap();
    let http = Http::new(gw.addr());
    let body = r#"{"zen":"Design for failure."}"#;
    let gh = |guid: &str, sig: Option<String>, body: &str| {
        let mut req = http
            .request("POST", "/gh")
            .header("x-github-delivery", guid)
            .header("content-type", "application/json");
        if let Some(sig) = sig {
            req = req.header("x-hub-signature-256", &sig);
        }
        req.body(body.to_string()).send()
    };
    // Signed with the new secret, and with the old one still configured during a rotation.
    assert_eq!(
        gh("d-1", Some(github_signature("s3cret-new", body)), body)
            .await
            .status,
        201
    );
    assert_eq!(
        gh("d-2", Some(github_signature("s3cret-old", body)), body)
            .await
            .status,
        201
    );
    // A wrong secret, a tampered body, no signature, a malformed one.
    for (guid, sig, sent) in [
        ("d-3", Some(github_signature("s3cret-other", body)), body),
        (
            "d-4",
            Some(github_signature("s3cret-new", body)),
            r#"{"zen":"Design for success."}"#,
        ),
        ("d-5", None, body),
        ("d-6", Some("sha1=0123".to_string()), body),
    ] {
        let got = gh(guid, sig, sent).await;
        assert_eq!(got.status, 401, "{guid}");
        assert_eq!(got.problem_type(), "signature-rejected", "{guid}");
    }
    // A Slack event signed 2 minutes ago, past this route's 1-minute tolerance: an old signed
    // delivery replayed after its record expired would be this.
    let slack_body = r#"{"type":"event_callback","event_id":"Ev1"}"#;
    let ts = now() - 120;
    let stale = http
        .request("POST", "/slack")
        .header("x-slack-request-timestamp", &ts.to_string())
        .header(
            "x-slack-signature",
            &slack_signature("s3cret-new", ts, slack_body),
        )
        .body(slack_body)
        .send()
        .await;
    assert_eq!(stale.status, 401);
    assert!(stale.text().contains("timestamp"), "{}", stale.text());
    assert_eq!(up.executions(), 2, "only the two signed deliveries ran");
    // Refused deliveries claimed nothing: d-3 signed properly now runs.
    assert_eq!(
        gh("d-3", Some(github_signature("s3cret-new", body)), body)
            .await
            .status,
        201
    );
    let metrics = scrape(gw.admin_addr().unwrap()).await;
    let count = |route: &str, result: &str| {
        metrics
            .get(&format!(
                "idemgate_signatures_total{{route=\"{route}\",result=\"{result}\"}}"
            ))
            .copied()
            .unwrap_or(0.0)
    };
    assert_eq!(count("gh", "verified"), 3.0);
    assert_eq!(count("gh", "invalid"), 2.0);
    assert_eq!(count("gh", "missing"), 2.0);
    assert_eq!(count("slack", "stale"), 1.0);
}

/// With `require_key = false`, a delivery without its key passes through, but only signed:
/// the signature is checked on every delivery to the route.
#[tokio::test]
async fn without_a_key_a_delivery_still_needs_its_signature() {
    let up = Upstream::counting().await;
    let dir = TempDir::new("unkeyed");
    let secret = dir.path.join("secret");
    std::fs::write(&secret, GITHUB_SECRET).unwrap();
    let config = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nurl = \"{}\"\n[store]\nbackend = \"memory\"\n[[routes]]\npath = \"/gh\"\nclient_header = \"\"\nrequire_key = false\nkey = {{ header = \"X-GitHub-Delivery\" }}\nsignature = {{ scheme = \"github\", secret_file = \"{}\" }}\n",
        up.url(),
        secret.display()
    );
    let gw = Running::start(idemgate::config::Config::parse(&config).unwrap())
        .await
        .unwrap();
    let http = Http::new(gw.addr());
    let body = r#"{"zen":"Keep it logically awesome."}"#;
    let unsigned = http.request("POST", "/gh").body(body).send().await;
    assert_eq!(unsigned.status, 401);
    let signed = http
        .request("POST", "/gh")
        .header(
            "x-hub-signature-256",
            &github_signature(GITHUB_SECRET, body),
        )
        .body(body)
        .send()
        .await;
    assert_eq!(signed.status, 201);
    assert_eq!(up.executions(), 1);
}

/// On a signed route, the signature is checked over the bytes as sent before anything is
/// decoded (an unsigned bomb gets `401`, never a decoder), and a method override never takes an
/// unsigned POST off the route.
#[tokio::test]
async fn a_signed_route_checks_before_it_decodes_and_keeps_overridden_posts() {
    let up = Upstream::counting().await;
    let dir = TempDir::new("signed-coded");
    let secret = dir.path.join("secret");
    std::fs::write(&secret, GITHUB_SECRET).unwrap();
    let config = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nmethod_override_header = \"X-HTTP-Method-Override\"\n[upstream]\nurl = \"{}\"\n[store]\nbackend = \"memory\"\n[[routes]]\npath = \"/gh\"\nclient_header = \"\"\nkey = {{ header = \"X-GitHub-Delivery\" }}\nsignature = {{ scheme = \"github\", secret_file = \"{}\" }}\n[[routes]]\nname = \"gh-delete\"\npath = \"/gh\"\nmethods = [\"DELETE\"]\n",
        up.url(),
        secret.display()
    );
    let gw = Running::start(idemgate::config::Config::parse(&config).unwrap())
        .await
        .unwrap();
    let http = Http::new(gw.addr());
    let send = |coding: &str, over: &str, body: Vec<u8>, signature: Option<String>| {
        let mut req = http
            .request("POST", "/gh")
            .header("x-github-delivery", "d-1")
            .header("content-type", "application/json");
        if !coding.is_empty() {
            req = req.header("content-encoding", coding);
        }
        if !over.is_empty() {
            req = req.header("x-http-method-override", over);
        }
        if let Some(signature) = signature {
            req = req.header("x-hub-signature-256", &signature);
        }
        req.body(body).send()
    };
    let gzip = |data: &[u8]| {
        use std::io::Write;
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    };
    let bomb = gzip(&vec![b' '; 8 << 20]);
    let unsigned = send("gzip", "", bomb, None).await;
    assert_eq!(unsigned.status, 401, "{unsigned:?}");
    // No GET route: the POST's own, signature and all.
    let got = send("", "GET", b"{}".to_vec(), None).await;
    assert_eq!(got.status, 401, "{got:?}");
    // A DELETE route without the signature: the override would drop it, so it is refused.
    let got = send("", "DELETE", b"{}".to_vec(), None).await;
    assert_eq!(got.status, 400, "{got:?}");
    assert_eq!(got.problem_type(), "invalid-method-override");
    let body = gzip(br#"{"zen":"Keep it logically awesome."}"#);
    // The signature is over the gzipped bytes, as GitHub would send them.
    let signed = github_signature(GITHUB_SECRET, &body);
    let got = send("gzip", "", body.clone(), Some(signed)).await;
    assert_eq!(got.status, 201, "{got:?}");
    assert_eq!(up.seen()[0].body, body, "forwarded as signed");
    assert_eq!(up.executions(), 1);
}

/// A signed route protects its path, not one spelling of it: another method, a lower-case
/// method, a backslash or a twice-encoded character never reaches the upstream unverified; the
/// same for a route with `require_client`.
#[tokio::test]
async fn a_signed_routes_path_is_protected_for_every_method_and_spelling() {
    let up = Upstream::counting().await;
    let dir = TempDir::new("guarded");
    let secret = dir.path.join("secret");
    std::fs::write(&secret, GITHUB_SECRET).unwrap();
    let config = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nurl = \"{}\"\n[store]\nbackend = \"memory\"\n[[routes]]\npath = \"/webhooks/github\"\nclient_header = \"\"\nkey = {{ header = \"X-GitHub-Delivery\" }}\nsignature = {{ scheme = \"github\", secret_file = \"{}\" }}\n[[routes]]\npath = \"/payments\"\nrequire_client = true\n[[routes]]\npath = \"/api/*\"\n",
        up.url(),
        secret.display()
    );
    let gw = Running::start(idemgate::config::Config::parse(&config).unwrap())
        .await
        .unwrap();
    let request = |method: &str, path: &str| {
        format!(
            "{method} {path} HTTP/1.1\r\nhost: x\r\nx-github-delivery: d-1\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{{}}"
        )
    };
    for (method, path, status) in [
        ("PUT", "/webhooks/github", "405"),
        ("post", "/webhooks/github", "405"),
        ("PATCH", "/Webhooks/GitHub/", "405"),
        ("POST", "/webhooks\\github", "401"),
        ("POST", "/webhooks/%2567ithub", "401"),
        ("POST", "/webhooks/github", "401"),
        ("PUT", "/payments", "405"),
        ("DELETE", "/PAYMENTS;x", "405"),
        // Another route's as written, the signed one's to a server reading `\` as `/`.
        ("POST", "/api/..%5Cwebhooks%5Cgithub", "405"),
        ("POST", "/api/..\\webhooks\\github", "405"),
    ] {
        let got = raw(gw.addr(), request(method, path).as_bytes()).await;
        assert!(
            got.starts_with(&format!("HTTP/1.1 {status}")),
            "{method} {path}: {got}"
        );
    }
    let got = raw(gw.addr(), request("PUT", "/webhooks/github").as_bytes()).await;
    assert!(got.to_ascii_lowercase().contains("allow: post"), "{got}");
    assert_eq!(up.executions(), 0, "nothing reached the upstream");
    // Other paths still pass, and so do a bodiless GET, HEAD or OPTIONS to the guarded path (a
    // CORS preflight, a sender's URL challenge): no handler acts on those.
    let got = raw(gw.addr(), request("PUT", "/webhooks/gitlab").as_bytes()).await;
    assert!(got.starts_with("HTTP/1.1 201"), "{got}");
    let before = up.executions();
    for method in ["GET", "OPTIONS"] {
        let bodiless = format!("{method} /webhooks/github?hub.challenge=1 HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
        let got = raw(gw.addr(), bodiless.as_bytes()).await;
        assert!(got.starts_with("HTTP/1.1 201"), "{method}: {got}");
    }
    assert_eq!(up.executions(), before + 2);
    let got = raw(gw.addr(), request("GET", "/webhooks/github").as_bytes()).await;
    assert!(got.starts_with("HTTP/1.1 405"), "a GET with a body: {got}");
}
