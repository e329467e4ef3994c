//! `[store]`: which backend, and the settings of that one (a setting of another backend is an
//! error, not silently ignored).

use std::time::Duration;

use super::connection::{clock_skew, connection};
use super::postgres::postgres;
use super::{shown, size_at_most, validate_redis_url, whole_number};
use crate::config::raw::{Backend, RawStore, Sync};
use crate::config::{
    ConfigError, DiskSettings, RedisSettings, RedisTarget, ReplicaAcks, StoreConfig, SyncMode,
};

/// Largest accepted `max_disk` (1 PiB): counts stay far from overflowing.
const MAX_DISK: u64 = 1 << 50;

/// `workers`: the gateway's worker threads, among which a Postgres pool is shared out.
pub(super) fn validate_store(raw: RawStore, workers: usize) -> Result<StoreConfig, ConfigError> {
    match raw.backend.unwrap_or(Backend::Memory) {
        Backend::Disk => {
            not_redis(&raw)?;
            not_postgres(&raw)?;
            not_memory(&raw)?;
            disk(raw).map(StoreConfig::Disk)
        }
        Backend::Memory => {
            not_disk(&raw)?;
            not_redis(&raw)?;
            not_postgres(&raw)?;
            memory(raw)
        }
        Backend::Redis => {
            not_disk(&raw)?;
            not_memory(&raw)?;
            not_postgres(&raw)?;
            redis(raw).map(StoreConfig::Redis)
        }
        Backend::Postgres => {
            not_disk(&raw)?;
            not_memory(&raw)?;
            not_redis_only(&raw)?;
            postgres(raw, workers).map(StoreConfig::Postgres)
        }
    }
}

/// `store.{field}` must not be set: it belongs to `backend`.
fn only(field: &str, set: bool, backend: &str) -> Result<(), ConfigError> {
    if set {
        Err(ConfigError::invalid(
            format!("store.{field}"),
            "(set)",
            format!("only with backend = {backend}"),
        ))
    } else {
        Ok(())
    }
}

fn not_disk(raw: &RawStore) -> Result<(), ConfigError> {
    only("path", raw.path.is_some(), DISK)?;
    only("sync", raw.sync.is_some(), DISK)?;
    only("sync_interval", raw.sync_interval.is_some(), DISK)?;
    only("max_disk", raw.max_disk.is_some(), DISK)
}

fn not_memory(raw: &RawStore) -> Result<(), ConfigError> {
    only("max_keys", raw.max_keys.is_some(), MEMORY)?;
    only("max_bytes", raw.max_bytes.is_some(), MEMORY)
}

/// Settings of a shared store (Redis or Postgres), for the embedded ones.
fn not_redis(raw: &RawStore) -> Result<(), ConfigError> {
    only("url", raw.url.is_some(), SHARED)?;
    only("command_timeout", raw.command_timeout.is_some(), SHARED)?;
    only("max_clock_skew", raw.max_clock_skew.is_some(), SHARED)?;
    only("tls_ca_file", raw.tls_ca_file.is_some(), SHARED)?;
    only("tls_client_cert", raw.tls_client_cert.is_some(), SHARED)?;
    only("tls_client_key", raw.tls_client_key.is_some(), SHARED)?;
    not_redis_only(raw)
}

/// Settings only Redis has.
fn not_redis_only(raw: &RawStore) -> Result<(), ConfigError> {
    only("cluster", raw.cluster.is_some(), REDIS)?;
    only("sentinels", raw.sentinels.is_some(), REDIS)?;
    only("master", raw.master.is_some(), REDIS)?;
    only("key_prefix", raw.key_prefix.is_some(), REDIS)?;
    only(
        "require_noeviction",
        raw.require_noeviction.is_some(),
        REDIS,
    )?;
    only("min_replicas", raw.min_replicas.is_some(), REDIS)?;
    only("replica_timeout", raw.replica_timeout.is_some(), REDIS)
}

fn not_postgres(raw: &RawStore) -> Result<(), ConfigError> {
    only("table", raw.table.is_some(), POSTGRES)?;
    only("pool_size", raw.pool_size.is_some(), POSTGRES)?;
    only(
        "allow_async_commit",
        raw.allow_async_commit.is_some(),
        POSTGRES,
    )
}

const DISK: &str = "\"disk\"";
const MEMORY: &str = "\"memory\"";
const REDIS: &str = "\"redis\"";
const POSTGRES: &str = "\"postgres\"";
const SHARED: &str = "\"redis\" or \"postgres\"";

fn disk(raw: RawStore) -> Result<DiskSettings, ConfigError> {
    let path =
        match raw.path {
            Some(p) if !p.trim().is_empty() => std::path::PathBuf::from(p),
            Some(p) => return Err(ConfigError::invalid(
                "store.path",
                p,
                "the directory that keeps the records, such as \"data\" or \"/var/lib/idemgate\"",
            )),
            None => {
                return Err(ConfigError::Missing {
                    field: "store.path".into(),
                })
            }
        };
    let interval = raw.sync_interval.unwrap_or(Duration::from_millis(100));
    if interval.is_zero() || interval > Duration::from_secs(10) {
        return Err(ConfigError::invalid(
            "store.sync_interval",
            shown(interval),
            "more than 0s and at most 10s",
        ));
    }
    let sync = match raw.sync.unwrap_or(Sync::Always) {
        Sync::Always => {
            if raw.sync_interval.is_some() {
                return Err(ConfigError::invalid(
                    "store.sync_interval",
                    "(set)",
                    "only with sync = \"batch\"",
                ));
            }
            SyncMode::Always
        }
        Sync::Batch => SyncMode::Batch { interval },
    };
    let max_disk = match raw.max_disk {
        None => 1 << 30,
        Some(n) => size_at_most("store.max_disk", n, MAX_DISK)?,
    };
    if max_disk < 1 << 20 {
        return Err(ConfigError::invalid(
            "store.max_disk",
            max_disk.to_string(),
            "at least 1MiB",
        ));
    }
    Ok(DiskSettings {
        path,
        sync,
        max_disk,
    })
}

fn memory(raw: RawStore) -> Result<StoreConfig, ConfigError> {
    let max_keys = whole_number("store.max_keys", raw.max_keys, 1_000_000, 1..=100_000_000)?;
    let max_bytes = match raw.max_bytes {
        None => 256 << 20,
        Some(n) => n.bytes,
    };
    Ok(StoreConfig::Memory {
        max_keys: max_keys as usize,
        max_bytes,
    })
}

fn redis(raw: RawStore) -> Result<RedisSettings, ConfigError> {
    let (command_timeout, tls_ca_file, tls_client) = connection(&raw, Duration::from_millis(500))?;
    let max_clock_skew = clock_skew(&raw)?;
    let target = redis_target(raw.url, raw.cluster, raw.sentinels, raw.master)?;
    let key_prefix = raw.key_prefix.unwrap_or_else(|| "idemgate:".into());
    if key_prefix.contains(['{', '}']) || key_prefix.len() > 64 {
        return Err(ConfigError::invalid(
            "store.key_prefix",
            key_prefix,
            "up to 64 characters without \"{\" or \"}\" (the gateway adds its own hash tag)",
        ));
    }
    Ok(RedisSettings {
        target,
        key_prefix,
        command_timeout,
        max_clock_skew,
        tls_ca_file,
        require_noeviction: raw.require_noeviction.unwrap_or(false),
        tls_client,
        replicas: replica_acks(raw.min_replicas, raw.replica_timeout)?,
    })
}

/// `min_replicas` (0, the default: no acknowledgement asked) and its `replica_timeout`.
fn replica_acks(
    min: Option<i64>,
    timeout: Option<Duration>,
) -> Result<Option<ReplicaAcks>, ConfigError> {
    let min = whole_number("store.min_replicas", min, 0, 0..=16)? as u32;
    let timeout_range = Duration::from_millis(10)..=Duration::from_secs(60);
    match (min, timeout) {
        (0, None) => Ok(None),
        (0, Some(_)) => Err(ConfigError::invalid(
            "store.replica_timeout",
            "(set)",
            "only with store.min_replicas of 1 or more",
        )),
        (_, Some(t)) if !timeout_range.contains(&t) => Err(ConfigError::invalid(
            "store.replica_timeout",
            shown(t),
            "from \"10ms\" to \"60s\" (\"1s\" is the default)",
        )),
        (min, timeout) => Ok(Some(ReplicaAcks {
            min,
            timeout: timeout.unwrap_or(Duration::from_secs(1)),
        })),
    }
}

/// `store.url` (one Redis), `store.cluster` (seed nodes) or `store.sentinels` with `master`:
/// exactly one of them.
fn redis_target(
    url: Option<String>,
    cluster: Option<Vec<String>>,
    sentinels: Option<Vec<String>>,
    master: Option<String>,
) -> Result<RedisTarget, ConfigError> {
    let Some(sentinels) = sentinels else {
        if let Some(master) = master {
            return Err(ConfigError::invalid(
                "store.master",
                master,
                "only with store.sentinels",
            ));
        }
        return single_or_cluster(url, cluster);
    };
    if url.is_some() || cluster.is_some() {
        return Err(ConfigError::invalid(
            "store.sentinels",
            "(set together with store.url or store.cluster)",
            "one of store.url (one Redis), store.cluster (Redis Cluster) and store.sentinels (Redis Sentinel)",
        ));
    }
    if sentinels.is_empty() {
        return Err(ConfigError::invalid(
            "store.sentinels",
            "[]",
            "a non-empty list of sentinel URLs such as [\"redis://10.0.0.1:26379\"]",
        ));
    }
    let master = master.ok_or_else(|| ConfigError::Missing {
        field: "store.master (with store.sentinels)".into(),
    })?;
    if master.is_empty() || master.len() > 128 || master.chars().any(|c| c.is_control() || c == ' ')
    {
        return Err(ConfigError::invalid(
            "store.master",
            master,
            "the name the sentinels monitor the primary under (sentinel monitor <name> ...), such as \"mymaster\"",
        ));
    }
    let sentinels = sentinels
        .into_iter()
        .map(|u| validate_redis_url("store.sentinels", u))
        .collect::<Result<_, _>>()?;
    Ok(RedisTarget::Sentinel { sentinels, master })
}

fn single_or_cluster(
    url: Option<String>,
    cluster: Option<Vec<String>>,
) -> Result<RedisTarget, ConfigError> {
    match (url, cluster) {
        (Some(url), None) => Ok(RedisTarget::Single(validate_redis_url("store.url", url)?)),
        (None, Some(nodes)) if !nodes.is_empty() => Ok(RedisTarget::Cluster(
            nodes
                .into_iter()
                .map(|u| validate_redis_url("store.cluster", u))
                .collect::<Result<_, _>>()?,
        )),
        (None, Some(_)) => Err(ConfigError::invalid(
            "store.cluster",
            "[]",
            "a non-empty list of seed node URLs such as [\"redis://10.0.0.1:7000\"]",
        )),
        (Some(_), Some(_)) => Err(ConfigError::invalid(
            "store.cluster",
            "(set together with store.url)",
            "either store.url (one Redis) or store.cluster (Redis Cluster seed nodes), not both",
        )),
        (None, None) => Err(ConfigError::Missing {
            field: "store.url (or store.cluster, or store.sentinels)".into(),
        }),
    }
}
