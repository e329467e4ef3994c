//! Connections: the driver's configuration from `store.url` (several hosts and
//! `target_session_attrs=read-write` follow a failover), TLS through rustls (verified against
//! `store.tls_ca_file` or the system's roots), and the pool the statements run on.

use std::str::FromStr;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime};
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
}

impl Connect {
    pub(super) fn new(settings: &PostgresSettings) -> Result<Connect, OpenError> {
        let mut config = tokio_postgres::Config::from_str(&settings.url)
            .map_err(|e| OpenError::PostgresUrl(format!("{}: {e}", redact_url(&settings.url))))?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(settings.command_timeout.max(Duration::from_secs(1)));
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
        })
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
        Pool::builder(manager)
            .max_size(size)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(timeout))
            .create_timeout(Some(timeout.max(Duration::from_secs(1))))
            .recycle_timeout(Some(timeout))
            .build()
            .map_err(|e| OpenError::PostgresUrl(e.to_string()))
    }
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
