//! What the Redis and Postgres stores' connections share: the command timeout and the TLS
//! files. Its own module, so that `store` (Redis) and `postgres` both use it without importing
//! each other's.

use std::path::PathBuf;
use std::time::Duration;

use super::{pem_file, pem_pair, shown, Pem};
use crate::config::raw::RawStore;
use crate::config::ConfigError;

/// What Redis and Postgres connections share: `command_timeout` (`default` unless set; more
/// than 0s, at most 60s) and the TLS files (`tls_ca_file`, `tls_client_cert` with its key).
pub(super) type Connection = (Duration, Option<PathBuf>, Option<(PathBuf, PathBuf)>);

/// `store.max_clock_skew`: 1s unless set; at most 60s (a larger one delays every take-over of
/// an abandoned key and every lookup by as much).
pub(super) fn clock_skew(raw: &RawStore) -> Result<Duration, ConfigError> {
    let skew = raw.max_clock_skew.unwrap_or(Duration::from_secs(1));
    if skew > Duration::from_secs(60) {
        return Err(ConfigError::invalid(
            "store.max_clock_skew",
            shown(skew),
            "at most 60s",
        ));
    }
    Ok(skew)
}

pub(super) fn connection(raw: &RawStore, default: Duration) -> Result<Connection, ConfigError> {
    let command_timeout = raw.command_timeout.unwrap_or(default);
    if command_timeout.is_zero() || command_timeout > Duration::from_secs(60) {
        return Err(ConfigError::invalid(
            "store.command_timeout",
            shown(command_timeout),
            "more than 0s and at most 60s",
        ));
    }
    let tls_ca_file = raw
        .tls_ca_file
        .clone()
        .map(|p| pem_file("store.tls_ca_file", p, Pem::Certificate))
        .transpose()?;
    let tls_client = pem_pair(
        ("store.tls_client_cert", "store.tls_client_key"),
        raw.tls_client_cert.clone(),
        raw.tls_client_key.clone(),
    )?;
    Ok((command_timeout, tls_ca_file, tls_client))
}
