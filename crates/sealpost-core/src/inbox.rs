//! The consumer inbox decision (R17–R18): `(consumer_id, event_id)` is recorded in the same
//! transaction as the consumer's own state change; the broker position is committed only
//! after that transaction.

use crate::encoding::{Canonical, Digest};
use crate::envelope::EventId;
use crate::signature::{decide_seal, Presented, SealRefusal, SignaturePolicy};

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
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DeliveryRefusal {
    /// The payload's digest is not the one its headers carry: altered on the way, or forged.
    #[error("payload does not match its digest header")]
    DigestHeaderMismatch,
    /// The message's signature is refused under the consumer's policy: forged, replayed
    /// under other facts, unsigned where a signature is required, or signed by a key the
    /// consumer does not hold.
    #[error("{0}")]
    Unsealed(SealRefusal),
}

/// Checks a delivered message before its effect: the payload against the digest its headers
/// claim, then what its signature presents ([`crate::signature::present`], over the claim
/// rebuilt from the headers and the digest of the bytes received) under the consumer's
/// policy. A refusal is recorded in the consumer's quarantine and never applied (R12, R17).
pub fn decide_delivery(
    claimed_digest: Digest,
    payload_digest: Digest,
    policy: SignaturePolicy,
    presented: &Presented,
) -> Result<(), DeliveryRefusal> {
    if claimed_digest != payload_digest {
        return Err(DeliveryRefusal::DigestHeaderMismatch);
    }
    decide_seal(policy, presented).map_err(DeliveryRefusal::Unsealed)
}

/// A consumer's limits for a message it cannot apply: how many deliveries it gets and how
/// long the broker waits before each redelivery. Every failure window has a retry limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RedeliveryPolicy {
    /// Deliveries of one message before it is dead-lettered (at least 1).
    pub max_deliveries: u32,
    /// Delay before the second delivery; doubles with each further one.
    pub backoff_first_ms: u64,
    /// Upper bound of the delay.
    pub backoff_max_ms: u64,
}

impl Default for RedeliveryPolicy {
    fn default() -> Self {
        RedeliveryPolicy {
            max_deliveries: 10,
            backoff_first_ms: 100,
            backoff_max_ms: 30_000,
        }
    }
}

/// What failed while a delivered message was being processed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The message's own effect (or inbox row) failed or timed out and was rolled back alone;
    /// the consumer's database answered, so a dead letter can be recorded.
    Message,
    /// The whole inbox transaction failed (database unreachable, commit failed): nothing was
    /// recorded and the message is not to blame.
    Transaction,
}

/// What the consumer does with a message it could not apply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailedDelivery {
    /// Send it back; the broker redelivers it after `delay_ms`.
    Retry {
        /// Delay before the redelivery.
        delay_ms: u64,
    },
    /// Record it in the consumer's quarantine (the dead letter, with the reason and the
    /// message's stream position), then tell the broker never to redeliver it.
    DeadLetter,
}

/// Decides the fate of a message whose processing failed on its `delivered`-th delivery
/// (1 = first). A message that failed on its own is dead-lettered at the policy's limit; a
/// failed transaction never dead-letters (the dead letter could not be written, and the
/// message is not the cause): it is retried with the same growing delay.
pub fn decide_failed_delivery(
    delivered: u64,
    failure: Failure,
    policy: RedeliveryPolicy,
) -> FailedDelivery {
    if failure == Failure::Message && delivered >= u64::from(policy.max_deliveries.max(1)) {
        return FailedDelivery::DeadLetter;
    }
    let doublings = delivered.saturating_sub(1).min(32) as u32;
    let delay_ms = policy
        .backoff_first_ms
        .saturating_mul(1u64 << doublings)
        .min(policy.backoff_max_ms);
    FailedDelivery::Retry { delay_ms }
}

/// Decides the fate of a message whose Sealpost headers are missing or do not parse: no
/// redelivery can fix its headers, so it is dead-lettered at once (recorded with what is
/// wrong, never dropped silently).
pub fn decide_unreadable_delivery() -> FailedDelivery {
    FailedDelivery::DeadLetter
}

/// What an ordered consumer does with an event of a per-aggregate-ordered destination
/// (R29, consumer side), given the aggregate's version it applied last.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApplyOrder {
    /// The next version (or an older one, which the inbox settles as a duplicate): apply.
    Apply,
    /// A gap: an earlier version has not been applied yet (a redelivery overtook it). Do not
    /// apply and do not acknowledge; it is delivered again after the earlier one.
    Hold,
}

/// The ordered consumer's gap rule: versions of one aggregate are applied `1, 2, 3, ...`.
/// `last_applied` is the highest version up to which *every* version of the aggregate was
/// applied (the contiguous prefix, `None` before version 1), not the highest applied: an
/// unordered version (sent before a route turned ordering on) may have arrived early. It relies on the producer numbering an
/// aggregate's versions without holes from 1, which the `aggregate_version` header lets the
/// consumer check; an aggregate whose history began before Sealpost is seeded with its last
/// version by the consumer's owner.
pub fn decide_apply_order(last_applied: Option<u64>, version: u64) -> ApplyOrder {
    if version > last_applied.unwrap_or(0) + 1 {
        ApplyOrder::Hold
    } else {
        ApplyOrder::Apply
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
    fn failed_deliveries_back_off_then_dead_letter() {
        let p = RedeliveryPolicy {
            max_deliveries: 4,
            backoff_first_ms: 100,
            backoff_max_ms: 250,
        };
        let m = Failure::Message;
        assert_eq!(
            decide_failed_delivery(1, m, p),
            FailedDelivery::Retry { delay_ms: 100 }
        );
        assert_eq!(
            decide_failed_delivery(2, m, p),
            FailedDelivery::Retry { delay_ms: 200 }
        );
        assert_eq!(
            decide_failed_delivery(3, m, p),
            FailedDelivery::Retry { delay_ms: 250 }
        );
        assert_eq!(decide_failed_delivery(4, m, p), FailedDelivery::DeadLetter);
        assert_eq!(decide_failed_delivery(40, m, p), FailedDelivery::DeadLetter);
        // A failed transaction is never the message's fault: retried, however often.
        assert_eq!(
            decide_failed_delivery(40, Failure::Transaction, p),
            FailedDelivery::Retry { delay_ms: 250 }
        );
        assert_ne!(
            decide_failed_delivery(u64::MAX, Failure::Transaction, p),
            FailedDelivery::DeadLetter
        );
        // A limit of 0 means one delivery, never "retry forever".
        let zero = RedeliveryPolicy {
            max_deliveries: 0,
            ..p
        };
        assert_eq!(
            decide_failed_delivery(1, m, zero),
            FailedDelivery::DeadLetter
        );
        assert_eq!(decide_unreadable_delivery(), FailedDelivery::DeadLetter);
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
