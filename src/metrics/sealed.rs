//! Records sealed at rest (`store.encryption_keys_*`, [`crate::store::seal`]):
//!
//! - `idemgate_store_sealed_opened_total{key_id}`: sealed parts opened, by the id of the key
//!   that sealed them. Once an old key's count has stopped rising for the longest `ttl` after a
//!   rotation, nothing read holds it any more and its line can go.
//! - `idemgate_store_sealed_unreadable_total`: sealed parts that did not open (their key not
//!   listed, or altered): each such record is refused `500 record-unreadable`.
//!
//! Both absent while records are kept in the clear.

use std::sync::atomic::Ordering;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use super::{registered, Metrics};
use crate::store::seal::SealStats;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KeyIdLabel {
    key_id: String,
}

/// No labels: a family of one series, so that it is absent until first set.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NoLabels {}

pub(super) struct SealedMetrics {
    opened: Family<KeyIdLabel, Counter>,
    unreadable: Family<NoLabels, Counter>,
}

impl SealedMetrics {
    pub(super) fn new(r: &mut Registry) -> Self {
        SealedMetrics {
            opened: registered(
                r,
                "store_sealed_opened",
                "Sealed record parts opened (store.encryption_keys_*), by the id of the key that sealed them",
            ),
            unreadable: registered(
                r,
                "store_sealed_unreadable",
                "Sealed record parts that did not open with the gateway's keys (refused 500 record-unreadable)",
            ),
        }
    }
}

impl Metrics {
    /// The sealer's running totals, at each scrape.
    pub fn set_sealed(&self, stats: SealStats) {
        let sealed = &self.sealed;
        for (id, n) in stats.opened {
            let label = KeyIdLabel {
                key_id: id.to_string(),
            };
            sealed
                .opened
                .get_or_create(&label)
                .inner()
                .store(n, Ordering::Relaxed);
        }
        (sealed.unreadable.get_or_create(&NoLabels {}).inner())
            .store(stats.unreadable, Ordering::Relaxed);
    }
}
