//! The fingerprint's forms and the canonical JSON it reads bodies through, held to models of
//! the previous version.
use super::canonical::{normalize_number, NUMBER_TOKEN};
use super::*;
use proptest::prelude::*;
use serde::de::{self, Deserializer, MapAccess, Visitor};

use serde_json::Value;

fn canon(json: &str) -> String {
    String::from_utf8(canonical_json(json.as_bytes(), &IgnoredFields::default()).unwrap()).unwrap()
}

fn norm(raw: &str) -> Option<String> {
    let mut out = Vec::new();
    normalize_number(raw, &mut out).then(|| String::from_utf8(out).unwrap())
}

/// The model the streaming canonicaliser must match byte for byte: how fingerprints were
/// computed before it, by parsing into a `Value`, removing the ignored pointers and writing
/// the value out. Stored fingerprints stay valid across the change only if the two agree.
mod model {
    use serde_json::Value;

    pub fn canonical(body: &[u8], ignore: &[String]) -> Option<Vec<u8>> {
        let mut value: Value = serde_json::from_slice(body).ok()?;
        for pointer in ignore {
            remove_pointer(&mut value, pointer);
        }
        let mut out = Vec::new();
        write(&value, &mut out);
        Some(out)
    }

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

    fn write(value: &Value, out: &mut Vec<u8>) {
        match value {
            Value::Null => out.extend_from_slice(b"null"),
            Value::Bool(true) => out.extend_from_slice(b"true"),
            Value::Bool(false) => out.extend_from_slice(b"false"),
            Value::Number(n) => out.extend_from_slice(super::super::canonical_number(n).as_bytes()),
            Value::String(s) => serde_json::to_writer(&mut *out, s).unwrap(),
            Value::Array(items) => {
                out.push(b'[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    write(item, out);
                }
                out.push(b']');
            }
            Value::Object(map) => {
                out.push(b'{');
                for (i, (k, v)) in map.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    serde_json::to_writer(&mut *out, k).unwrap();
                    out.push(b':');
                    write(v, out);
                }
                out.push(b'}');
            }
        }
    }
}

/// A request to the `/payments` route with `headers` and `body`, nothing else named.
fn on_payments<'a>(headers: &'a HeaderMap, body: &'a [u8]) -> RequestParts<'a> {
    RequestParts {
        method: &Method::POST,
        route: "/payments",
        path: "/payments",
        query: None,
        headers,
        identity: &[],
        authority: None,
        body,
    }
}

fn fp(ct: Option<&str>, body: &str, ignore: &[&str]) -> Fingerprint {
    let mut headers = HeaderMap::new();
    if let Some(ct) = ct {
        headers.insert(http::header::CONTENT_TYPE, ct.parse().unwrap());
    }
    let ignore: Vec<String> = ignore.iter().map(|s| s.to_string()).collect();
    fingerprint(
        &on_payments(&headers, body.as_bytes()),
        &IgnoredFields::new(&ignore),
    )
}

const JSON: Option<&str> = Some("application/json");

/// The fingerprint of a JSON body.
fn both(body: &str) -> Fingerprint {
    fp(JSON, body, &[])
}

/// The previous version's fingerprint of a JSON body, as [`earlier_fingerprint`] gives it.
fn previous(body: &str) -> Fingerprint {
    let mut headers = HeaderMap::new();
    headers.insert(
        http::header::CONTENT_TYPE,
        "application/json".parse().unwrap(),
    );
    earlier_fingerprint(
        &on_payments(&headers, body.as_bytes()),
        &IgnoredFields::default(),
    )
    .unwrap()
}

/// The previous version's fingerprint of a JSON body to `/payments`, written out as that
/// version computed it (b339059, `fingerprint`): canonicalised whatever keys it has, or hashed
/// as bytes when it does not parse.
fn previous_model(body: &str) -> Fingerprint {
    let mut h = Sha256::new();
    h.update(b"idemgate/fingerprint/v1\x00");
    for field in ["POST", "/payments", "/payments", ""] {
        h.update((field.len() as u64).to_be_bytes());
        h.update(field.as_bytes());
    }
    h.update([0]);
    match canonical_json(body.as_bytes(), &IgnoredFields::default()) {
        Some(c) => {
            h.update(b"json\x00");
            h.update(c);
        }
        None => {
            h.update(b"bytes\x00");
            h.update(body.as_bytes());
        }
    }
    Fingerprint(h.finalize().into())
}

#[test]
fn keys_equal_but_for_case_or_repeated_are_never_taken_for_one_request() {
    // What Go's encoding/json, ASP.NET Core and case-insensitive Jackson read as 1000 and 1.
    let pairs = [
        (
            r#"{"amount":1,"Amount":1000}"#,
            r#"{"Amount":1000,"amount":1}"#,
        ),
        (r#"{"amount":1,"amount":1000}"#, r#"{"amount":1000}"#),
        (
            r#"{"amount":1000,"amount":1}"#,
            r#"{"amount":1,"amount":1000}"#,
        ),
        (r#"{"k":1,"\u212a":2}"#, r#"{"\u212a":2,"k":1}"#),
        (r#"{"s":1,"\u017f":2}"#, r#"{"\u017f":2,"s":1}"#),
        (r#"{"x":{"ID":1,"id":2}}"#, r#"{"x":{"id":2,"ID":1}}"#),
        (r#"{"\u00df":1,"\u1e9e":2}"#, r#"{"\u1e9e":2,"\u00df":1}"#),
        (r#"{"aB":1,"Ab":2}"#, r#"{"Ab":2,"aB":1}"#),
    ];
    for (a, b) in pairs {
        assert_ne!(both(a), both(b), "{a} vs {b}");
        assert_ne!(both(a), both(&format!(" {a}")), "{a}: hashed as its bytes");
        assert_eq!(both(a), both(a), "the same bytes again: the same request");
    }
}

/// The fingerprint of `body` sent with `content_type`.
fn typed(content_type: &str, body: &str) -> Fingerprint {
    fp(Some(content_type), body, &[])
}

#[test]
fn the_media_type_is_part_of_the_request() {
    let body = r#"{"amount":1}"#;
    let json = typed("application/json", body);
    assert_ne!(
        json,
        fp(None, body, &[]),
        "no Content-Type is another request"
    );
    assert_eq!(typed("Application/JSON; charset=utf-8", body), json);
    let patch = typed("application/merge-patch+json", body);
    assert_ne!(patch, json);
    assert_ne!(
        typed("application/x-www-form-urlencoded", "a=1"),
        typed("text/plain", "a=1")
    );
    assert_ne!(
        typed("text/plain; charset=utf-8", "caf\u{e9}"),
        typed("text/plain; charset=latin1", "caf\u{e9}"),
        "a charset changes what the bytes say"
    );
    assert_eq!(
        typed("multipart/form-data; boundary=a", "x"),
        typed("multipart/form-data; boundary=b", "x"),
        "a boundary is new in every request"
    );
    assert_eq!(
        typed("application/merge-patch+json; charset=utf-8", body),
        patch,
        "JSON has no charset but UTF-8"
    );
    assert_ne!(
        typed("application/json; charset=utf-16", "not json"),
        typed("application/json; charset=utf-8", "not json"),
        "a body not read as JSON keeps its charset"
    );
}

#[test]
fn a_quoted_semicolon_neither_hides_nor_forges_a_charset() {
    let plain = typed("text/plain", "x");
    assert_eq!(typed(r#"text/plain; x="a;charset=latin1""#, "x"), plain);
    assert_eq!(
        typed(r#"text/plain; x="a;b"; charset=latin1"#, "x"),
        typed("text/plain; charset=latin1", "x")
    );
    assert_eq!(
        typed(r#"text/plain; charset="LATIN1""#, "x"),
        typed("text/plain; charset=latin1", "x")
    );
    assert_eq!(
        typed(r#"text/plain; x="a\";charset=utf-8""#, "x"),
        plain,
        "an escaped quote does not end the string"
    );
    assert_ne!(typed("text/plain; charset=latin1", "x"), plain);
    assert_ne!(
        typed("text/plain; charset=utf-8; charset=latin1", "x"),
        typed("text/plain; charset=utf-8; charset=utf-16", "x"),
        "readers differ on which of two they take: both count"
    );
    assert_ne!(
        typed(r#"text/plain; charset="x\""#, "x"),
        typed("text/plain; charset=x", "x"),
        "a quoted string left open is not unquoted"
    );
    assert_ne!(
        typed(r#"text/plain; a=b"c; charset=latin1"#, "x"),
        typed(r#"text/plain; a=b"c; charset=utf-8"#, "x"),
        "a quote inside a token starts no quoted string"
    );
}

#[test]
fn named_headers_are_part_of_the_request() {
    let tenant = [http::HeaderName::from_static("x-tenant")];
    let with = |values: &[&str]| {
        let mut headers = HeaderMap::new();
        headers.insert(
            http::header::CONTENT_TYPE,
            "application/json".parse().unwrap(),
        );
        for v in values {
            headers.append("x-tenant", v.parse().unwrap());
        }
        let parts = RequestParts {
            identity: &tenant,
            ..on_payments(&headers, b"{}")
        };
        fingerprint(&parts, &IgnoredFields::default())
    };
    assert_eq!(with(&["t1"]), with(&["t1"]));
    assert_ne!(with(&["t1"]), with(&["t2"]));
    assert_ne!(with(&[]), with(&[""]), "absent is not empty");
    assert_ne!(with(&["t1", "t2"]), with(&["t2", "t1"]), "in order");
}

#[test]
fn host_is_the_authority_over_http2() {
    let host = [http::header::HOST];
    let with = |header: Option<&str>, authority: Option<&str>| {
        let mut headers = HeaderMap::new();
        if let Some(h) = header {
            headers.insert(http::header::HOST, h.parse().unwrap());
        }
        let parts = RequestParts {
            identity: &host,
            authority,
            ..on_payments(&headers, b"{}")
        };
        fingerprint(&parts, &IgnoredFields::default())
    };
    assert_ne!(with(None, Some("shop1")), with(None, Some("shop2")));
    assert_eq!(
        with(Some("shop1"), None),
        with(None, Some("shop1")),
        "HTTP/1.1's Host and HTTP/2's :authority alike"
    );
    assert_eq!(
        with(Some("shop1"), Some("other")),
        with(Some("shop1"), None)
    );
}

#[test]
fn the_number_marker_never_comes_from_a_client() {
    let marker = r#"{"$serde_json::private::Number":"1e3"}"#;
    assert_ne!(both(marker), both("1000"));
    assert_ne!(both(marker), both("1e3"));
    let escaped = r#"{"$serde_json::private::Numb\u0065r":"1e3"}"#;
    assert_ne!(both(escaped), both("1000"));
    // A number too large for an integer still goes through the parser's own marker.
    let big = "12345678901234567890123";
    assert_eq!(
        both(big),
        both(&format!(" {big} ")),
        "canonicalised, not bytes"
    );
    assert_eq!(previous(big), previous_model(big));
    assert_eq!(both(&format!("{big}.0")), both(big));
}

#[test]
fn the_earlier_form_is_the_previous_versions_and_never_this_ones() {
    // Computed apart (Python's hashlib) over the previous version's layout.
    assert_eq!(
        previous(r#"{"b":1, "a":2}"#).to_string(),
        "53616caed767f462390d2e849775dc113d9d462fb6499d7ce8f0000f17eb5452"
    );
    // As the previous version's binary stored it on Redis (tests/e2e/fingerprint.rs).
    assert_eq!(
        previous(r#"{"amount":1000,"currency":"EUR"}"#).to_string(),
        "91715198b05cd565f9844d32ad29715d312df17378c3293da1da6c0151c28bc9"
    );
    for body in [
        r#"{"b":1,"a":{"d":[1,2],"c":null}}"#,
        r#"{"Amount":1,"currency":"EUR"}"#,
        r#"{"amount":1,"Amount":1000}"#,
        "[1,2,3]",
        "not json",
    ] {
        assert_eq!(previous(body), previous_model(body), "{body}");
        assert_ne!(both(body), previous(body), "{body}");
    }
    let tenant = [http::HeaderName::from_static("x-tenant")];
    let headers = HeaderMap::new();
    let parts = RequestParts {
        identity: &tenant,
        ..on_payments(&headers, b"{}")
    };
    assert_eq!(
        earlier_fingerprint(&parts, &IgnoredFields::default()),
        None,
        "the previous version knew nothing of fingerprint_headers"
    );
}

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

/// `Canon::visit_map` knows a number that fits no integer only by the private key serde_json's
/// `arbitrary_precision` hands it over under. Should serde_json rename that key or hand such
/// numbers over another way, they would be written as objects, and every stored fingerprint
/// of a body with a decimal in it would change: this test fails first.
#[test]
fn serde_json_hands_big_numbers_over_as_number_token() {
    const BIG: &str = "123456789012345678901234567890.000000000000000000001";

    /// The first map entry the parser hands over, as (key, value).
    struct FirstEntry;
    impl<'de> Visitor<'de> for FirstEntry {
        type Value = (String, String);
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "a map under {NUMBER_TOKEN:?}")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let key: String = map
                .next_key()?
                .ok_or_else(|| de::Error::custom("an empty map"))?;
            Ok((key, map.next_value()?))
        }
    }
    let mut de = serde_json::Deserializer::from_str(BIG);
    let (key, text) = de.deserialize_any(FirstEntry).unwrap_or_else(|e| {
        panic!("serde_json no longer hands {BIG} over as a map under {NUMBER_TOKEN:?}: {e}")
    });
    assert_eq!(
        key, NUMBER_TOKEN,
        "serde_json's arbitrary-precision number token changed: update NUMBER_TOKEN"
    );
    assert_eq!(
        text, BIG,
        "the text under {NUMBER_TOKEN:?} is not the number's"
    );

    // And through the canonicaliser: every digit kept, no object in sight.
    assert_eq!(
        canon(&format!(r#"{{"amount":{BIG}}}"#)),
        r#"{"amount":123456789012345678901234567890000000000000000000001e-21}"#,
        "a number under {NUMBER_TOKEN:?} was not recognised as one"
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
        identity: &[],
        authority: None,
        body: b"",
    };
    let f = |p: &RequestParts<'_>| fingerprint(p, &IgnoredFields::default());
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
    let sp = |s: &mut dyn Iterator<Item = bool>| if s.next().unwrap_or(false) { " \n" } else { "" };
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

/// JSON text in every form the parser accepts: repeated and escaped keys, numbers written
/// every way (integers that fit, huge ones, decimals, exponents, `-0`), escapes, spacing.
fn json_text() -> impl Strategy<Value = String> {
    let number = prop_oneof![
        Just("0".to_string()),
        Just("-0".to_string()),
        Just("10".to_string()),
        Just("1.50".to_string()),
        Just("-0.000".to_string()),
        Just("1e3".to_string()),
        Just("2E-2".to_string()),
        Just("12345678901234567890123".to_string()),
        Just("-9223372036854775809".to_string()),
        Just("18446744073709551616".to_string()),
        Just("1e0000000000000000000001".to_string()),
        any::<i64>().prop_map(|n| n.to_string()),
        (any::<u32>(), 0u32..6, -30i32..30)
            .prop_map(|(m, f, e)| format!("{m}.{}e{e}", "0".repeat(f as usize))),
    ];
    let string = prop_oneof![
        "[a-c]{0,2}".prop_map(|s| format!("\"{s}\"")),
        Just(r#""\u0061""#.to_string()),
        Just(r#""caf\u00e9\/\n""#.to_string()),
        Just("\"\u{e9}\u{1F600}\"".to_string()),
        Just(r#""$serde_json::private::Number""#.to_string()),
    ];
    let leaf = prop_oneof![
        Just("null".to_string()),
        Just("true".to_string()),
        Just("false".to_string()),
        number,
        string.clone(),
    ];
    let space = prop_oneof![Just(""), Just(" "), Just("\n\t ")];
    leaf.prop_recursive(4, 40, 5, move |inner| {
        prop_oneof![
            (prop::collection::vec(inner.clone(), 0..5), space.clone())
                .prop_map(|(items, s)| format!("[{s}{}]", items.join(&format!("{s},")))),
            (
                prop::collection::vec((string.clone(), inner), 0..5),
                space.clone()
            )
                .prop_map(|(members, s)| {
                    let members: Vec<String> = members
                        .into_iter()
                        .map(|(k, v)| format!("{k}{s}:{v}"))
                        .collect();
                    format!("{{{s}{}}}", members.join(","))
                }),
        ]
    })
}

fn pointer() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::collection::vec(
            prop_oneof![
                Just("a"),
                Just("b"),
                Just("0"),
                Just("1"),
                Just("01"),
                Just("+1"),
                Just(""),
                Just("a~1b"),
                Just("~0")
            ],
            1..4
        )
        .prop_map(|t| format!("/{}", t.join("/"))),
        Just("/".to_string()),
    ]
}

proptest! {
    /// Any JSON text: the earlier form is the previous version's fingerprint, and this
    /// version's never is.
    #[test]
    fn the_earlier_form_is_always_the_previous_versions(text in json_text()) {
        prop_assert_eq!(previous(&text), previous_model(&text));
        prop_assert_ne!(both(&text), previous(&text));
    }

    #[test]
    fn same_value_any_layout_same_fingerprint(v in json_value(), spaces in prop::collection::vec(any::<bool>(), 64)) {
        let compact = serde_json::to_string(&v).unwrap();
        let other = scrambled(&v, &mut spaces.into_iter().cycle());
        prop_assert_eq!(fp(JSON, &compact, &[]), fp(JSON, &other, &[]));
    }

    /// The canonical form is valid JSON and canonicalising it again changes nothing.
    #[test]
    fn canonical_form_is_a_fixed_point(v in json_value()) {
        let once = canonical_json(serde_json::to_string(&v).unwrap().as_bytes(), &IgnoredFields::default()).unwrap();
        let twice = canonical_json(&once, &IgnoredFields::default()).unwrap();
        prop_assert_eq!(once, twice);
    }

    /// The streaming canonicaliser writes what the `Value` model writes, for any JSON text
    /// (repeated keys, every number form, escapes, layout) and any ignore pointers.
    #[test]
    fn streaming_matches_the_value_model(text in json_text(), ignore in prop::collection::vec(pointer(), 0..4)) {
        prop_assert_eq!(
            canonical_json(text.as_bytes(), &IgnoredFields::new(&ignore)),
            model::canonical(text.as_bytes(), &ignore),
            "{} ignoring {:?}", text, ignore
        );
    }

    /// Broken JSON is refused by both alike (and then hashed as bytes).
    #[test]
    fn streaming_refuses_what_the_model_refuses(text in json_text(), cut in any::<prop::sample::Index>(), junk in "[\\]\\[{},:\"0-9a-z .eE+-]{0,3}") {
        let at = cut.index(text.len() + 1);
        let mut broken = text.as_bytes()[..at].to_vec();
        broken.extend_from_slice(junk.as_bytes());
        broken.extend_from_slice(&text.as_bytes()[at..]);
        prop_assert_eq!(canonical_json(&broken, &IgnoredFields::default()), model::canonical(&broken, &[]));
    }

    #[test]
    fn equal_numbers_normalise_equally(int in 0u64..1_000_000, zeros in 0usize..4, shift in 0i32..4) {
        let plain = int.to_string();
        let padded = format!("{plain}.{}", "0".repeat(zeros.max(1)));
        let scaled = format!("{int}e{shift}");
        prop_assert_eq!(norm(&plain), norm(&padded));
        let expected = norm(&((int as u128) * 10u128.pow(shift as u32)).to_string());
        prop_assert_eq!(norm(&scaled), expected);
    }

    #[test]
    fn any_bytes_fingerprint_without_panic(body in prop::collection::vec(any::<u8>(), 0..200)) {
        let headers = HeaderMap::new();
        let _ = fingerprint(&RequestParts { method: &Method::POST, route: "/", path: "/", query: None, headers: &headers, identity: &[], authority: None, body: &body }, &IgnoredFields::default());
    }
}

#[test]
fn ambiguity_inside_an_ignored_field_is_left_out_with_it() {
    let ignoring = |body: &str| fp(JSON, body, &["/meta", "/items/0"]);
    assert_eq!(
        ignoring(r#"{"amount":1,"meta":{"a":1,"A":2}}"#),
        ignoring(r#"{"amount":1,"meta":{"at":"now"}}"#)
    );
    assert_eq!(
        ignoring(r#"{"amount":1,"items":[{"x":1,"x":2},3]}"#),
        ignoring(r#"{"amount":1,"items":[0,3]}"#)
    );
    assert_ne!(
        ignoring(r#"{"amount":1,"Amount":2,"meta":{}}"#),
        ignoring(r#"{"Amount":2,"amount":1,"meta":{}}"#),
        "outside the ignored fields, still compared as bytes"
    );
    // Ignored members that repeat among themselves are left out together.
    let ts_ignored = |body: &str| fp(JSON, body, &["/ts"]);
    assert_eq!(
        ts_ignored(r#"{"ts":1,"ts":2,"a":1}"#),
        ts_ignored(r#"{"a":1,"ts":3,"ts":4}"#)
    );
    // An ignored member's case twin is kept: an upstream matching keys by case reads either.
    let amount_ignored = |body: &str| fp(JSON, body, &["/amount"]);
    assert_ne!(
        amount_ignored(r#"{"Amount":100,"amount":999}"#),
        amount_ignored(r#"{"Amount":100,"amount":5}"#)
    );
    assert_ne!(
        amount_ignored(r#"{"Amount":100,"amount":999}"#),
        amount_ignored(r#"{"Amount":100}"#)
    );
    assert_eq!(
        amount_ignored(r#"{"Amount":100,"amount":999}"#),
        amount_ignored(r#"{"Amount":100,"amount":999}"#)
    );
}
