//! The snapshot of one envelope row that every decision reads: the sealed identity, the
//! claim, the registered attempts and the publish slot. Shells load it (from Postgres or the
//! simulator's memory), call a `decide_*` function and persist the returned verdict; the
//! in-memory `apply_*` helpers next to each decision are what the simulator persists with.

use crate::encoding::Digest;
use crate::envelope::{Destination, EventId, SealedEnvelope};
use crate::receipt::Receipt;
use crate::state::State;

/// Who holds the row and until when (database clock, R7).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claim {
    /// Owner id of the dispatcher or reconciler process.
    pub owner: u64,
    /// The claim generation this claim was issued with.
    pub generation: u64,
    /// Lease end, in milliseconds of the database clock.
    pub lease_until_ms: u64,
}

/// What is known of one registered send attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AttemptStatus {
    /// Registered; the send may be in flight.
    Sending,
    /// The outcome is unknown (ACK lost or lease expired mid-send).
    Unknown,
    /// A receipt for this attempt was accepted (primary or duplicate).
    Acked,
    /// Provably not stored: the request never left, or the broker refused it.
    Failed,
}

/// One registered send attempt. Registered before the send leaves the process (R9/R10).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attempt {
    /// Store-unique attempt id (a sequence in Postgres).
    pub id: u64,
    /// Attempt generation of the row when this attempt was registered.
    pub attempt_generation: u32,
    /// Claim generation that authorised the attempt.
    pub claim_generation: u64,
    /// Owner that sent it.
    pub owner: u64,
    /// Envelope generation it was sent under.
    pub envelope_generation: u32,
    /// Destination digest it was sent to (always the frozen one of its envelope generation).
    pub destination_digest: Digest,
    /// Current knowledge of its outcome.
    pub status: AttemptStatus,
    /// Registration time (database clock).
    pub started_at_ms: u64,
}

/// A destination superseded by an explicit migration (R15).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Superseded {
    /// Envelope generation that used it.
    pub envelope_generation: u32,
    /// Its digest.
    pub destination_digest: Digest,
}

/// When the loops may next touch a row. Persisted with the row, so every dispatcher and
/// reconciler honours it, whichever process made the last attempt.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pacing {
    /// Not claimable for dispatch before this time (database clock): set with a backoff after
    /// a "never sent" outcome, so a row that cannot leave does not starve newer ones.
    pub not_before_ms: u64,
    /// "Never sent" outcomes since the row was last sent.
    pub never_sent: u32,
    /// The reconciler does not look the row up again before this time (database clock).
    pub next_lookup_at_ms: u64,
    /// Inconclusive lookups ("stay unknown") in the current unknown episode.
    pub lookups: u32,
}

/// Snapshot of one envelope row (one member of a delivery set, usually member 0).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventRow {
    /// Identity for life.
    pub event_id: EventId,
    /// Member index inside a delivery set (0 for a plain event).
    pub member: u16,
    /// Current envelope generation (1 unless migrated).
    pub envelope_generation: u32,
    /// Sealed payload digest.
    pub payload_digest: Digest,
    /// Frozen destination of the current envelope generation.
    pub destination: Destination,
    /// Its digest.
    pub destination_digest: Digest,
    /// Row state.
    pub state: State,
    /// Current claim, if any.
    pub claim: Option<Claim>,
    /// Last claim generation issued (monotonic, never reused).
    pub claim_generation: u64,
    /// Attempt generation (incremented for each new send authorisation).
    pub attempt_generation: u32,
    /// Every registered attempt, oldest first.
    pub attempts: Vec<Attempt>,
    /// The publish slot.
    pub primary: Option<Receipt>,
    /// Definite broker refusals so far (poison counter).
    pub rejections: u32,
    /// Since when the row has been unknown.
    pub unknown_since_ms: Option<u64>,
    /// When the slot was filled.
    pub published_at_ms: Option<u64>,
    /// Destinations left behind by migrations.
    pub superseded: Vec<Superseded>,
    /// Backoff of the dispatch and reconcile loops.
    pub pacing: Pacing,
}

impl EventRow {
    /// The row as committed by the producer: `PENDING`, nothing claimed, nothing sent.
    pub fn pending(env: &SealedEnvelope, member: u16) -> EventRow {
        EventRow::new_pending(
            env.event_id,
            member,
            env.payload_digest,
            env.destination.clone(),
        )
    }

    /// Same as [`EventRow::pending`] from the parts the decisions need.
    pub fn new_pending(
        event_id: EventId,
        member: u16,
        payload_digest: Digest,
        destination: Destination,
    ) -> EventRow {
        let destination_digest = destination.digest();
        EventRow {
            event_id,
            member,
            envelope_generation: 1,
            payload_digest,
            destination,
            destination_digest,
            state: State::Pending,
            claim: None,
            claim_generation: 0,
            attempt_generation: 0,
            attempts: Vec::new(),
            primary: None,
            rejections: 0,
            unknown_since_ms: None,
            published_at_ms: None,
            superseded: Vec::new(),
            pacing: Pacing::default(),
        }
    }

    /// The attempt with this id, if registered.
    pub fn attempt(&self, id: u64) -> Option<&Attempt> {
        self.attempts.iter().find(|a| a.id == id)
    }

    /// Mutable access to a registered attempt.
    pub fn attempt_mut(&mut self, id: u64) -> Option<&mut Attempt> {
        self.attempts.iter_mut().find(|a| a.id == id)
    }

    /// True if any attempt's outcome is not known (in flight or unknown).
    pub fn has_open_attempt(&self) -> bool {
        self.attempts
            .iter()
            .any(|a| matches!(a.status, AttemptStatus::Sending | AttemptStatus::Unknown))
    }
}
