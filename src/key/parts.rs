//! A key made of several parts (headers, JSON body fields), combined into one fixed-length key.
//!
//! Each part keeps its JSON type: the number `10` and the string `"1e1"`, or `true` and
//! `"true"`, are different ids and never make the same key (numbers compare by value: `10` and
//! `1e1` are one, written `1e1`). Until issue 45 every part was text, so a key with a number or boolean part
//! also has its older form ([`combine_untyped`]), looked up while records of that version may
//! still be kept.

use sha2::{Digest, Sha256};

use super::KeyError;

/// One part of a composite key, with its JSON type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyPart {
    /// A header's value or a JSON string.
    Text(String),
    /// A JSON number, in its canonical text (`1e1` is `10`).
    Number(String),
    Bool(bool),
}

impl KeyPart {
    /// A body field's value as a key part: `Ok(None)` when it is absent or null.
    pub(super) fn of_json(
        value: Option<&serde_json::Value>,
        pointer: &str,
    ) -> Result<Option<KeyPart>, KeyError> {
        use serde_json::Value;
        Ok(Some(match value {
            None | Some(Value::Null) => return Ok(None),
            Some(Value::String(s)) if s.is_empty() => return Err(KeyError::Empty),
            Some(Value::String(s)) => KeyPart::Text(s.clone()),
            Some(Value::Number(n)) => KeyPart::Number(crate::fingerprint::canonical_number(n)),
            Some(Value::Bool(b)) => KeyPart::Bool(*b),
            Some(_) => return Err(KeyError::NotScalar(pointer.to_string())),
        }))
    }

    /// A part as an operator writes it in JSON (`"pi_1"`, `10`, `true`): how `idemgate keys
    /// --json-parts` names a number or boolean part.
    pub fn parse_json(text: &str) -> Result<KeyPart, KeyError> {
        let value: serde_json::Value = serde_json::from_str(text).map_err(|_| KeyError::BadPart)?;
        KeyPart::of_json(Some(&value), "the part")?.ok_or(KeyError::BadPart)
    }

    /// The part as text, as every part was before issue 45.
    fn untyped(&self) -> std::borrow::Cow<'_, str> {
        match self {
            KeyPart::Text(s) | KeyPart::Number(s) => s.as_str().into(),
            KeyPart::Bool(b) => b.to_string().into(),
        }
    }

    /// Appends the part as a JSON value: a string quoted and escaped as serde_json does, so a
    /// key of text parts alone is the same as before issue 45.
    fn write_json(&self, out: &mut Vec<u8>) {
        match self {
            // Writing a string into a Vec cannot fail.
            KeyPart::Text(s) => drop(serde_json::to_writer(&mut *out, s)),
            KeyPart::Number(n) => out.extend_from_slice(n.as_bytes()),
            KeyPart::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
        }
    }
}

/// The key made of `parts`: a hash of them as a JSON array, unambiguous whatever they contain,
/// and of fixed length.
pub fn combine(parts: &[KeyPart]) -> String {
    hex::encode(Sha256::digest(json_array(parts)))
}

/// The parts as a JSON array of their values (`["pi_1",1e1]`): what [`combine`] hashes.
fn json_array(parts: &[KeyPart]) -> Vec<u8> {
    let mut joined = Vec::with_capacity(64);
    joined.push(b'[');
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            joined.push(b',');
        }
        part.write_json(&mut joined);
    }
    joined.push(b']');
    joined
}

/// The key the version before issue 45 made of `parts` (every part as text), where it differs
/// from [`combine`]'s: only when a part is a number or a boolean.
pub(super) fn combine_untyped(parts: &[KeyPart]) -> Option<String> {
    if parts.iter().all(|p| matches!(p, KeyPart::Text(_))) {
        return None;
    }
    let texts: Vec<std::borrow::Cow<'_, str>> = parts.iter().map(KeyPart::untyped).collect();
    // Serialising strings cannot fail; an empty array on the impossible error still hashes.
    let joined = serde_json::to_vec(&texts).unwrap_or_default();
    Some(hex::encode(Sha256::digest(&joined)))
}

/// [`combine`]'s key, and the key as its sender knows it: one part's text, or several as the
/// JSON array the key is a hash of.
pub(super) fn key_and_sent(parts: &[KeyPart]) -> (String, String) {
    let joined = json_array(parts);
    let key = hex::encode(Sha256::digest(&joined));
    let sent = match parts {
        [one] => one.untyped().into_owned(),
        // Strings serde_json wrote, digits and `true`/`false`: always UTF-8.
        _ => String::from_utf8_lossy(&joined).into_owned(),
    };
    (key, sent)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(s: &str) -> KeyPart {
        KeyPart::Text(s.into())
    }

    #[test]
    fn text_parts_make_the_key_they_always_made() {
        let parts = [text("pi_1"), text("a \"quoted\" \\ \u{e9}")];
        let before = {
            let joined = serde_json::to_vec(&["pi_1", "a \"quoted\" \\ \u{e9}"]).unwrap();
            hex::encode(Sha256::digest(&joined))
        };
        assert_eq!(combine(&parts), before);
        assert_eq!(combine_untyped(&parts), None, "no second lookup");
    }

    #[test]
    fn types_keep_parts_apart_and_the_older_key_is_the_untyped_one() {
        let number = [KeyPart::Number("1e1".into())];
        let string = [text("1e1")];
        assert_ne!(combine(&number), combine(&string));
        assert_eq!(combine_untyped(&number), Some(combine(&string)));
        let yes = [KeyPart::Bool(true)];
        assert_ne!(combine(&yes), combine(&[text("true")]));
        assert_eq!(combine_untyped(&yes), Some(combine(&[text("true")])));
        let sent = |parts: &[KeyPart]| key_and_sent(parts).1;
        assert_eq!(
            sent(&[text("pi_1"), KeyPart::Number("1e1".into())]),
            r#"["pi_1",1e1]"#
        );
        assert_eq!(sent(&number), "1e1");
        assert_eq!(key_and_sent(&number).0, combine(&number));
    }

    #[test]
    fn operators_write_parts_in_json() {
        assert_eq!(KeyPart::parse_json("10"), Ok(KeyPart::Number("1e1".into())));
        assert_eq!(KeyPart::parse_json("\"1e1\""), Ok(text("1e1")));
        assert_eq!(KeyPart::parse_json("false"), Ok(KeyPart::Bool(false)));
        assert_eq!(KeyPart::parse_json("bare"), Err(KeyError::BadPart));
        assert_eq!(KeyPart::parse_json("null"), Err(KeyError::BadPart));
        assert!(KeyPart::parse_json("[1]").is_err());
    }
}
