//! Whether this Redis can lose live records on its own, read from its configuration.
//!
//! A record Redis evicts under memory pressure is a key that executes again on its next retry:
//! only `maxmemory-policy noeviction` (Redis's default) refuses writes instead. Every other policy
//! (`allkeys-*`, and `volatile-*` too, since every record has a TTL) can evict live records. And a
//! Redis that neither appends to a file nor snapshots forgets every key when it restarts.
//!
//! A task reads `CONFIG GET` at startup (again each second until Redis answers) and then every
//! [`RECHECK`], and keeps the answer here: an evicting policy is logged as an error, shown on
//! `/readyz` and in the metric `idemgate_store_eviction_risk`, and with
//! `store.require_noeviction = true` new keys are refused until the policy is `noeviction`. A
//! Redis that does not allow `CONFIG` (some managed services) cannot be checked: that is a
//! warning, and with `require_noeviction` a refusal, since nothing proves the records are safe.
//!
//! With `store.min_replicas`, the same task counts the primary's connected replicas
//! (`INFO replication`; in a cluster, the fewest of any primary) every [`REPLICAS_RECHECK`]:
//! fewer than asked and `/readyz` says so, since no new key can be acknowledged.

use std::sync::atomic::{AtomicI64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
use redis::Value;

use super::conn::HandleConn;

/// How often the configuration is read again once it has been read.
pub const RECHECK: Duration = Duration::from_secs(30);
/// How often it is tried until Redis first answers.
const RETRY: Duration = Duration::from_secs(1);
/// How often the connected replicas are counted, with `store.min_replicas`.
pub const REPLICAS_RECHECK: Duration = Duration::from_secs(2);

/// What the last check found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Eviction {
    /// Not read yet.
    Unchecked = 0,
    /// `noeviction` (on every node that answered).
    Safe = 1,
    /// A policy that can evict live records.
    Evicting = 2,
    /// Redis answered, but not with its policy (`CONFIG` disabled or renamed).
    Unreadable = 3,
}

/// The last check's findings; shared by every handle of one store.
pub struct Safety {
    eviction: AtomicU8,
    /// Replicas connected to the primary (the fewest, in a cluster); -1 until counted.
    replicas: AtomicI64,
    /// What to tell an operator about it (never a URL or a password).
    note: Mutex<Option<String>>,
    /// The policy read last (an evicting one, if nodes differ); `None` until read, or when it
    /// cannot be.
    policy: Mutex<Option<String>>,
}

impl Default for Safety {
    fn default() -> Self {
        Safety {
            eviction: AtomicU8::new(Eviction::Unchecked as u8),
            replicas: AtomicI64::new(-1),
            note: Mutex::default(),
            policy: Mutex::default(),
        }
    }
}

impl Safety {
    /// Replicas connected to the primary when last counted; `None` until counted.
    pub fn replicas(&self) -> Option<u32> {
        u32::try_from(self.replicas.load(Ordering::Acquire)).ok()
    }

    pub fn eviction(&self) -> Eviction {
        match self.eviction.load(Ordering::Acquire) {
            1 => Eviction::Safe,
            2 => Eviction::Evicting,
            3 => Eviction::Unreadable,
            _ => Eviction::Unchecked,
        }
    }

    /// The `maxmemory-policy` read last, if it could be read.
    pub fn policy(&self) -> Option<String> {
        self.policy
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// What the last check found worth telling, if anything.
    pub fn note(&self) -> Option<String> {
        self.note
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn set(&self, eviction: Eviction, note: Option<String>, policy: Option<String>) {
        *self.policy.lock().unwrap_or_else(PoisonError::into_inner) = policy;
        let before = self.eviction.swap(eviction as u8, Ordering::AcqRel);
        let mut kept = self.note.lock().unwrap_or_else(PoisonError::into_inner);
        // Logged when it changes, not every RECHECK.
        if before != eviction as u8 || *kept != note {
            match (&note, eviction) {
                (Some(n), Eviction::Evicting) => tracing::error!("{n}"),
                (Some(n), _) => tracing::warn!("{n}"),
                (None, _) => tracing::info!("Redis keeps records until they expire (maxmemory-policy noeviction, persistence on)"),
            }
        }
        *kept = note;
    }
}

/// Reads Redis's configuration now and then, for as long as the store lives.
pub async fn watch(handle: Arc<HandleConn>, safety: Arc<Safety>, timeout: Duration) {
    loop {
        let checked = match handle.get() {
            Ok(mut conn) => tokio::time::timeout(timeout, check(&mut conn))
                .await
                .unwrap_or(Err(Unread::NoAnswer)),
            Err(_) => Err(Unread::NoAnswer),
        };
        let pause = match checked {
            Ok((eviction, note, policy)) => {
                safety.set(eviction, note, Some(policy));
                RECHECK
            }
            // Redis answered with an error: CONFIG is not allowed here.
            Err(Unread::Refused) => {
                safety.set(
                    Eviction::Unreadable,
                    Some("cannot read Redis's maxmemory-policy (is CONFIG disabled?): nothing shows that Redis will not evict live records; make sure it is noeviction".into()),
                    None,
                );
                RECHECK
            }
            // No answer: the store reports that on its own; what was read last still holds, and
            // the next try is soon.
            Err(Unread::NoAnswer) => RETRY,
        };
        tokio::time::sleep(pause).await;
    }
}

/// Counts the primary's connected replicas every [`REPLICAS_RECHECK`], for as long as the store
/// lives (with `store.min_replicas`); `handle` is the configuration watch's.
pub async fn count_replicas(handle: Arc<HandleConn>, safety: Arc<Safety>, timeout: Duration) {
    loop {
        let counted = match handle.get() {
            Ok(mut conn) => tokio::time::timeout(timeout, connected_replicas(&mut conn))
                .await
                .ok()
                .flatten(),
            Err(_) => None,
        };
        safety
            .replicas
            .store(counted.map_or(-1, i64::from), Ordering::Release);
        tokio::time::sleep(REPLICAS_RECHECK).await;
    }
}

/// Why the configuration was not read.
enum Unread {
    /// Redis answered with an error, or without the value.
    Refused,
    /// No answer (connection lost, timeout).
    NoAnswer,
}

/// What Redis's configuration means, a note for the operator, and the policy.
async fn check(
    conn: &mut super::conn::RedisConn,
) -> Result<(Eviction, Option<String>, String), Unread> {
    let policies = config_get(conn, "maxmemory-policy").await?;
    let appendonly = config_get(conn, "appendonly").await?;
    let save = config_get(conn, "save").await?;
    if policies.is_empty() {
        return Err(Unread::Refused);
    }
    let evicting: Vec<&String> = policies.iter().filter(|p| *p != "noeviction").collect();
    let forgets = !appendonly.is_empty()
        && appendonly.iter().all(|a| a == "no")
        && save.iter().all(String::is_empty);
    if let Some(policy) = evicting.first() {
        return Ok((
            Eviction::Evicting,
            Some(format!("Redis's maxmemory-policy is {policy}: under memory pressure Redis evicts live records, and a retry of an evicted key executes again; set maxmemory-policy noeviction (store.require_noeviction = true refuses new keys until then)")),
            policy.to_string(),
        ));
    }
    let note = forgets.then(|| {
        "Redis neither appends to a file (appendonly no) nor snapshots (save \"\"): a Redis restart forgets every key, and their retries execute again; set appendonly yes".to_string()
    });
    Ok((Eviction::Safe, note, "noeviction".into()))
}

/// `connected_slaves` of `INFO replication`: the fewest of every primary that answered (a
/// cluster answers for each); `None` if none did.
async fn connected_replicas(conn: &mut super::conn::RedisConn) -> Option<u32> {
    let answer: Value = redis::cmd("INFO")
        .arg("replication")
        .query_async(conn)
        .await
        .ok()?;
    let mut texts = Vec::new();
    flatten(&answer, &mut texts, 0);
    texts
        .iter()
        .flat_map(|t| t.lines())
        .filter_map(|line| line.trim().strip_prefix("connected_slaves:")?.parse().ok())
        .min()
}

/// The values of `CONFIG GET name`, one per node that answered: in a cluster, asked of every
/// primary (the client would send it to one node at random, and one evicting primary among N
/// would pass N - 1 checks in N).
async fn config_get(conn: &mut super::conn::RedisConn, name: &str) -> Result<Vec<String>, Unread> {
    let mut cmd = redis::cmd("CONFIG");
    cmd.arg("GET").arg(name);
    let answer = match conn {
        super::conn::RedisConn::Cluster(cluster) => {
            let every_primary = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
            cluster.route_command(cmd, every_primary).await
        }
        single => cmd.query_async::<Value>(single).await,
    };
    let answer: Value = answer.map_err(|e| {
        if e.is_io_error() || e.is_timeout() || e.is_connection_dropped() {
            Unread::NoAnswer
        } else {
            Unread::Refused
        }
    })?;
    let mut words = Vec::new();
    flatten(&answer, &mut words, 0);
    let values: Vec<String> = words
        .windows(2)
        .filter(|w| w[0].eq_ignore_ascii_case(name))
        .map(|w| w[1].clone())
        .collect();
    Ok(values)
}

/// Every string in a (possibly nested) answer, in order; nesting is bounded since an answer
/// comes from the trusted store, but a bound costs nothing.
fn flatten(v: &Value, out: &mut Vec<String>, depth: usize) {
    if depth > 8 {
        return;
    }
    match v {
        Value::BulkString(b) => out.push(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => out.push(s.clone()),
        Value::VerbatimString { text, .. } => out.push(text.clone()),
        Value::Array(items) | Value::Set(items) => {
            for i in items {
                flatten(i, out, depth + 1);
            }
        }
        Value::Map(pairs) => {
            for (k, v) in pairs {
                flatten(k, out, depth + 1);
                flatten(v, out, depth + 1);
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn answers_of_one_node_and_of_several_are_read_alike() {
        let mut one = Vec::new();
        flatten(
            &Value::Array(vec![bulk("maxmemory-policy"), bulk("noeviction")]),
            &mut one,
            0,
        );
        assert_eq!(one, ["maxmemory-policy", "noeviction"]);
        let mut several = Vec::new();
        flatten(
            &Value::Map(vec![
                (
                    bulk("node-a:7000"),
                    Value::Map(vec![(bulk("maxmemory-policy"), bulk("noeviction"))]),
                ),
                (
                    bulk("node-b:7001"),
                    Value::Array(vec![bulk("maxmemory-policy"), bulk("allkeys-lru")]),
                ),
            ]),
            &mut several,
            0,
        );
        assert!(several.ends_with(&["maxmemory-policy".into(), "allkeys-lru".into()]));
    }
}
