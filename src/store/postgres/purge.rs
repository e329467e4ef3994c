//! Removing expired records: every statement already ignores them, so this only keeps the
//! table (and its index) from growing. Small batches through the index on `expires_ms`, each
//! its own short transaction, rows locked by another instance's purge skipped.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use deadpool_postgres::Pool;

use super::Shared;

/// Rows removed per statement: small enough to hold few locks for a short time.
const BATCH: i64 = 500;
/// At most this many batches per round, then the next round.
const BATCHES: usize = 40;
/// How often a round starts.
pub(super) const EVERY: Duration = Duration::from_secs(1);

/// Runs until the store is dropped: it holds the store only while it purges.
pub(super) async fn purge(shared: Weak<Shared>, pool: Pool, purged: Arc<AtomicU64>) {
    let mut tick = tokio::time::interval(EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        for _ in 0..BATCHES {
            let run = shared.run(&pool, "purge", &shared.sql.purge, &[&BATCH], true);
            match run.await.map(|(_, n)| n) {
                Ok(n) => {
                    purged.fetch_add(n, Ordering::Relaxed);
                    if n < BATCH as u64 {
                        break;
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "Postgres purge: not now");
                    break;
                }
            }
        }
    }
}
