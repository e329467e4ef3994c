//! Inputs for every target in its layout ([`super::checks::run`]), drawn from the proptest
//! generators: the property targets run on them, and `FUZZ_SEED_DIR=fuzz/corpus cargo test
//! --test fuzz seeds` writes them as the cargo-fuzz corpus's seeds (then minimised with
//! `cargo fuzz cmin`).

use idemgate::key::StoreKey;
use idemgate::store::codec::{self, Seal};
use idemgate::store::seal::Sealing;
use proptest::prelude::*;
use proptest::strategy::{BoxedStrategy, ValueTree};
use proptest::test_runner::{Config as RunnerConfig, TestRunner};

use super::{checks, json_value, jsonish_bytes, path, record, PROXY_TOML};

/// A header block in [`checks::headers_and_body`]'s layout, then `body`.
fn with_headers(headers: &[(String, String)], body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    for (n, v) in headers {
        out.extend_from_slice(format!("{n}: {v}\n").as_bytes());
    }
    out.push(b'\n');
    out.extend_from_slice(body);
    out
}

/// `target`'s inputs.
pub fn strategy(target: &str) -> BoxedStrategy<Vec<u8>> {
    match target {
        "key_header" => prop_oneof![
            prop::collection::vec(any::<u8>(), 0..300),
            "[!#-~&&[^\"\\\\]]{1,200}".prop_map(|k| format!("\"{k}\"").into_bytes()),
        ]
        .boxed(),
        "key_fields" => (json_value(), any::<bool>())
            .prop_map(|(v, part)| {
                let body = serde_json::json!({ "id": v, "a": [v], "event": { "id": v } });
                let headers = [("x-part".to_string(), "p".to_string())];
                with_headers(&headers[..usize::from(part)], body.to_string().as_bytes())
            })
            .boxed(),
        "canonical_json" => prop_oneof![
            json_value().prop_map(|v| serde_json::to_vec_pretty(&v).unwrap_or_default()),
            jsonish_bytes(),
        ]
        .boxed(),
        "route_pattern" => prop_oneof![
            "\\PC{0,40}",
            "(/(\\*\\*|\\*|[a-z]{1,6}|\\{[a-z]{1,4}\\})){1,5}",
        ]
        .prop_map(String::into_bytes)
        .boxed(),
        "route_match" => path().prop_map(String::into_bytes).boxed(),
        "record" => (record(), any::<bool>())
            .prop_map(|(r, sealed)| {
                let sealer = checks::sealer();
                let key = StoreKey::from_bytes([7; 32]);
                let seal = if sealed { Seal::new(Some(&sealer), &key) } else { Seal::PLAIN };
                let r = idemgate::store::Record { sealing: Sealing::New, ..r };
                codec::encode(&r, seal).to_vec()
            })
            .boxed(),
        "config" => prop_oneof![
            Just(PROXY_TOML.as_bytes().to_vec()),
            "\\PC{0,300}".prop_map(String::into_bytes),
            (any::<prop::sample::Index>(), "\\PC{0,4}").prop_map(|(at, insert)| {
                let mut text = PROXY_TOML.to_string();
                let mut i = at.index(text.len() + 1);
                while !text.is_char_boundary(i) {
                    i -= 1;
                }
                text.insert_str(i, &insert);
                text.into_bytes()
            }),
        ]
        .boxed(),
        "keys_file" => prop::collection::vec(("[a-z0-9#]{0,8}", "[A-Za-z0-9+/]{40,44}={0,2}"), 0..4)
            .prop_map(|lines| {
                let lines: Vec<String> = lines.iter().map(|(id, k)| format!("{id}:{k}")).collect();
                lines.join("\n").into_bytes()
            })
            .boxed(),
        "webhook" => (0u8..7, prop::collection::vec(any::<u8>(), 0..64))
            .prop_map(|(n, body)| {
                let headers = idemgate::fuzzing::sign_webhook(n, "msg_1", checks::NOW_S, &body);
                let mut input = vec![n];
                input.extend(with_headers(&headers, &body));
                input
            })
            .boxed(),
        "jwt" => "(Bearer )?eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9\\.[A-Za-z0-9_-]{10,80}\\.[A-Za-z0-9_-]{43}"
            .prop_map(String::into_bytes)
            .boxed(),
        "error_template" => (
            prop_oneof![
                Just(r#"{"error":{"code":"{code}","message":"{detail}","status":{status}}}"#.to_string()),
                Just(r#"{"type":"{type}","title":"{title}"}"#.to_string()),
                "\\{\"[a-z]{1,5}\":\"\\{(code|detail|title|type)\\}[ -~]{0,5}\"\\}",
            ],
            "\\PC{0,20}",
        )
            .prop_map(|(t, v)| format!("{t}\0{v}").into_bytes())
            .boxed(),
        other => panic!("no fuzz target {other:?}"),
    }
}

/// `n` inputs of `target`, the same on every run.
pub fn draw(target: &str, n: usize) -> Vec<Vec<u8>> {
    let mut runner = TestRunner::new_with_rng(
        RunnerConfig::default(),
        proptest::test_runner::TestRng::deterministic_rng(
            proptest::test_runner::RngAlgorithm::ChaCha,
        ),
    );
    let strategy = strategy(target);
    (0..n)
        .map(|_| strategy.new_tree(&mut runner).unwrap().current())
        .collect()
}
