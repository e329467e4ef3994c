//! What must hold for each parser of outside input, whatever the input: shared by the
//! property-based targets (`tests/fuzz/main.rs`, proptest) and the coverage-guided ones
//! (`fuzz/`, cargo-fuzz), so both drivers assert the same. Each function panics on a violation;
//! "no panic" is the first property of all.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method};
use idemgate::config::answers::{ErrorBody, Fields};
use idemgate::config::Config;
use idemgate::fingerprint::{canonical_json, IgnoredFields};
use idemgate::key::{parse_key_value, KeySource, StoreKey};
use idemgate::route::{RoutePattern, Routed, Router};
use idemgate::store::codec::{self, Seal};
use idemgate::store::seal::{Sealer, Sealing};
use idemgate::store::{RecordState, StoreError};
use serde_json::Value;

/// The `Idempotency-Key` header: accepted only as 1 to 255 visible ASCII characters, and a
/// bare key and its quoted form are the same key.
pub fn key_header(raw: &[u8]) {
    if let Ok(key) = parse_key_value(raw) {
        assert!((1..=255).contains(&key.len()), "{key:?}");
        assert!(key.bytes().all(|b| (0x20..=0x7e).contains(&b)), "{key:?}");
        let bare = key.as_str();
        if !bare.contains(['"', '\\', ' ']) && bare.len() <= 253 {
            let quoted = parse_key_value(format!("\"{bare}\"").as_bytes());
            assert_eq!(quoted, parse_key_value(bare.as_bytes()), "{bare:?}");
        }
    }
}

/// Keys taken from a header and body fields (a route's `key_from`, a consumer's message
/// fields): never a panic; a composite key is a hash, of one length whatever its parts.
pub fn key_fields(headers: &HeaderMap, body: &[u8]) {
    let source = KeySource {
        headers: vec![HeaderName::from_static("x-part")],
        pointers: vec!["/id".into(), "/a/0".into()],
    };
    if let Ok(Some(key)) = source.extract(headers, body) {
        assert_eq!(key.len(), 64, "{key:?}");
    }
    let single = KeySource {
        headers: vec![],
        pointers: vec!["/event/id".into()],
    };
    if let Ok(Some(key)) = single.extract(headers, body) {
        assert!(!key.is_empty());
    }
}

fn canon(body: &[u8]) -> Option<Vec<u8>> {
    canonical_json(body, &IgnoredFields::default())
}

/// Canonical JSON: never a panic; a canonical form is its own canonical form, unless it holds a
/// number whose exponent is too long to normalise, which it keeps verbatim behind a `~` (no
/// JSON, so never equal to a normalised one: found by cargo-fuzz, `[86e-3531539885380889008]`);
/// a JSON value has one canonical form in any layout; ignored fields never panic.
pub fn canonical(body: &[u8]) {
    if let Some(c) = canon(body) {
        match canon(&c) {
            // Normalising can make an exponent that long (`10e999999999999999999` is
            // `1e1000000000000000000`): the second pass keeps it verbatim.
            Some(again) if again.contains(&b'~') && !c.contains(&b'~') => {}
            Some(again) => assert_eq!(again, c, "not its own canonical form"),
            None => assert!(
                c.contains(&b'~'),
                "not JSON: {:?}",
                String::from_utf8_lossy(&c)
            ),
        }
    }
    if let Ok(value) = serde_json::from_slice::<Value>(body) {
        let compact = canon(value.to_string().as_bytes()).expect("valid JSON");
        let pretty = canon(serde_json::to_string_pretty(&value).unwrap().as_bytes());
        assert_eq!(Some(&compact), pretty.as_ref(), "two layouts, two forms");
    }
    let ignore = IgnoredFields::new(&["/id".into(), "/a/0".into(), "/meta/~1x~0y".into()]);
    if let Some(c) = canonical_json(body, &ignore) {
        let again = canonical_json(&c, &ignore);
        let verbatim = |b: &[u8]| b.contains(&b'~');
        assert!(
            again.as_ref() == Some(&c) || verbatim(&c) || again.as_deref().is_some_and(verbatim)
        );
    }
}

pub struct R(pub RoutePattern, Vec<Method>);

impl Routed for R {
    fn pattern(&self) -> &RoutePattern {
        &self.0
    }
    fn methods(&self) -> &[Method] {
        &self.1
    }
}

pub fn router(patterns: &[&str], case_sensitive: bool) -> Router<R> {
    Router::new(
        patterns
            .iter()
            .map(|p| R(RoutePattern::parse(p).unwrap(), vec![Method::POST])),
        case_sensitive,
    )
}

/// A route pattern parses or is refused; a parsed one matches and overlaps without a panic.
pub fn pattern(raw: &str) {
    if let Ok(p) = RoutePattern::parse(raw) {
        let _ = p.matches(raw);
        let _ = p.overlap_example(&p);
    }
}

/// Route matching: never a panic; the route found for a path is found for its upper case and
/// with `;params` on its last segment.
pub fn route(path: &str) {
    let r = router(&["/payments", "/orders/*/capture", "/files/**"], false);
    let found = r.find(&Method::POST, path).map(|r| r.0.to_string());
    if found.is_some() && !path.contains('%') {
        let upper = r.find(&Method::POST, &path.to_ascii_uppercase());
        assert_eq!(found, upper.map(|r| r.0.to_string()), "upper case");
    }
    // A segment that is only `;params` once `..` is resolved (`/orders/;/capture`, where `*`
    // matches it as written) is dropped by a framework that drops them: no route there then.
    let mut resolved: Vec<&str> = Vec::new();
    for seg in path.split('/') {
        match seg {
            "" | "." => {}
            ".." => {
                resolved.pop();
            }
            _ => resolved.push(seg),
        }
    }
    let only_params = resolved.iter().any(|seg| seg.starts_with(';'));
    // `;params` after a last `.` or `..` make it `..;x`, which frameworks read as `..` (found by
    // cargo-fuzz): another path, rightly not the route.
    let dots_last = matches!(path.rsplit('/').next(), Some("." | ".."));
    if found.is_some() && !path.contains('%') && !only_params && !dots_last {
        let with_params = r.find(&Method::POST, &format!("{path};jsessionid=1"));
        assert_eq!(found, with_params.map(|r| r.0.to_string()), ";params");
    }
    let _ = router(&["/payments"], true).find(&Method::POST, path);
}

/// Two keys, the second listed: what a rotated keys file holds.
pub fn sealer() -> Sealer {
    Sealer::parse("new:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=\nold:HxwdHhsaGRgXFhUUExIREA8ODQwLCgkIBwYFBAMCAQA=").unwrap()
}

/// Stored bytes, however damaged: never a panic; what decodes encodes to a record that decodes
/// the same, in the clear and sealed, and a sealed one re-encodes to the bytes it was read
/// from (the stores' compare-and-set compares them) and opens under its own store key only.
pub fn record(raw: &[u8]) {
    let raw = Bytes::copy_from_slice(raw);
    let sealer = sealer();
    let key = StoreKey::from_bytes([7; 32]);
    let seal = Seal::new(Some(&sealer), &key);
    let _ = codec::decode(&raw, seal);
    let Ok(decoded) = codec::decode(&raw, Seal::PLAIN) else {
        return;
    };
    let again = codec::encode(&decoded, Seal::PLAIN);
    assert_eq!(codec::decode(&again, Seal::PLAIN).unwrap(), decoded);
    let mut fresh = decoded.clone();
    fresh.sealing = Sealing::New;
    let sealed = codec::encode(&fresh, seal);
    let read = codec::decode(&sealed, seal).unwrap();
    assert_eq!(read, decoded);
    assert_eq!(codec::encode(&read, seal), sealed, "re-encoded otherwise");
    let open = read.origin.is_some() || matches!(read.state, RecordState::Completed(_));
    if open {
        let other = StoreKey::from_bytes([8; 32]);
        let unreadable = |e: StoreError| matches!(e, StoreError::Unreadable { .. });
        assert!(codec::decode(&sealed, Seal::new(Some(&sealer), &other)).is_err_and(unreadable));
        assert!(codec::decode(&sealed, Seal::PLAIN).is_err_and(unreadable));
    }
}

/// A config file: a config, or an error that says why; a config describes itself.
pub fn config(text: &str) {
    match Config::parse(text) {
        Ok(c) => {
            let _ = idemgate::cli::describe(&c);
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
}

/// A keys file (`store.encryption_keys_file`): keys, or an error that never shows a key (any
/// line's text that is one: 32 bytes of base64).
pub fn keys_file(text: &str) {
    use base64::Engine as _;
    if let Err(e) = Sealer::parse(text) {
        let shown = e.to_string();
        for line in text.lines() {
            if let Some((_, secret)) = line.split_once(':') {
                let secret = secret.trim();
                let decoded = base64::engine::general_purpose::STANDARD.decode(secret);
                if decoded.is_ok_and(|k| k.len() == 32) {
                    assert!(!shown.contains(secret), "{shown:?} shows {secret:?}");
                }
            }
        }
    }
}

/// Headers in the form `name: value` per line, up to an empty line; the rest is the body.
pub fn headers_and_body(input: &[u8]) -> (HeaderMap, &[u8]) {
    let mut headers = HeaderMap::new();
    let mut rest = input;
    while let Some(end) = rest.iter().position(|&b| b == b'\n') {
        let line = &rest[..end];
        rest = &rest[end + 1..];
        if line.is_empty() {
            break;
        }
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            continue;
        };
        let value = line[colon + 1..]
            .strip_prefix(b" ")
            .unwrap_or(&line[colon + 1..]);
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(&line[..colon]),
            HeaderValue::from_bytes(value),
        ) {
            headers.append(n, v);
        }
    }
    (headers, rest)
}

/// Now, for the timestamped signature schemes (a fixed time: a run is reproducible).
pub const NOW_S: i64 = 1_800_000_000;

/// A webhook delivery under scheme `n`: never a panic; a delivery that passes, passes for its
/// bytes only; its sender's signature over the same bytes passes; the same signature over
/// other bytes is refused.
pub fn webhook(n: u8, headers: &HeaderMap, body: &[u8]) {
    if idemgate::fuzzing::verify_webhook(n, headers, body, NOW_S).is_ok() {
        // Whatever headers passed, their signature binds these bytes and no others.
        let mut other = body.to_vec();
        other.push(b'x');
        assert!(idemgate::fuzzing::verify_webhook(n, headers, &other, NOW_S).is_err());
    }
    let mut signed = HeaderMap::new();
    for (name, value) in idemgate::fuzzing::sign_webhook(n, "msg_1", NOW_S, body) {
        signed.append(
            HeaderName::from_bytes(name.as_bytes()).unwrap(),
            HeaderValue::from_str(&value).unwrap(),
        );
    }
    assert_eq!(
        idemgate::fuzzing::verify_webhook(n, &signed, body, NOW_S),
        Ok(())
    );
    let mut other = body.to_vec();
    other.push(b'x');
    assert_eq!(
        idemgate::fuzzing::verify_webhook(n, &signed, &other, NOW_S),
        Err("invalid")
    );
}

/// A bearer token: never a panic, and one not signed with the secret never verifies (a forged
/// token would choose its client scope); a JWKS document is keys or an error.
pub fn jwt(token: &str) {
    let verified = idemgate::fuzzing::verify_jwt(token, NOW_S as u64 * 1000);
    assert!(
        verified.is_err(),
        "a token made up by the fuzzer verified: {token:?}"
    );
    let _ = idemgate::fuzzing::parse_jwks(token.as_bytes());
}

/// An `error_body` template: refused, or every problem renders valid JSON with it, whatever
/// the values (quotes, backslashes, control characters, `</script>`).
pub fn error_template(template: &str, value: &str) {
    if let Ok(body) = ErrorBody::parse("application/json", template) {
        let rendered = body.render(&Fields {
            code: value,
            type_uri: value,
            title: value,
            detail: value,
            status: 409,
        });
        assert!(
            serde_json::from_slice::<Value>(&rendered).is_ok(),
            "{template:?} with {value:?} rendered {:?}",
            String::from_utf8_lossy(&rendered)
        );
    }
}

/// Every target, by the name its cargo-fuzz binary has (`fuzz/fuzz_targets/<name>.rs`).
pub const TARGETS: &[&str] = &[
    "key_header",
    "key_fields",
    "canonical_json",
    "route_pattern",
    "route_match",
    "record",
    "config",
    "keys_file",
    "webhook",
    "jwt",
    "error_template",
];

/// Runs `target`'s checks on one input, read in the target's layout (the same bytes for both
/// drivers, and the corpus in `fuzz/corpus/<target>/`).
pub fn run(target: &str, data: &[u8]) {
    let text = std::str::from_utf8(data).ok();
    match target {
        "key_header" => key_header(data),
        "key_fields" => {
            let (headers, body) = headers_and_body(data);
            key_fields(&headers, body);
        }
        "canonical_json" => canonical(data),
        "route_pattern" => pattern(&String::from_utf8_lossy(data)),
        "route_match" => route(&String::from_utf8_lossy(data)),
        "record" => record(data),
        "config" => text.into_iter().for_each(config),
        "keys_file" => text.into_iter().for_each(keys_file),
        "webhook" => {
            if let Some((&n, rest)) = data.split_first() {
                let (headers, body) = headers_and_body(rest);
                webhook(n, &headers, body);
            }
        }
        "jwt" => text.into_iter().for_each(jwt),
        "error_template" => {
            if let Some(text) = text {
                let (template, value) = text.split_once('\0').unwrap_or((text, "\"x"));
                error_template(template, value);
            }
        }
        other => panic!("no fuzz target {other:?}"),
    }
}
