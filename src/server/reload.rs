//! Signals: SIGHUP reloads the routes (and the listener's certificate), SIGTERM and SIGINT
//! begin a graceful shutdown.

use std::sync::Arc;

use crate::config::identity::{rekeyed, KeyIdentity};
use crate::config::Config;
use crate::gateway::{Gateway, Routing};
use crate::tls::ListenerTls;

/// SIGHUP, caught from when this is called: its default action ends the process, so `run` calls
/// it before anything else (a SIGHUP while the store connects would otherwise kill the
/// gateway). Those that come before the gateway serves are kept for [`reload_on_sighup`].
pub struct Hangups {
    #[cfg(unix)]
    signal: Option<tokio::signal::unix::Signal>,
}

impl Hangups {
    /// Must be called within a Tokio runtime.
    pub fn catch() -> Hangups {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            let signal = signal(SignalKind::hangup())
                .map_err(|e| {
                    tracing::warn!(error = %e, "cannot listen for SIGHUP; config reload disabled")
                })
                .ok();
            Hangups { signal }
        }
        #[cfg(not(unix))]
        Hangups {}
    }
}

/// Reloads routes, defaults and the default upstream from `path` on every SIGHUP. The new file is
/// validated first; on any error the running config stays and the error is logged. Requests
/// already running finish with the routing they started with. Store and server settings cannot
/// change without a restart, and a reload that changes them says so.
pub async fn reload_on_sighup(
    hangups: Hangups,
    path: std::path::PathBuf,
    gateway: Arc<Gateway>,
    running: Config,
    tls: Option<Arc<ListenerTls>>,
) {
    #[cfg(unix)]
    {
        let Some(mut hup) = hangups.signal else {
            return;
        };
        while hup.recv().await.is_some() {
            // The listener's certificate first: rotated files are picked up even if the config
            // has an error.
            if let Some(tls) = &tls {
                match tls.reload() {
                    Ok(()) => tracing::info!("TLS certificate reloaded"),
                    Err(e) => {
                        tracing::error!(error = %e, "TLS certificate reload failed; keeping the one in use")
                    }
                }
            }
            reload_keys(&gateway, &running);
            let new = match Config::load(&path) {
                Ok(c) => c,
                Err(e) => {
                    tracing::error!(error = %e, "config reload failed; keeping the running config");
                    continue;
                }
            };
            if new.consumers != running.consumers {
                // Named, as a change to [defaults] that consumers inherit counts too.
                let changed: Vec<&str> = (new.consumers.iter())
                    .filter(|c| !running.consumers.contains(c))
                    .map(|c| c.name.as_str())
                    .chain(
                        (running.consumers.iter())
                            .filter(|c| !new.consumers.iter().any(|n| n.name == c.name))
                            .map(|c| c.name.as_str()),
                    )
                    .collect();
                tracing::warn!(consumers = ?changed, "consumer settings changed ([[consumers]], or [defaults] they inherit): they take effect only after a restart; the running consumers keep reading as they were configured");
            }
            if new.store != running.store
                || new.server != running.server
                || new.upstream_max_connections != running.upstream_max_connections
                || new.upstream_idle_timeout != running.upstream_idle_timeout
                || new.upstream_tls != running.upstream_tls
                || new.telemetry != running.telemetry
                || new.store_keys != running.store_keys
            {
                tracing::warn!("[store] (encryption_keys_* included: the keys themselves are read again), [server], [telemetry], upstream.max_connections, upstream.idle_timeout and upstream.tls_* changes take effect only after a restart; reloading routes, defaults and upstream only");
            }
            // The body budget stays the running one: a route whose bodies could never fit in it
            // would answer 503 to each of them.
            let budget = running.server.max_buffered;
            if let Some(r) = new.routes.iter().find(|r| r.policy.max_body > budget) {
                tracing::error!(
                    route = %r.name,
                    max_body = r.policy.max_body,
                    max_buffered = budget,
                    "config reload refused: a route's max_body is over the running server.max_buffered (a restart applies a new one); keeping the running config"
                );
                continue;
            }
            // Keys derived otherwise for requests already served would be unreachable: their
            // retries would run again. Refused; a restart applies it on purpose.
            let new_ids: Vec<KeyIdentity> = new.routes.iter().map(KeyIdentity::of).collect();
            let why = rekeyed(&gateway.served(), &new_ids);
            if !why.is_empty() {
                for line in &why {
                    tracing::error!(change = %line, "config reload refused: it changes how stored keys are derived; keeping the running config (a restart applies it on purpose: docs/operations.md, \"Reloading the config\")");
                }
                continue;
            }
            let routes = new.routes.len();
            gateway.reload(Routing::new(
                new.routes,
                new.upstream,
                &new.defaults,
                // [server] settings: as the warning above says, they wait for a restart.
                &running.server,
                gateway.verifiers(),
            ));
            tracing::info!(routes, "config reloaded");
        }
    }
    #[cfg(not(unix))]
    {
        let _ = (hangups, path, gateway, running, tls);
    }
}

/// The store's keys, from where the running config reads them: new records are sealed with a
/// new first key from now on; a file that cannot be read keeps the keys in use and turns
/// `/readyz` false until a reload succeeds.
fn reload_keys(gateway: &Gateway, running: &Config) {
    if let (Some(sealer), Some(source)) = (gateway.sealer(), &running.store_keys) {
        match sealer.reload_from(source) {
            Ok(()) => tracing::info!(keys = ?sealer.ids(), "store keys reloaded"),
            Err(e) => {
                tracing::error!(error = %e, "store keys reload failed; keeping the keys in use, and /readyz answers 503 until a reload succeeds")
            }
        }
    }
}

/// Resolves on SIGTERM or SIGINT sent from the moment it is called (listening is set up here,
/// not at the first poll: a caller can say it listens, and mean it).
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let term = signal(SignalKind::terminate());
        let int = signal(SignalKind::interrupt());
        async move {
            match (term, int) {
                (Ok(mut term), Ok(mut int)) => {
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = int.recv() => {}
                    }
                }
                (Err(e), Ok(mut int)) => {
                    tracing::warn!(error = %e, "cannot listen for SIGTERM; only Ctrl-C stops the gateway");
                    let _ = int.recv().await;
                }
                (_, Err(e)) => {
                    tracing::warn!(error = %e, "cannot listen for SIGINT; falling back to Ctrl-C");
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        }
    }
    #[cfg(not(unix))]
    {
        async {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
