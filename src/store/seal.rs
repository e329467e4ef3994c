//! Stored answers sealed at rest (`store.encryption_keys_file` / `encryption_keys_env`): what a
//! record holds that a reader of the store, its replicas or its backups need not see (a
//! completed record's status, headers, trailers and body; an open record's origin: the route
//! and the key as the client sent it) is sealed with AES-256-GCM-SIV (RFC 8452) under the first
//! key of the keys file; every key listed opens what it sealed. What the stores' atomic
//! operations compare (state, fingerprint, owner token, lease, times) stays in the clear.
//!
//! A sealed part: `id length (u8) | key id | nonce (12) | ciphertext and tag (16)`. The
//! associated data is the store key and the part's kind: a sealed answer moved under another
//! key, or into an origin's place, does not open.
//!
//! Sealing is deterministic: the nonce is an HMAC of the part, under a key of its own derived
//! from the same secret (the synthetic-IV construction of RFC 5297, on a cipher that is itself
//! nonce-misuse resistant). The stores' compare-and-set (Redis take-over, Postgres `Expected`)
//! compares a record read with the stored bytes by encoding it again, so the same record must
//! seal to the same bytes; what this shows a reader is only that two sealed parts under the
//! same store key are the same, which the stored bytes around them say anyway. A record keeps
//! how it was read ([`Sealing`]: the key it was sealed with, or in the clear) so that it encodes
//! to the same bytes after a rotation, or after keys were configured.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError};

use aes_gcm_siv::aead::{AeadInPlace, KeyInit};
use aes_gcm_siv::{Aes256GcmSiv, Nonce};
use arc_swap::ArcSwap;
use base64::Engine;
use bytes::{BufMut, BytesMut};
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::config::TokenSource;
use crate::key::StoreKey;

/// The id of a key, as the keys file names it and a sealed part records it.
pub type KeyId = Arc<str>;

/// How a record's sealable parts were found, so that it is written again in the same form (the
/// stores' compare-and-set compares a record read, encoded again, with the stored bytes).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Sealing {
    /// Made here: sealed with the current key when the store seals.
    #[default]
    New,
    /// Read in the clear (stored before keys were configured, or with nothing to seal):
    /// written again in the clear.
    Clear,
    /// Read sealed with this key: sealed with it again while it is listed.
    With(KeyId),
}

/// What a sealed part holds: bound into its associated data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// A completed record's answer.
    Answer = 1,
    /// An open record's origin.
    Origin = 2,
}

const NONCE_LEN: usize = 12;
const TAG_LEN: usize = 16;
/// A key id: 1 to 32 of `[A-Za-z0-9._-]`.
const MAX_ID: usize = 32;
/// The most a sealed part adds to what it holds: the key id's length and the id, the nonce, the
/// tag.
pub const OVERHEAD: usize = 1 + MAX_ID + NONCE_LEN + TAG_LEN;

/// The keys a gateway seals and opens with; replaced as a whole on reload.
pub struct Sealer {
    keys: ArcSwap<Keys>,
    /// Parts opened with each key id since the start (kept across reloads), for
    /// `idemgate_store_sealed_opened_total`: an old key whose count stops rising holds nothing
    /// read any more.
    opened: std::sync::Mutex<Vec<(KeyId, Arc<AtomicU64>)>>,
    /// Parts that did not open.
    unreadable: AtomicU64,
    /// Why the last reload failed (the keys in use stay), until one succeeds: `/readyz` says so.
    reload_failed: std::sync::Mutex<Option<String>>,
}

/// What [`Sealer::stats`] counts.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SealStats {
    /// Parts opened, by the id of the key that sealed them.
    pub opened: Vec<(KeyId, u64)>,
    pub unreadable: u64,
}

struct Keys {
    /// The first is the key that seals.
    all: Vec<Key>,
}

struct Key {
    id: KeyId,
    cipher: Aes256GcmSiv,
    /// The HMAC key the synthetic nonces are made with.
    nonce_key: Hmac<Sha256>,
    /// This id's count in [`Sealer::opened`].
    opened: Arc<AtomicU64>,
}

/// Why a keys file was refused. Never holds key material.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeysError {
    #[error("line {line}: not ID:BASE64 (a key id, a colon, 32 random bytes in base64: openssl rand -base64 32)")]
    Malformed { line: usize },
    #[error("line {line}: the key id is 1 to {MAX_ID} of A-Z a-z 0-9 . _ -")]
    BadId { line: usize },
    #[error("line {line}: the key is not 32 bytes of base64 (openssl rand -base64 32)")]
    BadKey { line: usize },
    #[error("line {line}: the key id {id} is listed twice")]
    Duplicate { line: usize, id: String },
    #[error("no key: the first line is the key that seals")]
    Empty,
    #[error("cannot read {what}: {reason}")]
    Unreadable { what: String, reason: String },
}

/// Why a sealed part did not open.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    #[error("sealed with key {0}, which is not listed")]
    UnknownKey(String),
    #[error(
        "sealed with key {0}, and this gateway has no keys (store.encryption_keys_file or _env)"
    )]
    NoKeys(String),
    #[error("sealed with key {0}, and does not open with it (altered, or moved)")]
    Tampered(String),
    #[error("a sealed part cut short")]
    Malformed,
}

impl OpenError {
    /// The key id named, if any (logged and shown to operators; never key material).
    pub fn key_id(&self) -> Option<&str> {
        match self {
            OpenError::UnknownKey(id) | OpenError::Tampered(id) | OpenError::NoKeys(id) => Some(id),
            _ => None,
        }
    }
}

impl Sealer {
    /// The keys in a keys file's text: one `ID:BASE64` per line, the first the key that seals;
    /// blank lines and lines starting with `#` are skipped.
    pub fn parse(text: &str) -> Result<Sealer, KeysError> {
        let opened = std::sync::Mutex::new(Vec::new());
        let keys = Keys::parse(text, &opened)?;
        Ok(Sealer {
            keys: ArcSwap::from_pointee(keys),
            opened,
            unreadable: AtomicU64::new(0),
            reload_failed: std::sync::Mutex::new(None),
        })
    }

    /// The keys where the config says they are (`store.encryption_keys_file` or `_env`).
    pub fn load(source: &TokenSource) -> Result<Sealer, KeysError> {
        Sealer::parse(&read(source)?)
    }

    /// The keys a config names, if it names any (`Config::store_keys`).
    pub fn configured(source: Option<&TokenSource>) -> Result<Option<Arc<Sealer>>, KeysError> {
        source.map(|s| Sealer::load(s).map(Arc::new)).transpose()
    }

    /// Replaces the keys with those in `text`; on an error the keys in use stay.
    pub fn reload(&self, text: &str) -> Result<(), KeysError> {
        self.keys.store(Arc::new(Keys::parse(text, &self.opened)?));
        Ok(())
    }

    /// Reads the keys again where the config says (SIGHUP; a variable is the process's own,
    /// so only a file changes). On an error the keys in use stay, and [`Sealer::not_ready`]
    /// says why until a reload succeeds.
    pub fn reload_from(&self, source: &TokenSource) -> Result<(), KeysError> {
        let done = read(source).and_then(|text| self.reload(&text));
        let mut failed = self
            .reload_failed
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        *failed = done.as_ref().err().map(|e| e.to_string());
        done
    }

    /// Why the gateway should not take traffic: the last reload of the keys failed.
    pub fn not_ready(&self) -> Option<String> {
        let failed = self
            .reload_failed
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        (failed.as_ref()).map(|why| format!("store.encryption_keys_*: the last reload failed ({why}); the keys read before are in use"))
    }

    /// Parts opened per key id, and parts that did not open, since the start.
    pub fn stats(&self) -> SealStats {
        let opened = self.opened.lock().unwrap_or_else(PoisonError::into_inner);
        SealStats {
            opened: (opened.iter())
                .map(|(id, n)| (id.clone(), n.load(Ordering::Relaxed)))
                .collect(),
            unreadable: self.unreadable.load(Ordering::Relaxed),
        }
    }

    /// Every key id listed, the sealing one first.
    pub fn ids(&self) -> Vec<KeyId> {
        self.keys.load().all.iter().map(|k| k.id.clone()).collect()
    }

    /// Appends `plain` sealed as `part` of the record under `key` to `out`, with the key named
    /// `with` if it is listed (a record read keeps the key it was sealed with), else the
    /// current one.
    pub fn seal(
        &self,
        with: Option<&KeyId>,
        part: Part,
        key: &StoreKey,
        plain: &[u8],
        out: &mut BytesMut,
    ) {
        let keys = self.keys.load();
        let chosen = with
            .and_then(|id| keys.all.iter().find(|k| k.id == *id))
            .unwrap_or(&keys.all[0]);
        let mut mac = chosen.nonce_key.clone();
        mac.update(&[part as u8]);
        mac.update(key.as_bytes());
        mac.update(plain);
        let digest = mac.finalize().into_bytes();
        let nonce = Nonce::from_slice(&digest[..NONCE_LEN]);
        out.reserve(1 + chosen.id.len() + NONCE_LEN + plain.len() + TAG_LEN);
        out.put_u8(chosen.id.len() as u8);
        out.put_slice(chosen.id.as_bytes());
        out.put_slice(nonce);
        let start = out.len();
        out.put_slice(plain);
        let aad = associated(part, key);
        // Encrypting in place fails only past the cipher's limit (2^36 bytes), far above any
        // record (bodies are capped by max_body). Were it to fail, the part is cut short: it
        // then reads as unreadable (refused, never run again), never as the plain bytes.
        match chosen
            .cipher
            .encrypt_in_place_detached(nonce, &aad, &mut out[start..])
        {
            Ok(tag) => out.put_slice(&tag),
            Err(_) => {
                tracing::error!(bytes = plain.len(), "a record part too long to seal");
                out.truncate(start);
            }
        }
    }

    /// Opens a part [`Sealer::seal`] made: the plain bytes and the id of the key that sealed
    /// them.
    pub fn open(
        &self,
        part: Part,
        key: &StoreKey,
        sealed: &[u8],
    ) -> Result<(Vec<u8>, KeyId), OpenError> {
        let opened = self.try_open(part, key, sealed);
        if opened.is_err() {
            self.unreadable.fetch_add(1, Ordering::Relaxed);
        }
        opened
    }

    fn try_open(
        &self,
        part: Part,
        key: &StoreKey,
        sealed: &[u8],
    ) -> Result<(Vec<u8>, KeyId), OpenError> {
        let (id, rest) = split_id(sealed)?;
        let keys = self.keys.load();
        let Some(found) = keys.all.iter().find(|k| *k.id == *id) else {
            return Err(OpenError::UnknownKey(shown(id)));
        };
        if rest.len() < NONCE_LEN + TAG_LEN {
            return Err(OpenError::Malformed);
        }
        let (nonce, rest) = rest.split_at(NONCE_LEN);
        let (ciphertext, tag) = rest.split_at(rest.len() - TAG_LEN);
        let mut plain = ciphertext.to_vec();
        found
            .cipher
            .decrypt_in_place_detached(
                Nonce::from_slice(nonce),
                &associated(part, key),
                &mut plain,
                tag.into(),
            )
            .map_err(|_| OpenError::Tampered(shown(id)))?;
        found.opened.fetch_add(1, Ordering::Relaxed);
        Ok((plain, found.id.clone()))
    }
}

/// The text of the keys file, or of the variable, as the config names it.
fn read(source: &TokenSource) -> Result<String, KeysError> {
    match source {
        TokenSource::Env(name) => std::env::var(name)
            .ok()
            .filter(|t| !t.trim().is_empty())
            .ok_or_else(|| KeysError::Unreadable {
                what: format!(
                    "the environment variable {}",
                    crate::config::shown_name(name)
                ),
                reason: "not set or empty".into(),
            }),
        TokenSource::File(path) => {
            std::fs::read_to_string(path).map_err(|e| KeysError::Unreadable {
                what: crate::config::shown_name(&path.display().to_string()),
                reason: e.to_string(),
            })
        }
    }
}

/// The id of the key a sealed part names, for a gateway without keys to say which it lacks.
pub fn sealed_with(sealed: &[u8]) -> Result<String, OpenError> {
    split_id(sealed).map(|(id, _)| shown(id))
}

fn split_id(sealed: &[u8]) -> Result<(&str, &[u8]), OpenError> {
    let (&len, rest) = sealed.split_first().ok_or(OpenError::Malformed)?;
    let len = usize::from(len);
    if len == 0 || len > MAX_ID || rest.len() < len {
        return Err(OpenError::Malformed);
    }
    let (id, rest) = rest.split_at(len);
    let id = std::str::from_utf8(id).map_err(|_| OpenError::Malformed)?;
    if !valid_id(id) {
        return Err(OpenError::Malformed);
    }
    Ok((id, rest))
}

/// A key id as logs and answers show it (already checked to be short and plain).
fn shown(id: &str) -> String {
    id.to_string()
}

fn associated(part: Part, key: &StoreKey) -> [u8; 10 + 32] {
    let mut aad = [0u8; 42];
    aad[..9].copy_from_slice(b"idemgate\x01");
    aad[9] = part as u8;
    aad[10..].copy_from_slice(key.as_bytes());
    aad
}

fn valid_id(id: &str) -> bool {
    (1..=MAX_ID).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

impl Keys {
    /// The keys in `text`; each id's open count is taken from (or added to) `counts`.
    fn parse(
        text: &str,
        counts: &std::sync::Mutex<Vec<(KeyId, Arc<AtomicU64>)>>,
    ) -> Result<Keys, KeysError> {
        let mut all: Vec<Key> = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line_no = i + 1;
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (id, secret) = line
                .split_once(':')
                .ok_or(KeysError::Malformed { line: line_no })?;
            let id = id.trim();
            if !valid_id(id) {
                return Err(KeysError::BadId { line: line_no });
            }
            if all.iter().any(|k| &*k.id == id) {
                return Err(KeysError::Duplicate {
                    line: line_no,
                    id: id.to_string(),
                });
            }
            let secret = base64::engine::general_purpose::STANDARD
                .decode(secret.trim())
                .ok()
                .filter(|s| s.len() == 32)
                .ok_or(KeysError::BadKey { line: line_no })?;
            all.push(Key::new(id, &secret).ok_or(KeysError::BadKey { line: line_no })?);
        }
        if all.is_empty() {
            return Err(KeysError::Empty);
        }
        let mut counts = counts.lock().unwrap_or_else(PoisonError::into_inner);
        for key in &mut all {
            match counts.iter().find(|(id, _)| *id == key.id) {
                Some((_, n)) => key.opened = Arc::clone(n),
                None => counts.push((key.id.clone(), Arc::clone(&key.opened))),
            }
        }
        Ok(Keys { all })
    }
}

impl Key {
    /// Two keys from one secret, each for one use: the cipher's, and the nonces' HMAC.
    fn new(id: &str, secret: &[u8]) -> Option<Key> {
        let derive = |label: &[u8]| -> Option<[u8; 32]> {
            let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret).ok()?;
            mac.update(label);
            Some(mac.finalize().into_bytes().into())
        };
        let cipher = Aes256GcmSiv::new_from_slice(&derive(b"idemgate seal v1")?).ok()?;
        let nonce_key =
            <Hmac<Sha256> as Mac>::new_from_slice(&derive(b"idemgate nonce v1")?).ok()?;
        Some(Key {
            id: Arc::from(id),
            cipher,
            nonce_key,
            opened: Arc::new(AtomicU64::new(0)),
        })
    }
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The ids only: never key material.
        f.debug_struct("Sealer").field("keys", &self.ids()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ONE: &str = "k1:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
    const TWO: &str = "k2:HxwdHhsaGRgXFhUUExIREA8ODQwLCgkIBwYFBAMCAQA=";

    fn key(n: u8) -> StoreKey {
        StoreKey::from_bytes([n; 32])
    }

    fn sealed(s: &Sealer, with: Option<&KeyId>, part: Part, k: &StoreKey, plain: &[u8]) -> Vec<u8> {
        let mut out = BytesMut::new();
        s.seal(with, part, k, plain, &mut out);
        out.to_vec()
    }

    #[test]
    fn a_part_opens_with_its_key_only_where_it_was_sealed() {
        let s = Sealer::parse(ONE).unwrap();
        let blob = sealed(&s, None, Part::Answer, &key(1), b"card 4242");
        assert!(!blob.windows(4).any(|w| w == b"4242"));
        assert_eq!(
            s.open(Part::Answer, &key(1), &blob).unwrap().0,
            b"card 4242"
        );
        // The same part seals to the same bytes; another key's does not.
        assert_eq!(blob, sealed(&s, None, Part::Answer, &key(1), b"card 4242"));
        assert_ne!(blob, sealed(&s, None, Part::Answer, &key(2), b"card 4242"));
        // Moved under another key, or into an origin's place: does not open.
        assert_eq!(
            s.open(Part::Answer, &key(2), &blob),
            Err(OpenError::Tampered("k1".into()))
        );
        assert!(s.open(Part::Origin, &key(1), &blob).is_err());
        let mut flipped = blob.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(s.open(Part::Answer, &key(1), &flipped).is_err());
        for cut in 0..blob.len() {
            assert!(
                s.open(Part::Answer, &key(1), &blob[..cut]).is_err(),
                "{cut}"
            );
        }
    }

    #[test]
    fn a_rotation_seals_with_the_new_key_and_opens_the_old() {
        let old = Sealer::parse(ONE).unwrap();
        let blob = sealed(&old, None, Part::Origin, &key(1), b"route k");
        let both = Sealer::parse(&format!("{TWO}\n# the old one\n{ONE}\n")).unwrap();
        assert_eq!(&*both.ids()[0], "k2");
        let (plain, id) = both.open(Part::Origin, &key(1), &blob).unwrap();
        assert_eq!((plain.as_slice(), &*id), (&b"route k"[..], "k1"));
        // Sealed again with the key it was read with: the same bytes (compare-and-set).
        assert_eq!(
            sealed(&both, Some(&id), Part::Origin, &key(1), b"route k"),
            blob
        );
        let new = sealed(&both, None, Part::Origin, &key(1), b"route k");
        assert_eq!(sealed_with(&new).unwrap(), "k2");
        let only_new = Sealer::parse(TWO).unwrap();
        assert_eq!(
            only_new.open(Part::Origin, &key(1), &blob),
            Err(OpenError::UnknownKey("k1".into()))
        );
        // A failed reload keeps the keys in use.
        assert!(both.reload("nonsense").is_err());
        assert_eq!(both.ids().len(), 2);
        both.reload(ONE).unwrap();
        assert_eq!(both.ids(), vec![KeyId::from("k1")]);
        // Opens are counted per key id, across reloads; failures apart.
        both.open(Part::Origin, &key(1), &blob).unwrap();
        assert!(both.open(Part::Origin, &key(1), &new).is_err());
        let stats = both.stats();
        assert_eq!(stats.unreadable, 1);
        let k1 = stats
            .opened
            .iter()
            .find(|(id, _)| &**id == "k1")
            .map(|(_, n)| *n);
        assert_eq!(k1, Some(2));
    }

    #[test]
    fn a_keys_file_is_refused_with_the_line_never_the_key() {
        for (text, want) in [
            ("", KeysError::Empty),
            ("# nothing\n\n", KeysError::Empty),
            ("k1 AAAA", KeysError::Malformed { line: 1 }),
            ("k 1:AAAA", KeysError::BadId { line: 1 }),
            (":AAAA", KeysError::BadId { line: 1 }),
            ("k1:c2hvcnQ=", KeysError::BadKey { line: 1 }),
            ("k1:not base64!", KeysError::BadKey { line: 1 }),
        ] {
            assert_eq!(Sealer::parse(text).unwrap_err(), want, "{text:?}");
        }
        let twice = format!("{ONE}\n{ONE}");
        assert_eq!(
            Sealer::parse(&twice).unwrap_err(),
            KeysError::Duplicate {
                line: 2,
                id: "k1".into()
            }
        );
        let shown = format!(
            "{:?} {}",
            Sealer::parse(ONE).unwrap(),
            KeysError::BadKey { line: 3 }
        );
        assert!(!shown.contains("AAECAwQF"), "{shown}");
    }
}
