//! Tokens checked against key sets made here: HMAC, EC P-256 and Ed25519 (the RSA cases run
//! through the binary, tests/e2e/client_jwt.rs).

use std::time::Duration;

use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use base64::Engine as _;
use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
use ring::rand::SystemRandom;
use ring::signature::{EcdsaKeyPair, Ed25519KeyPair, KeyPair, ECDSA_P256_SHA256_FIXED_SIGNING};
use serde_json::json;

use super::keys::KeySet;
use super::verify::{verify, Unverified};
use crate::config::client::{ClientJwt, JwtKeys};
use crate::config::Secret;
use crate::key::ClientScope;

const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";
const NOW_S: u64 = 1_800_000_000;

fn config(audience: Option<&str>, claims: &[&str]) -> ClientJwt {
    ClientJwt {
        keys: JwtKeys::Hmac(Secret::new(SECRET.to_vec())),
        issuers: vec!["https://auth/".into(), "https://other/".into()],
        audience: audience.map(str::to_string),
        claims: claims.iter().map(|c| c.to_string()).collect(),
        header: http::header::AUTHORIZATION,
        leeway: Duration::from_secs(60),
        refresh: Duration::from_secs(600),
    }
}

fn hs256(claims: serde_json::Value) -> String {
    encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(SECRET),
    )
    .unwrap()
}

fn check(token: &str, set: &KeySet, config: &ClientJwt) -> Result<ClientScope, Unverified> {
    verify(token, set, config, NOW_S * 1000).map(|v| v.scope)
}

#[test]
fn a_refreshed_token_of_the_same_subject_is_the_same_scope() {
    let (set, cfg) = (KeySet::hmac(SECRET), config(None, &["sub"]));
    let first = hs256(
        json!({"iss": "https://auth/", "sub": "alice", "iat": NOW_S - 3000, "exp": NOW_S + 10}),
    );
    let refreshed = hs256(
        json!({"iss": "https://auth/", "sub": "alice", "iat": NOW_S, "exp": NOW_S + 3600, "jti": "x"}),
    );
    let scope = check(&first, &set, &cfg).unwrap();
    assert_eq!(check(&refreshed, &set, &cfg).unwrap(), scope);
    assert_eq!(scope, ClientScope::of_jwt("https://auth/", [&b"alice"[..]]));
    let bob = hs256(json!({"iss": "https://auth/", "sub": "bob", "exp": NOW_S + 10}));
    assert_ne!(check(&bob, &set, &cfg).unwrap(), scope);
    let other_issuer = hs256(json!({"iss": "https://other/", "sub": "alice", "exp": NOW_S + 10}));
    assert_ne!(check(&other_issuer, &set, &cfg).unwrap(), scope);
}

#[test]
fn time_issuer_audience_and_claims_are_checked() {
    let set = KeySet::hmac(SECRET);
    let cfg = config(Some("payments"), &["sub", "tenant"]);
    let ok = json!({"iss": "https://auth/", "sub": "a", "tenant": 7, "aud": ["x", "payments"], "exp": NOW_S + 1});
    assert!(check(&hs256(ok.clone()), &set, &cfg).is_ok());
    let with = |k: &str, v: serde_json::Value| {
        let mut c = ok.clone();
        c[k] = v;
        check(&hs256(c), &set, &cfg)
    };
    assert_eq!(with("exp", json!(NOW_S - 61)), Err(Unverified::Expired));
    assert!(with("exp", json!(NOW_S - 59)).is_ok(), "within the leeway");
    assert_eq!(with("exp", json!("soon")), Err(Unverified::Expired));
    assert_eq!(
        with("nbf", json!(NOW_S + 120)),
        Err(Unverified::NotYetValid)
    );
    assert!(with("nbf", json!(NOW_S + 30)).is_ok());
    assert_eq!(with("iss", json!("https://evil/")), Err(Unverified::Issuer));
    assert_eq!(with("aud", json!("other")), Err(Unverified::Audience));
    assert_eq!(with("tenant", json!(null)), Err(Unverified::ClaimMissing));
    let mut no_exp = ok.clone();
    no_exp.as_object_mut().unwrap().remove("exp");
    assert_eq!(
        check(&hs256(no_exp), &set, &cfg),
        Err(Unverified::Expired),
        "exp is required"
    );
}

#[test]
fn forgeries_are_refused() {
    let (set, cfg) = (KeySet::hmac(SECRET), config(None, &["sub"]));
    let claims = json!({"iss": "https://auth/", "sub": "a", "exp": NOW_S + 10});
    let other = encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(&[7; 32]),
    )
    .unwrap();
    assert_eq!(check(&other, &set, &cfg), Err(Unverified::Signature));
    let payload = B64.encode(claims.to_string());
    let none = format!("{}.{payload}.", B64.encode(r#"{"alg":"none","typ":"JWT"}"#));
    assert_eq!(check(&none, &set, &cfg), Err(Unverified::Malformed));
    assert_eq!(check("not.a.token", &set, &cfg), Err(Unverified::Malformed));
    assert_eq!(check("", &set, &cfg), Err(Unverified::Malformed));
}

/// A JWKS with an EC P-256 key `ec`, an Ed25519 key `ed`, and keys that must be skipped.
fn jwks() -> (KeySet, EncodingKey, EncodingKey, Vec<u8>) {
    let rng = SystemRandom::new();
    let ec8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng).unwrap();
    let ec =
        EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, ec8.as_ref(), &rng).unwrap();
    let point = ec.public_key().as_ref().to_vec();
    let ed8 = Ed25519KeyPair::generate_pkcs8(&rng).unwrap();
    let ed = Ed25519KeyPair::from_pkcs8(ed8.as_ref()).unwrap();
    let document = json!({"keys": [
        {"kty": "EC", "crv": "P-256", "kid": "ec", "x": B64.encode(&point[1..33]), "y": B64.encode(&point[33..])},
        {"kty": "OKP", "crv": "Ed25519", "kid": "ed", "x": B64.encode(ed.public_key().as_ref())},
        {"kty": "oct", "kid": "sym", "k": B64.encode(SECRET)},
        {"kty": "EC", "crv": "P-256", "kid": "enc", "use": "enc", "x": B64.encode(&point[1..33]), "y": B64.encode(&point[33..])},
        {"kty": "AKP", "kid": "future"}
    ]});
    let set = KeySet::parse(document.to_string().as_bytes()).unwrap();
    (
        set,
        EncodingKey::from_ec_der(ec8.as_ref()),
        EncodingKey::from_ed_der(ed8.as_ref()),
        point,
    )
}

#[test]
fn each_key_verifies_only_its_own_algorithm() {
    let (set, ec, ed, point) = jwks();
    assert_eq!(
        set.len(),
        2,
        "the symmetric, encryption and unknown keys are skipped"
    );
    let cfg = config(None, &["sub"]);
    let claims = json!({"iss": "https://auth/", "sub": "a", "exp": NOW_S + 10});
    let signed = |alg: Algorithm, kid: &str, key: &EncodingKey| {
        let mut h = Header::new(alg);
        h.kid = Some(kid.into());
        encode(&h, &claims, key).unwrap()
    };
    let scope = check(&signed(Algorithm::ES256, "ec", &ec), &set, &cfg).unwrap();
    assert_eq!(
        check(&signed(Algorithm::EdDSA, "ed", &ed), &set, &cfg),
        Ok(scope)
    );
    // The EC key's kid on an Ed25519 signature, and the other way round.
    assert_eq!(
        check(&signed(Algorithm::EdDSA, "ec", &ed), &set, &cfg),
        Err(Unverified::Algorithm)
    );
    assert_eq!(
        check(&signed(Algorithm::ES256, "ed", &ec), &set, &cfg),
        Err(Unverified::Algorithm)
    );
    // HS256 keyed with the EC public key: an HMAC is never checked with a public key.
    let confused = signed(Algorithm::HS256, "ec", &EncodingKey::from_secret(&point));
    assert_eq!(check(&confused, &set, &cfg), Err(Unverified::Algorithm));
    assert_eq!(
        check(&signed(Algorithm::ES256, "k9", &ec), &set, &cfg),
        Err(Unverified::UnknownKey)
    );
    let mut no_kid = Header::new(Algorithm::ES256);
    no_kid.kid = None;
    let token = encode(&no_kid, &claims, &ec).unwrap();
    assert_eq!(
        check(&token, &set, &cfg),
        Err(Unverified::UnknownKey),
        "two keys: a kid is needed"
    );
}

#[test]
fn a_document_without_a_usable_key_is_refused() {
    assert!(KeySet::parse(b"{\"keys\": []}").is_err());
    assert!(KeySet::parse(b"{\"keys\": [{\"kty\": \"oct\", \"k\": \"AAAA\"}]}").is_err());
    assert!(KeySet::parse(b"[]").is_err());
    assert!(KeySet::parse(&vec![b' '; 300 << 10]).is_err());
}
