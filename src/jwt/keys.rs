//! The keys tokens are verified with: a JWKS document (fetched or read from a file) or one
//! HMAC secret. Each key keeps the algorithms it may verify, so that a token cannot choose
//! another family (`alg: none`, HS256 keyed with an RSA public key) or another curve.

use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, KeyAlgorithm, PublicKeyUse};
use jsonwebtoken::{Algorithm, DecodingKey};

/// A JWKS document is refused past this (a real one is a few KB).
pub const MAX_JWKS_BYTES: usize = 256 << 10;
/// Keys kept from one document; more are ignored (issuers publish two or three).
const MAX_KEYS: usize = 64;

/// One verification key.
pub(super) struct Key {
    kid: Option<String>,
    pub(super) key: DecodingKey,
    algorithms: Vec<Algorithm>,
}

impl Key {
    pub(super) fn allows(&self, alg: Algorithm) -> bool {
        self.algorithms.contains(&alg)
    }
}

/// The keys in use, replaced whole by each successful fetch.
#[derive(Default)]
pub struct KeySet {
    keys: Vec<Key>,
    /// One configured secret: nothing to fetch, so its one key is the token's whatever it names.
    fixed: bool,
}

impl KeySet {
    /// The keys of a JWKS document: signature keys of a supported type; others (encryption
    /// keys, symmetric keys, types this verifier does not know) are skipped, so that an issuer
    /// adding one breaks nothing. A document without one usable key is refused.
    pub fn parse(document: &[u8]) -> Result<KeySet, String> {
        if document.len() > MAX_JWKS_BYTES {
            return Err(format!("over {MAX_JWKS_BYTES} bytes"));
        }
        let value: serde_json::Value =
            serde_json::from_slice(document).map_err(|e| format!("not JSON: {e}"))?;
        let Some(entries) = value.get("keys").and_then(|k| k.as_array()) else {
            return Err("no \"keys\" array".into());
        };
        let keys: Vec<Key> = (entries.iter())
            .filter_map(|entry| serde_json::from_value::<Jwk>(entry.clone()).ok())
            .filter_map(|jwk| key_of(&jwk))
            .take(MAX_KEYS)
            .collect();
        if keys.is_empty() {
            return Err(
                "no signature key of a supported type (RSA, EC P-256/P-384, Ed25519)".into(),
            );
        }
        Ok(KeySet { keys, fixed: false })
    }

    /// One HMAC secret: HS256, HS384 or HS512, whatever `kid` a token names.
    pub fn hmac(secret: &[u8]) -> KeySet {
        KeySet {
            keys: vec![Key {
                kid: None,
                key: DecodingKey::from_secret(secret),
                algorithms: vec![Algorithm::HS256, Algorithm::HS384, Algorithm::HS512],
            }],
            fixed: true,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// The key a token names by `kid`, and whether it was named: a key with that `kid`; else
    /// (a token without one, or a set whose one key has none) the only key there is, not
    /// named, so that a signature it does not verify may be a rotation to fetch. `None`: no key
    /// has the token's `kid` (or it names none among several): a rotation the gateway has not
    /// fetched yet, or a forgery.
    pub(super) fn find(&self, kid: Option<&str>) -> Option<(&Key, bool)> {
        if let Some(kid) = kid {
            if let Some(key) = self.keys.iter().find(|k| k.kid.as_deref() == Some(kid)) {
                return Some((key, true));
            }
        }
        match self.keys.as_slice() {
            [only] if kid.is_none() || only.kid.is_none() => Some((only, self.fixed)),
            _ => None,
        }
    }
}

/// A JWK as a verification key, with the algorithms its type and its own `alg` allow.
fn key_of(jwk: &Jwk) -> Option<Key> {
    if matches!(jwk.common.public_key_use, Some(ref u) if *u != PublicKeyUse::Signature) {
        return None;
    }
    let by_type: Vec<Algorithm> = match &jwk.algorithm {
        AlgorithmParameters::RSA(_) => vec![
            Algorithm::RS256,
            Algorithm::RS384,
            Algorithm::RS512,
            Algorithm::PS256,
            Algorithm::PS384,
            Algorithm::PS512,
        ],
        AlgorithmParameters::EllipticCurve(ec) => match ec.curve {
            EllipticCurve::P256 => vec![Algorithm::ES256],
            EllipticCurve::P384 => vec![Algorithm::ES384],
            _ => return None,
        },
        AlgorithmParameters::OctetKeyPair(okp) if okp.curve == EllipticCurve::Ed25519 => {
            vec![Algorithm::EdDSA]
        }
        // A symmetric key in a published document is one every reader holds.
        AlgorithmParameters::OctetKey(_) | AlgorithmParameters::OctetKeyPair(_) => return None,
    };
    let algorithms = match jwk.common.key_algorithm {
        None => by_type,
        Some(stated) => {
            let alg = algorithm_of(stated)?;
            if !by_type.contains(&alg) {
                return None;
            }
            vec![alg]
        }
    };
    Some(Key {
        kid: jwk.common.key_id.clone(),
        key: DecodingKey::from_jwk(jwk).ok()?,
        algorithms,
    })
}

fn algorithm_of(stated: KeyAlgorithm) -> Option<Algorithm> {
    Some(match stated {
        KeyAlgorithm::RS256 => Algorithm::RS256,
        KeyAlgorithm::RS384 => Algorithm::RS384,
        KeyAlgorithm::RS512 => Algorithm::RS512,
        KeyAlgorithm::PS256 => Algorithm::PS256,
        KeyAlgorithm::PS384 => Algorithm::PS384,
        KeyAlgorithm::PS512 => Algorithm::PS512,
        KeyAlgorithm::ES256 => Algorithm::ES256,
        KeyAlgorithm::ES384 => Algorithm::ES384,
        KeyAlgorithm::EdDSA => Algorithm::EdDSA,
        _ => return None,
    })
}
