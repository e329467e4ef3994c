//! Getting the key set and keeping it current: fetched (or read) at start and retried until it
//! loads, again every `refresh`, and at once when a token names an unknown `kid` (at most once
//! per [`KID_REFETCH`]). A failed fetch keeps the last good set, logged and counted. The
//! [`Verifiers`] registry shares one verifier per `client_jwt` table and one [`KeySource`] per
//! key source, across routes and reloads, so a reload neither refetches nor forgets the cache.

use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use http::StatusCode;
use http_body_util::{BodyExt, Limited};
use sha2::{Digest, Sha256};

use super::keys::MAX_JWKS_BYTES;
use super::{KeySet, KeySource, Loaded, Verifier, CACHE_ENTRIES, KID_REFETCH};
use crate::config::client::{ClientJwt, JwtKeys};
use crate::metrics::Metrics;
use crate::upstream::{oneshot, UpstreamTlsConnector};

/// One fetch, whole, within this.
const FETCH_TIMEOUT: Duration = Duration::from_secs(10);
/// A request whose token names an unknown `kid` waits at most this for the key set to be
/// fetched again (behind a fetch already running, or its own).
const KID_WAIT: Duration = Duration::from_secs(5);
/// Until a first key set loads, retries start this far apart and double to [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(30);

/// The verifiers in use, one per distinct `client_jwt` table, and the key sources they share.
pub struct Verifiers {
    tls: Arc<UpstreamTlsConnector>,
    metrics: Arc<Metrics>,
    live: Mutex<Vec<Weak<Verifier>>>,
    sources: Mutex<Vec<Weak<KeySource>>>,
}

impl Verifiers {
    pub fn new(tls: Arc<UpstreamTlsConnector>, metrics: Arc<Metrics>) -> Self {
        Verifiers {
            tls,
            metrics,
            live: Mutex::new(Vec::new()),
            sources: Mutex::new(Vec::new()),
        }
    }

    /// The verifier for `config`: the one in use if a route already has it, else a new one on
    /// the key source in use for its keys (so a reload that changes only an audience or a
    /// claim neither refetches nor waits for keys), or on a new source that starts loading now
    /// (on the calling runtime).
    pub fn get(&self, config: &Arc<ClientJwt>) -> Arc<Verifier> {
        let mut live = self.live.lock().unwrap_or_else(PoisonError::into_inner);
        live.retain(|w| w.strong_count() > 0);
        if let Some(v) = (live.iter().filter_map(Weak::upgrade)).find(|v| *v.config == **config) {
            return v;
        }
        let verifier = Arc::new(Verifier {
            config: Arc::clone(config),
            keys: self.source(config),
            cache: quick_cache::sync::Cache::new(CACHE_ENTRIES),
        });
        live.push(Arc::downgrade(&verifier));
        verifier
    }

    fn source(&self, config: &ClientJwt) -> Arc<KeySource> {
        let mut sources = self.sources.lock().unwrap_or_else(PoisonError::into_inner);
        sources.retain(|w| w.strong_count() > 0);
        let same = |s: &Arc<KeySource>| s.keys == config.keys && s.refresh == config.refresh;
        if let Some(s) = sources.iter().filter_map(Weak::upgrade).find(same) {
            return s;
        }
        let source = Arc::new(KeySource::new(
            config.keys.clone(),
            config.refresh,
            Arc::clone(&self.tls),
            Arc::clone(&self.metrics),
        ));
        sources.push(Arc::downgrade(&source));
        if !matches!(config.keys, JwtKeys::Hmac(_)) {
            tokio::spawn(keep_fresh(Arc::downgrade(&source)));
        }
        source
    }
}

/// Loads the key set, then keeps it fresh, until no verifier uses the source any more.
async fn keep_fresh(source: Weak<KeySource>) {
    let mut retry = RETRY_FIRST;
    loop {
        let Some(s) = source.upgrade() else {
            return;
        };
        let fetched = {
            let _one_at_a_time = s.fetching.lock().await;
            s.fetch().await
        };
        let wait = if fetched {
            retry = RETRY_FIRST;
            s.refresh
        } else {
            let wait = retry.min(s.refresh);
            retry = (retry * 2).min(RETRY_MAX);
            wait
        };
        drop(s);
        tokio::time::sleep(wait).await;
    }
}

/// What fetching the key set again for an unknown `kid` came to.
pub(super) enum Refetched {
    /// The key set changed: check the token again.
    Changed,
    /// Fetched (or not fetchable): the key is not there.
    Unchanged,
    /// Not now: one was fetched for a `kid` in the last [`KID_REFETCH`], or the fetch is still
    /// running after [`KID_WAIT`] (it goes on; the client may retry).
    Later,
}

impl KeySource {
    /// After a token named an unknown `kid` under `seen` (a generation): whether the key set
    /// changed since, by another's fetch or by one started now, if none was started for a
    /// `kid` in the last [`KID_REFETCH`]. The request waits at most [`KID_WAIT`]; a fetch it
    /// started finishes whether it waits or not, and requests that come while one runs wait
    /// for it rather than start their own.
    pub(super) async fn refetch(self: &Arc<Self>, seen: u64) -> Refetched {
        if matches!(self.keys, JwtKeys::Hmac(_)) {
            return Refetched::Unchanged;
        }
        let changed = || self.loaded.load().generation != seen;
        let Ok(mut last) = Arc::clone(&self.fetching).try_lock_owned() else {
            return match tokio::time::timeout(KID_WAIT, self.fetching.lock()).await {
                Ok(_) if changed() => Refetched::Changed,
                _ => Refetched::Later,
            };
        };
        if changed() {
            return Refetched::Changed;
        }
        let now = tokio::time::Instant::now();
        if last.is_some_and(|at| now.duration_since(at) < KID_REFETCH) {
            return Refetched::Later;
        }
        *last = Some(now);
        let source = Arc::clone(self);
        let fetch = tokio::spawn(async move {
            let _one_at_a_time = last;
            source.fetch().await
        });
        match tokio::time::timeout(KID_WAIT, fetch).await {
            Ok(Ok(_)) if changed() => Refetched::Changed,
            Ok(_) => Refetched::Unchanged,
            Err(_) => Refetched::Later,
        }
    }

    /// One fetch (the caller holds `fetching`): the new set replaces the old one if it parses;
    /// otherwise the old one stays. Whether a set is loaded now from this fetch.
    async fn fetch(&self) -> bool {
        let document = match tokio::time::timeout(FETCH_TIMEOUT, self.document()).await {
            Ok(Ok(d)) => KeySet::parse(&d).map(|set| (set, d)),
            Ok(Err(why)) => Err(why),
            Err(_) => Err(format!("no answer within {FETCH_TIMEOUT:?}")),
        };
        let source = self.keys.describe();
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
        match &self.keys {
            JwtKeys::Url(url) => {
                let response =
                    oneshot::get(url, &self.tls, oneshot::Peer::Other, http::HeaderMap::new())
                        .await?;
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
