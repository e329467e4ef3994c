//! `retry_hint_headers` and `error_body`: how the gateway's own answers speak to SDKs.

use super::answers::DEFAULT_HINT;
use super::*;

const BASE: &str = r#"
[server]
listen = "127.0.0.1:8080"
[upstream]
url = "http://127.0.0.1:3000"
"#;

fn parse(extra: &str) -> Result<Config, ConfigError> {
    Config::parse(&format!("{BASE}{extra}"))
}

fn field_of(r: Result<Config, ConfigError>) -> String {
    match r {
        Err(ConfigError::Invalid { field, .. }) => field,
        other => panic!("expected Invalid, got {other:?}"),
    }
}

#[test]
fn by_default_answers_carry_the_stainless_hint_and_problem_json() {
    let c = parse("[[routes]]\npath = \"/p\"\n").unwrap();
    let answers = &c.routes[0].policy.answers;
    assert!(answers.is_builtin());
    assert_eq!(answers.hints(), [DEFAULT_HINT]);
    assert!(answers.error_body().is_none());
}

#[test]
fn a_route_takes_the_defaults_answers_and_may_set_its_own() {
    let c = parse(
        r#"
[defaults]
retry_hint_headers = ["x-should-retry", "Stripe-Should-Retry"]
error_body = { template = '{"error": {"type": "idempotency_error", "code": "{code}", "message": "{detail}"}}' }
[[routes]]
path = "/a"
[[routes]]
path = "/b"
retry_hint_headers = []
error_body = { content_type = "application/vnd.api+json", template = '{"errors": [{"code": "{code}", "status": "{status}"}]}' }
"#,
    )
    .unwrap();
    let (a, b) = (&c.routes[0].policy.answers, &c.routes[1].policy.answers);
    assert_eq!(a.hints().len(), 2);
    assert_eq!(a.hints()[1].as_str(), "stripe-should-retry");
    assert_eq!(
        a.error_body().unwrap().content_type,
        "application/json",
        "the default media type"
    );
    assert!(b.hints().is_empty());
    assert_eq!(
        b.error_body().unwrap().content_type,
        "application/vnd.api+json"
    );
    assert_eq!(c.defaults.answers, *a);
}

#[test]
fn bad_hints_and_templates_are_refused_at_load_naming_the_field() {
    for (extra, field) in [
        (
            "retry_hint_headers = [\"bad header\"]",
            "routes[0].retry_hint_headers",
        ),
        (
            "retry_hint_headers = [\"retry-after\"]",
            "routes[0].retry_hint_headers",
        ),
        (
            "retry_hint_headers = [\"Content-Type\"]",
            "routes[0].retry_hint_headers",
        ),
        (
            "retry_hint_headers = [\"a\", \"A\"]",
            "routes[0].retry_hint_headers",
        ),
        (
            "retry_hint_headers = [\"idempotent-replayed\"]",
            "routes[0].replay_header",
        ),
        (
            "replay_header = \"x-should-retry\"",
            "routes[0].replay_header",
        ),
        (
            "error_body = { template = '{\"m\": \"{message}\"}' }",
            "routes[0].error_body",
        ),
        (
            "error_body = { template = '{\"m\": {detail}}' }",
            "routes[0].error_body",
        ),
        (
            "error_body = { template = '<p>{detail}</p>' }",
            "routes[0].error_body",
        ),
        (
            "error_body = { content_type = \"json\", template = '{\"c\": \"{code}\"}' }",
            "routes[0].error_body",
        ),
    ] {
        assert_eq!(
            field_of(parse(&format!("[[routes]]\npath = \"/p\"\n{extra}\n"))),
            field,
            "{extra}"
        );
    }
    let nine: Vec<String> = (0..9).map(|i| format!("\"h{i}\"")).collect();
    let extra = format!(
        "[[routes]]\npath = \"/p\"\nretry_hint_headers = [{}]\n",
        nine.join(", ")
    );
    assert_eq!(field_of(parse(&extra)), "routes[0].retry_hint_headers");
    // A template is required, and nothing else is taken.
    assert!(matches!(
        parse("[[routes]]\npath = \"/p\"\nerror_body = { content_type = \"application/json\" }\n"),
        Err(ConfigError::Syntax(_))
    ));
    assert!(matches!(
        parse("[[routes]]\npath = \"/p\"\nerror_body = { template = '{\"c\": \"{code}\"}', status = 400 }\n"),
        Err(ConfigError::Syntax(_))
    ));
}

#[test]
fn a_refused_template_s_message_says_why_without_echoing_it() {
    let err = parse(
        "[[routes]]\npath = \"/p\"\nerror_body = { template = '{\"m\": \"{secretish}\"}' }\n",
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("{secretish} is not a placeholder"), "{err}");
    assert!(
        err.contains("{code}, {type}, {title}, {detail} and {status}"),
        "{err}"
    );
}

#[test]
fn every_envelope_example_in_the_docs_loads() {
    let docs = include_str!("../../docs/problems.md");
    let examples: Vec<&str> = docs
        .split("```toml\n")
        .skip(1)
        .filter_map(|block| block.split("```").next())
        .filter(|block| block.contains("error_body"))
        .collect();
    assert_eq!(examples.len(), 3, "Stripe, Stainless and GoCardless");
    for example in examples {
        let c = parse(&format!("{example}[[routes]]\npath = \"/p\"\n"))
            .unwrap_or_else(|e| panic!("{example}: {e}"));
        assert!(c.routes[0].policy.answers.error_body().is_some());
    }
}
