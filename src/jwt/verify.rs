//! One token checked against the key set: its key by `kid`, the algorithm that key allows, the
//! signature (by jsonwebtoken), then `exp`, `nbf`, `iss` and `aud` here, and the scope's claims.
//! Claims are checked here rather than by jsonwebtoken so that every rule is in one place and
//! holds whatever the number representation (the crate's serde_json has arbitrary precision).

use jsonwebtoken::{decode, decode_header, Validation};
use serde_json::{Map, Value};

use super::keys::KeySet;
use crate::config::client::ClientJwt;
use crate::key::ClientScope;

/// Why a token did not verify (the `reason` of `idemgate_client_unverified_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unverified {
    /// Not three base64url segments of JSON, or an algorithm that is not one (`none`).
    Malformed,
    /// No key with the token's `kid`, even after fetching the key set again.
    UnknownKey,
    /// The token's `alg` is not one its key may verify.
    Algorithm,
    Signature,
    Expired,
    NotYetValid,
    Issuer,
    Audience,
    /// A claim of the scope (`claims`) is missing or null.
    ClaimMissing,
}

impl Unverified {
    pub fn as_str(self) -> &'static str {
        match self {
            Unverified::Malformed => "malformed",
            Unverified::UnknownKey => "unknown_key",
            Unverified::Algorithm => "algorithm",
            Unverified::Signature => "signature",
            Unverified::Expired => "expired",
            Unverified::NotYetValid => "not_yet_valid",
            Unverified::Issuer => "issuer",
            Unverified::Audience => "audience",
            Unverified::ClaimMissing => "claim_missing",
        }
    }
}

/// A verified token's scope and how long it may be remembered.
pub(super) struct Verified {
    pub(super) scope: ClientScope,
    /// Its `exp` plus the leeway, in ms since the epoch.
    pub(super) until_ms: u64,
}

pub(super) fn verify(
    token: &str,
    set: &KeySet,
    config: &ClientJwt,
    now_ms: u64,
) -> Result<Verified, Unverified> {
    let header = decode_header(token).map_err(|_| Unverified::Malformed)?;
    let (key, named) = set
        .find(header.kid.as_deref())
        .ok_or(Unverified::UnknownKey)?;
    if !key.allows(header.alg) {
        return Err(Unverified::Algorithm);
    }
    let mut validation = Validation::new(header.alg);
    validation.validate_exp = false;
    validation.validate_nbf = false;
    validation.validate_aud = false;
    validation.required_spec_claims.clear();
    let claims = decode::<Map<String, Value>>(token, &key.key, &validation)
        .map_err(|e| match e.kind() {
            // The only key, not named by the token: the issuer may have rotated to another.
            jsonwebtoken::errors::ErrorKind::InvalidSignature if !named => Unverified::UnknownKey,
            jsonwebtoken::errors::ErrorKind::InvalidSignature => Unverified::Signature,
            jsonwebtoken::errors::ErrorKind::InvalidAlgorithm => Unverified::Algorithm,
            _ => Unverified::Malformed,
        })?
        .claims;
    let leeway_ms = u64::try_from(config.leeway.as_millis()).unwrap_or(u64::MAX);
    // Required: a token without an end would be a scope forever, and it bounds the cache.
    let exp_ms = seconds_ms(claims.get("exp")).ok_or(Unverified::Expired)?;
    let until_ms = exp_ms.saturating_add(leeway_ms);
    if now_ms >= until_ms {
        return Err(Unverified::Expired);
    }
    if let Some(nbf) = claims.get("nbf") {
        let nbf_ms = seconds_ms(Some(nbf)).ok_or(Unverified::NotYetValid)?;
        if nbf_ms > now_ms.saturating_add(leeway_ms) {
            return Err(Unverified::NotYetValid);
        }
    }
    let issuer = match claims.get("iss") {
        Some(Value::String(iss)) if config.issuers.iter().any(|i| i == iss) => iss.as_str(),
        _ => return Err(Unverified::Issuer),
    };
    if let Some(audience) = &config.audience {
        let named = match claims.get("aud") {
            Some(Value::String(aud)) => aud == audience,
            Some(Value::Array(auds)) => auds.iter().any(|a| a.as_str() == Some(audience)),
            _ => false,
        };
        if !named {
            return Err(Unverified::Audience);
        }
    }
    let mut values: Vec<std::borrow::Cow<'_, [u8]>> = Vec::with_capacity(config.claims.len());
    for name in &config.claims {
        values.push(match claims.get(name) {
            None | Some(Value::Null) => return Err(Unverified::ClaimMissing),
            Some(Value::String(s)) => std::borrow::Cow::Borrowed(s.as_bytes()),
            Some(other) => std::borrow::Cow::Owned(other.to_string().into_bytes()),
        });
    }
    Ok(Verified {
        scope: ClientScope::of_jwt(issuer, values.iter().map(|v| &**v)),
        until_ms,
    })
}

/// A NumericDate (seconds, possibly fractional) in ms; `None` if it is not one.
fn seconds_ms(value: Option<&Value>) -> Option<u64> {
    let seconds = value?.as_f64()?;
    if !seconds.is_finite() || seconds < 0.0 {
        return None;
    }
    // Far future dates saturate (a u64 of ms covers 584 million years).
    Some((seconds * 1000.0).min(u64::MAX as f64) as u64)
}
