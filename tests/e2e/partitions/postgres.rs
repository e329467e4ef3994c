//! Postgres with a synchronous standby under partitions: a primary (p1), its synchronous
//! standby (p2, `synchronous_standby_names`), two gateways (gw1, gw2) on both hosts with
//! `target_session_attrs=read-write` (they follow a promotion), and the upstream, each on a host
//! of its own. The test plays the operator of a failover: it promotes the standby, and fences the
//! old primary (stops it) before healing, as a cluster manager would.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;

use super::net::{Net, Proc};
use super::Ledger;
use crate::support::postgres::Postgres;
use crate::support::{Http, TomlConfig, Upstream, PAYMENTS};

const HOSTS: [&str; 5] = ["p1", "p2", "gw1", "gw2", "up"];

/// The hosts, their processes and the upstream. Fields drop in order: the processes before
/// the network they run in.
pub struct Setup {
    gateways: Vec<Proc>,
    pub p1: Postgres,
    pub p2: Postgres,
    pub up: Upstream,
    pub gate: Arc<Semaphore>,
    pub net: Net,
}

impl Setup {
    /// Everything started, p2 the synchronous standby, both gateways ready; the upstream
    /// answers with a permit of `gate` (`permits` at first).
    pub async fn start(permits: usize) -> Setup {
        let net = Net::new(&HOSTS);
        let p1 = Postgres::start_in(&net.host("p1").ns, net.host("p1").addr, &[]);
        let p2 = Postgres::standby_in(&p1, &net.host("p2").ns, net.host("p2").addr, "standby1");
        p1.require_sync_standby("standby1");
        let gate = Arc::new(Semaphore::new(permits));
        let up = Upstream::counting_gated_on(net.host("up").listen(3000), &gate);
        // A host that drops packets costs each new connection `connect_timeout` before the next
        // host is tried: below `command_timeout` (which includes the wait for a connection), or
        // no request is served while the first host is cut off.
        let url = format!(
            "postgres://postgres@{}:5432,{}:5432/postgres?target_session_attrs=read-write&connect_timeout=1",
            p1.addr(),
            p2.addr()
        );
        let mut gateways = Vec::new();
        for name in ["gw1", "gw2"] {
            let host = net.host(name);
            let config = TomlConfig::parse(PAYMENTS)
                .set("server.listen", format!("{}:8080", host.addr))
                .set("server.admin", format!("{}:9090", host.addr))
                .set("store.backend", "postgres")
                .set("store.url", url.as_str())
                .set("store.command_timeout", "2s")
                .set(
                    "upstream.url",
                    format!("http://{}:3000", net.host("up").addr),
                );
            let path = net.dir(name).join("proxy.toml");
            std::fs::write(&path, config.text()).unwrap();
            gateways.push(host.spawn(
                env!("CARGO_BIN_EXE_idemgate"),
                &["run".into(), "--config".into(), path.display().to_string()],
                net.dir("logs").join(format!("{name}.log")),
            ));
        }
        let setup = Setup {
            net,
            p1,
            p2,
            gateways,
            up,
            gate,
        };
        for name in ["gw1", "gw2"] {
            setup.wait_ready(name).await;
        }
        setup
    }

    pub fn gw(&self, name: &str) -> SocketAddr {
        SocketAddr::from((self.net.host(name).addr, 8080))
    }

    async fn wait_ready(&self, name: &str) {
        let admin = SocketAddr::from((self.net.host(name).addr, 9090));
        let ready = crate::support::eventually_within(Duration::from_secs(30), || async move {
            Http::new(admin)
                .request("GET", "/readyz")
                .try_send(Duration::from_secs(2))
                .await
                .is_some_and(|got| got.status == 200)
        })
        .await;
        if !ready {
            for g in &self.gateways {
                eprintln!("{}", g.log_text());
            }
        }
        assert!(ready, "{name} not ready within 30 s");
    }

    /// The operator's failover: p1 cut from everyone (if it is not already), p2 promoted.
    /// Returns how long the promotion took.
    pub fn fail_over(&self) -> Duration {
        let started = Instant::now();
        self.net.split(&["p1"], &["p2", "gw1", "gw2", "up"]);
        self.p2.promote();
        started.elapsed()
    }

    /// Prints what the scenario saw (and the gateways' warnings, when an answer was lost).
    pub fn report(&self, scenario: &str, ledger: &Ledger, served_again: Duration) {
        super::report(scenario, ledger, &self.up, &self.gateways, served_again);
    }
}

/// Scenario 1 on Postgres: gw1 cut from the primary's replies while it reserves new keys, then
/// healed.
#[tokio::test(flavor = "multi_thread")]
async fn postgres_a_reservation_whose_reply_is_lost_runs_at_most_once() {
    let s = Setup::start(Semaphore::MAX_PERMITS).await;
    let mut ledger = Ledger::default();
    assert_eq!(ledger.post(s.gw("gw1"), "before").await, Some(201));
    s.net.cut_inbound("gw1", "p1");
    for i in 0..3 {
        ledger.post(s.gw("gw1"), &format!("cut-{i}")).await;
    }
    s.net.heal();
    let served = ledger.settle(s.gw("gw1"), Duration::from_secs(90)).await;
    s.report("1 (reply lost, postgres)", &ledger, served);
    s.up.assert_at_most_once();
    assert!(
        ledger.lost().is_empty(),
        "lost: {:?}",
        ledger.lost_with_answers()
    );
}

/// Scenario 1 at the completion on Postgres: gw1's packets to the primary dropped from the
/// moment the upstream answers, for 3 s; the retry through gw2 after healing replays.
#[tokio::test(flavor = "multi_thread")]
async fn postgres_an_answer_whose_completion_is_cut_off_is_replayed_after_healing() {
    let s = Setup::start(0).await;
    let mut ledger = Ledger::default();
    let gw = s.gw("gw1");
    let first = tokio::spawn(async move {
        let mut ledger = Ledger::default();
        ledger.post(gw, "cut-at-completion").await;
        ledger
    });
    s.up.next_arrival().await;
    s.net.cut_inbound("p1", "gw1");
    s.gate.add_permits(1);
    ledger.merge(first.await.unwrap());
    assert_eq!(ledger.answers("cut-at-completion"), [Some(201)]);
    tokio::time::sleep(Duration::from_secs(3)).await;
    s.net.heal();
    let healed = Instant::now();
    ledger.post(s.gw("gw2"), "cut-at-completion").await;
    let served = healed.elapsed();
    s.report("1 (completion cut off, postgres)", &ledger, served);
    s.up.assert_at_most_once();
    assert!(
        ledger.lost().is_empty(),
        "lost: {:?}",
        ledger.lost_with_answers()
    );
    assert!(
        served < Duration::from_secs(10),
        "the replay waited {served:?}"
    );
}

/// Scenarios 2 and 3 on Postgres: the primary cut from its synchronous standby while requests
/// arrive through both gateways (split brain: gw1 stays with the primary, gw2 with the standby);
/// the standby promoted by the operator, the old primary fenced (stopped), healed.
#[tokio::test(flavor = "multi_thread")]
async fn postgres_a_primary_cut_from_its_synchronous_standby_then_failed_over_loses_nothing() {
    let mut s = Setup::start(Semaphore::MAX_PERMITS).await;
    let mut ledger = Ledger::default();
    for i in 0..3 {
        assert_eq!(
            ledger.post(s.gw("gw1"), &format!("before-{i}")).await,
            Some(201)
        );
    }
    s.net.split(&["p1", "gw1"], &["p2", "gw2"]);
    for i in 0..6 {
        let key = format!("split-{i}");
        ledger.post(s.gw("gw1"), &key).await;
        ledger.post(s.gw("gw2"), &key).await;
    }
    let took = s.fail_over();
    let promoted = Instant::now();
    // gw2 serves new keys on the promoted standby while the old primary is still cut off.
    let mut first_served = None;
    for i in 0..20 {
        let key = format!("promoted-{i}");
        ledger.post(s.gw("gw1"), &key).await;
        if ledger.post(s.gw("gw2"), &key).await == Some(201) && first_served.is_none() {
            first_served = Some(promoted.elapsed());
        }
        if first_served.is_some() && i >= 5 {
            break;
        }
    }
    let first_served = first_served.expect("gw2 served no new key on the promoted standby");
    println!(
        "partition 2/3 (postgres): the standby promoted in {:.1} s; gw2 served a new key {:.1} s after",
        took.as_secs_f64(),
        first_served.as_secs_f64()
    );
    // Fenced (killed, as a cluster manager's fencing would) before the network heals: the old
    // primary must not take writes again.
    s.p1.kill();
    s.net.heal();
    let served = ledger.settle(s.gw("gw1"), Duration::from_secs(90)).await;
    ledger.settle(s.gw("gw2"), Duration::from_secs(90)).await;
    s.report(
        "2/3 (split from the synchronous standby, postgres)",
        &ledger,
        served,
    );
    s.up.assert_at_most_once();
    assert!(
        ledger.lost().is_empty(),
        "lost: {:?}",
        ledger.lost_with_answers()
    );
}
