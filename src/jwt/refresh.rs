//! Getting the key set and keeping it current: fetched (or read) at start and retried until it
//! loads, again every `refresh`, and at once when a token names an unknown `kid` (at most once
//! per [`KID_REFETCH`]). A failed fetch keeps the last good set, logged and counted. The
//! [`Verifiers`] registry shares one verifier per `client_jwt` table, across routes and
//! reloads, so a reload neither refetches nor forgets the cache.

use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use http::StatusCode;
use http_body_util::{BodyExt, Limited};
use sha2::{Digest, Sha256};

use super::keys::MAX_JWKS_BYTES;
use super::{KeySet, Loaded, Verifier, KID_REFETCH};
use crate::config::client::{ClientJwt, JwtKeys};
use crate::metrics::Metrics;
use crate::upstream::{oneshot, UpstreamTlsConnector};

/// One fetch, whole, within this.
const FETCH_TIMEOUT: Duration = Duration::from_secs(10);
/// Until a first key set loads, retries start this far apart and double to [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(30);

/// The verifiers in use, one per distinct `client_jwt` table.
pub struct Verifiers {
    tls: Arc<UpstreamTlsConnector>,
    metrics: Arc<Metrics>,
    live: Mutex<Vec<Weak<Verifier>>>,
}

impl Verifiers {
    pub fn new(tls: Arc<UpstreamTlsConnector>, metrics: Arc<Metrics>) -> Self {
        Verifiers {
            tls,
            metrics,
            live: Mutex::new(Vec::new()),
        }
    }

    /// The verifier for `config`: the one in use if a route already has it, else a new one
    /// whose key set starts loading now (on the calling runtime).
    pub fn get(&self, config: &Arc<ClientJwt>) -> Arc<Verifier> {
        let mut live = self.live.lock().unwrap_or_else(PoisonError::into_inner);
        live.retain(|w| w.strong_count() > 0);
        if let Some(v) = live
            .iter()
            .filter_map(Weak::upgrade)
            .find(|v| *v.config == **config)
        {
            return v;
        }
        let verifier = Arc::new(Verifier::new(
            Arc::clone(config),
            Arc::clone(&self.tls),
            Arc::clone(&self.metrics),
        ));
        live.push(Arc::downgrade(&verifier));
        if !matches!(config.keys, JwtKeys::Hmac(_)) {
            tokio::spawn(keep_fresh(Arc::downgrade(&verifier)));
        }
        verifier
    }
}

/// Loads the key set, then keeps it fresh, until no route uses the verifier any more.
async fn keep_fresh(verifier: Weak<Verifier>) {
    let mut retry = RETRY_FIRST;
    loop {
        let Some(v) = verifier.upgrade() else {
            return;
        };
        let fetched = {
            let _one_at_a_time = v.fetching.lock().await;
            v.fetch().await
        };
        let wait = if fetched {
            retry = RETRY_FIRST;
            v.config.refresh
        } else {
            let wait = retry.min(v.config.refresh);
            retry = (retry * 2).min(RETRY_MAX);
            wait
        };
        drop(v);
        tokio::time::sleep(wait).await;
    }
}

impl Verifier {
    /// After a token named an unknown `kid` under `seen` (a generation): whether the key set
    /// changed since, by another's fetch or by one made now, if none was made for a `kid` in
    /// the last [`KID_REFETCH`].
    pub(super) async fn refetch(&self, seen: u64) -> bool {
        if matches!(self.config.keys, JwtKeys::Hmac(_)) {
            return false;
        }
        let Ok(mut last) = tokio::time::timeout(FETCH_TIMEOUT, self.fetching.lock()).await else {
            return false;
        };
        if self.loaded.load().generation != seen {
            return true;
        }
        let now = tokio::time::Instant::now();
        if last.is_some_and(|at| now.duration_since(at) < KID_REFETCH) {
            return false;
        }
        *last = Some(now);
        self.fetch().await && self.loaded.load().generation != seen
    }

    /// One fetch (the caller holds `fetching`): the new set replaces the old one if it parses;
    /// otherwise the old one stays. Whether a set is loaded now from this fetch.
    async fn fetch(&self) -> bool {
        let document = match tokio::time::timeout(FETCH_TIMEOUT, self.document()).await {
            Ok(Ok(d)) => KeySet::parse(&d).map(|set| (set, d)),
            Ok(Err(why)) => Err(why),
            Err(_) => Err(format!("no answer within {FETCH_TIMEOUT:?}")),
        };
        let source = self.config.keys.describe();
        match document {
            Ok((set, bytes)) => {
                self.metrics.jwks_fetch("ok");
                let digest: [u8; 32] = Sha256::digest(&bytes).into();
                let old = self.loaded.load();
                if old.digest != digest || old.set.is_empty() {
                    tracing::info!(keys = set.len(), %source, "client_jwt key set loaded");
                    self.loaded.store(Arc::new(Loaded {
                        set,
                        digest,
                        generation: old.generation + 1,
                    }));
                }
                *self.failure.lock().unwrap_or_else(PoisonError::into_inner) = None;
                true
            }
            Err(why) => {
                self.metrics.jwks_fetch("failed");
                let kept = !self.loaded.load().set.is_empty();
                tracing::warn!(%source, why = %why, kept_last_good = kept, "client_jwt key set not fetched");
                *self.failure.lock().unwrap_or_else(PoisonError::into_inner) = Some(why);
                false
            }
        }
    }

    /// The JWKS document's bytes, bounded.
    async fn document(&self) -> Result<Vec<u8>, String> {
        match &self.config.keys {
            JwtKeys::Url(url) => {
                let response = oneshot::get(url, &self.tls, oneshot::Peer::Other).await?;
                let (parts, body) = response.into_parts();
                if parts.status != StatusCode::OK {
                    return Err(format!("answered {}", parts.status));
                }
                let body = Limited::new(body, MAX_JWKS_BYTES)
                    .collect()
                    .await
                    .map_err(|e| format!("its body: {e}"))?;
                Ok(body.to_bytes().to_vec())
            }
            JwtKeys::File(path) => {
                let len = tokio::fs::metadata(path)
                    .await
                    .map_err(|e| format!("cannot read it: {e}"))?
                    .len();
                if len > MAX_JWKS_BYTES as u64 {
                    return Err(format!("over {MAX_JWKS_BYTES} bytes"));
                }
                tokio::fs::read(path)
                    .await
                    .map_err(|e| format!("cannot read it: {e}"))
            }
            JwtKeys::Hmac(_) => Err("an HMAC secret is not fetched".into()),
        }
    }
}
