//! Entry points for the fuzz targets (`tests/fuzz`, proptest; `fuzz/`, cargo-fuzz) into
//! parsers that are private to the crate: webhook signatures and client JWTs. Not an API: thin
//! wrappers with fixed settings, so a target hands over only what a client controls.

use std::time::Duration;

use http::{HeaderMap, HeaderName};

use crate::config::client::{ClientJwt, JwtKeys};
use crate::config::{Secret, SignatureConfig, SignatureScheme};

/// The secret every fuzzed signature and token is checked with.
pub const SECRET: &[u8] = b"fuzzing-secret-fuzzing-secret-32";

/// Every signature scheme, by number (`n % 7`).
fn scheme(n: u8) -> SignatureScheme {
    match n % 7 {
        0 => SignatureScheme::StandardWebhooks,
        1 => SignatureScheme::Github,
        2 => SignatureScheme::Stripe,
        3 => SignatureScheme::Shopify,
        4 => SignatureScheme::Slack,
        5 => SignatureScheme::Hmac {
            header: HeaderName::from_static("x-signature"),
            base64: true,
            prefix: "sha256=".into(),
        },
        _ => SignatureScheme::Hmac {
            header: HeaderName::from_static("x-signature"),
            base64: false,
            prefix: String::new(),
        },
    }
}

fn signature_config(n: u8) -> SignatureConfig {
    SignatureConfig {
        scheme: scheme(n),
        secrets: vec![Secret::new(SECRET.to_vec())],
        tolerance: Duration::from_secs(300),
    }
}

/// A delivery checked as the gateway checks it under scheme `n`: `Err` names the rejection.
pub fn verify_webhook(
    n: u8,
    headers: &HeaderMap,
    body: &[u8],
    now_s: i64,
) -> Result<(), &'static str> {
    crate::signature::verify(&signature_config(n), headers, body, now_s).map_err(|r| r.as_str())
}

/// The headers a sender using scheme `n` and [`SECRET`] puts on `body` (message id `id`,
/// timestamp `ts`).
pub fn sign_webhook(n: u8, id: &str, ts: i64, body: &[u8]) -> Vec<(String, String)> {
    let config = signature_config(n);
    crate::signature::sign(&config.scheme, &config.secrets[0], id, ts, body)
}

/// A bearer token checked as `client_jwt` checks it, with [`SECRET`] as the HS256 key and
/// `https://issuer.example` as the only issuer: `Ok` holds when the scope may be remembered
/// until (ms since the epoch).
pub fn verify_jwt(token: &str, now_ms: u64) -> Result<u64, &'static str> {
    let config = ClientJwt {
        keys: JwtKeys::Hmac(Secret::new(SECRET.to_vec())),
        issuers: vec!["https://issuer.example".into()],
        audience: None,
        claims: vec!["sub".into()],
        header: http::header::AUTHORIZATION,
        leeway: Duration::from_secs(60),
        refresh: Duration::from_secs(300),
    };
    let set = crate::jwt::KeySet::hmac(SECRET);
    crate::jwt::verify_token(token, &set, &config, now_ms)
}

/// A JWKS document read as the gateway reads one: the number of keys it holds.
pub fn parse_jwks(document: &[u8]) -> Result<usize, String> {
    crate::jwt::KeySet::parse(document).map(|set| set.len())
}
