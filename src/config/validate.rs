//! Raw config -> validated [`Config`]: every value checked, defaults applied (route over
//! `[defaults]` over built-in), every rejection a [`ConfigError`] naming field, value and what
//! is allowed.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use http::{HeaderName, Method, StatusCode};

use super::raw::{
    OneOrMany, RawConfig, RawConsumer, RawKey, RawPolicy, RawRouteOwn, RawServer, RawSignature,
    RawSize, RawSource, RawStore, ROUTE_OWN_KEYS,
};
use super::{
    redact_url, Config, ConfigError, ConsumerConfig, Deadlines, DiskSettings, NatsSource,
    OnStoreError, OnUnknown, Policy, RedisSettings, RedisTarget, RouteConfig, Secret, ServerConfig,
    SignatureConfig, SignatureScheme, SourceConfig, StoreConfig, SyncMode, UpstreamProtocol,
    UpstreamTls, UpstreamUrl, CLIENT_SUBJECT_HEADER,
};
use crate::fingerprint::IgnoredFields;
use crate::key::KeySource;
use crate::route::{PatternError, RoutePattern};

/// Largest accepted `max_body` / `max_stored_response`: both are buffered in memory per request.
const MAX_BUFFER_LIMIT: u64 = 1 << 30;
/// A key must be kept at least this long, or a quick retry could execute again.
const MIN_TTL: Duration = Duration::from_secs(1);
/// Longer would overflow store expiry arithmetic, and no retry comes back after a year.
const MAX_TTL: Duration = Duration::from_secs(365 * 24 * 3600);
/// Largest accepted `max_disk` (1 PiB): counts stay far from overflowing.
const MAX_DISK: u64 = 1 << 50;
/// Request bodies buffered at once across every connection when `server.max_buffered` is not
/// set: about 64 thousand 1 KiB payment requests, or 64 at the 1 MiB `max_body`.
const DEFAULT_MAX_BUFFERED: usize = 64 << 20;
const MIN_BUFFERED: usize = 64 << 10;
const MAX_BUFFERED: u64 = 1 << 40;
/// Connections to each upstream when `upstream.max_connections` is not set.
const DEFAULT_UPSTREAM_CONNECTIONS: usize = 1024;
/// More worker threads than this would only add switching.
const MAX_WORKERS: usize = 256;
/// How often the listener's certificate files are read again by default: cert-manager renews
/// days before expiry, and kubelet swaps a mounted Secret's files within about a minute.
const DEFAULT_TLS_RECHECK: Duration = Duration::from_secs(60);

impl RawConfig {
    pub(super) fn validate(self) -> Result<Config, ConfigError> {
        let server = validate_server(self.server)?;
        let store = validate_store(self.store)?;
        let raw_upstream = self.upstream.ok_or_else(|| ConfigError::Missing {
            field: "upstream.url".into(),
        })?;
        let upstream_raw = raw_upstream.url.ok_or_else(|| ConfigError::Missing {
            field: "upstream.url".into(),
        })?;
        let mut upstream = UpstreamUrl::parse("upstream.url", &upstream_raw)?;
        if let Some(p) = &raw_upstream.protocol {
            upstream.protocol = UpstreamProtocol::parse("upstream.protocol", p)?;
        }
        let upstream_max_connections = match raw_upstream.max_connections {
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
        let defaults = apply_policy("defaults", &Policy::builtin(), &self.defaults)?;

        let mut routes = Vec::with_capacity(self.routes.len());
        for (index, table) in self.routes.into_iter().enumerate() {
            routes.push(validate_route(index, table, &defaults, &upstream)?);
        }
        check_unique_names(&routes)?;
        check_overlaps(&routes)?;
        check_protocols(&upstream, &routes)?;
        // The subject header is the gateway's to set only where it verifies certificates;
        // elsewhere a client could write it and pick its scope.
        if server.tls_client_ca.is_none() {
            let names_subject =
                |p: &Policy| p.client_headers.iter().any(|h| h == CLIENT_SUBJECT_HEADER);
            if names_subject(&defaults) || routes.iter().any(|r| names_subject(&r.policy)) {
                return Err(ConfigError::invalid(
                    "client_header",
                    CLIENT_SUBJECT_HEADER,
                    "only with server.tls_client_ca, which verifies the certificate it comes from",
                ));
            }
        }
        let mut consumers = Vec::with_capacity(self.consumers.len());
        for (index, raw) in self.consumers.into_iter().enumerate() {
            let consumer = validate_consumer(index, raw, &defaults, &store)?;
            if consumers
                .iter()
                .any(|c: &ConsumerConfig| c.name == consumer.name)
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
        // A body larger than the whole budget could never be read: say so now, not with a 503
        // on every such request (or a dead letter for every such message).
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
        let upstream_tls = validate_upstream_tls(
            raw_upstream.tls_ca_file,
            raw_upstream.tls_client_cert,
            raw_upstream.tls_client_key,
            raw_upstream.tls_server_name,
        )?;
        // One name for every https upstream: only right if there is one https host.
        if upstream_tls.server_name.is_some() {
            if let Some(r) = routes
                .iter()
                .find(|r| r.upstream.tls && r.upstream.authority != upstream.authority)
            {
                return Err(ConfigError::invalid(
                    "upstream.tls_server_name",
                    upstream_tls.server_name.clone().unwrap_or_default(),
                    format!(
                        "only when every https:// upstream is upstream.url; route {:?} goes to {}",
                        r.name, r.upstream
                    ),
                ));
            }
        }
        Ok(Config {
            server,
            store,
            upstream,
            upstream_max_connections,
            upstream_tls,
            defaults,
            routes,
            consumers,
        })
    }
}

/// Most messages one consumer handles at once.
const MAX_CONCURRENCY: i64 = 4096;
/// Most deliveries of one message before it is dead-lettered.
const MAX_ATTEMPTS: i64 = 1000;

/// A consumer's `source`: a Redis stream or a NATS JetStream stream.
fn validate_source(
    at: &dyn Fn(&str) -> String,
    source: RawSource,
    store: &StoreConfig,
) -> Result<SourceConfig, ConfigError> {
    let stream_name = |field: &str, v: String| {
        if v.is_empty() || v.len() > 256 || v.chars().any(char::is_control) {
            Err(ConfigError::invalid(
                at(field),
                v,
                "1 to 256 characters without control characters",
            ))
        } else {
            Ok(v)
        }
    };
    let duration =
        |field: &str, v: &Option<String>, default: Duration| -> Result<Duration, ConfigError> {
            let d = match v {
                Some(s) => parse_duration(&at(field), s)?,
                None => default,
            };
            if d < Duration::from_millis(100) {
                return Err(ConfigError::invalid(
                    at(field),
                    humantime::format_duration(d).to_string(),
                    "at least 100ms: the gateway renews its claim every third of it",
                ));
            }
            Ok(d)
        };
    match (source.redis_stream, source.nats_stream) {
        (Some(stream), None) => {
            for (key, set) in [("subject", source.subject.is_some()), ("durable", source.durable.is_some()), ("ack_wait", source.ack_wait.is_some())] {
                if set {
                    return Err(ConfigError::invalid(at(&format!("source.{key}")), "(set)", "only with nats_stream; a Redis stream has group and claim_idle"));
                }
            }
            let stream = stream_name("source.redis_stream", stream)?;
            let group = stream_name(
                "source.group",
                source.group.unwrap_or_else(|| "idemgate".to_string()),
            )?;
            let dead_letter = stream_name(
                "source.dead_letter",
                source
                    .dead_letter
                    .unwrap_or_else(|| format!("{stream}:dead")),
            )?;
            if dead_letter == stream {
                return Err(ConfigError::invalid(
                    at("source.dead_letter"),
                    dead_letter,
                    "another stream than the one read",
                ));
            }
            let redis = match (source.url, store) {
                (Some(url), _) => RedisSettings {
                    target: RedisTarget::Single(validate_redis_url(&at("source.url"), url)?),
                    key_prefix: String::new(),
                    command_timeout: Duration::from_secs(5),
                    tls_ca_file: None,
                    require_noeviction: false,
                    tls_client: None,
                },
                (None, StoreConfig::Redis(settings))
                    if matches!(settings.target, RedisTarget::Single(_)) =>
                {
                    settings.clone()
                }
                (None, _) => {
                    return Err(ConfigError::invalid(
                        at("source.url"),
                        "(none)",
                        "the Redis holding the stream (\"redis://host:6379\"); without it the [store]'s, which must then be a single Redis",
                    ))
                }
            };
            let claim_idle = duration("source.claim_idle", &source.claim_idle, Duration::from_secs(60))?;
            Ok(SourceConfig::RedisStream {
                stream,
                group,
                redis,
                dead_letter,
                claim_idle,
            })
        }
        (None, Some(stream)) => {
            for (key, set) in [("group", source.group.is_some()), ("claim_idle", source.claim_idle.is_some())] {
                if set {
                    return Err(ConfigError::invalid(at(&format!("source.{key}")), "(set)", "only with redis_stream; a NATS stream has durable and ack_wait"));
                }
            }
            let stream = stream_name("source.nats_stream", stream)?;
            let url = source.url.ok_or_else(|| ConfigError::Missing { field: at("source.url") })?;
            if !url.starts_with("nats://") && !url.starts_with("tls://") {
                return Err(ConfigError::invalid(at("source.url"), redact_url(&url), "a NATS URL such as \"nats://127.0.0.1:4222\""));
            }
            let subject = source.subject.map(|s| stream_name("source.subject", s)).transpose()?;
            let durable = stream_name("source.durable", source.durable.unwrap_or_else(|| "idemgate".to_string()))?;
            if durable.contains(['.', '*', '>', ' ']) {
                return Err(ConfigError::invalid(at("source.durable"), durable, "a name without '.', '*', '>' or spaces"));
            }
            let dead_letter = stream_name(
                "source.dead_letter",
                source.dead_letter.ok_or_else(|| ConfigError::Missing { field: at("source.dead_letter") })?,
            )?;
            let ack_wait = duration("source.ack_wait", &source.ack_wait, Duration::from_secs(30))?;
            Ok(SourceConfig::NatsStream(NatsSource {
                url,
                stream,
                subject,
                durable,
                dead_letter,
                ack_wait,
            }))
        }
        _ => Err(ConfigError::invalid(
            at("source"),
            "(neither or both)",
            "one of { redis_stream = \"orders\" } and { nats_stream = \"ORDERS\", url = \"nats://host:4222\", dead_letter = \"dead.orders\" }",
        )),
    }
}

fn validate_consumer(
    index: usize,
    raw: RawConsumer,
    defaults: &Policy,
    store: &StoreConfig,
) -> Result<ConsumerConfig, ConfigError> {
    let at = |f: &str| format!("consumers[{index}].{f}");
    let name = match raw.name {
        None => return Err(ConfigError::Missing { field: at("name") }),
        Some(n) if n.is_empty() || n.len() > 128 || n.chars().any(char::is_control) => {
            return Err(ConfigError::invalid(
                at("name"),
                n,
                "1 to 128 characters without control characters",
            ))
        }
        Some(n) => n,
    };
    let handler = raw.handler.ok_or_else(|| ConfigError::Missing {
        field: at("handler"),
    })?;
    let mut handler = UpstreamUrl::parse(&at("handler"), &handler)?;
    if let Some(p) = &raw.protocol {
        handler.protocol = UpstreamProtocol::parse(&at("protocol"), p)?;
    }
    let key = raw
        .key
        .ok_or_else(|| ConfigError::Missing { field: at("key") })?;
    let key = validate_key_source(
        &at("key"),
        RawKey {
            header: key.field,
            json: key.json,
        },
    )
    .map_err(|e| match e {
        // The same rules as a route's key, with fields where a route has headers.
        ConfigError::Invalid {
            field,
            value,
            allowed,
        } => ConfigError::Invalid {
            field: field.replace(".header", ".field"),
            value,
            allowed: allowed.replace("{ header = \"webhook-id\" }", "{ field = \"messageId\" }"),
        },
        other => other,
    })?;
    let source = raw.source.ok_or_else(|| ConfigError::Missing {
        field: at("source"),
    })?;
    let source = validate_source(&at, source, store)?;
    if raw.body_field.is_some() && matches!(source, SourceConfig::NatsStream(_)) {
        return Err(ConfigError::invalid(
            at("body_field"),
            "(set)",
            "only with redis_stream: a NATS message's payload is the body",
        ));
    }
    let body_field = raw.body_field.unwrap_or_else(|| "body".to_string());
    let content_type = raw
        .content_type
        .unwrap_or_else(|| "application/json".to_string());
    let content_type = http::HeaderValue::from_str(&content_type).map_err(|_| {
        ConfigError::invalid(
            at("content_type"),
            &content_type,
            "a media type such as \"application/json\"",
        )
    })?;
    let int = |field: &str, v: Option<i64>, default: i64, max: i64| -> Result<i64, ConfigError> {
        match v {
            None => Ok(default),
            Some(n) if (1..=max).contains(&n) => Ok(n),
            Some(n) => Err(ConfigError::invalid(
                at(field),
                n.to_string(),
                format!("from 1 to {max}"),
            )),
        }
    };
    let concurrency = int("concurrency", raw.concurrency, 16, MAX_CONCURRENCY)?;
    let max_attempts = int("max_attempts", raw.max_attempts, 5, MAX_ATTEMPTS)?;
    let backoff = match &raw.backoff {
        Some(s) => parse_duration(&at("backoff"), s)?,
        None => Duration::from_secs(1),
    };
    let max_backoff = match &raw.max_backoff {
        Some(s) => parse_duration(&at("max_backoff"), s)?,
        None => Duration::from_secs(60),
    };
    if max_backoff < backoff {
        return Err(ConfigError::invalid(
            at("max_backoff"),
            humantime::format_duration(max_backoff).to_string(),
            "at least backoff",
        ));
    }
    let policy_raw = RawPolicy {
        ttl: raw.ttl,
        lock_timeout: raw.lock_timeout,
        wait: raw.wait,
        max_body: raw.max_body,
        max_stored_response: raw.max_stored_response,
        upstream_timeout: raw.upstream_timeout,
        store_server_errors: raw.store_server_errors,
        on_unknown: raw.on_unknown,
        ..RawPolicy::default()
    };
    let mut policy = apply_policy(&format!("consumers[{index}]"), defaults, &policy_raw)?;
    // A message is never handled without its key being kept: there is no client to tell.
    policy.on_store_error = OnStoreError::Reject;
    policy.require_key = true;
    Ok(ConsumerConfig {
        name,
        source,
        handler,
        key,
        check_fingerprint: raw.check_fingerprint.unwrap_or(true),
        body_field,
        content_type,
        // Both within bounds checked above.
        concurrency: usize::try_from(concurrency).unwrap_or(16),
        max_attempts: u64::try_from(max_attempts).unwrap_or(5),
        backoff,
        max_backoff,
        policy,
    })
}

/// The parser's message and where, without the quoted source line: that line may hold a
/// password (`url = "redis://:secret@..."`), and these errors are printed and logged.
pub(super) fn syntax_error(text: &str, e: &toml::de::Error) -> ConfigError {
    let at = e
        .span()
        .map(|span| {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
            format!(" (line {line}, column {column})")
        })
        .unwrap_or_default();
    ConfigError::Syntax(format!("{}{at}", e.message().trim_end()))
}

fn validate_server(raw: Option<RawServer>) -> Result<ServerConfig, ConfigError> {
    let raw = raw.ok_or_else(|| ConfigError::Missing {
        field: "server.listen".into(),
    })?;
    let listen_raw = raw.listen.ok_or_else(|| ConfigError::Missing {
        field: "server.listen".into(),
    })?;
    let addr_allowed = "an IP address and port such as \"127.0.0.1:8080\" or \"[::]:8080\"";
    let listen: SocketAddr = listen_raw
        .parse()
        .map_err(|_| ConfigError::invalid("server.listen", &listen_raw, addr_allowed))?;
    let admin = match raw.admin {
        None => None,
        Some(a) => Some(
            a.parse()
                .map_err(|_| ConfigError::invalid("server.admin", &a, addr_allowed))?,
        ),
    };
    let shutdown_grace = match raw.shutdown_grace {
        None => Duration::from_secs(30),
        Some(s) => parse_duration("server.shutdown_grace", &s)?,
    };
    if shutdown_grace > Duration::from_secs(3600) {
        return Err(ConfigError::invalid(
            "server.shutdown_grace",
            humantime::format_duration(shutdown_grace).to_string(),
            "at most \"1h\"",
        ));
    }
    let max_connections = match raw.max_connections {
        None => 4096,
        Some(n) if (1..=1_000_000).contains(&n) => n as usize,
        Some(n) => {
            return Err(ConfigError::invalid(
                "server.max_connections",
                n.to_string(),
                "a whole number from 1 to 1000000",
            ))
        }
    };
    let workers = match raw.workers {
        // What the process may use, cgroup CPU limits included (a Kubernetes `limits.cpu`).
        None => std::thread::available_parallelism().map_or(1, |n| n.get().min(MAX_WORKERS)),
        Some(n) if (1..=MAX_WORKERS as i64).contains(&n) => n as usize,
        Some(n) => {
            return Err(ConfigError::invalid(
                "server.workers",
                n.to_string(),
                format!("a whole number from 1 to {MAX_WORKERS}"),
            ))
        }
    };
    let defaults = Deadlines::default();
    let timeout = |field: &str, raw: Option<String>, default: Duration| match raw {
        None => Ok(default),
        Some(s) => {
            let d = parse_duration(field, &s)?;
            if d < Duration::from_millis(100) || d > Duration::from_secs(3600) {
                return Err(ConfigError::invalid(
                    field,
                    s,
                    "a duration from \"100ms\" to \"1h\"",
                ));
            }
            Ok(d)
        }
    };
    let deadlines = Deadlines {
        header: timeout("server.header_timeout", raw.header_timeout, defaults.header)?,
        body: timeout("server.body_timeout", raw.body_timeout, defaults.body)?,
        idle: timeout("server.idle_timeout", raw.idle_timeout, defaults.idle)?,
        send: timeout("server.send_timeout", raw.send_timeout, defaults.send)?,
    };
    let max_streams = match raw.max_streams {
        None => 100,
        Some(n) if (1..=1000).contains(&n) => n as u32,
        Some(n) => {
            return Err(ConfigError::invalid(
                "server.max_streams",
                n.to_string(),
                "a whole number from 1 to 1000",
            ))
        }
    };
    let max_buffered = match &raw.max_buffered {
        None => DEFAULT_MAX_BUFFERED,
        Some(s) => parse_size("server.max_buffered", s, MAX_BUFFERED)? as usize,
    };
    if max_buffered < MIN_BUFFERED {
        return Err(ConfigError::invalid(
            "server.max_buffered",
            max_buffered.to_string(),
            "at least 64KiB (64MiB is the default)",
        ));
    }
    let tls = pem_pair(
        ("server.tls_cert", "server.tls_key"),
        raw.tls_cert,
        raw.tls_key,
    )?;
    let tls_client_ca = match raw.tls_client_ca {
        None => None,
        Some(_) if tls.is_none() => {
            return Err(ConfigError::invalid(
                "server.tls_client_ca",
                "(set)",
                "only with server.tls_cert and tls_key: client certificates are asked for in the TLS handshake",
            ))
        }
        Some(path) => Some(pem_file("server.tls_client_ca", path, "CERTIFICATE")?),
    };
    let tls_recheck = match raw.tls_recheck.as_deref() {
        None => Some(DEFAULT_TLS_RECHECK),
        Some(_) if tls.is_none() => {
            return Err(ConfigError::invalid(
                "server.tls_recheck",
                "(set)",
                "only with server.tls_cert and tls_key",
            ))
        }
        Some(raw) => match parse_duration("server.tls_recheck", raw)? {
            d if d.is_zero() => None,
            d if d < Duration::from_secs(1) => {
                return Err(ConfigError::invalid(
                    "server.tls_recheck",
                    raw,
                    "at least 1s, or 0 to read the files again only on SIGHUP",
                ))
            }
            d => Some(d),
        },
    };
    let mut trusted_proxies = Vec::new();
    for (i, raw) in raw
        .trusted_proxies
        .unwrap_or_default()
        .into_iter()
        .enumerate()
    {
        let field = format!("server.trusted_proxies[{i}]");
        let net = raw
            .parse::<ipnet::IpNet>()
            .or_else(|_| raw.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
            .map_err(|_| {
                ConfigError::invalid(
                    &field,
                    &raw,
                    "an IP address or CIDR range such as \"10.0.0.0/8\" or \"127.0.0.1\"",
                )
            })?;
        trusted_proxies.push(net.trunc());
    }
    Ok(ServerConfig {
        listen,
        admin,
        shutdown_grace,
        max_connections,
        workers,
        deadlines,
        max_streams,
        max_buffered,
        tls,
        tls_client_ca,
        tls_recheck,
        trusted_proxies,
        case_sensitive_routes: raw.case_sensitive_routes.unwrap_or(false),
    })
}

fn validate_store(raw: RawStore) -> Result<StoreConfig, ConfigError> {
    let backend = raw.backend.clone().unwrap_or_else(|| "memory".into());
    let only = |field: &str, set: bool, backend: &str| -> Result<(), ConfigError> {
        if set {
            Err(ConfigError::invalid(
                format!("store.{field}"),
                "(set)",
                format!("only with backend = \"{backend}\""),
            ))
        } else {
            Ok(())
        }
    };
    let not_disk = |raw: &RawStore| -> Result<(), ConfigError> {
        only("path", raw.path.is_some(), "disk")?;
        only("sync", raw.sync.is_some(), "disk")?;
        only("sync_interval", raw.sync_interval.is_some(), "disk")?;
        only("max_disk", raw.max_disk.is_some(), "disk")
    };
    let not_redis = |raw: &RawStore| -> Result<(), ConfigError> {
        only("url", raw.url.is_some(), "redis")?;
        only("cluster", raw.cluster.is_some(), "redis")?;
        only("key_prefix", raw.key_prefix.is_some(), "redis")?;
        only("command_timeout", raw.command_timeout.is_some(), "redis")?;
        only("tls_ca_file", raw.tls_ca_file.is_some(), "redis")?;
        only(
            "require_noeviction",
            raw.require_noeviction.is_some(),
            "redis",
        )?;
        only("tls_client_cert", raw.tls_client_cert.is_some(), "redis")?;
        only("tls_client_key", raw.tls_client_key.is_some(), "redis")
    };
    match backend.as_str() {
        "disk" => {
            not_redis(&raw)?;
            only("max_keys", raw.max_keys.is_some(), "memory")?;
            only("max_bytes", raw.max_bytes.is_some(), "memory")?;
            let path = match raw.path {
                Some(p) if !p.trim().is_empty() => std::path::PathBuf::from(p),
                Some(p) => {
                    return Err(ConfigError::invalid(
                        "store.path",
                        p,
                        "the directory that keeps the records, such as \"data\" or \"/var/lib/idemgate\"",
                    ))
                }
                None => {
                    return Err(ConfigError::Missing {
                        field: "store.path".into(),
                    })
                }
            };
            let interval = match &raw.sync_interval {
                None => Duration::from_millis(100),
                Some(s) => parse_duration("store.sync_interval", s)?,
            };
            if interval.is_zero() || interval > Duration::from_secs(10) {
                return Err(ConfigError::invalid(
                    "store.sync_interval",
                    humantime::format_duration(interval).to_string(),
                    "more than 0s and at most 10s",
                ));
            }
            let sync = match raw.sync.as_deref() {
                None | Some("always") => {
                    if raw.sync_interval.is_some() {
                        return Err(ConfigError::invalid(
                            "store.sync_interval",
                            "(set)",
                            "only with sync = \"batch\"",
                        ));
                    }
                    SyncMode::Always
                }
                Some("batch") => SyncMode::Batch { interval },
                Some(other) => {
                    return Err(ConfigError::invalid(
                        "store.sync",
                        other,
                        "\"always\" (a result is on disk before its client gets it) or \"batch\" (within sync_interval after)",
                    ))
                }
            };
            let max_disk = match raw.max_disk {
                None => 1 << 30,
                Some(s) => parse_size("store.max_disk", &s, MAX_DISK)?,
            };
            if max_disk < 1 << 20 {
                return Err(ConfigError::invalid(
                    "store.max_disk",
                    max_disk.to_string(),
                    "at least 1MiB",
                ));
            }
            Ok(StoreConfig::Disk(DiskSettings {
                path,
                sync,
                max_disk,
            }))
        }
        "memory" => {
            not_disk(&raw)?;
            not_redis(&raw)?;
            let max_keys = match raw.max_keys {
                None => 1_000_000,
                Some(n) if (1..=100_000_000).contains(&n) => n as usize,
                Some(n) => {
                    return Err(ConfigError::invalid(
                        "store.max_keys",
                        n.to_string(),
                        "a whole number from 1 to 100000000",
                    ))
                }
            };
            let max_bytes = match raw.max_bytes {
                None => 256 << 20,
                Some(s) => parse_size("store.max_bytes", &s, u64::MAX)?,
            };
            Ok(StoreConfig::Memory {
                max_keys,
                max_bytes,
            })
        }
        "redis" => {
            not_disk(&raw)?;
            only("max_keys", raw.max_keys.is_some(), "memory")?;
            only("max_bytes", raw.max_bytes.is_some(), "memory")?;
            let target = match (raw.url, raw.cluster) {
                (Some(url), None) => RedisTarget::Single(validate_redis_url("store.url", url)?),
                (None, Some(nodes)) if !nodes.is_empty() => RedisTarget::Cluster(
                    nodes
                        .into_iter()
                        .map(|u| validate_redis_url("store.cluster", u))
                        .collect::<Result<_, _>>()?,
                ),
                (None, Some(_)) => {
                    return Err(ConfigError::invalid(
                        "store.cluster",
                        "[]",
                        "a non-empty list of seed node URLs such as [\"redis://10.0.0.1:7000\"]",
                    ))
                }
                (Some(_), Some(_)) => {
                    return Err(ConfigError::invalid(
                        "store.cluster",
                        "(set together with store.url)",
                        "either store.url (one Redis) or store.cluster (Redis Cluster seed nodes), not both",
                    ))
                }
                (None, None) => {
                    return Err(ConfigError::Missing {
                        field: "store.url (or store.cluster)".into(),
                    })
                }
            };
            let key_prefix = raw.key_prefix.unwrap_or_else(|| "idemgate:".into());
            if key_prefix.contains(['{', '}']) || key_prefix.len() > 64 {
                return Err(ConfigError::invalid(
                    "store.key_prefix",
                    key_prefix,
                    "up to 64 characters without \"{\" or \"}\" (the gateway adds its own hash tag)",
                ));
            }
            let command_timeout = match raw.command_timeout {
                None => Duration::from_millis(500),
                Some(s) => parse_duration("store.command_timeout", &s)?,
            };
            if command_timeout.is_zero() || command_timeout > Duration::from_secs(60) {
                return Err(ConfigError::invalid(
                    "store.command_timeout",
                    humantime::format_duration(command_timeout).to_string(),
                    "more than 0s and at most 60s",
                ));
            }
            let tls_ca_file = raw
                .tls_ca_file
                .map(|p| pem_file("store.tls_ca_file", p, "CERTIFICATE"))
                .transpose()?;
            let tls_client = pem_pair(
                ("store.tls_client_cert", "store.tls_client_key"),
                raw.tls_client_cert,
                raw.tls_client_key,
            )?;
            Ok(StoreConfig::Redis(RedisSettings {
                target,
                key_prefix,
                command_timeout,
                tls_ca_file,
                require_noeviction: raw.require_noeviction.unwrap_or(false),
                tls_client,
            }))
        }
        other => Err(ConfigError::invalid(
            "store.backend",
            other,
            "\"disk\" (embedded and durable, one instance), \"memory\" (embedded, lost on restart) or \"redis\" (shared by several instances)",
        )),
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

fn validate_route(
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
    let own: RawRouteOwn = toml::Value::Table(own)
        .try_into()
        .map_err(|e: toml::de::Error| ConfigError::Syntax(format!("routes[{index}]: {e}")))?;
    let policy_raw: RawPolicy = toml::Value::Table(table)
        .try_into()
        .map_err(|e: toml::de::Error| ConfigError::Syntax(format!("routes[{index}]: {e}")))?;

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
    if let Some(p) = &own.protocol {
        upstream.protocol = UpstreamProtocol::parse(&at("protocol"), p)?;
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
    let name = match own.name {
        Some(n) if n.is_empty() || n.len() > 128 || n.chars().any(char::is_control) => {
            return Err(ConfigError::invalid(
                at("name"),
                n,
                "1 to 128 characters without control characters",
            ))
        }
        Some(n) => n,
        None => path.clone(),
    };
    let policy = apply_policy(&format!("routes[{index}]"), defaults, &policy_raw)?;
    let key = match own.key {
        None => KeySource::header(policy.key_header.clone()),
        Some(raw) => validate_key_source(&at("key"), raw)?,
    };
    let signature = match own.signature {
        None => None,
        Some(raw) => Some(validate_signature(&at("signature"), raw)?),
    };
    if let Some(sig) = signature.as_ref().filter(|s| s.scheme.is_timestamped()) {
        // A record that expires within the tolerance would let the same signed delivery, sent
        // again, run again.
        if policy.ttl < sig.tolerance {
            return Err(ConfigError::invalid(
                at("ttl"),
                humantime::format_duration(policy.ttl).to_string(),
                format!(
                    "at least the signature's tolerance ({}) on a signed route",
                    humantime::format_duration(sig.tolerance)
                ),
            ));
        }
    }
    Ok(RouteConfig {
        name,
        pattern,
        methods,
        upstream,
        fingerprint_ignore: IgnoredFields::new(&own.fingerprint_ignore),
        key,
        check_fingerprint: own.check_fingerprint.unwrap_or(true),
        signature,
        policy,
    })
}

/// A PEM file that must hold at least one `block` ("CERTIFICATE", or "PRIVATE KEY", which
/// also finds "RSA PRIVATE KEY" and "EC PRIVATE KEY"); errors name the file, never its content.
fn pem_file(field: &str, path: String, block: &str) -> Result<std::path::PathBuf, ConfigError> {
    let pem = std::fs::read_to_string(&path).map_err(|e| {
        ConfigError::invalid(field, &path, format!("a readable PEM file ({})", e.kind()))
    })?;
    if !pem.contains("-----BEGIN ") || !pem.contains(&format!("{block}-----")) {
        return Err(ConfigError::invalid(
            field,
            &path,
            format!("a PEM file with a {block} block"),
        ));
    }
    Ok(std::path::PathBuf::from(path))
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
            pem_file(cert_field, c, "CERTIFICATE")?,
            pem_file(key_field, k, "PRIVATE KEY")?,
        ))),
        (Some(_), None) => Err(ConfigError::Missing {
            field: format!("{key_field} (with {cert_field})"),
        }),
        (None, Some(_)) => Err(ConfigError::Missing {
            field: format!("{cert_field} (with {key_field})"),
        }),
    }
}

fn validate_upstream_tls(
    ca_file: Option<String>,
    client_cert: Option<String>,
    client_key: Option<String>,
    server_name: Option<String>,
) -> Result<UpstreamTls, ConfigError> {
    let ca_file = ca_file
        .map(|p| pem_file("upstream.tls_ca_file", p, "CERTIFICATE"))
        .transpose()?;
    let (client_cert, client_key) = match pem_pair(
        ("upstream.tls_client_cert", "upstream.tls_client_key"),
        client_cert,
        client_key,
    )? {
        Some((cert, key)) => (Some(cert), Some(key)),
        None => (None, None),
    };
    if let Some(name) = &server_name {
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
        server_name,
    })
}

/// At most this many secrets per route: each one is an HMAC over the whole body per delivery.
const MAX_SECRETS: usize = 8;

/// A route's `signature`: the scheme, and its secrets read now from the environment or files
/// (errors name the variable or file, never what is in it).
fn validate_signature(field: &str, raw: RawSignature) -> Result<SignatureConfig, ConfigError> {
    let f = |name: &str| format!("{field}.{name}");
    let schemes =
        "\"standard-webhooks\", \"github\", \"stripe\", \"shopify\", \"slack\" or \"hmac-sha256\"";
    let scheme_name = raw
        .scheme
        .ok_or_else(|| ConfigError::Missing { field: f("scheme") })?;
    let only_hmac = |name: &str, set: bool| {
        if set {
            Err(ConfigError::invalid(
                f(name),
                "(set)",
                "only with scheme = \"hmac-sha256\"; the other schemes name their own header",
            ))
        } else {
            Ok(())
        }
    };
    let scheme = match scheme_name.as_str() {
        "hmac-sha256" => {
            let header = raw
                .header
                .ok_or_else(|| ConfigError::Missing { field: f("header") })?;
            let base64 = match raw.encoding.as_deref() {
                None | Some("hex") => false,
                Some("base64") => true,
                Some(other) => {
                    return Err(ConfigError::invalid(
                        f("encoding"),
                        other,
                        "\"hex\" (the default) or \"base64\"",
                    ))
                }
            };
            SignatureScheme::Hmac {
                header: parse_header_name(&f("header"), &header)?,
                base64,
                prefix: raw.prefix.unwrap_or_default(),
            }
        }
        other => {
            only_hmac("header", raw.header.is_some())?;
            only_hmac("encoding", raw.encoding.is_some())?;
            only_hmac("prefix", raw.prefix.is_some())?;
            match other {
                "standard-webhooks" => SignatureScheme::StandardWebhooks,
                "github" => SignatureScheme::Github,
                "stripe" => SignatureScheme::Stripe,
                "shopify" => SignatureScheme::Shopify,
                "slack" => SignatureScheme::Slack,
                _ => return Err(ConfigError::invalid(f("scheme"), other, schemes)),
            }
        }
    };
    let tolerance = match raw.tolerance {
        None => Duration::from_secs(300),
        Some(_) if !scheme.is_timestamped() => {
            return Err(ConfigError::invalid(
                f("tolerance"),
                "(set)",
                format!(
                    "only for the schemes whose deliveries carry a timestamp (standard-webhooks, stripe, slack); {} has none",
                    scheme.name()
                ),
            ))
        }
        Some(s) => {
            let d = parse_duration(&f("tolerance"), &s)?;
            if d < Duration::from_secs(1) || d > Duration::from_secs(3600) {
                return Err(ConfigError::invalid(
                    f("tolerance"),
                    s,
                    "from \"1s\" to \"1h\" (the senders' libraries use 5 minutes)",
                ));
            }
            d
        }
    };
    let mut raw_secrets: Vec<(String, String)> = Vec::new();
    for name in raw.secret_env.map(OneOrMany::into_vec).unwrap_or_default() {
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
                &name,
                "the name of an environment variable that is set (it holds the signing secret)",
            )
        })?;
        raw_secrets.push((format!("{field} {name}"), value.trim().to_string()));
    }
    for path in raw.secret_file.map(OneOrMany::into_vec).unwrap_or_default() {
        let field = f("secret_file");
        let text = std::fs::read_to_string(&path).map_err(|e| {
            ConfigError::invalid(
                &field,
                &path,
                format!("a readable file holding the signing secret ({})", e.kind()),
            )
        })?;
        raw_secrets.push((format!("{field} {path}"), text.trim().to_string()));
    }
    if raw_secrets.is_empty() {
        return Err(ConfigError::Missing {
            field: format!("{field}.secret_env (or secret_file)"),
        });
    }
    if raw_secrets.len() > MAX_SECRETS {
        return Err(ConfigError::invalid(
            f("secret_env (and secret_file)"),
            format!("{} secrets", raw_secrets.len()),
            format!("at most {MAX_SECRETS} secrets (the current one and those being rotated out)"),
        ));
    }
    let mut secrets = Vec::with_capacity(raw_secrets.len());
    for (source, value) in raw_secrets {
        // Where the secret came from, never what it is.
        let bad = |why: &str| ConfigError::invalid(&source, "(its content)", why);
        if value.is_empty() {
            return Err(bad("a signing secret, not empty"));
        }
        let key = match scheme {
            // The key is the base64 after "whsec_" (the spec's format), not the text.
            SignatureScheme::StandardWebhooks => {
                use base64::Engine as _;
                let wrong = || {
                    bad("a Standard Webhooks secret: \"whsec_\" and the base64 of 24 to 64 bytes")
                };
                let b64 = value.strip_prefix("whsec_").ok_or_else(wrong)?;
                let key = base64::engine::general_purpose::STANDARD
                    .decode(b64)
                    .map_err(|_| wrong())?;
                // An empty key is one anyone can sign with.
                if !(24..=64).contains(&key.len()) {
                    return Err(wrong());
                }
                key
            }
            _ => value.into_bytes(),
        };
        secrets.push(Secret::new(key));
    }
    Ok(SignatureConfig {
        scheme,
        secrets,
        tolerance,
    })
}

fn validate_key_source(field: &str, raw: RawKey) -> Result<KeySource, ConfigError> {
    let headers = raw
        .header
        .map(OneOrMany::into_vec)
        .unwrap_or_default()
        .iter()
        .map(|h| parse_header_name(&format!("{field}.header"), h))
        .collect::<Result<Vec<_>, _>>()?;
    let pointers = raw.json.map(OneOrMany::into_vec).unwrap_or_default();
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
            "a header and/or JSON pointers: { header = \"webhook-id\" }, { json = \"/id\" }, { json = [\"/data/object/id\", \"/type\"] }",
        ));
    }
    if headers.len() + pointers.len() > 8 {
        return Err(ConfigError::invalid(
            field,
            "(more than 8 parts)",
            "at most 8 headers and pointers",
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

/// Applies the fields set in `raw` on top of `base`; `scope` prefixes field names in errors.
fn apply_policy(scope: &str, base: &Policy, raw: &RawPolicy) -> Result<Policy, ConfigError> {
    let f = |name: &str| format!("{scope}.{name}");
    let mut p = base.clone();
    if let Some(h) = &raw.key_header {
        p.key_header = parse_header_name(&f("key_header"), h)?;
    }
    if let Some(b) = raw.require_key {
        p.require_key = b;
    }
    if let Some(s) = &raw.ttl {
        p.ttl = parse_duration(&f("ttl"), s)?;
    }
    if let Some(s) = &raw.lock_timeout {
        p.lock_timeout = parse_duration(&f("lock_timeout"), s)?;
    }
    if let Some(s) = &raw.wait {
        p.wait = parse_duration(&f("wait"), s)?;
    }
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
    if let Some(b) = raw.require_client {
        p.require_client = b;
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
    if let Some(s) = &raw.max_body {
        p.max_body = parse_size(&f("max_body"), s, MAX_BUFFER_LIMIT)? as usize;
    }
    if let Some(s) = &raw.max_stored_response {
        p.max_stored_response =
            parse_size(&f("max_stored_response"), s, MAX_BUFFER_LIMIT)? as usize;
    }
    if let Some(s) = &raw.upstream_timeout {
        p.upstream_timeout = parse_duration(&f("upstream_timeout"), s)?;
    }
    if let Some(b) = raw.store_server_errors {
        p.store_server_errors = b;
    }
    if let Some(s) = &raw.on_store_error {
        p.on_store_error = match s.as_str() {
            "reject" => OnStoreError::Reject,
            "pass" => OnStoreError::Pass,
            _ => {
                return Err(ConfigError::invalid(
                    f("on_store_error"),
                    s,
                    "\"reject\" (503, fail closed; the default) or \"pass\" (forward without idempotency)",
                ))
            }
        };
    }
    if let Some(s) = &raw.on_unknown {
        p.on_unknown = match s.as_str() {
            "reject" => OnUnknown::Reject,
            "retry" => OnUnknown::Retry,
            _ => {
                return Err(ConfigError::invalid(
                    f("on_unknown"),
                    s,
                    "\"reject\" (never re-execute an unknown outcome; the default) or \"retry\" (only for upstreams that are safe to run twice)",
                ))
            }
        };
    }

    // Cross-field rules, checked on the merged result so a route cannot break them by halves.
    if p.ttl < MIN_TTL {
        return Err(ConfigError::invalid(
            f("ttl"),
            humantime::format_duration(p.ttl).to_string(),
            "at least 1s; keep it longer than your clients retry (24h is the default)",
        ));
    }
    if p.ttl > MAX_TTL {
        return Err(ConfigError::invalid(
            f("ttl"),
            humantime::format_duration(p.ttl).to_string(),
            "at most \"365days\"",
        ));
    }
    if p.upstream_timeout > Duration::from_secs(3600) {
        return Err(ConfigError::invalid(
            f("upstream_timeout"),
            humantime::format_duration(p.upstream_timeout).to_string(),
            "at most \"1h\"",
        ));
    }
    if p.lock_timeout.is_zero() || p.lock_timeout > p.ttl {
        return Err(ConfigError::invalid(
            f("lock_timeout"),
            humantime::format_duration(p.lock_timeout).to_string(),
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
            humantime::format_duration(p.ttl).to_string(),
            format!(
                "at least upstream_timeout + lock_timeout ({})",
                humantime::format_duration(p.upstream_timeout + p.lock_timeout)
            ),
        ));
    }
    if p.wait > Duration::from_secs(600) {
        return Err(ConfigError::invalid(
            f("wait"),
            humantime::format_duration(p.wait).to_string(),
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
    if p.key_header == p.replay_header {
        return Err(ConfigError::invalid(
            f("replay_header"),
            p.replay_header.as_str(),
            "a header name other than key_header",
        ));
    }
    if p.require_client && p.client_headers.is_empty() {
        return Err(ConfigError::invalid(
            f("require_client"),
            "true",
            "false while client_header = \"\" (no header names a client to require)",
        ));
    }
    Ok(p)
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

/// Parses "250ms", "30s", "24h", "1h 30m".
fn parse_duration(field: &str, raw: &str) -> Result<Duration, ConfigError> {
    humantime::parse_duration(raw).map_err(|_| {
        ConfigError::invalid(
            field,
            raw,
            "a duration such as \"250ms\", \"30s\", \"5m\" or \"24h\"",
        )
    })
}

fn parse_size(field: &str, raw: &RawSize, max: u64) -> Result<u64, ConfigError> {
    let allowed =
        || format!("a size such as \"512KiB\", \"1MiB\" or a byte count, at most {max} bytes");
    let bytes = match raw {
        RawSize::Bytes(n) => {
            u64::try_from(*n).map_err(|_| ConfigError::invalid(field, n.to_string(), allowed()))?
        }
        RawSize::Text(s) => s
            .trim()
            .parse::<bytesize::ByteSize>()
            .map_err(|_| ConfigError::invalid(field, s, allowed()))?
            .as_u64(),
    };
    if bytes > max {
        let shown = match raw {
            RawSize::Bytes(n) => n.to_string(),
            RawSize::Text(s) => s.clone(),
        };
        return Err(ConfigError::invalid(field, shown, allowed()));
    }
    Ok(bytes)
}

/// One upstream (scheme, host and port), one protocol: its connections are pooled together,
/// whichever route made them.
fn check_protocols(default: &UpstreamUrl, routes: &[RouteConfig]) -> Result<(), ConfigError> {
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

fn check_unique_names(routes: &[RouteConfig]) -> Result<(), ConfigError> {
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

fn check_overlaps(routes: &[RouteConfig]) -> Result<(), ConfigError> {
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
