//! Connections: the driver's configuration from `store.url` (several hosts and
//! `target_session_attrs=read-write` follow a failover), TLS through rustls (verified against
//! `store.tls_ca_file` or the system's roots), and the pool the statements run on.
//!
//! Only a connection that can keep a record is used: each new one is asked whether its node is
//! a standby (`pg_is_in_recovery()`) and whether its commits are durable (`synchronous_commit`
//! other than `off`, unless `store.allow_async_commit`); a standby is refused (the pool makes
//! another, which `target_session_attrs=read-write` sends to the primary). A pooled connection
//! lives at most [`MAX_AGE`]: `target_session_attrs` is checked only at connect, and a node that
//! turned into a standby, or an old primary nobody fenced, must not keep this process for ever.

use std::str::FromStr;
use std::time::Duration;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use deadpool_postgres::{
    Hook, HookError, Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime,
};
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::{Client, Connection, Socket};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::config::{redact_url, PostgresSettings};
use crate::store::{OpenError, StoreError};

/// A connection's stream, TLS or not (as the server and `sslmode` agree).
type TlsStream = <MakeRustlsConnect as MakeTlsConnect<Socket>>::Stream;

/// How to open one connection: for the pool, and for the listener beside it.
#[derive(Clone)]
pub(super) struct Connect {
    config: tokio_postgres::Config,
    tls: MakeRustlsConnect,
    /// `store.allow_async_commit`.
    allow_async_commit: bool,
    /// Whether the warning for an asynchronous commit was logged (once per process).
    warned: Arc<AtomicBool>,
}

/// The longest a pooled connection is used: then it is closed and another made, which finds
/// the writable node again.
pub(super) const MAX_AGE: Duration = Duration::from_secs(60);

/// How long a cancel request may take to be made.
const CANCEL_WAIT: Duration = Duration::from_secs(5);

impl Connect {
    pub(super) fn new(settings: &PostgresSettings) -> Result<Connect, OpenError> {
        let mut config = tokio_postgres::Config::from_str(&settings.url)
            .map_err(|e| OpenError::PostgresUrl(format!("{}: {e}", redact_url(&settings.url))))?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(settings.command_timeout.max(Duration::from_secs(1)));
        }
        // Every statement writes: only a node that accepts writes will do, unless the URL says
        // otherwise.
        if !settings.url.contains("target_session_attrs") {
            config.target_session_attrs(tokio_postgres::config::TargetSessionAttrs::ReadWrite);
        }
        if config.get_application_name().is_none() {
            config.application_name("idemgate");
        }
        let client = settings
            .tls_client
            .as_ref()
            .map(|(cert, key)| (cert.as_path(), key.as_path()));
        let tls = crate::upstream::client_config(settings.tls_ca_file.as_deref(), client, "store")
            .map_err(|e| OpenError::PostgresTls(e.to_string()))?;
        Ok(Connect {
            config,
            tls: MakeRustlsConnect::new(tls),
            allow_async_commit: settings.allow_async_commit,
            warned: Arc::new(AtomicBool::new(false)),
        })
    }

    /// Asks the server, in the background, to cancel what `token`'s connection is running.
    pub(super) fn cancel(&self, token: tokio_postgres::CancelToken) {
        let tls = self.tls.clone();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let cancelled = tokio::time::timeout(CANCEL_WAIT, token.cancel_query(tls)).await;
                if let Ok(Err(e)) = cancelled {
                    tracing::debug!(error = %e, "cannot cancel a statement that ran out of time");
                }
            });
        }
    }

    /// One connection outside the pool; the caller drives the [`Connection`].
    pub(super) async fn open(
        &self,
    ) -> Result<(Client, Connection<Socket, TlsStream>), tokio_postgres::Error> {
        self.config.connect(self.tls.clone()).await
    }

    /// The pool: `size` connections at most, made when first needed; waiting for one, making
    /// one and checking one are each bounded by `timeout`.
    pub(super) fn pool(&self, size: usize, timeout: Duration) -> Result<Pool, OpenError> {
        let manager = Manager::from_config(
            self.config.clone(),
            self.tls.clone(),
            // `Fast`: a connection the server or the network closed is dropped when it is next
            // taken; one that stopped answering is dropped by [`Lease`] after its timeout.
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let (allow_async_commit, warned) = (self.allow_async_commit, Arc::clone(&self.warned));
        let checked = Hook::async_fn(move |client: &mut deadpool_postgres::ClientWrapper, _| {
            let warned = Arc::clone(&warned);
            Box::pin(async move {
                let refusal = writable(client, allow_async_commit, &warned).await;
                refusal.map_err(|why| HookError::Message(why.into()))
            })
        });
        let young = Hook::sync_fn(|_, metrics| match metrics.age() > MAX_AGE {
            true => Err(HookError::Message("older than its maximum age".into())),
            false => Ok(()),
        });
        Pool::builder(manager)
            .post_create(checked)
            .pre_recycle(young)
            .max_size(size)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(timeout))
            .create_timeout(Some(timeout.max(Duration::from_secs(1))))
            .recycle_timeout(Some(timeout))
            .build()
            .map_err(|e| OpenError::PostgresUrl(e.to_string()))
    }
}

/// Whether a new connection can keep records: not on a standby, and with durable commits
/// (unless allowed otherwise); why not.
async fn writable(
    client: &tokio_postgres::Client,
    allow_async_commit: bool,
    warned: &AtomicBool,
) -> Result<(), String> {
    let row = client
        .query_one(
            "SELECT pg_is_in_recovery(), current_setting('synchronous_commit')",
            &[],
        )
        .await
        .map_err(|e| format!("cannot check the connection: {}", explain(&e)))?;
    let (standby, commit): (bool, String) = (
        row.try_get(0).map_err(|e| e.to_string())?,
        row.try_get(1).map_err(|e| e.to_string())?,
    );
    if standby {
        return Err("the node is a standby (in recovery): records cannot be written there; give every host in store.url with ?target_session_attrs=read-write".into());
    }
    if commit == "off" {
        let why = "synchronous_commit is off for the gateway's connections: a crash of the database can lose reservations the gateway already acted on, and their retries would run again";
        if !allow_async_commit {
            return Err(format!("{why}; set it to on (ALTER ROLE ... SET synchronous_commit = on), or store.allow_async_commit = true to accept that"));
        }
        if !warned.swap(true, Ordering::Relaxed) {
            tracing::warn!("{why} (store.allow_async_commit = true)");
        }
    }
    Ok(())
}

/// A pooled connection that goes back to the pool only when its statement finished: one whose
/// statement failed on the connection or ran out of time is closed instead, so that no later
/// statement queues behind an answer that may never come.
pub(super) struct Lease(Option<Object>);

impl Lease {
    pub(super) async fn take(pool: &Pool) -> Result<Lease, StoreError> {
        pool.get().await.map(|o| Lease(Some(o))).map_err(|e| {
            StoreError::Unavailable(format!("no Postgres connection: {}", explain(&e)))
        })
    }

    pub(super) fn client(&mut self) -> Result<&mut Object, StoreError> {
        self.0
            .as_mut()
            .ok_or_else(|| StoreError::Unavailable("connection already given back".into()))
    }

    /// The statement finished (with a result or an SQL error): the connection is fine.
    pub(super) fn keep(mut self) {
        self.0 = None;
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(object) = self.0.take() {
            // Detached from the pool and dropped: the connection closes.
            drop(Object::take(object));
        }
    }
}

/// An error with its causes: the driver's own message is often only the step that failed
/// ("error performing TLS handshake"), and the cause says why (an unknown issuer).
pub(super) fn explain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        cause = c.source();
    }
    out
}
