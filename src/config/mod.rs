//! Configuration: `proxy.toml` -> raw serde structs ([`raw`], unknown keys rejected) ->
//! validated [`Config`] ([`validate`]). What is here is data: the running gateway keeps its live
//! state (metric handles, connections) beside it, never in it.
//!
//! Precedence for every policy field: the route's own value, else `[defaults]`, else the built-in
//! default listed in [`Policy::builtin`]. Every rejection is a [`ConfigError`] naming the field, the
//! bad value and what is allowed, and happens before anything listens.

pub mod answers;
pub mod client;
pub mod identity;
mod raw;
mod redact;
pub use redact::{redact_url, shown_name};
mod store;
pub mod telemetry;

pub use store::{
    DiskSettings, PostgresSettings, RedisSettings, RedisTarget, ReplicaAcks, StoreConfig, SyncMode,
};
mod validate;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use http::{HeaderName, Method, StatusCode, Uri};

use crate::fingerprint::IgnoredFields;
use crate::key::KeySource;
use crate::route::RoutePattern;

/// Why a configuration was refused. Each message names the field, the value and what is allowed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {reason}")]
    Read { path: String, reason: String },
    #[error("config is not valid TOML or has an unknown or mistyped key: {0}")]
    Syntax(String),
    #[error("{field} = {value:?} is invalid: {allowed}")]
    Invalid {
        field: String,
        value: String,
        allowed: String,
    },
    #[error("{field} is required")]
    Missing { field: String },
    #[error("routes {first:?} and {second:?} overlap for method {method}: a request to {example:?} would match both; make one of them more specific or split the methods")]
    Overlap {
        first: String,
        second: String,
        method: String,
        example: String,
    },
    #[error(
        "routes[{index}].name = {name:?} is used by another route; route names must be unique"
    )]
    DuplicateName { index: usize, name: String },
}

impl ConfigError {
    fn invalid(
        field: impl Into<String>,
        value: impl Into<String>,
        allowed: impl Into<String>,
    ) -> Self {
        ConfigError::Invalid {
            field: field.into(),
            value: value.into(),
            allowed: allowed.into(),
        }
    }
}

/// The whole validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub server: ServerConfig,
    pub store: StoreConfig,
    pub upstream: UpstreamUrl,
    /// `[upstream] max_connections`: the cap on connections to each upstream (host and port),
    /// across workers; fixed at startup.
    pub upstream_max_connections: usize,
    /// `[upstream] idle_timeout`: idle upstream connections older than this are closed rather
    /// than reused; fixed at startup.
    pub upstream_idle_timeout: Duration,
    /// `[upstream] tls_*`: for every `https://` upstream.
    pub upstream_tls: UpstreamTls,
    /// `[defaults]` over the built-ins: what pass-through traffic outside any route uses.
    pub defaults: Policy,
    pub routes: Vec<RouteConfig>,
    /// `[[consumers]]`: broker messages delivered to a handler through the same core.
    pub consumers: Vec<ConsumerConfig>,
    /// `[telemetry]`: traces over OTLP; `None`, the default, exports nothing.
    pub telemetry: Option<telemetry::Telemetry>,
    /// `store.encryption_keys_file` or `_env`: where the keys that seal stored answers are
    /// ([`crate::store::seal`]); `None`, the default, stores them in the clear.
    pub store_keys: Option<TokenSource>,
}

/// One `[[consumers]]` entry, validated ([`crate::consumer`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ConsumerConfig {
    /// Part of every stored key (as a route's name is), and the metrics' `consumer` label.
    pub name: String,
    pub source: SourceConfig,
    /// Where each message is POSTed: the whole URL, path included.
    pub handler: UpstreamUrl,
    /// The message's key: entry fields (as [`KeySource::headers`]) and JSON pointers.
    pub key: KeySource,
    pub check_fingerprint: bool,
    /// The entry field that holds the handler's request body.
    pub body_field: String,
    pub content_type: http::HeaderValue,
    /// Messages handled at once; no more are read while this many are.
    pub concurrency: usize,
    /// Deliveries of one message before it goes to the dead-letter stream.
    pub max_attempts: u64,
    /// The first retry's delay; doubled at each retry up to `max_backoff`, with jitter.
    pub backoff: Duration,
    pub max_backoff: Duration,
    pub policy: Policy,
}

/// Where a consumer reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceConfig {
    /// A Redis stream, read by a consumer group (XREADGROUP), entries acknowledged with XACK.
    RedisStream {
        stream: String,
        group: String,
        /// The Redis: `[store]`'s unless `url` is given.
        redis: RedisSettings,
        /// Where failed entries go, with their reason (`<stream>:dead` by default).
        dead_letter: String,
        /// Entries unacknowledged this long were left by a consumer that died: taken over.
        claim_idle: Duration,
    },
    /// A NATS JetStream stream, read by a durable pull consumer that every instance shares.
    NatsStream(NatsSource),
    /// A RabbitMQ queue, consumed with manual acknowledgement by every instance.
    RabbitQueue(RabbitSource),
    /// A Kafka topic, read by a consumer group whose offsets move only past finished messages.
    KafkaTopic(KafkaSource),
}

/// A consumer's NATS JetStream stream: what [`crate::consumer::NatsStream`] reads. Its `Debug`
/// shows the URL without its credentials.
#[derive(Clone, PartialEq, Eq)]
pub struct NatsSource {
    pub url: String,
    pub stream: String,
    /// Only messages on this subject (a filter of the stream's subjects).
    pub subject: Option<String>,
    pub durable: String,
    /// The subject failed messages are published to (a stream must capture it).
    pub dead_letter: String,
    /// A message unacknowledged this long is delivered again (to any instance).
    pub ack_wait: Duration,
}

/// `source = { rabbitmq_queue = "orders", url = "amqp://...", dead_letter = "orders.dead" }`.
/// Its `Debug` shows the URL without its credentials.
#[derive(Clone, PartialEq, Eq)]
pub struct RabbitSource {
    /// `amqp://` or `amqps://`, with credentials and the virtual host (`%2f` for `/`).
    pub url: String,
    pub queue: String,
    /// The queue failed messages are published to (through the default exchange).
    pub dead_letter: String,
    /// With `amqps://`: the only CA trusted for the broker's certificate (else the system's).
    pub tls_ca_file: Option<std::path::PathBuf>,
}

/// `source = { kafka_topic = "orders", brokers = ["host:9092"], group = "idemgate",
/// dead_letter = "orders.dead" }`.
#[derive(Clone, PartialEq, Eq)]
pub struct KafkaSource {
    /// `host:port` of at least one broker (the rest are found from it).
    pub brokers: Vec<String>,
    pub topic: String,
    /// The consumer group every instance joins.
    pub group: String,
    /// The topic failed messages are produced to.
    pub dead_letter: String,
    /// librdkafka settings, passed as they are (TLS, SASL, timeouts); never logged: they may
    /// hold a password.
    pub options: std::collections::BTreeMap<String, String>,
}

impl std::fmt::Debug for NatsSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsSource")
            .field("url", &redact_url(&self.url))
            .field("stream", &self.stream)
            .field("subject", &self.subject)
            .field("durable", &self.durable)
            .field("dead_letter", &self.dead_letter)
            .field("ack_wait", &self.ack_wait)
            .finish()
    }
}

impl std::fmt::Debug for RabbitSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitSource")
            .field("url", &redact_url(&self.url))
            .field("queue", &self.queue)
            .field("dead_letter", &self.dead_letter)
            .field("tls_ca_file", &self.tls_ca_file)
            .finish()
    }
}

impl std::fmt::Debug for KafkaSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSource")
            .field("brokers", &self.brokers)
            .field("topic", &self.topic)
            .field("group", &self.group)
            .field("dead_letter", &self.dead_letter)
            .field("options", &self.options.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Config {
    /// The shortest `upstream_timeout` of any route, consumer or the defaults.
    pub fn shortest_upstream_timeout(&self) -> Duration {
        self.routes
            .iter()
            .map(|r| r.policy.upstream_timeout)
            .chain(self.consumers.iter().map(|c| c.policy.upstream_timeout))
            .fold(self.defaults.upstream_timeout, Duration::min)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub admin: Option<SocketAddr>,
    /// Where the operator API's bearer token is read from at startup; `None`: the API is off.
    pub admin_token: Option<TokenSource>,
    /// How long in-flight requests get to finish (and store their results) after SIGTERM.
    pub shutdown_grace: Duration,
    /// How long the gateway keeps accepting and serving after SIGTERM, with `/readyz` already
    /// 503, before it drains: the time a load balancer takes to stop sending (the preStop
    /// pattern).
    pub drain_delay: Duration,
    /// Connections beyond this wait in the accept queue: with `max_body` this bounds buffered memory.
    pub max_connections: usize,
    /// Threads serving requests, each with its own runtime and upstream pool.
    pub workers: usize,
    /// How long each phase of a client connection may take.
    pub deadlines: Deadlines,
    /// HTTP/2 streams open at once on one connection.
    pub max_streams: u32,
    /// `server.max_buffered`: bytes of request bodies buffered at once, all requests together.
    pub max_buffered: usize,
    /// `server.max_header_bytes`: the largest request head, on HTTP/1.1 (request line and
    /// headers as sent) and HTTP/2 (the decoded header list); over it, 431.
    pub max_header_bytes: usize,
    /// `server.tls_cert` and `server.tls_key`: the listener speaks TLS with this PEM chain and
    /// key (re-read on SIGHUP).
    pub tls: Option<(std::path::PathBuf, std::path::PathBuf)>,
    /// `server.tls_client_ca`: clients must present a certificate signed by these CAs; its
    /// subject is given to every request as [`CLIENT_SUBJECT_HEADER`].
    pub tls_client_ca: Option<std::path::PathBuf>,
    /// `server.tls_recheck`: how often the certificate files are read again to find a renewed
    /// certificate without a SIGHUP (`None`: only on SIGHUP).
    pub tls_recheck: Option<Duration>,
    /// Peers whose `X-Forwarded-*` and `Forwarded` headers are believed (load balancers in
    /// front); from any other peer they are replaced.
    pub trusted_proxies: Vec<ipnet::IpNet>,
    /// Route literals compare case-sensitively (for upstreams whose routing does); by default
    /// `/PAYMENTS` is the `/payments` route too.
    pub case_sensitive_routes: bool,
    /// `server.method_override_header`: the header the upstream takes a POST's method from
    /// (`X-HTTP-Method-Override`); such a POST is routed and fingerprinted as that method.
    pub method_override_header: Option<http::HeaderName>,
}

impl ServerConfig {
    /// Whether a client connection comes from one of `trusted_proxies`.
    pub fn is_trusted_proxy(&self, peer: std::net::IpAddr) -> bool {
        let peer = peer.to_canonical();
        self.trusted_proxies.iter().any(|n| n.contains(&peer))
    }
}

/// The deadline on each phase of a client connection (docs/security.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadlines {
    /// From accept, or from the first byte of the next HTTP/1.1 request, to a complete request
    /// head (any protocol: nothing sent, a partial head, a partial HTTP/2 preface).
    pub header: Duration,
    /// The longest gap between two pieces of a request body.
    pub body: Duration,
    /// With no request in flight: how long a connection may stay silent (HTTP/1.1 keep-alive)
    /// or without a stream (HTTP/2) before it is closed.
    pub idle: Duration,
    /// The longest a response write may wait on a client that does not read.
    pub send: Duration,
}

impl Default for Deadlines {
    fn default() -> Self {
        Deadlines {
            header: Duration::from_secs(10),
            body: Duration::from_secs(30),
            idle: Duration::from_secs(60),
            send: Duration::from_secs(30),
        }
    }
}

/// Where a secret is read from at startup (never the secret itself: a config is printed and
/// compared freely).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenSource {
    /// The name of an environment variable (`server.admin_token_env`).
    Env(String),
    /// A file whose content, trimmed, is the token (`server.admin_token_file`).
    File(std::path::PathBuf),
}

/// What an idempotent route does when the store cannot be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnStoreError {
    /// 503 problem with `Retry-After`: nothing is forwarded without idempotency (fail closed).
    Reject,
    /// Forward without idempotency: availability over duplicates (fail open).
    Pass,
}

/// What happens to a key whose request reached the upstream without a complete answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnUnknown {
    /// Keep the key as `unknown`: retries get `outcome-unknown` and never execute (the default).
    Reject,
    /// Release the key (and take over abandoned ones): for upstreams that are safe to run again.
    Retry,
}

/// A set of 5xx statuses, as bits (`unknown_statuses`): small enough to copy into every
/// operation's rules. Two words rather than a `u128`, whose 16-byte alignment would pad every
/// future that holds the rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ServerStatuses([u64; 2]);

impl ServerStatuses {
    /// The statuses a proxy in front of the upstream answers when it gave up on an upstream that
    /// may have committed: 502 (the connection failed mid-answer) and 504 (it timed out).
    pub const DEFAULT_UNKNOWN: ServerStatuses = ServerStatuses([(1 << 2) | (1 << 4), 0]);

    /// The set of `codes`; `None` if one is not from 500 to 599.
    pub fn of(codes: &[u16]) -> Option<ServerStatuses> {
        codes
            .iter()
            .try_fold(ServerStatuses::default(), |mut set, &code| {
                let bit = code.checked_sub(500).filter(|b| *b < 100)?;
                set.0[usize::from(bit / 64)] |= 1 << (bit % 64);
                Some(set)
            })
    }

    pub fn contains(self, status: u16) -> bool {
        match status.checked_sub(500).filter(|b| *b < 100) {
            Some(bit) => self.0[usize::from(bit / 64)] & (1 << (bit % 64)) != 0,
            None => false,
        }
    }

    /// The statuses, in order.
    pub fn codes(self) -> Vec<u16> {
        (500..600).filter(|&s| self.contains(s)).collect()
    }
}

/// An `http(s)://host:port[/prefix]` upstream. Requests go to `prefix + original path`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamUrl {
    /// `https://`: connections are TLS ([`UpstreamTls`]).
    pub tls: bool,
    pub authority: http::uri::Authority,
    /// Path prefix without a trailing slash ("" for none).
    pub prefix: String,
    /// How to speak to it (`protocol`).
    pub protocol: UpstreamProtocol,
}

/// The HTTP version spoken to an upstream (`[upstream] protocol`, a route's `protocol`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UpstreamProtocol {
    /// Over TLS, whichever of HTTP/2 and HTTP/1.1 the upstream picks (ALPN); HTTP/1.1 in
    /// cleartext, where nothing can be negotiated.
    #[default]
    Auto,
    /// HTTP/1.1 only.
    Http1,
    /// HTTP/2 only: ALPN `h2` over TLS, prior knowledge in cleartext (h2c).
    Http2,
}

impl UpstreamProtocol {
    pub fn as_str(self) -> &'static str {
        match self {
            UpstreamProtocol::Auto => "auto",
            UpstreamProtocol::Http1 => "http1",
            UpstreamProtocol::Http2 => "http2",
        }
    }
}

impl UpstreamUrl {
    pub fn parse(field: &str, raw: &str) -> Result<Self, ConfigError> {
        let allowed = "an absolute http:// or https:// URL such as \"http://127.0.0.1:3000\" or \"https://payments.internal/api\", without query";
        // Shown without user info: a URL refused for carrying credentials must not print them.
        let invalid = || ConfigError::invalid(field, redact_url(raw), allowed);
        let uri: Uri = raw.parse().map_err(|_| invalid())?;
        let tls = match uri.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            _ => return Err(invalid()),
        };
        let authority = uri.authority().cloned().ok_or_else(invalid)?;
        if uri.query().is_some() || authority.as_str().contains('@') {
            return Err(invalid());
        }
        let prefix = uri.path().trim_end_matches('/').to_string();
        Ok(UpstreamUrl {
            tls,
            authority,
            prefix,
            protocol: UpstreamProtocol::Auto,
        })
    }

    /// The port connected to: the URL's, or the scheme's.
    pub fn port(&self) -> u16 {
        self.authority
            .port_u16()
            .unwrap_or(if self.tls { 443 } else { 80 })
    }
}

impl std::fmt::Display for UpstreamUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let scheme = if self.tls { "https" } else { "http" };
        write!(f, "{scheme}://{}{}", self.authority, self.prefix)
    }
}

pub use client::{CLIENT_SUBJECT_HEADER, CLIENT_URI_HEADER};

/// How `https://` upstreams are trusted and who the gateway is to them (`[upstream] tls_*`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UpstreamTls {
    /// PEM certificates of the CA(s) that sign the upstreams' certificates; `None`: the system's
    /// trusted roots.
    pub ca_file: Option<std::path::PathBuf>,
    /// PEM chain and key the gateway presents to upstreams that ask (mTLS).
    pub client_cert: Option<std::path::PathBuf>,
    pub client_key: Option<std::path::PathBuf>,
    /// The name the upstream's certificate must carry, sent as SNI, instead of the URL's host.
    pub server_name: Option<String>,
}

/// Idempotency behaviour of one route, after defaults were applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub key_header: HeaderName,
    /// Headers whose values are part of a request's fingerprint (a tenant header, `Host` for a
    /// multi-tenant upstream): the same key with other values is another request.
    pub fingerprint_headers: Vec<HeaderName>,
    pub require_key: bool,
    pub ttl: Duration,
    pub lock_timeout: Duration,
    pub wait: Duration,
    /// Duplicates that may wait on one key at once (per instance); more get `409 in-flight` at
    /// once.
    pub max_waiters: usize,
    pub mismatch_status: StatusCode,
    pub replay_header: HeaderName,
    /// The headers that tell clients apart, in order: the first one a request carries decides
    /// its scope. Empty when `client_header = ""`: every caller shares one scope.
    pub client_headers: Vec<HeaderName>,
    /// The scope from a verified JWT instead of `client_headers` (`client_jwt`).
    pub client_jwt: Option<std::sync::Arc<client::ClientJwt>>,
    /// Refuse requests that carry none of `client_headers` (401), rather than putting them in
    /// the one anonymous scope they would share.
    pub require_client: bool,
    /// Records one client scope may store per `ttl` on this route, counted in this instance
    /// ([`crate::quota`]); 0: no quota.
    pub max_keys_per_client: u64,
    /// The same for the one scope of requests that name no client (0 by default: a sidecar
    /// whose callers send no client header must never be stopped by a count).
    pub max_keys_anonymous: u64,
    /// Percent of an embedded store's bound that anonymous callers' new keys may fill while
    /// identified clients store records too (100: no share kept for them).
    pub anonymous_share: u8,
    pub max_body: usize,
    pub max_stored_response: usize,
    pub upstream_timeout: Duration,
    pub store_server_errors: bool,
    /// Upstream statuses that may follow a commit (a proxy's 502 or 504 in front of an upstream
    /// that ran the request): the key is kept as an unknown outcome, never released or stored.
    pub unknown_statuses: ServerStatuses,
    pub on_store_error: OnStoreError,
    pub on_unknown: OnUnknown,
    /// How to ask the upstream whether an unknown outcome happened (`reconcile`).
    pub reconcile: Option<Reconcile>,
    /// The gateway's own answers' retry hints and body (`retry_hint_headers`, `error_body`).
    pub answers: answers::Answers,
}

/// A route's `reconcile`: the upstream's lookup by idempotency key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reconcile {
    /// `http://host/path/{key}`: `{key}` is replaced by the client's key, percent-encoded.
    pub url: String,
    /// No lookup before this long after the request was last known to run; `None`: the
    /// route's `upstream_timeout`.
    pub after: Option<Duration>,
}

impl Policy {
    /// Built-in defaults, used where neither the route nor `[defaults]` sets a field.
    pub fn builtin() -> Self {
        Policy {
            key_header: HeaderName::from_static("idempotency-key"),
            fingerprint_headers: Vec::new(),
            require_key: true,
            ttl: Duration::from_secs(24 * 3600),
            lock_timeout: Duration::from_secs(30),
            wait: Duration::from_secs(10),
            max_waiters: 64,
            mismatch_status: StatusCode::CONFLICT,
            replay_header: HeaderName::from_static("idempotent-replayed"),
            client_headers: vec![http::header::AUTHORIZATION],
            client_jwt: None,
            require_client: false,
            max_keys_per_client: 0,
            max_keys_anonymous: 0,
            anonymous_share: 50,
            max_body: 1 << 20,
            max_stored_response: 1 << 20,
            upstream_timeout: Duration::from_secs(30),
            store_server_errors: false,
            unknown_statuses: ServerStatuses::DEFAULT_UNKNOWN,
            on_store_error: OnStoreError::Reject,
            on_unknown: OnUnknown::Reject,
            reconcile: None,
            answers: answers::Answers::builtin(),
        }
    }
}

/// One `[[routes]]` entry, validated.
#[derive(Debug, Clone)]
pub struct RouteConfig {
    /// Stable identity of the route: part of every stored key, and how operators name it.
    pub name: String,
    /// Whether `name` was written in the config; without one, the name is the path, and its
    /// keys follow the path ([`identity`]).
    pub named: bool,
    pub pattern: RoutePattern,
    pub methods: Vec<Method>,
    pub upstream: UpstreamUrl,
    /// JSON pointers removed from a JSON body before it is fingerprinted.
    pub fingerprint_ignore: IgnoredFields,
    /// Where the key comes from (default: the policy's `key_header`).
    pub key: KeySource,
    /// False for deliveries deduplicated by business id: a later, different message with the
    /// same key gets the stored response instead of a mismatch.
    pub check_fingerprint: bool,
    /// Deliveries on this route must carry their sender's signature (`signature = {...}`).
    pub signature: Option<SignatureConfig>,
    pub policy: Policy,
}

/// How a route verifies its sender's signature ([`crate::signature`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignatureConfig {
    pub scheme: SignatureScheme,
    /// Every secret accepted now (more than one while a secret is rotated), as the HMAC key.
    pub secrets: Vec<Secret>,
    /// For timestamped schemes: how far a delivery's timestamp may be from now.
    pub tolerance: Duration,
}

/// A sender's signature scheme, each to its sender's published spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SignatureScheme {
    /// Standard Webhooks (Svix, OpenAI, Resend...): `webhook-id`, `webhook-timestamp`,
    /// `webhook-signature` (or their `svix-` names).
    StandardWebhooks,
    /// GitHub: `X-Hub-Signature-256`.
    Github,
    /// Stripe: `Stripe-Signature` with `t=` and `v1=`.
    Stripe,
    /// Shopify: `X-Shopify-Hmac-Sha256`.
    Shopify,
    /// Slack: `X-Slack-Signature` over `X-Slack-Request-Timestamp` and the body.
    Slack,
    /// HMAC-SHA256 of the body in a header, hex or base64, after an optional prefix.
    Hmac {
        header: HeaderName,
        base64: bool,
        prefix: String,
    },
}

impl SignatureScheme {
    pub fn name(&self) -> &'static str {
        match self {
            SignatureScheme::StandardWebhooks => "standard-webhooks",
            SignatureScheme::Github => "github",
            SignatureScheme::Stripe => "stripe",
            SignatureScheme::Shopify => "shopify",
            SignatureScheme::Slack => "slack",
            SignatureScheme::Hmac { .. } => "hmac-sha256",
        }
    }

    /// Whether deliveries carry a signed timestamp (and so a tolerance applies).
    pub fn is_timestamped(&self) -> bool {
        matches!(
            self,
            SignatureScheme::StandardWebhooks | SignatureScheme::Stripe | SignatureScheme::Slack
        )
    }
}

/// A signing secret: never printed, logged or compared except by the HMAC it keys.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl Secret {
    pub fn new(key: Vec<u8>) -> Self {
        Secret(key)
    }

    pub fn key(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(***)")
    }
}

impl Config {
    /// Reads and validates a config file. A relative disk store `path` is taken relative to
    /// the file's directory, not to wherever the gateway was started: started from elsewhere,
    /// it would open an empty store and forget every key.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        let mut config = Config::parse(&text)?;
        if let Some(dir) = path.parent() {
            if let StoreConfig::Disk(disk) = &mut config.store {
                if disk.path.is_relative() {
                    disk.path = dir.join(&disk.path);
                }
            }
            for source in [&mut config.server.admin_token, &mut config.store_keys] {
                if let Some(TokenSource::File(file)) = source {
                    if file.is_relative() {
                        *file = dir.join(&*file);
                    }
                }
            }
        }
        Ok(config)
    }

    /// The longest `ttl` of `[defaults]`, every route and every consumer: how long an operator's
    /// change keeps the record it writes. An operator names a record by its id, not its route,
    /// and a record kept shorter than its route's `ttl` would let a retry run again once it
    /// expired; one kept longer costs only space.
    pub fn longest_ttl(&self) -> Duration {
        (self.routes.iter().map(|r| r.policy.ttl))
            .chain(self.consumers.iter().map(|c| c.policy.ttl))
            .fold(self.defaults.ttl, Duration::max)
    }

    /// Parses and validates config text.
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        raw::parse(text)?.validate()
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_answers;
#[cfg(test)]
mod tests_client;
#[cfg(test)]
mod tests_uncertain;
