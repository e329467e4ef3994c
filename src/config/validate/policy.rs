//! The policy of a route, a consumer or `[defaults]`: the fields set in a raw table applied over
//! a base (the built-ins, or `[defaults]`), then the rules between fields checked on the merged
//! result, so that a route cannot break them by halves.

use std::time::Duration;

use http::StatusCode;

use super::{parse_header_name, shown, size_at_most};
use crate::config::answers::ErrorBody;
use crate::config::raw::{OneOrMany, RawPolicy, RawReconcile};
use crate::config::{ConfigError, Policy, Reconcile, ServerStatuses};

/// Largest accepted `max_body` / `max_stored_response`: both are buffered in memory per request.
const MAX_BUFFER_LIMIT: u64 = 1 << 30;
/// A key must be kept at least this long, or a quick retry could execute again.
const MIN_TTL: Duration = Duration::from_secs(1);
/// Longer would overflow store expiry arithmetic, and no retry comes back after a year.
const MAX_TTL: Duration = Duration::from_secs(365 * 24 * 3600);

/// Applies the fields set in `raw` on top of `base`; `scope` prefixes field names in errors.
pub(super) fn apply_policy(
    scope: &str,
    base: &Policy,
    raw: &RawPolicy,
) -> Result<Policy, ConfigError> {
    let f = |name: &str| format!("{scope}.{name}");
    let mut p = base.clone();
    apply_identity(&f, &mut p, raw)?;
    apply_timing(&f, &mut p, raw)?;
    apply_limits(&f, &mut p, raw)?;
    apply_answers(&f, &mut p, raw)?;
    check_policy(&f, &p)?;
    Ok(p)
}

/// Which header carries the key, how clients are told apart, what a mismatch answers.
fn apply_identity(
    f: &dyn Fn(&str) -> String,
    p: &mut Policy,
    raw: &RawPolicy,
) -> Result<(), ConfigError> {
    if let Some(h) = &raw.key_header {
        p.key_header = parse_header_name(&f("key_header"), h)?;
    }
    if let Some(names) = &raw.fingerprint_headers {
        p.fingerprint_headers = names
            .iter()
            .map(|h| parse_header_name(&f("fingerprint_headers"), h))
            .collect::<Result<_, _>>()?;
    }
    if let Some(b) = raw.require_key {
        p.require_key = b;
    }
    if let Some(n) = raw.mismatch_status {
        p.mismatch_status = match u16::try_from(n).ok().map(StatusCode::from_u16) {
            Some(Ok(s)) if s.is_client_error() => s,
            _ => {
                return Err(ConfigError::invalid(
                    f("mismatch_status"),
                    n.to_string(),
                    "a 4xx status: 409 (default) or 422 (the IETF draft's choice)",
                ))
            }
        };
    }
    if let Some(h) = &raw.replay_header {
        p.replay_header = parse_header_name(&f("replay_header"), h)?;
    }
    if let Some(h) = raw.client_header.clone() {
        p.client_headers = match h {
            OneOrMany::One(one) if one.is_empty() => Vec::new(),
            many => {
                let names = many.into_vec();
                if names.is_empty() || names.len() > 8 {
                    return Err(ConfigError::invalid(
                        f("client_header"),
                        format!("{names:?}"),
                        "one header name, \"\" (one scope for every caller), or a list of 1 to 8 header names",
                    ));
                }
                names
                    .iter()
                    .map(|n| parse_header_name(&f("client_header"), n))
                    .collect::<Result<_, _>>()?
            }
        };
    }
    if let Some(jwt) = &raw.client_jwt {
        if raw.client_header.is_some() {
            return Err(ConfigError::invalid(
                f("client_header"),
                "(set beside client_jwt)",
                "either client_header or client_jwt in one table: with client_jwt the scope is the token's issuer and claims",
            ));
        }
        p.client_jwt = Some(std::sync::Arc::new(super::jwt::client_jwt(
            &f("client_jwt"),
            jwt,
        )?));
    } else if raw.client_header.is_some() {
        // A route naming its own headers leaves the defaults' token behind.
        p.client_jwt = None;
    }
    if let Some(b) = raw.require_client {
        p.require_client = b;
    }
    Ok(())
}

/// How long keys are kept, leased and waited for.
fn apply_timing(
    f: &dyn Fn(&str) -> String,
    p: &mut Policy,
    raw: &RawPolicy,
) -> Result<(), ConfigError> {
    p.ttl = raw.ttl.unwrap_or(p.ttl);
    p.lock_timeout = raw.lock_timeout.unwrap_or(p.lock_timeout);
    p.wait = raw.wait.unwrap_or(p.wait);
    if let Some(n) = raw.max_waiters {
        p.max_waiters = match usize::try_from(n) {
            Ok(n @ 1..=10_000) => n,
            _ => {
                return Err(ConfigError::invalid(
                    f("max_waiters"),
                    n.to_string(),
                    "from 1 to 10000 duplicates waiting on one key (64 is the default)",
                ))
            }
        };
    }
    Ok(())
}

/// Headers a hint may not take: the gateway sets them to something else on the same answers,
/// or they mean something to the connection.
const NOT_HINTS: [&str; 19] = [
    "content-type",
    "content-encoding",
    "date",
    "set-cookie",
    "upgrade",
    "te",
    "trailer",
    "keep-alive",
    "proxy-connection",
    "idempotency-bypassed",
    "content-length",
    "transfer-encoding",
    "connection",
    "cache-control",
    "retry-after",
    "retry-after-ms",
    "allow",
    "www-authenticate",
    "accept-encoding",
];

/// How the gateway's own answers hint at retrying and what their bodies look like.
fn apply_answers(
    f: &dyn Fn(&str) -> String,
    p: &mut Policy,
    raw: &RawPolicy,
) -> Result<(), ConfigError> {
    if let Some(names) = &raw.retry_hint_headers {
        let bad = || {
            ConfigError::invalid(
                f("retry_hint_headers"),
                format!("{names:?}"),
                "a list of up to 8 distinct header names the SDKs read, such as [\"x-should-retry\", \"stripe-should-retry\"] ([] for none); not one the gateway sets itself (Content-Type, Retry-After, retry-after-ms, ...)",
            )
        };
        let mut hints: Vec<http::HeaderName> = Vec::with_capacity(names.len());
        for name in names {
            let h = parse_header_name(&f("retry_hint_headers"), name)?;
            if hints.contains(&h) || NOT_HINTS.contains(&h.as_str()) {
                return Err(bad());
            }
            hints.push(h);
        }
        if hints.len() > 8 {
            return Err(bad());
        }
        p.answers.with_hints(hints);
    }
    if let Some(body) = &raw.error_body {
        let content_type = body.content_type.as_deref().unwrap_or("application/json");
        let parsed = ErrorBody::parse(content_type, &body.template)
            .map_err(|why| ConfigError::invalid(f("error_body"), "(the table)", why))?;
        p.answers.with_error_body(Some(std::sync::Arc::new(parsed)));
    }
    Ok(())
}

/// Quotas, sizes, the upstream's deadline and what failures do.
fn apply_limits(
    f: &dyn Fn(&str) -> String,
    p: &mut Policy,
    raw: &RawPolicy,
) -> Result<(), ConfigError> {
    if let Some(n) = raw.anonymous_share {
        p.anonymous_share = u8::try_from(n)
            .ok()
            .filter(|n| (1..=100).contains(n))
            .ok_or_else(|| {
                ConfigError::invalid(
                    f("anonymous_share"),
                    n.to_string(),
                    "a percent of the store's bound, from 1 to 100 (100: anonymous callers may fill it all)",
                )
            })?;
    }
    for (name, raw, field) in [
        (
            "max_keys_per_client",
            raw.max_keys_per_client,
            &mut p.max_keys_per_client,
        ),
        (
            "max_keys_anonymous",
            raw.max_keys_anonymous,
            &mut p.max_keys_anonymous,
        ),
    ] {
        if let Some(n) = raw {
            *field = u64::try_from(n).map_err(|_| {
                ConfigError::invalid(
                    f(name),
                    n.to_string(),
                    "a number of records per ttl, 0 for no quota",
                )
            })?;
        }
    }
    if let Some(n) = raw.max_body.clone() {
        p.max_body = size_at_most(&f("max_body"), n, MAX_BUFFER_LIMIT)? as usize;
    }
    if let Some(n) = raw.max_stored_response.clone() {
        p.max_stored_response =
            size_at_most(&f("max_stored_response"), n, MAX_BUFFER_LIMIT)? as usize;
    }
    p.upstream_timeout = raw.upstream_timeout.unwrap_or(p.upstream_timeout);
    p.store_server_errors = raw.store_server_errors.unwrap_or(p.store_server_errors);
    if let Some(codes) = &raw.unknown_statuses {
        let codes16: Vec<u16> = codes
            .iter()
            .map(|&c| u16::try_from(c).unwrap_or(0))
            .collect();
        p.unknown_statuses = ServerStatuses::of(&codes16).ok_or_else(|| {
                ConfigError::invalid(
                    f("unknown_statuses"),
                    format!("{codes:?}"),
                "a list of 5xx statuses (500 to 599) that may follow a commit, such as [502, 504] (the default); [] for none",
            )
        })?;
    }
    p.on_store_error = raw.on_store_error.unwrap_or(p.on_store_error);
    p.on_unknown = raw.on_unknown.unwrap_or(p.on_unknown);
    if let Some(r) = &raw.reconcile {
        p.reconcile = Some(reconcile(f, r)?);
    }
    Ok(())
}

/// `reconcile`: an `http://` or `https://` URL with `{key}` in it (https with the `[upstream]`
/// TLS settings), and `after` from 0s to 1h.
fn reconcile(f: &dyn Fn(&str) -> String, r: &RawReconcile) -> Result<Reconcile, ConfigError> {
    let example = "an http:// or https:// URL with {key} where the client's key goes, such as \"http://payments:3000/payments/by-key/{key}\"";
    let filled = r.url.replace("{key}", "k");
    // `{key}` only after the authority: a client's key never names a host to connect to (a
    // connection slot per key, the key in connection errors), and no user info in a URL the
    // gateway logs.
    let authority_ok = |u: &http::Uri| {
        u.authority().is_some_and(|a| !a.as_str().contains('@'))
            && r.url.split_once("://").is_some_and(|(_, rest)| {
                let end = rest.find(['/', '?']).unwrap_or(rest.len());
                !rest[..end].contains("{key}")
            })
    };
    let valid = (r.url.starts_with("http://") || r.url.starts_with("https://"))
        && r.url.contains("{key}")
        && filled.parse::<http::Uri>().is_ok_and(|u| authority_ok(&u));
    if !valid {
        return Err(ConfigError::invalid(
            f("reconcile.url"),
            crate::config::redact_url(&r.url),
            example,
        ));
    }
    if let Some(after) = r.after {
        if after > Duration::from_secs(3600) {
            return Err(ConfigError::invalid(
                f("reconcile.after"),
                shown(after),
                "at most 1h (the default is the route's upstream_timeout)",
            ));
        }
    }
    Ok(Reconcile {
        url: r.url.clone(),
        after: r.after,
    })
}

/// The rules between fields, on the merged policy.
fn check_policy(f: &dyn Fn(&str) -> String, p: &Policy) -> Result<(), ConfigError> {
    if p.ttl < MIN_TTL {
        return Err(ConfigError::invalid(
            f("ttl"),
            shown(p.ttl),
            "at least 1s; keep it longer than your clients retry (24h is the default)",
        ));
    }
    if p.ttl > MAX_TTL {
        return Err(ConfigError::invalid(
            f("ttl"),
            shown(p.ttl),
            "at most \"365days\"",
        ));
    }
    if p.upstream_timeout > Duration::from_secs(3600) {
        return Err(ConfigError::invalid(
            f("upstream_timeout"),
            shown(p.upstream_timeout),
            "at most \"1h\"",
        ));
    }
    if p.lock_timeout.is_zero() || p.lock_timeout > p.ttl {
        return Err(ConfigError::invalid(
            f("lock_timeout"),
            shown(p.lock_timeout),
            format!(
                "more than 0s and at most ttl ({})",
                humantime::format_duration(p.ttl)
            ),
        ));
    }
    // A pending record must outlive the whole upstream call plus one lease, or it could expire
    // mid-flight and let a retry execute while the original still runs.
    if p.ttl < p.upstream_timeout + p.lock_timeout {
        return Err(ConfigError::invalid(
            f("ttl"),
            shown(p.ttl),
            format!(
                "at least upstream_timeout + lock_timeout ({})",
                humantime::format_duration(p.upstream_timeout + p.lock_timeout)
            ),
        ));
    }
    if p.wait > Duration::from_secs(600) {
        return Err(ConfigError::invalid(
            f("wait"),
            shown(p.wait),
            "from \"0s\" (409 at once) to \"10m\"",
        ));
    }
    if p.upstream_timeout.is_zero() {
        return Err(ConfigError::invalid(
            f("upstream_timeout"),
            "0s",
            "a duration above zero such as \"30s\"",
        ));
    }
    // Checked on the merged policy: a replay header set in one table and the hints in another
    // would mark every replay `true`, which Stainless SDKs obey over the status.
    if p.answers.hints().contains(&p.replay_header) {
        return Err(ConfigError::invalid(
            f("replay_header"),
            p.replay_header.as_str(),
            "a header other than the retry hint headers (retry_hint_headers): a replay is not a hint",
        ));
    }
    if p.key_header == p.replay_header {
        return Err(ConfigError::invalid(
            f("replay_header"),
            p.replay_header.as_str(),
            "a header name other than key_header",
        ));
    }
    if p.require_client && p.client_headers.is_empty() && p.client_jwt.is_none() {
        return Err(ConfigError::invalid(
            f("require_client"),
            "true",
            "false while client_header = \"\" (no header names a client to require)",
        ));
    }
    Ok(())
}
