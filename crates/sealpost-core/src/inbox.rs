//! The consumer inbox decision (R17–R18): `(consumer_id, event_id)` is recorded in the same
//! transaction as the consumer's own state change; the broker position is committed only
//! after that transaction.

use crate::encoding::{Canonical, Digest};
use crate::envelope::EventId;

/// What the consumer's store already holds for `(consumer_id, event_id)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InboxRecord {
    /// Payload digest that was applied.
    pub payload_digest: Digest,
    /// The original consumption receipt id.
    pub receipt_id: u64,
}

/// Verdict for one delivered message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InboxDecision {
    /// First delivery: apply the effect and insert the inbox row in one transaction.
    Apply,
    /// Seen before: return the original receipt, no second effect.
    Duplicate {
        /// The original consumption receipt.
        receipt_id: u64,
    },
    /// A different payload under a known event id: quarantine, never apply.
    Quarantine,
}

/// Decides what a delivered message does.
pub fn decide_inbox(existing: Option<InboxRecord>, payload_digest: Digest) -> InboxDecision {
    match existing {
        None => InboxDecision::Apply,
        Some(rec) if rec.payload_digest == payload_digest => InboxDecision::Duplicate {
            receipt_id: rec.receipt_id,
        },
        Some(_) => InboxDecision::Quarantine,
    }
}

/// Why a delivery is refused before the inbox is consulted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DeliveryRefusal {
    /// The payload's digest is not the one its headers carry: altered on the way, or forged.
    #[error("payload does not match its digest header")]
    DigestHeaderMismatch,
}

/// Checks a delivered message against the digest its headers claim. A mismatch is recorded
/// in the consumer's quarantine and never applied (R12, R17).
pub fn decide_delivery(
    claimed_digest: Digest,
    payload_digest: Digest,
) -> Result<(), DeliveryRefusal> {
    if claimed_digest == payload_digest {
        Ok(())
    } else {
        Err(DeliveryRefusal::DigestHeaderMismatch)
    }
}

/// A stable idempotency key for an external effect (mail, payment) derived from the event
/// id, the consumer and the effect's name (R18). Every redelivery derives the same key.
pub fn idempotency_key(event_id: EventId, consumer_id: &str, effect: &str) -> String {
    let d = Canonical::new("sealpost.idempotency.v1")
        .bytes(1, &event_id.0)
        .str(2, consumer_id)
        .str(3, effect)
        .finish();
    format!("sp1-{}", &d.to_hex()[..32])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decisions() {
        let a = Digest([1; 32]);
        let b = Digest([2; 32]);
        assert_eq!(decide_inbox(None, a), InboxDecision::Apply);
        let rec = InboxRecord {
            payload_digest: a,
            receipt_id: 7,
        };
        assert_eq!(
            decide_inbox(Some(rec), a),
            InboxDecision::Duplicate { receipt_id: 7 }
        );
        assert_eq!(decide_inbox(Some(rec), b), InboxDecision::Quarantine);
    }

    #[test]
    fn idempotency_key_is_stable_and_distinct() {
        let e = EventId([3; 16]);
        assert_eq!(
            idempotency_key(e, "billing", "charge"),
            idempotency_key(e, "billing", "charge")
        );
        assert_ne!(
            idempotency_key(e, "billing", "charge"),
            idempotency_key(e, "mail", "charge")
        );
        assert_ne!(
            idempotency_key(e, "billing", "charge"),
            idempotency_key(EventId([4; 16]), "billing", "charge")
        );
    }
}
