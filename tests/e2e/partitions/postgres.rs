//! Postgres with a synchronous standby under partitions: a primary (p1), its synchronous
//! standby (p2, `synchronous_standby_names`), two gateways (gw1, gw2) on both hosts with
//! `target_session_attrs=read-write` (they follow a promotion), and the upstream, each on a host
//! of its own. The test plays the operator of a failover: it promotes the standby, and fences the
//! old primary (stops it) before healing, as a cluster manager would.

use std::time::{Duration, Instant};

use tokio::sync::Semaphore;

use super::cluster::{gateways, Cluster, Front};
use super::net::{Net, Proc};
use super::{scenarios, Ledger};
use crate::support::postgres::Postgres;

const HOSTS: [&str; 5] = ["p1", "p2", "gw1", "gw2", "up"];

/// The hosts, their processes and the upstream. Fields drop in order: the processes before
/// the network they run in.
pub struct Setup {
    gateways: Vec<Proc>,
    p1: Postgres,
    p2: Postgres,
    front: Front,
    net: Net,
}

impl Setup {
    /// Everything started, p2 the synchronous standby, both gateways ready; the upstream
    /// answers with a permit of its gate (`permits` at first; with `reconcile`, see
    /// [`Front::start`]).
    pub async fn start(permits: usize, reconcile: bool) -> Setup {
        let net = Net::new(&HOSTS);
        let p1 = Postgres::start_in(&net.host("p1").ns, net.host("p1").addr, &[]);
        let p2 = Postgres::standby_in(&p1, &net.host("p2").ns, net.host("p2").addr, "standby1");
        p1.require_sync_standby("standby1");
        let front = Front::start(&net, permits, reconcile);
        // A host that drops packets costs each new connection `connect_timeout` before the next
        // host is tried: below `command_timeout` (which includes the wait for a connection), or
        // no request is served while the first host is cut off.
        let url = format!(
            "postgres://postgres@{}:5432,{}:5432/postgres?target_session_attrs=read-write&connect_timeout=1",
            p1.addr(),
            p2.addr()
        );
        let gateways = gateways(&net, |name| {
            front
                .config(&net, name)
                .set("store.backend", "postgres")
                .set("store.url", url.as_str())
                .set("store.command_timeout", "2s")
        })
        .await;
        Setup {
            gateways,
            p1,
            p2,
            front,
            net,
        }
    }

    /// The operator's failover: p1 cut from everyone (if it is not already), p2 promoted.
    /// Returns how long the promotion took.
    pub fn fail_over(&self) -> Duration {
        let started = Instant::now();
        self.net.split(&["p1"], &["p2", "gw1", "gw2", "up"]);
        self.p2.promote();
        started.elapsed()
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
        "p1"
    }

    fn store(&self) -> &'static str {
        "postgres"
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_a_reservation_whose_reply_is_lost_runs_at_most_once() {
    scenarios::reply_lost(&Setup::start(Semaphore::MAX_PERMITS, false).await).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_an_answer_whose_completion_is_cut_off_is_replayed_after_healing() {
    scenarios::completion_cut_off(&Setup::start(0, false).await).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_an_answer_lost_between_upstream_and_gateway_is_reconciled_and_runs_once() {
    scenarios::upstream_cut(&Setup::start(0, true).await).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_a_lossy_link_to_the_store_under_load_runs_each_key_at_most_once() {
    scenarios::lossy_link(&Setup::start(Semaphore::MAX_PERMITS, false).await).await;
}

/// Scenarios 2 and 3 on Postgres: the primary cut from its synchronous standby while requests
/// arrive through both gateways (split brain: gw1 stays with the primary, gw2 with the standby);
/// the standby promoted by the operator, the old primary fenced (stopped), healed.
#[tokio::test(flavor = "multi_thread")]
async fn postgres_a_primary_cut_from_its_synchronous_standby_then_failed_over_loses_nothing() {
    let mut s = Setup::start(Semaphore::MAX_PERMITS, false).await;
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
    s.report("2/3 (split from the synchronous standby)", &ledger, served);
    s.up().assert_at_most_once();
    assert!(
        ledger.lost().is_empty(),
        "lost: {:?}",
        ledger.lost_with_answers()
    );
}
