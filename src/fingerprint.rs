//! The request fingerprint: what "the same logical request" means when a key is reused.
//!
//! SHA-256 over method, route, path, query and body. A JSON body (`application/json` or
//! `*/*+json`) is canonicalised first: object keys sorted at every depth, insignificant whitespace
//! dropped, escapes normalised, numbers written in one exact form (`1`, `1.0` and `1e0` are the
//! same number; no float rounding, so large amounts never collide) and the route's
//! `fingerprint_ignore` pointers removed. Any other body, or JSON that does not parse, is hashed
//! as bytes.

use http::{HeaderMap, Method};
use serde_json::Value;
use sha2::{Digest, Sha256};

/// A request's fingerprint, stored with the key's record.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub [u8; 32]);

impl std::fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fingerprint({})", hex::encode(&self.0[..8]))
    }
}

impl std::fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

/// What a fingerprint is computed over.
pub struct RequestParts<'a> {
    pub method: &'a Method,
    pub route: &'a str,
    pub path: &'a str,
    pub query: Option<&'a str>,
    pub headers: &'a HeaderMap,
    pub body: &'a [u8],
}

/// Computes the fingerprint of a request whose body was read in full.
pub fn fingerprint(parts: &RequestParts<'_>, ignore: &[String]) -> Fingerprint {
    let mut h = Sha256::new();
    h.update(b"idemgate/fingerprint/v1\x00");
    for field in [
        parts.method.as_str(),
        parts.route,
        parts.path,
        parts.query.unwrap_or(""),
    ] {
        h.update((field.len() as u64).to_be_bytes());
        h.update(field.as_bytes());
    }
    // `?` alone and no query at all are different requests to most servers.
    h.update([u8::from(parts.query.is_some())]);

    let json = is_json(parts.headers)
        .then(|| serde_json::from_slice::<Value>(parts.body).ok())
        .flatten();
    match json {
        Some(mut value) => {
            for pointer in ignore {
                remove_pointer(&mut value, pointer);
            }
            h.update(b"json\x00");
            let mut sink = HashSink(&mut h);
            write_canonical(&value, &mut sink);
        }
        None => {
            h.update(b"bytes\x00");
            h.update(parts.body);
        }
    }
    Fingerprint(h.finalize().into())
}

fn is_json(headers: &HeaderMap) -> bool {
    let Some(ct) = headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let essence = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json" || (essence.contains('/') && essence.ends_with("+json"))
}

/// Removes what `pointer` (RFC 6901) names, if present. An array element becomes `null` rather
/// than shifting its neighbours, so ignoring `/items/0` does not make `/items/1` look like it.
fn remove_pointer(value: &mut Value, pointer: &str) {
    let Some((parent, last)) = pointer.rsplit_once('/') else {
        return;
    };
    let token = last.replace("~1", "/").replace("~0", "~");
    match value.pointer_mut(parent) {
        Some(Value::Object(map)) => {
            map.remove(&token);
        }
        Some(Value::Array(items)) => {
            if let Some(item) = token.parse::<usize>().ok().and_then(|i| items.get_mut(i)) {
                *item = Value::Null;
            }
        }
        _ => {}
    }
}

/// Where canonical JSON goes: straight into the hash, or into a buffer in tests.
pub trait Sink: std::io::Write {
    fn put(&mut self, bytes: &[u8]);
}

struct HashSink<'a>(&'a mut Sha256);

impl std::io::Write for HashSink<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Sink for HashSink<'_> {
    fn put(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

/// Writes the canonical form of `value`. Nesting depth is bounded by the JSON parser (128).
pub fn write_canonical(value: &Value, out: &mut impl Sink) {
    match value {
        Value::Null => out.put(b"null"),
        Value::Bool(true) => out.put(b"true"),
        Value::Bool(false) => out.put(b"false"),
        Value::Number(n) => write_number(n.as_str(), out),
        Value::String(s) => write_string(s, out),
        Value::Array(items) => {
            out.put(b"[");
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.put(b",");
                }
                write_canonical(item, out);
            }
            out.put(b"]");
        }
        Value::Object(map) => {
            // serde_json's map is a BTreeMap here (no `preserve_order`), so it iterates sorted.
            out.put(b"{");
            for (i, (k, v)) in map.iter().enumerate() {
                if i > 0 {
                    out.put(b",");
                }
                write_string(k, out);
                out.put(b":");
                write_canonical(v, out);
            }
            out.put(b"}");
        }
    }
}

fn write_string(s: &str, out: &mut impl Sink) {
    // Escapes straight into the sink, no intermediate buffer; writing to a hash or a Vec cannot
    // fail, and on the impossible error the raw text still goes in.
    if serde_json::to_writer(&mut *out, s).is_err() {
        out.put(s.as_bytes());
    }
}

/// Writes a JSON number as `[-]digits[eEXP]` with no leading or trailing zeros in `digits`:
/// exact for any precision, and equal for equal values written differently.
fn write_number(raw: &str, out: &mut impl Sink) {
    match normalize_number(raw) {
        Some(n) => out.put(n.as_bytes()),
        None => {
            out.put(b"~");
            out.put(raw.as_bytes());
        }
    }
}

/// A JSON number in the same exact, canonical text the fingerprint uses (`1e1` for `10`).
pub fn canonical_number(n: &serde_json::Number) -> String {
    normalize_number(n.as_str()).unwrap_or_else(|| n.as_str().to_string())
}

fn normalize_number(raw: &str) -> Option<String> {
    let (negative, unsigned) = match raw.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, raw),
    };
    let (mantissa, exp) = match unsigned.find(['e', 'E']) {
        Some(i) => (&unsigned[..i], &unsigned[i + 1..]),
        None => (unsigned, "0"),
    };
    let exp = exp.strip_prefix('+').unwrap_or(exp);
    // 18 digits always fit in an i64; longer exponents are astronomically rare and fall back to
    // the raw text (still a stable fingerprint, only not normalised).
    if exp.trim_start_matches('-').len() > 18 {
        return None;
    }
    let mut exp: i128 = exp.parse().ok()?;
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    exp -= frac.len() as i128;
    let mut digits: String = int.chars().chain(frac.chars()).collect();
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let leading = digits.len() - digits.trim_start_matches('0').len();
    digits.drain(..leading);
    if digits.is_empty() {
        return Some("0".into());
    }
    while digits.ends_with('0') {
        digits.pop();
        exp += 1;
    }
    let mut out = String::with_capacity(digits.len() + 8);
    if negative {
        out.push('-');
    }
    out.push_str(&digits);
    if exp != 0 {
        out.push('e');
        out.push_str(&exp.to_string());
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn canon(json: &str) -> String {
        let v: Value = serde_json::from_str(json).unwrap();
        let mut out = Vec::new();
        write_canonical(&v, &mut out);
        String::from_utf8(out).unwrap()
    }

    fn fp(ct: Option<&str>, body: &str, ignore: &[&str]) -> Fingerprint {
        let mut headers = HeaderMap::new();
        if let Some(ct) = ct {
            headers.insert(http::header::CONTENT_TYPE, ct.parse().unwrap());
        }
        let ignore: Vec<String> = ignore.iter().map(|s| s.to_string()).collect();
        fingerprint(
            &RequestParts {
                method: &Method::POST,
                route: "/payments",
                path: "/payments",
                query: None,
                headers: &headers,
                body: body.as_bytes(),
            },
            &ignore,
        )
    }

    const JSON: Option<&str> = Some("application/json");

    #[test]
    fn key_order_and_whitespace_do_not_matter() {
        assert_eq!(
            canon(r#"{ "b": 1, "a": {"d": [1, 2], "c": null} }"#),
            r#"{"a":{"c":null,"d":[1,2]},"b":1}"#
        );
        assert_eq!(
            fp(JSON, r#"{"a":1,"b":2}"#, &[]),
            fp(JSON, "{\n  \"b\": 2,\n  \"a\": 1\n}", &[])
        );
    }

    #[test]
    fn array_order_matters() {
        assert_ne!(fp(JSON, "[1,2]", &[]), fp(JSON, "[2,1]", &[]));
    }

    #[test]
    fn numbers_compare_by_value_exactly() {
        assert_eq!(
            canon("[1, 1.0, 1e0, 10e-1, 0.1e1, 100, 1E2, -0, 0.000]"),
            "[1,1,1,1,1,1e2,1e2,0,0]"
        );
        assert_eq!(canon("[0.5, -12.340, 1e+3]"), "[5e-1,-1234e-2,1e3]");
        // Beyond f64 precision: two different amounts stay different.
        assert_ne!(
            fp(JSON, r#"{"amount":12345678901234567890123}"#, &[]),
            fp(JSON, r#"{"amount":12345678901234567890124}"#, &[])
        );
        assert_ne!(
            fp(JSON, r#"{"amount":1}"#, &[]),
            fp(JSON, r#"{"amount":"1"}"#, &[])
        );
    }

    #[test]
    fn unicode_escapes_are_normalised() {
        assert_eq!(canon(r#""caf\u00e9""#), canon("\"caf\u{e9}\""));
        assert_eq!(canon(r#"{"\u0061":1}"#), canon(r#"{"a":1}"#));
        assert_eq!(
            fp(JSON, r#"{"name":"\u00e9"}"#, &[]),
            fp(JSON, "{\"name\":\"\u{e9}\"}", &[])
        );
    }

    #[test]
    fn ignored_pointers_are_left_out() {
        let a = r#"{"amount":100,"meta":{"sentAt":"2026-01-01T00:00:00Z","id":1}}"#;
        let b = r#"{"amount":100,"meta":{"sentAt":"2026-01-02T09:30:00Z","id":1}}"#;
        assert_ne!(fp(JSON, a, &[]), fp(JSON, b, &[]));
        assert_eq!(
            fp(JSON, a, &["/meta/sentAt"]),
            fp(JSON, b, &["/meta/sentAt"])
        );
        // Ignoring one field never hides a change in another.
        let c = r#"{"amount":101,"meta":{"sentAt":"2026-01-02T09:30:00Z","id":1}}"#;
        assert_ne!(
            fp(JSON, a, &["/meta/sentAt"]),
            fp(JSON, c, &["/meta/sentAt"])
        );
        // Escaped pointer tokens and array elements.
        assert_eq!(
            fp(JSON, r#"{"a/b":1,"x":[1,2]}"#, &["/a~1b", "/x/0"]),
            fp(JSON, r#"{"a/b":2,"x":[9,2]}"#, &["/a~1b", "/x/0"])
        );
        assert_ne!(
            fp(JSON, r#"{"x":[1,2]}"#, &["/x/0"]),
            fp(JSON, r#"{"x":[2]}"#, &["/x/0"])
        );
    }

    #[test]
    fn non_json_bodies_are_hashed_as_bytes() {
        assert_ne!(
            fp(None, r#"{"a":1,"b":2}"#, &[]),
            fp(None, r#"{"b":2,"a":1}"#, &[])
        );
        assert_eq!(fp(None, "x=1", &[]), fp(None, "x=1", &[]));
        assert_ne!(fp(JSON, "{not json", &[]), fp(JSON, "{not json!", &[]));
        assert_eq!(
            fp(
                Some("application/vnd.api+json; charset=utf-8"),
                r#"{"a":1,"b":2}"#,
                &[]
            ),
            fp(Some("application/vnd.api+json"), r#"{"b":2,"a":1}"#, &[])
        );
    }

    #[test]
    fn method_path_and_query_are_part_of_it() {
        let headers = HeaderMap::new();
        let base = RequestParts {
            method: &Method::POST,
            route: "/r",
            path: "/r",
            query: None,
            headers: &headers,
            body: b"",
        };
        let f = |p: &RequestParts<'_>| fingerprint(p, &[]);
        let a = f(&base);
        assert_ne!(
            a,
            f(&RequestParts {
                method: &Method::PUT,
                ..base
            })
        );
        assert_ne!(
            a,
            f(&RequestParts {
                path: "/r/",
                ..base
            })
        );
        assert_ne!(
            a,
            f(&RequestParts {
                query: Some(""),
                ..base
            })
        );
        assert_ne!(
            f(&RequestParts {
                query: Some("a=1"),
                ..base
            }),
            f(&RequestParts {
                query: Some("a=2"),
                ..base
            })
        );
    }

    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            "[a-z\u{e9}\u{1F600}\"\\\\]{0,6}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
                prop::collection::btree_map("[a-d]{1,2}", inner, 0..5)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// Serialises objects with their keys in reverse order and random spacing.
    fn scrambled(v: &Value, spaces: &mut impl Iterator<Item = bool>) -> String {
        let sp =
            |s: &mut dyn Iterator<Item = bool>| if s.next().unwrap_or(false) { " \n" } else { "" };
        match v {
            Value::Array(items) => {
                let parts: Vec<String> = items.iter().map(|i| scrambled(i, spaces)).collect();
                format!("[{}{}]", sp(spaces), parts.join(" , "))
            }
            Value::Object(map) => {
                let parts: Vec<String> = map
                    .iter()
                    .rev()
                    .map(|(k, v)| {
                        format!(
                            "{}{}: {}",
                            sp(spaces),
                            serde_json::to_string(k).unwrap(),
                            scrambled(v, spaces)
                        )
                    })
                    .collect();
                format!("{{{}}}", parts.join(","))
            }
            other => serde_json::to_string(other).unwrap(),
        }
    }

    proptest! {
        #[test]
        fn same_value_any_layout_same_fingerprint(v in json_value(), spaces in prop::collection::vec(any::<bool>(), 64)) {
            let compact = serde_json::to_string(&v).unwrap();
            let other = scrambled(&v, &mut spaces.into_iter().cycle());
            prop_assert_eq!(fp(JSON, &compact, &[]), fp(JSON, &other, &[]));
        }

        /// The canonical form is valid JSON and canonicalising it again changes nothing.
        #[test]
        fn canonical_form_is_a_fixed_point(v in json_value()) {
            let mut once = Vec::new();
            write_canonical(&v, &mut once);
            let back: Value = serde_json::from_slice(&once).unwrap();
            let mut twice = Vec::new();
            write_canonical(&back, &mut twice);
            prop_assert_eq!(once, twice);
        }

        #[test]
        fn equal_numbers_normalise_equally(int in 0u64..1_000_000, zeros in 0usize..4, shift in 0i32..4) {
            let plain = int.to_string();
            let padded = format!("{plain}.{}", "0".repeat(zeros.max(1)));
            let scaled = format!("{int}e{shift}");
            prop_assert_eq!(normalize_number(&plain), normalize_number(&padded));
            let expected = normalize_number(&((int as u128) * 10u128.pow(shift as u32)).to_string());
            prop_assert_eq!(normalize_number(&scaled), expected);
        }

        #[test]
        fn any_bytes_fingerprint_without_panic(body in prop::collection::vec(any::<u8>(), 0..200)) {
            let headers = HeaderMap::new();
            let _ = fingerprint(&RequestParts { method: &Method::POST, route: "/", path: "/", query: None, headers: &headers, body: &body }, &[]);
        }
    }
}
