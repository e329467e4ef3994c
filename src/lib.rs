//! idemgate: an idempotency gateway. A reverse proxy that makes the routes named in its config
//! safe to retry: a request with an `Idempotency-Key` executes upstream at most once and every
//! retry gets the first result back.
//!
//! # Layout
//! - [`cli`] - the command line (`run`, `check`, `keys`); `main.rs` only calls it.
//! - [`operator`] - `idemgate keys get|delete`: inspect and release one key.
//! - [`config`] - `proxy.toml` -> validated [`config::Config`]; every rejection names field and value.
//! - [`route`] - which route a request belongs to (pure matching, overlap detection).
//! - [`key`] - the `Idempotency-Key` header, client scoping, the hashed store key.
//! - [`fingerprint`] - "same request?": SHA-256 over method, path, query and canonical body.
//! - [`store`] - the store contract, records, backends ([`store::memory`], [`store::redis`]),
//!   the record codec, waiting on a key.
//! - [`upstream`] - the pooled client, request rewriting, failure classification.
//! - [`body`] - the body type, capped reading, streaming what is too large to keep.
//! - [`gateway`] - the idempotency state machine, phase by phase (start here).
//! - [`problem`] - every response the gateway makes itself (RFC 9457), in one place.
//! - [`server`] - the acceptor, worker threads (one runtime each), graceful shutdown.
//! - [`admin`] - the admin listener: `/healthz`, `/readyz`, `/metrics`.
//! - [`metrics`] - the Prometheus metrics.
//! - [`telemetry`] - logging.

pub mod admin;
pub mod body;
pub mod cli;
pub mod config;
pub mod fingerprint;
pub mod gateway;
pub mod key;
pub mod metrics;
pub mod operator;
pub mod problem;
pub mod route;
pub mod server;
pub mod store;
pub mod telemetry;
pub mod upstream;
