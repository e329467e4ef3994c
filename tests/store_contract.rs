//! The store contract (see `src/store/mod.rs`), run against every backend.
//!
//! Each check is a plain async function over `&dyn Store`, so a new backend gets the whole suite
//! by adding one `contract_tests!` line.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};
use idemgate::fingerprint::Fingerprint;
use idemgate::key::{ClientScope, StoreKey};
use idemgate::store::memory::MemoryStore;
use idemgate::store::{
    OwnerToken, Record, RecordState, Reservation, Store, StoreError, StoredResponse, UnknownReason,
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
    }
}

async fn own(store: &dyn Store, k: &StoreKey) -> OwnerToken {
    match store.reserve(k, FP, LEASE, TTL).await.unwrap() {
        Reservation::Owner(t) => t,
        other => panic!("expected ownership, got {other:?}"),
    }
}

async fn exactly_one_of_many_concurrent_reservations_owns_a_key(store: Arc<dyn Store>) {
    let k = key("race");
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let (store, k) = (Arc::clone(&store), k.clone());
        tasks.push(tokio::spawn(async move {
            store.reserve(&k, FP, LEASE, TTL).await.unwrap()
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
    }) = store.reserve(&k, FP, LEASE, TTL).await.unwrap()
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
    let Reservation::Existing(r) = store.reserve(&k, FP, LEASE, TTL).await.unwrap() else {
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

async fn waiters_are_woken_by_completion(store: Arc<dyn Store>) {
    let k = key("wake");
    let t = own(&*store, &k).await;
    let mut sub = store.subscribe(&k);
    let (s2, k2) = (Arc::clone(&store), k.clone());
    let completer =
        tokio::spawn(async move { s2.complete(&k2, t, response(), TTL).await.unwrap() });
    tokio::time::timeout(Duration::from_secs(5), sub.changed())
        .await
        .expect("a completion must wake the subscriber");
    completer.await.unwrap();
    assert!(matches!(
        store.get(&k).await.unwrap().unwrap().state,
        RecordState::Completed(_)
    ));
}

async fn waiters_are_woken_by_release(store: Arc<dyn Store>) {
    let k = key("wake-release");
    let t = own(&*store, &k).await;
    let mut sub = store.subscribe(&k);
    store.release(&k, t).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), sub.changed())
        .await
        .expect("a release must wake the subscriber");
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

macro_rules! contract_tests {
    ($backend:ident, $make:expr) => {
        mod $backend {
            use super::*;
            contract_tests!(@each $make;
                exactly_one_of_many_concurrent_reservations_owns_a_key,
                a_completed_record_is_returned_exactly,
                only_the_owner_can_complete_release_renew_or_mark_unknown,
                release_lets_the_next_reservation_own_the_key,
                unknown_outcomes_are_kept,
                renew_extends_the_lease,
                waiters_are_woken_by_completion,
                waiters_are_woken_by_release,
                operators_can_delete_any_record,
                keys_are_independent,
            );
        }
    };
    (@each $make:expr; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let store: Arc<dyn Store> = $make;
                super::$name(store).await;
            }
        )*
    };
}

contract_tests!(memory, Arc::new(MemoryStore::new(10_000, 64 << 20)));
