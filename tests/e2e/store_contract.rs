//! The store contract (see `src/store/mod.rs`), run against every backend.
//!
//! Each check is a plain async function over `&dyn Store`, so a new backend gets the whole suite
//! by adding one module that runs `all_checks!`.

use crate::support::eventually;
use crate::support::redis::{RedisCluster, RedisServer};

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};
use idemgate::config::{RedisSettings, RedisTarget};
use idemgate::fingerprint::Fingerprint;
use idemgate::key::{ClientScope, StoreKey};
use idemgate::store::memory::MemoryStore;
use idemgate::store::redis::RedisStore;
use idemgate::store::{
    Claim, Origin, OriginKind, OwnerToken, Record, RecordState, Reservation, Store, StoreError,
    StoredResponse, Subscription, TraceLink, UnknownReason,
};

const FP: Fingerprint = Fingerprint([7; 32]);
const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(3600);

fn key(name: &str) -> StoreKey {
    // A fresh scope per test run keeps backends that outlive a test (Redis) from sharing keys.
    StoreKey::new(&ClientScope::from_value(name.as_bytes()), "route", name)
}

fn response() -> StoredResponse {
    StoredResponse {
        trailers: vec![],
        status: StatusCode::CREATED,
        headers: vec![
            (
                HeaderName::from_static("content-type"),
                HeaderValue::from_static("application/json"),
            ),
            (
                HeaderName::from_static("set-cookie"),
                HeaderValue::from_static("a=1"),
            ),
            (
                HeaderName::from_static("set-cookie"),
                HeaderValue::from_static("b=2"),
            ),
        ],
        body: Bytes::from_static(b"{\"id\":1}\x00\xff binary ok"),
        body_kept: true,
        completed_ms: 1_700_000_000_000,
        link: None,
    }
}

async fn own(store: &dyn Store, k: &StoreKey) -> OwnerToken {
    match store.reserve(k, &FP.into(), LEASE, TTL).await.unwrap() {
        Reservation::Owner(t) => t,
        other => panic!("expected ownership, got {other:?}"),
    }
}

async fn exactly_one_of_many_concurrent_reservations_owns_a_key(store: Arc<dyn Store>) {
    let k = key("race");
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let (store, k) = (Arc::clone(&store), k);
        tasks.push(tokio::spawn(async move {
            store.reserve(&k, &FP.into(), LEASE, TTL).await.unwrap()
        }));
    }
    let mut owners = 0;
    for t in tasks {
        match t.await.unwrap() {
            Reservation::Owner(_) => owners += 1,
            Reservation::Existing(r) => {
                assert_eq!(r.fingerprint, FP);
                assert!(matches!(r.state, RecordState::Pending { .. }));
            }
        }
    }
    assert_eq!(owners, 1);
}

async fn a_completed_record_is_returned_exactly(store: Arc<dyn Store>) {
    let k = key("complete");
    let t = own(&*store, &k).await;
    store.complete(&k, t, response(), TTL).await.unwrap();
    let Reservation::Existing(Record {
        fingerprint,
        state: RecordState::Completed(r),
        ..
    }) = store.reserve(&k, &FP.into(), LEASE, TTL).await.unwrap()
    else {
        panic!("expected the completed record");
    };
    assert_eq!(fingerprint, FP);
    assert_eq!(
        *r,
        response(),
        "status, headers in order (repeats included), body bytes"
    );
    assert_eq!(
        store.get(&k).await.unwrap().unwrap().state,
        RecordState::Completed(r)
    );
}

async fn only_the_owner_can_complete_release_renew_or_mark_unknown(store: Arc<dyn Store>) {
    let k = key("owner");
    let t = own(&*store, &k).await;
    let stranger = OwnerToken::random();
    assert_eq!(
        store.complete(&k, stranger, response(), TTL).await,
        Err(StoreError::NotOwner)
    );
    assert_eq!(store.release(&k, stranger).await, Err(StoreError::NotOwner));
    assert_eq!(
        store.renew(&k, stranger, LEASE).await,
        Err(StoreError::NotOwner)
    );
    assert_eq!(
        store
            .mark_unknown(&k, stranger, UnknownReason::Timeout)
            .await,
        Err(StoreError::NotOwner)
    );
    assert!(
        matches!(store.get(&k).await.unwrap().unwrap().state, RecordState::Pending { owner, .. } if owner == t)
    );
    // Once completed, even the former owner cannot change it.
    store.complete(&k, t, response(), TTL).await.unwrap();
    assert_eq!(store.release(&k, t).await, Err(StoreError::NotOwner));
    assert_eq!(
        store.complete(&k, t, response(), TTL).await,
        Err(StoreError::NotOwner)
    );
    assert!(matches!(
        store.get(&k).await.unwrap().unwrap().state,
        RecordState::Completed(_)
    ));
}

async fn release_lets_the_next_reservation_own_the_key(store: Arc<dyn Store>) {
    let k = key("release");
    let t = own(&*store, &k).await;
    store.release(&k, t).await.unwrap();
    assert_eq!(store.get(&k).await.unwrap(), None);
    let t2 = own(&*store, &k).await;
    assert_ne!(t, t2);
}

async fn unknown_outcomes_are_kept(store: Arc<dyn Store>) {
    let k = key("unknown");
    let t = own(&*store, &k).await;
    store
        .mark_unknown(&k, t, UnknownReason::Interrupted)
        .await
        .unwrap();
    let Reservation::Existing(r) = store.reserve(&k, &FP.into(), LEASE, TTL).await.unwrap() else {
        panic!("an unknown outcome must not be reservable again");
    };
    assert!(matches!(
        r.state,
        RecordState::Unknown {
            reason: UnknownReason::Interrupted,
            ..
        }
    ));
}

async fn renew_extends_the_lease(store: Arc<dyn Store>) {
    let k = key("renew");
    let t = own(&*store, &k).await;
    let before = match store.get(&k).await.unwrap().unwrap().state {
        RecordState::Pending { lease_until_ms, .. } => lease_until_ms,
        other => panic!("{other:?}"),
    };
    store.renew(&k, t, LEASE * 10).await.unwrap();
    let after = match store.get(&k).await.unwrap().unwrap().state {
        RecordState::Pending { lease_until_ms, .. } => lease_until_ms,
        other => panic!("{other:?}"),
    };
    assert!(
        after >= before + LEASE.as_millis() as u64 * 8,
        "{before} -> {after}"
    );
}

/// Waits (5 s at most) for `sub` to be woken; fails with `why` otherwise.
async fn woken(sub: &mut Subscription, why: &str) {
    tokio::time::timeout(Duration::from_secs(5), sub.changed())
        .await
        .expect(why);
}

async fn waiters_are_woken_by_completion(store: Arc<dyn Store>) {
    let k = key("wake");
    let t = own(&*store, &k).await;
    // As a waiting request does: read saying it waits, subscribed from before the read.
    let watch = store.watch(&k).await.unwrap();
    assert!(matches!(
        watch.record.unwrap().state,
        RecordState::Pending { .. }
    ));
    let mut sub = watch.changes;
    let (s2, k2) = (Arc::clone(&store), k);
    let completer =
        tokio::spawn(async move { s2.complete(&k2, t, response(), TTL).await.unwrap() });
    woken(&mut sub, "a completion must wake the subscriber").await;
    completer.await.unwrap();
    assert!(matches!(
        store.get(&k).await.unwrap().unwrap().state,
        RecordState::Completed(_)
    ));
}

async fn waiters_are_woken_by_release(store: Arc<dyn Store>) {
    let k = key("wake-release");
    let t = own(&*store, &k).await;
    let mut sub = store.watch(&k).await.unwrap().changes;
    store.release(&k, t).await.unwrap();
    woken(&mut sub, "a release must wake the subscriber").await;
}

/// The owner renews its lease while a waiter waits: the waiter must still hear the completion.
async fn waiters_are_woken_after_a_renewal(store: Arc<dyn Store>) {
    let k = key("wake-renewed");
    let t = own(&*store, &k).await;
    let mut sub = store.watch(&k).await.unwrap().changes;
    store.renew(&k, t, LEASE * 10).await.unwrap();
    store.renew(&k, t, LEASE * 10).await.unwrap();
    store.complete(&k, t, response(), TTL).await.unwrap();
    woken(
        &mut sub,
        "a completion after renewals must wake the subscriber",
    )
    .await;
}

async fn waiters_are_woken_by_an_operator_delete(store: Arc<dyn Store>) {
    let k = key("wake-delete");
    own(&*store, &k).await;
    let mut sub = store.watch(&k).await.unwrap().changes;
    assert!(store.delete(&k).await.unwrap());
    woken(
        &mut sub,
        "deleting a pending record must wake the subscriber",
    )
    .await;
}

/// A waiter reading a record must not make it look changed to a take-over of that same record,
/// and the waiter still hears the new owner's completion.
async fn take_over_accepts_a_record_a_waiter_reads(store: Arc<dyn Store>) {
    let k = key("take-over-watched");
    own(&*store, &k).await;
    let watch = store.watch(&k).await.unwrap();
    let (seen, mut sub) = (watch.record.unwrap(), watch.changes);
    let t2 = store
        .take_over(&k, &seen, &FP.into(), LEASE, TTL)
        .await
        .unwrap()
        .expect("the record is as the waiter saw it");
    store.complete(&k, t2, response(), TTL).await.unwrap();
    woken(
        &mut sub,
        "the new owner's completion must wake the subscriber",
    )
    .await;
}

async fn operators_can_delete_any_record(store: Arc<dyn Store>) {
    let k = key("delete");
    let t = own(&*store, &k).await;
    store
        .mark_unknown(&k, t, UnknownReason::Timeout)
        .await
        .unwrap();
    assert!(store.delete(&k).await.unwrap());
    assert!(!store.delete(&k).await.unwrap());
    own(&*store, &k).await;
}

async fn take_over_is_compare_and_set(store: Arc<dyn Store>) {
    let k = key("take-over");
    let t = own(&*store, &k).await;
    store
        .mark_unknown(&k, t, UnknownReason::Interrupted)
        .await
        .unwrap();
    let unknown = store.get(&k).await.unwrap().unwrap();
    let t2 = store
        .take_over(&k, &unknown, &FP.into(), LEASE, TTL)
        .await
        .unwrap()
        .expect("takes over");
    assert_ne!(t, t2);
    assert!(
        matches!(store.get(&k).await.unwrap().unwrap().state, RecordState::Pending { owner, .. } if owner == t2)
    );
    // The same stale view cannot take over twice, and the old owner is out.
    assert_eq!(
        store
            .take_over(&k, &unknown, &FP.into(), LEASE, TTL)
            .await
            .unwrap(),
        None
    );
    assert_eq!(
        store.complete(&k, t, response(), TTL).await,
        Err(StoreError::NotOwner)
    );
    store.complete(&k, t2, response(), TTL).await.unwrap();
    // Nothing to take over once the key is gone.
    store.delete(&k).await.unwrap();
    assert_eq!(
        store
            .take_over(&k, &unknown, &FP.into(), LEASE, TTL)
            .await
            .unwrap(),
        None
    );
}

/// A completed record, as a retry reads it, is taken over by another request (how a stored 4xx
/// gives way to another event with the same business key): compare and set on the whole record,
/// the new owner's fingerprint kept.
async fn a_completed_record_can_be_taken_over(store: Arc<dyn Store>) {
    const OTHER: Fingerprint = Fingerprint([8; 32]);
    let k = key("take-over-completed");
    let t = own(&*store, &k).await;
    let refused = StoredResponse {
        status: StatusCode::BAD_REQUEST,
        ..response()
    };
    store.complete(&k, t, refused, TTL).await.unwrap();
    let Reservation::Existing(seen) = store.reserve(&k, &OTHER.into(), LEASE, TTL).await.unwrap()
    else {
        panic!("the key is taken");
    };
    let t2 = store
        .take_over(&k, &seen, &OTHER.into(), LEASE, TTL)
        .await
        .unwrap()
        .expect("takes over the completed record");
    let now = store.get(&k).await.unwrap().unwrap();
    assert_eq!(now.fingerprint, OTHER);
    assert!(matches!(now.state, RecordState::Pending { owner, .. } if owner == t2));
    assert_eq!(
        store
            .take_over(&k, &seen, &OTHER.into(), LEASE, TTL)
            .await
            .unwrap(),
        None,
        "once only"
    );
    store.complete(&k, t2, response(), TTL).await.unwrap();
    let done = store.get(&k).await.unwrap().unwrap();
    assert!(matches!(done.state, RecordState::Completed(r) if r.status == StatusCode::CREATED));
}

/// A take-over whose caller goes away mid-call (a client that hung up, a timeout around it) never
/// frees the key: the record it was replacing, unknown or completed, stays (or comes back), or
/// the take-over's own record stands; a retry never finds the key free. Dropped at every point
/// a first poll can reach.
async fn a_take_over_dropped_mid_flight_never_frees_the_key(store: Arc<dyn Store>) {
    for (i, completed) in [(0, false), (1, true)] {
        let k = key(&format!("dropped-take-over-{i}"));
        let t = own(&*store, &k).await;
        if completed {
            store.complete(&k, t, response(), TTL).await.unwrap();
        } else {
            store
                .mark_unknown(&k, t, UnknownReason::Timeout)
                .await
                .unwrap();
        }
        let seen = store.get(&k).await.unwrap().unwrap();
        // Polled once (the command goes out, or is queued), then dropped; a store that answers
        // in its first poll (memory) is not dropped, and must not free the key either.
        let _ = tokio::time::timeout(
            Duration::ZERO,
            store.take_over(&k, &seen, &FP.into(), LEASE, TTL),
        )
        .await;
        // Whatever landed, and whatever a give-back wrote, in any order: never free.
        for _ in 0..20 {
            let now = store.get(&k).await.unwrap();
            assert!(now.is_some(), "a dropped take-over freed the key");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(
            matches!(
                store.reserve(&k, &FP.into(), LEASE, TTL).await.unwrap(),
                Reservation::Existing(_)
            ),
            "a retry found the key free"
        );
    }
}

/// The store decides that a lease ran out: the record reads as abandoned (never as pending
/// for ever, never as gone), and a take-over of what was read succeeds once.
async fn a_lease_that_runs_out_reads_as_abandoned(store: Arc<dyn Store>) {
    let k = key("abandoned");
    let t = match store
        .reserve(&k, &FP.into(), Duration::from_millis(1), TTL)
        .await
        .unwrap()
    {
        Reservation::Owner(t) => t,
        other => panic!("expected ownership, got {other:?}"),
    };
    let abandoned =
        |r: &Record| matches!(r.state, RecordState::Abandoned { owner, .. } if owner == t);
    assert!(
        eventually(|| {
            let store = Arc::clone(&store);
            async move { abandoned(&store.get(&k).await.unwrap().unwrap()) }
        })
        .await,
        "a pending record past its lease reads as abandoned"
    );
    let Reservation::Existing(seen) = store.reserve(&k, &FP.into(), LEASE, TTL).await.unwrap()
    else {
        panic!("an abandoned key must not be reservable again");
    };
    assert!(abandoned(&seen), "{seen:?}");
    let t2 = store
        .take_over(&k, &seen, &FP.into(), LEASE, TTL)
        .await
        .unwrap()
        .expect("an abandoned record is taken over as read");
    assert_eq!(
        store
            .take_over(&k, &seen, &FP.into(), LEASE, TTL)
            .await
            .unwrap(),
        None
    );
    assert!(
        matches!(store.get(&k).await.unwrap().unwrap().state, RecordState::Pending { owner, .. } if owner == t2)
    );
}

/// A worker's handle is the same store: what one handle reserves, another sees and cannot own.
async fn worker_handles_share_one_store(store: Arc<dyn Store>) {
    let k = key("workers");
    let (a, b) = (store.for_worker(), store.for_worker());
    let t = own(&*a, &k).await;
    assert!(matches!(
        b.reserve(&k, &FP.into(), LEASE, TTL).await.unwrap(),
        Reservation::Existing(_)
    ));
    let mut sub = b.watch(&k).await.unwrap().changes;
    store.complete(&k, t, response(), TTL).await.unwrap();
    woken(
        &mut sub,
        "a completion through one handle wakes a waiter on another",
    )
    .await;
    assert!(matches!(
        b.get(&k).await.unwrap().unwrap().state,
        RecordState::Completed(_)
    ));
}

async fn keys_are_independent(store: Arc<dyn Store>) {
    let (a, b) = (key("ind-a"), key("ind-b"));
    let ta = own(&*store, &a).await;
    own(&*store, &b).await;
    store.complete(&a, ta, response(), TTL).await.unwrap();
    assert!(matches!(
        store.get(&b).await.unwrap().unwrap().state,
        RecordState::Pending { .. }
    ));
}

/// The client keys of every unknown outcome listed from `route`, paging 2 at a time, each
/// page at most what was asked and each entry checked against its origin.
async fn listed(store: &dyn Store, route: &str) -> Vec<String> {
    let mut listed = Vec::new();
    let mut cursor: Option<String> = None;
    for page_no in 0.. {
        assert!(page_no < 100_000, "the listing never ended");
        let page = store.scan_unknown(cursor.as_deref(), 2).await.unwrap();
        assert!(
            page.records.len() <= 2,
            "a page holds at most what was asked"
        );
        for found in page.records {
            assert!(found.record.is_unknown(), "{found:?}");
            let Some(origin) = found.record.origin.clone() else {
                continue;
            };
            if origin.name == route {
                assert_eq!(origin.kind, OriginKind::Route);
                assert_eq!(found.key, key(&format!("{route}-{}", origin.key)));
                listed.push(origin.key.clone());
            }
        }
        cursor = page.cursor;
        if cursor.is_none() {
            break;
        }
    }
    listed
}

/// The operator's listing: every unknown outcome (marked unknown, or abandoned) comes back
/// once across pages, with the route and the key its client sent; nothing else does.
async fn unknown_outcomes_are_listed_with_their_origin(store: Arc<dyn Store>) {
    // Other checks may share the store: this one's records are told apart by their route.
    let route = format!("listing-{}", rand::random::<u32>());
    let claim = |key: &str| Claim {
        fingerprint: FP,
        origin: Some(Origin::new(OriginKind::Route, &route, key.to_owned())),
    };
    let reserve = |name: &'static str, lease: Duration| {
        let (store, claim) = (Arc::clone(&store), claim(name));
        let k = key(&format!("{route}-{name}"));
        async move {
            match store.reserve(&k, &claim, lease, TTL).await.unwrap() {
                Reservation::Owner(t) => (k, t),
                other => panic!("expected ownership, got {other:?}"),
            }
        }
    };
    // Only settled and running records (on a store of its own): an empty listing.
    let (done, t) = reserve("done", LEASE).await;
    store.complete(&done, t, response(), TTL).await.unwrap();
    reserve("running", LEASE).await;
    assert!(
        listed(&*store, &route).await.is_empty(),
        "settled and running records are not unknown"
    );
    let mut expected = Vec::new();
    for name in ["timeout 1", "timeout 2", "a/b?c=d"] {
        let (k, t) = reserve(name, LEASE).await;
        // A waiter's flag on the pending record must not cost the origin (the Redis scripts).
        store.watch(&k).await.unwrap();
        store
            .mark_unknown(&k, t, UnknownReason::Timeout)
            .await
            .unwrap();
        expected.push(name);
    }
    for name in ["crashed 1", "crashed 2"] {
        reserve(name, Duration::from_millis(1)).await;
        expected.push(name);
    }
    assert_eq!(
        store.get(&done).await.unwrap().unwrap().origin,
        None,
        "a completed record drops it"
    );
    // Past the 1 ms leases.
    tokio::time::sleep(Duration::from_millis(20)).await;

    let mut listed = listed(&*store, &route).await;
    listed.sort();
    expected.sort();
    assert_eq!(listed, expected, "each unknown outcome once, nothing else");
    assert_eq!(
        store
            .scan_unknown(Some("not a cursor"), 2)
            .await
            .unwrap_err(),
        StoreError::BadCursor
    );
}

/// When a record expires, for the operator API: about `ttl` after it was written, in every
/// state; nothing for a key without a record.
async fn a_records_expiry_is_told(store: Arc<dyn Store>) {
    let k = key("expiring");
    assert_eq!(store.expires_ms(&k).await.unwrap(), None);
    let t = own(&*store, &k).await;
    let within = |at: Option<u64>| {
        let at = at.expect("an expiry");
        let now = idemgate::store::now_ms();
        let ttl = TTL.as_millis() as u64;
        // The record's ttl in milliseconds: not its lease, nor seconds (a minute's slack for
        // a loaded machine).
        assert!(
            at + 60_000 > now + ttl && at <= now + ttl + 1000,
            "{at} vs now {now} + {ttl}"
        );
    };
    within(store.expires_ms(&k).await.unwrap());
    store.complete(&k, t, response(), TTL).await.unwrap();
    within(store.expires_ms(&k).await.unwrap());
    // An unknown outcome keeps the pending record's expiry.
    let u = key("expiring-unknown");
    let t = own(&*store, &u).await;
    (store.mark_unknown(&u, t, UnknownReason::Timeout).await).unwrap();
    within(store.expires_ms(&u).await.unwrap());
}

/// The span a completed record came from (`[telemetry]`) is kept with it, for the replays' links.
async fn a_completed_records_trace_link_is_kept(store: Arc<dyn Store>) {
    let k = key("linked");
    let t = own(&*store, &k).await;
    let link = TraceLink {
        trace_id: [0x4b; 16],
        span_id: [0x07; 8],
    };
    let linked = StoredResponse {
        link: Some(link),
        ..response()
    };
    store.complete(&k, t, linked.clone(), TTL).await.unwrap();
    let Some(Record {
        state: RecordState::Completed(r),
        ..
    }) = store.get(&k).await.unwrap()
    else {
        panic!("expected the completed record");
    };
    assert_eq!(*r, linked, "the link, and the headers without it");
}

/// Every check, as (name, function).
macro_rules! all_checks {
    ($m:ident) => {
        $m!(
            exactly_one_of_many_concurrent_reservations_owns_a_key,
            a_completed_record_is_returned_exactly,
            a_completed_records_trace_link_is_kept,
            a_records_expiry_is_told,
            only_the_owner_can_complete_release_renew_or_mark_unknown,
            release_lets_the_next_reservation_own_the_key,
            unknown_outcomes_are_kept,
            renew_extends_the_lease,
            waiters_are_woken_by_completion,
            waiters_are_woken_by_release,
            waiters_are_woken_after_a_renewal,
            waiters_are_woken_by_an_operator_delete,
            take_over_accepts_a_record_a_waiter_reads,
            operators_can_delete_any_record,
            take_over_is_compare_and_set,
            a_completed_record_can_be_taken_over,
            a_take_over_dropped_mid_flight_never_frees_the_key,
            a_lease_that_runs_out_reads_as_abandoned,
            worker_handles_share_one_store,
            keys_are_independent,
            unknown_outcomes_are_listed_with_their_origin,
        );
    };
}

/// The keys the sealed runs use: a rotated file, the first key sealing.
fn sealer() -> Option<Arc<idemgate::store::seal::Sealer>> {
    let keys = "new:HxwdHhsaGRgXFhUUExIREA8ODQwLCgkIBwYFBAMCAQA=\nold:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
    Some(Arc::new(
        idemgate::store::seal::Sealer::parse(keys).unwrap(),
    ))
}

/// The embedded store: one test per check.
mod memory {
    use super::*;
    macro_rules! each {
        ($($name:ident),* $(,)?) => {$(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                super::$name(Arc::new(MemoryStore::new(10_000, 64 << 20))).await;
            }
        )*};
    }
    all_checks!(each);

    /// Sealing completed records' answers (`store.encryption_keys_*`).
    mod sealed {
        use super::*;
        macro_rules! each {
            ($($name:ident),* $(,)?) => {$(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let store = MemoryStore::sealed(10_000, 64 << 20, super::super::sealer());
                    super::super::$name(Arc::new(store)).await;
                }
            )*};
        }
        all_checks!(each);
    }
}

/// The disk store, syncing every result, and in batches: one fresh directory per check.
mod disk {
    use super::*;
    use crate::support::TempDir;
    use idemgate::config::{DiskSettings, SyncMode};
    use idemgate::store::disk::DiskStore;

    pub fn open(dir: &TempDir, sync: SyncMode) -> Arc<dyn Store> {
        open_sealed(dir, sync, None)
    }

    pub fn open_sealed(
        dir: &TempDir,
        sync: SyncMode,
        sealer: Option<Arc<idemgate::store::seal::Sealer>>,
    ) -> Arc<dyn Store> {
        let settings = DiskSettings {
            path: dir.path.clone(),
            sync,
            max_disk: 64 << 20,
        };
        Arc::new(DiskStore::open(&settings, sealer).unwrap())
    }

    /// Sealing every record's answer and origin, syncing every result.
    mod sealed {
        use super::*;
        macro_rules! each {
            ($($name:ident),* $(,)?) => {$(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let dir = TempDir::new("contract-disk-sealed");
                    let store = open_sealed(&dir, SyncMode::Always, super::super::sealer());
                    super::super::$name(store).await;
                }
            )*};
        }
        all_checks!(each);
    }

    mod always {
        use super::*;
        macro_rules! each {
            ($($name:ident),* $(,)?) => {$(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let dir = TempDir::new("contract-disk");
                    super::super::$name(open(&dir, SyncMode::Always)).await;
                }
            )*};
        }
        all_checks!(each);
    }

    mod batch {
        use super::*;
        macro_rules! each {
            ($($name:ident),* $(,)?) => {$(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let dir = TempDir::new("contract-disk");
                    let sync = SyncMode::Batch { interval: Duration::from_millis(50) };
                    super::super::$name(open(&dir, sync)).await;
                }
            )*};
        }
        all_checks!(each);
    }
}

async fn redis_store(settings: RedisSettings) -> Arc<dyn Store> {
    sealed_redis_store(settings, None).await
}

async fn sealed_redis_store(
    settings: RedisSettings,
    sealer: Option<Arc<idemgate::store::seal::Sealer>>,
) -> Arc<dyn Store> {
    let store = Arc::new(RedisStore::new(&settings, sealer).unwrap());
    // The connections are made in the background: wait until the store answers and its
    // subscriber listens. A subscriber that starts listening wakes every waiter, which would let
    // the waiter checks pass without any message from the scripts.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while store.ping().await.is_err() || !store.is_subscribed() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the Redis store never became ready"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    store
}

fn settings(target: RedisTarget) -> RedisSettings {
    RedisSettings {
        target,
        key_prefix: "contract:".into(),
        command_timeout: Duration::from_secs(2),
        max_clock_skew: Duration::ZERO,
        tls_ca_file: None,
        require_noeviction: false,
        tls_client: None,
        replicas: None,
    }
}

/// One real redis-server per check.
mod redis_single {
    use super::*;
    macro_rules! each {
        ($($name:ident),* $(,)?) => {$(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let server = RedisServer::start();
                let store = redis_store(settings(RedisTarget::Single(server.url()))).await;
                super::$name(store).await;
                drop(server);
            }
        )*};
    }
    all_checks!(each);
}

/// One real redis-server per check, every record's answer and origin sealed.
mod redis_sealed {
    use super::*;
    macro_rules! each {
        ($($name:ident),* $(,)?) => {$(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let server = RedisServer::start();
                let target = RedisTarget::Single(server.url());
                let store = sealed_redis_store(settings(target), super::sealer()).await;
                super::$name(store).await;
                drop(server);
            }
        )*};
    }
    all_checks!(each);
}

/// A primary with a replica, every write acknowledged by it (`store.min_replicas = 1`): the
/// contract holds through the pipelines that wait for the replica.
mod redis_replicated {
    use super::*;
    use crate::support::redis::replica_of;
    use idemgate::config::ReplicaAcks;
    macro_rules! each {
        ($($name:ident),* $(,)?) => {$(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let primary = RedisServer::start();
                let replica = replica_of(primary.port).await;
                // Generous: the contract is not about timing, and the whole suite loads the cores.
                let replicas = Some(ReplicaAcks { min: 1, timeout: Duration::from_secs(5) });
                let target = RedisTarget::Single(primary.url());
                let store = redis_store(RedisSettings { replicas, ..settings(target) }).await;
                super::$name(store).await;
                drop((primary, replica));
            }
        )*};
    }
    all_checks!(each);
}

/// The waiter's flag as Redis holds it: one byte after the 66-byte pending record, set only by a
/// waiter, kept by renewals and take-overs, and gone with the pending state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_waiter_flags_the_pending_record_itself() {
    let server = RedisServer::start();
    let store = redis_store(settings(RedisTarget::Single(server.url()))).await;
    let k = key("flag-bytes");
    let redis_key = format!("contract:{{{}}}", k.hex());
    let len = || server.cli(&["STRLEN", &redis_key]).trim().to_string();
    let t = own(&*store, &k).await;
    assert_eq!(len(), "66", "nobody waits: the record only");
    store.get(&k).await.unwrap();
    assert_eq!(len(), "66", "a plain read does not flag");
    store.watch(&k).await.unwrap();
    assert_eq!(len(), "67", "a waiter flags it");
    store.watch(&k).await.unwrap();
    assert_eq!(len(), "67", "once");
    store.renew(&k, t, LEASE).await.unwrap();
    assert_eq!(len(), "67", "a renewal keeps the flag");
    let seen = store.get(&k).await.unwrap().unwrap();
    let t2 = store
        .take_over(&k, &seen, &FP.into(), LEASE, TTL)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(len(), "67", "so does a take-over");
    store.complete(&k, t2, response(), TTL).await.unwrap();
    assert_eq!(
        server
            .cli(&["GETRANGE", &redis_key, "1", "1"])
            .trim_end()
            .as_bytes(),
        b"\x02",
        "completed"
    );
    assert_eq!(
        server.cli(&["EXISTS", &format!("{redis_key}:w")]).trim(),
        "0",
        "no side key"
    );
}

/// `rediss://` with a private CA: the whole contract over TLS, and no connection without the CA.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_over_tls_passes_every_check() {
    let server = RedisServer::start_tls();
    let mut tls = settings(RedisTarget::Single(server.url()));
    tls.tls_ca_file = server.tls_ca.clone();
    let store = redis_store(tls).await;
    macro_rules! each {
        ($($name:ident),* $(,)?) => {$(
            $name(Arc::clone(&store)).await;
        )*};
    }
    all_checks!(each);

    // Without the CA the server's certificate is not trusted: the store never becomes usable.
    let untrusted = RedisStore::new(&settings(RedisTarget::Single(server.url())), None).unwrap();
    for _ in 0..3 {
        assert!(
            untrusted.ping().await.is_err(),
            "connected without trusting the server"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A Redis that verifies its clients' certificates (mTLS): the store with the client
/// certificate works; without it, it never connects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_with_client_certificates() {
    let server = RedisServer::start_mtls();
    let mut with_cert = settings(RedisTarget::Single(server.url()));
    with_cert.tls_ca_file = server.tls_ca.clone();
    with_cert.tls_client = server.tls_client.clone();
    let store = redis_store(with_cert).await;
    exactly_one_of_many_concurrent_reservations_owns_a_key(Arc::clone(&store)).await;
    a_completed_record_is_returned_exactly(Arc::clone(&store)).await;

    let mut without = settings(RedisTarget::Single(server.url()));
    without.tls_ca_file = server.tls_ca.clone();
    let refused = RedisStore::new(&without, None).unwrap();
    for _ in 0..3 {
        assert!(
            refused.ping().await.is_err(),
            "connected without a client certificate"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A 3-master Redis Cluster formed by the test; every check runs against it in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_passes_every_check() {
    let cluster = RedisCluster::start();
    let store = redis_store(settings(RedisTarget::Cluster(cluster.urls()))).await;
    macro_rules! each {
        ($($name:ident),* $(,)?) => {$(
            $name(Arc::clone(&store)).await;
        )*};
    }
    all_checks!(each);
    // The keys really were spread over the masters (so slots, not luck, kept them atomic).
    let mut masters_with_keys = 0;
    for port in &cluster.ports {
        let n: usize = crate::support::redis::cli(*port, &["dbsize"])
            .trim()
            .parse()
            .unwrap_or(0);
        if n > 0 {
            masters_with_keys += 1;
        }
    }
    assert!(
        masters_with_keys >= 2,
        "keys landed on {masters_with_keys} master(s) only"
    );
}

/// The Postgres store: one real server per check, started from a template data directory.
mod postgres {
    use super::*;
    use crate::support::postgres::Postgres;
    use idemgate::config::PostgresSettings;
    use idemgate::store::postgres::PostgresStore;

    pub fn settings(server: &Postgres) -> PostgresSettings {
        PostgresSettings {
            url: server.url(),
            table: "idemgate_records".into(),
            pool_size: 8,
            workers: 2,
            command_timeout: Duration::from_secs(2),
            max_clock_skew: Duration::ZERO,
            tls_ca_file: None,
            tls_client: None,
            allow_async_commit: false,
        }
    }

    /// The store once it answers and listens: a listener that starts wakes every waiter, which
    /// would let the waiter checks pass without a notification.
    pub async fn ready(settings: &PostgresSettings) -> Arc<PostgresStore> {
        ready_sealed(settings, None).await
    }

    pub async fn ready_sealed(
        settings: &PostgresSettings,
        sealer: Option<Arc<idemgate::store::seal::Sealer>>,
    ) -> Arc<PostgresStore> {
        let store = Arc::new(PostgresStore::new(settings, sealer).unwrap());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while store.ping().await.is_err() || !store.is_listening() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the Postgres store never became ready: {:?}",
                store.ping().await
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        store
    }

    macro_rules! each {
        ($($name:ident),* $(,)?) => {$(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let server = Postgres::start();
                let store = ready(&settings(&server)).await;
                super::$name(store).await;
                drop(server);
            }
        )*};
    }
    all_checks!(each);

    /// Every record's answer and origin sealed.
    mod sealed {
        use super::*;
        macro_rules! each {
            ($($name:ident),* $(,)?) => {$(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let server = Postgres::start();
                    let store = ready_sealed(&settings(&server), super::super::sealer()).await;
                    super::super::$name(store).await;
                    drop(server);
                }
            )*};
        }
        all_checks!(each);
    }
}
