//! Raw config -> validated [`Config`]: every value checked, defaults applied (route over
//! `[defaults]` over built-in), every rejection a [`ConfigError`] naming field, value and what
//! is allowed. One file per section: [`server`], [`store`], [`route`] (with the policy of
//! [`policy`] and the signatures of [`signature`]) and [`consumer`]; here the whole file, the
//! rules that cross sections, and the value parsers they share.

mod connection;
mod consumer;
mod jwt;
mod policy;
mod postgres;
mod route;
mod server;
mod signature;
mod store;

use std::time::Duration;

use http::HeaderName;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use super::client::is_certificate_header;
use super::raw::{RawConfig, RawUpstream, Size, SIZE};
use super::{
    redact_url, Config, ConfigError, ConsumerConfig, Policy, RouteConfig, ServerConfig,
    StoreConfig, UpstreamTls, UpstreamUrl,
};

/// How long an upstream connection may sit idle before it is closed rather than reused, when
/// `upstream.idle_timeout` is not set: below the keep-alive timeouts of common upstream servers
/// (gunicorn 2 s, Node.js and uvicorn 5 s, Apache 5 s), so that the gateway never writes a
/// request on a connection the upstream is closing (an unknown outcome for a request that never
/// ran).
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(1);

/// Where a secret is read from: the name of an environment variable (`env`, never the secret
/// itself: the file is printed and compared freely) or a file (`file`), one of the two; `names`
/// are their keys, `what` the secret as the error calls it.
fn secret_source(
    env: &Option<String>,
    file: &Option<String>,
    (env_key, file_key): (&str, &str),
    what: &str,
) -> Result<Option<super::TokenSource>, ConfigError> {
    use super::TokenSource;
    Ok(Some(match (env, file) {
        (None, None) => return Ok(None),
        (Some(_), Some(_)) => {
            return Err(ConfigError::invalid(
                file_key,
                format!("(set together with {env_key})"),
                format!("one of {env_key} (a variable's name) and {file_key}"),
            ))
        }
        (Some(name), None) => {
            let valid = !name.is_empty()
                && name.len() <= 128
                && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
            if !valid {
                // Not shown if it looks like the secret pasted in the name's place.
                return Err(ConfigError::invalid(
                    env_key,
                    super::shown_name(name),
                    format!("the name of an environment variable, such as \"IDEMGATE_SECRET\" (the {what} itself never goes in the file)"),
                ));
            }
            TokenSource::Env(name.clone())
        }
        (None, Some(path)) if !path.trim().is_empty() => TokenSource::File(path.into()),
        (None, Some(path)) => {
            return Err(ConfigError::invalid(
                file_key,
                super::shown_name(path),
                format!("the path of a file holding the {what}"),
            ))
        }
    }))
}

/// Connections to each upstream when `upstream.max_connections` is not set.
const DEFAULT_UPSTREAM_CONNECTIONS: usize = 1024;

impl RawConfig {
    pub(super) fn validate(self) -> Result<Config, ConfigError> {
        let server = server::validate_server(self.server)?;
        let store_keys = secret_source(
            &self.store.encryption_keys_env,
            &self.store.encryption_keys_file,
            ("store.encryption_keys_env", "store.encryption_keys_file"),
            "keys",
        )?;
        let store = store::validate_store(self.store, server.workers)?;
        let raw_upstream = self.upstream.ok_or_else(|| ConfigError::Missing {
            field: "upstream.url".into(),
        })?;
        let (upstream, upstream_max_connections) = validate_upstream(&raw_upstream)?;
        let upstream_idle_timeout = validate_idle_timeout(&raw_upstream)?;
        let defaults = policy::apply_policy("defaults", &Policy::builtin(), &self.defaults)?;

        let mut routes = Vec::with_capacity(self.routes.len());
        for (index, table) in self.routes.into_iter().enumerate() {
            routes.push(route::validate_route(index, table, &defaults, &upstream)?);
        }
        route::check_unique_names(&routes)?;
        route::check_overlaps(&routes)?;
        route::check_protocols(&upstream, &routes)?;
        check_client_subject(&server, &defaults, &routes)?;
        let mut consumers: Vec<ConsumerConfig> = Vec::with_capacity(self.consumers.len());
        for (index, raw) in self.consumers.into_iter().enumerate() {
            let consumer = consumer::validate_consumer(index, raw, &defaults, &store)?;
            if consumers.iter().any(|c| c.name == consumer.name)
                || routes.iter().any(|r| r.name == consumer.name)
            {
                return Err(ConfigError::invalid(
                    format!("consumers[{index}].name"),
                    consumer.name,
                    "a name no other consumer or route has (it is part of every stored key)",
                ));
            }
            consumers.push(consumer);
        }
        check_body_budget(&server, &routes, &consumers)?;
        check_ttl_margin(&store, &routes, &consumers)?;
        let upstream_tls = validate_upstream_tls(raw_upstream)?;
        let telemetry = self
            .telemetry
            .map(crate::config::telemetry::Telemetry::validate)
            .transpose()?;
        check_tls_server_name(&upstream_tls, &upstream, &routes)?;
        Ok(Config {
            server,
            store,
            upstream,
            upstream_max_connections,
            upstream_idle_timeout,
            upstream_tls,
            defaults,
            routes,
            consumers,
            telemetry,
            store_keys,
        })
    }
}

/// `[upstream] url`, `protocol` and `max_connections`.
fn validate_upstream(raw: &RawUpstream) -> Result<(UpstreamUrl, usize), ConfigError> {
    let url = raw.url.as_deref().ok_or_else(|| ConfigError::Missing {
        field: "upstream.url".into(),
    })?;
    let mut upstream = UpstreamUrl::parse("upstream.url", url)?;
    if let Some(p) = raw.protocol {
        upstream.protocol = p;
    }
    let max_connections = match raw.max_connections {
        None => DEFAULT_UPSTREAM_CONNECTIONS,
        Some(n) => match usize::try_from(n) {
            Ok(n @ 1..=65_535) => n,
            _ => {
                return Err(ConfigError::invalid(
                    "upstream.max_connections",
                    n.to_string(),
                    "from 1 to 65535 connections to each upstream (1024 is the default)",
                ))
            }
        },
    };
    Ok((upstream, max_connections))
}

/// `[upstream] idle_timeout`: from 100ms to 10m.
fn validate_idle_timeout(raw: &RawUpstream) -> Result<Duration, ConfigError> {
    match raw.idle_timeout {
        None => Ok(DEFAULT_IDLE_TIMEOUT),
        Some(d) if (Duration::from_millis(100)..=Duration::from_secs(600)).contains(&d) => Ok(d),
        Some(d) => Err(ConfigError::invalid(
            "upstream.idle_timeout",
            shown(d),
            "from 100ms to 10m, below the upstream's own keep-alive timeout (1s is the default)",
        )),
    }
}

/// The certificate headers are the gateway's to set only where it verifies certificates;
/// elsewhere a client could write them and pick its scope. And a certificate's subject or URI is
/// public: listed beside a secret header, a client whose certificate lacks one (or a client
/// without a certificate) could send another's public value in the secret header and stand in
/// that client's scope.
fn check_client_subject(
    server: &ServerConfig,
    defaults: &Policy,
    routes: &[RouteConfig],
) -> Result<(), ConfigError> {
    let policies = std::iter::once(("defaults", defaults))
        .chain(routes.iter().map(|r| (r.name.as_str(), &r.policy)));
    for (name, p) in policies {
        let public = p.client_headers.iter().filter(|h| is_certificate_header(h));
        let Some(first) = public.clone().next() else {
            continue;
        };
        if server.tls_client_ca.is_none() {
            return Err(ConfigError::invalid(
                "client_header",
                first.as_str(),
                "only with server.tls_client_ca, which verifies the certificate it comes from",
            ));
        }
        if public.count() != p.client_headers.len() {
            let names: Vec<&str> = p.client_headers.iter().map(|h| h.as_str()).collect();
            return Err(ConfigError::invalid(
                format!("client_header ({name})"),
                format!("{names:?}"),
                "certificate headers (x-client-cert-subject, x-client-cert-uri) alone: they are public, and a secret header beside them would let a client without them claim another's scope by sending its public value",
            ));
        }
    }
    Ok(())
}

/// How long a shared store may take, at most, over a reservation and its completion: the Redis
/// record's TTL starts at its `SET`, before the replicas' `WAIT`, and the completion comes after
/// the upstream call; each is bounded by `command_timeout` (plus `replica_timeout`).
fn store_time(store: &StoreConfig) -> Duration {
    match store {
        StoreConfig::Redis(r) => {
            2 * (r.command_timeout + r.replicas.as_ref().map_or(Duration::ZERO, |a| a.timeout))
        }
        StoreConfig::Postgres(p) => 2 * p.command_timeout,
        StoreConfig::Memory { .. } | StoreConfig::Disk(_) => Duration::ZERO,
    }
}

/// A pending record must outlive the whole upstream call, one lease, and the store's own time
/// for the reservation and the completion, or it could expire before its result is stored and
/// let a retry execute again.
fn check_ttl_margin(
    store: &StoreConfig,
    routes: &[RouteConfig],
    consumers: &[ConsumerConfig],
) -> Result<(), ConfigError> {
    let margin = store_time(store);
    let policies = (routes
        .iter()
        .map(|r| (format!("routes[{}]", r.name), &r.policy)))
    .chain(
        consumers
            .iter()
            .map(|c| (format!("consumers[{}]", c.name), &c.policy)),
    );
    for (at, p) in policies {
        let least = p.upstream_timeout + p.lock_timeout + margin;
        if p.ttl < least {
            return Err(ConfigError::invalid(
                format!("{at}.ttl"),
                shown(p.ttl),
                format!(
                    "at least upstream_timeout + lock_timeout + twice the store's command_timeout (and replica_timeout) ({})",
                    humantime::format_duration(least)
                ),
            ));
        }
    }
    Ok(())
}

/// A body larger than the whole budget could never be read: say so now, not with a 503 on
/// every such request (or a dead letter for every such message).
fn check_body_budget(
    server: &ServerConfig,
    routes: &[RouteConfig],
    consumers: &[ConsumerConfig],
) -> Result<(), ConfigError> {
    let policies = routes
        .iter()
        .enumerate()
        .map(|(i, r)| ("routes", i, &r.policy));
    let policies = policies.chain(
        consumers
            .iter()
            .enumerate()
            .map(|(i, c)| ("consumers", i, &c.policy)),
    );
    for (table, i, policy) in policies {
        if policy.max_body > server.max_buffered {
            return Err(ConfigError::invalid(
                format!("{table}[{i}].max_body"),
                policy.max_body.to_string(),
                format!(
                    "at most server.max_buffered ({} bytes)",
                    server.max_buffered
                ),
            ));
        }
    }
    Ok(())
}

/// One name for every https upstream: only right if there is one https host.
fn check_tls_server_name(
    tls: &UpstreamTls,
    upstream: &UpstreamUrl,
    routes: &[RouteConfig],
) -> Result<(), ConfigError> {
    let Some(name) = &tls.server_name else {
        return Ok(());
    };
    if let Some(r) = routes
        .iter()
        .find(|r| r.upstream.tls && r.upstream.authority != upstream.authority)
    {
        return Err(ConfigError::invalid(
            "upstream.tls_server_name",
            name,
            format!(
                "only when every https:// upstream is upstream.url; route {:?} goes to {}",
                r.name, r.upstream
            ),
        ));
    }
    Ok(())
}

fn validate_upstream_tls(raw: RawUpstream) -> Result<UpstreamTls, ConfigError> {
    let ca_file = raw
        .tls_ca_file
        .map(|p| pem_file("upstream.tls_ca_file", p, Pem::Certificate))
        .transpose()?;
    let (client_cert, client_key) = match pem_pair(
        ("upstream.tls_client_cert", "upstream.tls_client_key"),
        raw.tls_client_cert,
        raw.tls_client_key,
    )? {
        Some((cert, key)) => (Some(cert), Some(key)),
        None => (None, None),
    };
    if let Some(name) = &raw.tls_server_name {
        if rustls::pki_types::ServerName::try_from(name.as_str()).is_err() {
            return Err(ConfigError::invalid(
                "upstream.tls_server_name",
                name,
                "a DNS name or IP address that the upstream's certificate names",
            ));
        }
    }
    Ok(UpstreamTls {
        ca_file,
        client_cert,
        client_key,
        server_name: raw.tls_server_name,
    })
}

/// What a PEM file must hold.
#[derive(Clone, Copy)]
pub(super) enum Pem {
    Certificate,
    PrivateKey,
}

/// A PEM file that must parse and hold at least one certificate or a private key (PKCS#8,
/// PKCS#1 or SEC1); errors name the file, never its content.
pub(super) fn pem_file(
    field: &str,
    path: String,
    what: Pem,
) -> Result<std::path::PathBuf, ConfigError> {
    let (found, block) = match what {
        Pem::Certificate => (
            CertificateDer::pem_file_iter(&path).and_then(|certs| {
                let certs = certs.collect::<Result<Vec<_>, _>>()?;
                Ok(!certs.is_empty())
            }),
            "CERTIFICATE",
        ),
        Pem::PrivateKey => (
            PrivateKeyDer::from_pem_file(&path).map(|_| true),
            "PRIVATE KEY",
        ),
    };
    match found {
        Ok(true) => Ok(std::path::PathBuf::from(path)),
        Err(pem::Error::Io(e)) => Err(ConfigError::invalid(
            field,
            crate::config::shown_name(&path),
            format!("a readable PEM file ({})", e.kind()),
        )),
        Ok(false) | Err(_) => Err(ConfigError::invalid(
            field,
            crate::config::shown_name(&path),
            format!("a PEM file with a {block} block"),
        )),
    }
}

/// A PEM certificate and its key, set together or not at all; `fields` are their names.
fn pem_pair(
    (cert_field, key_field): (&str, &str),
    cert: Option<String>,
    key: Option<String>,
) -> Result<Option<(std::path::PathBuf, std::path::PathBuf)>, ConfigError> {
    match (cert, key) {
        (None, None) => Ok(None),
        (Some(c), Some(k)) => Ok(Some((
            pem_file(cert_field, c, Pem::Certificate)?,
            pem_file(key_field, k, Pem::PrivateKey)?,
        ))),
        (Some(_), None) => Err(ConfigError::Missing {
            field: format!("{key_field} (with {cert_field})"),
        }),
        (None, Some(_)) => Err(ConfigError::Missing {
            field: format!("{cert_field} (with {key_field})"),
        }),
    }
}

/// Checks a Redis URL without connecting; errors show it with the password masked.
fn validate_redis_url(field: &str, url: String) -> Result<String, ConfigError> {
    let allowed = "a URL such as \"redis://127.0.0.1:6379/0\", \"redis://user:password@host:6379\" or, for TLS, \"rediss://host:6380\"";
    if !url.starts_with("redis://") && !url.starts_with("rediss://") {
        return Err(ConfigError::invalid(field, redact_url(&url), allowed));
    }
    redis::Client::open(url.as_str())
        .map_err(|_| ConfigError::invalid(field, redact_url(&url), allowed))?;
    Ok(url)
}

/// A route's or consumer's name: part of every key it stores.
fn entry_name(field: &str, name: String) -> Result<String, ConfigError> {
    if name.is_empty() || name.len() > 128 || name.chars().any(char::is_control) {
        return Err(ConfigError::invalid(
            field,
            name,
            "1 to 128 characters without control characters",
        ));
    }
    Ok(name)
}

fn parse_header_name(field: &str, raw: &str) -> Result<HeaderName, ConfigError> {
    HeaderName::from_bytes(raw.as_bytes()).map_err(|_| {
        ConfigError::invalid(
            field,
            raw,
            "an HTTP header name such as \"Idempotency-Key\"",
        )
    })
}

/// A duration as the messages show it.
fn shown(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

/// A size of at most `max` bytes.
fn size_at_most(field: &str, size: Size, max: u64) -> Result<u64, ConfigError> {
    if size.bytes > max {
        return Err(ConfigError::invalid(
            field,
            size.written,
            format!("{SIZE}, at most {max} bytes"),
        ));
    }
    Ok(size.bytes)
}

/// A whole number in `range`, or `default` when unset.
fn whole_number(
    field: &str,
    raw: Option<i64>,
    default: i64,
    range: std::ops::RangeInclusive<i64>,
) -> Result<i64, ConfigError> {
    match raw {
        None => Ok(default),
        Some(n) if range.contains(&n) => Ok(n),
        Some(n) => Err(ConfigError::invalid(
            field,
            n.to_string(),
            format!("a whole number from {} to {}", range.start(), range.end()),
        )),
    }
}
