//! Delivery signatures: a webhook sender's HMAC over the exact bytes received, checked before a
//! delivery can claim its key (phase `verify` of [`crate::gateway`]).
//!
//! Anyone can POST to a webhook URL, and a delivery's key (its message id, or a business id) is
//! often public or guessable: unverified, a forged delivery would claim the key and its answer
//! would be replayed to the genuine one. Each scheme follows its sender's published spec; every
//! comparison is the `hmac` crate's constant-time `verify_slice`; timestamped schemes refuse a
//! delivery whose timestamp is further from now than the route's tolerance, so a delivery
//! captured once cannot be replayed after its record expired. Several secrets may be configured
//! (rotation): a delivery signed with any of them passes.

use base64::Engine as _;
use hmac::{Hmac, Mac};
use http::HeaderMap;
use sha2::Sha256;

use crate::config::{Secret, SignatureConfig, SignatureScheme};

type HmacSha256 = Hmac<Sha256>;

/// Signatures looked at per delivery: senders send one or two (old and new secret); more is
/// only work for an attacker to hand us.
const MAX_CANDIDATES: usize = 8;

/// Why a delivery was not verified (the `result` label of `idemgate_signatures_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    /// A header the scheme needs is absent, or not in the scheme's format.
    Missing,
    /// The signed timestamp is further from now than the tolerance.
    Stale,
    /// No signature matches any configured secret.
    Invalid,
}

impl Rejection {
    pub fn as_str(self) -> &'static str {
        match self {
            Rejection::Missing => "missing",
            Rejection::Stale => "stale",
            Rejection::Invalid => "invalid",
        }
    }
}

/// Checks a delivery: `Ok` if one of its signatures was made with one of the route's secrets
/// over exactly these bytes (and, for timestamped schemes, within the tolerance of `now_s`,
/// seconds since the Unix epoch).
pub fn verify(
    config: &SignatureConfig,
    headers: &HeaderMap,
    body: &[u8],
    now_s: i64,
) -> Result<(), Rejection> {
    let fresh = |ts: &str| fresh(ts, config.tolerance, now_s);
    match &config.scheme {
        SignatureScheme::StandardWebhooks => standard_webhooks(config, headers, body, now_s),
        SignatureScheme::Github => {
            let sig = header(headers, "x-hub-signature-256").ok_or(Rejection::Missing)?;
            let hex_sig = sig.strip_prefix("sha256=").ok_or(Rejection::Missing)?;
            let candidate = hex::decode(hex_sig).map_err(|_| Rejection::Missing)?;
            matches(&config.secrets, &[body], &[candidate])
        }
        SignatureScheme::Stripe => stripe(config, headers, body, now_s),
        SignatureScheme::Shopify => {
            let sig = header(headers, "x-shopify-hmac-sha256").ok_or(Rejection::Missing)?;
            let candidate = base64::engine::general_purpose::STANDARD
                .decode(sig.trim())
                .map_err(|_| Rejection::Missing)?;
            matches(&config.secrets, &[body], &[candidate])
        }
        SignatureScheme::Slack => {
            let ts = header(headers, "x-slack-request-timestamp").ok_or(Rejection::Missing)?;
            let sig = header(headers, "x-slack-signature").ok_or(Rejection::Missing)?;
            let hex_sig = sig.strip_prefix("v0=").ok_or(Rejection::Missing)?;
            let candidate = hex::decode(hex_sig).map_err(|_| Rejection::Missing)?;
            fresh(ts)?;
            matches(
                &config.secrets,
                &[b"v0:", ts.as_bytes(), b":", body],
                &[candidate],
            )
        }
        SignatureScheme::Hmac {
            header: name,
            base64,
            prefix,
        } => {
            let sig = header(headers, name.as_str()).ok_or(Rejection::Missing)?;
            let encoded = sig
                .trim()
                .strip_prefix(prefix.as_str())
                .ok_or(Rejection::Missing)?;
            let candidate = if *base64 {
                base64::engine::general_purpose::STANDARD
                    .decode(encoded)
                    .map_err(|_| Rejection::Missing)?
            } else {
                hex::decode(encoded).map_err(|_| Rejection::Missing)?
            };
            matches(&config.secrets, &[body], &[candidate])
        }
    }
}

/// A signed timestamp within the tolerance of `now_s`.
fn fresh(ts: &str, tolerance: std::time::Duration, now_s: i64) -> Result<(), Rejection> {
    let ts: i64 = ts.trim().parse().map_err(|_| Rejection::Missing)?;
    let tolerance = i64::try_from(tolerance.as_secs()).unwrap_or(i64::MAX);
    if now_s.abs_diff(ts) > tolerance.unsigned_abs() {
        return Err(Rejection::Stale);
    }
    Ok(())
}

/// Standard Webhooks: `webhook-id`, `webhook-timestamp` and `webhook-signature` (or their
/// `svix-` names), the id and timestamp signed with the body.
fn standard_webhooks(
    config: &SignatureConfig,
    headers: &HeaderMap,
    body: &[u8],
    now_s: i64,
) -> Result<(), Rejection> {
    // One family of headers, whole: mixing them would let a captured delivery's signature vouch
    // for another id (the key).
    let has = |prefix: &str| headers.keys().any(|k| k.as_str().starts_with(prefix));
    let family = match (has("webhook-"), has("svix-")) {
        (true, false) => "webhook",
        (false, true) => "svix",
        _ => return Err(Rejection::Missing),
    };
    let get = |name: &str| header(headers, &format!("{family}-{name}")).ok_or(Rejection::Missing);
    let (id, ts, sigs) = (get("id")?, get("timestamp")?, get("signature")?);
    // "v1,<base64>" entries separated by spaces (asymmetric "v1a" ones are not ours).
    let candidates: Vec<Vec<u8>> = sigs
        .split(' ')
        .filter_map(|s| s.strip_prefix("v1,"))
        .filter_map(|b64| base64::engine::general_purpose::STANDARD.decode(b64).ok())
        .take(MAX_CANDIDATES)
        .collect();
    if candidates.is_empty() {
        return Err(Rejection::Missing);
    }
    fresh(ts, config.tolerance, now_s)?;
    matches(
        &config.secrets,
        &[id.as_bytes(), b".", ts.as_bytes(), b".", body],
        &candidates,
    )
}

/// Stripe: `Stripe-Signature: t=<timestamp>,v1=<hex>[,v1=<hex>...]` over the timestamp and body.
fn stripe(
    config: &SignatureConfig,
    headers: &HeaderMap,
    body: &[u8],
    now_s: i64,
) -> Result<(), Rejection> {
    let sig = header(headers, "stripe-signature").ok_or(Rejection::Missing)?;
    let mut ts = None;
    let mut candidates = Vec::new();
    for item in sig.split(',') {
        match item.trim().split_once('=') {
            Some(("t", t)) => ts = Some(t),
            Some(("v1", v)) if candidates.len() < MAX_CANDIDATES => {
                if let Ok(c) = hex::decode(v) {
                    candidates.push(c);
                }
            }
            _ => {}
        }
    }
    let ts = ts.ok_or(Rejection::Missing)?;
    if candidates.is_empty() {
        return Err(Rejection::Missing);
    }
    fresh(ts, config.tolerance, now_s)?;
    matches(&config.secrets, &[ts.as_bytes(), b".", body], &candidates)
}

/// The one value of a header, as text; `None` if absent, repeated or not visible ASCII.
fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    let mut values = headers.get_all(name).iter();
    let first = values.next()?;
    if values.next().is_some() {
        return None;
    }
    first.to_str().ok()
}

/// Whether any candidate is the HMAC of `parts` (concatenated) under any secret. The message is
/// hashed once per secret; each candidate is compared in constant time.
fn matches(secrets: &[Secret], parts: &[&[u8]], candidates: &[Vec<u8>]) -> Result<(), Rejection> {
    for secret in secrets {
        let Ok(mut mac) = HmacSha256::new_from_slice(secret.key()) else {
            continue;
        };
        for part in parts {
            mac.update(part);
        }
        if candidates
            .iter()
            .any(|c| mac.clone().verify_slice(c).is_ok())
        {
            return Ok(());
        }
    }
    Err(Rejection::Invalid)
}

/// What a sender puts in its headers (for the tests below and `crate::fuzzing`): the signature headers of `scheme`
/// for `body`, signed with `secret` at `ts` (seconds since the epoch) and, for Standard
/// Webhooks, with message id `id`.
pub(crate) fn sign(
    scheme: &SignatureScheme,
    secret: &Secret,
    id: &str,
    ts: i64,
    body: &[u8],
) -> Vec<(String, String)> {
    let mac = |parts: &[&[u8]]| -> Vec<u8> {
        let mut m = match HmacSha256::new_from_slice(secret.key()) {
            Ok(m) => m,
            Err(_) => return Vec::new(),
        };
        for p in parts {
            m.update(p);
        }
        m.finalize().into_bytes().to_vec()
    };
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    let ts_s = ts.to_string();
    match scheme {
        SignatureScheme::StandardWebhooks => vec![
            ("webhook-id".into(), id.into()),
            ("webhook-timestamp".into(), ts_s.clone()),
            (
                "webhook-signature".into(),
                format!(
                    "v1,{}",
                    b64(&mac(&[id.as_bytes(), b".", ts_s.as_bytes(), b".", body]))
                ),
            ),
        ],
        SignatureScheme::Github => vec![(
            "x-hub-signature-256".into(),
            format!("sha256={}", hex::encode(mac(&[body]))),
        )],
        SignatureScheme::Stripe => vec![(
            "stripe-signature".into(),
            format!(
                "t={ts_s},v1={}",
                hex::encode(mac(&[ts_s.as_bytes(), b".", body]))
            ),
        )],
        SignatureScheme::Shopify => vec![("x-shopify-hmac-sha256".into(), b64(&mac(&[body])))],
        SignatureScheme::Slack => vec![
            ("x-slack-request-timestamp".into(), ts_s.clone()),
            (
                "x-slack-signature".into(),
                format!(
                    "v0={}",
                    hex::encode(mac(&[b"v0:", ts_s.as_bytes(), b":", body]))
                ),
            ),
        ],
        SignatureScheme::Hmac {
            header,
            base64,
            prefix,
        } => {
            let m = mac(&[body]);
            let encoded = if *base64 { b64(&m) } else { hex::encode(m) };
            vec![(header.as_str().into(), format!("{prefix}{encoded}"))]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use std::time::Duration;

    fn config(scheme: SignatureScheme, secrets: &[&[u8]]) -> SignatureConfig {
        SignatureConfig {
            scheme,
            secrets: secrets.iter().map(|s| Secret::new(s.to_vec())).collect(),
            tolerance: Duration::from_secs(300),
        }
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    /// The Standard Webhooks spec's example (and Svix's docs'): secret, id, timestamp, body
    /// and the signature they publish.
    #[test]
    fn standard_webhooks_published_example() {
        let key = base64::engine::general_purpose::STANDARD
            .decode("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
            .unwrap();
        let c = config(SignatureScheme::StandardWebhooks, &[&key]);
        let h = headers(&[
            ("webhook-id", "msg_p5jXN8AQM9LWM0D4loKWxJek"),
            ("webhook-timestamp", "1614265330"),
            (
                "webhook-signature",
                "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=",
            ),
        ]);
        let body = br#"{"test": 2432232314}"#;
        assert_eq!(verify(&c, &h, body, 1614265330), Ok(()));
        assert_eq!(
            verify(&c, &h, br#"{"test": 2432232315}"#, 1614265330),
            Err(Rejection::Invalid)
        );
        assert_eq!(
            verify(&c, &h, body, 1614265330 + 301),
            Err(Rejection::Stale)
        );
        assert_eq!(
            verify(&c, &h, body, 1614265330 - 301),
            Err(Rejection::Stale)
        );
    }

    /// GitHub's docs' example: secret "It's a Secret to Everybody", payload "Hello, World!".
    #[test]
    fn github_published_example() {
        let c = config(SignatureScheme::Github, &[b"It's a Secret to Everybody"]);
        let h = headers(&[(
            "x-hub-signature-256",
            "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17",
        )]);
        assert_eq!(verify(&c, &h, b"Hello, World!", 0), Ok(()));
        assert_eq!(verify(&c, &h, b"Hello, World?", 0), Err(Rejection::Invalid));
    }

    /// Slack's docs' example request.
    #[test]
    fn slack_published_example() {
        let c = config(
            SignatureScheme::Slack,
            &[b"8f742231b10e8888abcd99yyyzzz85a5"],
        );
        let body = b"token=xyzz0WbapA4vBCDEFasx0q6G&team_id=T1DC2JH3J&team_domain=testteamnow&channel_id=G8PSS9T3V&channel_name=foobar&user_id=U2CERLKJA&user_name=roadrunner&command=%2Fwebhook-collect&text=&response_url=https%3A%2F%2Fhooks.slack.com%2Fcommands%2FT1DC2JH3J%2F397700885554%2F96rGlfmibIGlgcZRskXaIFfN&trigger_id=398738663015.47445629121.803a0bc887a14d10d2c447fce8b6703c";
        let h = headers(&[
            ("x-slack-request-timestamp", "1531420618"),
            (
                "x-slack-signature",
                "v0=a2114d57b48eac39b9ad189dd8316235a7b4a8d21a10bd27519666489c69b503",
            ),
        ]);
        assert_eq!(verify(&c, &h, body, 1531420618), Ok(()));
        assert_eq!(
            verify(&c, &h, body, 1531420618 + 3600),
            Err(Rejection::Stale)
        );
    }

    #[test]
    fn every_scheme_verifies_what_it_signs_and_nothing_else() {
        let schemes = [
            SignatureScheme::StandardWebhooks,
            SignatureScheme::Github,
            SignatureScheme::Stripe,
            SignatureScheme::Shopify,
            SignatureScheme::Slack,
            SignatureScheme::Hmac {
                header: http::HeaderName::from_static("x-signature"),
                base64: false,
                prefix: "sha256=".into(),
            },
            SignatureScheme::Hmac {
                header: http::HeaderName::from_static("x-signature"),
                base64: true,
                prefix: String::new(),
            },
        ];
        let now = 1_700_000_000;
        for scheme in schemes {
            let name = scheme.name();
            let old = Secret::new(b"old-secret".to_vec());
            let new = Secret::new(b"new-secret".to_vec());
            let c = SignatureConfig {
                scheme: scheme.clone(),
                secrets: vec![new.clone(), old.clone()],
                tolerance: Duration::from_secs(300),
            };
            let signed = |secret: &Secret, body: &[u8]| {
                let pairs = sign(&scheme, secret, "msg_1", now, body);
                let mut h = HeaderMap::new();
                for (k, v) in pairs {
                    h.insert(
                        http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                        HeaderValue::from_str(&v).unwrap(),
                    );
                }
                h
            };
            assert_eq!(
                verify(&c, &signed(&new, b"{}"), b"{}", now),
                Ok(()),
                "{name}"
            );
            // Rotation: the old secret still passes while it is configured.
            assert_eq!(
                verify(&c, &signed(&old, b"{}"), b"{}", now),
                Ok(()),
                "{name}"
            );
            let wrong = Secret::new(b"wrong".to_vec());
            assert_eq!(
                verify(&c, &signed(&wrong, b"{}"), b"{}", now),
                Err(Rejection::Invalid),
                "{name}"
            );
            assert_eq!(
                verify(&c, &signed(&new, b"{}"), b"{ }", now),
                Err(Rejection::Invalid),
                "{name}: a tampered body"
            );
            assert_eq!(
                verify(&c, &HeaderMap::new(), b"{}", now),
                Err(Rejection::Missing),
                "{name}"
            );
            if scheme.is_timestamped() {
                assert_eq!(
                    verify(&c, &signed(&new, b"{}"), b"{}", now + 600),
                    Err(Rejection::Stale),
                    "{name}"
                );
            }
        }
    }

    #[test]
    fn stripe_takes_any_of_several_v1_signatures_and_needs_t() {
        let c = config(SignatureScheme::Stripe, &[b"whsec_test"]);
        let good = sign(&c.scheme, &c.secrets[0], "", 1000, b"{}");
        let v1 = good[0].1.split_once("v1=").unwrap().1.to_string();
        let both = headers(&[(
            "stripe-signature",
            &format!("t=1000,v1={},v1={v1},v0=abc", "00".repeat(32)),
        )]);
        assert_eq!(verify(&c, &both, b"{}", 1000), Ok(()));
        let no_t = headers(&[("stripe-signature", &format!("v1={v1}"))]);
        assert_eq!(verify(&c, &no_t, b"{}", 1000), Err(Rejection::Missing));
    }

    #[test]
    fn standard_webhooks_takes_svix_names_but_never_a_mix() {
        let key = b"0123456789abcdef0123456789abcdef";
        let c = config(SignatureScheme::StandardWebhooks, &[key]);
        let signed = sign(&c.scheme, &c.secrets[0], "msg_1", 1000, b"{}");
        let svix: Vec<(String, String)> = signed
            .iter()
            .map(|(k, v)| (k.replace("webhook-", "svix-"), v.clone()))
            .collect();
        let as_map = |pairs: &[(String, String)]| {
            let refs: Vec<(&str, &str)> = pairs
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            headers(&refs)
        };
        assert_eq!(verify(&c, &as_map(&svix), b"{}", 1000), Ok(()));
        // A captured svix delivery with a webhook-id naming another key: refused.
        let mut mixed = svix.clone();
        mixed.push(("webhook-id".into(), "msg_other".into()));
        assert_eq!(
            verify(&c, &as_map(&mixed), b"{}", 1000),
            Err(Rejection::Missing)
        );
    }

    #[test]
    fn a_repeated_signature_header_is_refused() {
        let c = config(SignatureScheme::Github, &[b"s"]);
        let sig = sign(&c.scheme, &c.secrets[0], "", 0, b"{}")[0].1.clone();
        let h = headers(&[("x-hub-signature-256", &sig), ("x-hub-signature-256", &sig)]);
        assert_eq!(verify(&c, &h, b"{}", 0), Err(Rejection::Missing));
    }
}
