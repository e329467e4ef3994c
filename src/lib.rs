//! idemgate: an idempotency gateway. A reverse proxy that makes the routes named in its config
//! safe to retry: a request with an `Idempotency-Key` executes upstream at most once and every
//! retry gets the first result back.
//!
//! # Layout
//! Data flows one way: config -> store and upstream -> the idempotency core -> the fronts
//! (HTTP today) -> the server that runs them. No module imports one above it.
//! - [`cli`] - the command line (`run`, `check`, `keys`); `main.rs` only calls it.
//! - [`operator`] - `idemgate keys id|get|delete` and the operator API's changes: name, inspect,
//!   release or resolve one key.
//! - [`config`] - `proxy.toml` -> raw ([`config`]'s `raw`) -> validated [`config::Config`]
//!   (`validate`, a file per section); plain data, every rejection names field and value.
//!   A new config key: a typed field in `raw.rs` (a duration, size or choice through its
//!   `deserialize_with`, which names what is allowed), its ranges and cross-field rules in its
//!   section under `validate/`, a rejection test in `tests.rs`, a row in docs/configuration.md.
//! - [`route`] - which route a request belongs to (pure matching, overlap detection).
//! - [`key`] - the `Idempotency-Key` header, client scoping, the hashed store key.
//! - [`jwt`] - client identity from a verified JWT (`client_jwt`): the key set, fetched and
//!   kept fresh, and a cache of verified tokens.
//! - [`fingerprint`] - "same request?": SHA-256 over method, path, query, media type and
//!   canonical body.
//! - [`store`] - the store contract and records; backends [`store::disk`] (durable, embedded),
//!   [`store::memory`] (volatile), [`store::redis`] (connections, Lua scripts, pub/sub
//!   subscriber) and [`store::postgres`] (statements, pool, LISTEN/NOTIFY, purge, schema);
//!   the record codec; waiting.
//!   A new backend goes here: one module, one arm in [`store::open`], one more contract run.
//! - [`upstream`] - the per-worker connection pool, request rewriting, failure classification.
//!   A new upstream protocol goes here.
//! - [`body`] - the body type, capped reading, streaming what is too large to keep.
//! - [`error`] - the boxed error every layer hands to hyper and the bodies.
//! - [`grpc`] - gRPC status codes both ways: a stored call's `grpc-status` judged as the HTTP
//!   status it stands for, the gateway's problems as gRPC statuses.
//! - [`idempotency`] - the core: reserve, wait, decide, execute, settle, for any front; its
//!   decisions are pure functions with tests of their own (start here).
//! - [`signature`] - webhook senders' signatures, verified before a delivery claims its key.
//! - [`quota`] - records stored per client scope, so no client can fill the store for others.
//! - [`reconcile`] - asking the upstream whether an unknown outcome happened (`reconcile`),
//!   for a retry and in the background.
//! - [`duplicates`] - duplicates waiting on one key: a capped room, one store read for all.
//! - [`gateway`] - the HTTP front on the core, phase by phase.
//! - [`consumer`] - the broker front on the same core: `[[consumers]]` read a Redis stream, a
//!   NATS JetStream stream, a RabbitMQ queue or a Kafka topic and deliver each message to a
//!   handler once, acknowledging it (Kafka: committing past it) only once its result is stored.
//!   A new broker is one [`consumer::Source`]. A consumer's task that stops is started
//!   again; `/readyz` knows. Its `kafka_headers` module holds the crate's only `unsafe` code
//!   (librdkafka's header names, read as bytes).
//! - [`problem`] - every response the gateway makes itself (RFC 9457), in one place.
//! - [`conn`] - one client connection under a deadline in every phase (slow and idle clients).
//! - [`tls`] - TLS on the traffic listener, its certificate reloaded on SIGHUP and when its
//!   files change.
//! - [`server`] - the acceptor, worker threads (one runtime and one context each), shutdown.
//! - [`admin`] - the admin listener: `/healthz`, `/readyz`, `/metrics`, and the operator API
//!   (`/keys`, `/keys/{id}`, with a token). A new endpoint is one more arm of its path `match`.
//! - [`metrics`] - the Prometheus metrics and the outcome names they count.
//! - [`telemetry`] - logging, and traces: OpenTelemetry spans over OTLP (`[telemetry]`).
//! - `fuzzing` - entry points for the fuzz targets into private parsers (hidden, not an API).
//!
//! Public: what the binary, the tests and an embedder use ([`cli`], [`config`], [`server`], and
//! the parts the store contract tests drive: [`store`], [`key`], [`fingerprint`], [`route`]);
//! every other module is private to the crate.

mod admin;
mod body;
pub mod cli;
pub mod config;
mod conn;
mod consumer;
mod duplicates;
mod error;
pub mod fingerprint;
#[doc(hidden)]
pub mod fuzzing;
mod gateway;
mod grpc;
mod idempotency;
mod jwt;
pub mod key;
mod metrics;
pub mod operator;
mod problem;
mod quota;
mod reconcile;
pub mod route;
pub mod server;
mod signature;
pub mod store;
mod telemetry;
mod tls;
mod upstream;
