//! The release gate as tests: a run of 100,000 fault-injected traces finds zero violations
//! in every class (G1), every late valid ACK converges (G2), unknowns resolve within 15
//! minutes at p99 (G3); and every mutant is caught in the class it breaks within 100,000
//! traces (G4). The same numbers at 1,000,000 traces come from `sealpost simulate`.

use sealpost_sim::{run, Mutant, Protocol, RunOptions, TraceStats, Violation};

fn simulate(traces: u64, seed: u64, mutant: Option<Mutant>) -> TraceStats {
    run(
        RunOptions {
            traces,
            seed,
            threads: 0,
            proto: Protocol { mutant },
            stop_at_first_failure: false,
        },
        &|_| {},
    )
    .stats
}

#[test]
fn gate_100k_traces_zero_violations() {
    let s = simulate(100_000, 7, None);
    assert_eq!(s.traces, 100_000);
    for class in Violation::ALL {
        assert_eq!(s.violations.get(class), 0, "{} must be zero", class.key());
    }
    assert!(s.late_acks > 0, "the run must exercise late ACKs");
    assert!(
        s.leased_sends > 0 && s.leases_dropped > 0,
        "the claims must record first sends in batch leases, and drop them"
    );
    assert_eq!(
        s.late_acks_converged, s.late_acks,
        "G2: every late valid ACK converges"
    );
    assert_eq!(
        s.unknown.unresolved, 0,
        "every UNKNOWN resolves once faults stop"
    );
    assert!(
        s.unknown.resolved() > 0,
        "the run must produce UNKNOWN outcomes"
    );
    assert!(
        s.unknown.quantile_s(0.99) <= 900.0,
        "G3: p99 {}",
        s.unknown.quantile_s(0.99)
    );
    assert!(
        s.never_sent > 0,
        "the run must exercise sends that never leave (deadline, outage, deleted stream)"
    );
    assert!(
        s.verified > 0,
        "the verification pass must re-check published rows at the broker"
    );
    assert!(
        s.deliveries_unsealed > 0 && s.copies_unsealed > 0,
        "consumers and lookups must meet forged messages and refuse them"
    );
    assert!(
        s.unsealed_parked > 0,
        "a forgery occupying a create-if-absent subject must park its row for the operator"
    );
    let cdc = &s.cdc;
    assert!(
        cdc.traces > 0
            && cdc.alone > 0
            && cdc.restarts > 0
            && cdc.reconnects > 0
            && cdc.repeats > 0
            && cdc.slot_losses > 0
            && cdc.window_full > 0
            && cdc.stalls > 0
            && cdc.claimed_from_log > 0
            && cdc.sweeps > 0
            && cdc.confirms > 0,
        "the CDC log reader must be exercised: {cdc:?}"
    );
    assert!(
        s.sets > 0 && s.sets_complete > 0,
        "delivery sets must be run to completion: {} sets, {} complete",
        s.sets,
        s.sets_complete
    );
    let r = &s.rollout;
    assert!(
        r.traces > 0
            && r.switches > 0
            && r.refused > 0
            && r.to_stage.iter().all(|&n| n > 0)
            && r.sends.iter().all(|&n| n > 0)
            && r.skipped > 0,
        "the rollout (R25) must move every stage and both implementations must send: {r:?}"
    );
    assert!(
        r.shadow_reads > 0 && r.shadow_compared > 0 && r.shadow_foreign > 0,
        "the shadow (R25) must compare rows, some against a copy that is not the sealed envelope: {r:?}"
    );
    let late = &s.late;
    assert!(
        late.traces > 0
            && late.commits > 0
            && late.behind_scan > 0
            && late.found_by_scan_from_behind > 0
            && late.found_by_full_scan > 0,
        "transactions must commit late, behind a scan, and be found from behind it: {late:?}"
    );
    for f in sealpost_sim::Fault::ALL {
        assert!(
            s.faults.get(f) > 0,
            "fault `{}` was never injected",
            f.label()
        );
    }
}

/// The class each mutant must show up in. `None`: the G2 convergence count.
fn expected_class(m: Mutant) -> Option<Violation> {
    match m {
        Mutant::AcceptWithoutDigestCheck => Some(Violation::DivergentPayloads),
        Mutant::RetryToOtherDestination => Some(Violation::CrossDestinationRetries),
        Mutant::AcceptUnregisteredAttempt => Some(Violation::LostEvents),
        Mutant::DropLateAck => None,
        Mutant::StaleClaimOverwritesPrimary => Some(Violation::LostEvents),
        Mutant::NewEventIdOnRetry => Some(Violation::SecondEventIds),
        Mutant::ConsumerDedupOutsideTx => Some(Violation::DuplicateEffects),
        Mutant::PurgeAtAck => Some(Violation::EarlyPurges),
        Mutant::SendPastDeadline => Some(Violation::SendsPastLease),
        Mutant::UnboundedNeverSent => Some(Violation::Liveness),
        Mutant::NoCreateIfAbsent => Some(Violation::SecondCopies),
        Mutant::RetryOverFoundCopy => Some(Violation::Liveness),
        Mutant::ReconcileWithoutBackoff => Some(Violation::Liveness),
        Mutant::RefusalAsNoAnswer => Some(Violation::Liveness),
        Mutant::HighWaterCursor => Some(Violation::Liveness),
        Mutant::PurgeIgnoresRestorePoint => Some(Violation::EarlyPurges),
        Mutant::OrderingIgnoresEarlierEvent => Some(Violation::Ordering),
        Mutant::RefusalFailsBatch => Some(Violation::Liveness),
        Mutant::AckFailedEffect => Some(Violation::Liveness),
        Mutant::AbsentFromUnfinishedScan => Some(Violation::FalseAbsences),
        Mutant::UnguardedFastPath => Some(Violation::LostEvents),
        Mutant::AdoptUnsignedCopy => Some(Violation::ForgedCopyAdopted),
        Mutant::ConsumerSkipsSignature => Some(Violation::ForgeryApplied),
        Mutant::TrustDuplicateAck => Some(Violation::ForgedCopyAdopted),
        Mutant::PermissionRefusalIsPoison => Some(Violation::Liveness),
        Mutant::CdcConfirmBeforeAccept => Some(Violation::CdcConfirmedUnsettled),
        Mutant::CdcSweepOnlyWhenWindowEmpty => Some(Violation::Liveness),
        Mutant::SetCompletesEarly => Some(Violation::SetCompletedEarly),
        Mutant::ClaimWithoutAliasFence => Some(Violation::SendWithoutAlias),
        Mutant::ShadowComparesOwnReceipt => Some(Violation::ShadowMissedDivergence),
        Mutant::RegisterWithoutCompatibilityCheck => Some(Violation::UnreadableEvents),
        Mutant::EnqueueWithoutContractCheck => Some(Violation::UnreadableEvents),
        Mutant::LeaseDroppedWhenAnswered => Some(Violation::LostAttempts),
    }
}

#[test]
fn every_mutant_is_caught_within_100k_traces() {
    for m in Mutant::ALL {
        assert_eq!(Mutant::parse(m.name()), Some(m));
        let mut caught_after = None;
        let mut acc = TraceStats::default();
        // Chunks of 10,000 traces, stopping at the first chunk that catches it.
        for chunk in 0..10u64 {
            let s = simulate(10_000, 1000 + chunk, Some(m));
            acc.merge(&s);
            let caught = match expected_class(m) {
                Some(class) => acc.violations.get(class) > 0,
                None => acc.late_acks_converged < acc.late_acks,
            };
            if caught {
                caught_after = Some(acc.traces);
                break;
            }
        }
        assert!(
            caught_after.is_some(),
            "mutant {} survived 100,000 traces",
            m.name()
        );
        assert!(
            acc.failed(),
            "a caught mutant must fail the gate: {}",
            m.name()
        );
    }
}

#[test]
fn a_trace_replays_identically() {
    let a = sealpost_sim::replay(sealpost_sim::trace_seed(3, 17), Protocol::default());
    let b = sealpost_sim::replay(sealpost_sim::trace_seed(3, 17), Protocol::default());
    assert_eq!(a.0, b.0);
    assert_eq!(a.1, b.1);
    assert!(!a.1.is_empty(), "the replay log must show the steps");
}
