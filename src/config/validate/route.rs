//! `[[routes]]`: which requests a route takes, where they go, how their key is made, and the
//! rules between routes (unique names, no overlaps, one protocol per upstream).

use std::collections::BTreeMap;

use http::Method;

use super::signature::validate_signature;
use super::{entry_name, parse_header_name, shown};
use crate::config::raw::{from_table, OneOrMany, RawPolicy, RawRouteOwn, ROUTE_OWN_KEYS};
use crate::config::{ConfigError, Policy, RouteConfig, UpstreamUrl};
use crate::fingerprint::IgnoredFields;
use crate::key::KeySource;
use crate::route::{PatternError, RoutePattern};

pub(super) fn validate_route(
    index: usize,
    mut table: toml::Table,
    defaults: &Policy,
    default_upstream: &UpstreamUrl,
) -> Result<RouteConfig, ConfigError> {
    let at = |f: &str| format!("routes[{index}].{f}");
    let mut own = toml::Table::new();
    for k in ROUTE_OWN_KEYS {
        if let Some(v) = table.remove(*k) {
            own.insert((*k).to_string(), v);
        }
    }
    let own: RawRouteOwn = from_table(&format!("routes[{index}]"), own)?;
    let policy_raw: RawPolicy = from_table(&format!("routes[{index}]"), table)?;

    let path = own
        .path
        .ok_or_else(|| ConfigError::Missing { field: at("path") })?;
    let pattern = RoutePattern::parse(&path)
        .map_err(|e: PatternError| ConfigError::invalid(at("path"), &path, e.to_string()))?;
    let methods = validate_methods(&at("methods"), own.methods)?;
    let mut upstream = match own.upstream {
        None => default_upstream.clone(),
        Some(u) => UpstreamUrl {
            protocol: default_upstream.protocol,
            ..UpstreamUrl::parse(&at("upstream"), &u)?
        },
    };
    if let Some(p) = own.protocol {
        upstream.protocol = p;
    }
    for p in &own.fingerprint_ignore {
        if !p.starts_with('/') {
            return Err(ConfigError::invalid(
                at("fingerprint_ignore"),
                p,
                "JSON pointers (RFC 6901) starting with \"/\", such as \"/meta/sentAt\"",
            ));
        }
    }
    let named = own.name.is_some();
    let name = match own.name {
        Some(n) => entry_name(&at("name"), n)?,
        None => path.clone(),
    };
    let policy = super::policy::apply_policy(&format!("routes[{index}]"), defaults, &policy_raw)?;
    let key = match own.key {
        None => KeySource::header(policy.key_header.clone()),
        Some(raw) => validate_key_source(&at("key"), raw.header, raw.json, &ROUTE_KEY)?,
    };
    let signature = match own.signature {
        None => None,
        Some(raw) => Some(validate_signature(&at("signature"), raw)?),
    };
    outlives_its_tolerance(&at("ttl"), signature.as_ref(), policy.ttl)?;
    let check_fingerprint = own.check_fingerprint.unwrap_or(true);
    // A key a client picks, unchecked: any other request that reuses it gets the stored answer.
    if !check_fingerprint && key.pointers.is_empty() && own.unchecked_header_key != Some(true) {
        return Err(ConfigError::invalid(
            at("check_fingerprint"),
            "false",
            "true on a route keyed by headers alone (a key the client picks: any other request \
             that reused one would get its stored answer); for business keys, key the route by \
             body fields (key = { json = [...] }), or set unchecked_header_key = true to accept it",
        ));
    }
    Ok(RouteConfig {
        name,
        named,
        pattern,
        methods,
        upstream,
        fingerprint_ignore: IgnoredFields::new(&own.fingerprint_ignore),
        key,
        check_fingerprint,
        signature,
        policy,
    })
}

/// What a key's parts are called where it is written: a route's `header`, a consumer's `field`.
pub(super) struct KeyParts {
    /// The field naming the parts that are not JSON pointers.
    pub(super) named: &'static str,
    /// An example of a key made of one such part.
    pub(super) example: &'static str,
}

/// A route's key: headers and JSON pointers.
pub(super) const ROUTE_KEY: KeyParts = KeyParts {
    named: "header",
    example: "{ header = \"webhook-id\" }",
};

pub(super) fn validate_key_source(
    field: &str,
    named: Option<OneOrMany>,
    json: Option<OneOrMany>,
    parts: &KeyParts,
) -> Result<KeySource, ConfigError> {
    let headers = named
        .map(OneOrMany::into_vec)
        .unwrap_or_default()
        .iter()
        .map(|h| parse_header_name(&format!("{field}.{}", parts.named), h))
        .collect::<Result<Vec<_>, _>>()?;
    let pointers = json.map(OneOrMany::into_vec).unwrap_or_default();
    for p in &pointers {
        if !p.starts_with('/') {
            return Err(ConfigError::invalid(
                format!("{field}.json"),
                p,
                "JSON pointers (RFC 6901) starting with \"/\", such as \"/id\" or \"/data/object/id\"",
            ));
        }
    }
    if headers.is_empty() && pointers.is_empty() {
        return Err(ConfigError::invalid(
            field,
            "{}",
            format!(
                "a {} and/or JSON pointers: {}, {{ json = \"/id\" }}, {{ json = [\"/data/object/id\", \"/type\"] }}",
                parts.named, parts.example
            ),
        ));
    }
    if headers.len() + pointers.len() > 8 {
        return Err(ConfigError::invalid(
            field,
            "(more than 8 parts)",
            format!("at most 8 {}s and pointers", parts.named),
        ));
    }
    Ok(KeySource { headers, pointers })
}

fn validate_methods(field: &str, raw: Option<Vec<String>>) -> Result<Vec<Method>, ConfigError> {
    let raw = raw.unwrap_or_else(|| vec!["POST".into()]);
    if raw.is_empty() {
        return Err(ConfigError::invalid(
            field,
            "[]",
            "a non-empty list of HTTP methods such as [\"POST\", \"PATCH\"]",
        ));
    }
    let mut methods = Vec::with_capacity(raw.len());
    for m in raw {
        let upper = m.to_ascii_uppercase();
        let method = Method::from_bytes(upper.as_bytes())
            .map_err(|_| ConfigError::invalid(field, &m, "HTTP method names such as \"POST\""))?;
        if method == Method::CONNECT || method == Method::OPTIONS {
            return Err(ConfigError::invalid(
                field,
                &m,
                "methods that carry an operation (POST, PUT, PATCH, DELETE, ...); not CONNECT or OPTIONS",
            ));
        }
        if !methods.contains(&method) {
            methods.push(method);
        }
    }
    Ok(methods)
}

/// One upstream (scheme, host and port), one protocol: its connections are pooled together,
/// whichever route made them.
pub(super) fn check_protocols(
    default: &UpstreamUrl,
    routes: &[RouteConfig],
) -> Result<(), ConfigError> {
    let mut seen: Vec<&UpstreamUrl> = vec![default];
    for (i, r) in routes.iter().enumerate() {
        let u = &r.upstream;
        if let Some(other) = seen
            .iter()
            .find(|s| s.tls == u.tls && s.authority == u.authority && s.protocol != u.protocol)
        {
            return Err(ConfigError::invalid(
                format!("routes[{i}].protocol"),
                u.protocol.as_str(),
                format!(
                    "the protocol of {} is {:?} elsewhere in this config; one upstream, one protocol",
                    other,
                    other.protocol.as_str()
                ),
            ));
        }
        seen.push(u);
    }
    Ok(())
}

pub(super) fn check_unique_names(routes: &[RouteConfig]) -> Result<(), ConfigError> {
    let mut seen = BTreeMap::new();
    for (index, r) in routes.iter().enumerate() {
        if seen.insert(r.name.as_str(), index).is_some() {
            return Err(ConfigError::DuplicateName {
                index,
                name: r.name.clone(),
            });
        }
    }
    Ok(())
}

pub(super) fn check_overlaps(routes: &[RouteConfig]) -> Result<(), ConfigError> {
    for (i, a) in routes.iter().enumerate() {
        for b in &routes[i + 1..] {
            let Some(method) = a.methods.iter().find(|m| b.methods.contains(m)) else {
                continue;
            };
            if let Some(example) = a.pattern.overlap_example(&b.pattern) {
                return Err(ConfigError::Overlap {
                    first: a.name.clone(),
                    second: b.name.clone(),
                    method: method.to_string(),
                    example,
                });
            }
        }
    }
    Ok(())
}

/// A signed timestamp is accepted while it is within the tolerance of now, either way: stamped
/// a tolerance ahead (a sender's clock running fast), a delivery stays acceptable for twice the
/// tolerance after it first arrived. A record that expires before then would let it, sent
/// again, run again.
fn outlives_its_tolerance(
    field: &str,
    signature: Option<&crate::config::SignatureConfig>,
    ttl: std::time::Duration,
) -> Result<(), ConfigError> {
    if let Some(sig) = signature.filter(|s| s.scheme.is_timestamped()) {
        // Timestamps are whole seconds: one more covers the second a stamp is rounded down by.
        let least = sig
            .tolerance
            .saturating_mul(2)
            .saturating_add(std::time::Duration::from_secs(1));
        if ttl < least {
            return Err(ConfigError::invalid(
                field.to_string(),
                shown(ttl),
                format!(
                    "at least {} on a signed route: twice the signature's tolerance ({}) and a second",
                    humantime::format_duration(least),
                    humantime::format_duration(sig.tolerance)
                ),
            ));
        }
    }
    Ok(())
}
