//! A JWT issuer for the tests: keys made here (RSA by the `openssl` command, EC P-256 by ring),
//! its JWKS document served by a real HTTP server that counts fetches and can be taken down,
//! and tokens signed with them.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use base64::Engine as _;
use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
use ring::rand::SystemRandom;
use ring::signature::{EcdsaKeyPair, KeyPair, ECDSA_P256_SHA256_FIXED_SIGNING};
use serde_json::{json, Value};

use super::{Reply, TempDir, Upstream};

/// A signing key and its public JWK.
pub struct SigningKey {
    pub kid: String,
    pub alg: Algorithm,
    pub encoding: EncodingKey,
    pub jwk: Value,
    /// The public key in PEM (RSA), for the "HS256 keyed with the public key" forgery.
    pub public_pem: Vec<u8>,
}

impl SigningKey {
    /// A 2048-bit RSA key, made by `openssl genpkey`.
    pub fn rsa(kid: &str) -> SigningKey {
        let dir = TempDir::new("rsa");
        let key = dir.path.join("key.pem");
        let run = |args: &[&str]| {
            let out = std::process::Command::new("openssl")
                .args(args)
                .output()
                .unwrap_or_else(|e| panic!("the JWT tests need the openssl command (Debian: apt-get install openssl): {e}"));
            assert!(
                out.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            out.stdout
        };
        let path = key.to_str().unwrap();
        run(&[
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:2048",
            "-out",
            path,
        ]);
        let modulus = String::from_utf8(run(&["rsa", "-in", path, "-noout", "-modulus"])).unwrap();
        let hex = modulus.trim().trim_start_matches("Modulus=");
        let n: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        let public_pem = run(&["pkey", "-in", path, "-pubout"]);
        let pem = std::fs::read(&key).unwrap();
        SigningKey {
            kid: kid.into(),
            alg: Algorithm::RS256,
            encoding: EncodingKey::from_rsa_pem(&pem).unwrap(),
            jwk: json!({"kty": "RSA", "kid": kid, "use": "sig", "alg": "RS256", "n": B64.encode(n), "e": "AQAB"}),
            public_pem,
        }
    }

    /// An EC P-256 key (ES256).
    pub fn ec(kid: &str) -> SigningKey {
        let rng = SystemRandom::new();
        let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng).unwrap();
        let pair = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8.as_ref(), &rng)
            .unwrap();
        let point = pair.public_key().as_ref();
        SigningKey {
            kid: kid.into(),
            alg: Algorithm::ES256,
            encoding: EncodingKey::from_ec_der(pkcs8.as_ref()),
            jwk: json!({"kty": "EC", "crv": "P-256", "kid": kid, "x": B64.encode(&point[1..33]), "y": B64.encode(&point[33..])}),
            public_pem: Vec::new(),
        }
    }

    /// A token with these claims, signed by this key under its `kid`.
    pub fn sign(&self, claims: &Value) -> String {
        let mut header = Header::new(self.alg);
        header.kid = Some(self.kid.clone());
        encode(&header, claims, &self.encoding).unwrap()
    }
}

/// An issuer's JWKS endpoint on a real HTTP server.
pub struct Jwks {
    pub url: String,
    document: Arc<Mutex<Value>>,
    down: Arc<AtomicBool>,
    fetches: Arc<AtomicUsize>,
    _server: Upstream,
}

impl Jwks {
    /// Serves the public keys of `keys` at `/.well-known/jwks.json`.
    pub async fn serve(keys: &[&SigningKey]) -> Jwks {
        let document = Arc::new(Mutex::new(Value::Null));
        let down = Arc::new(AtomicBool::new(false));
        let fetches = Arc::new(AtomicUsize::new(0));
        let (d, dn, f) = (
            Arc::clone(&document),
            Arc::clone(&down),
            Arc::clone(&fetches),
        );
        let server = Upstream::start(move |_, _| {
            f.fetch_add(1, Ordering::SeqCst);
            if dn.load(Ordering::SeqCst) {
                return Reply::json(503, "{}");
            }
            Reply::json(200, &d.lock().unwrap().to_string())
        })
        .await;
        let jwks = Jwks {
            url: format!("{}/.well-known/jwks.json", server.url()),
            document,
            down,
            fetches,
            _server: server,
        };
        jwks.publish(keys);
        jwks
    }

    /// Replaces the published keys (a rotation).
    pub fn publish(&self, keys: &[&SigningKey]) {
        let keys: Vec<Value> = keys.iter().map(|k| k.jwk.clone()).collect();
        *self.document.lock().unwrap() = json!({ "keys": keys });
    }

    /// Every fetch from now on answers 503.
    pub fn take_down(&self) {
        self.down.store(true, Ordering::SeqCst);
    }

    pub fn fetches(&self) -> usize {
        self.fetches.load(Ordering::SeqCst)
    }
}

/// Seconds since the epoch.
pub fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// An unsigned token (`alg: none`) with these claims and `kid`.
pub fn unsigned(kid: &str, claims: &Value) -> String {
    let header = json!({"alg": "none", "typ": "JWT", "kid": kid});
    format!(
        "{}.{}.",
        B64.encode(header.to_string()),
        B64.encode(claims.to_string())
    )
}

/// An HS256 token keyed with `secret` (an RSA public key's PEM, for the confusion forgery).
pub fn hs256(kid: &str, secret: &[u8], claims: &Value) -> String {
    let mut header = Header::new(Algorithm::HS256);
    header.kid = Some(kid.into());
    encode(&header, claims, &EncodingKey::from_secret(secret)).unwrap()
}
