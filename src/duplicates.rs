//! Duplicates waiting on one key: a capped room per key, and one store read for all of them.
//!
//! Without it, every duplicate of a slow request re-reads the store on each change and each
//! recheck: a client that sends a thousand copies of one request turns one key into a thousand
//! reads a second on the shared store. Here the first duplicate of a key (in this instance)
//! opens a room and a reader task; the reader reads the record, publishes it, and reads again on
//! the store's change signal or after [`RECHECK`]; every duplicate in the room only looks at
//! what the reader published. The room holds at most `max_waiters` duplicates; one more is told
//! at once ([`Full`]). The reader stops when the record is no longer pending, or when the last
//! duplicate leaves.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::watch;

use crate::key::StoreKey;
use crate::metrics::Metrics;
use crate::store::{Record, RecordState, Store, StoreError, StoreOp};

/// How often the reader re-reads a pending record even without a signal: catches an owner whose
/// lease ran out (a dead owner sends no signal), and any signal that was lost.
pub const RECHECK: Duration = Duration::from_secs(1);

/// What the reader last saw of a key.
#[derive(Clone)]
pub enum Seen {
    /// Nothing read yet.
    Nothing,
    /// The record as read (`None`: there is none, the key was released).
    Record(Option<Record>),
    /// The store could not be read; the reader stopped.
    Failed(StoreError),
    /// The reader is gone without a last word: the runtime it ran on (another worker's) was
    /// torn down at shutdown. Join again: the new room's reader runs on the caller's runtime.
    ReaderGone,
}

/// The room already holds `max_waiters` duplicates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Full;

/// Every key that has duplicates waiting on it in this instance. One per process.
#[derive(Clone)]
pub struct Rooms {
    inner: Arc<Mutex<RoomMap>>,
    /// Duplicates seated in any room.
    seated: Gauge,
}

#[derive(Default)]
struct RoomMap {
    rooms: HashMap<StoreKey, Room>,
    /// Tells a room from the one that replaced it under the same key.
    next_id: u64,
}

struct Room {
    id: u64,
    seated: usize,
    /// Kept unread, so a clone sees every value since the room opened as new.
    rx: watch::Receiver<Seen>,
}

impl Rooms {
    /// `seated` counts the duplicates waiting in every room.
    pub fn new(seated: Gauge) -> Self {
        Rooms {
            inner: Arc::default(),
            seated,
        }
    }

    /// Takes a seat in `key`'s room, opening it (and starting its reader on `store`) if there
    /// is none. Must be called inside a tokio runtime.
    pub fn join(
        &self,
        key: &StoreKey,
        max_waiters: usize,
        store: &Arc<dyn Store>,
        metrics: &Arc<Metrics>,
    ) -> Result<Seat, Full> {
        let mut map = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        // A room whose reader is gone (its worker stopped first at shutdown) is replaced.
        if let Some(room) = map
            .rooms
            .get_mut(key)
            .filter(|r| r.rx.has_changed().is_ok())
        {
            if room.seated >= max_waiters {
                return Err(Full);
            }
            room.seated += 1;
            self.seated.inc();
            return Ok(Seat {
                rx: room.rx.clone(),
                key: *key,
                id: room.id,
                rooms: self.clone(),
            });
        }
        let id = map.next_id;
        map.next_id = map.next_id.wrapping_add(1);
        let (tx, rx) = watch::channel(Seen::Nothing);
        map.rooms.insert(
            *key,
            Room {
                id,
                seated: 1,
                rx: rx.clone(),
            },
        );
        drop(map);
        self.seated.inc();
        let reader = Reader {
            key: *key,
            id,
            tx,
            store: Arc::clone(store),
            metrics: Arc::clone(metrics),
            rooms: self.clone(),
        };
        tokio::spawn(reader.run());
        Ok(Seat {
            rx,
            key: *key,
            id,
            rooms: self.clone(),
        })
    }

    /// Closes room `id` if it is still the one open under `key`.
    fn close(&self, key: &StoreKey, id: u64) {
        let mut map = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        if map.rooms.get(key).is_some_and(|r| r.id == id) {
            map.rooms.remove(key);
        }
    }
}

/// One duplicate's place in a room; leaving (dropping it) frees the seat.
pub struct Seat {
    rx: watch::Receiver<Seen>,
    key: StoreKey,
    id: u64,
    rooms: Rooms,
}

impl Seat {
    /// The next thing the reader saw that this seat has not looked at yet (the latest only).
    pub async fn next(&mut self) -> Seen {
        if self.rx.changed().await.is_err() {
            // The reader is gone without a last word: only when its runtime shut down.
            return Seen::ReaderGone;
        }
        self.rx.borrow_and_update().clone()
    }
}

impl Drop for Seat {
    fn drop(&mut self) {
        self.rooms.seated.dec();
        let mut map = self
            .rooms
            .inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let Some(room) = map.rooms.get_mut(&self.key) else {
            return;
        };
        if room.id != self.id {
            return;
        }
        room.seated = room.seated.saturating_sub(1);
        if room.seated == 0 {
            // Dropping the room's receiver (with the seats') tells the reader to stop.
            map.rooms.remove(&self.key);
        }
    }
}

/// The one task that reads a key for its room.
struct Reader {
    key: StoreKey,
    id: u64,
    tx: watch::Sender<Seen>,
    store: Arc<dyn Store>,
    metrics: Arc<Metrics>,
    rooms: Rooms,
}

impl Reader {
    async fn run(self) {
        self.read_until_settled().await;
        // A later duplicate must not see this room's last (now stale) record: it opens a new
        // room and reads afresh.
        self.rooms.close(&self.key, self.id);
    }

    async fn read_until_settled(&self) {
        loop {
            let started = tokio::time::Instant::now();
            // Subscribes before reading, so a change between the read and the wait wakes us.
            let watched = tokio::select! {
                w = self.store.watch(&self.key) => w,
                () = self.tx.closed() => return,
            };
            let failed = watched.as_ref().is_err_and(StoreError::is_failure);
            self.metrics
                .store_call(StoreOp::Get, started.elapsed(), failed);
            let watch = match watched {
                Ok(w) => w,
                Err(e) => {
                    tracing::warn!(key = self.key.short(), error = %e, "store error while waiting");
                    self.tx.send_replace(Seen::Failed(e));
                    return;
                }
            };
            let pending = matches!(
                watch.record.as_ref().map(|r| &r.state),
                Some(RecordState::Pending { .. })
            );
            self.tx.send_replace(Seen::Record(watch.record));
            if !pending {
                return;
            }
            let mut changes = watch.changes;
            tokio::select! {
                () = changes.changed() => {}
                () = tokio::time::sleep(RECHECK) => {}
                () = self.tx.closed() => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::Fingerprint;
    use crate::store::memory::MemoryStore;
    use crate::store::{Reservation, StoredResponse};

    /// A waiter whose room's reader ran on another worker's runtime, torn down first at
    /// shutdown, still gets the owner's answer: it joins again, and the new reader runs on its
    /// own runtime.
    #[tokio::test]
    async fn a_waiter_outlives_a_reader_on_a_runtime_torn_down_first() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new(10, 1 << 20));
        let metrics = Arc::new(Metrics::new());
        let rooms = Rooms::new(Gauge::default());
        let key = StoreKey::from_bytes([3; 32]);
        let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(60));
        let claim = Fingerprint([1; 32]).into();
        let Ok(Reservation::Owner(owner)) = store.reserve(&key, &claim, lease, ttl).await else {
            panic!("owned");
        };
        // Another worker: the first waiter opens the room there, then that runtime goes.
        let mut seat = {
            let (rooms, store, metrics) = (rooms.clone(), Arc::clone(&store), Arc::clone(&metrics));
            std::thread::spawn(move || {
                let other = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                let seat = other.block_on(async {
                    let mut seat = rooms.join(&key, 8, &store, &metrics).unwrap();
                    // The reader has read the pending record and waits for a change.
                    assert!(matches!(seat.next().await, Seen::Record(Some(_))));
                    seat
                });
                drop(other);
                seat
            })
            .join()
            .unwrap()
        };
        assert!(matches!(seat.next().await, Seen::ReaderGone));
        let mut seat = rooms.join(&key, 8, &store, &metrics).unwrap();
        assert!(
            matches!(seat.next().await, Seen::Record(Some(_))),
            "a live reader"
        );
        let answer = StoredResponse {
            status: http::StatusCode::CREATED,
            headers: vec![],
            trailers: vec![],
            body: bytes::Bytes::from_static(b"{}"),
            body_kept: true,
            completed_ms: 1,
            link: None,
        };
        store.complete(&key, owner, answer, ttl).await.unwrap();
        let seen = tokio::time::timeout(Duration::from_secs(5), seat.next()).await;
        assert!(matches!(
            seen,
            Ok(Seen::Record(Some(Record {
                state: RecordState::Completed(_),
                ..
            })))
        ));
    }
}
