//! The request fingerprint: what "the same logical request" means when a key is reused.
//!
//! SHA-256 over method, route, path, query, the media type of `Content-Type`, the route's
//! `fingerprint_headers` and the body. A JSON body (`application/json` or `*/*+json`) is
//! canonicalised first ([`canonical`]): object keys sorted at every depth, insignificant
//! whitespace dropped, escapes normalised, numbers written in one exact form (`1`, `1.0` and
//! `1e0` are the same number; no float rounding, so large amounts never collide) and the
//! route's `fingerprint_ignore` pointers removed. Any other body, JSON that does not parse, and
//! ambiguous JSON (repeated keys, keys equal but for case) are hashed as bytes.
//!
//! The form before issue 44 ([`earlier_fingerprint`]) is still computed, on demand, to find
//! the records that version stored.

mod canonical;
#[cfg(test)]
mod tests;

use http::{HeaderMap, Method};
use sha2::{Digest, Sha256};

use canonical::{canonical, Canonical};
pub use canonical::{canonical_json, canonical_number};

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
    /// Headers whose values are part of the request (`fingerprint_headers`), in order.
    pub identity: &'a [http::HeaderName],
    /// The request's authority (HTTP/2's `:authority`), standing for a `Host` header it lacks:
    /// the `Host` the upstream gets.
    pub authority: Option<&'a str>,
    pub body: &'a [u8],
}

/// A route's `fingerprint_ignore` pointers (RFC 6901), split into their unescaped reference
/// tokens once, when the config is loaded. A pointer that does not start with `/` names no member
/// and ignores nothing, as `Value::pointer` would find nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IgnoredFields(Vec<Vec<String>>);

impl IgnoredFields {
    pub fn new(pointers: &[String]) -> Self {
        IgnoredFields(
            pointers
                .iter()
                .filter_map(|p| p.strip_prefix('/'))
                .map(|rest| {
                    rest.split('/')
                        .map(|t| t.replace("~1", "/").replace("~0", "~"))
                        .collect()
                })
                .collect(),
        )
    }
}

/// Computes the fingerprint of a request whose body was read in full (form 2).
///
/// Every fingerprint of this form differs from every one of the form before issue 44 (its
/// first bytes do), so a record the previous version stored can be told by its fingerprint
/// alone: [`earlier_fingerprint`] is compared with those, and can never match a record this
/// version stored.
pub fn fingerprint(parts: &RequestParts<'_>, ignore: &IgnoredFields) -> Fingerprint {
    let canonical = if is_json(parts.headers) {
        canonical(parts.body, ignore, true)
    } else {
        Canonical::NotJson
    };
    let body = match &canonical {
        Canonical::Json(c) => Body::Json(c),
        Canonical::NotJson | Canonical::Ambiguous => Body::Bytes(parts.body),
    };
    let mut h = Sha256::new();
    h.update(b"idemgate/fingerprint/v2\x00");
    target(&mut h, parts);
    media(&mut h, parts.headers, matches!(body, Body::Json(_)));
    identity(&mut h, parts);
    body.hash(&mut h);
    Fingerprint(h.finalize().into())
}

/// The fingerprint the version before issue 44 gave the same request (form 1: no media type, no
/// headers, JSON canonicalised whatever its keys), to find the records that version stored for
/// one `ttl` after the upgrade. `None` on a route with `fingerprint_headers`: the old form knows
/// nothing of them, and would hand one tenant's stored answer to another.
pub fn earlier_fingerprint(
    parts: &RequestParts<'_>,
    ignore: &IgnoredFields,
) -> Option<Fingerprint> {
    if !parts.identity.is_empty() {
        return None;
    }
    let canonical = is_json(parts.headers)
        .then(|| canonical_json(parts.body, ignore))
        .flatten();
    let body = match &canonical {
        Some(c) => Body::Json(c),
        None => Body::Bytes(parts.body),
    };
    let mut h = Sha256::new();
    h.update(b"idemgate/fingerprint/v1\x00");
    target(&mut h, parts);
    body.hash(&mut h);
    Some(Fingerprint(h.finalize().into()))
}

/// Method, route, path and query, each length-prefixed.
fn target(h: &mut Sha256, parts: &RequestParts<'_>) {
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
}

/// What of `Content-Type` changes how an upstream reads the body, for every such header in
/// order (none is a part too): the media type's essence (lower case) and, for a body not
/// compared as canonical JSON, its `charset`; not the other parameters (a multipart `boundary`
/// is new in every request).
fn media(h: &mut Sha256, headers: &HeaderMap, canonical_json: bool) {
    let values = headers.get_all(http::header::CONTENT_TYPE);
    h.update(b"\x00content-type\x00");
    h.update((values.iter().count() as u64).to_be_bytes());
    for value in values {
        let value = value.as_bytes();
        let essence = value.split(|&b| b == b';').next().unwrap_or_default();
        let essence = essence.trim_ascii();
        h.update((essence.len() as u64).to_be_bytes());
        if essence.iter().any(u8::is_ascii_uppercase) {
            h.update(essence.to_ascii_lowercase());
        } else {
            h.update(essence);
        }
        // Every one, in order: readers differ on which of two they take.
        let charsets = if canonical_json {
            Vec::new()
        } else {
            charsets(value)
        };
        h.update((charsets.len() as u64).to_be_bytes());
        for charset in charsets {
            h.update((charset.len() as u64).to_be_bytes());
            h.update(charset);
        }
    }
}

/// The `charset` parameters of a media type, lower case, a well-formed quoted value unquoted
/// (any other kept as written); parameters are split at `;` outside quoted strings (RFC 9110,
/// 5.6.6), so a quoted `;` cannot hide or forge one.
fn charsets(value: &[u8]) -> Vec<Vec<u8>> {
    let mut params = Vec::new();
    // A quoted string only where a value starts (after `=`, spaces aside): a `"` inside a token
    // is a character of it, as readers that split at every `;` take it.
    let (mut quoted, mut escaped, mut value_starts, mut from) = (false, false, false, 0);
    for (i, &b) in value.iter().enumerate() {
        match b {
            _ if escaped => escaped = false,
            b'\\' if quoted => escaped = true,
            b'"' if quoted => quoted = false,
            b'"' if value_starts => quoted = true,
            b';' if !quoted => {
                params.push(&value[from..i]);
                from = i + 1;
            }
            _ => {}
        }
        value_starts = !quoted && (b == b'=' || (value_starts && (b == b' ' || b == b'\t')));
    }
    params.push(&value[from..]);
    let charset = |param: &[u8]| {
        let param = param.trim_ascii();
        let (name, value) = param.split_at(param.iter().position(|&b| b == b'=')?);
        if !name.trim_ascii().eq_ignore_ascii_case(b"charset") {
            return None;
        }
        let value = value.get(1..).unwrap_or_default().trim_ascii();
        let value = unquoted(value).unwrap_or_else(|| value.to_vec());
        Some(value.to_ascii_lowercase())
    };
    params.into_iter().skip(1).filter_map(charset).collect()
}

/// The text of a quoted string (RFC 9110, 5.6.4: each `\\x` is `x`), or `None` when `value` is
/// not exactly one.
fn unquoted(value: &[u8]) -> Option<Vec<u8>> {
    let inner = value.strip_prefix(b"\"")?;
    let mut out = Vec::with_capacity(inner.len());
    let mut escaped = false;
    for (i, &b) in inner.iter().enumerate() {
        match b {
            _ if escaped => {
                out.push(b);
                escaped = false;
            }
            b'\\' => escaped = true,
            b'"' => return (i + 1 == inner.len()).then_some(out),
            _ => out.push(b),
        }
    }
    None
}

/// The values of `fingerprint_headers`, in the order named; `Host` is HTTP/2's `:authority` when
/// the request has no `Host` header (what the upstream gets as `Host`).
fn identity(h: &mut Sha256, parts: &RequestParts<'_>) {
    h.update(b"\x00headers\x00");
    h.update((parts.identity.len() as u64).to_be_bytes());
    for name in parts.identity {
        h.update((name.as_str().len() as u64).to_be_bytes());
        h.update(name.as_str().as_bytes());
        let values = parts.headers.get_all(name);
        let authority = (name == http::header::HOST && values.iter().next().is_none())
            .then_some(parts.authority)
            .flatten();
        let count = values.iter().count() + usize::from(authority.is_some());
        h.update((count as u64).to_be_bytes());
        for v in values
            .iter()
            .map(|v| v.as_bytes())
            .chain(authority.map(str::as_bytes))
        {
            h.update((v.len() as u64).to_be_bytes());
            h.update(v);
        }
    }
}

/// What the body part of a fingerprint is made of.
enum Body<'a> {
    Json(&'a [u8]),
    Bytes(&'a [u8]),
}

impl Body<'_> {
    fn hash(&self, h: &mut Sha256) {
        match self {
            Body::Json(canonical) => {
                h.update(b"json\x00");
                h.update(canonical);
            }
            Body::Bytes(bytes) => {
                h.update(b"bytes\x00");
                h.update(bytes);
            }
        }
    }
}

fn is_json(headers: &HeaderMap) -> bool {
    let Some(ct) = headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let essence = ct.split(';').next().unwrap_or("").trim();
    essence.eq_ignore_ascii_case("application/json")
        || (essence.contains('/')
            && essence.len() >= 5
            && essence.as_bytes()[essence.len() - 5..].eq_ignore_ascii_case(b"+json"))
}
