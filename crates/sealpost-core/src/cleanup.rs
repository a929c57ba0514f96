//! Retention and purge (R20). Evidence is removed only after the maximum replay window
//! **and** every required consumer's watermark has passed the event's broker position. An
//! ACK alone is never a reason to delete the only evidence.

use crate::row::EventRow;
use crate::state::State;

/// Retention policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetentionPolicy {
    /// Maximum replay window after publication, in milliseconds.
    pub replay_window_ms: u64,
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

/// Decides whether a row may be purged now. Consumers are checked before the replay window,
/// so a `ReplayWindow` refusal means every required consumer has passed the event (the
/// row may move to `RETAINED`).
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
    Ok(())
}

/// What retention does with one row now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetentionDecision {
    /// Past the replay window and every required consumer: `-> PURGED`.
    Purge,
    /// Every required consumer passed it but the replay window is open: `PUBLISHED ->
    /// RETAINED`.
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
        Err(PurgeRefusal::ReplayWindow { .. }) if row.state == State::Published => {
            RetentionDecision::Retain
        }
        Err(r) => RetentionDecision::Keep(r),
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
