//! Retention and purge (R20, R34). A row's payload is removed only after the maximum replay
//! window, every required consumer's watermark having passed the event's broker position,
//! **and** the restore point (the oldest backup anyone may restore from: an event published
//! after it may have to be replayed to a restored consumer). An ACK alone is never a reason
//! to delete the only evidence. The tombstone a purge leaves goes after the replay window;
//! audit evidence (earlier attempts, duplicate receipts, quarantine and audit rows) has its
//! own, longer retention and never goes while its event is still live.

use crate::row::EventRow;
use crate::state::State;

/// Retention policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetentionPolicy {
    /// Maximum replay window after publication, in milliseconds.
    pub replay_window_ms: u64,
    /// Time of the oldest backup one may restore from (database clock, ms): rows published
    /// at or after it are kept. `None`: the operator declared no restore objective.
    pub restore_point_ms: Option<u64>,
}

/// A required consumer's progress on the event's destination: every position up to and
/// including `watermark` has been consumed (`None`: nothing yet).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Watermark {
    /// Consumer index in the caller's list of required consumers.
    pub consumer: u32,
    /// Highest contiguous consumed position on the destination.
    pub watermark: Option<u64>,
}

/// Why a purge was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PurgeRefusal {
    /// Not published: the row is the only evidence of an undelivered fact.
    #[error("the event is {0}, not published: its row is the only evidence of the fact")]
    NotPublished(State),
    /// Inside the replay window.
    #[error("inside the replay window for another {remaining_ms} ms")]
    ReplayWindow {
        /// Time left.
        remaining_ms: u64,
    },
    /// Published at or after the oldest backup one may restore from.
    #[error("published at {published_at_ms}, not before the restore point {restore_point_ms}: a consumer restored from that backup may need it replayed")]
    RestorePoint {
        /// When the event was published.
        published_at_ms: u64,
        /// The restore point.
        restore_point_ms: u64,
    },
    /// Created at or after the oldest transaction a CDC publisher has not confirmed to its
    /// slot (R20, R32): cleanup never runs ahead of the CDC position.
    #[error("created at {created_at_ms}, not before the CDC publisher's hold {hold_from_ms}: its slot has not confirmed it")]
    CdcPosition {
        /// When the row was created.
        created_at_ms: u64,
        /// The oldest unconfirmed commit, less the margin for long transactions.
        hold_from_ms: u64,
    },
    /// A required consumer has not passed the event's position.
    #[error("required consumer #{consumer} has not passed position {position} (watermark {watermark:?})")]
    ConsumerBehind {
        /// Which consumer.
        consumer: u32,
        /// The event's broker position.
        position: u64,
        /// The consumer's watermark.
        watermark: Option<u64>,
    },
}

/// Decides whether a row may be purged now. Consumers are checked before the replay window
/// and the restore point, so a `ReplayWindow` or `RestorePoint` refusal means every required
/// consumer has passed the event (the row may move to `RETAINED`).
pub fn decide_purge(
    row: &EventRow,
    now_ms: u64,
    policy: RetentionPolicy,
    required: &[Watermark],
) -> Result<(), PurgeRefusal> {
    let (Some(primary), Some(published_at)) = (&row.primary, row.published_at_ms) else {
        return Err(PurgeRefusal::NotPublished(row.state));
    };
    if !matches!(row.state, State::Published | State::Retained) {
        return Err(PurgeRefusal::NotPublished(row.state));
    }
    for w in required {
        if w.watermark.is_none_or(|m| m < primary.sequence) {
            return Err(PurgeRefusal::ConsumerBehind {
                consumer: w.consumer,
                position: primary.sequence,
                watermark: w.watermark,
            });
        }
    }
    let until = published_at + policy.replay_window_ms;
    if now_ms < until {
        return Err(PurgeRefusal::ReplayWindow {
            remaining_ms: until - now_ms,
        });
    }
    if let Some(restore_point_ms) = policy.restore_point_ms {
        if published_at >= restore_point_ms {
            return Err(PurgeRefusal::RestorePoint {
                published_at_ms: published_at,
                restore_point_ms,
            });
        }
    }
    Ok(())
}

/// What retention does with one row now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetentionDecision {
    /// Past the replay window and every required consumer: `-> PURGED`.
    Purge,
    /// Every required consumer passed it but the replay window is open or it is newer than
    /// the restore point: `PUBLISHED -> RETAINED`.
    Retain,
    /// Leave it as it is, for this reason.
    Keep(PurgeRefusal),
}

/// Decides retention for one row ([`decide_purge`], plus the `RETAINED` step).
pub fn decide_retention(
    row: &EventRow,
    now_ms: u64,
    policy: RetentionPolicy,
    required: &[Watermark],
) -> RetentionDecision {
    match decide_purge(row, now_ms, policy, required) {
        Ok(()) => RetentionDecision::Purge,
        Err(PurgeRefusal::ReplayWindow { .. } | PurgeRefusal::RestorePoint { .. })
            if row.state == State::Published =>
        {
            RetentionDecision::Retain
        }
        Err(r) => RetentionDecision::Keep(r),
    }
}

/// Holds a purge back while a CDC publisher has not confirmed the row's transaction
/// (`hold_from_ms`: the lowest hold of `sealpost.cdc_progress`, `None` without a CDC
/// publisher): a row created at or after the hold stays, whatever else allowed its purge.
pub fn hold_for_cdc(
    decision: RetentionDecision,
    created_at_ms: u64,
    hold_from_ms: Option<u64>,
) -> RetentionDecision {
    match (decision, hold_from_ms) {
        (RetentionDecision::Purge, Some(hold_from_ms)) if created_at_ms >= hold_from_ms => {
            RetentionDecision::Keep(PurgeRefusal::CdcPosition {
                created_at_ms,
                hold_from_ms,
            })
        }
        (d, _) => d,
    }
}

/// Applies a retention decision through the state table (`PUBLISHED -> RETAINED`,
/// `PUBLISHED | RETAINED -> PURGED`); the store writes the resulting state.
pub fn apply_retention(
    row: &mut EventRow,
    decision: RetentionDecision,
) -> Result<(), crate::state::TransitionError> {
    let to = match decision {
        RetentionDecision::Purge => State::Purged,
        RetentionDecision::Retain => State::Retained,
        RetentionDecision::Keep(_) => return Ok(()),
    };
    row.state = crate::state::transition(row.state, to)?;
    Ok(())
}

/// Why a tombstone (a `PURGED` row: id, digests and primary position) stays.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TombstoneRefusal {
    /// Not purged: the row is no tombstone.
    #[error("the event is {0}, not purged")]
    NotPurged(State),
    /// Purged too recently: a late ACK or a replay inside the window must still meet it.
    #[error("purged {age_ms} ms ago, inside the replay window")]
    ReplayWindow {
        /// Time since the purge.
        age_ms: u64,
    },
}

/// Decides whether a purged row's tombstone may be deleted: once the replay window has
/// passed since the purge. (Until then a late ACK meets the tombstone and is rejected; after
/// it, the store answers "unknown event", which never resurrects the row either.)
pub fn decide_tombstone_removal(
    state: State,
    purged_at_ms: u64,
    now_ms: u64,
    policy: RetentionPolicy,
) -> Result<(), TombstoneRefusal> {
    if state != State::Purged {
        return Err(TombstoneRefusal::NotPurged(state));
    }
    let age_ms = now_ms.saturating_sub(purged_at_ms);
    if age_ms < policy.replay_window_ms {
        return Err(TombstoneRefusal::ReplayWindow { age_ms });
    }
    Ok(())
}

/// Why a piece of audit evidence (an earlier attempt, a duplicate receipt, a quarantine, audit
/// or finding row, a consumer's dead letter) stays.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EvidenceRefusal {
    /// Its event is still live (not purged): the evidence explains a row someone may act on.
    #[error("its event is {0}: evidence of a live event stays")]
    EventLive(State),
    /// Younger than the audit retention.
    #[error("inside the audit retention for another {remaining_ms} ms")]
    AuditRetention {
        /// Time left.
        remaining_ms: u64,
    },
}

/// Decides whether one piece of audit evidence written at `at_ms` may be deleted: it must be
/// older than `audit_retention_ms`, and its event (if it has one) must be purged or gone
/// (`event_state` `None`: no such row any more, or evidence of no event).
pub fn decide_evidence_removal(
    event_state: Option<State>,
    at_ms: u64,
    now_ms: u64,
    audit_retention_ms: u64,
) -> Result<(), EvidenceRefusal> {
    if let Some(s) = event_state {
        if s != State::Purged {
            return Err(EvidenceRefusal::EventLive(s));
        }
    }
    let until = at_ms.saturating_add(audit_retention_ms);
    if now_ms < until {
        return Err(EvidenceRefusal::AuditRetention {
            remaining_ms: until - now_ms,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tombstones_go_after_the_replay_window_only() {
        let p = RetentionPolicy {
            replay_window_ms: 1_000,
            restore_point_ms: None,
        };
        assert_eq!(
            decide_tombstone_removal(State::Published, 0, 10_000, p),
            Err(TombstoneRefusal::NotPurged(State::Published))
        );
        assert_eq!(
            decide_tombstone_removal(State::Purged, 9_500, 10_000, p),
            Err(TombstoneRefusal::ReplayWindow { age_ms: 500 })
        );
        assert_eq!(
            decide_tombstone_removal(State::Purged, 9_000, 10_000, p),
            Ok(())
        );
    }

    #[test]
    fn evidence_of_live_events_stays_and_the_rest_waits_for_the_audit_retention() {
        assert_eq!(
            decide_evidence_removal(Some(State::Quarantined), 0, 1_000_000, 10),
            Err(EvidenceRefusal::EventLive(State::Quarantined))
        );
        assert_eq!(
            decide_evidence_removal(Some(State::Purged), 100, 105, 10),
            Err(EvidenceRefusal::AuditRetention { remaining_ms: 5 })
        );
        assert_eq!(
            decide_evidence_removal(Some(State::Purged), 100, 110, 10),
            Ok(())
        );
        assert_eq!(decide_evidence_removal(None, 100, 110, 10), Ok(()));
        assert!(decide_evidence_removal(None, 100, 109, 10).is_err());
    }
}
