//! Reconciling unknown outcomes (R13–R14). The reconciler holds a `RECONCILING` claim, asks
//! the broker whether the event is stored at its *frozen* destination, and either turns the
//! answer into a receipt through the acceptance point or grants a retry to the same
//! destination. It never picks another destination.

use crate::claim::{check_fence, ClaimToken, Fenced};
use crate::encoding::Digest;
use crate::receipt::{decide_receipt, QuarantineReason, Receipt, ReceiptVerdict, RejectReason};
use crate::row::{AttemptStatus, EventRow};
use crate::state::{transition, State, TransitionError};

/// What the broker said when asked "did you store event X at destination D?".
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// A stored message for the event at the frozen destination, as a receipt, whose seal
    /// the reader admitted ([`crate::signature::judge_copy`]), or a broker whose adapter
    /// reads no seal.
    Found(Receipt),
    /// The stored messages for the event at the frozen destination as the adapter read them,
    /// oldest first (never empty, at most [`crate::signature::COPIES_MAX`]), their signatures
    /// not yet judged: the reader turns them into `Found` (the first copy whose seal it
    /// admits) or `Unsealed` with [`crate::signature::judge_copy`] before any decision.
    /// Every copy is read, not only the first or the last: anyone who may publish there can
    /// put a look-alike before or after the genuine one. Undecided, a decision leaves the row
    /// unknown.
    Copies(Vec<crate::signature::FoundCopy>),
    /// A stored message whose seal the reader refused: forged, or signed by a key it does not
    /// hold. Never adopted, never counted as present.
    Unsealed {
        /// The copy as a receipt.
        receipt: Receipt,
        /// Why its seal was refused.
        refusal: crate::signature::SealRefusal,
    },
    /// Proven absent: the broker answered and holds no such message.
    Absent,
    /// This broker cannot be asked (no lookup by event id).
    Unqueryable,
    /// The broker could not be reached; nothing was learned.
    Unavailable,
}

/// How a broker whose lookup is a scan (Kafka: a partition read from an event's mint time to
/// the end) answers many unknown events at once ([`crate::port::Capabilities::lookup_scan`]):
/// one scan answers every event of a group that [`shares_scan`] admits, at most
/// `events_max` of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LookupScan {
    /// Events one scan answers at most.
    pub events_max: usize,
    /// Events of one scan were minted at most this far from the group's first: the scan
    /// starts at the earliest one's mint time (minus the adapter's clock margin), so a wider
    /// window reads more records for the later ones.
    pub window_ms: u64,
}

/// Whether the unknown event `b` may be answered by the scan made for `a` (the group's first
/// event): the same frozen cluster, topic and partition, and `b` minted at most `window_ms`
/// from `a`. An event id
/// without a mint time (not a UUIDv7) is scanned from the partition's start, alone.
pub fn shares_scan(
    a: (&crate::envelope::Destination, crate::envelope::EventId),
    b: (&crate::envelope::Destination, crate::envelope::EventId),
    window_ms: u64,
) -> bool {
    let (da, ia) = a;
    let (db, ib) = b;
    let same_place = da.cluster == db.cluster
        && da.topic == db.topic
        && da.partition_algorithm == db.partition_algorithm
        && da.partition() == db.partition();
    match (ia.minted_unix_ms(), ib.minted_unix_ms()) {
        (Some(x), Some(y)) => same_place && x.abs_diff(y) <= window_ms,
        _ => false,
    }
}

/// How far one scan got: it fixes the end it reads to (the partition's end when it starts)
/// and reads from the group's start; `finished` only if it read every record in between.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScanReach {
    /// Every record from the scan's start to the end it fixed was read.
    pub finished: bool,
    /// Records before the scan's start were deleted by retention (the first retained one is
    /// already newer than the start): nothing there can be proven absent.
    pub start_deleted: bool,
}

/// The answer of one scan for each event of its group (R13): `Copies` (their seals to be
/// judged) for an event the scan saw, `Absent` only for an event it did not see **and** a scan that read its whole range
/// (nothing proven from a range it did not finish: a bound, a time limit or an error stops a
/// scan short), `Unqueryable` when retention removed records the scan needed, `Unavailable`
/// (nothing learned) otherwise. Every adapter that scans, and the simulator, answer through
/// this.
pub fn decide_scanned(
    group: &[(crate::envelope::EventId, u16)],
    found: impl Fn(crate::envelope::EventId, u16) -> Vec<crate::signature::FoundCopy>,
    reach: ScanReach,
) -> Vec<Lookup> {
    group
        .iter()
        .map(|&(event_id, member)| {
            let copies = found(event_id, member);
            match () {
                _ if !copies.is_empty() => Lookup::Copies(copies),
                _ if reach.start_deleted => Lookup::Unqueryable,
                _ if reach.finished => Lookup::Absent,
                _ => Lookup::Unavailable,
            }
        })
        .collect()
}

/// The first wait after an inconclusive lookup; it doubles per repeat.
pub const LOOKUP_BACKOFF_MS_MIN: u64 = 1_000;
/// The longest wait between lookups of one unknown row (G3 asks for p99 within 15 minutes;
/// a broker outage of any length costs at most this much on top).
pub const LOOKUP_BACKOFF_MS_MAX: u64 = 30_000;

/// The wait before an unknown row is looked up again after `lookups` inconclusive answers.
pub fn lookup_backoff_ms(lookups: u32) -> u64 {
    let shift = lookups.saturating_sub(1).min(16);
    (LOOKUP_BACKOFF_MS_MIN << shift).min(LOOKUP_BACKOFF_MS_MAX)
}

/// Reconciler policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReconcilePolicy {
    /// Where the broker cannot be asked, may the reconciler redeliver to the same frozen
    /// destination (consumers deduplicate)? (R14)
    pub redeliver_when_unqueryable: bool,
    /// The adapter declared create-if-absent: the broker refuses any second copy of the
    /// event at this destination, so a retry after a lookup found a *conflicting* copy
    /// (quarantined) can never succeed.
    pub create_if_absent: bool,
}

impl Default for ReconcilePolicy {
    fn default() -> Self {
        ReconcilePolicy {
            redeliver_when_unqueryable: true,
            create_if_absent: false,
        }
    }
}

impl ReconcilePolicy {
    /// The policy for a broker adapter with these capabilities.
    pub fn for_capabilities(caps: crate::port::Capabilities) -> ReconcilePolicy {
        ReconcilePolicy {
            redeliver_when_unqueryable: true,
            create_if_absent: caps.create_if_absent,
        }
    }
}

/// The reconciler's verdict for one `RECONCILING` row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReconcileDecision {
    /// The lookup found the message: submit the receipt to the acceptance point.
    Accept(Receipt),
    /// Grant a redelivery to the same frozen destination: `RETRY_CLAIMED`, attempt
    /// generation + 1.
    RetrySameDestination {
        /// The only destination the retry may use.
        destination_digest: Digest,
        /// Quarantine the found receipt first (it contradicted the envelope).
        quarantine: Option<QuarantineReason>,
    },
    /// Acceptance neither proven nor disproven: back to `DISPATCH_UNKNOWN`.
    StayUnknown,
    /// The destination holds a copy of this event that contradicts the sealed envelope (it
    /// is quarantined), and the broker refuses a second copy (create-if-absent): a retry can
    /// never succeed. `RECONCILING -> QUARANTINED` for an operator (e.g. a restore undid a
    /// migration that had already published); never a retry loop.
    Conflict(QuarantineReason),
    /// The reconciler's claim is gone (an ACK was accepted meanwhile, or another
    /// reconciler took over): its write fails harmlessly.
    Fenced(Fenced),
}

/// The row a reconciler claimed is gone (a restore removed it, or it was purged): its claim
/// is void and nothing is written. Never "stay unknown": there is no row to keep unknown.
pub fn decide_reconcile_missing() -> ReconcileDecision {
    ReconcileDecision::Fenced(Fenced::Superseded { current: None })
}

/// Decides what to do with a lookup result (R13–R14).
pub fn decide_reconcile(
    row: &EventRow,
    token: ClaimToken,
    lookup: &Lookup,
    policy: ReconcilePolicy,
    now_ms: u64,
) -> ReconcileDecision {
    if row.state != State::Reconciling {
        return ReconcileDecision::Fenced(Fenced::WrongState(row.state));
    }
    if let Err(f) = check_fence(row, token, now_ms) {
        return ReconcileDecision::Fenced(f);
    }
    let retry = |quarantine| ReconcileDecision::RetrySameDestination {
        destination_digest: row.destination_digest,
        quarantine,
    };
    match lookup {
        Lookup::Found(r) => match decide_receipt(row, r) {
            ReceiptVerdict::Primary | ReceiptVerdict::Duplicate(_) => {
                ReconcileDecision::Accept(r.clone())
            }
            // The broker holds a copy we cannot tie to a registered attempt (the row was
            // restored from a backup, say). Redeliver to the same destination under the
            // same event id: the broker deduplicates or consumers do.
            // At a broker that refuses a second copy, retrying can never replace it: a
            // conflict for the operator, not a retry loop.
            ReceiptVerdict::Reject(
                RejectReason::UnregisteredAttempt | RejectReason::EnvelopeGenerationMismatch,
            ) if policy.create_if_absent => {
                ReconcileDecision::Conflict(QuarantineReason::UnadoptableCopy)
            }
            ReceiptVerdict::Reject(RejectReason::UnregisteredAttempt) => retry(None),
            ReceiptVerdict::Reject(RejectReason::NoPosition) => ReconcileDecision::StayUnknown,
            ReceiptVerdict::Reject(_) => retry(None),
            ReceiptVerdict::Quarantine(q) if policy.create_if_absent => {
                ReconcileDecision::Conflict(q)
            }
            ReceiptVerdict::Quarantine(q) => retry(Some(q)),
        },
        // A copy nobody may trust: at a broker that refuses a second copy it blocks the
        // genuine one for good (an operator removes it, then releases the row); elsewhere the
        // genuine copy is sent to the same destination beside it, and readers refuse the
        // forgery by its seal.
        Lookup::Unsealed { .. } if policy.create_if_absent => {
            ReconcileDecision::Conflict(QuarantineReason::UnsealedCopy)
        }
        Lookup::Unsealed { .. } => retry(None),
        // Not judged by the shell: nothing is decided on an unchecked copy.
        Lookup::Copies(_) => ReconcileDecision::StayUnknown,
        Lookup::Absent => retry(None),
        Lookup::Unqueryable if policy.redeliver_when_unqueryable => retry(None),
        Lookup::Unqueryable | Lookup::Unavailable => ReconcileDecision::StayUnknown,
    }
}

/// Applies a reconcile verdict other than `Accept` (which goes through
/// [`crate::receipt::apply_receipt`]).
pub fn apply_reconcile(
    row: &mut EventRow,
    decision: &ReconcileDecision,
    now_ms: u64,
) -> Result<(), TransitionError> {
    match decision {
        ReconcileDecision::RetrySameDestination { .. } => {
            row.state = transition(row.state, State::RetryClaimed)?;
            row.pacing.lookups = 0;
            row.pacing.next_lookup_at_ms = 0;
            row.attempt_generation += 1;
            row.claim = None;
            for a in &mut row.attempts {
                // Still registered: a late ACK from it competes for the slot (R11).
                if a.status == AttemptStatus::Sending {
                    a.status = AttemptStatus::Unknown;
                }
            }
        }
        ReconcileDecision::StayUnknown => {
            row.state = transition(row.state, State::DispatchUnknown)?;
            row.claim = None;
            // "Row missing means stay unknown" and "broker unavailable" both land here: the
            // row waits out a growing backoff so other unknown rows get their turn.
            row.pacing.lookups += 1;
            row.pacing.next_lookup_at_ms = now_ms + lookup_backoff_ms(row.pacing.lookups);
        }
        ReconcileDecision::Conflict(_) => {
            row.state = transition(row.state, State::Quarantined)?;
            row.claim = None;
            row.pacing.lookups = 0;
            row.pacing.next_lookup_at_ms = 0;
        }
        ReconcileDecision::Accept(_) | ReconcileDecision::Fenced(_) => {}
    }
    Ok(())
}
