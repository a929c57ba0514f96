//! Moving an event to another destination (R15). Allowed only with proof that the old
//! destination did not accept it; creates an explicit new envelope generation and a
//! migration receipt. While any attempt at the old destination is open (`UNKNOWN` or
//! in flight), cross-destination sends are refused.

use crate::encoding::Digest;
use crate::envelope::Destination;
use crate::row::{AttemptStatus, EventRow, Superseded};
use crate::state::{transition, State, TransitionError};

/// Why a migration was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MigrationRefusal {
    /// An attempt at the old destination has an unknown outcome; resolve it first.
    #[error("an attempt at the old destination is still unknown or in flight; reconcile it first")]
    OldDestinationUnknown,
    /// The event is already published at its destination.
    #[error(
        "the event is already published; a second destination is a delivery set, not a migration"
    )]
    AlreadyPublished,
    /// The row is claimed or otherwise busy.
    #[error("the row is {0}; migrate only PENDING or QUARANTINED rows")]
    Busy(State),
    /// The new destination is the current one.
    #[error("the new destination equals the frozen one")]
    SameDestination,
    /// The new destination's ordering differs (R29): the event's successors wait on it, so a
    /// migration keeps it (`per_aggregate` to `per_aggregate`, unordered to unordered).
    #[error("the new destination's ordering differs from the frozen one; migrate to a route with the same ordering")]
    OrderingChanged,
}

/// The migration receipt: evidence of what moved, from where, on what proof.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MigrationGrant {
    /// The new envelope generation.
    pub envelope_generation: u32,
    /// The destination left behind.
    pub from_digest: Digest,
    /// The new frozen destination's digest.
    pub to_digest: Digest,
    /// Attempts that were proven not stored (the proof of absence).
    pub failed_attempts: u32,
}

/// Decides whether `row` may move to `to`. The proof of absence is the row itself: every
/// attempt at the old destination ended `Failed` (a definite "not stored").
pub fn decide_migration(
    row: &EventRow,
    to: &Destination,
) -> Result<MigrationGrant, MigrationRefusal> {
    if row.state.is_published() || row.primary.is_some() {
        return Err(MigrationRefusal::AlreadyPublished);
    }
    if row.has_open_attempt() || row.state.is_unknown() || row.state == State::RetryClaimed {
        return Err(MigrationRefusal::OldDestinationUnknown);
    }
    if !matches!(row.state, State::Pending | State::Quarantined) {
        return Err(MigrationRefusal::Busy(row.state));
    }
    if to.ordering != row.destination.ordering {
        return Err(MigrationRefusal::OrderingChanged);
    }
    let to_digest = to.digest();
    if to_digest == row.destination_digest {
        return Err(MigrationRefusal::SameDestination);
    }
    debug_assert!(row
        .attempts
        .iter()
        .all(|a| a.status == AttemptStatus::Failed));
    Ok(MigrationGrant {
        envelope_generation: row.envelope_generation + 1,
        from_digest: row.destination_digest,
        to_digest,
        failed_attempts: row.attempts.len() as u32,
    })
}

/// Applies a grant: new generation, new frozen destination, old one remembered so that a
/// receipt from it is a conflict.
pub fn apply_migration(
    row: &mut EventRow,
    grant: &MigrationGrant,
    to: Destination,
) -> Result<(), TransitionError> {
    row.state = transition(row.state, State::Pending)?;
    row.superseded.push(Superseded {
        envelope_generation: row.envelope_generation,
        destination_digest: row.destination_digest,
    });
    row.envelope_generation = grant.envelope_generation;
    row.destination = to;
    row.destination_digest = grant.to_digest;
    row.claim = None;
    row.rejections = 0;
    // A new destination is tried at once, without the old one's backoff.
    row.pacing = crate::row::Pacing::default();
    Ok(())
}
