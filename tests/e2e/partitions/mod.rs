//! Network partitions between hosts of their own (network namespaces on a bridge, see
//! [`net`]): the gateways, the store's nodes, the sentinels and the upstream each on a host with
//! an address, partitioned, slowed and healed by the test, the test process playing the clients.
//! A checker ([`Ledger`]) keeps every answer per key and, after healing, retries every key: a key
//! answered 2xx must replay that answer byte for byte, and the upstream counts executions per
//! key. Each scenario prints what it saw (answers by status, executions by count, time to serve
//! again); the figures are in docs/stores.md ("Partitions"). Needs root (scripts/test runs as
//! root, as CI does); cargo-nextest runs these one at a time (.config/nextest.toml).

mod cluster;
mod net;
mod postgres;
mod redis;
mod scenarios;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::support::{Http, Upstream};

/// What the clients saw, key by key, and what the upstream executed.
#[derive(Default)]
pub struct Ledger {
    /// Every answer per key, in order (`None`: no answer within the client's timeout).
    answers: BTreeMap<String, Vec<Option<u16>>>,
    /// The first 2xx body per key.
    acknowledged: BTreeMap<String, Bytes>,
    /// Keys that got a 2xx answer other than the first one acknowledged (a second execution).
    changed: std::collections::BTreeSet<String>,
}

/// A client's patience for one request: past it the request counts as unanswered.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(8);

impl Ledger {
    /// `POST /payments` with `key` through the gateway at `gw`; the answer is recorded.
    pub async fn post(&mut self, gw: SocketAddr, key: &str) -> Option<u16> {
        let http = Http::new(gw);
        let got = http
            .request("POST", "/payments")
            .header("idempotency-key", key)
            .json("{\"amount\":100}")
            .try_send(CLIENT_TIMEOUT)
            .await;
        let status = got.as_ref().map(|g| g.status.as_u16());
        self.answers
            .entry(key.to_string())
            .or_default()
            .push(status);
        if let Some(g) = got {
            if g.status.is_success() {
                let first = self
                    .acknowledged
                    .entry(key.to_string())
                    .or_insert_with(|| g.body.clone());
                if *first != g.body {
                    self.changed.insert(key.to_string());
                }
            }
        }
        status
    }

    /// After healing: every key retried through `gw` until it gets a final answer (not 503, not
    /// unanswered), within `limit`. Returns how long the last key took to be served.
    pub async fn settle(&mut self, gw: SocketAddr, limit: Duration) -> Duration {
        let started = Instant::now();
        let keys: Vec<String> = self.answers.keys().cloned().collect();
        for key in keys {
            loop {
                match self.post(gw, &key).await {
                    Some(s) if s != 503 => break,
                    _ => {}
                }
                assert!(
                    started.elapsed() < limit,
                    "{key}: still no final answer {limit:?} after healing"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        started.elapsed()
    }

    /// Keys acknowledged (2xx) whose answer did not survive: the final answer (after
    /// [`Ledger::settle`]) is not 2xx, or a later 2xx differs from the first (a second
    /// execution's answer). A 503 in between (a store unreachable for a while) is not a loss.
    pub fn lost(&self) -> Vec<String> {
        self.acknowledged
            .keys()
            .filter(|key| {
                self.changed.contains(*key)
                    || !matches!(self.answers[*key].last(), Some(Some(s)) if (200..300).contains(s))
            })
            .cloned()
            .collect()
    }

    /// Every answer `key` got, in order (for failure messages).
    pub fn answers(&self, key: &str) -> &[Option<u16>] {
        self.answers.get(key).map_or(&[], Vec::as_slice)
    }

    /// The lost keys with every answer each got (for failure messages).
    pub fn lost_with_answers(&self) -> Vec<(String, Vec<Option<u16>>)> {
        self.lost()
            .into_iter()
            .map(|k| {
                let a = self.answers(&k).to_vec();
                (k, a)
            })
            .collect()
    }

    /// Answers by status over every request ("none": unanswered).
    pub fn by_status(&self) -> BTreeMap<String, usize> {
        let mut out = BTreeMap::new();
        for a in self.answers.values().flatten() {
            let k = a.map_or("none".to_string(), |s| s.to_string());
            *out.entry(k).or_default() += 1;
        }
        out
    }

    /// Takes in another client's ledger (keys are the clients' own).
    pub fn merge(&mut self, other: Ledger) {
        self.answers.extend(other.answers);
        self.acknowledged.extend(other.acknowledged);
        self.changed.extend(other.changed);
    }

    pub fn keys(&self) -> usize {
        self.answers.len()
    }
}

/// Executions per key, as counts: how many keys ran 0, 1, 2... times.
pub fn executions_by_count(
    per_key: &std::collections::HashMap<String, usize>,
    keys: usize,
) -> BTreeMap<usize, usize> {
    let mut out = BTreeMap::new();
    let ran = per_key.len();
    if keys > ran {
        out.insert(0, keys - ran);
    }
    for n in per_key.values() {
        *out.entry(*n).or_default() += 1;
    }
    out
}

/// Prints what a scenario saw: keys, answers by status, executions by count, acknowledged
/// answers lost, and how long after healing every key was served; with the gateways' warnings
/// and errors when an answer was lost.
pub fn report(
    scenario: &str,
    ledger: &Ledger,
    up: &Upstream,
    gateways: &[net::Proc],
    served_again: Duration,
) {
    if !ledger.lost().is_empty() {
        for g in gateways {
            for line in g
                .log_text()
                .lines()
                .filter(|l| l.contains("WARN") || l.contains("ERROR"))
            {
                eprintln!("{line}");
            }
        }
    }
    let per_key = up.executions_per_key();
    println!(
        "partition {scenario}: {} keys; answers by status {:?}; executions by count {:?}; acknowledged then lost {:?}; served again {:.1} s after healing",
        ledger.keys(),
        ledger.by_status(),
        executions_by_count(&per_key, ledger.keys()),
        ledger.lost().len(),
        served_again.as_secs_f64()
    );
}
