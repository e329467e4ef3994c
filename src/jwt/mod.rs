//! Client identity from a verified JWT (`client_jwt`): the scope is SHA-256 over the token's
//! issuer and chosen claims, so a client that refreshes its token (same `iss` and `sub`, new
//! `iat` and `exp`) keeps its keys, and no one can stand in its scope without a token its
//! issuer signed.
//!
//! - [`keys`]: the key set (a JWKS document, or one HMAC secret) and the algorithms each key
//!   allows.
//! - [`refresh`]: fetching the key set at start, every `refresh`, and at once for an unknown
//!   `kid` (at most once per [`KID_REFETCH`]); one [`KeySource`] per JWKS, whichever tables
//!   name it.
//! - here: [`Verifier::scope`], with a cache of verified tokens by their hash, so a client's
//!   repeated token costs one signature check until it expires.

mod keys;
mod refresh;
mod verify;

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use arc_swap::ArcSwap;
use sha2::{Digest, Sha256};

use crate::config::client::{ClientJwt, JwtKeys};
use crate::key::ClientScope;
use crate::metrics::Metrics;
use crate::store::now_ms;
use crate::upstream::UpstreamTlsConnector;
pub use keys::KeySet;
use refresh::Refetched;
pub use refresh::Verifiers;
pub use verify::Unverified;

/// A token checked against `set` and `config` at `now_ms`, as [`Verifier`] checks one, without
/// its cache: until when it may be remembered, or why it was refused (for `crate::fuzzing`).
pub(crate) fn verify_token(
    token: &str,
    set: &KeySet,
    config: &ClientJwt,
    now_ms: u64,
) -> Result<u64, &'static str> {
    verify::verify(token, set, config, now_ms)
        .map(|v| v.until_ms)
        .map_err(Unverified::as_str)
}

/// An unknown `kid` fetches the key set again at most this often, so that forged `kid`s cannot
/// make the gateway hammer the issuer.
pub const KID_REFETCH: Duration = Duration::from_secs(30);
/// Verified tokens remembered per key source; past this, the oldest-used go.
const CACHE_ENTRIES: usize = 16_384;
/// A token longer than this is refused unread (real ones are under 2 KB).
const MAX_TOKEN: usize = 8 << 10;

/// Why a keyed request gets no scope from its token.
#[derive(Debug)]
pub enum Rejected {
    /// The token does not verify: 401.
    Unverified(Unverified),
    /// No key set has been loaded yet, or the token names a key the set may be about to get
    /// (a fetch running, or one made in the last [`KID_REFETCH`]): 503, the client may retry.
    NoKeys,
}

/// The key set as loaded, with a number that changes when its content does.
#[derive(Default)]
struct Loaded {
    set: KeySet,
    /// SHA-256 of the document it came from; a fetch of the same document changes nothing.
    digest: [u8; 32],
    generation: u64,
}

/// A verified token, remembered by its hash (never its text).
#[derive(Clone, Copy)]
struct Cached {
    scope: ClientScope,
    /// Past this (its `exp` plus the leeway), the token is checked again, and refused.
    until_ms: u64,
    generation: u64,
}

/// One source of keys (a JWKS URL or file, or an HMAC secret), fetched and kept fresh for
/// every `client_jwt` table that names it, whatever their issuers or audiences.
pub struct KeySource {
    keys: JwtKeys,
    refresh: Duration,
    loaded: ArcSwap<Loaded>,
    /// Why the last fetch failed, while no key set is loaded (for `/readyz` and the 503).
    failure: Mutex<Option<String>>,
    /// Held for a fetch (one at a time); the time of the last one an unknown `kid` asked for.
    fetching: Arc<tokio::sync::Mutex<Option<tokio::time::Instant>>>,
    tls: Arc<UpstreamTlsConnector>,
    metrics: Arc<Metrics>,
}

impl KeySource {
    fn new(
        keys: JwtKeys,
        refresh: Duration,
        tls: Arc<UpstreamTlsConnector>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let loaded = match &keys {
            JwtKeys::Hmac(secret) => Loaded {
                set: KeySet::hmac(secret.key()),
                digest: [0; 32],
                generation: 1,
            },
            JwtKeys::Url(_) | JwtKeys::File(_) => Loaded::default(),
        };
        KeySource {
            keys,
            refresh,
            loaded: ArcSwap::from_pointee(loaded),
            failure: Mutex::new(None),
            fetching: Arc::new(tokio::sync::Mutex::new(None)),
            tls,
            metrics,
        }
    }

    /// `None` once a key set is loaded; until then, why not (for `/readyz`).
    pub fn not_ready(&self) -> Option<String> {
        if !self.loaded.load().set.is_empty() {
            return None;
        }
        let why = self.failure.lock().unwrap_or_else(PoisonError::into_inner);
        Some(format!(
            "client_jwt keys from {} not loaded yet{}",
            self.keys.describe(),
            why.as_deref().map(|w| format!(": {w}")).unwrap_or_default()
        ))
    }
}

/// Verifies one `client_jwt` table's tokens; shared by every route with the same table.
pub struct Verifier {
    config: Arc<ClientJwt>,
    keys: Arc<KeySource>,
    cache: quick_cache::sync::Cache<[u8; 32], Cached>,
}

impl Verifier {
    pub fn config(&self) -> &ClientJwt {
        &self.config
    }

    /// `None` once a key set is loaded; until then, why not (for `/readyz`).
    pub fn not_ready(&self) -> Option<String> {
        self.keys.not_ready()
    }

    /// The scope of the client `token` names, once it verifies.
    pub async fn scope(&self, token: &str) -> Result<ClientScope, Rejected> {
        if token.len() > MAX_TOKEN {
            return Err(Rejected::Unverified(Unverified::Malformed));
        }
        let loaded = self.keys.loaded.load_full();
        if loaded.set.is_empty() {
            return Err(Rejected::NoKeys);
        }
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let now = now_ms();
        if let Some(hit) = self.cache.get(&digest) {
            if hit.generation == loaded.generation && now < hit.until_ms {
                return Ok(hit.scope);
            }
        }
        let verified = match verify::verify(token, &loaded.set, &self.config, now) {
            Err(Unverified::UnknownKey) => match self.keys.refetch(loaded.generation).await {
                Refetched::Changed => {
                    let loaded = self.keys.loaded.load_full();
                    verify::verify(token, &loaded.set, &self.config, now)
                        .map(|v| (v, loaded.generation))
                }
                Refetched::Unchanged => Err(Unverified::UnknownKey),
                // A rotation may be on its way: a 401 would end a real client's retries.
                Refetched::Later => return Err(Rejected::NoKeys),
            },
            other => other.map(|v| (v, loaded.generation)),
        };
        let (verified, generation) = verified.map_err(Rejected::Unverified)?;
        self.cache.insert(
            digest,
            Cached {
                scope: verified.scope,
                until_ms: verified.until_ms,
                generation,
            },
        );
        Ok(verified.scope)
    }
}

#[cfg(test)]
mod tests;
