//! The core's pure decisions: what a record means, which statuses release a key.
use super::*;
use crate::store::OwnerToken;

const FP: Fingerprint = Fingerprint([1; 32]);
const OTHER: Fingerprint = Fingerprint([2; 32]);

/// The built-in policy's rules.
fn rules() -> Rules {
    Rules {
        check_fingerprint: true,
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(24 * 3600),
        wait: Duration::from_secs(10),
        max_waiters: 64,
        quota: None,
        share: Share::Unshared,
        store_server_errors: false,
        unknown_statuses: ServerStatuses::DEFAULT_UNKNOWN,
        on_store_error: OnStoreError::Reject,
        on_unknown: OnUnknown::Reject,
    }
}

fn no_earlier() -> Option<Fingerprint> {
    None
}

/// A request without an earlier fingerprint.
fn only(fingerprint: Fingerprint) -> Sought<'static> {
    Sought::new(fingerprint, &no_earlier)
}

fn retrying() -> Rules {
    Rules {
        on_unknown: OnUnknown::Retry,
        ..rules()
    }
}

fn record(state: RecordState) -> Record {
    Record {
        fingerprint: FP,
        created_ms: 1,
        state,
        origin: None,
        sealing: Default::default(),
    }
}

fn completed() -> Record {
    answered(http::StatusCode::CREATED)
}

fn answered(status: http::StatusCode) -> Record {
    record(RecordState::Completed(Arc::new(StoredResponse {
        trailers: vec![],
        status,
        headers: vec![],
        body: bytes::Bytes::from_static(b"{}"),
        body_kept: true,
        completed_ms: 2,
        link: None,
    })))
}

fn pending() -> Record {
    record(RecordState::Pending {
        owner: OwnerToken(1),
        lease_until_ms: u64::MAX,
    })
}

fn abandoned() -> Record {
    record(RecordState::Abandoned {
        owner: OwnerToken(1),
        lease_until_ms: 5,
    })
}

fn unknown() -> Record {
    record(RecordState::Unknown {
        since_ms: 3,
        reason: UnknownReason::Timeout,
    })
}

#[test]
fn a_completed_record_is_replayed() {
    let Ok(Some(Resolved::Replay(r))) = decide(rules(), &only(FP), &completed()) else {
        panic!("expected a replay");
    };
    assert_eq!(r.status, http::StatusCode::CREATED);
}

#[test]
fn another_fingerprint_is_refused_before_anything_else_unless_unchecked() {
    for r in [completed(), pending(), abandoned(), unknown()] {
        assert_eq!(decide(rules(), &only(OTHER), &r), Err(Refusal::KeyReused));
    }
    let unchecked = Rules {
        check_fingerprint: false,
        ..rules()
    };
    assert!(matches!(
        decide(unchecked, &only(OTHER), &completed()),
        Ok(Some(Resolved::Replay(_)))
    ));
}

#[test]
fn a_stored_refusal_is_replayed_only_to_its_own_request_where_fingerprints_are_unchecked() {
    let unchecked = Rules {
        check_fingerprint: false,
        ..rules()
    };
    for status in [400, 404, 409, 422] {
        let refused = answered(http::StatusCode::from_u16(status).unwrap());
        assert_eq!(
            decide(unchecked, &only(OTHER), &refused),
            Ok(Some(Resolved::TakeOver(refused.clone()))),
            "{status}"
        );
        assert!(matches!(
            decide(unchecked, &only(FP), &refused),
            Ok(Some(Resolved::Replay(_)))
        ));
        // Where fingerprints are checked, another request is refused as ever.
        assert_eq!(
            decide(rules(), &only(OTHER), &refused),
            Err(Refusal::KeyReused)
        );
    }
    // A stored 5xx (store_server_errors) may follow a commit: never run again.
    let failed = answered(http::StatusCode::INTERNAL_SERVER_ERROR);
    assert!(matches!(
        decide(unchecked, &only(OTHER), &failed),
        Ok(Some(Resolved::Replay(_)))
    ));
}

#[test]
fn a_pending_record_is_waited_on() {
    assert_eq!(decide(rules(), &only(FP), &pending()), Ok(None));
    assert_eq!(decide(retrying(), &only(FP), &pending()), Ok(None));
}

#[test]
fn unknown_and_abandoned_are_never_run_again_by_default() {
    assert_eq!(
        decide(rules(), &only(FP), &unknown()),
        Err(Refusal::OutcomeUnknown(UnknownReason::Timeout))
    );
    assert_eq!(
        decide(rules(), &only(FP), &abandoned()),
        Err(Refusal::OutcomeUnknown(UnknownReason::Abandoned))
    );
}

#[test]
fn unknown_and_abandoned_are_taken_over_when_the_route_allows_it() {
    for r in [unknown(), abandoned()] {
        assert_eq!(
            decide(retrying(), &only(FP), &r),
            Ok(Some(Resolved::TakeOver(r.clone())))
        );
    }
}

#[test]
fn statuses_that_release_the_key() {
    assert!(not_executed(500, false));
    assert!(!not_executed(500, true));
    assert!(not_executed(503, false));
    assert!(not_executed(429, true));
    assert!(not_executed(408, true));
    assert!(not_executed(425, true));
    assert!(
        not_executed(415, true),
        "the body's format refused before it was read"
    );
    assert!(!not_executed(201, false));
    assert!(!not_executed(400, false));
    assert!(not_executed(401, false));
    assert!(not_executed(403, true));
    assert!(!not_executed(402, false));
    assert!(!not_executed(404, false));
    assert!(!not_executed(409, false));
    assert!(!not_executed(499, false));
    assert!(!not_executed(600, false));
}

#[test]
fn the_earlier_fingerprint_finds_a_record_of_the_previous_version() {
    let earlier = || Some(FP);
    assert!(matches!(
        decide(rules(), &Sought::new(OTHER, &earlier), &completed()),
        Ok(Some(Resolved::Replay(_)))
    ));
    let another = || Some(Fingerprint([3; 32]));
    assert_eq!(
        decide(rules(), &Sought::new(OTHER, &another), &completed()),
        Err(Refusal::KeyReused)
    );
}
