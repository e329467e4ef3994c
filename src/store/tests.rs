use super::*;

fn pending_until(lease_until_ms: u64) -> Record {
    Record {
        fingerprint: Fingerprint([1; 32]),
        created_ms: 1,
        state: RecordState::Pending {
            owner: OwnerToken(9),
            lease_until_ms,
        },
        origin: None,
        sealing: seal::Sealing::New,
    }
}

#[test]
fn a_lease_of_another_clock_runs_out_max_clock_skew_later() {
    let skew = Duration::from_millis(500);
    let live = pending_until(1_000).checked_lease_skewed_at(1_500, skew);
    assert!(matches!(live.state, RecordState::Pending { .. }));
    let gone = pending_until(1_000).checked_lease_skewed_at(1_501, skew);
    assert!(matches!(gone.state, RecordState::Abandoned { .. }));
    // A skew past the epoch reads nothing as abandoned rather than wrapping.
    let huge = pending_until(1_000).checked_lease_skewed_at(1_501, Duration::MAX);
    assert!(matches!(huge.state, RecordState::Pending { .. }));
}

#[test]
fn a_lease_that_ran_out_reads_as_abandoned() {
    let live = pending_until(1_000).checked_lease_at(1_000);
    assert!(matches!(live.state, RecordState::Pending { .. }));
    let gone = pending_until(1_000).checked_lease_at(1_001);
    assert_eq!(
        gone.state,
        RecordState::Abandoned {
            owner: OwnerToken(9),
            lease_until_ms: 1_000
        }
    );
    // Other states are not touched.
    let unknown = Record {
        state: RecordState::Unknown {
            since_ms: 5,
            reason: UnknownReason::Timeout,
        },
        ..pending_until(0)
    };
    assert_eq!(unknown.clone().checked_lease_at(u64::MAX), unknown);
    assert!(matches!(
        pending_until(u64::MAX).checked_lease().state,
        RecordState::Pending { .. }
    ));
    assert!(matches!(
        pending_until(1).checked_lease().state,
        RecordState::Abandoned { .. }
    ));
}
