//! The background reconciliation ([`crate::reconcile`]'s background part) as the server runs
//! it: on the server's runtime, with a store handle of its own, told how to ask about a record
//! by the routes as they are now (a reload is seen at the next sweep) and the consumers.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::Policy;
use crate::gateway::Gateway;
use crate::reconcile::{self, Lookup, Sources};
use crate::store::{Origin, OriginKind};

struct Configured {
    gateway: Arc<Gateway>,
    /// Each consumer's name and policy.
    consumers: Vec<(String, Policy)>,
}

impl Configured {
    /// Every policy that reconciles, with the name and kind of its route or consumer.
    fn reconciling(&self) -> Vec<(OriginKind, String, Policy)> {
        let routes = self.gateway.routes().into_iter().map(|r| {
            let c = &r.config;
            (OriginKind::Route, c.name.clone(), c.policy.clone())
        });
        let consumers = (self.consumers.iter())
            .map(|(name, policy)| (OriginKind::Consumer, name.clone(), policy.clone()));
        routes
            .chain(consumers)
            .filter(|(_, _, p)| p.reconcile.is_some())
            .collect()
    }
}

impl Sources for Configured {
    fn lookup(&self, origin: &Origin) -> Option<(Lookup, Duration)> {
        let policy = match origin.kind {
            OriginKind::Route => {
                let routes = self.gateway.routes();
                let route = routes.iter().find(|r| r.config.name == origin.name)?;
                route.config.policy.clone()
            }
            OriginKind::Consumer => {
                let (_, policy) = self.consumers.iter().find(|(n, _)| *n == origin.name)?;
                policy.clone()
            }
        };
        Some((Lookup::of(&policy, &origin.key)?, policy.ttl))
    }

    fn any(&self) -> bool {
        !self.reconciling().is_empty()
    }

    fn longest_lease(&self) -> Duration {
        let leases = self
            .reconciling()
            .into_iter()
            .map(|(_, _, p)| p.lock_timeout);
        leases.max().unwrap_or_default()
    }
}

/// Starts the background reconciliation, until `stop`.
pub(super) fn start(
    gateway: &Arc<Gateway>,
    consumers: Vec<(String, Policy)>,
    stop: CancellationToken,
) -> Option<JoinHandle<()>> {
    let reconciler = Arc::clone(gateway.core().reconciler());
    let backlog = reconciler.take_backlog()?;
    let sources = Arc::new(Configured {
        gateway: Arc::clone(gateway),
        consumers,
    });
    Some(tokio::spawn(reconcile::run_background(
        backlog,
        reconciler,
        gateway.store().for_worker(),
        sources,
        stop,
    )))
}
