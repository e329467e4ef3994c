//! The end-to-end suite: a real upstream, the real gateway (in-process or the `idemgate` binary)
//! and real `redis-server` processes, all on free loopback ports, talking real HTTP and RESP.
//!
//! One test binary with a module per area, so `support` compiles and links once. Every test runs
//! as a thread of this one process: nothing here may rely on process-global state of its own
//! (environment variables, a global subscriber, fixed file names): scratch directories are
//! unique per call, and every listener is on a port free when it was chosen.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

mod architecture;
mod cli;
mod client_jwt;
mod client_scope;
mod clock_skew;
mod consumers;
mod disk_restarts;
mod disk_store;
mod encoded_bodies;
mod encryption;
mod failures;
mod fingerprint;
mod gateway;
mod grpc;
mod hostile;
mod openapi;
mod operations;
mod operator_api;
mod partitions;
mod postgres_gateway;
mod prometheus_rules;
mod reconcile;
mod redis_failover;
mod redis_gateway;
mod sdks;
mod shutdown;
mod store_contract;
mod tls;
mod traces;
mod uncertain;
mod webhooks;
mod wire_fuzz;
