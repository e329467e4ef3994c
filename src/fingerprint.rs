//! The request fingerprint: what "the same logical request" means when a key is reused.
//!
//! SHA-256 over method, route, path, query, the media type (unless plain `application/json`)
//! and body. A JSON body (`application/json` or `*/*+json`) is canonicalised first: object keys
//! sorted at every depth, insignificant whitespace dropped, escapes normalised, numbers written in one exact form (`1`, `1.0` and `1e0` are the
//! same number; no float rounding, so large amounts never collide) and the route's
//! `fingerprint_ignore` pointers removed. Any other body, JSON that does not parse, and
//! ambiguous JSON (repeated keys, keys equal but for case) are hashed as bytes.

use std::borrow::Cow;
use std::cell::Cell;

use http::{HeaderMap, Method};
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
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

/// Computes the fingerprint of a request whose body was read in full.
///
/// Plain JSON and bodies without a `Content-Type` keep the fingerprint versions before issue 44
/// gave them. Ambiguous JSON (hashed as bytes now), other media types and `fingerprint_headers`
/// change it: a key stored before the upgrade for such a request gets `409` on a retry after
/// it, for at most one `ttl` (the safe direction: nothing tells a record of the previous
/// version from one of this version, so an older form accepted too could replay one request's
/// answer for another).
pub fn fingerprint(parts: &RequestParts<'_>, ignore: &IgnoredFields) -> Fingerprint {
    let json = is_json(parts.headers);
    let media = media_part(parts.headers, json);
    let canonical = if json {
        canonical(parts.body, ignore, true)
    } else {
        Canonical::NotJson
    };
    let body = match &canonical {
        Canonical::Json(c) => Body::Json(c),
        Canonical::NotJson | Canonical::Ambiguous => Body::Bytes(parts.body),
    };
    hashed(parts, body, media.as_deref())
}

/// What of `Content-Type` changes how an upstream reads the body, for every such header in
/// order: the media type's essence (lower case) and, for a body that is not JSON, its
/// `charset`; not the other parameters (a multipart `boundary` is new in every request). `None`
/// when there is no `Content-Type` or it is plain `application/json`: those fingerprints stay
/// as the previous version made them.
fn media_part(headers: &HeaderMap, json: bool) -> Option<Vec<u8>> {
    let values = headers.get_all(http::header::CONTENT_TYPE);
    let count = values.iter().count();
    let first = values.iter().next()?;
    let plain_json = |v: &http::HeaderValue| {
        let essence = v
            .as_bytes()
            .split(|&b| b == b';')
            .next()
            .unwrap_or_default();
        essence
            .trim_ascii()
            .eq_ignore_ascii_case(b"application/json")
    };
    if count == 1 && plain_json(first) {
        return None;
    }
    let mut out = (count as u64).to_be_bytes().to_vec();
    for value in values {
        let mut params = value.as_bytes().split(|&b| b == b';');
        let essence = params.next().unwrap_or_default().trim_ascii();
        out.extend_from_slice(&(essence.len() as u64).to_be_bytes());
        out.extend(essence.iter().map(u8::to_ascii_lowercase));
        let charset = params
            .filter(|_| !json)
            .filter_map(|p| {
                let (name, value) = p
                    .trim_ascii()
                    .split_at(p.trim_ascii().iter().position(|&b| b == b'=')?);
                name.eq_ignore_ascii_case(b"charset")
                    .then_some(value[1..].trim_ascii())
            })
            .next()
            .unwrap_or_default();
        out.extend_from_slice(&(charset.len() as u64).to_be_bytes());
        out.extend(charset.iter().map(u8::to_ascii_lowercase));
    }
    Some(out)
}

/// What the body part of a fingerprint is made of.
enum Body<'a> {
    Json(&'a [u8]),
    Bytes(&'a [u8]),
}

fn hashed(parts: &RequestParts<'_>, body: Body<'_>, media: Option<&[u8]>) -> Fingerprint {
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
    // Only when there is one: every fingerprint without it stays as the previous version made
    // it. Its tag starts with a byte no body tag does, and its parts are counted and
    // length-prefixed, so it cannot be mistaken for the start of a body.
    if let Some(media) = media {
        h.update(b"\x00content-type\x00");
        h.update(media);
    }
    if !parts.identity.is_empty() {
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
    match body {
        Body::Json(canonical) => {
            h.update(b"json\x00");
            h.update(canonical);
        }
        Body::Bytes(bytes) => {
            h.update(b"bytes\x00");
            h.update(bytes);
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
    let essence = ct.split(';').next().unwrap_or("").trim();
    essence.eq_ignore_ascii_case("application/json")
        || (essence.contains('/')
            && essence.len() >= 5
            && essence.as_bytes()[essence.len() - 5..].eq_ignore_ascii_case(b"+json"))
}

/// The canonical form of a JSON body, with the `ignore` pointers (RFC 6901) left out, or `None`
/// when the body is not JSON.
///
/// Written straight from the parser into one buffer, without building a `serde_json::Value`: a
/// value tree allocates for nearly every key and value in it, more than the rest of the fingerprint
/// costs (bench/README.md, "bench/callgrind"). The output is byte for byte what writing the parsed
/// value would give (a property test holds it to that model): object keys sorted, the last of
/// repeated keys kept, an ignored object member left out and an ignored array element written as
/// `null`, so that ignoring `/items/0` does not make `/items/1` look like it. Nesting depth is
/// bounded by the parser (128); an object whose members arrive unsorted is rewritten once, so the
/// work is at most that depth times the body's size.
///
/// The form before issue 44, which [`fingerprint`] still gives every unambiguous body: it
/// uses the strict one, which refuses ambiguous bodies.
pub fn canonical_json(body: &[u8], ignore: &IgnoredFields) -> Option<Vec<u8>> {
    match canonical(body, ignore, false) {
        Canonical::Json(out) => Some(out),
        Canonical::NotJson | Canonical::Ambiguous => None,
    }
}

/// A body's canonical JSON form, or why it has none.
#[derive(Debug)]
enum Canonical {
    Json(Vec<u8>),
    /// Not JSON, or not JSON `serde_json` reads.
    NotJson,
    /// (`strict` only) JSON that upstreams read differently: an object with a repeated key or
    /// keys equal but for case (Go's `encoding/json`, ASP.NET Core and case-insensitive Jackson
    /// match keys so; some keep the first of repeated keys, some the last, some refuse), or an
    /// object a client wrote with serde_json's private number key.
    Ambiguous,
}

impl Canonical {
    #[cfg(test)]
    fn is_ambiguous(&self) -> bool {
        matches!(self, Canonical::Ambiguous)
    }
}

fn canonical(body: &[u8], ignore: &IgnoredFields, strict: bool) -> Canonical {
    let all: Vec<usize> = (0..ignore.0.len()).collect();
    let mut out = Vec::with_capacity(body.len() + 8);
    let mut de = serde_json::Deserializer::from_slice(body);
    let ambiguous = Cell::new(false);
    let seed = Canon {
        out: &mut out,
        pointers: &ignore.0,
        active: &all,
        depth: 0,
        strict: strict.then_some((&ambiguous, body)),
    };
    if seed.deserialize(&mut de).is_err() || de.end().is_err() {
        return Canonical::NotJson;
    }
    if ambiguous.get() {
        return Canonical::Ambiguous;
    }
    Canonical::Json(out)
}

/// Which ignore pointers a member or element at `depth` matches: those still active whose token
/// names it. In an array, a pointer's last token is read as any `usize` (`01` is 1), the tokens
/// before it as a strict index (no leading zero or sign): how the pointers were applied to a
/// `Value` before, and fingerprints must not change between versions. With nothing active (no
/// pointers, or none reaching this deep) it allocates nothing.
fn narrow(
    pointers: &[Vec<String>],
    active: &[usize],
    depth: usize,
    matches: impl Fn(&str, bool) -> bool,
) -> (Vec<usize>, bool) {
    let mut deeper = Vec::new();
    let mut ignored = false;
    for &i in active {
        let tokens = &pointers[i];
        let last = tokens.len() == depth + 1;
        if tokens.get(depth).is_some_and(|t| matches(t, last)) {
            if last {
                ignored = true;
            } else {
                deeper.push(i);
            }
        }
    }
    (deeper, ignored)
}

fn strict_index(token: &str) -> Option<usize> {
    if token.starts_with('+') || (token.starts_with('0') && token.len() != 1) {
        return None;
    }
    token.parse().ok()
}

/// Writes the canonical form of one JSON value into `out`, as the parser reads it.
struct Canon<'a> {
    out: &'a mut Vec<u8>,
    pointers: &'a [Vec<String>],
    /// Pointers whose tokens so far name this value's path.
    active: &'a [usize],
    depth: usize,
    /// When strict: where to say the body is ambiguous, and the body (a key borrowed from it
    /// was written by the client).
    strict: Option<(&'a Cell<bool>, &'a [u8])>,
}

impl Canon<'_> {
    /// The writer of a member or element, with the pointers that may still name its insides.
    fn child<'b>(&'b mut self, active: &'b [usize]) -> Canon<'b> {
        Canon {
            out: &mut *self.out,
            pointers: self.pointers,
            active,
            depth: self.depth + 1,
            strict: self.strict,
        }
    }

    /// Whether `first`, an object's first key equal to serde_json's number marker, is that
    /// marker (a number too large for an integer) rather than a key the client wrote: the
    /// parser hands its own marker from static memory, never from the body, and never with an
    /// escape in it. Not strict: any such key, as the previous version read it.
    // The Cow itself is asked: an owned key had an escape in it, so the client wrote it.
    #[allow(clippy::ptr_arg)]
    fn is_number(&self, first: &Cow<'_, str>) -> bool {
        let Some((ambiguous, body)) = self.strict else {
            return true;
        };
        let genuine = match first {
            Cow::Borrowed(k) => !body.as_ptr_range().contains(&k.as_ptr()),
            Cow::Owned(_) => false,
        };
        if !genuine {
            ambiguous.set(true);
        }
        genuine
    }

    /// Strict: marks the body ambiguous if two of an object's keys are equal, or equal but for
    /// case.
    fn check_keys(&self, members: &[(Cow<'_, str>, usize, usize)]) {
        let Some((ambiguous, _)) = self.strict else {
            return;
        };
        if members.len() < 2 || ambiguous.get() {
            return;
        }
        // ASCII keys (the common case), without allocating a string: in strictly increasing
        // order case-insensitively, none repeats; else sorted by reference and compared.
        if members.iter().all(|m| m.0.is_ascii()) {
            let folded_cmp = |a: &str, b: &str| {
                (a.bytes().map(|c| c.to_ascii_lowercase()))
                    .cmp(b.bytes().map(|c| c.to_ascii_lowercase()))
            };
            if members
                .windows(2)
                .all(|w| folded_cmp(&w[0].0, &w[1].0).is_lt())
            {
                return;
            }
            let mut keys: Vec<&str> = members.iter().map(|m| m.0.as_ref()).collect();
            keys.sort_unstable_by(|a, b| folded_cmp(a, b));
            if keys.windows(2).any(|w| w[0].eq_ignore_ascii_case(w[1])) {
                ambiguous.set(true);
            }
            return;
        }
        let mut keys: Vec<Cow<'_, str>> = members.iter().map(|(k, _, _)| folded(k)).collect();
        keys.sort_unstable();
        if keys.windows(2).any(|w| w[0] == w[1]) {
            ambiguous.set(true);
        }
    }
}

/// A key as case-insensitive readers match it: ASCII lower case, and for other text each
/// character lowered, raised and lowered again (so `ſ` meets `s`, the Kelvin sign `k`, and `ẞ`
/// and `ß` meet `ss`, as Go's `strings.EqualFold` and Java's case-insensitive readers have it).
fn folded<'k>(key: &'k str) -> Cow<'k, str> {
    if key.is_ascii() {
        if key.bytes().any(|b| b.is_ascii_uppercase()) {
            Cow::Owned(key.to_ascii_lowercase())
        } else {
            Cow::Borrowed(key)
        }
    } else {
        Cow::Owned(
            key.chars()
                .flat_map(char::to_lowercase)
                .flat_map(char::to_uppercase)
                .flat_map(char::to_lowercase)
                .collect(),
        )
    }
}

impl<'de> DeserializeSeed<'de> for Canon<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Canon<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.out.extend_from_slice(b"null");
        Ok(())
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<(), E> {
        self.out
            .extend_from_slice(if v { b"true" } else { b"false" });
        Ok(())
    }

    // Integers that fit come as integers even with `arbitrary_precision`; others as text below.
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        write_number(itoa::Buffer::new().format(v), self.out);
        Ok(())
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        write_number(itoa::Buffer::new().format(v), self.out);
        Ok(())
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        match serde_json::Number::from_f64(v) {
            Some(n) => write_number(n.as_str(), self.out),
            None => self.out.extend_from_slice(b"null"),
        }
        Ok(())
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        write_string(v, self.out);
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<(), A::Error> {
        self.out.push(b'[');
        let mut index = 0usize;
        loop {
            let (deeper, ignored) = narrow(self.pointers, self.active, self.depth, |t, last| {
                let i = if last {
                    t.parse().ok()
                } else {
                    strict_index(t)
                };
                i == Some(index)
            });
            let before = self.out.len();
            if index > 0 {
                self.out.push(b',');
            }
            let at = self.out.len();
            if seq.next_element_seed(self.child(&deeper))?.is_none() {
                self.out.truncate(before);
                break;
            }
            if ignored {
                // Still parsed in full above: what `Value` refuses must stay refused.
                self.out.truncate(at);
                self.out.extend_from_slice(b"null");
            }
            index += 1;
        }
        self.out.push(b']');
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(mut self, mut map: A) -> Result<(), A::Error> {
        let Some(first) = map.next_key_seed(KeySeed)? else {
            self.out.extend_from_slice(b"{}");
            return Ok(());
        };
        // A number that does not fit an integer, as `serde_json` hands it over with
        // `arbitrary_precision`: a map of one private key to the number's text. `Value` reads
        // it the same way (an object whose first key is this one is taken for a number too).
        if first == NUMBER_TOKEN && self.is_number(&first) {
            let raw = map.next_value_seed(KeySeed)?;
            let n: serde_json::Number = raw.parse().map_err(de::Error::custom)?;
            write_number(n.as_str(), self.out);
            return Ok(());
        }
        let start = self.out.len();
        self.out.push(b'{');
        // Each member as written: its key and where its `"key":value` text lies in `out`.
        let mut members: Vec<(Cow<'de, str>, usize, usize)> = Vec::new();
        let mut key = Some(first);
        while let Some(k) = key
            .take()
            .map(Ok)
            .or_else(|| map.next_key_seed(KeySeed).transpose())
        {
            let k = k?;
            let (deeper, ignored) = narrow(self.pointers, self.active, self.depth, |t, _| t == k);
            let before = self.out.len();
            if !members.is_empty() {
                self.out.push(b',');
            }
            let at = self.out.len();
            write_string(&k, self.out);
            self.out.push(b':');
            map.next_value_seed(self.child(&deeper))?;
            if ignored {
                // Parsed in full all the same, so that what `Value` refuses stays refused.
                self.out.truncate(before);
                continue;
            }
            members.push((k, at, self.out.len()));
        }
        self.out.push(b'}');
        self.check_keys(&members);
        if members.windows(2).all(|w| w[0].0 < w[1].0) {
            return Ok(());
        }
        // Out of order or repeated: rewrite the object sorted, each key's last value kept.
        let written = self.out.split_off(start);
        members.sort_by(|a, b| a.0.cmp(&b.0)); // stable: repeats stay in arrival order
        self.out.push(b'{');
        let mut first = true;
        for (i, (k, from, to)) in members.iter().enumerate() {
            if members.get(i + 1).is_some_and(|next| next.0 == *k) {
                continue;
            }
            if !first {
                self.out.push(b',');
            }
            first = false;
            self.out
                .extend_from_slice(&written[from - start..to - start]);
        }
        self.out.push(b'}');
        Ok(())
    }
}

/// The private key `serde_json` names an arbitrary-precision number with.
const NUMBER_TOKEN: &str = "$serde_json::private::Number";

/// Reads an object key (or a number's text), borrowed from the body when it has no escapes.
struct KeySeed;

impl<'de> DeserializeSeed<'de> for KeySeed {
    type Value = Cow<'de, str>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeySeed {
    type Value = Cow<'de, str>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a string")
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Cow::Owned(v.to_owned()))
    }
}

fn write_string(s: &str, out: &mut Vec<u8>) {
    // Most keys and values need no escape: copied as they are, which is exactly what serde_json
    // writes for them (it escapes only `"`, `\\` and control characters).
    if !s.bytes().any(|b| b == b'"' || b == b'\\' || b < 0x20) {
        out.reserve(s.len() + 2);
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
        return;
    }
    // Writing to a Vec cannot fail; on the impossible error the raw text still goes in.
    if serde_json::to_writer(&mut *out, s).is_err() {
        out.extend_from_slice(s.as_bytes());
    }
}

/// Writes a JSON number as `[-]digits[eEXP]` with no leading or trailing zeros in `digits`:
/// exact for any precision, and equal for equal values written differently.
fn write_number(raw: &str, out: &mut Vec<u8>) {
    if !normalize_number(raw, out) {
        out.push(b'~');
        out.extend_from_slice(raw.as_bytes());
    }
}

/// A JSON number in the same exact, canonical text the fingerprint uses (`1e1` for `10`).
pub fn canonical_number(n: &serde_json::Number) -> String {
    let mut out = Vec::new();
    write_number(n.as_str(), &mut out);
    String::from_utf8(out).unwrap_or_else(|_| n.as_str().to_string())
}

/// Appends the canonical text of the number `raw` to `out`; false, with nothing appended, when
/// `raw` is not a plain decimal number or its exponent is too long to normalise.
fn normalize_number(raw: &str, out: &mut Vec<u8>) -> bool {
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
        return false;
    }
    let Ok(exp) = exp.parse::<i128>() else {
        return false;
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let (int, frac) = (int.as_bytes(), frac.as_bytes());
    if !int.iter().chain(frac).all(u8::is_ascii_digit) {
        return false;
    }
    // The digits are int ++ frac; keep from the first to the last non-zero one.
    let digit = |i: usize| {
        if i < int.len() {
            int[i]
        } else {
            frac[i - int.len()]
        }
    };
    let total = int.len() + frac.len();
    let Some(first) = (0..total).find(|&i| digit(i) != b'0') else {
        out.push(b'0');
        return true;
    };
    let last = (0..total)
        .rev()
        .find(|&i| digit(i) != b'0')
        .unwrap_or(first);
    let exp = exp - frac.len() as i128 + (total - 1 - last) as i128;
    if negative {
        out.push(b'-');
    }
    for part in [
        int.get(first..(last + 1).min(int.len())),
        frac.get(first.saturating_sub(int.len())..(last + 1).saturating_sub(int.len())),
    ]
    .into_iter()
    .flatten()
    {
        out.extend_from_slice(part);
    }
    if exp != 0 {
        out.push(b'e');
        out.extend_from_slice(itoa::Buffer::new().format(exp).as_bytes());
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    use serde_json::Value;

    fn canon(json: &str) -> String {
        String::from_utf8(canonical_json(json.as_bytes(), &IgnoredFields::default()).unwrap())
            .unwrap()
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
                Value::Number(n) => {
                    out.extend_from_slice(super::super::canonical_number(n).as_bytes())
                }
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

    /// The previous version's fingerprint of a JSON body, computed as it did: canonicalised
    /// whatever keys it has, or hashed as bytes when it does not parse.
    fn previous(body: &str) -> Fingerprint {
        let headers = HeaderMap::new();
        let parts = on_payments(&headers, body.as_bytes());
        match canonical_json(body.as_bytes(), &IgnoredFields::default()) {
            Some(c) => hashed(&parts, Body::Json(&c), None),
            None => hashed(&parts, Body::Bytes(body.as_bytes()), None),
        }
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
            assert_eq!(both(a), fp(None, a, &[]), "{a}: hashed as its bytes");
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
        assert_eq!(json, previous(body), "plain JSON: as before");
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
        assert_eq!(both(big), previous(big));
        assert_eq!(both(&format!("{big}.0")), both(big));
    }

    #[test]
    fn an_unambiguous_body_keeps_the_previous_versions_fingerprint() {
        for body in [
            r#"{"b":1,"a":{"d":[1,2],"c":null}}"#,
            r#"{"Amount":1,"currency":"EUR"}"#,
            "[1,2,3]",
            "not json",
        ] {
            assert_eq!(both(body), previous(body), "{body}");
        }
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
        /// Any JSON text: the fingerprint is the previous version's unless the body is
        /// ambiguous, and then it is the bytes' and the previous version's is kept beside it.
        #[test]
        fn fingerprints_change_only_for_ambiguous_bodies(text in json_text()) {
            let now = both(&text);
            if now != previous(&text) {
                // Only an ambiguous body changes, and then to its bytes.
                prop_assert_eq!(now, fp(None, &text, &[]));
                prop_assert!(canonical(text.as_bytes(), &IgnoredFields::default(), true).is_ambiguous());
            }
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
}
