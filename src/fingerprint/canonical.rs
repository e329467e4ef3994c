//! The canonical form of a JSON body: what makes two layouts of one JSON value the same request,
//! and the strict reading that refuses bodies upstreams read differently (repeated keys, keys
//! equal but for case, serde_json's private number marker written by a client).

use std::borrow::Cow;
use std::cell::Cell;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

use super::IgnoredFields;

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
/// Not strict: the form of the fingerprint before issue 44 ([`super::earlier_fingerprint`]).
/// [`super::fingerprint`] uses the strict one, which gives the same bytes for every body it
/// does not refuse.
pub fn canonical_json(body: &[u8], ignore: &IgnoredFields) -> Option<Vec<u8>> {
    match canonical(body, ignore, false) {
        Canonical::Json(out) => Some(out),
        Canonical::NotJson | Canonical::Ambiguous => None,
    }
}

/// A body's canonical JSON form, or why it has none.
#[derive(Debug)]
pub(super) enum Canonical {
    Json(Vec<u8>),
    /// Not JSON, or not JSON `serde_json` reads.
    NotJson,
    /// (`strict` only) JSON that upstreams read differently: an object with a repeated key or
    /// keys equal but for case (Go's `encoding/json`, ASP.NET Core and case-insensitive Jackson
    /// match keys so; some keep the first of repeated keys, some the last, some refuse), or an
    /// object a client wrote with serde_json's private number key.
    Ambiguous,
}

pub(super) fn canonical(body: &[u8], ignore: &IgnoredFields, strict: bool) -> Canonical {
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
    /// An ignored one is not strict: what is left out cannot be read two ways.
    fn child<'b>(&'b mut self, active: &'b [usize], ignored: bool) -> Canon<'b> {
        Canon {
            out: &mut *self.out,
            pointers: self.pointers,
            active,
            depth: self.depth + 1,
            strict: self.strict.filter(|_| !ignored),
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
    /// case, a kept one and an ignored one's (`left_out`) included: an upstream that matches
    /// keys by case may read the kept one's twin.
    fn check_keys(&self, members: &[(Cow<'_, str>, usize, usize)], left_out: &[Cow<'_, str>]) {
        let Some((ambiguous, _)) = self.strict else {
            return;
        };
        if members.len() + left_out.len() < 2 || ambiguous.get() {
            return;
        }
        if !left_out.is_empty() {
            // A kept key and an ignored one that meet; ignored ones among themselves are left
            // out together.
            let mut kept: Vec<Cow<'_, str>> = members.iter().map(|m| folded(&m.0)).collect();
            kept.sort_unstable();
            let meet = kept.windows(2).any(|w| w[0] == w[1])
                || left_out
                    .iter()
                    .any(|k| kept.binary_search(&folded(k)).is_ok());
            if meet {
                ambiguous.set(true);
            }
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
            if seq
                .next_element_seed(self.child(&deeper, ignored))?
                .is_none()
            {
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
        let mut left_out: Vec<Cow<'de, str>> = Vec::new();
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
            map.next_value_seed(self.child(&deeper, ignored))?;
            if ignored {
                // Parsed in full all the same, so that what `Value` refuses stays refused.
                self.out.truncate(before);
                if self.strict.is_some() {
                    left_out.push(k);
                }
                continue;
            }
            members.push((k, at, self.out.len()));
        }
        self.out.push(b'}');
        self.check_keys(&members, &left_out);
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
pub(super) const NUMBER_TOKEN: &str = "$serde_json::private::Number";

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
pub(super) fn normalize_number(raw: &str, out: &mut Vec<u8>) -> bool {
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
