//! The config file as written: serde structs that refuse unknown keys, every field optional,
//! each value already of its type (durations, sizes, choices), nothing else checked yet.
//! [`super::validate`] turns them into a [`super::Config`]: ranges, defaults and the rules
//! between fields.
//!
//! A value of the wrong kind (`ttl = "soon"`, `sync = "fsync"`) is a [`ConfigError::Invalid`]
//! naming the field, the value and what is allowed; an unknown or mistyped key is a
//! [`ConfigError::Syntax`] with its line and column.

use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer};

use super::{ConfigError, OnStoreError, OnUnknown, UpstreamProtocol};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    pub(super) server: Option<RawServer>,
    #[serde(default)]
    pub(super) store: RawStore,
    pub(super) upstream: Option<RawUpstream>,
    #[serde(default)]
    pub(super) defaults: RawPolicy,
    #[serde(default)]
    pub(super) routes: Vec<toml::Table>,
    #[serde(default)]
    pub(super) consumers: Vec<RawConsumer>,
    pub(super) telemetry: Option<super::telemetry::RawTelemetry>,
}

/// One `[[consumers]]` entry.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConsumer {
    pub(super) name: Option<String>,
    pub(super) source: Option<RawSource>,
    pub(super) handler: Option<String>,
    #[serde(default, deserialize_with = "typed")]
    pub(super) protocol: Option<UpstreamProtocol>,
    pub(super) key: Option<RawMessageKey>,
    pub(super) check_fingerprint: Option<bool>,
    pub(super) body_field: Option<String>,
    pub(super) content_type: Option<String>,
    pub(super) concurrency: Option<i64>,
    pub(super) max_attempts: Option<i64>,
    #[serde(default, deserialize_with = "duration")]
    pub(super) backoff: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    pub(super) max_backoff: Option<Duration>,
    // The policy keys that mean something for a message (the rest are about HTTP clients).
    #[serde(default, deserialize_with = "duration")]
    pub(super) ttl: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    pub(super) lock_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    pub(super) wait: Option<Duration>,
    #[serde(default, deserialize_with = "size")]
    pub(super) max_body: Option<Size>,
    #[serde(default, deserialize_with = "size")]
    pub(super) max_stored_response: Option<Size>,
    #[serde(default, deserialize_with = "duration")]
    pub(super) upstream_timeout: Option<Duration>,
    pub(super) store_server_errors: Option<bool>,
    pub(super) unknown_statuses: Option<Vec<i64>>,
    #[serde(default, deserialize_with = "typed")]
    pub(super) on_unknown: Option<OnUnknown>,
    pub(super) reconcile: Option<RawReconcile>,
}

/// `source = { redis_stream = "orders", group = "idemgate" }`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSource {
    pub(super) redis_stream: Option<String>,
    pub(super) group: Option<String>,
    pub(super) url: Option<String>,
    pub(super) dead_letter: Option<String>,
    #[serde(default, deserialize_with = "duration")]
    pub(super) claim_idle: Option<Duration>,
    pub(super) nats_stream: Option<String>,
    pub(super) subject: Option<String>,
    pub(super) durable: Option<String>,
    #[serde(default, deserialize_with = "duration")]
    pub(super) ack_wait: Option<Duration>,
    pub(super) rabbitmq_queue: Option<String>,
    pub(super) tls_ca_file: Option<String>,
    pub(super) kafka_topic: Option<String>,
    pub(super) brokers: Option<Vec<String>>,
    pub(super) options: Option<std::collections::BTreeMap<String, String>>,
}

/// A consumer's `key`: JSON pointers into the body and/or fields of the entry.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMessageKey {
    pub(super) field: Option<OneOrMany>,
    pub(super) json: Option<OneOrMany>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServer {
    #[serde(default, deserialize_with = "typed")]
    pub(super) listen: Option<std::net::SocketAddr>,
    #[serde(default, deserialize_with = "typed")]
    pub(super) admin: Option<std::net::SocketAddr>,
    pub(super) admin_token_env: Option<String>,
    pub(super) admin_token_file: Option<String>,
    #[serde(default, deserialize_with = "duration")]
    pub(super) shutdown_grace: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    pub(super) drain_delay: Option<Duration>,
    pub(super) max_connections: Option<i64>,
    pub(super) workers: Option<i64>,
    #[serde(default, deserialize_with = "duration")]
    pub(super) header_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    pub(super) body_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    pub(super) idle_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    pub(super) send_timeout: Option<Duration>,
    pub(super) max_streams: Option<i64>,
    #[serde(default, deserialize_with = "size")]
    pub(super) max_buffered: Option<Size>,
    #[serde(default, deserialize_with = "size")]
    pub(super) max_header_bytes: Option<Size>,
    pub(super) tls_cert: Option<String>,
    pub(super) tls_key: Option<String>,
    pub(super) tls_client_ca: Option<String>,
    #[serde(default, deserialize_with = "duration")]
    pub(super) tls_recheck: Option<Duration>,
    pub(super) trusted_proxies: Option<Vec<String>>,
    pub(super) case_sensitive_routes: Option<bool>,
    pub(super) method_override_header: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStore {
    #[serde(default, deserialize_with = "typed")]
    pub(super) backend: Option<Backend>,
    pub(super) max_keys: Option<i64>,
    #[serde(default, deserialize_with = "size")]
    pub(super) max_bytes: Option<Size>,
    pub(super) url: Option<String>,
    pub(super) cluster: Option<Vec<String>>,
    pub(super) sentinels: Option<Vec<String>>,
    pub(super) master: Option<String>,
    pub(super) key_prefix: Option<String>,
    #[serde(default, deserialize_with = "duration")]
    pub(super) command_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    pub(super) max_clock_skew: Option<Duration>,
    pub(super) tls_ca_file: Option<String>,
    pub(super) require_noeviction: Option<bool>,
    pub(super) allow_async_commit: Option<bool>,
    pub(super) tls_client_cert: Option<String>,
    pub(super) tls_client_key: Option<String>,
    pub(super) min_replicas: Option<i64>,
    pub(super) encryption_keys_file: Option<String>,
    pub(super) encryption_keys_env: Option<String>,
    #[serde(default, deserialize_with = "duration")]
    pub(super) replica_timeout: Option<Duration>,
    pub(super) table: Option<String>,
    pub(super) pool_size: Option<i64>,
    pub(super) path: Option<String>,
    #[serde(default, deserialize_with = "typed")]
    pub(super) sync: Option<Sync>,
    #[serde(default, deserialize_with = "duration")]
    pub(super) sync_interval: Option<Duration>,
    #[serde(default, deserialize_with = "size")]
    pub(super) max_disk: Option<Size>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawUpstream {
    pub(super) url: Option<String>,
    #[serde(default, deserialize_with = "typed")]
    pub(super) protocol: Option<UpstreamProtocol>,
    pub(super) max_connections: Option<i64>,
    #[serde(default, deserialize_with = "duration")]
    pub(super) idle_timeout: Option<Duration>,
    pub(super) tls_ca_file: Option<String>,
    pub(super) tls_client_cert: Option<String>,
    pub(super) tls_client_key: Option<String>,
    pub(super) tls_server_name: Option<String>,
}

/// `reconcile = { url = "...{key}...", after = "30s" }`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawReconcile {
    pub(super) url: String,
    #[serde(default, deserialize_with = "duration")]
    pub(super) after: Option<Duration>,
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPolicy {
    pub(super) key_header: Option<String>,
    pub(super) fingerprint_headers: Option<Vec<String>>,
    pub(super) require_key: Option<bool>,
    #[serde(default, deserialize_with = "duration")]
    pub(super) ttl: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    pub(super) lock_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    pub(super) wait: Option<Duration>,
    pub(super) max_waiters: Option<i64>,
    pub(super) mismatch_status: Option<i64>,
    pub(super) replay_header: Option<String>,
    pub(super) client_header: Option<OneOrMany>,
    pub(super) client_jwt: Option<RawClientJwt>,
    pub(super) require_client: Option<bool>,
    pub(super) max_keys_per_client: Option<i64>,
    pub(super) max_keys_anonymous: Option<i64>,
    pub(super) anonymous_share: Option<i64>,
    pub(super) reconcile: Option<RawReconcile>,
    #[serde(default, deserialize_with = "size")]
    pub(super) max_body: Option<Size>,
    #[serde(default, deserialize_with = "size")]
    pub(super) max_stored_response: Option<Size>,
    #[serde(default, deserialize_with = "duration")]
    pub(super) upstream_timeout: Option<Duration>,
    pub(super) store_server_errors: Option<bool>,
    pub(super) unknown_statuses: Option<Vec<i64>>,
    #[serde(default, deserialize_with = "typed")]
    pub(super) on_store_error: Option<OnStoreError>,
    #[serde(default, deserialize_with = "typed")]
    pub(super) on_unknown: Option<OnUnknown>,
    pub(super) retry_hint_headers: Option<Vec<String>>,
    pub(super) error_body: Option<RawErrorBody>,
}

/// An `error_body` table, as written.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawErrorBody {
    pub(super) content_type: Option<String>,
    pub(super) template: String,
}

/// A `client_jwt` table, as written.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawClientJwt {
    pub(super) jwks_url: Option<String>,
    pub(super) jwks_file: Option<String>,
    pub(super) hmac_secret_env: Option<String>,
    pub(super) hmac_secret_file: Option<String>,
    pub(super) issuer: Option<OneOrMany>,
    pub(super) audience: Option<String>,
    pub(super) claims: Option<Vec<String>>,
    pub(super) header: Option<String>,
    #[serde(default, deserialize_with = "duration")]
    pub(super) leeway: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    pub(super) refresh: Option<Duration>,
}

/// The route-only keys of a `[[routes]]` table; the rest of the table is a [`RawPolicy`].
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRouteOwn {
    pub(super) name: Option<String>,
    pub(super) path: Option<String>,
    pub(super) methods: Option<Vec<String>>,
    pub(super) upstream: Option<String>,
    #[serde(default, deserialize_with = "typed")]
    pub(super) protocol: Option<UpstreamProtocol>,
    #[serde(default)]
    pub(super) fingerprint_ignore: Vec<String>,
    pub(super) key: Option<RawKey>,
    pub(super) check_fingerprint: Option<bool>,
    pub(super) unchecked_header_key: Option<bool>,
    pub(super) signature: Option<RawSignature>,
}

/// `signature = { scheme = "...", secret_env = "NAME" }` on a route.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSignature {
    #[serde(default, deserialize_with = "typed")]
    pub(super) scheme: Option<Scheme>,
    pub(super) secret_env: Option<OneOrMany>,
    pub(super) secret_file: Option<OneOrMany>,
    #[serde(default, deserialize_with = "duration")]
    pub(super) tolerance: Option<Duration>,
    /// `hmac-sha256` only.
    pub(super) header: Option<String>,
    #[serde(default, deserialize_with = "typed")]
    pub(super) encoding: Option<Encoding>,
    pub(super) prefix: Option<String>,
}

/// `key = { header = "webhook-id" }`, `key = { json = ["/data/object/id", "/type"] }`, or both.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawKey {
    pub(super) header: Option<OneOrMany>,
    pub(super) json: Option<OneOrMany>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub(super) enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    pub(super) fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

pub(super) const ROUTE_OWN_KEYS: &[&str] = &[
    "name",
    "path",
    "methods",
    "upstream",
    "protocol",
    "fingerprint_ignore",
    "key",
    "check_fingerprint",
    "unchecked_header_key",
    "signature",
];

/// `store.backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum Backend {
    Disk,
    Memory,
    Redis,
    Postgres,
}

/// `store.sync`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum Sync {
    Always,
    Batch,
}

/// A signature's `scheme`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(super) enum Scheme {
    StandardWebhooks,
    Github,
    Stripe,
    Shopify,
    Slack,
    HmacSha256,
}

/// An `hmac-sha256` signature's `encoding`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum Encoding {
    Hex,
    Base64,
}

/// What a rejected value of a kind is told is allowed instead.
pub(super) trait Allowed {
    const ALLOWED: &'static str;
}

/// Each kind's [`Allowed`] text.
macro_rules! allowed {
    ($($kind:ty => $text:expr),* $(,)?) => {$(
        impl Allowed for $kind {
            const ALLOWED: &'static str = $text;
        }
    )*};
}

allowed! {
    Backend => "\"disk\" (embedded and durable, one instance), \"memory\" (embedded, lost on restart) \"redis\" or \"postgres\" (shared by several instances)",
    Sync => "\"always\" (a result is on disk before its client gets it) or \"batch\" (within sync_interval after)",
    Scheme => "\"standard-webhooks\", \"github\", \"stripe\", \"shopify\", \"slack\" or \"hmac-sha256\"",
    Encoding => "\"hex\" (the default) or \"base64\"",
    UpstreamProtocol => "\"auto\" (HTTP/2 or HTTP/1.1 by ALPN over TLS, HTTP/1.1 in cleartext), \"http1\" or \"http2\" (prior knowledge in cleartext)",
    OnStoreError => "\"reject\" (503, fail closed; the default) or \"pass\" (forward without idempotency)",
    OnUnknown => "\"reject\" (never re-execute an unknown outcome; the default) or \"retry\" (only for upstreams that are safe to run twice)",
    std::net::SocketAddr => "an IP address and port such as \"127.0.0.1:8080\" or \"[::]:8080\"",
}

const DURATION: &str = "a duration such as \"250ms\", \"30s\", \"5m\" or \"24h\"";
pub(super) const SIZE: &str = "a size such as \"512KiB\", \"1MiB\" or a byte count";

/// Opens every message of ours in serde's string-only error channel, so that [`parse`] can
/// tell a value outside what is allowed from a structural error.
const REJECTED: &str = "\u{1}";

fn rejected<E: serde::de::Error>(allowed: &str) -> E {
    E::custom(format_args!("{REJECTED}{allowed}"))
}

/// A value of kind `T`, or a rejection saying what `T` allows.
fn typed<'de, D: Deserializer<'de>, T: Deserialize<'de> + Allowed>(
    d: D,
) -> Result<Option<T>, D::Error> {
    Option::<T>::deserialize(d).map_err(|_| rejected(T::ALLOWED))
}

/// `"250ms"`, `"30s"`, `"24h"`, `"1h 30m"` (humantime's syntax).
fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    humantime_serde::option::deserialize(d).map_err(|_| rejected(DURATION))
}

/// A size, and how it was written (what a message about its range shows).
#[derive(Debug, Clone)]
pub(super) struct Size {
    pub(super) bytes: u64,
    pub(super) written: String,
}

/// A byte count (`1048576`) or a size with a unit (`"1MiB"`).
fn size<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Size>, D::Error> {
    let Some(value) = Option::<toml::Value>::deserialize(d)? else {
        return Ok(None);
    };
    let written = match &value {
        toml::Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let bytes = bytesize::ByteSize::deserialize(value).map_err(|_| rejected(SIZE))?;
    Ok(Some(Size {
        bytes: bytes.as_u64(),
        written,
    }))
}

/// The whole file.
pub(super) fn parse(text: &str) -> Result<RawConfig, ConfigError> {
    serde_path_to_error::deserialize(toml::Deserializer::new(text)).map_err(|e| {
        let field = e.path().to_string();
        let e = e.into_inner();
        match e.message().strip_prefix(REJECTED) {
            // A rejection means the text parsed: its value can be looked up.
            Some(allowed) => {
                let root = text.parse::<toml::Table>().map(toml::Value::Table).ok();
                let value = root.as_ref().and_then(|root| value_at(root, &field));
                rejection(field, value, allowed)
            }
            None => syntax_error(text, &e),
        }
    })
}

/// A part of a table that serde could not take in one pass (a route's own keys, and its
/// policy); `at` names the table in errors.
pub(super) fn from_table<T: DeserializeOwned>(
    at: &str,
    table: toml::Table,
) -> Result<T, ConfigError> {
    let root = toml::Value::Table(table);
    serde_path_to_error::deserialize(root.clone()).map_err(|e| {
        let path = e.path().to_string();
        let e = e.into_inner();
        match e.message().strip_prefix(REJECTED) {
            Some(allowed) => rejection(format!("{at}.{path}"), value_at(&root, &path), allowed),
            None => {
                ConfigError::Syntax(format!("{at}: {}", without_values(e.message().trim_end())))
            }
        }
    })
}

/// `field`, the value found there, and what is allowed.
fn rejection(field: String, value: Option<&toml::Value>, allowed: &str) -> ConfigError {
    // As written, but a URL's credentials: a rejected value is shown to say what was wrong.
    let value = value
        .map(|v| match v {
            toml::Value::String(s) => super::redact_url(s),
            // An array or a table where a single value goes: its kind, not its strings.
            toml::Value::Array(_) => "(an array)".into(),
            toml::Value::Table(_) => "(a table)".into(),
            other => other.to_string(),
        })
        .unwrap_or_default();
    ConfigError::Invalid {
        field,
        value,
        allowed: allowed.to_string(),
    }
}

/// The value at `routes[0].signature.scheme` in `root` (a path as serde_path_to_error writes it).
fn value_at<'a>(root: &'a toml::Value, path: &str) -> Option<&'a toml::Value> {
    path.split('.').try_fold(root, |v, part| {
        let (key, index) = match part.split_once('[') {
            Some((key, rest)) => (key, rest.strip_suffix(']')?.parse::<usize>().ok()),
            None => (part, None),
        };
        let v = v.get(key)?;
        match index {
            Some(i) => v.get(i),
            None => Some(v),
        }
    })
}

/// The parser's message and where, without the quoted source line: that line may hold a
/// password (`url = "redis://:secret@..."`), and these errors are printed and logged.
fn syntax_error(text: &str, e: &toml::de::Error) -> ConfigError {
    let at = e
        .span()
        .map(|span| {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
            format!(" (line {line}, column {column})")
        })
        .unwrap_or_default();
    ConfigError::Syntax(format!("{}{at}", without_values(e.message().trim_end())))
}

/// A deserializer's message without the values it quotes: `invalid type: string "redis://:pw@h",
/// expected a sequence` names a password when a URL is written where a list goes. Strings and
/// characters (serde's `string "..."`, `'c'`) and unknown variants (`` `...` ``) become their
/// kind; field names, numbers and what was expected stay.
fn without_values(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    loop {
        let next = [
            ("string \"", '"', "a string"),
            ("variant `", '`', "variant"),
            // A number or a flag can be a secret too (`sasl.password = 12345678`).
            ("integer `", '\'', "an integer"),
            ("floating point `", '\'', "a number"),
            ("boolean `", '\'', "a boolean"),
            ("character `", '\'', "a character"),
        ]
        .into_iter()
        .filter_map(|(open, close, kind)| rest.find(open).map(|at| (at, open, close, kind)))
        .min_by_key(|found| found.0);
        let Some((at, open, close, kind)) = next else {
            out.push_str(rest);
            return out;
        };
        out.push_str(&rest[..at]);
        out.push_str(kind);
        // To the closing quote, past escaped ones (a variant's is not escaped by serde: to the
        // last "`, expected" after it); an unclosed one hides the rest.
        let quoted = &rest[at + open.len()..];
        let end = match close {
            '"' => {
                let mut escaped = false;
                quoted.char_indices().find_map(|(i, c)| {
                    let closes = c == '"' && !escaped;
                    escaped = !escaped && c == '\\';
                    closes.then_some(i + 1)
                })
            }
            // A scalar's text holds no backtick: to the next one.
            '\'' => quoted.find('`').map(|i| i + 1),
            _ => quoted.rfind("`, expected").map(|i| i + 1),
        };
        match end {
            Some(end) => rest = &quoted[end..],
            None => return out,
        }
    }
}
