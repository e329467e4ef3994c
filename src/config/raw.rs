//! The config file as written: serde structs that refuse unknown keys, every field optional,
//! nothing checked yet. [`super::validate`] turns them into a [`super::Config`].

use serde::Deserialize;

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
}

/// One `[[consumers]]` entry.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConsumer {
    pub(super) name: Option<String>,
    pub(super) source: Option<RawSource>,
    pub(super) handler: Option<String>,
    pub(super) protocol: Option<String>,
    pub(super) key: Option<RawMessageKey>,
    pub(super) check_fingerprint: Option<bool>,
    pub(super) body_field: Option<String>,
    pub(super) content_type: Option<String>,
    pub(super) concurrency: Option<i64>,
    pub(super) max_attempts: Option<i64>,
    pub(super) backoff: Option<String>,
    pub(super) max_backoff: Option<String>,
    // The policy keys that mean something for a message (the rest are about HTTP clients).
    pub(super) ttl: Option<String>,
    pub(super) lock_timeout: Option<String>,
    pub(super) wait: Option<String>,
    pub(super) max_body: Option<RawSize>,
    pub(super) max_stored_response: Option<RawSize>,
    pub(super) upstream_timeout: Option<String>,
    pub(super) store_server_errors: Option<bool>,
    pub(super) on_unknown: Option<String>,
}

/// `source = { redis_stream = "orders", group = "idemgate" }`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSource {
    pub(super) redis_stream: Option<String>,
    pub(super) group: Option<String>,
    pub(super) url: Option<String>,
    pub(super) dead_letter: Option<String>,
    pub(super) claim_idle: Option<String>,
    pub(super) nats_stream: Option<String>,
    pub(super) subject: Option<String>,
    pub(super) durable: Option<String>,
    pub(super) ack_wait: Option<String>,
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
    pub(super) listen: Option<String>,
    pub(super) admin: Option<String>,
    pub(super) shutdown_grace: Option<String>,
    pub(super) max_connections: Option<i64>,
    pub(super) workers: Option<i64>,
    pub(super) header_timeout: Option<String>,
    pub(super) body_timeout: Option<String>,
    pub(super) idle_timeout: Option<String>,
    pub(super) send_timeout: Option<String>,
    pub(super) max_streams: Option<i64>,
    pub(super) max_buffered: Option<RawSize>,
    pub(super) tls_cert: Option<String>,
    pub(super) tls_key: Option<String>,
    pub(super) tls_client_ca: Option<String>,
    pub(super) tls_recheck: Option<String>,
    pub(super) trusted_proxies: Option<Vec<String>>,
    pub(super) case_sensitive_routes: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStore {
    pub(super) backend: Option<String>,
    pub(super) max_keys: Option<i64>,
    pub(super) max_bytes: Option<RawSize>,
    pub(super) url: Option<String>,
    pub(super) cluster: Option<Vec<String>>,
    pub(super) key_prefix: Option<String>,
    pub(super) command_timeout: Option<String>,
    pub(super) tls_ca_file: Option<String>,
    pub(super) require_noeviction: Option<bool>,
    pub(super) tls_client_cert: Option<String>,
    pub(super) tls_client_key: Option<String>,
    pub(super) path: Option<String>,
    pub(super) sync: Option<String>,
    pub(super) sync_interval: Option<String>,
    pub(super) max_disk: Option<RawSize>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawUpstream {
    pub(super) url: Option<String>,
    pub(super) protocol: Option<String>,
    pub(super) max_connections: Option<i64>,
    pub(super) tls_ca_file: Option<String>,
    pub(super) tls_client_cert: Option<String>,
    pub(super) tls_client_key: Option<String>,
    pub(super) tls_server_name: Option<String>,
}

/// A size written as a byte count (`1048576`) or with a unit (`"1MiB"`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub(super) enum RawSize {
    Bytes(i64),
    Text(String),
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPolicy {
    pub(super) key_header: Option<String>,
    pub(super) require_key: Option<bool>,
    pub(super) ttl: Option<String>,
    pub(super) lock_timeout: Option<String>,
    pub(super) wait: Option<String>,
    pub(super) max_waiters: Option<i64>,
    pub(super) mismatch_status: Option<i64>,
    pub(super) replay_header: Option<String>,
    pub(super) client_header: Option<OneOrMany>,
    pub(super) require_client: Option<bool>,
    pub(super) max_keys_per_client: Option<i64>,
    pub(super) max_keys_anonymous: Option<i64>,
    pub(super) max_body: Option<RawSize>,
    pub(super) max_stored_response: Option<RawSize>,
    pub(super) upstream_timeout: Option<String>,
    pub(super) store_server_errors: Option<bool>,
    pub(super) on_store_error: Option<String>,
    pub(super) on_unknown: Option<String>,
}

/// The route-only keys of a `[[routes]]` table; the rest of the table is a [`RawPolicy`].
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRouteOwn {
    pub(super) name: Option<String>,
    pub(super) path: Option<String>,
    pub(super) methods: Option<Vec<String>>,
    pub(super) upstream: Option<String>,
    pub(super) protocol: Option<String>,
    #[serde(default)]
    pub(super) fingerprint_ignore: Vec<String>,
    pub(super) key: Option<RawKey>,
    pub(super) check_fingerprint: Option<bool>,
    pub(super) signature: Option<RawSignature>,
}

/// `signature = { scheme = "...", secret_env = "NAME" }` on a route.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSignature {
    pub(super) scheme: Option<String>,
    pub(super) secret_env: Option<OneOrMany>,
    pub(super) secret_file: Option<OneOrMany>,
    pub(super) tolerance: Option<String>,
    /// `hmac-sha256` only.
    pub(super) header: Option<String>,
    pub(super) encoding: Option<String>,
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
    "signature",
];
