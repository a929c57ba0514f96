//! The sole acceptance point (R10–R12): the decision of `acceptDispatchReceipt`. The store
//! runs it inside one transaction holding the event row's lock; nothing else may fill the
//! publish slot or set `PUBLISHED`.

use crate::encoding::Digest;
use crate::envelope::EventId;
use crate::row::{AttemptStatus, EventRow};
use crate::state::{transition, State, TransitionError};

/// How a receipt reached the acceptance point.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReceiptSource {
    /// The broker's publish acknowledgement, reported by the sender.
    Ack,
    /// The reconciler found the message at the frozen destination (R13).
    Lookup,
}

/// A broker receipt, as reported to the acceptance point.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Receipt {
    /// Event id carried by the stored message.
    pub event_id: EventId,
    /// Delivery-set member (0 for plain events).
    pub member: u16,
    /// Envelope generation carried by the message.
    pub envelope_generation: u32,
    /// Attempt id carried by the message headers.
    pub attempt_id: u64,
    /// Payload digest carried by the message.
    pub payload_digest: Digest,
    /// Destination digest carried by the message.
    pub destination_digest: Digest,
    /// Cluster that acknowledged.
    pub cluster: String,
    /// Stream or topic that stored it.
    pub stream: String,
    /// Partition, for partitioned brokers.
    pub partition: Option<u32>,
    /// Broker position (JetStream stream sequence, Kafka offset). 0 is never a position.
    pub sequence: u64,
    /// The broker reported this as a duplicate of an earlier publish (NATS `duplicate`).
    pub broker_duplicate: bool,
    /// Where the receipt came from.
    pub source: ReceiptSource,
}

/// Why a receipt was quarantined: it contradicts the sealed envelope under the same id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuarantineReason {
    /// Payload digest differs from the sealed one.
    PayloadDigestMismatch,
    /// Destination digest differs from the attempt's frozen one.
    DestinationDigestMismatch,
    /// Broker coordinates (cluster/stream/partition) differ from the frozen destination.
    ReceiptOutsideDestination,
    /// A receipt from a destination that a migration declared "not accepted" (R15): the
    /// absence proof was wrong. Alert.
    MigrationConflict,
    /// A copy at a broker that refuses a second one (create-if-absent), found by a lookup,
    /// that the store cannot adopt: an attempt it never registered, or one of another
    /// envelope generation (a restore from a backup followed by a migration of the row,
    /// say). No retry can replace it; an operator decides.
    UnadoptableCopy,
    /// A copy at a broker that refuses a second one, found by a lookup, whose signature the
    /// reconciler refused ([`crate::signature::decide_seal`]): a forgery holds the event's
    /// place. An operator removes it, then releases the row.
    UnsealedCopy,
}

/// Why a receipt was rejected (audited, not an error of the event).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RejectReason {
    /// The receipt names another event.
    WrongEvent,
    /// No broker position (e.g. a NATS duplicate ack with sequence 0): not proof of anything.
    NoPosition,
    /// The attempt id was never registered (possible forgery or a bug).
    UnregisteredAttempt,
    /// The receipt's envelope generation is not the attempt's.
    EnvelopeGenerationMismatch,
    /// The row is not in a state that has an attempt in flight (e.g. `PENDING`, `PURGED`).
    NotInFlight(State),
}

/// How a duplicate transport receipt relates to the primary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DuplicateKind {
    /// Same broker position as the primary (the broker deduplicated the publish).
    SamePosition,
    /// A second stored copy at another position; consumers' inboxes absorb it. A finding.
    SecondCopy,
}

/// The verdict of the acceptance point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReceiptVerdict {
    /// Fill the empty slot with this receipt and set `PUBLISHED`.
    Primary,
    /// The slot is taken: keep as a duplicate transport receipt.
    Duplicate(DuplicateKind),
    /// Contradicts the sealed envelope: quarantine the receipt, leave the slot untouched.
    Quarantine(QuarantineReason),
    /// Not a valid receipt for this row: audit it.
    Reject(RejectReason),
}

/// `acceptDispatchReceipt`'s decision. It does not look at the current claim: a late,
/// genuine ACK from an expired attempt competes for the same slot (R11).
pub fn decide_receipt(row: &EventRow, r: &Receipt) -> ReceiptVerdict {
    use ReceiptVerdict::{Duplicate, Primary, Quarantine, Reject};
    if r.event_id != row.event_id || r.member != row.member {
        return Reject(RejectReason::WrongEvent);
    }
    if row.state == State::Purged {
        // The evidence is gone by design (R20); nothing may be written to a purged row.
        return Reject(RejectReason::NotInFlight(State::Purged));
    }
    if r.payload_digest != row.payload_digest {
        return Quarantine(QuarantineReason::PayloadDigestMismatch);
    }
    if row
        .superseded
        .iter()
        .any(|s| s.destination_digest == r.destination_digest)
    {
        return Quarantine(QuarantineReason::MigrationConflict);
    }
    let Some(attempt) = row.attempt(r.attempt_id) else {
        if r.destination_digest != row.destination_digest {
            return Quarantine(QuarantineReason::DestinationDigestMismatch);
        }
        if adoptable(row, r) {
            // A copy the broker itself holds, found by the reconciler's lookup, whose event
            // id, payload digest, destination digest, envelope generation and coordinates
            // all match the sealed envelope, but whose attempt this database never saw (it
            // was restored from a backup taken before the send). The copy *is* the
            // publication: it fills the slot instead of being sent a second time.
            return adopt(row);
        }
        return Reject(RejectReason::UnregisteredAttempt);
    };
    if r.destination_digest != attempt.destination_digest
        || r.destination_digest != row.destination_digest
    {
        return Quarantine(QuarantineReason::DestinationDigestMismatch);
    }
    if r.envelope_generation != attempt.envelope_generation {
        return Reject(RejectReason::EnvelopeGenerationMismatch);
    }
    if r.cluster != row.destination.cluster
        || r.stream != row.destination.topic
        || r.partition != row.destination.partition()
    {
        return Quarantine(QuarantineReason::ReceiptOutsideDestination);
    }
    if r.sequence == 0 {
        return Reject(RejectReason::NoPosition);
    }
    if attempt.status == AttemptStatus::Failed && adoptable(row, r) {
        // The broker holds a copy under an attempt id this store recorded as "not stored".
        // After a restore, attempt ids restart from the backup and can name a later,
        // different attempt; the broker's own answer is the better evidence, and the row is
        // still waiting for an outcome.
        return adopt(row);
    }
    if attempt.status == AttemptStatus::Failed {
        // We declared this attempt "provably not stored"; a receipt says otherwise. The
        // row may already have re-entered the main path, so the receipt is not accepted
        // here; it is audited for an operator.
        return Reject(RejectReason::NotInFlight(row.state));
    }
    match (&row.primary, row.state) {
        (Some(p), _) => {
            if p.stream == r.stream && p.partition == r.partition && p.sequence == r.sequence {
                Duplicate(DuplicateKind::SamePosition)
            } else {
                Duplicate(DuplicateKind::SecondCopy)
            }
        }
        (
            None,
            State::Sending | State::DispatchUnknown | State::Reconciling | State::RetryClaimed,
        ) => Primary,
        // Quarantined as poison while an older attempt was still unknown: that attempt's
        // genuine late ACK is the publication (R11; the attempt is registered and not failed).
        (None, State::Quarantined) if attempt.status == AttemptStatus::Unknown => Primary,
        (None, s) => Reject(RejectReason::NotInFlight(s)),
    }
}

/// The verdict for an adopted copy: the slot if it is empty (a copy found by lookup is the
/// publication), else a duplicate.
fn adopt(row: &EventRow) -> ReceiptVerdict {
    match row.primary {
        // A copy adopted while the slot is filled is a second copy, a finding.
        Some(_) => ReceiptVerdict::Duplicate(DuplicateKind::SecondCopy),
        None => ReceiptVerdict::Primary,
    }
}

/// The evidence that lets a copy from an attempt the store never registered fill the slot:
/// it was read from the broker by a lookup (not reported by a sender, who could forge it),
/// and everything sealed matches: event id and member (checked by the caller), payload and
/// destination digests, envelope generation, the broker coordinates of the frozen
/// destination, and a real position; and the row is waiting for exactly this answer.
pub fn adoptable(row: &EventRow, r: &Receipt) -> bool {
    r.source == ReceiptSource::Lookup
        && r.payload_digest == row.payload_digest
        && r.destination_digest == row.destination_digest
        && r.envelope_generation == row.envelope_generation
        && r.cluster == row.destination.cluster
        && r.stream == row.destination.topic
        && r.partition == row.destination.partition()
        && r.sequence != 0
        && matches!(
            row.state,
            State::Sending | State::DispatchUnknown | State::Reconciling | State::RetryClaimed
        )
}

/// Applies a verdict to the in-memory row (the simulator's persistence; the Postgres store
/// writes the same changes in SQL). Quarantine and reject change nothing on the row.
pub fn apply_receipt(
    row: &mut EventRow,
    r: &Receipt,
    verdict: ReceiptVerdict,
    now_ms: u64,
) -> Result<(), TransitionError> {
    match verdict {
        ReceiptVerdict::Primary => {
            row.state = transition(row.state, State::Published)?;
            row.primary = Some(r.clone());
            row.claim = None;
            row.published_at_ms = Some(now_ms);
            row.unknown_since_ms = None;
            row.pacing = crate::row::Pacing::default();
            if let Some(a) = row.attempt_mut(r.attempt_id) {
                a.status = AttemptStatus::Acked;
            }
        }
        ReceiptVerdict::Duplicate(_) => {
            if let Some(a) = row.attempt_mut(r.attempt_id) {
                a.status = AttemptStatus::Acked;
            }
        }
        ReceiptVerdict::Quarantine(_) | ReceiptVerdict::Reject(_) => {}
    }
    Ok(())
}
