//! At-least-once deliveries deduplicated by message id or business id, with the documented
//! sender configurations of `examples/webhooks.toml` and realistic deliveries from each sender.

use crate::support::*;

/// The shipped example config, pointed at the test upstream and a free port.
async fn webhook_gateway(up: &Upstream) -> Running {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/webhooks.toml"
    ))
    .unwrap()
    .replace("listen = \"127.0.0.1:8080\"", "listen = \"127.0.0.1:0\"")
    .replace(
        "url = \"http://127.0.0.1:3000\"",
        &format!("url = \"{}\"", up.url()),
    );
    Running::start(idemgate::config::Config::parse(&text).unwrap())
        .await
        .unwrap()
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
    let delivery = |id: &str, ts: &str, sig: &str| Delivery {
        path: "/webhooks/standard",
        headers: vec![
            json(),
            ("webhook-id", id.into()),
            ("webhook-timestamp", ts.into()),
            ("webhook-signature", sig.into()),
        ],
        body: body.into(),
    };
    // A redelivery is signed again, with a new timestamp: only webhook-id stays.
    check_sender(
        delivery(
            "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W",
            "1674087231",
            "v1,K5oZfzN95Z9UVu1EsfQmfVNQhnkZ2pj9o9NDN/H/pI4=",
        ),
        delivery(
            "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W",
            "1674087291",
            "v1,7mTbqLz3yW1fGH2Bx9v0bHq8cCkz1J1e3m0QbQ0x5yE=",
        ),
        delivery(
            "msg_2KWPBgLlAfxdpx2AI54pPJ85f5X",
            "1674087300",
            "v1,Zm9vYmFyYmF6cXV4cXV1eHF1dXhxdXV4cXV1eHF1dXg=",
        ),
    )
    .await;
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
            (
                "x-hub-signature-256",
                "sha256=d57c68ca6f92289e6987922ff26938930f6e66a2d161ef06abdf1859230aa23c".into(),
            ),
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
    Delivery {
        path,
        headers: vec![
            ("content-type", "application/json; charset=utf-8".into()),
            (
                "stripe-signature",
                "t=1686089970,v1=5257a869e7ecebeda32affa62cdca3fa51cad7e77a0e56ff536d0ce8e108d8bd"
                    .into(),
            ),
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
    let delivery = |event_id: &str, webhook_id: &str| {
        Delivery {
        path: "/webhooks/shopify",
        headers: vec![
            json(),
            ("x-shopify-topic", "orders/create".into()),
            ("x-shopify-event-id", event_id.into()),
            ("x-shopify-webhook-id", webhook_id.into()),
            ("x-shopify-shop-domain", "example.myshopify.com".into()),
            ("x-shopify-hmac-sha256", "XWmrwMey6OsLMeiZKwP4FppHH3cmAiiJJAweH5Jo4bM=".into()),
            ("x-shopify-api-version", "2025-01".into()),
        ],
        body: r#"{"id":820982911946154508,"email":"jon@example.com","total_price":"598.94","currency":"USD","line_items":[{"id":866550311766439020,"quantity":1}]}"#.into(),
    }
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
