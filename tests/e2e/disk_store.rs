//! The disk store's own promises, beyond the contract: records outlive the process, one process
//! per directory, expiry gives the space back, the `max_disk` bound, shared fsyncs, and a
//! corrupt record is never read as "no record".

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::StatusCode;
use idemgate::config::{DiskSettings, SyncMode};
use idemgate::fingerprint::Fingerprint;
use idemgate::key::{ClientScope, StoreKey};
use idemgate::store::disk::DiskStore;
use idemgate::store::{
    Bound, OwnerToken, RecordState, Reservation, Store, StoreError, StoredResponse, UnknownReason,
};

use crate::support::{eventually, eventually_within, TempDir};

const FP: Fingerprint = Fingerprint([3; 32]);
const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(3600);

fn key(name: &str) -> StoreKey {
    StoreKey::new(&ClientScope::from_value(b"disk"), "route", name)
}

fn settings(dir: &TempDir, sync: SyncMode, max_disk: u64) -> DiskSettings {
    DiskSettings {
        path: dir.path.join("store"),
        sync,
        max_disk,
    }
}

fn open(dir: &TempDir) -> DiskStore {
    DiskStore::open(&settings(dir, SyncMode::Always, 64 << 20), None).unwrap()
}

fn response(body: &'static str) -> StoredResponse {
    StoredResponse {
        trailers: vec![],
        status: StatusCode::CREATED,
        headers: vec![(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        )],
        body: Bytes::from_static(body.as_bytes()),
        body_kept: true,
        completed_ms: 1_700_000_000_000,
        link: None,
    }
}

async fn own(store: &DiskStore, k: &StoreKey, lease: Duration, ttl: Duration) -> OwnerToken {
    match store.reserve(k, &FP.into(), lease, ttl).await.unwrap() {
        Reservation::Owner(t) => t,
        other => panic!("expected ownership, got {other:?}"),
    }
}

fn dir_size(path: &std::path::Path) -> u64 {
    std::fs::read_dir(path)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let m = e.metadata().unwrap();
            if m.is_dir() {
                dir_size(&e.path())
            } else {
                m.len()
            }
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_state_survives_closing_and_reopening() {
    let dir = TempDir::new("disk-reopen");
    {
        let store = open(&dir);
        let t = own(&store, &key("done"), LEASE, TTL).await;
        store
            .complete(&key("done"), t, response("{\"id\":1}"), TTL)
            .await
            .unwrap();
        let t = own(&store, &key("unknown"), LEASE, TTL).await;
        store
            .mark_unknown(&key("unknown"), t, UnknownReason::Timeout)
            .await
            .unwrap();
        own(&store, &key("in-flight"), Duration::from_millis(1), TTL).await;
        let t = own(&store, &key("released"), LEASE, TTL).await;
        store.release(&key("released"), t).await.unwrap();
    }
    // Dropping the last handle releases the file: the same process may open it again.
    let store = open(&dir);
    match store.get(&key("done")).await.unwrap().unwrap().state {
        RecordState::Completed(r) => assert_eq!(*r, response("{\"id\":1}")),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        store.get(&key("unknown")).await.unwrap().unwrap().state,
        RecordState::Unknown {
            reason: UnknownReason::Timeout,
            ..
        }
    ));
    // Its owner is gone and its lease ran out: never read as absent, never run again.
    assert!(matches!(
        store.get(&key("in-flight")).await.unwrap().unwrap().state,
        RecordState::Abandoned { .. }
    ));
    assert_eq!(store.get(&key("released")).await.unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_store_on_the_same_directory_is_refused_with_the_reason() {
    let dir = TempDir::new("disk-lock");
    let _first = open(&dir);
    let err = match DiskStore::open(&settings(&dir, SyncMode::Always, 64 << 20), None) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a second open of the same directory must fail"),
    };
    assert!(err.contains("another process has it open"), "{err}");
    assert!(err.contains("redis"), "says what to do instead: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_that_cannot_be_made_is_refused_with_what_to_do() {
    let dir = TempDir::new("disk-bad-dir");
    let file = dir.path.join("a-file");
    std::fs::write(&file, b"not a directory").unwrap();
    let settings = DiskSettings {
        path: file.join("store"),
        sync: SyncMode::Always,
        max_disk: 64 << 20,
    };
    let err = match DiskStore::open(&settings, None) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a path under a file cannot be a store"),
    };
    assert!(err.contains("cannot create the directory"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_records_are_purged_and_no_longer_counted() {
    let dir = TempDir::new("disk-expiry");
    let store = open(&dir);
    // Long enough that a reservation is still alive when it completes on a loaded machine (each
    // completion waits for an fsync shared with every other test), short enough to expire soon.
    // (Reserved with the same ttl: a record is filed for purging at its reservation's expiry.)
    let ttl = Duration::from_secs(2);
    let body = "x".repeat(2000);
    let body: &'static str = Box::leak(body.into_boxed_str());
    let mut sizes = Vec::new();
    for round in 0..4 {
        for i in 0..300 {
            let k = key(&format!("r{round}-{i}"));
            let t = own(&store, &k, LEASE, ttl).await;
            store.complete(&k, t, response(body), ttl).await.unwrap();
        }
        let purged = 300 * (round + 1);
        assert!(
            eventually(|| async { store.stats().purged >= purged }).await,
            "round {round}: {} of {purged} purged",
            store.stats().purged
        );
        assert!(
            store.used() < 300 * 1000,
            "{} bytes still counted",
            store.used()
        );
        sizes.push(dir_size(&dir.path));
    }
    // A steady stream of short-lived keys: the directory stays within fjall's journal (64 MiB,
    // allocated up front) and its tables. Giving expired bytes back to the file system is fjall's
    // compaction, later: this checks the bound, not the shrinking.
    eprintln!("disk store directory after each round: {sizes:?}");
    assert!(
        sizes.iter().all(|s| *s < (64 << 20) + (16 << 20)),
        "the directory outgrew its journal and tables: {sizes:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_max_disk_new_keys_are_refused_live_ones_kept_and_room_comes_back() {
    let dir = TempDir::new("disk-bound");
    let store = DiskStore::open(&settings(&dir, SyncMode::Always, 64 << 10), None).unwrap();
    // Long enough for most keys to be reserved and checked before they expire, even when every
    // fsync is slow; a key whose time ran out before its check is not checked.
    let ttl = Duration::from_secs(10);
    let mut owned = Vec::new();
    let refused = loop {
        let k = key(&format!("k{}", owned.len()));
        let expires = Instant::now() + ttl;
        match store.reserve(&k, &FP.into(), LEASE, ttl).await {
            Ok(Reservation::Owner(t)) => {
                store
                    .complete(&k, t, response("{\"ok\":true}"), ttl)
                    .await
                    .unwrap();
                owned.push((k, expires));
            }
            Err(e) => break e,
            Ok(other) => panic!("{other:?}"),
        }
        assert!(owned.len() < 10_000, "the bound never came");
    };
    assert_eq!(refused, StoreError::Full(Bound::MaxDisk));
    assert!(owned.len() > 50, "only {} keys fit", owned.len());
    let mut checked = 0;
    for (k, expires) in &owned {
        let found = store.reserve(k, &FP.into(), LEASE, ttl).await.unwrap();
        if Instant::now() < *expires {
            assert!(
                matches!(found, Reservation::Existing(_)),
                "a live key was evicted"
            );
            checked += 1;
        }
    }
    assert!(
        checked * 2 > owned.len(),
        "only {checked} keys checked in time"
    );
    // Once they expire and are purged, new keys get in again without a restart.
    assert!(
        eventually_within(Duration::from_secs(60), || async {
            matches!(
                store.reserve(&key("later"), &FP.into(), LEASE, TTL).await,
                Ok(Reservation::Owner(_))
            )
        })
        .await,
        "the store never made room again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_share_their_fsyncs() {
    let dir = TempDir::new("disk-group");
    let store = Arc::new(open(&dir));
    let before = store.stats().syncs;
    let requests = 400;
    let mut tasks = Vec::new();
    for i in 0..requests {
        let store = Arc::clone(&store);
        tasks.push(tokio::spawn(async move {
            let k = key(&format!("g{i}"));
            let t = own(&store, &k, LEASE, TTL).await;
            store.complete(&k, t, response("{}"), TTL).await.unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let syncs = store.stats().syncs - before;
    let per_request = syncs as f64 / requests as f64;
    eprintln!("disk store: {syncs} fsyncs for {requests} concurrent new keys ({per_request:.2} per request)");
    // Two synced writes per request (reserve, complete) without group commit.
    assert!(per_request < 1.0, "{per_request:.2} fsyncs per request");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_sync_batch_results_share_a_deferred_fsync_and_still_survive_a_reopen() {
    let dir = TempDir::new("disk-batch");
    let count = |sync: SyncMode| {
        let dir = TempDir::new("disk-batch-count");
        async move {
            let store = DiskStore::open(&settings(&dir, sync, 64 << 20), None).unwrap();
            for i in 0..40 {
                let k = key(&format!("b{i}"));
                let t = own(&store, &k, LEASE, TTL).await;
                store.complete(&k, t, response("{}"), TTL).await.unwrap();
            }
            store.stats().syncs
        }
    };
    let always = count(SyncMode::Always).await;
    let batch = count(SyncMode::Batch {
        interval: Duration::from_secs(5),
    })
    .await;
    assert!(
        always >= 80,
        "one-by-one requests sync every write: {always}"
    );
    assert!(batch < always * 3 / 4, "batch {batch} vs always {always}");

    // Results not yet synced are synced when the store closes.
    {
        let store = DiskStore::open(
            &settings(
                &dir,
                SyncMode::Batch {
                    interval: Duration::from_secs(5),
                },
                64 << 20,
            ),
            None,
        )
        .unwrap();
        let t = own(&store, &key("late"), LEASE, TTL).await;
        store
            .complete(&key("late"), t, response("{\"late\":1}"), TTL)
            .await
            .unwrap();
    }
    let store = DiskStore::open(&settings(&dir, SyncMode::Always, 64 << 20), None).unwrap();
    assert!(matches!(
        store.get(&key("late")).await.unwrap().unwrap().state,
        RecordState::Completed(_)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_record_is_an_error_never_an_absent_key() {
    let dir = TempDir::new("disk-corrupt");
    {
        let store = open(&dir);
        let t = own(&store, &key("c"), LEASE, TTL).await;
        store
            .complete(&key("c"), t, response("{}"), TTL)
            .await
            .unwrap();
    }
    {
        // Damage the record in place: a valid expiry, then bytes no codec version reads.
        let db = fjall::Database::builder(dir.path.join("store"))
            .open()
            .unwrap();
        let records = db
            .keyspace("records", fjall::KeyspaceCreateOptions::default)
            .unwrap();
        let mut value = u64::MAX.to_be_bytes().to_vec();
        value.extend_from_slice(&[0xee; 20]);
        records.insert(key("c").as_bytes().to_vec(), value).unwrap();
        db.persist(fjall::PersistMode::SyncAll).unwrap();
    }
    let store = open(&dir);
    assert!(matches!(
        store.get(&key("c")).await,
        Err(StoreError::Corrupt(_))
    ));
    assert!(matches!(
        store.reserve(&key("c"), &FP.into(), LEASE, TTL).await,
        Err(StoreError::Corrupt(_))
    ));
}

/// A small tmpfs mounted for one test, unmounted on drop: a disk that really fills up.
struct SmallDisk {
    dir: TempDir,
}

impl SmallDisk {
    fn mount(size: &str) -> SmallDisk {
        let dir = TempDir::new("disk-full");
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&dir.path)
            .status()
            .expect("the disk-full test needs `mount` (util-linux) and root");
        assert!(
            status.success(),
            "the disk-full test mounts a small tmpfs: run the tests as root"
        );
        SmallDisk { dir }
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg(&self.dir.path)
            .status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_fails_closed_keeps_what_it_has_and_says_so() {
    let disk = SmallDisk::mount("2m");
    let store = DiskStore::open(&settings(&disk.dir, SyncMode::Always, 1 << 30), None).unwrap();
    let body: &'static str = Box::leak("y".repeat(64 << 10).into_boxed_str());
    let mut kept = Vec::new();
    let failure = loop {
        let k = key(&format!("f{}", kept.len()));
        let t = match store.reserve(&k, &FP.into(), LEASE, TTL).await {
            Ok(Reservation::Owner(t)) => t,
            Ok(other) => panic!("{other:?}"),
            Err(e) => break e,
        };
        if let Err(e) = store.complete(&k, t, response(body), TTL).await {
            break e;
        }
        kept.push(k);
        assert!(kept.len() < 1000, "a 2 MiB disk never filled up");
    };
    assert!(
        matches!(failure, StoreError::Unavailable(_)),
        "a full disk is the store failing (fail closed), not {failure:?}"
    );
    assert!(
        store.ping().await.is_err(),
        "readiness says the store cannot write"
    );
    // And keeps saying it past the ticker's next (empty) batch: fjall takes no more writes.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(store.ping().await.is_err(), "readiness stays false");
    // What was stored before stays readable: never "no record".
    assert!(!kept.is_empty());
    for k in &kept {
        assert!(matches!(
            store.get(k).await.unwrap().unwrap().state,
            RecordState::Completed(_)
        ));
    }
    // New keys are refused while the disk is full: nothing runs without its record.
    assert!(store
        .reserve(&key("later"), &FP.into(), LEASE, TTL)
        .await
        .is_err());
}

/// A caller that goes away while its reservation is on the way (an HTTP client hanging up)
/// leaves no pending record: nothing was forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_whose_caller_left_is_released() {
    let dir = TempDir::new("disk-dropped");
    let store = open(&dir);
    let mut dropped = None;
    for i in 0..200 {
        let k = key(&format!("d{i}"));
        // Polled once: the reservation is queued, its answer not back yet; then dropped.
        use futures_util::FutureExt;
        let before = store.stats().syncs;
        if store
            .reserve(&k, &FP.into(), LEASE, TTL)
            .now_or_never()
            .is_none()
        {
            dropped = Some((k, before));
            break;
        }
    }
    let (k, before) = dropped.expect("some reservation was still on its way when polled once");
    // The reservation was written (synced: a release of a key never reserved writes nothing)...
    assert!(
        eventually(|| async { store.stats().syncs > before }).await,
        "the dropped reservation reached the disk"
    );
    // ...and then released.
    assert!(
        eventually(|| async { store.get(&k).await.unwrap().is_none() }).await,
        "the dropped reservation was released"
    );
    assert!(matches!(
        store.reserve(&k, &FP.into(), LEASE, TTL).await.unwrap(),
        Reservation::Owner(_)
    ));
}

/// With `sync = "batch"` a result waits for its sync; `flush`, which a clean shutdown calls,
/// syncs it at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_syncs_what_batch_mode_held() {
    let dir = TempDir::new("disk-flush");
    let store = DiskStore::open(
        &settings(
            &dir,
            SyncMode::Batch {
                interval: Duration::from_secs(10),
            },
            64 << 20,
        ),
        None,
    )
    .unwrap();
    let t = own(&store, &key("f"), LEASE, TTL).await;
    let before = store.stats().syncs;
    store
        .complete(&key("f"), t, response("{}"), TTL)
        .await
        .unwrap();
    assert_eq!(store.stats().syncs, before, "batch mode: not synced yet");
    store.flush().await.unwrap();
    assert_eq!(store.stats().syncs, before + 1, "flush synced it");
}
