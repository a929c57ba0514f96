//! Claims and fencing (R7–R9). A claim grants only the right to *try* a send. Every write a
//! claim holder makes is a compare-and-set on the claim generation; a holder whose lease ran
//! out or was superseded gets [`Fenced`] and may only leave an audit record.

use crate::encoding::Digest;
use crate::envelope::EventOrdering;
use crate::row::{Attempt, AttemptStatus, Claim, EventRow};
use crate::state::{transition, State, TransitionError};

/// What a claim holder presents with every write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ClaimToken {
    /// Owner id.
    pub owner: u64,
    /// Claim generation received from the grant.
    pub generation: u64,
}

/// Why a claim holder's write was refused. The write goes to the audit log instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fenced {
    /// The row is no longer in a state this write applies to.
    WrongState(State),
    /// Another claim generation (or none) is current.
    Superseded {
        /// The current generation, if any claim is held.
        current: Option<u64>,
    },
    /// The lease ended at `lease_until_ms` (database clock) before `now_ms`.
    LeaseExpired {
        /// Lease end.
        lease_until_ms: u64,
    },
    /// The attempt named is not the row's current open attempt.
    NotCurrentAttempt,
}

/// The result of looking at a row during a claim scan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClaimDecision {
    /// Take a new claim generation and move to `next` (`CLAIMED`, `RETRY_CLAIMED` or
    /// `RECONCILING`).
    Grant {
        /// State after the grant.
        next: State,
        /// New claim generation.
        generation: u64,
        /// Lease end (database clock).
        lease_until_ms: u64,
        /// True when this supersedes an expired claim.
        superseding: bool,
    },
    /// A `SENDING` row whose lease expired: the send may have happened, so it becomes
    /// `DISPATCH_UNKNOWN` and its open attempt `Unknown` (R9). Never `PENDING`.
    ExpireToUnknown,
    /// Not claimable now.
    Skip,
    /// Claimable, but its destination keeps per-aggregate order and an earlier event of the
    /// same aggregate is unresolved (R29): it waits, untouched, until that one is published.
    Wait,
}

/// The first backoff after a "never sent" outcome or a refusal; it doubles per repeat.
pub const NEVER_SENT_BACKOFF_MS_MIN: u64 = 1_000;
/// The longest backoff: a row that cannot leave (a deleted stream, a cluster nobody serves)
/// is retried at most this often, however long the cause lasts.
pub const NEVER_SENT_BACKOFF_MS_MAX: u64 = 60_000;
/// "Never sent" outcomes after which the row is reported as stuck (`status`, the alert log).
pub const NEVER_SENT_ALERT_COUNT: u32 = 5;

/// The wait before a row that could not leave `count` times may be claimed again.
pub fn never_sent_backoff_ms(count: u32) -> u64 {
    let shift = count.saturating_sub(1).min(16);
    (NEVER_SENT_BACKOFF_MS_MIN << shift).min(NEVER_SENT_BACKOFF_MS_MAX)
}

/// Does a dispatcher that serves `clusters` claim rows bound for `row`'s frozen destination?
/// A dispatcher never claims a row it cannot send (it would only come back "never sent").
pub fn serves(clusters: &[String], row: &EventRow) -> bool {
    clusters.contains(&row.destination.cluster)
}

/// The claim decision of a dispatcher serving `clusters`: [`decide_dispatch_claim`] for the
/// rows of its clusters, `Skip` for every other row.
pub fn decide_dispatch_claim_for(
    row: &EventRow,
    clusters: &[String],
    earlier_unresolved: bool,
    now_ms: u64,
    lease_ms: u64,
) -> ClaimDecision {
    if !serves(clusters, row) {
        return ClaimDecision::Skip;
    }
    decide_dispatch_claim_with(row, earlier_unresolved, now_ms, lease_ms)
}

/// The claim decision with the one fact a row does not carry itself: `earlier_unresolved`,
/// "an event of the same aggregate with a lower `aggregate_version`, bound for a
/// per-aggregate-ordered destination, is not yet published" (pending, claimed, sending,
/// unknown, reconciling, retry-claimed or quarantined). For a row whose frozen destination
/// is [`EventOrdering::PerAggregate`] a grant becomes [`ClaimDecision::Wait`] while that
/// fact holds, so the aggregate's events reach the broker one at a time, in version order
/// (R29). A `SENDING` row whose lease ran out still moves to `DISPATCH_UNKNOWN`: that is
/// bookkeeping, not a send. The fact is ignored for unordered destinations.
///
/// The shell must read the fact so that it errs towards `true`: the store reads every
/// earlier version of the key regardless of who holds it, in the claim's own statement.
pub fn decide_dispatch_claim_with(
    row: &EventRow,
    earlier_unresolved: bool,
    now_ms: u64,
    lease_ms: u64,
) -> ClaimDecision {
    let d = decide_dispatch_claim(row, now_ms, lease_ms);
    let ordered = row.destination.ordering == EventOrdering::PerAggregate;
    match d {
        ClaimDecision::Grant { .. } if ordered && earlier_unresolved => ClaimDecision::Wait,
        d => d,
    }
}

/// Whether a claim whose lease ends at `lease_until_ms` is still live at `now_ms` (both the
/// database's clock): the one lease rule the claim decisions, the fence and the CDC
/// publisher's state check share.
pub fn lease_live(lease_until_ms: u64, now_ms: u64) -> bool {
    lease_until_ms > now_ms
}

/// The dispatcher's claim decision for one row (R7), for a row with no earlier unresolved
/// event of its aggregate (see [`decide_dispatch_claim_with`] for ordered destinations). `lease_ms` is added to the database's
/// `now_ms`; a worker's clock is never consulted. A `PENDING` row that could not leave waits
/// out its backoff ([`never_sent_backoff_ms`]).
pub fn decide_dispatch_claim(row: &EventRow, now_ms: u64, lease_ms: u64) -> ClaimDecision {
    let expired = row
        .claim
        .as_ref()
        .is_none_or(|c| !lease_live(c.lease_until_ms, now_ms));
    let grant = |next: State, superseding: bool| ClaimDecision::Grant {
        next,
        generation: row.claim_generation + 1,
        lease_until_ms: now_ms + lease_ms,
        superseding,
    };
    match row.state {
        State::Pending if row.pacing.not_before_ms > now_ms => ClaimDecision::Skip,
        State::Pending => grant(State::Claimed, false),
        State::Claimed if expired => grant(State::Claimed, true),
        State::RetryClaimed if expired => grant(State::RetryClaimed, row.claim.is_some()),
        State::Sending if expired => ClaimDecision::ExpireToUnknown,
        _ => ClaimDecision::Skip,
    }
}

/// The reconciler's claim decision: `DISPATCH_UNKNOWN` whose next lookup is due (or a
/// `RECONCILING` row whose reconciler lease ran out) moves to `RECONCILING` under a new claim
/// generation.
pub fn decide_reconcile_claim(row: &EventRow, now_ms: u64, lease_ms: u64) -> ClaimDecision {
    let expired = row
        .claim
        .as_ref()
        .is_none_or(|c| !lease_live(c.lease_until_ms, now_ms));
    match row.state {
        State::DispatchUnknown if row.pacing.next_lookup_at_ms > now_ms => ClaimDecision::Skip,
        State::DispatchUnknown | State::Reconciling if expired => ClaimDecision::Grant {
            next: State::Reconciling,
            generation: row.claim_generation + 1,
            lease_until_ms: now_ms + lease_ms,
            superseding: row.state == State::Reconciling,
        },
        State::Sending if expired => ClaimDecision::ExpireToUnknown,
        _ => ClaimDecision::Skip,
    }
}

/// Applies a claim decision to the in-memory row. Returns the token for a grant.
pub fn apply_claim(
    row: &mut EventRow,
    decision: &ClaimDecision,
    owner: u64,
    now_ms: u64,
) -> Result<Option<ClaimToken>, TransitionError> {
    match *decision {
        ClaimDecision::Grant {
            next,
            generation,
            lease_until_ms,
            ..
        } => {
            let prev = row.state;
            row.state = transition(prev, next)?;
            if prev == State::Pending {
                // Pending -> Claimed: a new send authorisation.
                row.attempt_generation += 1;
            }
            row.claim_generation = generation;
            row.claim = Some(Claim {
                owner,
                generation,
                lease_until_ms,
            });
            Ok(Some(ClaimToken { owner, generation }))
        }
        ClaimDecision::ExpireToUnknown => {
            row.state = transition(row.state, State::DispatchUnknown)?;
            mark_open_attempts_unknown(row);
            row.claim = None;
            row.unknown_since_ms.get_or_insert(now_ms);
            Ok(None)
        }
        ClaimDecision::Skip | ClaimDecision::Wait => Ok(None),
    }
}

fn mark_open_attempts_unknown(row: &mut EventRow) {
    for a in &mut row.attempts {
        if a.status == AttemptStatus::Sending {
            a.status = AttemptStatus::Unknown;
        }
    }
}

/// Checks that `token` is the current, unexpired claim on `row`.
pub fn check_fence(row: &EventRow, token: ClaimToken, now_ms: u64) -> Result<(), Fenced> {
    match &row.claim {
        Some(c) if c.generation == token.generation && c.owner == token.owner => {
            if !lease_live(c.lease_until_ms, now_ms) {
                Err(Fenced::LeaseExpired {
                    lease_until_ms: c.lease_until_ms,
                })
            } else {
                Ok(())
            }
        }
        other => Err(Fenced::Superseded {
            current: other.as_ref().map(|c| c.generation),
        }),
    }
}

/// What a send must carry: the frozen destination of the current envelope generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BeginSend {
    /// The event id the message carries: always the row's own (R3).
    pub event_id: crate::envelope::EventId,
    /// Attempt generation the new attempt is registered under.
    pub attempt_generation: u32,
    /// Envelope generation sent.
    pub envelope_generation: u32,
    /// The only destination this send may go to.
    pub destination_digest: Digest,
}

/// May this claim holder register an attempt and send? (R8–R9). The caller registers the
/// attempt (in the same CAS) *before* the request leaves the process.
pub fn decide_begin_send(
    row: &EventRow,
    token: ClaimToken,
    now_ms: u64,
) -> Result<BeginSend, Fenced> {
    if !matches!(row.state, State::Claimed | State::RetryClaimed) {
        return Err(Fenced::WrongState(row.state));
    }
    check_fence(row, token, now_ms)?;
    Ok(BeginSend {
        event_id: row.event_id,
        attempt_generation: row.attempt_generation,
        envelope_generation: row.envelope_generation,
        destination_digest: row.destination_digest,
    })
}

/// Registers the attempt and moves the row to `SENDING`.
pub fn apply_begin_send(
    row: &mut EventRow,
    begin: &BeginSend,
    token: ClaimToken,
    attempt_id: u64,
    now_ms: u64,
) -> Result<(), TransitionError> {
    row.state = transition(row.state, State::Sending)?;
    row.attempts.push(Attempt {
        id: attempt_id,
        attempt_generation: begin.attempt_generation,
        claim_generation: token.generation,
        owner: token.owner,
        envelope_generation: begin.envelope_generation,
        destination_digest: begin.destination_digest,
        status: AttemptStatus::Sending,
        started_at_ms: now_ms,
    });
    Ok(())
}

/// What the sender learned without a receipt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendOutcome {
    /// No ACK within the timeout: the broker may have stored it.
    AckTimeout,
    /// Provably never left the process (connection refused before the write).
    NeverSent,
    /// The broker answered with a definite refusal (nothing stored).
    Rejected,
}

/// The verdict on a send outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendOutcomeDecision {
    /// `SENDING -> DISPATCH_UNKNOWN`, attempt `Unknown`.
    ToUnknown,
    /// `SENDING -> PENDING`, attempt `Failed` (definite "not stored").
    ToPending,
    /// This attempt is definitely not stored, but an older attempt's outcome is still
    /// unknown: `SENDING -> DISPATCH_UNKNOWN` so that its late ACK can still win (R11).
    BackToUnknown,
    /// `SENDING -> QUARANTINED`: refused `rejection_limit` times (poison).
    ToQuarantine,
    /// The reporter's claim is no longer current: keep the report as audit only.
    Audit(Fenced),
}

/// Decides what a claim holder's report about its own attempt does (R6, R9).
pub fn decide_send_outcome(
    row: &EventRow,
    token: ClaimToken,
    attempt_id: u64,
    outcome: SendOutcome,
    now_ms: u64,
    rejection_limit: u32,
) -> SendOutcomeDecision {
    if row.state != State::Sending {
        return SendOutcomeDecision::Audit(Fenced::WrongState(row.state));
    }
    if let Err(f) = check_fence(row, token, now_ms) {
        return SendOutcomeDecision::Audit(f);
    }
    match row.attempt(attempt_id) {
        Some(a) if a.status == AttemptStatus::Sending && a.claim_generation == token.generation => {
        }
        _ => return SendOutcomeDecision::Audit(Fenced::NotCurrentAttempt),
    }
    let older_unknown = row
        .attempts
        .iter()
        .any(|a| a.id != attempt_id && a.status == AttemptStatus::Unknown);
    match outcome {
        SendOutcome::AckTimeout => SendOutcomeDecision::ToUnknown,
        // Poison reaches its quarantine even while an older attempt is unknown (else a
        // retry after every inconclusive lookup loops forever); that attempt's late ACK can
        // still fill the slot of a QUARANTINED row (R11).
        SendOutcome::Rejected if row.rejections + 1 >= rejection_limit => {
            SendOutcomeDecision::ToQuarantine
        }
        SendOutcome::NeverSent | SendOutcome::Rejected if older_unknown => {
            SendOutcomeDecision::BackToUnknown
        }
        SendOutcome::NeverSent => SendOutcomeDecision::ToPending,
        SendOutcome::Rejected => SendOutcomeDecision::ToPending,
    }
}

/// Applies a send-outcome verdict to the in-memory row.
pub fn apply_send_outcome(
    row: &mut EventRow,
    decision: SendOutcomeDecision,
    attempt_id: u64,
    outcome: SendOutcome,
    now_ms: u64,
) -> Result<(), TransitionError> {
    let (next, status) = match decision {
        SendOutcomeDecision::Audit(_) => return Ok(()),
        SendOutcomeDecision::ToUnknown => (State::DispatchUnknown, AttemptStatus::Unknown),
        SendOutcomeDecision::ToPending => (State::Pending, AttemptStatus::Failed),
        SendOutcomeDecision::BackToUnknown => (State::DispatchUnknown, AttemptStatus::Failed),
        SendOutcomeDecision::ToQuarantine => (State::Quarantined, AttemptStatus::Failed),
    };
    row.state = transition(row.state, next)?;
    if let Some(a) = row.attempt_mut(attempt_id) {
        a.status = status;
    }
    if outcome == SendOutcome::Rejected {
        row.rejections += 1;
    }
    match outcome {
        SendOutcome::NeverSent => {
            row.pacing.never_sent += 1;
            if next == State::Pending {
                row.pacing.not_before_ms = now_ms + never_sent_backoff_ms(row.pacing.never_sent);
            }
        }
        SendOutcome::Rejected if next == State::Pending => {
            row.pacing.not_before_ms = now_ms + never_sent_backoff_ms(row.rejections);
        }
        SendOutcome::Rejected | SendOutcome::AckTimeout => {}
    }
    if next == State::DispatchUnknown && decision == SendOutcomeDecision::ToUnknown {
        // Look it up at once: the broker may already hold it (create-if-absent refusals
        // arrive here too).
        row.pacing.next_lookup_at_ms = now_ms;
    }
    if next == State::DispatchUnknown {
        row.unknown_since_ms.get_or_insert(now_ms);
    }
    row.claim = None;
    Ok(())
}

/// Graceful shutdown: a holder gives an unused claim back (`CLAIMED -> PENDING`,
/// `RETRY_CLAIMED` keeps its state and loses the claim).
pub fn decide_release(row: &EventRow, token: ClaimToken, now_ms: u64) -> Result<State, Fenced> {
    check_fence(row, token, now_ms)?;
    match row.state {
        State::Claimed => Ok(State::Pending),
        State::RetryClaimed => Ok(State::RetryClaimed),
        s => Err(Fenced::WrongState(s)),
    }
}

/// Operator exit path for poison: `QUARANTINED -> PENDING`. Refused for any other state
/// (a `SENDING` row must never be sent back to `PENDING` by hand, R9).
pub fn decide_release_quarantine(row: &EventRow) -> Result<State, TransitionError> {
    if row.state != State::Quarantined {
        return Err(TransitionError {
            from: row.state,
            to: State::Pending,
        });
    }
    transition(row.state, State::Pending)
}

/// Applies an operator release: back to `PENDING` with the poison counter reset.
pub fn apply_release_quarantine(row: &mut EventRow) -> Result<(), TransitionError> {
    row.state = decide_release_quarantine(row)?;
    row.rejections = 0;
    row.pacing = crate::row::Pacing::default();
    row.claim = None;
    Ok(())
}
