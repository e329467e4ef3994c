//! The idempotency key: parsing the header, and deriving the scoped, hashed key the store uses.
//!
//! The stored key is `SHA-256(client scope, route name, key)`: one client can never replay, block
//! or detect another client's operation, neither the key nor the credential that scopes it is
//! ever stored or logged in the clear, and every stored key has the same short, bounded length.

use std::fmt;

use http::{HeaderMap, HeaderName};
use sha2::{Digest, Sha256};

mod parts;
mod scope;
pub use parts::{combine, KeyPart};
pub use scope::{canonical_value, ClientScope, Identified};

/// Longest accepted key, as Stripe and the IETF draft's examples allow.
pub const MAX_KEY_LEN: usize = 255;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("the key is empty")]
    Empty,
    #[error("the key is longer than 255 characters")]
    TooLong,
    #[error("the key must be visible ASCII characters, bare or as a quoted string (\"abc\")")]
    Malformed,
    #[error("the key header appears more than once")]
    Repeated,
    #[error("the body field {0} is not a string, number or boolean")]
    NotScalar(String),
    #[error("a key part is longer than 1024 bytes or not printable ASCII")]
    BadPart,
}

/// A key as extracted from a request or message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sent {
    /// What the store key is made from: the header's value, or the parts combined.
    pub key: String,
    /// The key as its sender knows it (for operators and the upstream's lookup): the header's
    /// value or the one field's, several parts as a JSON array.
    pub sent: String,
    /// The key the version before issue 45 made of the same parts, where it differs (a number or
    /// boolean part): records it stored are looked up under it ([`parts`]).
    pub older: Option<String>,
}

/// Where a route's key comes from: by default the `key_header`; for deliveries, any headers and
/// JSON body fields, combined in order into one key (a message id, or a business id such as
/// object id + event type).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySource {
    pub headers: Vec<HeaderName>,
    /// JSON pointers (RFC 6901) into the request body.
    pub pointers: Vec<String>,
}

/// Longest accepted header part of a composite key.
const MAX_PART_LEN: usize = 1024;

impl KeySource {
    pub fn header(name: HeaderName) -> Self {
        KeySource {
            headers: vec![name],
            pointers: Vec::new(),
        }
    }

    /// Whether the body must be read before the key is known.
    pub fn needs_body(&self) -> bool {
        !self.pointers.is_empty()
    }

    /// What a request must carry, for messages: "an Idempotency-Key header", "the body field /id".
    pub fn describe(&self) -> String {
        let mut parts: Vec<String> = self
            .headers
            .iter()
            .map(|h| format!("the {} header", display_header(h)))
            .collect();
        parts.extend(self.pointers.iter().map(|p| format!("the body field {p}")));
        parts.join(" and ")
    }

    /// The key of a request: `Ok(None)` when a part is absent. One header alone is parsed as an
    /// `Idempotency-Key` (bare or quoted, 1 to 255 visible characters); several parts are combined
    /// into one fixed-length key, so no choice of values can make two different combinations
    /// collide.
    pub fn extract(&self, headers: &HeaderMap, body: &[u8]) -> Result<Option<String>, KeyError> {
        Ok(self.extract_sent(headers, body)?.map(|k| k.key))
    }

    /// [`Self::extract`], and the key as its sender would recognise it ([`Sent`]).
    pub fn extract_sent(&self, headers: &HeaderMap, body: &[u8]) -> Result<Option<Sent>, KeyError> {
        if let ([name], true) = (self.headers.as_slice(), self.is_single_header()) {
            return Ok(parse_key(headers, name)?.map(|key| Sent {
                sent: key.clone(),
                key,
                older: None,
            }));
        }
        let mut parts: Vec<KeyPart> = Vec::with_capacity(self.headers.len() + self.pointers.len());
        for name in &self.headers {
            let mut values = headers.get_all(name).iter();
            let Some(value) = values.next() else {
                return Ok(None);
            };
            if values.next().is_some() {
                return Err(KeyError::Repeated);
            }
            let raw = trim_ows(value.as_bytes());
            if raw.is_empty() {
                return Err(KeyError::Empty);
            }
            if raw.len() > MAX_PART_LEN || !raw.iter().all(|b| (0x20..=0x7e).contains(b)) {
                return Err(KeyError::BadPart);
            }
            parts.push(KeyPart::Text(String::from_utf8_lossy(raw).into_owned()));
        }
        if !self.pointers.is_empty() {
            let Ok(json) = serde_json::from_slice::<serde_json::Value>(body) else {
                return Ok(None);
            };
            for pointer in &self.pointers {
                match KeyPart::of_json(json.pointer(pointer), pointer)? {
                    Some(part) => parts.push(part),
                    None => return Ok(None),
                }
            }
        }
        let (key, sent) = parts::key_and_sent(&parts);
        Ok(Some(Sent {
            key,
            sent,
            older: parts::combine_untyped(&parts),
        }))
    }

    /// Whether the key is one header's value as sent (else parts combined by [`Self::combine`]).
    pub fn is_single_header(&self) -> bool {
        self.headers.len() == 1 && self.pointers.is_empty()
    }
}

/// `idempotency-key` -> `Idempotency-Key`, for messages.
pub fn display_header(name: &HeaderName) -> String {
    name.as_str()
        .split('-')
        .map(|w| {
            let mut c = w.chars();
            c.next()
                .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
                .unwrap_or_default()
        })
        .collect::<Vec<_>>()
        .join("-")
}

/// Reads the key from `headers`: `Ok(None)` when the header is absent.
///
/// Accepts the bare form (`abc`) and the RFC 8941 sf-string form (`"abc"`, with `\"` and `\\`
/// escapes), which the IETF draft requires. Parameters after the string are refused rather than
/// ignored, so two different header values can never name the same key by accident.
pub fn parse_key(headers: &HeaderMap, name: &HeaderName) -> Result<Option<String>, KeyError> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyError::Repeated);
    }
    parse_key_value(value.as_bytes()).map(Some)
}

/// Parses one header value into a key.
pub fn parse_key_value(raw: &[u8]) -> Result<String, KeyError> {
    let raw = trim_ows(raw);
    let key = match raw.first() {
        Some(b'"') => unquote(&raw[1..])?,
        _ => raw.to_vec(),
    };
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong);
    }
    if !key.iter().all(|b| (0x21..=0x7e).contains(b)) {
        return Err(KeyError::Malformed);
    }
    // Every byte is ASCII, so this cannot fail; the error arm keeps it panic-free anyway.
    String::from_utf8(key).map_err(|_| KeyError::Malformed)
}

fn trim_ows(mut raw: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = raw {
        raw = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = raw {
        raw = rest;
    }
    raw
}

/// The body of an sf-string after its opening quote; the closing quote must end the value.
fn unquote(body: &[u8]) -> Result<Vec<u8>, KeyError> {
    let mut out = Vec::with_capacity(body.len());
    let mut iter = body.iter();
    while let Some(&b) = iter.next() {
        match b {
            b'\\' => match iter.next() {
                Some(&e @ (b'"' | b'\\')) => out.push(e),
                _ => return Err(KeyError::Malformed),
            },
            b'"' => {
                return if iter.next().is_none() {
                    Ok(out)
                } else {
                    Err(KeyError::Malformed)
                };
            }
            0x20..=0x7e => out.push(b),
            _ => return Err(KeyError::Malformed),
        }
        if out.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong);
        }
    }
    Err(KeyError::Malformed)
}

/// The key under which one operation is stored: SHA-256 of (scope, route, key). Kept as the
/// 32 bytes (no allocation, cheap to copy and hash); hex only where text is needed (Redis keys,
/// pub/sub messages, logs).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct StoreKey([u8; 32]);

impl std::hash::Hash for StoreKey {
    // Already a uniformly distributed hash: 8 of its bytes are as good as all 32 to the map,
    // and a quarter of the work for its hasher.
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        let mut word = [0u8; 8];
        word.copy_from_slice(&self.0[..8]);
        state.write_u64(u64::from_le_bytes(word));
    }
}

impl StoreKey {
    pub fn new(scope: &ClientScope, route: &str, key: &str) -> Self {
        let mut h = Sha256::new();
        h.update(b"idemgate/key/v1\x00");
        h.update(scope.as_bytes());
        // Length prefixes keep ("ab", "c") and ("a", "bc") apart.
        h.update((route.len() as u64).to_be_bytes());
        h.update(route.as_bytes());
        h.update((key.len() as u64).to_be_bytes());
        h.update(key.as_bytes());
        StoreKey(h.finalize().into())
    }

    /// The 64 lowercase hex digits, as Redis keys and pub/sub messages carry it.
    /// The 32 bytes, as embedded stores key their records.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    pub fn hex(&self) -> String {
        String::from_utf8_lossy(&self.hex_digits()).into_owned()
    }

    /// [`StoreKey::hex`] without an allocation, for the Redis hot path (every request builds
    /// two or three keys from it; the `hex` crate's char iterator cost more than the rest of
    /// the key's formatting together).
    pub fn hex_digits(&self) -> [u8; 64] {
        let mut out = [0u8; 64];
        // Fails only when the output is not twice the input, which these sizes rule out.
        let _ = hex::encode_to_slice(self.0, &mut out);
        out
    }

    /// A key as a store keeps it ([`StoreKey::as_bytes`]).
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        StoreKey(bytes)
    }

    /// A key as [`StoreKey::hex`] printed it, e.g. from a pub/sub message.
    pub fn from_hex(s: &str) -> Option<Self> {
        if s.len() != 64 || !s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return None;
        }
        let mut bytes = [0u8; 32];
        hex::decode_to_slice(s, &mut bytes).ok()?;
        Some(StoreKey(bytes))
    }

    /// Which of `n` shards the key belongs to.
    pub fn shard(&self, n: usize) -> usize {
        usize::from(u16::from_be_bytes([self.0[0], self.0[1]])) % n.max(1)
    }

    /// A short prefix that identifies the key in logs without revealing it.
    pub fn short(&self) -> String {
        hex::encode(&self.0[..8])
    }
}

impl fmt::Debug for StoreKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StoreKey({})", self.short())
    }
}

impl fmt::Display for StoreKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&String::from_utf8_lossy(&self.hex_digits()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(raw: &str) -> Result<String, KeyError> {
        parse_key_value(raw.as_bytes())
    }

    #[test]
    fn bare_and_quoted_forms_name_the_same_key() {
        assert_eq!(key("abc"), Ok("abc".into()));
        assert_eq!(key("\"abc\""), Ok("abc".into()));
        assert_eq!(key("  abc "), Ok("abc".into()));
        assert_eq!(key(r#""a\"b\\c""#), Ok(r#"a"b\c"#.into()));
        assert_eq!(
            key("8e03978e-40d5-43e8-bc93-6894a57f9324"),
            Ok("8e03978e-40d5-43e8-bc93-6894a57f9324".into())
        );
    }

    #[test]
    fn bad_keys_are_refused() {
        assert_eq!(key(""), Err(KeyError::Empty));
        assert_eq!(key("\"\""), Err(KeyError::Empty));
        assert_eq!(key(&"a".repeat(256)), Err(KeyError::TooLong));
        assert_eq!(key(&"a".repeat(255)), Ok("a".repeat(255)));
        assert_eq!(
            key(&format!("\"{}\"", "a".repeat(300))),
            Err(KeyError::TooLong)
        );
        assert_eq!(key("a b"), Err(KeyError::Malformed));
        assert_eq!(key("\"a b\""), Err(KeyError::Malformed));
        assert_eq!(key("\"abc"), Err(KeyError::Malformed));
        assert_eq!(key("\"abc\";p=1"), Err(KeyError::Malformed));
        assert_eq!(key("\"a\\nb\""), Err(KeyError::Malformed));
        assert_eq!(key("caf\u{e9}"), Err(KeyError::Malformed));
    }

    #[test]
    fn repeated_header_is_refused() {
        let name = HeaderName::from_static("idempotency-key");
        let mut h = HeaderMap::new();
        assert_eq!(parse_key(&h, &name), Ok(None));
        h.append(&name, "a".parse().unwrap());
        assert_eq!(parse_key(&h, &name), Ok(Some("a".into())));
        h.append(&name, "b".parse().unwrap());
        assert_eq!(parse_key(&h, &name), Err(KeyError::Repeated));
    }

    #[test]
    fn store_keys_separate_scopes_routes_and_keys() {
        let a = ClientScope::from_value(b"Bearer a");
        let b = ClientScope::from_value(b"Bearer b");
        let base = StoreKey::new(&a, "/payments", "k1");
        assert_eq!(base, StoreKey::new(&a, "/payments", "k1"));
        assert_ne!(base, StoreKey::new(&b, "/payments", "k1"));
        assert_ne!(base, StoreKey::new(&a, "/refunds", "k1"));
        assert_ne!(base, StoreKey::new(&a, "/payments", "k2"));
        assert_ne!(
            StoreKey::new(&a, "ab", "c"),
            StoreKey::new(&a, "a", "bc"),
            "route/key boundary must be unambiguous"
        );
        assert_eq!(base.hex().len(), 64);
        assert!(!base.hex().contains("k1"));
        assert_eq!(StoreKey::from_hex(&base.hex()), Some(base));
        assert_eq!(StoreKey::from_hex("zz"), None);
        assert_eq!(base.hex(), hex::encode(base.0));
        assert_eq!(base.to_string(), base.hex());
    }

    fn hm(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    #[test]
    fn composite_keys_from_headers_and_body_fields() {
        let ce = KeySource {
            headers: vec![
                HeaderName::from_static("ce-id"),
                HeaderName::from_static("ce-source"),
            ],
            pointers: vec![],
        };
        let a = ce
            .extract(&hm(&[("ce-id", "1"), ("ce-source", "/orders")]), b"")
            .unwrap()
            .unwrap();
        let b = ce
            .extract(&hm(&[("ce-id", "1"), ("ce-source", "/payments")]), b"")
            .unwrap()
            .unwrap();
        assert_ne!(a, b, "same id from another source is another message");
        assert_eq!(ce.extract(&hm(&[("ce-id", "1")]), b"").unwrap(), None);
        assert_eq!(a.len(), 64);

        let business = KeySource {
            headers: vec![],
            pointers: vec!["/data/object/id".into(), "/type".into()],
        };
        let k1 = business
            .extract(
                &HeaderMap::new(),
                br#"{"id":"evt_1","type":"charge.succeeded","data":{"object":{"id":"ch_9"}}}"#,
            )
            .unwrap();
        let k2 = business
            .extract(
                &HeaderMap::new(),
                br#"{"id":"evt_2","type":"charge.succeeded","data":{"object":{"id":"ch_9"}}}"#,
            )
            .unwrap();
        assert!(k1.is_some());
        assert_eq!(
            k1, k2,
            "two events about one operation share the business key"
        );
        assert_eq!(
            business
                .extract(&HeaderMap::new(), br#"{"type":"x"}"#)
                .unwrap(),
            None
        );
        assert_eq!(
            business.extract(&HeaderMap::new(), b"not json").unwrap(),
            None
        );
        assert_eq!(
            business.extract(
                &HeaderMap::new(),
                br#"{"type":"x","data":{"object":{"id":{"nested":1}}}}"#
            ),
            Err(KeyError::NotScalar("/data/object/id".into()))
        );
        // ("a", "b,c") and ("a,b", "c") stay apart.
        let two = KeySource {
            headers: vec![],
            pointers: vec!["/x".into(), "/y".into()],
        };
        // As the sender knows it: the one field's value, or the parts as a JSON array.
        let sent = |source: &KeySource, body: &[u8]| {
            source
                .extract_sent(&HeaderMap::new(), body)
                .unwrap()
                .unwrap()
                .sent
        };
        let first = KeySource {
            headers: vec![],
            pointers: vec!["/x".into()],
        };
        assert_eq!(sent(&first, br#"{"x":"ord_1"}"#), "ord_1");
        assert_eq!(sent(&two, br#"{"x":"a","y":"b,c"}"#), r#"["a","b,c"]"#);
        assert_ne!(
            two.extract(&HeaderMap::new(), br#"{"x":"a","y":"b,c"}"#)
                .unwrap(),
            two.extract(&HeaderMap::new(), br#"{"x":"a,b","y":"c"}"#)
                .unwrap()
        );
        // Numbers by value, and apart from strings and booleans.
        let one = KeySource {
            headers: vec![],
            pointers: vec!["/n".into()],
        };
        let of = |body: &[u8]| one.extract(&HeaderMap::new(), body).unwrap().unwrap();
        assert_eq!(of(br#"{"n":10}"#), of(br#"{"n":1e1}"#));
        assert_ne!(of(br#"{"n":10}"#), of(br#"{"n":"1e1"}"#));
        assert_ne!(of(br#"{"n":true}"#), of(br#"{"n":"true"}"#));
        let older = |body: &[u8]| {
            let sent = one.extract_sent(&HeaderMap::new(), body).unwrap().unwrap();
            sent.older
        };
        assert_eq!(older(br#"{"n":10}"#), Some(of(br#"{"n":"1e1"}"#)));
        assert_eq!(older(br#"{"n":"1e1"}"#), None);
    }

    #[test]
    fn a_single_header_source_parses_like_idempotency_key() {
        let src = KeySource::header(HeaderName::from_static("webhook-id"));
        assert_eq!(
            src.extract(&hm(&[("webhook-id", "\"msg_1\"")]), b"")
                .unwrap(),
            Some("msg_1".into())
        );
        assert_eq!(src.describe(), "the Webhook-Id header");
    }

    proptest! {
        #[test]
        fn any_visible_key_round_trips_through_the_quoted_form(k in "[!-~]{1,255}") {
            let quoted = format!("\"{}\"", k.replace('\\', "\\\\").replace('"', "\\\""));
            prop_assert_eq!(key(&quoted), Ok(k.clone()));
            if !k.starts_with('"') {
                prop_assert_eq!(key(&k), Ok(k));
            }
        }

        #[test]
        fn parsing_never_panics(raw in prop::collection::vec(any::<u8>(), 0..300)) {
            if let Ok(k) = parse_key_value(&raw) {
                prop_assert!(!k.is_empty() && k.len() <= MAX_KEY_LEN);
            }
        }
    }
}
