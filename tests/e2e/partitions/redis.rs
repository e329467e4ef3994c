//! Redis with Sentinel under partitions: a primary (r1) and two replicas (r2, r3), three
//! sentinels (s1..s3, quorum 2), two gateways (gw1, gw2) following the primary through the
//! sentinels, and the upstream, each on a host of its own.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;

use super::cluster::{gateways, Cluster, Front};
use super::net::{Net, Proc};
use super::{scenarios, Ledger};

const HOSTS: [&str; 9] = ["r1", "r2", "r3", "s1", "s2", "s3", "gw1", "gw2", "up"];
const REDIS: [&str; 3] = ["r1", "r2", "r3"];
const SENTINELS: [&str; 3] = ["s1", "s2", "s3"];

fn redis_cli(addr: Ipv4Addr, port: u16, args: &[&str]) -> String {
    let out = std::process::Command::new("redis-cli")
        .args(["-h", &addr.to_string(), "-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli is missing (Debian: apt-get install redis-tools)");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

async fn wait_for(what: &str, limit: Duration, mut check: impl FnMut() -> bool) {
    let started = Instant::now();
    while !check() {
        assert!(started.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The hosts, their processes and the upstream. Fields drop in order: the processes before
/// the network they run in.
pub struct Setup {
    gateways: Vec<Proc>,
    _sentinels: Vec<Proc>,
    _redis: Vec<Proc>,
    front: Front,
    net: Net,
}

impl Setup {
    /// Everything started, the replicas following, the sentinels agreed, both gateways ready.
    /// `min_replicas`: the gateways' `store.min_replicas`.
    pub async fn start(min_replicas: u32) -> Setup {
        Self::start_with(min_replicas, Semaphore::MAX_PERMITS, false).await
    }

    /// The same with an upstream that answers nothing until the test adds permits to its gate.
    pub async fn start_gated(min_replicas: u32) -> Setup {
        Self::start_with(min_replicas, 0, false).await
    }

    /// [`Setup::start_gated`] with `min_replicas = 1`, an upstream that can be asked what it did
    /// with a key, and the route reconciling with it ([`Front::start`]).
    pub async fn start_reconciling() -> Setup {
        Self::start_with(1, 0, true).await
    }

    async fn start_with(min_replicas: u32, permits: usize, reconcile: bool) -> Setup {
        let net = Net::new(&HOSTS);
        let primary = net.host("r1").addr;
        let mut redis = Vec::new();
        for name in REDIS {
            let host = net.host(name);
            let mut args: Vec<String> = [
                "--port",
                "6379",
                "--bind",
                &host.addr.to_string(),
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
                "--repl-diskless-sync-delay",
                "0",
                "--dir",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            args.push(net.dir(name).display().to_string());
            if name != "r1" {
                args.extend(["--replicaof".into(), primary.to_string(), "6379".into()]);
            }
            redis.push(host.spawn(
                "redis-server",
                &args,
                net.dir("logs").join(format!("{name}.log")),
            ));
            let addr = host.addr;
            wait_for(
                &format!("{name} answers PING"),
                Duration::from_secs(20),
                || redis_cli(addr, 6379, &["PING"]).contains("PONG"),
            )
            .await;
        }
        for name in ["r2", "r3"] {
            let addr = net.host(name).addr;
            wait_for(
                &format!("{name} follows r1"),
                Duration::from_secs(20),
                || {
                    redis_cli(addr, 6379, &["INFO", "replication"])
                        .contains("master_link_status:up")
                },
            )
            .await;
        }
        let mut sentinels = Vec::new();
        for name in SENTINELS {
            let host = net.host(name);
            let dir = net.dir(name);
            let conf = dir.join("sentinel.conf");
            std::fs::write(
                &conf,
                format!(
                    "port 26379\nbind {}\nprotected-mode no\ndir {}\nsentinel monitor mymaster {primary} 6379 2\nsentinel down-after-milliseconds mymaster 1000\nsentinel failover-timeout mymaster 5000\nsentinel parallel-syncs mymaster 2\n",
                    host.addr,
                    dir.display()
                ),
            )
            .unwrap();
            sentinels.push(host.spawn(
                "redis-server",
                &[conf.display().to_string(), "--sentinel".into()],
                net.dir("logs").join(format!("{name}.log")),
            ));
        }
        for name in SENTINELS {
            let addr = net.host(name).addr;
            wait_for(
                &format!("{name} knows the others"),
                Duration::from_secs(30),
                || {
                    let out = redis_cli(addr, 26379, &["SENTINEL", "master", "mymaster"]);
                    let field = |f: &str| {
                        let mut lines = out.lines();
                        while let Some(l) = lines.next() {
                            if l.trim() == f {
                                return lines.next().unwrap_or("").trim().to_string();
                            }
                        }
                        String::new()
                    };
                    field("num-slaves") == "2" && field("num-other-sentinels") == "2"
                },
            )
            .await;
        }
        let front = Front::start(&net, permits, reconcile);
        let sentinel_urls: Vec<toml::Value> = SENTINELS
            .iter()
            .map(|s| format!("redis://{}:26379", net.host(s).addr).into())
            .collect();
        let gateways = gateways(&net, |name| {
            let config = front
                .config(&net, name)
                .set("store.backend", "redis")
                .set("store.sentinels", sentinel_urls.clone())
                .set("store.master", "mymaster")
                .set("store.command_timeout", "1s")
                .set("store.min_replicas", i64::from(min_replicas));
            if min_replicas > 0 {
                config.set("store.replica_timeout", "500ms")
            } else {
                config
            }
        })
        .await;
        Setup {
            gateways,
            _sentinels: sentinels,
            _redis: redis,
            front,
            net,
        }
    }

    /// The primary the sentinel on `sentinel` names.
    pub fn named_primary(&self, sentinel: &str) -> String {
        redis_cli(
            self.net.host(sentinel).addr,
            26379,
            &["SENTINEL", "get-master-addr-by-name", "mymaster"],
        )
        .lines()
        .next()
        .unwrap_or("")
        .to_string()
    }

    /// Waits until `sentinel` names a primary other than r1; returns how long it took.
    pub async fn wait_promotion(&self, sentinel: &str) -> Duration {
        let started = Instant::now();
        let old = self.net.host("r1").addr.to_string();
        wait_for("a replica promoted", Duration::from_secs(60), || {
            let p = self.named_primary(sentinel);
            !p.is_empty() && p != old
        })
        .await;
        started.elapsed()
    }

    /// Waits until r1 is a replica again (the sentinels demote it once they reach it).
    pub async fn wait_r1_replica(&self) {
        let addr = self.net.host("r1").addr;
        wait_for("r1 back as a replica", Duration::from_secs(60), || {
            let info = redis_cli(addr, 6379, &["INFO", "replication"]);
            info.contains("role:slave") && info.contains("master_link_status:up")
        })
        .await;
    }
}

impl Cluster for Setup {
    fn net(&self) -> &Net {
        &self.net
    }

    fn front(&self) -> &Front {
        &self.front
    }

    fn gateways(&self) -> &[Proc] {
        &self.gateways
    }

    fn primary(&self) -> &'static str {
        "r1"
    }

    fn store(&self) -> &'static str {
        "redis"
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_a_reservation_whose_reply_is_lost_runs_at_most_once() {
    scenarios::reply_lost(&Setup::start(1).await).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_an_answer_whose_completion_is_cut_off_is_replayed_after_healing() {
    scenarios::completion_cut_off(&Setup::start_gated(1).await).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_an_answer_lost_between_upstream_and_gateway_is_reconciled_and_runs_once() {
    scenarios::upstream_cut(&Setup::start_reconciling().await).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_a_lossy_link_to_the_store_under_load_runs_each_key_at_most_once() {
    scenarios::lossy_link(&Setup::start(1).await).await;
}

/// Scenario 2, split brain: the primary and gw1 on one side; the replicas, the sentinels and gw2 on the
/// other, where the majority promotes a replica. Clients send every key to both sides. Healed,
/// the old primary rejoins as a replica and every key is retried.
async fn split_brain(min_replicas: u32) -> (Setup, Ledger) {
    let s = Setup::start(min_replicas).await;
    let mut ledger = Ledger::default();
    for i in 0..3 {
        assert_eq!(
            ledger.post(s.gw("gw1"), &format!("before-{i}")).await,
            Some(201)
        );
    }
    s.net
        .split(&["r1", "gw1"], &["r2", "r3", "s1", "s2", "s3", "gw2"]);
    let mut i = 0;
    let promoted = Instant::now();
    // Keys while the majority has not promoted yet, and for 3 s after it has.
    let mut until = None;
    loop {
        let key = format!("split-{i}");
        ledger.post(s.gw("gw1"), &key).await;
        ledger.post(s.gw("gw2"), &key).await;
        i += 1;
        if until.is_none()
            && s.named_primary("s1") != s.net.host("r1").addr.to_string()
            && !s.named_primary("s1").is_empty()
        {
            println!(
                "partition 2: a replica promoted {:.1} s after the split",
                promoted.elapsed().as_secs_f64()
            );
            until = Some(Instant::now() + Duration::from_secs(3));
        }
        if until.is_some_and(|u| Instant::now() > u) || i >= 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(until.is_some(), "the majority never promoted a replica");
    s.net.heal();
    s.wait_r1_replica().await;
    let served = ledger.settle(s.gw("gw1"), Duration::from_secs(90)).await;
    ledger.settle(s.gw("gw2"), Duration::from_secs(90)).await;
    s.report(
        &format!("2 (split brain, min_replicas = {min_replicas})"),
        &ledger,
        served,
    );
    (s, ledger)
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_split_brain_with_min_replicas_runs_each_key_at_most_once_and_keeps_every_answer() {
    let (s, ledger) = split_brain(1).await;
    s.up().assert_at_most_once();
    assert!(
        ledger.lost().is_empty(),
        "acknowledged answers lost: {:?}",
        ledger.lost()
    );
}

/// The same without `min_replicas`: what asynchronous replication costs, measured (printed),
/// not asserted: keys gw1 ran on the old primary are lost with it and run again.
#[tokio::test(flavor = "multi_thread")]
async fn redis_split_brain_without_min_replicas_is_measured() {
    let (s, ledger) = split_brain(0).await;
    let twice = s
        .up()
        .executions_per_key()
        .values()
        .filter(|n| **n > 1)
        .count();
    println!(
        "partition 2 (min_replicas = 0): {twice} keys executed twice, {} acknowledged answers lost",
        ledger.lost().len()
    );
    // Every key got a final answer after healing (settle asserts it); the losses are the figure.
    assert!(ledger.keys() > 3);
}

/// Scenario 3: the primary cut from its replicas while requests arrive (it still reaches the sentinels
/// and the gateways), then cut from everyone, so the sentinels promote a replica; healed.
#[tokio::test(flavor = "multi_thread")]
async fn redis_a_primary_cut_from_its_replicas_then_failed_over_loses_nothing_acknowledged() {
    let s = Setup::start(1).await;
    let mut ledger = Ledger::default();
    for i in 0..3 {
        assert_eq!(
            ledger.post(s.gw("gw1"), &format!("before-{i}")).await,
            Some(201)
        );
    }
    s.net.split(&["r1"], &["r2", "r3"]);
    for i in 0..10 {
        let key = format!("cut-{i}");
        ledger
            .post(s.gw(if i % 2 == 0 { "gw1" } else { "gw2" }), &key)
            .await;
    }
    s.net.split(&["r1"], &["s1", "s2", "s3", "gw1", "gw2"]);
    let took = s.wait_promotion("s1").await;
    println!(
        "partition 3: a replica promoted {:.1} s after r1 was cut from everyone",
        took.as_secs_f64()
    );
    s.net.heal();
    s.wait_r1_replica().await;
    let served = ledger.settle(s.gw("gw2"), Duration::from_secs(90)).await;
    s.report("3 (primary cut from replicas)", &ledger, served);
    s.up().assert_at_most_once();
    assert!(
        ledger.lost().is_empty(),
        "acknowledged answers lost: {:?}",
        ledger.lost()
    );
}
