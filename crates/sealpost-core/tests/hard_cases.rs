//! SPEC §10 "Hard cases and the expected outcome", one test per line that concerns the core,
//! plus the claim/fence rules (R7–R9), send outcomes (R6), reconcile decisions (R13–R14),
//! migration (R15) and purge (R20). Every test builds `EventRow` snapshots and drives them
//! only through the core's public `decide_*` / `apply_*` functions, the way a shell would.

use sealpost_core::claim::{
    apply_begin_send, apply_claim, apply_send_outcome, check_fence, decide_begin_send,
    decide_dispatch_claim, decide_reconcile_claim, decide_release, decide_release_quarantine,
    decide_send_outcome, never_sent_backoff_ms, Fenced, NEVER_SENT_BACKOFF_MS_MAX,
};
use sealpost_core::cleanup::{
    decide_purge, decide_retention, PurgeRefusal, RetentionDecision, RetentionPolicy, Watermark,
};
use sealpost_core::envelope::{NewEvent, PartitionAlgorithm, PAYLOAD_DOMAIN};
use sealpost_core::inbox::{decide_inbox, idempotency_key, InboxDecision, InboxRecord};
use sealpost_core::migration::{apply_migration, decide_migration, MigrationRefusal};
use sealpost_core::port::WireEnvelope;
use sealpost_core::receipt::{apply_receipt, decide_receipt, ReceiptSource};
use sealpost_core::reconcile::{
    apply_reconcile, decide_reconcile, Lookup, ReconcileDecision, ReconcilePolicy,
};
use sealpost_core::reconciler::{decide_verify, VerifyItem, VerifyVerdict};
use sealpost_core::signature::{
    is_this_message, judge_copy, Crypto, FoundCopy, SealRefusal, SignatureHeader, SignaturePolicy,
    SignedClaim, SIGNATURE_LEN,
};
use sealpost_core::{
    AttemptStatus, ClaimDecision, ClaimToken, Destination, Digest, DuplicateKind, EventId,
    EventRow, QuarantineReason, Receipt, ReceiptVerdict, RejectReason, RoutePolicy, SealedEnvelope,
    SendOutcome, SendOutcomeDecision, State,
};

// ---------------------------------------------------------------------------------------
// helpers
// ---------------------------------------------------------------------------------------

/// Database clock at the start of every scenario.
const T0: u64 = 1_700_000_000_000;
/// Claim lease length.
const LEASE: u64 = 30_000;
/// Poison limit used by the dispatcher.
const LIMIT: u32 = 3;
/// Routing key of the test aggregate.
const KEY: &str = "tenant-7.order.o-42";

const REDELIVER: ReconcilePolicy = ReconcilePolicy {
    redeliver_when_unqueryable: true,
    create_if_absent: false,
};
const NO_REDELIVER: ReconcilePolicy = ReconcilePolicy {
    redeliver_when_unqueryable: false,
    create_if_absent: false,
};

fn policy(generation: u64, topic: &str) -> RoutePolicy {
    RoutePolicy {
        generation,
        cluster: "nats-local".into(),
        topic: topic.into(),
        partition_algorithm: PartitionAlgorithm::None,
        serializer: "json.v1".into(),
        durability: "file".into(),
        required_ack: "stream".into(),
        ordering: sealpost_core::envelope::EventOrdering::Unordered,
    }
}

/// The destination frozen at commit for the test event.
fn orders() -> Destination {
    policy(1, "ORDERS").resolve(KEY)
}

/// A destination a migration may move to.
fn orders_eu() -> Destination {
    let mut p = policy(2, "ORDERS_EU");
    p.cluster = "nats-eu".into();
    p.resolve(KEY)
}

fn payload() -> Digest {
    Digest::of_bytes(PAYLOAD_DOMAIN, br#"{"order":"o-42","total_cents":1999}"#)
}

fn event_id() -> EventId {
    EventId::mint(T0, [7; 10])
}

/// The row as committed: `PENDING`, nothing claimed, nothing sent.
fn pending() -> EventRow {
    EventRow::new_pending(event_id(), 0, payload(), orders())
}

/// A dispatcher claim that must be granted.
fn claim(row: &mut EventRow, owner: u64, now: u64) -> ClaimToken {
    let d = decide_dispatch_claim(row, now, LEASE);
    assert!(
        matches!(d, ClaimDecision::Grant { .. }),
        "expected a grant, got {d:?}"
    );
    apply_claim(row, &d, owner, now)
        .expect("grant is in the state table")
        .expect("a token")
}

/// A reconciler claim that must be granted.
fn reconcile_claim(row: &mut EventRow, owner: u64, now: u64) -> ClaimToken {
    let d = decide_reconcile_claim(row, now, LEASE);
    assert!(
        matches!(
            d,
            ClaimDecision::Grant {
                next: State::Reconciling,
                ..
            }
        ),
        "{d:?}"
    );
    apply_claim(row, &d, owner, now)
        .expect("grant is in the state table")
        .expect("a token")
}

/// Registers attempt `attempt_id` and moves to `SENDING`.
fn begin(row: &mut EventRow, token: ClaimToken, attempt_id: u64, now: u64) {
    let b = decide_begin_send(row, token, now).expect("the claim holder may send");
    assert_eq!(
        b.destination_digest, row.destination_digest,
        "sends go to the frozen destination"
    );
    apply_begin_send(row, &b, token, attempt_id, now).expect("in the state table");
}

/// The sender reports what it learned without a receipt; decision and persistence.
fn report(
    row: &mut EventRow,
    token: ClaimToken,
    attempt_id: u64,
    outcome: SendOutcome,
    now: u64,
) -> SendOutcomeDecision {
    let d = decide_send_outcome(row, token, attempt_id, outcome, now, LIMIT);
    apply_send_outcome(row, d, attempt_id, outcome, now).expect("in the state table");
    d
}

/// `acceptDispatchReceipt`: decision and persistence.
fn accept(row: &mut EventRow, r: &Receipt, now: u64) -> ReceiptVerdict {
    let v = decide_receipt(row, r);
    apply_receipt(row, r, v, now).expect("in the state table");
    v
}

/// `SENDING`: owner 1 claimed at `T0` (lease until `T0 + LEASE`) and registered attempt 1.
fn sending() -> (EventRow, ClaimToken) {
    let mut row = pending();
    let t = claim(&mut row, 1, T0);
    begin(&mut row, t, 1, T0 + 1);
    (row, t)
}

/// `DISPATCH_UNKNOWN`: attempt 1 timed out waiting for its ACK at `T0 + 2`.
fn unknown() -> EventRow {
    let (mut row, t) = sending();
    assert_eq!(
        report(&mut row, t, 1, SendOutcome::AckTimeout, T0 + 2),
        SendOutcomeDecision::ToUnknown
    );
    row
}

/// `RECONCILING`, held by reconciler 9 from `T0 + 3`.
fn reconciling() -> (EventRow, ClaimToken) {
    let mut row = unknown();
    let t = reconcile_claim(&mut row, 9, T0 + 3);
    (row, t)
}

/// `PUBLISHED` at `T0 + 2` with the primary receipt at broker position `seq`.
fn published(seq: u64) -> EventRow {
    let (mut row, _) = sending();
    let r = ack(&row, 1, seq);
    assert_eq!(accept(&mut row, &r, T0 + 2), ReceiptVerdict::Primary);
    row
}

/// The genuine broker ACK for `attempt_id` at position `seq` of the row's frozen destination.
fn ack(row: &EventRow, attempt_id: u64, seq: u64) -> Receipt {
    Receipt {
        event_id: row.event_id,
        member: row.member,
        envelope_generation: row.envelope_generation,
        attempt_id,
        payload_digest: row.payload_digest,
        destination_digest: row.destination_digest,
        cluster: row.destination.cluster.clone(),
        stream: row.destination.topic.clone(),
        partition: row.destination.partition(),
        sequence: seq,
        broker_duplicate: false,
        source: ReceiptSource::Ack,
    }
}

/// The same receipt as found by the reconciler's lookup.
fn found(r: &Receipt) -> Receipt {
    Receipt {
        source: ReceiptSource::Lookup,
        ..r.clone()
    }
}

// ---------------------------------------------------------------------------------------
// SPEC §10, one test per line
// ---------------------------------------------------------------------------------------

#[test]
fn claim_lease_expires_while_claimed_another_dispatcher_claims_and_old_owner_is_fenced() {
    let mut row = pending();
    let old = claim(&mut row, 1, T0);
    let lease_end = T0 + LEASE;

    // Still leased (database clock): nobody else may take it.
    assert_eq!(
        decide_dispatch_claim(&row, lease_end - 1, LEASE),
        ClaimDecision::Skip
    );

    let d = decide_dispatch_claim(&row, lease_end, LEASE);
    assert_eq!(
        d,
        ClaimDecision::Grant {
            next: State::Claimed,
            generation: old.generation + 1,
            lease_until_ms: lease_end + LEASE,
            superseding: true,
        }
    );
    let new = apply_claim(&mut row, &d, 2, lease_end).unwrap().unwrap();
    assert_eq!(row.state, State::Claimed);
    assert_eq!(
        new,
        ClaimToken {
            owner: 2,
            generation: old.generation + 1
        }
    );
    assert_eq!(
        row.attempt_generation, 1,
        "a re-claim is not a new send authorisation"
    );
    assert!(row.attempts.is_empty());

    // The old owner's writes fail the CAS.
    let fenced = Err(Fenced::Superseded {
        current: Some(new.generation),
    });
    assert_eq!(
        decide_begin_send(&row, old, lease_end + 1).map(|_| ()),
        fenced
    );
    assert_eq!(decide_release(&row, old, lease_end + 1).map(|_| ()), fenced);

    // The new owner sends; the old owner's later report is audit only and changes nothing.
    begin(&mut row, new, 1, lease_end + 1);
    let before = row.clone();
    let d = report(&mut row, old, 1, SendOutcome::NeverSent, lease_end + 2);
    assert_eq!(
        d,
        SendOutcomeDecision::Audit(Fenced::Superseded {
            current: Some(new.generation)
        })
    );
    assert_eq!(row, before);
    assert_eq!(row.state, State::Sending);
    assert_eq!(row.attempt(1).unwrap().owner, 2);
}

#[test]
fn claim_lease_expires_while_sending_goes_to_dispatch_unknown_never_pending() {
    let (mut row, t) = sending();
    let lease_end = T0 + LEASE;

    assert_eq!(
        decide_dispatch_claim(&row, lease_end - 1, LEASE),
        ClaimDecision::Skip
    );
    assert_eq!(
        decide_reconcile_claim(&row, lease_end - 1, LEASE),
        ClaimDecision::Skip
    );
    // Both scanners agree: the send may have happened.
    assert_eq!(
        decide_reconcile_claim(&row, lease_end, LEASE),
        ClaimDecision::ExpireToUnknown
    );
    let d = decide_dispatch_claim(&row, lease_end, LEASE);
    assert_eq!(d, ClaimDecision::ExpireToUnknown);
    assert_eq!(
        apply_claim(&mut row, &d, 2, lease_end),
        Ok(None),
        "no claim is granted"
    );

    assert_eq!(row.state, State::DispatchUnknown);
    assert_ne!(row.state, State::Pending);
    assert_eq!(row.attempt(1).unwrap().status, AttemptStatus::Unknown);
    assert_eq!(row.claim, None);
    assert_eq!(row.unknown_since_ms, Some(lease_end));
    assert_eq!(row.primary, None);

    // A dispatcher scan never hands an unknown row out again as a fresh send.
    assert_eq!(
        decide_dispatch_claim(&row, lease_end + 1, LEASE),
        ClaimDecision::Skip
    );
    // The stale sender cannot take it back to PENDING with a late "never sent".
    let before = row.clone();
    let d = report(&mut row, t, 1, SendOutcome::NeverSent, lease_end + 1);
    assert_eq!(
        d,
        SendOutcomeDecision::Audit(Fenced::WrongState(State::DispatchUnknown))
    );
    assert_eq!(row, before);
    // ... but its late, genuine ACK still converges into the slot (F2, R11).
    let late = ack(&row, 1, 5);
    assert_eq!(
        accept(&mut row, &late, lease_end + 2),
        ReceiptVerdict::Primary
    );
    assert_eq!(row.state, State::Published);
    assert_eq!(row.primary, Some(late));
    assert_eq!(row.unknown_since_ms, None);
}

#[test]
fn old_attempt_ack_after_retry_claimed_new_attempt_wins_slot_and_new_ack_is_duplicate() {
    let (mut row, rt) = reconciling();
    let d = decide_reconcile(&row, rt, &Lookup::Unqueryable, REDELIVER, T0 + 4);
    apply_reconcile(&mut row, &d, T0 + 4).unwrap();
    assert_eq!(row.state, State::RetryClaimed);
    let t2 = claim(&mut row, 2, T0 + 5);
    begin(&mut row, t2, 2, T0 + 6);
    assert_eq!(row.attempt(2).unwrap().attempt_generation, 2);

    // The old attempt is still registered, as UNKNOWN.
    assert_eq!(row.attempt(1).unwrap().status, AttemptStatus::Unknown);
    assert_eq!(row.attempt(1).unwrap().attempt_generation, 1);

    let old_ack = ack(&row, 1, 10);
    assert_eq!(accept(&mut row, &old_ack, T0 + 7), ReceiptVerdict::Primary);
    assert_eq!(row.state, State::Published);
    assert_eq!(row.primary, Some(old_ack.clone()));

    let new_ack = ack(&row, 2, 11);
    assert_eq!(
        accept(&mut row, &new_ack, T0 + 8),
        ReceiptVerdict::Duplicate(DuplicateKind::SecondCopy)
    );
    assert_eq!(
        row.primary,
        Some(old_ack),
        "the duplicate never replaces the primary"
    );
    assert_eq!(row.published_at_ms, Some(T0 + 7));
    assert_eq!(row.attempt(1).unwrap().status, AttemptStatus::Acked);
    assert_eq!(row.attempt(2).unwrap().status, AttemptStatus::Acked);

    // The new sender's own report is now audit only.
    let before = row.clone();
    let d = report(&mut row, t2, 2, SendOutcome::AckTimeout, T0 + 9);
    assert_eq!(
        d,
        SendOutcomeDecision::Audit(Fenced::WrongState(State::Published))
    );
    assert_eq!(row, before);
}

#[test]
fn old_attempt_ack_that_loses_the_race_is_kept_as_duplicate() {
    let (mut row, rt) = reconciling();
    let d = decide_reconcile(&row, rt, &Lookup::Absent, REDELIVER, T0 + 4);
    apply_reconcile(&mut row, &d, T0 + 4).unwrap();
    let t2 = claim(&mut row, 2, T0 + 5);
    begin(&mut row, t2, 2, T0 + 6);

    let new_ack = ack(&row, 2, 11);
    assert_eq!(accept(&mut row, &new_ack, T0 + 7), ReceiptVerdict::Primary);
    // The expired attempt's genuine ACK is not dropped (R11): it is a duplicate.
    let old_ack = ack(&row, 1, 10);
    assert_eq!(
        accept(&mut row, &old_ack, T0 + 8),
        ReceiptVerdict::Duplicate(DuplicateKind::SecondCopy)
    );
    assert_eq!(row.primary, Some(new_ack));
    assert_eq!(row.attempt(1).unwrap().status, AttemptStatus::Acked);
}

#[test]
fn ack_while_reconciling_is_accepted_and_reconcilers_cas_fails_harmlessly() {
    let (mut row, rt) = reconciling();
    let r = ack(&row, 1, 3);
    assert_eq!(accept(&mut row, &r, T0 + 4), ReceiptVerdict::Primary);
    assert_eq!(row.state, State::Published);
    assert_eq!(
        row.claim, None,
        "acceptance releases the reconciler's claim"
    );
    assert_eq!(row.unknown_since_ms, None);

    let before = row.clone();
    for lookup in [
        Lookup::Found(found(&r)),
        Lookup::Absent,
        Lookup::Unqueryable,
        Lookup::Unavailable,
    ] {
        let d = decide_reconcile(&row, rt, &lookup, REDELIVER, T0 + 5);
        assert_eq!(
            d,
            ReconcileDecision::Fenced(Fenced::WrongState(State::Published)),
            "{lookup:?}"
        );
        apply_reconcile(&mut row, &d, T0 + 5).unwrap();
        assert_eq!(
            row, before,
            "the fenced reconciler changed the row after {lookup:?}"
        );
    }
}

#[test]
fn two_acks_same_broker_position_give_primary_and_same_position_duplicate() {
    let (mut row, _) = sending();
    let first = ack(&row, 1, 42);
    assert_eq!(accept(&mut row, &first, T0 + 2), ReceiptVerdict::Primary);

    // NATS answers the re-publish with `duplicate: true` and the same stream sequence.
    let dup = Receipt {
        broker_duplicate: true,
        ..ack(&row, 1, 42)
    };
    assert_eq!(
        accept(&mut row, &dup, T0 + 3),
        ReceiptVerdict::Duplicate(DuplicateKind::SamePosition)
    );
    assert_eq!(row.primary, Some(first));
    assert_eq!(row.published_at_ms, Some(T0 + 2));
    assert_eq!(row.state, State::Published);
}

#[test]
fn two_acks_different_positions_give_primary_and_second_copy_absorbed_by_inbox() {
    let (mut row, _) = sending();
    let first = ack(&row, 1, 42);
    assert_eq!(accept(&mut row, &first, T0 + 2), ReceiptVerdict::Primary);
    let second = ack(&row, 1, 43);
    let v = accept(&mut row, &second, T0 + 3);
    assert_eq!(v, ReceiptVerdict::Duplicate(DuplicateKind::SecondCopy));
    assert_ne!(v, ReceiptVerdict::Duplicate(DuplicateKind::SamePosition));
    assert_eq!(row.primary.as_ref().map(|p| p.sequence), Some(42));

    // The consumer applied the first copy; the second copy has no second effect.
    assert_eq!(
        decide_inbox(None, first.payload_digest),
        InboxDecision::Apply
    );
    let rec = InboxRecord {
        payload_digest: first.payload_digest,
        receipt_id: 77,
    };
    assert_eq!(
        decide_inbox(Some(rec), second.payload_digest),
        InboxDecision::Duplicate { receipt_id: 77 }
    );
}

#[test]
fn ack_with_payload_or_destination_digest_mismatch_is_quarantined_and_slot_untouched() {
    let (row, _) = sending();
    let other_route = policy(2, "ORDERS").resolve(KEY).digest();
    assert_ne!(other_route, row.destination_digest);
    let cases = [
        (
            Receipt {
                payload_digest: Digest([0xaa; 32]),
                ..ack(&row, 1, 5)
            },
            QuarantineReason::PayloadDigestMismatch,
        ),
        (
            Receipt {
                destination_digest: other_route,
                ..ack(&row, 1, 5)
            },
            QuarantineReason::DestinationDigestMismatch,
        ),
        // Unregistered attempt but contradicting digests: still quarantined, not just rejected.
        (
            Receipt {
                payload_digest: Digest([0xaa; 32]),
                ..ack(&row, 99, 5)
            },
            QuarantineReason::PayloadDigestMismatch,
        ),
        (
            Receipt {
                destination_digest: other_route,
                ..ack(&row, 99, 5)
            },
            QuarantineReason::DestinationDigestMismatch,
        ),
        // Right digests, but the broker coordinates are outside the frozen destination.
        (
            Receipt {
                cluster: "nats-other".into(),
                ..ack(&row, 1, 5)
            },
            QuarantineReason::ReceiptOutsideDestination,
        ),
        (
            Receipt {
                stream: "ORDERS_V2".into(),
                ..ack(&row, 1, 5)
            },
            QuarantineReason::ReceiptOutsideDestination,
        ),
        (
            Receipt {
                partition: Some(3),
                ..ack(&row, 1, 5)
            },
            QuarantineReason::ReceiptOutsideDestination,
        ),
    ];
    for (bad, reason) in &cases {
        let mut after = row.clone();
        assert_eq!(
            accept(&mut after, bad, T0 + 2),
            ReceiptVerdict::Quarantine(*reason)
        );
        assert_eq!(after, row, "quarantine changed the row ({reason:?})");
        assert_eq!(after.primary, None);
        assert_eq!(after.state, State::Sending);
    }

    // With the slot already filled, a contradicting receipt is not even a duplicate.
    let mut pubd = row.clone();
    let good = ack(&row, 1, 5);
    assert_eq!(accept(&mut pubd, &good, T0 + 2), ReceiptVerdict::Primary);
    for (bad, reason) in &cases {
        let mut after = pubd.clone();
        assert_eq!(
            accept(&mut after, bad, T0 + 3),
            ReceiptVerdict::Quarantine(*reason)
        );
        assert_eq!(after, pubd);
        assert_eq!(after.primary, Some(good.clone()));
    }
}

#[test]
fn ack_for_unregistered_attempt_id_is_rejected_and_row_untouched() {
    let (row, _) = sending();
    let forged = ack(&row, 99, 5);
    let mut after = row.clone();
    assert_eq!(
        accept(&mut after, &forged, T0 + 2),
        ReceiptVerdict::Reject(RejectReason::UnregisteredAttempt)
    );
    assert_eq!(after, row);

    // Not on a never-sent row either ...
    let p = pending();
    assert_eq!(
        decide_receipt(&p, &ack(&p, 1, 5)),
        ReceiptVerdict::Reject(RejectReason::UnregisteredAttempt)
    );
    // ... and not as a "duplicate" once the slot is filled.
    let mut pubd = published(5);
    let before = pubd.clone();
    assert_eq!(
        accept(&mut pubd, &ack(&before, 99, 6), T0 + 3),
        ReceiptVerdict::Reject(RejectReason::UnregisteredAttempt)
    );
    assert_eq!(pubd, before);
}

#[test]
fn receipt_transaction_rolls_back_row_stays_in_flight_and_slot_is_filled_later() {
    let (row, _) = sending();
    let r = ack(&row, 1, 8);
    assert_eq!(decide_receipt(&row, &r), ReceiptVerdict::Primary);
    // The transaction that would persist it rolls back: nothing is applied.
    assert_eq!(row.state, State::Sending);
    assert_eq!(row.primary, None);

    // Either a retry of acceptance fills the slot ...
    let mut retried = row.clone();
    assert_eq!(accept(&mut retried, &r, T0 + 3), ReceiptVerdict::Primary);
    assert_eq!(retried.primary, Some(r.clone()));

    // ... or nobody retries, the lease runs out, and the reconciler's lookup fills it.
    let mut row = row;
    let d = decide_dispatch_claim(&row, T0 + LEASE, LEASE);
    assert_eq!(d, ClaimDecision::ExpireToUnknown);
    apply_claim(&mut row, &d, 2, T0 + LEASE).unwrap();
    assert_eq!(row.state, State::DispatchUnknown);
    let rt = reconcile_claim(&mut row, 9, T0 + LEASE + 1);
    let f = found(&r);
    let d = decide_reconcile(
        &row,
        rt,
        &Lookup::Found(f.clone()),
        NO_REDELIVER,
        T0 + LEASE + 2,
    );
    assert_eq!(d, ReconcileDecision::Accept(f.clone()));
    assert_eq!(
        accept(&mut row, &f, T0 + LEASE + 2),
        ReceiptVerdict::Primary
    );
    assert_eq!(row.state, State::Published);
    assert_eq!(row.primary, Some(f));
    assert_eq!(row.attempt(1).unwrap().status, AttemptStatus::Acked);
}

#[test]
fn route_policy_revised_between_commit_and_send_uses_frozen_destination() {
    let ev = NewEvent {
        aggregate_type: "order",
        aggregate_id: "o-42",
        aggregate_version: 17,
        event_type: "order.created.v1",
        payload_schema: "order.created.v1",
        payload: br#"{"order":"o-42","total_cents":1999}"#,
        tenant: "tenant-7",
        occurred_at_ms: T0,
        creating_txid: 4242,
    };
    let v1 = policy(1, "ORDERS");
    let env = SealedEnvelope::seal(event_id(), &ev, &v1, KEY);
    let mut row = EventRow::pending(&env, 0);

    // The policy is revised before any dispatcher runs; only new events see it.
    let v2 = policy(2, "ORDERS_V2");
    let later = SealedEnvelope::seal(EventId::mint(T0 + 1, [8; 10]), &ev, &v2, KEY);
    assert_eq!(later.destination.topic, "ORDERS_V2");
    assert_ne!(later.destination_digest, env.destination_digest);

    let t = claim(&mut row, 1, T0);
    let b = decide_begin_send(&row, t, T0 + 1).unwrap();
    assert_eq!(b.destination_digest, env.destination_digest);
    assert_ne!(b.destination_digest, later.destination_digest);
    apply_begin_send(&mut row, &b, t, 1, T0 + 1).unwrap();
    assert_eq!(row.destination, env.destination);
    assert_eq!(
        row.attempt(1).unwrap().destination_digest,
        env.destination_digest
    );

    // A receipt claiming the event went to the new route is quarantined ...
    let moved = Receipt {
        destination_digest: later.destination_digest,
        stream: "ORDERS_V2".into(),
        ..ack(&row, 1, 4)
    };
    assert_eq!(
        decide_receipt(&row, &moved),
        ReceiptVerdict::Quarantine(QuarantineReason::DestinationDigestMismatch)
    );
    // ... the one from the frozen destination is accepted.
    let r = ack(&row, 1, 4);
    assert_eq!(accept(&mut row, &r, T0 + 2), ReceiptVerdict::Primary);
    assert_eq!(row.primary.as_ref().unwrap().stream, "ORDERS");
}

#[test]
fn migration_while_old_destination_unknown_is_refused() {
    let to = orders_eu();
    let refused = Err(MigrationRefusal::OldDestinationUnknown);

    let (s, _) = sending();
    assert_eq!(decide_migration(&s, &to).map(|_| ()), refused, "SENDING");
    let u = unknown();
    assert_eq!(
        decide_migration(&u, &to).map(|_| ()),
        refused,
        "DISPATCH_UNKNOWN"
    );
    let (r, rt) = reconciling();
    assert_eq!(
        decide_migration(&r, &to).map(|_| ()),
        refused,
        "RECONCILING"
    );

    // F5: the old destination cannot be asked; without a redeliver policy it stays unknown,
    // and the migration is still refused.
    let mut stuck = r.clone();
    let d = decide_reconcile(&stuck, rt, &Lookup::Unqueryable, NO_REDELIVER, T0 + 4);
    assert_eq!(d, ReconcileDecision::StayUnknown);
    apply_reconcile(&mut stuck, &d, T0 + 4).unwrap();
    assert_eq!(stuck.state, State::DispatchUnknown);
    assert_eq!(
        decide_migration(&stuck, &to).map(|_| ()),
        refused,
        "unqueryable"
    );

    // A redelivery grant is to the same destination, not a licence to move.
    let mut retry = r;
    let d = decide_reconcile(&retry, rt, &Lookup::Unqueryable, REDELIVER, T0 + 4);
    apply_reconcile(&mut retry, &d, T0 + 4).unwrap();
    assert_eq!(retry.state, State::RetryClaimed);
    assert_eq!(
        decide_migration(&retry, &to).map(|_| ()),
        refused,
        "RETRY_CLAIMED"
    );
}

#[test]
fn old_destination_receipt_after_migration_granted_is_quarantined_as_migration_conflict() {
    let (mut row, t) = sending();
    // What the old destination would answer if the "never sent" proof were wrong.
    let old_ack = ack(&row, 1, 12);
    assert_eq!(
        report(&mut row, t, 1, SendOutcome::NeverSent, T0 + 2),
        SendOutcomeDecision::ToPending
    );

    let to = orders_eu();
    let grant = decide_migration(&row, &to).expect("all attempts failed: migration allowed");
    apply_migration(&mut row, &grant, to.clone()).unwrap();
    assert_eq!(row.envelope_generation, 2);
    assert_eq!(row.destination_digest, to.digest());

    let before = row.clone();
    assert_eq!(
        accept(&mut row, &old_ack, T0 + 3),
        ReceiptVerdict::Quarantine(QuarantineReason::MigrationConflict)
    );
    assert_eq!(row, before, "a conflicting receipt must not touch the row");
    assert_eq!(row.state, State::Pending);

    // The new generation publishes at the new destination ...
    let t2 = claim(&mut row, 2, T0 + 10);
    begin(&mut row, t2, 2, T0 + 11);
    let new_ack = ack(&row, 2, 1);
    assert_eq!(new_ack.cluster, "nats-eu");
    assert_eq!(accept(&mut row, &new_ack, T0 + 12), ReceiptVerdict::Primary);

    // ... and the old-destination receipt is still a conflict, never a second accepted copy.
    let before = row.clone();
    let v = accept(&mut row, &old_ack, T0 + 13);
    assert_eq!(
        v,
        ReceiptVerdict::Quarantine(QuarantineReason::MigrationConflict)
    );
    assert!(!matches!(v, ReceiptVerdict::Duplicate(_)));
    assert_eq!(row, before);
    assert_eq!(row.primary, Some(new_ack));
}

#[test]
fn database_restored_from_backup_before_publication_keeps_event_ids_and_no_second_effect() {
    // Before the disaster the event was published by attempt 5 at position 20 and consumed.
    // The backup predates all of that: the row comes back PENDING and knows no attempt 5.
    let mut row = pending();
    let pre_restore = ack(&row, 5, 20);
    let before = row.clone();
    assert_eq!(
        accept(&mut row, &pre_restore, T0),
        ReceiptVerdict::Reject(RejectReason::UnregisteredAttempt)
    );
    assert_eq!(row, before);

    // Redelivery under the same event id.
    let t = claim(&mut row, 3, T0 + 1);
    begin(&mut row, t, 1, T0 + 2);
    let redelivered = ack(&row, 1, 21);
    assert_eq!(redelivered.event_id, pre_restore.event_id);
    assert_eq!(
        accept(&mut row, &redelivered, T0 + 3),
        ReceiptVerdict::Primary
    );
    assert_eq!(row.event_id, event_id());

    // The consumer already holds the pre-restore delivery: no second effect, same key.
    let rec = InboxRecord {
        payload_digest: pre_restore.payload_digest,
        receipt_id: 500,
    };
    assert_eq!(
        decide_inbox(Some(rec), redelivered.payload_digest),
        InboxDecision::Duplicate { receipt_id: 500 }
    );
    assert_eq!(
        idempotency_key(redelivered.event_id, "billing", "charge"),
        idempotency_key(pre_restore.event_id, "billing", "charge")
    );

    // A row restored in SENDING with a long-gone lease goes to UNKNOWN, not PENDING; the
    // lookup finds the pre-restore copy (attempt unknown to this database). Event id,
    // digests, envelope generation and coordinates all match the sealed envelope, so the
    // copy the broker holds fills the slot: no second copy is sent, however long ago the
    // duplicate window closed.
    let (mut s, _) = sending();
    let now = T0 + 10 * LEASE;
    let d = decide_dispatch_claim(&s, now, LEASE);
    assert_eq!(d, ClaimDecision::ExpireToUnknown);
    apply_claim(&mut s, &d, 3, now).unwrap();
    assert_eq!(s.state, State::DispatchUnknown);
    let rt = reconcile_claim(&mut s, 9, now + 1);
    let d = decide_reconcile(
        &s,
        rt,
        &Lookup::Found(found(&pre_restore)),
        NO_REDELIVER,
        now + 2,
    );
    let ReconcileDecision::Accept(adopted) = d else {
        panic!("expected the copy to be adopted, got {d:?}");
    };
    assert_eq!(accept(&mut s, &adopted, now + 2), ReceiptVerdict::Primary);
    assert_eq!(s.state, State::Published);
    assert_eq!(s.event_id, event_id());
    assert_eq!(
        s.primary.as_ref().map(|p| p.sequence),
        Some(found(&pre_restore).sequence)
    );

    // The same unregistered attempt reported by a *sender* (not read from the broker) is
    // never adopted: anyone can claim an attempt id.
    let (s2, _) = sending();
    let mut forged = found(&pre_restore);
    forged.source = ReceiptSource::Ack;
    assert_eq!(
        decide_receipt(&s2, &forged),
        ReceiptVerdict::Reject(RejectReason::UnregisteredAttempt)
    );
    // Nor is a found copy whose payload differs from the sealed one.
    let mut other = found(&pre_restore);
    other.payload_digest = Digest([0xab; 32]);
    assert!(!sealpost_core::receipt::adoptable(&s2, &other));

    // A found copy it cannot adopt (another envelope generation: the restored row was
    // migrated since) at a broker that refuses a second copy: a retry could never replace
    // it (the simulator found that endless loop), so it is a conflict for the operator; at a
    // broker without create-if-absent the retry goes to the same destination as before.
    let create_if_absent = ReconcilePolicy {
        redeliver_when_unqueryable: false,
        create_if_absent: true,
    };
    for (policy, conflict) in [(create_if_absent, true), (NO_REDELIVER, false)] {
        let (mut s3, _) = sending();
        let now = T0 + 10 * LEASE;
        let d = decide_dispatch_claim(&s3, now, LEASE);
        apply_claim(&mut s3, &d, 3, now).unwrap();
        let rt = reconcile_claim(&mut s3, 9, now + 1);
        let mut older = found(&pre_restore);
        older.envelope_generation += 1;
        let d = decide_reconcile(&s3, rt, &Lookup::Found(older), policy, now + 2);
        if conflict {
            assert_eq!(
                d,
                ReconcileDecision::Conflict(QuarantineReason::UnadoptableCopy)
            );
        } else {
            assert!(
                matches!(
                    d,
                    ReconcileDecision::RetrySameDestination {
                        quarantine: None,
                        ..
                    }
                ),
                "{d:?}"
            );
        }
    }
}

#[test]
fn broker_answers_duplicate_with_sequence_zero_is_not_a_receipt_but_unknown() {
    let (mut row, t) = sending();
    let zero = Receipt {
        broker_duplicate: true,
        ..ack(&row, 1, 0)
    };
    let before = row.clone();
    assert_eq!(
        accept(&mut row, &zero, T0 + 2),
        ReceiptVerdict::Reject(RejectReason::NoPosition)
    );
    assert_eq!(row, before);
    assert_eq!(row.primary, None);

    // The sender therefore has no receipt: unknown.
    assert_eq!(
        report(&mut row, t, 1, SendOutcome::AckTimeout, T0 + 3),
        SendOutcomeDecision::ToUnknown
    );
    assert_eq!(row.state, State::DispatchUnknown);

    // A lookup that only yields the sequence-0 answer proves nothing either.
    let rt = reconcile_claim(&mut row, 9, T0 + 4);
    let d = decide_reconcile(&row, rt, &Lookup::Found(found(&zero)), REDELIVER, T0 + 5);
    assert_eq!(d, ReconcileDecision::StayUnknown);
    apply_reconcile(&mut row, &d, T0 + 5).unwrap();
    assert_eq!(row.state, State::DispatchUnknown);
    assert_eq!(row.primary, None);

    // Same for a sequence-0 answer once the slot is filled: not a duplicate receipt.
    let mut pubd = published(9);
    let before = pubd.clone();
    assert_eq!(
        accept(
            &mut pubd,
            &Receipt {
                broker_duplicate: true,
                ..ack(&before, 1, 0)
            },
            T0 + 3
        ),
        ReceiptVerdict::Reject(RejectReason::NoPosition)
    );
    assert_eq!(pubd, before);
}

#[test]
fn consumer_commits_effect_then_crashes_before_broker_ack_redelivery_returns_original_receipt() {
    let id = event_id();
    let p = payload();
    assert_eq!(decide_inbox(None, p), InboxDecision::Apply);
    // Effect and inbox row committed together as consumption receipt 31; then the crash.
    let rec = InboxRecord {
        payload_digest: p,
        receipt_id: 31,
    };

    let redelivery = decide_inbox(Some(rec), p);
    assert_eq!(redelivery, InboxDecision::Duplicate { receipt_id: 31 });
    assert_ne!(redelivery, InboxDecision::Apply);
    // A different payload under the known id is quarantined, never applied.
    assert_eq!(
        decide_inbox(Some(rec), Digest([1; 32])),
        InboxDecision::Quarantine
    );
    // External effects carry a key derived from the event id: the same on every delivery.
    let k = idempotency_key(id, "billing", "charge");
    assert_eq!(k, idempotency_key(id, "billing", "charge"));
    assert_ne!(
        k,
        idempotency_key(EventId::mint(T0, [8; 10]), "billing", "charge")
    );
}

#[test]
fn purge_requested_for_event_a_required_consumer_has_not_passed_is_refused_with_reason() {
    let row = published(100);
    let window = RetentionPolicy {
        replay_window_ms: 7 * 24 * 3_600_000,
        restore_point_ms: None,
    };
    let after_window = T0 + 2 + window.replay_window_ms;

    let required = [
        Watermark {
            consumer: 0,
            watermark: Some(150),
        },
        Watermark {
            consumer: 1,
            watermark: Some(99),
        },
    ];
    let err = decide_purge(&row, after_window, window, &required).unwrap_err();
    assert_eq!(
        err,
        PurgeRefusal::ConsumerBehind {
            consumer: 1,
            position: 100,
            watermark: Some(99)
        }
    );
    let reason = err.to_string();
    assert!(reason.contains("#1") && reason.contains("100"), "{reason}");

    // A consumer that has consumed nothing yet holds the purge too.
    assert_eq!(
        decide_purge(
            &row,
            after_window,
            window,
            &[Watermark {
                consumer: 2,
                watermark: None
            }]
        ),
        Err(PurgeRefusal::ConsumerBehind {
            consumer: 2,
            position: 100,
            watermark: None
        })
    );
}

#[test]
fn an_event_published_after_the_oldest_restorable_backup_is_retained_not_purged() {
    let row = published(100);
    let published_at = row.published_at_ms.unwrap();
    let consumed = [Watermark {
        consumer: 0,
        watermark: Some(100),
    }];
    let policy = |restore_point_ms| RetentionPolicy {
        replay_window_ms: 1_000,
        restore_point_ms,
    };
    let now = published_at + 10_000;
    // The backup was taken at the publication instant: a consumer restored from it has not
    // seen the event, so its payload must stay for the replay.
    let kept = policy(Some(published_at));
    assert_eq!(
        decide_purge(&row, now, kept, &consumed),
        Err(PurgeRefusal::RestorePoint {
            published_at_ms: published_at,
            restore_point_ms: published_at
        })
    );
    assert_eq!(
        decide_retention(&row, now, kept, &consumed),
        RetentionDecision::Retain,
        "every consumer passed it: RETAINED, not PURGED"
    );
    // A backup taken after the publication: the event may go.
    assert_eq!(
        decide_purge(&row, now, policy(Some(published_at + 1)), &consumed),
        Ok(())
    );
    // The restore point never overrides a consumer that has not passed the event.
    assert!(matches!(
        decide_purge(
            &row,
            now,
            policy(Some(published_at + 1)),
            &[Watermark {
                consumer: 0,
                watermark: Some(99)
            }]
        ),
        Err(PurgeRefusal::ConsumerBehind { .. })
    ));
}

// ---------------------------------------------------------------------------------------
// Claims and fencing (R7–R9)
// ---------------------------------------------------------------------------------------

#[test]
fn lease_is_judged_on_the_database_clock_with_a_consistent_boundary() {
    let mut row = pending();
    let t = claim(&mut row, 1, T0);
    assert_eq!(row.claim.as_ref().unwrap().lease_until_ms, T0 + LEASE);
    assert_eq!(check_fence(&row, t, T0 + LEASE - 1), Ok(()));
    assert_eq!(
        check_fence(&row, t, T0 + LEASE),
        Err(Fenced::LeaseExpired {
            lease_until_ms: T0 + LEASE
        })
    );
    // The scanner sees the same boundary: no instant where both may write.
    assert_eq!(
        decide_dispatch_claim(&row, T0 + LEASE - 1, LEASE),
        ClaimDecision::Skip
    );
    assert!(matches!(
        decide_dispatch_claim(&row, T0 + LEASE, LEASE),
        ClaimDecision::Grant { .. }
    ));
    // Same generation, other owner: not the holder.
    let imposter = ClaimToken {
        owner: 2,
        generation: t.generation,
    };
    assert_eq!(
        check_fence(&row, imposter, T0 + 1),
        Err(Fenced::Superseded {
            current: Some(t.generation)
        })
    );
}

#[test]
fn stale_claim_writes_are_fenced_and_become_audit() {
    let (row, t) = sending();

    // Lease expired (nobody has re-claimed yet): the report is audit only.
    let mut after = row.clone();
    let d = report(&mut after, t, 1, SendOutcome::AckTimeout, T0 + LEASE);
    assert_eq!(
        d,
        SendOutcomeDecision::Audit(Fenced::LeaseExpired {
            lease_until_ms: T0 + LEASE
        })
    );
    assert_eq!(after, row);
    assert_eq!(after.state, State::Sending);

    // Superseded claim generation.
    let stale = ClaimToken {
        owner: 1,
        generation: t.generation - 1,
    };
    let mut after = row.clone();
    let d = report(&mut after, stale, 1, SendOutcome::Rejected, T0 + 2);
    assert_eq!(
        d,
        SendOutcomeDecision::Audit(Fenced::Superseded {
            current: Some(t.generation)
        })
    );
    assert_eq!(after, row);
    assert_eq!(after.rejections, 0, "an audited rejection is not counted");

    // A report about an attempt that is not this claim's open attempt.
    let mut after = row.clone();
    let d = report(&mut after, t, 99, SendOutcome::NeverSent, T0 + 2);
    assert_eq!(d, SendOutcomeDecision::Audit(Fenced::NotCurrentAttempt));
    assert_eq!(after, row);

    // The holder cannot start a second send while one is registered.
    assert_eq!(
        decide_begin_send(&row, t, T0 + 2),
        Err(Fenced::WrongState(State::Sending))
    );
    // An expired holder cannot start a new send on a CLAIMED row either.
    let mut c = pending();
    let ct = claim(&mut c, 1, T0);
    assert_eq!(
        decide_begin_send(&c, ct, T0 + LEASE),
        Err(Fenced::LeaseExpired {
            lease_until_ms: T0 + LEASE
        })
    );
}

#[test]
fn expired_sending_lease_gives_expire_to_unknown_never_pending() {
    let (row, _) = sending();
    for now in [T0 + LEASE, T0 + 100 * LEASE] {
        for d in [
            decide_dispatch_claim(&row, now, LEASE),
            decide_reconcile_claim(&row, now, LEASE),
        ] {
            assert_eq!(d, ClaimDecision::ExpireToUnknown);
            let mut after = row.clone();
            apply_claim(&mut after, &d, 2, now).unwrap();
            assert_eq!(after.state, State::DispatchUnknown);
            assert!(after
                .attempts
                .iter()
                .all(|a| a.status == AttemptStatus::Unknown));
            assert_eq!(
                after.claim_generation, row.claim_generation,
                "no new claim issued"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// Send outcomes (R6)
// ---------------------------------------------------------------------------------------

#[test]
fn send_outcome_ack_timeout_goes_to_unknown() {
    let (mut row, t) = sending();
    let d = report(&mut row, t, 1, SendOutcome::AckTimeout, T0 + 2);
    assert_eq!(d, SendOutcomeDecision::ToUnknown);
    assert_eq!(row.state, State::DispatchUnknown);
    assert_eq!(row.attempt(1).unwrap().status, AttemptStatus::Unknown);
    assert_eq!(row.unknown_since_ms, Some(T0 + 2));
    assert_eq!(row.claim, None);
    assert_eq!(row.rejections, 0);
    assert_eq!(
        decide_dispatch_claim(&row, T0 + 3, LEASE),
        ClaimDecision::Skip
    );
}

#[test]
fn send_outcome_never_sent_returns_to_pending_with_failed_attempt() {
    let (mut row, t) = sending();
    let d = report(&mut row, t, 1, SendOutcome::NeverSent, T0 + 2);
    assert_eq!(d, SendOutcomeDecision::ToPending);
    assert_eq!(row.state, State::Pending);
    assert_eq!(row.attempt(1).unwrap().status, AttemptStatus::Failed);
    assert_eq!(row.claim, None);
    assert_eq!(row.rejections, 0, "never sent is not a broker rejection");
    assert_eq!(row.unknown_since_ms, None);
    assert_eq!(row.pacing.never_sent, 1);

    // Not claimable again before its backoff: a row that cannot leave must not be
    // re-claimed on every poll and starve newer rows.
    let due = T0 + 2 + never_sent_backoff_ms(1);
    assert_eq!(row.pacing.not_before_ms, due);
    assert_eq!(
        decide_dispatch_claim(&row, due - 1, LEASE),
        ClaimDecision::Skip
    );
    // The next claim is a new send authorisation; the failed attempt stays registered.
    let t2 = claim(&mut row, 2, due);
    assert_eq!(row.attempt_generation, 2);
    begin(&mut row, t2, 2, due + 1);
    assert_eq!(row.attempts.len(), 2);
    assert_eq!(row.attempt(1).unwrap().status, AttemptStatus::Failed);
}

#[test]
fn send_outcome_rejected_up_to_rejection_limit_goes_to_quarantine() {
    let mut row = pending();
    for i in 1..=u64::from(LIMIT) {
        let now = T0 + i * 10 * NEVER_SENT_BACKOFF_MS_MAX;
        let t = claim(&mut row, 1, now);
        begin(&mut row, t, i, now + 1);
        let d = report(&mut row, t, i, SendOutcome::Rejected, now + 2);
        if i < u64::from(LIMIT) {
            assert_eq!(d, SendOutcomeDecision::ToPending, "rejection {i}");
            assert_eq!(row.state, State::Pending);
        } else {
            assert_eq!(d, SendOutcomeDecision::ToQuarantine, "rejection {i}");
        }
        assert_eq!(u64::from(row.rejections), i);
        assert_eq!(row.attempt(i).unwrap().status, AttemptStatus::Failed);
    }
    assert_eq!(row.state, State::Quarantined);
    assert_eq!(row.primary, None, "quarantine never fills the slot");
    assert_eq!(row.claim, None);
    // No infinite loop: no scanner picks a quarantined row up.
    assert_eq!(
        decide_dispatch_claim(&row, T0 + 10 * LEASE, LEASE),
        ClaimDecision::Skip
    );
    assert_eq!(
        decide_reconcile_claim(&row, T0 + 10 * LEASE, LEASE),
        ClaimDecision::Skip
    );
    // The operator's exit path.
    assert_eq!(decide_release_quarantine(&row), Ok(State::Pending));

    // A limit of 1 quarantines on the first refusal.
    let (mut one, t) = sending();
    let d = decide_send_outcome(&one, t, 1, SendOutcome::Rejected, T0 + 2, 1);
    assert_eq!(d, SendOutcomeDecision::ToQuarantine);
    apply_send_outcome(&mut one, d, 1, SendOutcome::Rejected, T0 + 2).unwrap();
    assert_eq!(one.state, State::Quarantined);
}

#[test]
fn operator_quarantine_release_only_applies_to_quarantined_rows() {
    // The exit path is QUARANTINED -> PENDING. On any other row it must be refused; above all
    // it must never move a SENDING row back to PENDING (R9: the send may have happened).
    let (s, _) = sending();
    let mut c = pending();
    claim(&mut c, 1, T0);
    let granted: Vec<State> = [pending(), c, s, unknown(), published(1)]
        .iter()
        .filter(|row| decide_release_quarantine(row).is_ok())
        .map(|row| row.state)
        .collect();
    assert!(
        granted.is_empty(),
        "quarantine release granted on non-quarantined rows: {granted:?}"
    );
}

// ---------------------------------------------------------------------------------------
// Reconcile decisions (R13–R14)
// ---------------------------------------------------------------------------------------

#[test]
fn reconcile_found_is_accepted_through_the_acceptance_point() {
    let (mut row, rt) = reconciling();
    let f = found(&ack(&row, 1, 9));
    let d = decide_reconcile(&row, rt, &Lookup::Found(f.clone()), NO_REDELIVER, T0 + 4);
    assert_eq!(d, ReconcileDecision::Accept(f.clone()));
    // The reconcile decision itself writes nothing; only the acceptance point publishes.
    let before = row.clone();
    apply_reconcile(&mut row, &d, T0 + 4).unwrap();
    assert_eq!(row, before);
    assert_eq!(accept(&mut row, &f, T0 + 4), ReceiptVerdict::Primary);
    assert_eq!(row.state, State::Published);
    assert_eq!(row.primary, Some(f));
}

#[test]
fn reconcile_absent_retries_to_the_rows_own_frozen_destination() {
    let (mut row, rt) = reconciling();
    let d = decide_reconcile(&row, rt, &Lookup::Absent, NO_REDELIVER, T0 + 4);
    assert_eq!(
        d,
        ReconcileDecision::RetrySameDestination {
            destination_digest: row.destination_digest,
            quarantine: None
        }
    );
    let ReconcileDecision::RetrySameDestination {
        destination_digest, ..
    } = d
    else {
        unreachable!()
    };
    assert_eq!(destination_digest, orders().digest());
    assert_ne!(
        destination_digest,
        policy(2, "ORDERS").resolve(KEY).digest()
    );

    apply_reconcile(&mut row, &d, T0 + 4).unwrap();
    assert_eq!(row.state, State::RetryClaimed);
    assert_eq!(row.attempt_generation, 2);
    assert_eq!(row.claim, None);
    assert_eq!(
        row.attempt(1).unwrap().status,
        AttemptStatus::Unknown,
        "still registered"
    );
    assert_eq!(
        row.destination,
        orders(),
        "the destination is never changed by a retry"
    );

    // The redelivery goes to that same destination under attempt generation 2.
    let t = claim(&mut row, 2, T0 + 5);
    assert_eq!(row.state, State::RetryClaimed);
    let b = decide_begin_send(&row, t, T0 + 6).unwrap();
    assert_eq!(b.destination_digest, destination_digest);
    assert_eq!(b.attempt_generation, 2);
}

#[test]
fn reconcile_unqueryable_retries_only_with_redeliver_policy() {
    let (row, rt) = reconciling();

    let mut with = row.clone();
    let d = decide_reconcile(&with, rt, &Lookup::Unqueryable, REDELIVER, T0 + 4);
    assert_eq!(
        d,
        ReconcileDecision::RetrySameDestination {
            destination_digest: row.destination_digest,
            quarantine: None
        }
    );
    apply_reconcile(&mut with, &d, T0 + 4).unwrap();
    assert_eq!(with.state, State::RetryClaimed);

    let mut without = row.clone();
    let d = decide_reconcile(&without, rt, &Lookup::Unqueryable, NO_REDELIVER, T0 + 4);
    assert_eq!(d, ReconcileDecision::StayUnknown);
    apply_reconcile(&mut without, &d, T0 + 4).unwrap();
    assert_eq!(without.state, State::DispatchUnknown);
    assert_eq!(
        without.attempt_generation, row.attempt_generation,
        "no new send authorised"
    );
    assert_eq!(without.claim, None);
    assert_eq!(
        without.unknown_since_ms,
        Some(T0 + 2),
        "UNKNOWN age keeps counting"
    );
}

#[test]
fn reconcile_unavailable_stays_unknown_under_any_policy() {
    let (row, rt) = reconciling();
    for policy in [REDELIVER, NO_REDELIVER] {
        let mut after = row.clone();
        let d = decide_reconcile(&after, rt, &Lookup::Unavailable, policy, T0 + 4);
        assert_eq!(d, ReconcileDecision::StayUnknown, "{policy:?}");
        apply_reconcile(&mut after, &d, T0 + 4).unwrap();
        assert_eq!(after.state, State::DispatchUnknown);
        assert_eq!(after.attempt_generation, row.attempt_generation);
        assert_eq!(after.attempt(1).unwrap().status, AttemptStatus::Unknown);
        assert_eq!(after.primary, None);
    }
}

#[test]
fn reconcile_is_fenced_when_row_was_published_meanwhile_or_reconciler_superseded() {
    // Published meanwhile by a late ACK.
    let (mut row, rt) = reconciling();
    let r = ack(&row, 1, 3);
    assert_eq!(accept(&mut row, &r, T0 + 4), ReceiptVerdict::Primary);
    assert_eq!(
        decide_reconcile(&row, rt, &Lookup::Absent, REDELIVER, T0 + 5),
        ReconcileDecision::Fenced(Fenced::WrongState(State::Published))
    );

    // Lease ran out.
    let (row, rt) = reconciling();
    assert_eq!(
        decide_reconcile(&row, rt, &Lookup::Absent, REDELIVER, T0 + 3 + LEASE),
        ReconcileDecision::Fenced(Fenced::LeaseExpired {
            lease_until_ms: T0 + 3 + LEASE
        })
    );

    // Another reconciler holds a newer generation (snapshot after a takeover).
    let (mut row, rt) = reconciling();
    row.claim_generation += 1;
    row.claim = Some(sealpost_core::Claim {
        owner: 10,
        generation: row.claim_generation,
        lease_until_ms: T0 + 4 + LEASE,
    });
    let before = row.clone();
    let d = decide_reconcile(&row, rt, &Lookup::Absent, REDELIVER, T0 + 5);
    assert_eq!(
        d,
        ReconcileDecision::Fenced(Fenced::Superseded {
            current: Some(rt.generation + 1)
        })
    );
    apply_reconcile(&mut row, &d, T0 + 5).unwrap();
    assert_eq!(row, before);
}

#[test]
fn reconciler_lease_expiry_lets_another_reconciler_take_over() {
    let (mut row, rt) = reconciling();
    let lease_end = T0 + 3 + LEASE;
    assert_eq!(
        decide_reconcile_claim(&row, lease_end - 1, LEASE),
        ClaimDecision::Skip
    );
    let d = decide_reconcile_claim(&row, lease_end, LEASE);
    assert_eq!(
        d,
        ClaimDecision::Grant {
            next: State::Reconciling,
            generation: rt.generation + 1,
            lease_until_ms: lease_end + LEASE,
            superseding: true,
        }
    );
    // The grant the core decided must be applicable through the state table.
    let applied = apply_claim(&mut row, &d, 10, lease_end);
    assert!(
        applied.is_ok(),
        "takeover of an expired RECONCILING lease refused by the state table: {applied:?}"
    );
    let t10 = applied.unwrap().unwrap();
    assert_eq!(row.state, State::Reconciling);
    assert_eq!(row.claim.as_ref().unwrap().owner, 10);
    assert_eq!(
        decide_reconcile(&row, rt, &Lookup::Absent, REDELIVER, lease_end + 1),
        ReconcileDecision::Fenced(Fenced::Superseded {
            current: Some(t10.generation)
        })
    );
}

#[test]
fn late_ack_of_unknown_attempt_converges_even_if_the_retry_attempt_never_left() {
    // Attempt 1's outcome is unknown; the reconciler grants a redelivery; attempt 2 provably
    // never leaves the process. Attempt 1 may still have been stored: its late genuine ACK
    // must converge into the slot (R11, G2), not be dropped.
    let (mut row, rt) = reconciling();
    let d = decide_reconcile(&row, rt, &Lookup::Unqueryable, REDELIVER, T0 + 4);
    apply_reconcile(&mut row, &d, T0 + 4).unwrap();
    let t2 = claim(&mut row, 2, T0 + 5);
    begin(&mut row, t2, 2, T0 + 6);
    report(&mut row, t2, 2, SendOutcome::NeverSent, T0 + 7);
    assert_eq!(row.attempt(1).unwrap().status, AttemptStatus::Unknown);

    let state_before_ack = row.state;
    let late = ack(&row, 1, 30);
    let v = accept(&mut row, &late, T0 + 8);
    assert!(
        matches!(v, ReceiptVerdict::Primary | ReceiptVerdict::Duplicate(_)),
        "late genuine ACK of the still-UNKNOWN attempt 1 was {v:?} in state {state_before_ack}"
    );
    assert_eq!(row.primary, Some(late));
}

// ---------------------------------------------------------------------------------------
// Migration (R15)
// ---------------------------------------------------------------------------------------

#[test]
fn migration_granted_for_pending_row_whose_attempts_all_failed() {
    let (mut row, t) = sending();
    report(&mut row, t, 1, SendOutcome::Rejected, T0 + 2);
    let later = T0 + 2 + NEVER_SENT_BACKOFF_MS_MAX;
    let t2 = claim(&mut row, 1, later);
    begin(&mut row, t2, 2, later + 1);
    report(&mut row, t2, 2, SendOutcome::NeverSent, later + 2);
    assert_eq!(row.state, State::Pending);
    assert!(row
        .attempts
        .iter()
        .all(|a| a.status == AttemptStatus::Failed));

    let to = orders_eu();
    let grant = decide_migration(&row, &to).unwrap();
    assert_eq!(grant.envelope_generation, 2);
    assert_eq!(grant.from_digest, orders().digest());
    assert_eq!(grant.to_digest, to.digest());
    assert_eq!(grant.failed_attempts, 2);

    apply_migration(&mut row, &grant, to.clone()).unwrap();
    assert_eq!(row.state, State::Pending);
    assert_eq!(row.event_id, event_id(), "a migration keeps the event id");
    assert_eq!(row.envelope_generation, 2);
    assert_eq!(row.destination, to);
    assert_eq!(row.rejections, 0);
    assert_eq!(row.superseded.len(), 1);
    assert_eq!(row.superseded[0].destination_digest, orders().digest());
    assert_eq!(row.superseded[0].envelope_generation, 1);

    // Refusals on the migrated row and elsewhere.
    assert_eq!(
        decide_migration(&row, &to),
        Err(MigrationRefusal::SameDestination)
    );
    let mut c = pending();
    claim(&mut c, 1, T0);
    assert_eq!(
        decide_migration(&c, &to),
        Err(MigrationRefusal::Busy(State::Claimed))
    );
    assert_eq!(
        decide_migration(&published(1), &to),
        Err(MigrationRefusal::AlreadyPublished)
    );
}

// ---------------------------------------------------------------------------------------
// Purge (R20)
// ---------------------------------------------------------------------------------------

const WINDOW: RetentionPolicy = RetentionPolicy {
    replay_window_ms: 3_600_000,
    restore_point_ms: None,
};

#[test]
fn purge_refused_when_not_published() {
    let far = T0 + 100 * WINDOW.replay_window_ms;
    let none: [Watermark; 0] = [];
    let (s, _) = sending();
    let (r, _) = reconciling();
    for row in [pending(), s, unknown(), r] {
        assert_eq!(
            decide_purge(&row, far, WINDOW, &none),
            Err(PurgeRefusal::NotPublished(row.state))
        );
    }
    let mut purged = published(5);
    purged.state = State::Purged;
    assert_eq!(
        decide_purge(&purged, far, WINDOW, &none),
        Err(PurgeRefusal::NotPublished(State::Purged))
    );
}

#[test]
fn purge_refused_inside_replay_window_even_with_consumers_done() {
    let row = published(5);
    let done = [Watermark {
        consumer: 0,
        watermark: Some(1_000),
    }];
    let end = T0 + 2 + WINDOW.replay_window_ms;
    assert_eq!(
        decide_purge(&row, end - 1, WINDOW, &done),
        Err(PurgeRefusal::ReplayWindow { remaining_ms: 1 })
    );
    assert_eq!(
        decide_purge(&row, T0 + 2, WINDOW, &done),
        Err(PurgeRefusal::ReplayWindow {
            remaining_ms: WINDOW.replay_window_ms
        })
    );
}

#[test]
fn purge_refused_when_a_required_consumer_is_behind() {
    let row = published(5);
    let end = T0 + 2 + WINDOW.replay_window_ms;
    let behind = [
        Watermark {
            consumer: 0,
            watermark: Some(5),
        },
        Watermark {
            consumer: 1,
            watermark: Some(4),
        },
    ];
    assert_eq!(
        decide_purge(&row, end, WINDOW, &behind),
        Err(PurgeRefusal::ConsumerBehind {
            consumer: 1,
            position: 5,
            watermark: Some(4)
        })
    );
}

#[test]
fn purge_accepted_after_replay_window_and_every_watermark() {
    let row = published(5);
    let end = T0 + 2 + WINDOW.replay_window_ms;
    let done = [
        Watermark {
            consumer: 0,
            watermark: Some(5),
        },
        Watermark {
            consumer: 1,
            watermark: Some(9),
        },
    ];
    assert_eq!(decide_purge(&row, end, WINDOW, &done), Ok(()));
    let mut retained = row.clone();
    retained.state = State::Retained;
    assert_eq!(decide_purge(&retained, end, WINDOW, &done), Ok(()));
}

#[test]
fn poison_with_an_older_unknown_attempt_reaches_quarantine_and_the_late_ack_still_publishes() {
    // Attempt 1's outcome is unknown; the broker cannot be asked, so a retry is granted.
    let (mut row, t) = sending();
    report(&mut row, t, 1, SendOutcome::AckTimeout, T0 + 2);
    let late = ack(&row, 1, 7);
    let rt = reconcile_claim(&mut row, 9, T0 + 3);
    let d = decide_reconcile(&row, rt, &Lookup::Unqueryable, REDELIVER, T0 + 4);
    apply_reconcile(&mut row, &d, T0 + 4).unwrap();
    assert_eq!(row.state, State::RetryClaimed);
    // The retry is refused for the last time allowed: quarantine, not another round of
    // "back to unknown, retry, refused" forever.
    row.rejections = LIMIT - 1;
    let t2 = claim(&mut row, 2, T0 + 5);
    begin(&mut row, t2, 2, T0 + 6);
    assert_eq!(
        report(&mut row, t2, 2, SendOutcome::Rejected, T0 + 7),
        SendOutcomeDecision::ToQuarantine
    );
    assert_eq!(row.state, State::Quarantined);
    assert_eq!(row.attempt(1).unwrap().status, AttemptStatus::Unknown);
    // Attempt 1's genuine late ACK still fills the slot (R11).
    assert_eq!(accept(&mut row, &late, T0 + 8), ReceiptVerdict::Primary);
    assert_eq!(row.state, State::Published);
    // A receipt of the refused attempt never does.
    let mut row2 = row.clone();
    row2.state = State::Quarantined;
    row2.primary = None;
    assert!(matches!(
        decide_receipt(&row2, &ack(&row2, 2, 8)),
        ReceiptVerdict::Reject(_)
    ));
}

/// R29: on a per-aggregate-ordered destination a claim waits while an earlier event of the
/// aggregate is unresolved, and is granted once it is not; an unordered destination ignores
/// the fact; a `SENDING` row whose lease ran out still becomes unknown (bookkeeping, no send).
#[test]
fn an_ordered_claim_waits_for_the_earlier_event_of_its_aggregate() {
    use sealpost_core::claim::decide_dispatch_claim_with;
    use sealpost_core::envelope::EventOrdering;
    let mut p = policy(1, "ORDERS");
    p.ordering = EventOrdering::PerAggregate;
    let ordered = EventRow::new_pending(event_id(), 0, payload(), p.resolve(KEY));
    assert_eq!(
        decide_dispatch_claim_with(&ordered, true, T0, LEASE),
        ClaimDecision::Wait
    );
    assert!(matches!(
        decide_dispatch_claim_with(&ordered, false, T0, LEASE),
        ClaimDecision::Grant { .. }
    ));
    let unordered = pending();
    assert!(matches!(
        decide_dispatch_claim_with(&unordered, true, T0, LEASE),
        ClaimDecision::Grant { .. }
    ));
    // A waiting row is left untouched.
    let mut row = ordered.clone();
    assert_eq!(apply_claim(&mut row, &ClaimDecision::Wait, 1, T0), Ok(None));
    assert_eq!(row, ordered);
    // A SENDING row past its lease: the fact does not hold back the move to unknown.
    let mut sending = ordered.clone();
    let t = claim(&mut sending, 1, T0);
    let b = decide_begin_send(&sending, t, T0).unwrap();
    apply_begin_send(&mut sending, &b, t, 1, T0).unwrap();
    assert_eq!(
        decide_dispatch_claim_with(&sending, true, T0 + LEASE, LEASE),
        ClaimDecision::ExpireToUnknown
    );
    // A migration keeps the ordering: its successors wait on it.
    assert_eq!(
        decide_migration(&ordered, &orders_eu()),
        Err(MigrationRefusal::OrderingChanged)
    );
}

// ---------------------------------------------------------------------------------------
// Signed envelopes: a lookup's copy is judged by its seal before anything is decided on it
// (issue 23)
// ---------------------------------------------------------------------------------------

/// A reconciler at a broker that refuses a second copy (NATS create-if-absent).
const CREATE_IF_ABSENT: ReconcilePolicy = ReconcilePolicy {
    redeliver_when_unqueryable: false,
    create_if_absent: true,
};

/// A lookup's answer as the adapter reads it: the copy of `r` carrying `signature`.
fn copy_of(r: &Receipt, signature: Option<&str>) -> Lookup {
    Lookup::Copies(vec![read_copy(r, signature)])
}

fn read_copy(r: &Receipt, signature: Option<&str>) -> FoundCopy {
    FoundCopy::read(
        found(r),
        Some(WireEnvelope::default()),
        signature.map(str::to_string),
    )
}

fn header() -> String {
    SignatureHeader {
        key_id: "k-2026".into(),
        signature: [9; SIGNATURE_LEN],
    }
    .format()
}

#[test]
fn a_found_copy_is_adopted_only_once_its_seal_is_judged_valid() {
    let (mut row, rt) = reconciling();
    let r = ack(&row, 1, 9);
    let copy = copy_of(&r, Some(&header()));
    // Unjudged, nothing is decided on it: the row stays unknown.
    assert_eq!(
        decide_reconcile(&row, rt, &copy, CREATE_IF_ABSENT, T0 + 4),
        ReconcileDecision::StayUnknown
    );
    let judged = judge_copy(copy, SignaturePolicy::Require, |_, _, _| Crypto::Valid);
    assert_eq!(judged, Lookup::Found(found(&r)));
    let d = decide_reconcile(&row, rt, &judged, CREATE_IF_ABSENT, T0 + 4);
    assert_eq!(d, ReconcileDecision::Accept(found(&r)));
    assert_eq!(
        accept(&mut row, &found(&r), T0 + 4),
        ReceiptVerdict::Primary
    );
    assert_eq!(row.state, State::Published);
}

#[test]
fn an_unsealed_copy_at_a_create_if_absent_broker_parks_the_row_as_a_conflict() {
    // A forger published the event's copy first: the broker refuses the genuine one for
    // good, so only an operator can resolve it (remove the forgery, release the row).
    for (signature, crypto, refusal) in [
        (None, Crypto::Valid, SealRefusal::Unsigned),
        (
            Some(header()),
            Crypto::Invalid,
            SealRefusal::Invalid("k-2026".into()),
        ),
        (
            Some(header()),
            Crypto::UnknownKey,
            SealRefusal::UnknownKey("k-2026".into()),
        ),
    ] {
        let (mut row, rt) = reconciling();
        let r = ack(&row, 1, 9);
        let judged = judge_copy(
            copy_of(&r, signature.as_deref()),
            SignaturePolicy::Require,
            |_, _, _| crypto,
        );
        assert_eq!(
            judged,
            Lookup::Unsealed {
                receipt: found(&r),
                refusal
            }
        );
        let d = decide_reconcile(&row, rt, &judged, CREATE_IF_ABSENT, T0 + 4);
        assert_eq!(
            d,
            ReconcileDecision::Conflict(QuarantineReason::UnsealedCopy)
        );
        apply_reconcile(&mut row, &d, T0 + 4).unwrap();
        assert_eq!(row.state, State::Quarantined);
        assert_eq!(row.primary, None, "a forged copy is never adopted");
    }
}

#[test]
fn an_unsealed_copy_elsewhere_retries_to_the_same_destination() {
    let (mut row, rt) = reconciling();
    let r = ack(&row, 1, 9);
    let judged = judge_copy(copy_of(&r, None), SignaturePolicy::Require, |_, _, _| {
        Crypto::Valid
    });
    for policy in [NO_REDELIVER, REDELIVER] {
        let d = decide_reconcile(&row, rt, &judged, policy, T0 + 4);
        assert_eq!(
            d,
            ReconcileDecision::RetrySameDestination {
                destination_digest: orders().digest(),
                quarantine: None
            }
        );
    }
    let d = decide_reconcile(&row, rt, &judged, NO_REDELIVER, T0 + 4);
    apply_reconcile(&mut row, &d, T0 + 4).unwrap();
    assert_eq!(row.state, State::RetryClaimed);
    assert_eq!(row.destination_digest, orders().digest());
    assert_eq!(row.primary, None);
}

#[test]
fn a_replayed_signature_is_refused_under_require_and_admitted_only_without_keys() {
    let (row, _) = reconciling();
    let r = ack(&row, 1, 9);
    // The crypto says the genuine signature does not verify over this copy's facts.
    let under = |policy| {
        judge_copy(copy_of(&r, Some(&header())), policy, |_, _, _| {
            Crypto::Invalid
        })
    };
    assert!(matches!(
        under(SignaturePolicy::Require),
        Lookup::Unsealed { .. }
    ));
    assert!(matches!(
        under(SignaturePolicy::IfPresent),
        Lookup::Unsealed { .. }
    ));
    assert_eq!(under(SignaturePolicy::Off), Lookup::Found(found(&r)));
}

#[test]
fn verification_counts_an_unsealed_copy_missing_and_an_unjudged_one_unknown() {
    let (row, _) = reconciling();
    let r = ack(&row, 1, 9);
    let item = VerifyItem {
        event_id: row.event_id,
        member: row.member,
        destination: row.destination.clone(),
        sequence: 9,
    };
    let unsealed = judge_copy(copy_of(&r, None), SignaturePolicy::Require, |_, _, _| {
        Crypto::Valid
    });
    assert_eq!(decide_verify(&item, &unsealed), VerifyVerdict::Missing);
    assert_eq!(
        decide_verify(&item, &copy_of(&r, Some(&header()))),
        VerifyVerdict::Unknown
    );
    let sealed = judge_copy(
        copy_of(&r, Some(&header())),
        SignaturePolicy::Require,
        |_, _, _| Crypto::Valid,
    );
    assert_eq!(decide_verify(&item, &sealed), VerifyVerdict::Held);
}

#[test]
fn the_genuine_copy_is_adopted_wherever_forgeries_stand_beside_it() {
    // A forger may publish look-alikes before the genuine copy (Kafka: nothing refuses a
    // second copy) or after it (NATS: a publish without the expected-sequence header): the
    // reader judges every copy the lookup read and adopts the sealed one, wherever it is.
    let (row, rt) = reconciling();
    let genuine = ack(&row, 1, 9);
    let forged = |seq| ack(&row, 1, seq);
    let forged_header = SignatureHeader {
        key_id: "k-2026".into(),
        signature: [4; SIGNATURE_LEN],
    }
    .format();
    let verify = |_: &str, sig: &[u8; SIGNATURE_LEN], _: &Digest| {
        if sig == &[9; SIGNATURE_LEN] {
            Crypto::Valid
        } else {
            Crypto::Invalid
        }
    };
    for order in [[0, 1, 2], [1, 0, 2], [1, 2, 0]] {
        let copies: Vec<FoundCopy> = order
            .iter()
            .map(|&i| match i {
                0 => read_copy(&genuine, Some(&header())),
                1 => read_copy(&forged(7), None),
                _ => read_copy(&forged(11), Some(&forged_header)),
            })
            .collect();
        let judged = judge_copy(Lookup::Copies(copies), SignaturePolicy::Require, verify);
        assert_eq!(judged, Lookup::Found(found(&genuine)), "order {order:?}");
        assert_eq!(
            decide_reconcile(&row, rt, &judged, CREATE_IF_ABSENT, T0 + 4),
            ReconcileDecision::Accept(found(&genuine))
        );
    }
    // Only forgeries: the oldest one is reported with its refusal (the copy that holds the
    // subject at a create-if-absent broker).
    let judged = judge_copy(
        Lookup::Copies(vec![
            read_copy(&forged(7), None),
            read_copy(&forged(11), Some(&forged_header)),
        ]),
        SignaturePolicy::Require,
        verify,
    );
    assert_eq!(
        judged,
        Lookup::Unsealed {
            receipt: found(&forged(7)),
            refusal: SealRefusal::Unsigned
        }
    );
    // An adapter that found nothing must say Absent or Unavailable; an empty list is no
    // proof of anything.
    assert_eq!(
        judge_copy(Lookup::Copies(vec![]), SignaturePolicy::Off, verify),
        Lookup::Unavailable
    );
}

#[test]
fn a_duplicate_acknowledgement_is_a_receipt_only_for_this_very_message() {
    let (row, _) = reconciling();
    let request = sealpost_core::port::SendRequest {
        event_id: row.event_id,
        member: row.member,
        envelope_generation: 1,
        attempt_id: 1,
        payload_digest: Digest([1; 32]),
        destination: orders(),
        destination_digest: orders().digest(),
        payload: b"{}".to_vec(),
        envelope: WireEnvelope {
            event_type: "order.created.v1".into(),
            ..WireEnvelope::default()
        },
        signature: Some(header()),
    };
    let stored = |r: &sealpost_core::port::SendRequest, signature: Option<String>| {
        FoundCopy::read(
            Receipt {
                event_id: r.event_id,
                member: r.member,
                envelope_generation: r.envelope_generation,
                attempt_id: 7,
                payload_digest: r.payload_digest,
                destination_digest: r.destination_digest,
                cluster: "c".into(),
                stream: "s".into(),
                partition: None,
                sequence: 3,
                broker_duplicate: false,
                source: ReceiptSource::Lookup,
            },
            Some(r.envelope.clone()),
            signature,
        )
    };
    let this = |copy: &FoundCopy| {
        is_this_message(
            &SignedClaim::of_request(&request),
            request.signature.as_deref(),
            copy,
        )
    };
    // An earlier attempt of the same message (another attempt id, same facts and seal).
    assert!(this(&stored(&request, Some(header()))));
    // A forger's look-alike: no seal, another seal, another payload, another event type.
    assert!(!this(&stored(&request, None)));
    let other_seal = SignatureHeader {
        key_id: "k-2026".into(),
        signature: [4; SIGNATURE_LEN],
    }
    .format();
    assert!(!this(&stored(&request, Some(other_seal))));
    let mut other = request.clone();
    other.payload_digest = Digest([2; 32]);
    assert!(!this(&stored(&other, Some(header()))));
    let mut other = request.clone();
    other.envelope.event_type = "order.cancelled.v1".into();
    assert!(!this(&stored(&other, Some(header()))));
    // A copy whose headers are too incomplete to rebuild a claim is never this message.
    let mut bare = stored(&request, Some(header()));
    bare.seal.claim = None;
    assert!(!this(&bare));
}
