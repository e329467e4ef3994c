//! What the Redis and Postgres set-ups share: the upstream on its host, the two gateway
//! processes (gw1, gw2) and their configs, and the [`Cluster`] the shared scenarios
//! ([`super::scenarios`]) run on.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Semaphore;

use super::net::{Net, Proc};
use super::Ledger;
use crate::support::{Http, Reply, Seen, TomlConfig, Upstream, PAYMENTS};

/// The upstream on the host `up`, port 3000, answering with a permit of `gate`.
pub struct Front {
    pub up: Upstream,
    pub gate: Arc<Semaphore>,
    url: String,
    reconcile: bool,
}

impl Front {
    /// The counting upstream (`permits` at first), or with `reconcile` one that can be asked
    /// what it did with a key ([`reconciling`]), with the route reconciling with it.
    pub fn start(net: &Net, permits: usize, reconcile: bool) -> Front {
        let gate = Arc::new(Semaphore::new(permits));
        let listener = net.host("up").listen(3000);
        let up = if reconcile {
            Upstream::start_on_listener(listener, reconciling(&gate))
        } else {
            Upstream::counting_gated_on(listener, &gate)
        };
        Front {
            up,
            gate,
            url: format!("http://{}:3000", net.host("up").addr),
            reconcile,
        }
    }

    /// A gateway's config on `host` (listener on :8080, admin on :9090), the upstream, and with
    /// `reconcile` the route's `upstream_timeout = "2s"` and `reconcile = { url =
    /// ".../payments/by-key/{key}", after = "1s" }`; the store's keys are the caller's.
    pub fn config(&self, net: &Net, host: &str) -> TomlConfig {
        let addr = net.host(host).addr;
        let config = TomlConfig::parse(PAYMENTS)
            .set("server.listen", format!("{addr}:8080"))
            .set("server.admin", format!("{addr}:9090"))
            .set("upstream.url", self.url.as_str());
        if !self.reconcile {
            return config;
        }
        config
            .set("routes[0].upstream_timeout", "2s")
            .set(
                "routes[0].reconcile.url",
                format!("{}/payments/by-key/{{key}}", self.url),
            )
            .set("routes[0].reconcile.after", "1s")
    }
}

/// The gateway process on each of gw1 and gw2 with its config, once both are ready.
pub async fn gateways(net: &Net, config: impl Fn(&str) -> TomlConfig) -> Vec<Proc> {
    let mut gateways = Vec::new();
    for name in ["gw1", "gw2"] {
        let path = net.dir(name).join("proxy.toml");
        std::fs::write(&path, config(name).text()).unwrap();
        gateways.push(net.host(name).spawn(
            env!("CARGO_BIN_EXE_idemgate"),
            &["run".into(), "--config".into(), path.display().to_string()],
            net.dir("logs").join(format!("{name}.log")),
        ));
    }
    for name in ["gw1", "gw2"] {
        let admin = SocketAddr::from((net.host(name).addr, 9090));
        let ready = crate::support::eventually_within(Duration::from_secs(30), || async move {
            Http::new(admin)
                .request("GET", "/readyz")
                .try_send(Duration::from_secs(2))
                .await
                .is_some_and(|got| got.status == 200)
        })
        .await;
        if !ready {
            for g in &gateways {
                eprintln!("{}", g.log_text());
            }
        }
        assert!(ready, "{name} not ready within 30 s");
    }
    gateways
}

/// An upstream that executes each POST (its answer, 201 with the key in the body, held until
/// `gate` gives a permit) and answers `GET /payments/by-key/{key}` with what it did with the key
/// (200 and the same body, or 404): the lookup `reconcile` asks.
fn reconciling(gate: &Arc<Semaphore>) -> impl Fn(&Seen, usize) -> Reply + Send + Sync + 'static {
    let gate = Arc::clone(gate);
    let done: Mutex<HashMap<String, String>> = Mutex::default();
    move |seen, _| {
        if seen.method == http::Method::GET {
            let key = seen.path_and_query.rsplit('/').next().unwrap_or("");
            return match done.lock().unwrap().get(key) {
                Some(body) => Reply::json(200, body),
                None => Reply::json(404, "{}"),
            };
        }
        let key = seen.headers["idempotency-key"]
            .to_str()
            .unwrap()
            .to_string();
        let body = format!("{{\"charged\":\"{key}\"}}");
        done.lock().unwrap().insert(key, body.clone());
        Reply::json(201, &body).gated(&gate)
    }
}

/// A store's set-up as the shared scenarios see it.
pub trait Cluster {
    fn net(&self) -> &Net;
    fn front(&self) -> &Front;
    fn gateways(&self) -> &[Proc];
    /// The store's primary host.
    fn primary(&self) -> &'static str;
    /// The store, for reports.
    fn store(&self) -> &'static str;

    fn up(&self) -> &Upstream {
        &self.front().up
    }

    fn gw(&self, name: &str) -> SocketAddr {
        SocketAddr::from((self.net().host(name).addr, 8080))
    }

    /// Prints what the scenario saw (and the gateways' warnings, when an answer was lost).
    fn report(&self, scenario: &str, ledger: &Ledger, served_again: Duration) {
        let scenario = format!("{scenario}, {}", self.store());
        super::report(&scenario, ledger, self.up(), self.gateways(), served_again);
    }
}
