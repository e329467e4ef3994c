//! A route's `signature`: the scheme, and its secrets read now from the environment or files
//! (errors name the variable or file, never what is in it).

use std::time::Duration;

use super::{parse_header_name, shown};
use crate::config::raw::{Encoding, OneOrMany, RawSignature, Scheme};
use crate::config::{ConfigError, Secret, SignatureConfig, SignatureScheme};

/// At most this many secrets per route: each one is an HMAC over the whole body per delivery.
const MAX_SECRETS: usize = 8;

pub(super) fn validate_signature(
    field: &str,
    raw: RawSignature,
) -> Result<SignatureConfig, ConfigError> {
    let f = |name: &str| format!("{field}.{name}");
    let scheme = scheme(&f, &raw)?;
    let tolerance = tolerance(&f, raw.tolerance, &scheme)?;
    let found = read_secrets(&f, raw.secret_env, raw.secret_file)?;
    if found.is_empty() {
        return Err(ConfigError::Missing {
            field: format!("{field}.secret_env (or secret_file)"),
        });
    }
    if found.len() > MAX_SECRETS {
        return Err(ConfigError::invalid(
            f("secret_env (and secret_file)"),
            format!("{} secrets", found.len()),
            format!("at most {MAX_SECRETS} secrets (the current one and those being rotated out)"),
        ));
    }
    let secrets = found
        .into_iter()
        .map(|(source, value)| signing_key(&scheme, &source, value).map(Secret::new))
        .collect::<Result<_, _>>()?;
    Ok(SignatureConfig {
        scheme,
        secrets,
        tolerance,
    })
}

fn scheme(f: &dyn Fn(&str) -> String, raw: &RawSignature) -> Result<SignatureScheme, ConfigError> {
    let named = match raw.scheme {
        None => return Err(ConfigError::Missing { field: f("scheme") }),
        Some(Scheme::HmacSha256) => return hmac(f, raw),
        Some(Scheme::StandardWebhooks) => SignatureScheme::StandardWebhooks,
        Some(Scheme::Github) => SignatureScheme::Github,
        Some(Scheme::Stripe) => SignatureScheme::Stripe,
        Some(Scheme::Shopify) => SignatureScheme::Shopify,
        Some(Scheme::Slack) => SignatureScheme::Slack,
    };
    for (key, set) in [
        ("header", raw.header.is_some()),
        ("encoding", raw.encoding.is_some()),
        ("prefix", raw.prefix.is_some()),
    ] {
        if set {
            return Err(ConfigError::invalid(
                f(key),
                "(set)",
                "only with scheme = \"hmac-sha256\"; the other schemes name their own header",
            ));
        }
    }
    Ok(named)
}

/// `hmac-sha256`: the only scheme whose header and encoding the config names.
fn hmac(f: &dyn Fn(&str) -> String, raw: &RawSignature) -> Result<SignatureScheme, ConfigError> {
    let header = raw
        .header
        .as_deref()
        .ok_or_else(|| ConfigError::Missing { field: f("header") })?;
    Ok(SignatureScheme::Hmac {
        header: parse_header_name(&f("header"), header)?,
        base64: raw.encoding == Some(Encoding::Base64),
        prefix: raw.prefix.clone().unwrap_or_default(),
    })
}

/// How far a delivery's timestamp may be from now, for the schemes that sign one.
fn tolerance(
    f: &dyn Fn(&str) -> String,
    raw: Option<Duration>,
    scheme: &SignatureScheme,
) -> Result<Duration, ConfigError> {
    match raw {
        None => Ok(Duration::from_secs(300)),
        Some(_) if !scheme.is_timestamped() => Err(ConfigError::invalid(
            f("tolerance"),
            "(set)",
            format!(
                "only for the schemes whose deliveries carry a timestamp (standard-webhooks, stripe, slack); {} has none",
                scheme.name()
            ),
        )),
        Some(d) => {
            if d < Duration::from_secs(1) || d > Duration::from_secs(3600) {
                return Err(ConfigError::invalid(
                    f("tolerance"),
                    shown(d),
                    "from \"1s\" to \"1h\" (the senders' libraries use 5 minutes)",
                ));
            }
            Ok(d)
        }
    }
}

/// Each secret's value, trimmed, with where it came from ("field NAME" or "field PATH").
fn read_secrets(
    f: &dyn Fn(&str) -> String,
    env: Option<OneOrMany>,
    files: Option<OneOrMany>,
) -> Result<Vec<(String, String)>, ConfigError> {
    let mut found = Vec::new();
    for name in env.map(OneOrMany::into_vec).unwrap_or_default() {
        let field = f("secret_env");
        // Only a name is echoed: a secret pasted here by mistake is not.
        let is_name = !name.is_empty()
            && !name.starts_with(|c: char| c.is_ascii_digit())
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !is_name {
            return Err(ConfigError::invalid(
                &field,
                "(not shown: not a variable name)",
                "the name of an environment variable, such as \"STRIPE_WEBHOOK_SECRET\", not the secret itself",
            ));
        }
        let value = std::env::var(&name).map_err(|_| {
            ConfigError::invalid(
                &field,
                crate::config::shown_name(&name),
                "the name of an environment variable that is set (it holds the signing secret)",
            )
        })?;
        found.push((format!("{field} {name}"), value.trim().to_string()));
    }
    for path in files.map(OneOrMany::into_vec).unwrap_or_default() {
        let field = f("secret_file");
        let text = std::fs::read_to_string(&path).map_err(|e| {
            ConfigError::invalid(
                &field,
                crate::config::shown_name(&path),
                format!("a readable file holding the signing secret ({})", e.kind()),
            )
        })?;
        found.push((format!("{field} {path}"), text.trim().to_string()));
    }
    Ok(found)
}

/// The key a secret's text stands for under `scheme`; errors say where it came from, never
/// what it is.
fn signing_key(
    scheme: &SignatureScheme,
    source: &str,
    value: String,
) -> Result<Vec<u8>, ConfigError> {
    let bad = |why: &str| ConfigError::invalid(source, "(its content)", why);
    if value.is_empty() {
        return Err(bad("a signing secret, not empty"));
    }
    if *scheme != SignatureScheme::StandardWebhooks {
        return Ok(value.into_bytes());
    }
    // The key is the base64 after "whsec_" (the spec's format), not the text.
    use base64::Engine as _;
    let wrong = || bad("a Standard Webhooks secret: \"whsec_\" and the base64 of 24 to 64 bytes");
    let b64 = value.strip_prefix("whsec_").ok_or_else(wrong)?;
    let key = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .map_err(|_| wrong())?;
    // An empty key is one anyone can sign with.
    if !(24..=64).contains(&key.len()) {
        return Err(wrong());
    }
    Ok(key)
}
