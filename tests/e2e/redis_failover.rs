//! A Redis failover under the gateway: a primary with one replica whose replication is stalled
//! (a relay between them stops forwarding, as a partition or a slow link would), new keys
//! during the stall, the primary killed with `kill -9`, the replica promoted and the gateway's
//! address moved to it (as a virtual IP or a DNS name would be), then every key retried.
//!
//! With `store.min_replicas = 1` nothing of the stalled period is answered 2xx and nothing runs
//! twice; without it, every key of the stalled period runs a second time: the figure in the
//! README's "What a Redis failure can cost" table.

use std::collections::HashMap;
use std::time::Duration;

use http::StatusCode;
use idemgate::config::{Config, RedisTarget, ReplicaAcks, SourceConfig, StoreConfig};

use crate::support::redis::{cli, replica_of, RedisCluster, RedisServer, Sentinel};
use crate::support::relay::Relay;
use crate::support::*;

/// Keys written while the replica still follows, and while it is stalled.
const BEFORE: usize = 5;
const STALLED: usize = 20;

/// A primary, a replica following it through `link`, and `vip`: the address the gateway uses.
struct Pair {
    primary: RedisServer,
    replica: RedisServer,
    link: Relay,
    vip: Relay,
    /// A replica of the promoted one, after the failover (the old primary, back as a replica).
    rejoined: Option<RedisServer>,
}

impl Pair {
    async fn start() -> Pair {
        let primary = RedisServer::start();
        let link = Relay::start(primary.port).await;
        let replica = replica_of(link.port).await;
        let vip = Relay::start(primary.port).await;
        Pair {
            primary,
            replica,
            link,
            vip,
            rejoined: None,
        }
    }

    /// `kill -9` of the primary, the replica promoted, the address moved to it, and a node
    /// back as its replica (with `min_replicas = 1`, no new key is taken until one is).
    async fn fail_over(&mut self) {
        self.primary.kill();
        assert!(self.replica.cli(&["REPLICAOF", "NO", "ONE"]).contains("OK"));
        self.vip.retarget(self.replica.port);
        self.rejoined = Some(replica_of(self.replica.port).await);
    }
}

/// A config of the gateway on `target` with `replicas` asked for, and an admin listener.
fn redis_config(upstream: &str, target: RedisTarget, replicas: Option<ReplicaAcks>) -> Config {
    let mut config = Config::parse(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n[store]\nbackend = \"redis\"\nurl = \"redis://127.0.0.1:1\"\ncommand_timeout = \"2s\"\n[upstream]\nurl = \"{upstream}\"\n{PAYMENTS}"
    ))
    .unwrap();
    let StoreConfig::Redis(settings) = &mut config.store else {
        panic!("not a Redis store");
    };
    settings.target = target;
    settings.replicas = replicas;
    config
}

/// The gateway on the Redis at `vip` with `replicas` asked for.
async fn gateway(upstream: &str, vip: u16, replicas: Option<ReplicaAcks>) -> Running {
    let target = RedisTarget::Single(format!("redis://127.0.0.1:{vip}"));
    Running::start(redis_config(upstream, target, replicas))
        .await
        .unwrap()
}

/// Posts `key` as a client does: again after each 503 (Redis unreachable, or not replicated),
/// up to 10 s.
async fn until_answered(http: &Http, key: &str) -> StatusCode {
    for _ in 0..200 {
        let got = http.post("/payments", key, "{}").await;
        if got.status != StatusCode::SERVICE_UNAVAILABLE {
            return got.status;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{key}: still 503 after 10 s");
}

/// The scenario: what the keys of the stalled period were answered, and how many keys the
/// upstream executed more than once.
async fn failover(replicas: Option<ReplicaAcks>) -> (Vec<StatusCode>, usize) {
    let mut pair = Pair::start().await;
    let up = Upstream::counting().await;
    let gw = gateway(&up.url(), pair.vip.port, replicas).await;
    let http = Http::new(gw.addr());
    for i in 0..BEFORE {
        // Retried on a 503: on a loaded machine the replica may take longer than the 100 ms
        // asked of it even while it follows.
        let key = format!("before-{i}");
        assert_eq!(
            until_answered(&http, &key).await,
            StatusCode::CREATED,
            "{key}"
        );
    }
    // The keys before the stall are on the replica (replication is asynchronous, and on a
    // loaded machine a completion may still be on its way when the link stalls: its key would
    // come back pending after the failover, and wait as in flight).
    let offset = |info: String| -> u64 {
        info.lines()
            .find_map(|l| l.trim().strip_prefix("master_repl_offset:")?.parse().ok())
            .unwrap_or(0)
    };
    let written = offset(pair.primary.cli(&["INFO", "replication"]));
    let caught_up =
        eventually(|| async { offset(pair.replica.cli(&["INFO", "replication"])) >= written })
            .await;
    assert!(caught_up, "the replica did not catch up before the stall");
    pair.link.stall();
    let mut stalled = Vec::new();
    for i in 0..STALLED {
        stalled.push(
            http.post("/payments", &format!("stalled-{i}"), "{}")
                .await
                .status,
        );
    }
    pair.fail_over().await;
    for key in (0..BEFORE)
        .map(|i| format!("before-{i}"))
        .chain((0..STALLED).map(|i| format!("stalled-{i}")))
    {
        assert_eq!(
            until_answered(&http, &key).await,
            StatusCode::CREATED,
            "{key}"
        );
    }
    let runs = runs(&up);
    // Every key ran at least once: a failover loses no work, whatever it does.
    assert_eq!(runs.len(), BEFORE + STALLED, "{runs:?}");
    let twice = ran_twice(&runs).len();
    (stalled, twice)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_min_replicas_a_failover_executes_nothing_twice() {
    let acks = ReplicaAcks {
        min: 1,
        timeout: Duration::from_millis(100),
    };
    let (stalled, twice) = failover(Some(acks)).await;
    assert!(
        stalled
            .iter()
            .all(|s| *s == StatusCode::SERVICE_UNAVAILABLE),
        "a key the replica did not hold was answered: {stalled:?}"
    );
    assert_eq!(twice, 0, "keys executed twice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_min_replicas_a_failover_executes_the_unreplicated_keys_again() {
    let (stalled, twice) = failover(None).await;
    assert!(
        stalled.iter().all(|s| *s == StatusCode::CREATED),
        "{stalled:?}"
    );
    assert_eq!(
        twice, STALLED,
        "the README's table says every key of the stalled period runs again"
    );
}

/// A Redis without the replicas asked for: `/readyz` says so, a new key is refused before it
/// is forwarded, and the shortfall is counted; an existing key still replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_few_replicas_refuse_new_keys_and_say_so() {
    let redis = RedisServer::start();
    let up = Upstream::counting().await;
    let plain = gateway(&up.url(), redis.port, None).await;
    let http = Http::new(plain.addr());
    assert_eq!(http.post("/payments", "old", "{}").await.status, 201);
    let acks = ReplicaAcks {
        min: 1,
        timeout: Duration::from_millis(50),
    };
    let gw = gateway(&up.url(), redis.port, Some(acks)).await;
    let admin = gw.admin_addr().unwrap();
    let not_ready = eventually(|| async {
        let (status, body) = admin_get(admin, "/readyz").await;
        status == 503 && body.contains("fewer connected replicas (0) than store.min_replicas (1)")
    })
    .await;
    assert!(not_ready, "{:?}", admin_get(admin, "/readyz").await);

    let http = Http::new(gw.addr());
    let refused = http.post("/payments", "new", "{}").await;
    assert_eq!(refused.status, 503, "{refused:?}");
    assert_eq!(refused.problem_type(), "store-unavailable");
    assert_eq!(up.executions(), 1, "the new key was forwarded");
    // Given back (in the background): the key is free, not pending.
    let given_back = eventually(|| async { redis.cli(&["DBSIZE"]).trim() == "1" }).await;
    assert!(given_back, "{}", redis.cli(&["KEYS", "*"]));
    let missed = scrape(admin).await;
    assert_eq!(
        missed.get("idemgate_store_replica_acks_missed_total{op=\"reserve\"}"),
        Some(&1.0),
        "{missed:?}"
    );
    let replay = http.post("/payments", "old", "{}").await;
    assert_eq!(replay.status, 201);
    assert_eq!(replay.headers["idempotent-replayed"], "true");
    assert_eq!(up.executions(), 1);
}

/// Connections to the Redis on `port` but the asking one (`CLIENT LIST` has a line each).
fn clients(port: u16) -> usize {
    cli(port, &["CLIENT", "LIST"])
        .lines()
        .count()
        .saturating_sub(1)
}

/// After a Redis restart the gateway's connections come back by themselves, before any request
/// needs them: the first request after it is served, not answered 503 on a dead connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_redis_restart_the_first_request_is_served() {
    let mut redis = RedisServer::start_durable();
    let up = Upstream::counting().await;
    let gw = gateway(&up.url(), redis.port, None).await;
    let http = Http::new(gw.addr());
    assert_eq!(http.post("/payments", "before", "{}").await.status, 201);
    let port = redis.port;
    // Every worker's connection, the readiness checker's and the subscriber's.
    let connected = clients(port);
    assert!(connected >= 3, "{}", cli(port, &["CLIENT", "LIST"]));
    redis.restart();
    let back = eventually(|| async move { clients(port) >= connected }).await;
    assert!(back, "{}", cli(port, &["CLIENT", "LIST"]));
    for i in 0..4 {
        let got = http.post("/payments", &format!("after-{i}"), "{}").await;
        assert_eq!(got.status, 201, "{got:?}");
    }
    let replay = http.post("/payments", "before", "{}").await;
    assert_eq!(replay.headers["idempotent-replayed"], "true");
    assert_eq!(up.executions(), 5);
}

/// A primary, two replicas and three sentinels (quorum 2), every one of them aware of the others.
struct Watched {
    primary: RedisServer,
    replicas: [RedisServer; 2],
    sentinels: Vec<Sentinel>,
}

impl Watched {
    async fn start() -> Watched {
        let primary = RedisServer::start();
        let replicas = [
            replica_of(primary.port).await,
            replica_of(primary.port).await,
        ];
        let sentinels: Vec<Sentinel> = (0..3).map(|_| Sentinel::start(primary.port)).collect();
        for s in &sentinels {
            let aware =
                eventually_within(Duration::from_secs(30), || async { s.knows() == (2, 2) }).await;
            assert!(aware, "sentinel {} knows {:?}", s.port, s.knows());
        }
        Watched {
            primary,
            replicas,
            sentinels,
        }
    }

    fn target(&self) -> RedisTarget {
        RedisTarget::Sentinel {
            sentinels: self.sentinels.iter().map(Sentinel::url).collect(),
            master: "mymaster".into(),
        }
    }

    /// `kill -9` of the primary; the port of the replica the sentinels promote.
    async fn fail_over(&mut self) -> u16 {
        let old = self.primary.port;
        self.primary.kill();
        let sentinel = &self.sentinels[0];
        let promoted = eventually_within(Duration::from_secs(30), || async {
            sentinel.primary().is_some_and(|p| p != old)
        })
        .await;
        assert!(promoted, "no replica was promoted");
        sentinel.primary().unwrap()
    }
}

/// A key sent under traffic, what it got, and when.
type Sent = (String, StatusCode, std::time::Instant);

/// Posts new keys one after another until `stop`, each once.
async fn traffic(http: Http, stop: tokio::sync::watch::Receiver<bool>) -> Vec<Sent> {
    let mut sent = Vec::new();
    for i in 0.. {
        if *stop.borrow() {
            break;
        }
        let key = format!("t-{i}");
        let status = http.post("/payments", &key, "{}").await.status;
        sent.push((key, status, std::time::Instant::now()));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    sent
}

/// The gateway on `target` with one replica's acknowledgement asked for; a key whose owner
/// died with its primary answers 409 at once instead of waiting.
async fn acked_gateway(upstream: &str, target: RedisTarget) -> Running {
    let acks = ReplicaAcks {
        min: 1,
        timeout: Duration::from_millis(500),
    };
    let mut config = redis_config(upstream, target, Some(acks));
    config.routes[0].policy.wait = Duration::ZERO;
    Running::start(config).await.unwrap()
}

/// The traffic of [`traffic`] running, and how to stop it.
type Traffic = (
    tokio::sync::watch::Sender<bool>,
    tokio::task::JoinHandle<Vec<Sent>>,
);

/// [`acked_gateway`] once it serves, with traffic running on it for 300 ms already.
async fn under_traffic(upstream: &str, target: RedisTarget) -> (Running, Http, Traffic) {
    let gw = acked_gateway(upstream, target).await;
    let http = Http::new(gw.addr());
    let serving = eventually_within(Duration::from_secs(20), || async {
        http.post("/payments", "first", "{}").await.status == StatusCode::CREATED
    })
    .await;
    assert!(serving, "the gateway never reached Redis");
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let driver = tokio::spawn(traffic(http.clone(), stopped));
    tokio::time::sleep(Duration::from_millis(300)).await;
    (gw, http, (stop, driver))
}

/// Stops the traffic, checks that serving again `took` less than 10 s (and prints it), and
/// retries every key it sent (201, or 409 for one whose owner died mid-call): none may have run
/// twice.
async fn after_failover(
    what: &str,
    took: Duration,
    (stop, driver): (
        tokio::sync::watch::Sender<bool>,
        tokio::task::JoinHandle<Vec<Sent>>,
    ),
    http: &Http,
    up: &Upstream,
) {
    stop.send_replace(true);
    let sent = driver.await.unwrap();
    eprintln!(
        "{what} failover: served again {took:?} after the promotion; {} keys sent under traffic",
        sent.len()
    );
    assert!(
        took < Duration::from_secs(10),
        "served again after {took:?}"
    );
    for (key, _, _) in &sent {
        let again = until_answered(http, key).await;
        assert!(
            again == StatusCode::CREATED || again == StatusCode::CONFLICT,
            "{key}: {again}"
        );
    }
    let runs = runs(up);
    assert!(
        ran_twice(&runs).is_empty(),
        "ran twice: {:?}",
        ran_twice(&runs)
    );
}

/// How many times the upstream ran each key.
fn runs(up: &Upstream) -> HashMap<String, usize> {
    let mut runs: HashMap<String, usize> = HashMap::new();
    for seen in up.seen() {
        let key = seen.headers["idempotency-key"]
            .to_str()
            .unwrap()
            .to_string();
        *runs.entry(key).or_default() += 1;
    }
    runs
}

fn ran_twice(runs: &HashMap<String, usize>) -> Vec<(&String, &usize)> {
    runs.iter().filter(|(_, n)| **n > 1).collect()
}

/// The primary killed under traffic: the sentinels promote a replica, and the same gateway
/// process finds it and serves again within 10 s of the promotion; nothing runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_failover_under_traffic_is_followed_and_runs_nothing_twice() {
    let mut redis = Watched::start().await;
    let up = Upstream::counting().await;
    let (_gw, http, traffic) = under_traffic(&up.url(), redis.target()).await;
    redis.fail_over().await;
    let promoted_at = std::time::Instant::now();
    let served = eventually_within(Duration::from_secs(20), || async {
        http.post(
            "/payments",
            &format!("probe-{:?}", promoted_at.elapsed()),
            "{}",
        )
        .await
        .status
            == StatusCode::CREATED
    })
    .await;
    assert!(served, "not served again within 20 s of the promotion");
    after_failover("sentinel", promoted_at.elapsed(), traffic, &http, &up).await;
    assert!(!redis.replicas.is_empty());
}

/// A cluster master killed under traffic: its replica is promoted, the killed node comes back as
/// the new master's replica, and the same gateway serves every slot again; nothing runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_failover_under_traffic_runs_nothing_twice() {
    let mut cluster = RedisCluster::start_with_replicas();
    let up = Upstream::counting().await;
    let target = RedisTarget::Cluster(cluster.urls());
    let (_gw, http, traffic) = under_traffic(&up.url(), target).await;
    // A master other than the first seed node, which also carries the subscriber.
    let seed = cluster.ports[0];
    let victim = *cluster.masters(seed).iter().find(|p| **p != seed).unwrap();
    cluster.kill(victim);
    // Only then may the killed node come back: empty (no persistence) and still a master in
    // its own eyes, it would wipe its replica before the replica took over (Redis's own
    // documentation warns of masters without persistence that restart at once).
    let promoted = eventually_within(Duration::from_secs(30), || async {
        let masters = cluster.masters(seed);
        masters.len() == 3 && !masters.contains(&victim)
    })
    .await;
    assert!(
        promoted,
        "no replica was promoted: {:?}",
        cluster.masters(seed)
    );
    let promoted_at = std::time::Instant::now();
    // Back as a replica: the promoted master can be acknowledged again.
    cluster.restart(victim);
    // Keys in every slot are served again.
    for i in 0..30 {
        let key = format!("after-{i}");
        assert_eq!(
            until_answered(&http, &key).await,
            StatusCode::CREATED,
            "{key}"
        );
    }
    after_failover("cluster", promoted_at.elapsed(), traffic, &http, &up).await;
}

/// A Redis-stream consumer on a Sentinel store: after the primary is killed and a replica
/// promoted, the consumer reads the stream on the new primary, and no message is applied twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_consumer_follows_a_sentinel_failover() {
    let mut redis = Watched::start().await;
    let up = Upstream::counting().await;
    let mut config = Config::parse(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[store]\nbackend = \"redis\"\nurl = \"redis://127.0.0.1:1\"\n[upstream]\nurl = \"{0}\"\n[[consumers]]\nname = \"orders\"\nsource = {{ redis_stream = \"orders\", claim_idle = \"1s\" }}\nhandler = \"{0}/orders\"\nkey = {{ json = \"/messageId\" }}\nbackoff = \"50ms\"\nmax_backoff = \"200ms\"\n",
        up.url()
    ))
    .unwrap();
    let StoreConfig::Redis(settings) = &mut config.store else {
        panic!("not a Redis store");
    };
    settings.target = redis.target();
    settings.replicas = Some(ReplicaAcks {
        min: 1,
        timeout: Duration::from_millis(500),
    });
    // The consumer reads the store's Redis: its copy of the settings, made when parsed.
    let target = settings.target.clone();
    let SourceConfig::RedisStream { redis: source, .. } = &mut config.consumers[0].source else {
        panic!("not a Redis stream");
    };
    source.target = target;
    let _gw = Running::start(config).await.unwrap();
    let applied = || {
        up.seen()
            .iter()
            .filter_map(|s| {
                let v: serde_json::Value = serde_json::from_slice(&s.body).ok()?;
                Some(v["messageId"].as_str()?.to_string())
            })
            .collect::<Vec<_>>()
    };
    let publish = |port: u16, id: &str| {
        cli(
            port,
            &[
                "XADD",
                "orders",
                "*",
                "body",
                &format!("{{\"messageId\":\"{id}\"}}"),
            ],
        )
    };
    publish(redis.primary.port, "before");
    let handled = eventually_within(Duration::from_secs(20), || async {
        applied().contains(&"before".to_string())
    })
    .await;
    assert!(handled, "{:?}", applied());

    let new_primary = redis.fail_over().await;
    publish(new_primary, "after");
    let followed = eventually_within(Duration::from_secs(20), || async {
        applied().contains(&"after".to_string())
    })
    .await;
    assert!(followed, "the consumer did not follow: {:?}", applied());
    let all = applied();
    for id in ["before", "after"] {
        assert_eq!(all.iter().filter(|a| *a == id).count(), 1, "{all:?}");
    }
}
