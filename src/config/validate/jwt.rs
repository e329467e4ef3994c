//! `client_jwt`: where the keys come from, which issuers and audience a token must name, which
//! claims make the scope. Every rejection names the field; a secret is never echoed.

use std::time::Duration;

use http::Uri;

use super::{parse_header_name, shown};
use crate::config::client::{ClientJwt, JwtKeys};
use crate::config::raw::RawClientJwt;
use crate::config::{ConfigError, Secret};

/// Shorter HMAC keys can be brute-forced from one token (RFC 7518 section 3.2: at least the
/// hash's size).
const MIN_HMAC_KEY: usize = 32;
const MAX_LEEWAY: Duration = Duration::from_secs(300);
const MIN_REFRESH: Duration = Duration::from_secs(10);
const MAX_REFRESH: Duration = Duration::from_secs(24 * 3600);

pub(super) fn client_jwt(field: &str, raw: &RawClientJwt) -> Result<ClientJwt, ConfigError> {
    let f = |name: &str| format!("{field}.{name}");
    let keys = keys(&f, raw)?;
    let issuers = raw.issuer.clone().map(|i| i.into_vec()).unwrap_or_default();
    if issuers.is_empty() || issuers.iter().any(String::is_empty) || issuers.len() > 16 {
        return Err(ConfigError::invalid(
            f("issuer"),
            format!("{issuers:?}"),
            "the issuer (\"iss\") a token must name, or a list of 1 to 16 of them",
        ));
    }
    if raw.audience.as_deref() == Some("") {
        return Err(ConfigError::invalid(
            f("audience"),
            "\"\"",
            "the audience (\"aud\") a token must name, or no audience key",
        ));
    }
    let claims = raw
        .claims
        .clone()
        .unwrap_or_else(|| vec!["sub".to_string()]);
    let mut seen = std::collections::HashSet::new();
    let bad_claim = |c: &String| c.is_empty() || c == "iss" || !seen.insert(c.clone());
    if claims.is_empty() || claims.len() > 8 || claims.iter().any(bad_claim) {
        return Err(ConfigError::invalid(
            f("claims"),
            format!("{claims:?}"),
            "1 to 8 distinct claim names other than \"iss\" (always part of the scope), such as [\"sub\"] or [\"sub\", \"tenant_id\"]",
        ));
    }
    let header = match &raw.header {
        Some(h) => parse_header_name(&f("header"), h)?,
        None => http::header::AUTHORIZATION,
    };
    let leeway = raw.leeway.unwrap_or(Duration::from_secs(60));
    if leeway > MAX_LEEWAY {
        return Err(ConfigError::invalid(
            f("leeway"),
            shown(leeway),
            "a clock skew from 0s to 5m (60s is the default)",
        ));
    }
    let refresh = raw.refresh.unwrap_or(Duration::from_secs(600));
    if !(MIN_REFRESH..=MAX_REFRESH).contains(&refresh) {
        return Err(ConfigError::invalid(
            f("refresh"),
            shown(refresh),
            "from 10s to 24h (10m is the default)",
        ));
    }
    Ok(ClientJwt {
        keys,
        issuers,
        audience: raw.audience.clone(),
        claims,
        header,
        leeway,
        refresh,
    })
}

/// Exactly one source of keys.
fn keys(f: &dyn Fn(&str) -> String, raw: &RawClientJwt) -> Result<JwtKeys, ConfigError> {
    let set = [
        raw.jwks_url.is_some(),
        raw.jwks_file.is_some(),
        raw.hmac_secret_env.is_some(),
        raw.hmac_secret_file.is_some(),
    ];
    if set.iter().filter(|s| **s).count() != 1 {
        return Err(ConfigError::invalid(
            f("jwks_url"),
            "(keys)",
            "exactly one of jwks_url, jwks_file, hmac_secret_env, hmac_secret_file",
        ));
    }
    if let Some(url) = &raw.jwks_url {
        let uri: Option<Uri> = url.parse().ok();
        // A key set is public: credentials in its URL would only be logged and shown.
        if uri
            .as_ref()
            .and_then(Uri::authority)
            .is_some_and(|a| a.as_str().contains('@'))
        {
            return Err(ConfigError::invalid(
                f("jwks_url"),
                "(not shown: it carries credentials)",
                "the URL of a public JWKS document, without user or password",
            ));
        }
        return match uri {
            Some(u) if matches!(u.scheme_str(), Some("http" | "https")) && u.host().is_some() => {
                Ok(JwtKeys::Url(u))
            }
            _ => Err(ConfigError::invalid(
                f("jwks_url"),
                crate::config::redact_url(url),
                "an http:// or https:// URL of the issuer's JWKS document",
            )),
        };
    }
    if let Some(path) = &raw.jwks_file {
        let text = std::fs::read_to_string(path).map_err(|e| {
            ConfigError::invalid(
                f("jwks_file"),
                path,
                format!("a readable JWKS file ({})", e.kind()),
            )
        })?;
        // Its keys are read by the verifier (a file without a usable one keeps `/readyz` at
        // 503, saying why); here, that it is a JWKS document at all.
        let document: Option<serde_json::Value> = serde_json::from_str(&text).ok();
        if !document.is_some_and(|d| d.get("keys").is_some_and(|k| k.is_array())) {
            return Err(ConfigError::invalid(
                f("jwks_file"),
                path,
                "a JWKS document: JSON with a \"keys\" array",
            ));
        }
        return Ok(JwtKeys::File(path.into()));
    }
    let (source, value) = if let Some(name) = &raw.hmac_secret_env {
        let field = f("hmac_secret_env");
        let value = std::env::var(name).map_err(|_| {
            ConfigError::invalid(
                &field,
                "(not shown)",
                "the name of an environment variable that is set (it holds the HMAC secret)",
            )
        })?;
        (format!("{field} {name}"), value)
    } else {
        let path = raw.hmac_secret_file.clone().unwrap_or_default();
        let field = f("hmac_secret_file");
        let value = std::fs::read_to_string(&path).map_err(|e| {
            ConfigError::invalid(
                &field,
                crate::config::shown_name(&path),
                format!("a readable file holding the HMAC secret ({})", e.kind()),
            )
        })?;
        (format!("{field} {path}"), value)
    };
    let key = value.trim().as_bytes().to_vec();
    if key.len() < MIN_HMAC_KEY {
        return Err(ConfigError::invalid(
            source,
            "(its content)",
            format!("an HMAC secret of at least {MIN_HMAC_KEY} bytes"),
        ));
    }
    Ok(JwtKeys::Hmac(Secret::new(key)))
}
