//! One pure step per store transaction: what the transaction decides, over the row snapshots
//! it loaded, with its pre- and post-conditions checked.
//!
//! The PostgreSQL store (`sealpost::store`), the simulator's store model and the differential
//! test all run these functions: the store loads rows, calls the step and persists the rows
//! as the step left them; the simulator does the same over its in-memory rows. A rule that
//! lives here has no second copy in a shell.
//!
//! * [`picks`]: which rows the dispatch claim scan takes (and counts against its batch).
//!   The store's `WHERE` clause says the same in SQL; every claim checks each row the SQL
//!   picked against [`picks`] ([`step_claim`]'s precondition), so the two cannot drift
//!   unnoticed.
//! * [`holds_back`]: "an earlier version of this aggregate is unresolved" (R29).
//! * [`step_claim`]: the claim transaction: grant or expire or wait per picked row, register
//!   an attempt for each grant, the scan's next position and the ordered sends' lowest one.
//! * [`step_accept`]: the locked acceptance point (R10–R12) for a batch of receipts: the
//!   verdict per receipt, the row changes, and which receipts are kept as evidence.
//! * [`guarded_eligible`] and [`step_guarded`]: the dispatcher's fast acceptance path, a
//!   receipt accepted on the row as the dispatcher's own claim left it, written only if the
//!   row is still exactly that.
//! * [`step_report`]: the senders' outcome reports (ACK timeout, never sent, refused).
//! * [`picks_for_reconcile`], [`EXPIRY_FRONT_PER_BATCH`] and [`step_claim_unknown`]: the
//!   reconciler's claim of due unknown rows and of expired `SENDING` rows at the front of the
//!   claim order.
//! * [`step_finish_reconcile`]: the reconciler's verdict on one row after its lookup; a found
//!   copy goes through the acceptance step in the same transaction.
//!
//! Mutants and other variations of a decision come in through the [`ClaimRules`],
//! [`AcceptRules`] and [`ReportRules`] hooks (the simulator's `Protocol`); production passes
//! [`CoreRules`].

use std::borrow::BorrowMut;

use crate::claim::{
    self, apply_begin_send, apply_claim, BeginSend, ClaimDecision, ClaimToken, SendOutcome,
    SendOutcomeDecision, NEVER_SENT_ALERT_COUNT,
};
use crate::dispatcher::OutcomeReport;
use crate::envelope::EventOrdering;
use crate::receipt::{self, DuplicateKind, Receipt, ReceiptSource, ReceiptVerdict};
use crate::reconcile::{self, Lookup, ReconcileDecision, ReconcilePolicy};
use crate::rollout::{self, AliasCheck, ClaimFacts};
use crate::row::{AttemptStatus, EventRow};
use crate::state::{Phase, State, TransitionError};

/// Why a step refused to run or could not finish: the shell's rows or inputs broke the
/// step's contract. Always a bug (in the shell's query, its snapshot or the core); the shell
/// rolls its transaction back and reports it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StepError {
    /// The inputs do not satisfy the step's precondition.
    #[error("{step} precondition violated: {what}")]
    Precondition {
        /// The step.
        step: &'static str,
        /// What was wrong.
        what: String,
    },
    /// The step's result does not satisfy its postcondition.
    #[error("{step} postcondition violated: {what}")]
    Postcondition {
        /// The step.
        step: &'static str,
        /// What was wrong.
        what: String,
    },
    /// A state change outside the state table.
    #[error(transparent)]
    Transition(#[from] TransitionError),
}

fn pre(step: &'static str, what: String) -> StepError {
    StepError::Precondition { step, what }
}

fn post(step: &'static str, what: String) -> StepError {
    StepError::Postcondition { step, what }
}

/// The clusters a dispatcher serves: a claim never takes a row it cannot send.
#[derive(Clone, Copy, Debug)]
pub enum Served<'a> {
    /// Every cluster (a dispatcher whose adapter reaches them all).
    Every,
    /// Only these clusters.
    Only(&'a [String]),
}

impl Served<'_> {
    /// Does this dispatcher send to `row`'s frozen destination?
    pub fn serves(&self, row: &EventRow) -> bool {
        match self {
            Served::Every => true,
            Served::Only(clusters) => claim::serves(clusters, row),
        }
    }
}

/// Does the dispatch claim scan take `row` (lock it and count it against the batch)? A row
/// of a served cluster in the dispatchable phase that the claim decision does not skip: a
/// `PENDING` row past its never-sent backoff, or a claimed, retry-claimed or sending row
/// whose lease ran out. Rows waiting for an earlier version (R29) are taken: they count,
/// and the claim records that they wait.
///
/// The store's claim `WHERE` clause is this predicate in SQL, on the statement's clock.
pub fn picks(row: &EventRow, served: Served<'_>, now_ms: u64) -> bool {
    row.state.phase() == Phase::Dispatchable
        && served.serves(row)
        && claim::decide_dispatch_claim(row, now_ms, 0) != ClaimDecision::Skip
}

/// Does `earlier`, an earlier version of an aggregate, hold back the later versions bound
/// for an ordered destination (R29)? It does while it is itself ordered and unresolved
/// ([`Phase::is_unresolved`]: dispatchable, unknown or parked), whoever holds it.
pub fn holds_back(earlier: &EventRow) -> bool {
    earlier.destination.ordering == EventOrdering::PerAggregate
        && earlier.state.phase().is_unresolved()
}

/// The decisions a claim step takes, as hooks: production uses the core's ([`CoreRules`]),
/// the simulator's mutants replace one. `index` is the row's place in the step's slice.
pub trait ClaimRules {
    /// The claim decision for one picked row.
    fn decide_claim(
        &mut self,
        _index: usize,
        row: &EventRow,
        served: Served<'_>,
        earlier_unresolved: bool,
        now_ms: u64,
        lease_ms: u64,
    ) -> ClaimDecision {
        if !served.serves(row) {
            return ClaimDecision::Skip;
        }
        claim::decide_dispatch_claim_with(row, earlier_unresolved, now_ms, lease_ms)
    }

    /// What the fresh claim's send must carry.
    fn decide_begin_send(
        &mut self,
        _index: usize,
        row: &EventRow,
        token: ClaimToken,
        now_ms: u64,
    ) -> Result<BeginSend, claim::Fenced> {
        claim::decide_begin_send(row, token, now_ms)
    }
}

/// The core's own decisions.
#[derive(Clone, Copy, Debug, Default)]
pub struct CoreRules;

impl ClaimRules for CoreRules {}

/// What the claim transaction is asked to do.
#[derive(Clone, Copy, Debug)]
pub struct ClaimInput<'a> {
    /// The dispatcher's owner id.
    pub owner: u64,
    /// The clusters it serves.
    pub served: Served<'a>,
    /// The database clock of the transaction.
    pub now_ms: u64,
    /// The lease a grant gets, added to `now_ms`.
    pub lease_ms: u64,
    /// The most rows one claim takes (the scan's `LIMIT`).
    pub batch_max: usize,
    /// The claiming implementation and the rollout aliases read in the claim's own
    /// transaction (R25): a picked row must be one [`rollout::may_claim`] gives it.
    pub alias: AliasCheck<'a>,
}

/// What the store read beside a picked row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pick<'a> {
    /// The row's commit position (the claim index's order within its cluster).
    pub position: u64,
    /// "An earlier version of this aggregate is unresolved" ([`holds_back`]), read so that
    /// it errs towards `true` (the store reads it in the claim's own statement).
    pub earlier_unresolved: bool,
    /// The attempt id the store drew for the row, used if the row is sent.
    pub attempt_id: u64,
    /// The row's event type, aggregate share bucket and protocol (the alias's inputs).
    pub facts: ClaimFacts<'a>,
}

/// A send the claim authorised: the attempt is registered and the row is `SENDING`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Authorised {
    /// The claim the sender presents with every later write.
    pub token: ClaimToken,
    /// What the message must carry.
    pub begin: BeginSend,
    /// The attempt registered (the message's attempt id).
    pub attempt_id: u64,
    /// The lease end (database clock).
    pub lease_until_ms: u64,
    /// The grant superseded an expired claim.
    pub superseding: bool,
    /// The row was `PENDING` before the claim (a new attempt generation).
    pub was_pending: bool,
}

/// What the claim did with one picked row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PickOutcome {
    /// Claimed and authorised to send.
    Send(Authorised),
    /// A `SENDING` row whose lease ran out: now `DISPATCH_UNKNOWN` (R9).
    ExpiredToUnknown,
    /// Waits for an earlier version of its aggregate (R29), untouched.
    Waits,
}

/// What one claim transaction decided.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClaimStep {
    /// One outcome per picked row, in the slice's order.
    pub outcomes: Vec<PickOutcome>,
    /// The highest commit position among the picked rows: where the next scan may start.
    pub last_position: Option<u64>,
    /// The lowest commit position among the sends bound for an ordered destination.
    pub ordered_from: Option<u64>,
    /// Rows moved to `DISPATCH_UNKNOWN`.
    pub expired_to_unknown: usize,
    /// Rows that wait for an earlier version.
    pub ordering_waits: usize,
}

impl ClaimStep {
    /// The authorised sends with their index in the slice, in claim order.
    pub fn sends(&self) -> impl Iterator<Item = (usize, &Authorised)> + '_ {
        self.outcomes
            .iter()
            .enumerate()
            .filter_map(|(i, o)| match o {
                PickOutcome::Send(a) => Some((i, a)),
                _ => None,
            })
    }
}

const CLAIM: &str = "claim step";

/// The dispatch claim transaction over the rows its scan picked, in scan order (by cluster,
/// then commit position), at most `batch_max` of them, each one [`picks`] takes.
///
/// For each row: the claim decision ([`ClaimRules::decide_claim`], with the row's
/// `earlier_unresolved` fact); a grant registers an attempt under the drawn attempt id and
/// moves the row to `SENDING` (the attempt is registered in the claim's own transaction,
/// before anything is sent); an expired `SENDING` row becomes `DISPATCH_UNKNOWN`; an ordered
/// row behind an unresolved earlier version waits.
///
/// Preconditions: one [`Pick`] per row, no more than `batch_max` rows, commit positions
/// never decreasing within each cluster, and every row one that [`picks`] takes at
/// `now_ms` and [`rollout::may_claim`] gives the claiming implementation (a row the store's
/// SQL picked that the core would skip means the SQL and the core disagree: the step
/// refuses before it changes anything). Postconditions: every sent row is
/// `SENDING` with the drawn attempt as its open attempt; waiting rows are unchanged.
pub fn step_claim<R: BorrowMut<EventRow>>(
    rows: &mut [R],
    picked: &[Pick<'_>],
    input: &ClaimInput<'_>,
    rules: &mut impl ClaimRules,
) -> Result<ClaimStep, StepError> {
    if rows.len() != picked.len() {
        return Err(pre(
            CLAIM,
            format!("{} rows but {} picks", rows.len(), picked.len()),
        ));
    }
    if rows.len() > input.batch_max {
        return Err(pre(
            CLAIM,
            format!(
                "{} rows picked, more than the batch of {}",
                rows.len(),
                input.batch_max
            ),
        ));
    }
    for (i, r) in rows.iter().enumerate() {
        let row: &EventRow = r.borrow();
        if !picks(row, input.served, input.now_ms) {
            return Err(pre(
                CLAIM,
                format!(
                    "event {} ({}, position {}) was picked but the claim rule does not take it at {} ms",
                    row.event_id, row.state, picked[i].position, input.now_ms
                ),
            ));
        }
        if let Err(why) = rollout::may_claim(input.alias, &row.destination, picked[i].facts) {
            return Err(pre(
                CLAIM,
                format!(
                    "event {} was picked but {} may not claim it: {why:?}",
                    row.event_id, input.alias.implementation.id
                ),
            ));
        }
        if let Some(j) = (0..i)
            .rev()
            .find(|&j| rows[j].borrow().destination.cluster == row.destination.cluster)
        {
            if picked[j].position > picked[i].position {
                return Err(pre(
                    CLAIM,
                    format!(
                        "positions {} then {} of cluster {} are not in commit order",
                        picked[j].position, picked[i].position, row.destination.cluster
                    ),
                ));
            }
        }
    }
    let now = input.now_ms;
    let mut step = ClaimStep {
        last_position: picked.iter().map(|p| p.position).max(),
        ..ClaimStep::default()
    };
    for (i, (r, pick)) in rows.iter_mut().zip(picked).enumerate() {
        let row: &mut EventRow = r.borrow_mut();
        let decision = rules.decide_claim(
            i,
            row,
            input.served,
            pick.earlier_unresolved,
            now,
            input.lease_ms,
        );
        let superseding = matches!(
            decision,
            ClaimDecision::Grant {
                superseding: true,
                ..
            }
        );
        let was_pending = row.state == State::Pending;
        let outcome = match decision {
            ClaimDecision::Skip => {
                return Err(pre(
                    CLAIM,
                    format!(
                        "event {} was picked but its claim decision is Skip",
                        row.event_id
                    ),
                ))
            }
            ClaimDecision::Wait => {
                step.ordering_waits += 1;
                PickOutcome::Waits
            }
            ClaimDecision::ExpireToUnknown => {
                apply_claim(row, &decision, input.owner, now)?;
                step.expired_to_unknown += 1;
                PickOutcome::ExpiredToUnknown
            }
            ClaimDecision::Grant { .. } => {
                let token = apply_claim(row, &decision, input.owner, now)?
                    .ok_or_else(|| post(CLAIM, "a grant gave no token".into()))?;
                let begin = rules
                    .decide_begin_send(i, row, token, now)
                    .map_err(|f| post(CLAIM, format!("a fresh claim was fenced: {f:?}")))?;
                apply_begin_send(row, &begin, token, pick.attempt_id, now)?;
                if row.destination.ordering == EventOrdering::PerAggregate {
                    step.ordered_from = Some(
                        step.ordered_from
                            .map_or(pick.position, |q| q.min(pick.position)),
                    );
                }
                let lease_until_ms = row.claim.as_ref().map_or(now, |c| c.lease_until_ms);
                let open = row.attempts.last();
                if row.state != State::Sending
                    || open.is_none_or(|a| {
                        a.id != pick.attempt_id || a.status != AttemptStatus::Sending
                    })
                {
                    return Err(post(
                        CLAIM,
                        format!(
                            "event {} sent without its attempt {} registered",
                            row.event_id, pick.attempt_id
                        ),
                    ));
                }
                PickOutcome::Send(Authorised {
                    token,
                    begin,
                    attempt_id: pick.attempt_id,
                    lease_until_ms,
                    superseding,
                    was_pending,
                })
            }
        };
        step.outcomes.push(outcome);
    }
    Ok(step)
}

/// The acceptance decisions, as hooks ([`CoreRules`]: the core's own).
pub trait AcceptRules {
    /// `acceptDispatchReceipt`'s verdict.
    fn decide_receipt(&mut self, row: &EventRow, r: &Receipt) -> ReceiptVerdict {
        receipt::decide_receipt(row, r)
    }

    /// Applies the verdict to the row.
    fn apply_receipt(
        &mut self,
        row: &mut EventRow,
        r: &Receipt,
        verdict: ReceiptVerdict,
        now_ms: u64,
    ) -> Result<(), TransitionError> {
        receipt::apply_receipt(row, r, verdict, now_ms)
    }
}

impl AcceptRules for CoreRules {}

/// A receipt the acceptance keeps as a row of evidence (`sealpost.receipt`). The happy
/// path's primary receipt lives in the work row alone (R10).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Evidence {
    /// A primary found by a lookup, or one the broker reported as a duplicate publish.
    Primary,
    /// A duplicate transport receipt at the primary's position.
    SamePosition,
    /// A second stored copy (a finding).
    SecondCopy,
}

impl Evidence {
    /// The `kind` stored with the receipt row.
    pub fn kind(self) -> &'static str {
        match self {
            Evidence::Primary => "primary",
            Evidence::SamePosition => "same_position",
            Evidence::SecondCopy => "second_copy",
        }
    }

    /// What, if anything, of `r` is kept as evidence after `verdict`.
    pub fn of(r: &Receipt, verdict: ReceiptVerdict) -> Option<Evidence> {
        match verdict {
            ReceiptVerdict::Primary if r.source == ReceiptSource::Lookup || r.broker_duplicate => {
                Some(Evidence::Primary)
            }
            ReceiptVerdict::Duplicate(DuplicateKind::SamePosition) => Some(Evidence::SamePosition),
            ReceiptVerdict::Duplicate(DuplicateKind::SecondCopy) => Some(Evidence::SecondCopy),
            _ => None,
        }
    }
}

/// What the acceptance did with one receipt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Acceptance {
    /// No locked row has the receipt's event id and member (an unknown or purged event, a
    /// forged id): audited.
    UnknownEvent,
    /// The verdict on the row at `row` (its index in the step's slice).
    Judged {
        /// The row's index.
        row: usize,
        /// The acceptance point's verdict.
        verdict: ReceiptVerdict,
        /// The evidence row to keep, if any.
        evidence: Option<Evidence>,
    },
}

const ACCEPT: &str = "acceptance step";

/// The locked acceptance point over `rows` (each event and member once, locked by the
/// shell) for `receipts` in order: each receipt is judged on its row as the receipts before
/// it left it (two receipts for one row compete for one slot). It does not look at claims: a
/// late ACK from an expired attempt competes like any other (R11).
///
/// Postcondition: a `Primary` verdict left its row published.
pub fn step_accept<R: BorrowMut<EventRow>>(
    rows: &mut [R],
    receipts: &[Receipt],
    now_ms: u64,
    rules: &mut impl AcceptRules,
) -> Result<Vec<Acceptance>, StepError> {
    let index = index_locked(rows, ACCEPT)?;
    let mut out = Vec::with_capacity(receipts.len());
    for r in receipts {
        let Some(&i) = index.get(&(r.event_id, r.member)) else {
            out.push(Acceptance::UnknownEvent);
            continue;
        };
        let row: &mut EventRow = rows[i].borrow_mut();
        let verdict = rules.decide_receipt(row, r);
        rules.apply_receipt(row, r, verdict, now_ms)?;
        if verdict == ReceiptVerdict::Primary && !row.state.is_published() {
            return Err(post(
                ACCEPT,
                format!(
                    "a primary receipt left event {} {}",
                    row.event_id, row.state
                ),
            ));
        }
        out.push(Acceptance::Judged {
            row: i,
            verdict,
            evidence: Evidence::of(r, verdict),
        });
    }
    Ok(out)
}

/// The slice position of each locked row by event and member; a row locked twice breaks the
/// step's precondition.
fn index_locked<R: BorrowMut<EventRow>>(
    rows: &[R],
    step: &'static str,
) -> Result<std::collections::HashMap<(crate::envelope::EventId, u16), usize>, StepError> {
    let mut index = std::collections::HashMap::with_capacity(rows.len());
    for (i, r) in rows.iter().enumerate() {
        let row: &EventRow = r.borrow();
        if index.insert((row.event_id, row.member), i).is_some() {
            return Err(pre(
                step,
                format!("event {} member {} locked twice", row.event_id, row.member),
            ));
        }
    }
    Ok(index)
}

/// The outcome-report decisions, as hooks ([`CoreRules`]: the core's own).
pub trait ReportRules {
    /// The verdict on a report.
    fn decide_send_outcome(
        &mut self,
        row: &EventRow,
        rep: &OutcomeReport,
        now_ms: u64,
        rejection_limit: u32,
    ) -> SendOutcomeDecision {
        claim::decide_send_outcome(
            row,
            rep.token,
            rep.attempt_id,
            rep.outcome,
            now_ms,
            rejection_limit,
        )
    }

    /// Applies the verdict to the row.
    fn apply_send_outcome(
        &mut self,
        row: &mut EventRow,
        decision: SendOutcomeDecision,
        rep: &OutcomeReport,
        now_ms: u64,
    ) -> Result<(), TransitionError> {
        claim::apply_send_outcome(row, decision, rep.attempt_id, rep.outcome, now_ms)
    }
}

impl ReportRules for CoreRules {}

/// What the report step did with one report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reported {
    /// The row's index in the step's slice (`None`: no such row; the verdict is an audit).
    pub row: Option<usize>,
    /// The verdict.
    pub decision: SendOutcomeDecision,
    /// The report's detail is the row's latest evidence of why it could not leave (not an
    /// audit, not an ACK timeout).
    pub records_error: bool,
    /// The row could not leave `NEVER_SENT_ALERT_COUNT` times or more: an operator alert.
    pub stuck: Option<u32>,
    /// The row is quarantined as poison, refused this many times.
    pub quarantined_after: Option<u32>,
}

/// The senders' outcome reports over `rows` (each event and member once, locked by the
/// shell), in order. A report from a claim that is no longer current, or for a row that is
/// gone, is an audit only (R9).
pub fn step_report<R: BorrowMut<EventRow>>(
    rows: &mut [R],
    reports: &[OutcomeReport],
    rejection_limit: u32,
    now_ms: u64,
    rules: &mut impl ReportRules,
) -> Result<Vec<Reported>, StepError> {
    let index = index_locked(rows, "report step")?;
    let mut out = Vec::with_capacity(reports.len());
    for rep in reports {
        let Some(&i) = index.get(&(rep.event_id, rep.member)) else {
            out.push(Reported {
                row: None,
                decision: SendOutcomeDecision::Audit(claim::Fenced::NotCurrentAttempt),
                records_error: false,
                stuck: None,
                quarantined_after: None,
            });
            continue;
        };
        let row: &mut EventRow = rows[i].borrow_mut();
        let decision = rules.decide_send_outcome(row, rep, now_ms, rejection_limit);
        rules.apply_send_outcome(row, decision, rep, now_ms)?;
        let counted = !matches!(decision, SendOutcomeDecision::Audit(_))
            && rep.outcome != SendOutcome::AckTimeout;
        out.push(Reported {
            row: Some(i),
            decision,
            records_error: counted,
            stuck: (counted
                && rep.outcome == SendOutcome::NeverSent
                && row.pacing.never_sent >= NEVER_SENT_ALERT_COUNT)
                .then_some(row.pacing.never_sent),
            quarantined_after: (decision == SendOutcomeDecision::ToQuarantine)
                .then_some(row.rejections),
        });
    }
    Ok(out)
}

/// Does the reconciler's claim take `row`? A `DISPATCH_UNKNOWN` row whose next lookup is
/// due and which no reconciler holds (or a `RECONCILING` row whose reconciler's lease ran
/// out), or a `SENDING` row whose lease ran out (it becomes `DISPATCH_UNKNOWN`).
///
/// The store reads the unknown rows in the order their lookups fell due, up to the batch,
/// and the expired `SENDING` rows among the first [`EXPIRY_FRONT_PER_BATCH`] × batch rows of
/// the dispatchable phase in claim order (cluster, commit position), up to the batch: the
/// lease is not indexed, and a dispatcher that died mid-send left its rows at the front
/// (claims go in commit order); every dispatch claim scan expires the rows it passes too.
pub fn picks_for_reconcile(row: &EventRow, now_ms: u64) -> bool {
    claim::decide_reconcile_claim(row, now_ms, 0) != ClaimDecision::Skip
}

/// How far into the claim order the reconciler's claim looks for expired `SENDING` rows, in
/// batches ([`picks_for_reconcile`]).
pub const EXPIRY_FRONT_PER_BATCH: usize = 8;

/// What the reconciler's claim did with one picked row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnknownPick {
    /// Now `RECONCILING` under this claim: the reconciler looks it up.
    Claimed {
        /// The reconciler's claim.
        token: ClaimToken,
        /// It superseded a reconciler whose lease ran out.
        superseding: bool,
    },
    /// A `SENDING` row whose lease ran out, now `DISPATCH_UNKNOWN`.
    ExpiredToUnknown,
}

/// The reconciler's claim transaction over the rows it picked. Precondition: every row is
/// one [`picks_for_reconcile`] takes at `now_ms`.
pub fn step_claim_unknown<R: BorrowMut<EventRow>>(
    rows: &mut [R],
    owner: u64,
    now_ms: u64,
    lease_ms: u64,
) -> Result<Vec<UnknownPick>, StepError> {
    const STEP: &str = "reconciler claim step";
    for r in rows.iter() {
        let row: &EventRow = r.borrow();
        if !picks_for_reconcile(row, now_ms) {
            return Err(pre(
                STEP,
                format!(
                    "event {} ({}) was picked but the reconciler's claim rule does not take it at {now_ms} ms",
                    row.event_id, row.state
                ),
            ));
        }
    }
    let mut out = Vec::with_capacity(rows.len());
    for r in rows.iter_mut() {
        let row: &mut EventRow = r.borrow_mut();
        let d = claim::decide_reconcile_claim(row, now_ms, lease_ms);
        let superseding = matches!(
            d,
            ClaimDecision::Grant {
                superseding: true,
                ..
            }
        );
        out.push(match apply_claim(row, &d, owner, now_ms)? {
            Some(token) => UnknownPick::Claimed { token, superseding },
            None => UnknownPick::ExpiredToUnknown,
        });
    }
    Ok(out)
}

/// The reconciler's decisions, as hooks ([`CoreRules`]: the core's own).
pub trait ReconcileRules: AcceptRules {
    /// The verdict on a looked-up row.
    fn decide_reconcile(
        &mut self,
        row: &EventRow,
        token: ClaimToken,
        lookup: &Lookup,
        policy: ReconcilePolicy,
        now_ms: u64,
    ) -> ReconcileDecision {
        reconcile::decide_reconcile(row, token, lookup, policy, now_ms)
    }

    /// Applies a verdict other than `Accept`.
    fn apply_reconcile(
        &mut self,
        row: &mut EventRow,
        decision: &ReconcileDecision,
        now_ms: u64,
    ) -> Result<(), TransitionError> {
        reconcile::apply_reconcile(row, decision, now_ms)
    }
}

impl ReconcileRules for CoreRules {}

/// What finishing a reconcile did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finished {
    /// The reconciler's verdict.
    pub decision: ReconcileDecision,
    /// For `Accept`: what the acceptance point did with the found copy.
    pub accepted: Option<Acceptance>,
}

/// The reconciler's verdict on `row` after its lookup (R13–R14), applied: a found copy the
/// core can tie to a registered attempt goes through [`step_accept`] (the acceptance point is
/// still the only door to `PUBLISHED`); a retry to the same destination, "stay unknown" and a
/// conflict change the row; a fenced reconciler changes nothing.
pub fn step_finish_reconcile(
    row: &mut EventRow,
    token: ClaimToken,
    lookup: &Lookup,
    policy: ReconcilePolicy,
    now_ms: u64,
    rules: &mut impl ReconcileRules,
) -> Result<Finished, StepError> {
    let decision = rules.decide_reconcile(row, token, lookup, policy, now_ms);
    let accepted = match &decision {
        ReconcileDecision::Accept(r) => Some(
            step_accept(
                std::slice::from_mut(row),
                std::slice::from_ref(r),
                now_ms,
                rules,
            )?[0],
        ),
        ReconcileDecision::Fenced(_) => None,
        other => {
            rules.apply_reconcile(row, other, now_ms)?;
            None
        }
    };
    Ok(Finished { decision, accepted })
}

/// May `receipt` take the guarded fast path? Only an ordinary first ACK: from the sender,
/// not reported as a broker duplicate, and the only receipt for its row in the submission.
/// Everything else (lookups, duplicates, several receipts for one row) takes the locked
/// acceptance.
pub fn guarded_eligible(receipt: &Receipt, receipts_for_row: usize) -> bool {
    receipts_for_row == 1 && receipt.source == ReceiptSource::Ack && !receipt.broker_duplicate
}

/// The guarded acceptance of `receipt` on `held`, the row exactly as the dispatcher's claim
/// wrote it: the core's acceptance decision ([`receipt::decide_receipt`], or the caller's
/// variation of it) and [`receipt::apply_receipt`] on that row. Returns the row the guarded
/// write stores, or `None` when the receipt must take the locked path: not eligible, not a
/// `Primary` verdict, or one that would archive an attempt (the guarded write changes the
/// work row alone).
///
/// The shell writes the result only if the stored row is still `held` (PostgreSQL: the row
/// version's `xmin` is still the claim's transaction); if anyone wrote the row since, the
/// receipt takes the locked path, whose decision on an unchanged row is this one.
pub fn step_guarded(
    held: &EventRow,
    r: &Receipt,
    receipts_for_row: usize,
    now_ms: u64,
    decide: impl FnOnce(&EventRow, &Receipt) -> ReceiptVerdict,
) -> Result<Option<EventRow>, StepError> {
    if !guarded_eligible(r, receipts_for_row) {
        return Ok(None);
    }
    let v = decide(held, r);
    if v != ReceiptVerdict::Primary {
        return Ok(None);
    }
    let mut after = held.clone();
    receipt::apply_receipt(&mut after, r, v, now_ms)?;
    if after.attempts.len() != held.attempts.len() {
        return Ok(None);
    }
    if !after.state.is_published() || after.primary.is_none() {
        return Err(post(
            "guarded acceptance",
            format!(
                "a primary receipt left event {} {}",
                after.event_id, after.state
            ),
        ));
    }
    Ok(Some(after))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::{Destination, EventId, PartitionAlgorithm};
    use crate::row::Claim;

    fn row(n: u8, cluster: &str) -> EventRow {
        let destination = Destination {
            cluster: cluster.into(),
            topic: "T".into(),
            routing_key: "k".into(),
            partition_algorithm: PartitionAlgorithm::None,
            route_policy_generation: 1,
            serializer: "json".into(),
            durability: "replicated".into(),
            required_ack: "all".into(),
            ordering: EventOrdering::Unordered,
        };
        EventRow::new_pending(EventId([n; 16]), 0, crate::Digest([n; 32]), destination)
    }

    fn pick(position: u64) -> Pick<'static> {
        Pick {
            position,
            earlier_unresolved: false,
            attempt_id: 100 + position,
            facts: ClaimFacts::PLAIN,
        }
    }

    fn input(batch_max: usize) -> ClaimInput<'static> {
        ClaimInput {
            owner: 7,
            served: Served::Every,
            now_ms: 1_000,
            lease_ms: 500,
            batch_max,
            alias: AliasCheck {
                implementation: rollout::Implementation::this_build(),
                aliases: &[],
            },
        }
    }

    #[test]
    fn every_phase_has_one_code_and_settled_is_published() {
        let mut codes: Vec<i16> = Phase::ALL.iter().map(|p| p.code()).collect();
        codes.dedup();
        assert_eq!(codes, vec![0, 1, 2, 3]);
        for s in State::ALL {
            assert_eq!(s.is_published(), s.phase() == Phase::Settled, "{s}");
            assert_eq!(s.is_unknown(), s.phase() == Phase::Unknown, "{s}");
        }
    }

    #[test]
    fn a_claim_refuses_a_row_the_alias_gives_another_implementation() {
        use crate::rollout::{Alias, Implementation, Switch};
        let mut rows = vec![row(1, "c")];
        let d0 = &rows[0].destination;
        let a0 = Alias::new("orders", &d0.cluster, &d0.topic, "old");
        let Ok(Switch::To(shadow)) = a0.shadow("new") else {
            panic!()
        };
        let aliases = [shadow];
        let new = Implementation::new("new").unwrap();
        let old = Implementation::new("old").unwrap();
        let mut inp = input(10);
        inp.alias = AliasCheck {
            implementation: &new,
            aliases: &aliases,
        };
        let e = step_claim(&mut rows, &[pick(1)], &inp, &mut CoreRules).unwrap_err();
        assert!(e.to_string().contains("new may not claim"), "{e}");
        assert_eq!(rows[0].state, State::Pending, "refused before any change");
        inp.alias.implementation = &old;
        let step = step_claim(&mut rows, &[pick(1)], &inp, &mut CoreRules).unwrap();
        assert_eq!(step.sends().count(), 1);
        // A row of a later protocol is nobody's here.
        let mut later = vec![row(2, "c")];
        let mut p = pick(2);
        p.facts.protocol = rollout::PROTOCOL_VERSION + 1;
        assert!(step_claim(&mut later, &[p], &inp, &mut CoreRules).is_err());
    }

    #[test]
    fn the_pick_is_the_claim_rule_minus_skips() {
        let mut r = row(1, "c");
        assert!(picks(&r, Served::Every, 1_000));
        r.pacing.not_before_ms = 1_001;
        assert!(!picks(&r, Served::Every, 1_000), "backoff not over");
        r.pacing.not_before_ms = 1_000;
        assert!(picks(&r, Served::Every, 1_000));
        assert!(!picks(&r, Served::Only(&["d".to_string()]), 1_000));
        r.state = State::Sending;
        r.claim = Some(Claim {
            owner: 1,
            generation: 1,
            lease_until_ms: 1_001,
        });
        assert!(!picks(&r, Served::Every, 1_000), "lease still running");
        assert!(picks(&r, Served::Every, 1_001), "lease over: expires");
        for s in [State::DispatchUnknown, State::Published, State::Quarantined] {
            r.state = s;
            assert!(!picks(&r, Served::Every, 5_000), "{s}");
        }
    }

    #[test]
    fn a_claim_sends_expires_and_waits_and_counts_each_against_the_batch() {
        let mut rows = vec![row(1, "c"), row(2, "c"), row(3, "c")];
        rows[1].state = State::Sending;
        rows[1].claim = Some(Claim {
            owner: 1,
            generation: 1,
            lease_until_ms: 900,
        });
        rows[1].claim_generation = 1;
        rows[2].destination.ordering = EventOrdering::PerAggregate;
        let mut picked = vec![pick(1), pick(2), pick(3)];
        picked[2].earlier_unresolved = true;
        let step = step_claim(&mut rows, &picked, &input(3), &mut CoreRules).unwrap();
        assert!(
            matches!(step.outcomes[0], PickOutcome::Send(a) if a.attempt_id == 101 && a.was_pending)
        );
        assert_eq!(step.outcomes[1], PickOutcome::ExpiredToUnknown);
        assert_eq!(step.outcomes[2], PickOutcome::Waits);
        assert_eq!((step.expired_to_unknown, step.ordering_waits), (1, 1));
        assert_eq!(step.last_position, Some(3));
        assert_eq!(step.ordered_from, None);
        assert_eq!(rows[0].state, State::Sending);
        assert_eq!(rows[1].state, State::DispatchUnknown);
        assert_eq!(rows[2].state, State::Pending);
    }

    #[test]
    fn a_claim_refuses_rows_the_rule_would_skip_too_many_rows_and_rows_out_of_order() {
        let mut rows = vec![row(1, "c"), row(2, "c")];
        rows[1].pacing.not_before_ms = 5_000;
        let e = step_claim(&mut rows, &[pick(1), pick(2)], &input(2), &mut CoreRules);
        assert!(matches!(e, Err(StepError::Precondition { .. })), "{e:?}");
        assert_eq!(rows[0].state, State::Pending, "nothing changed");
        rows[1].pacing.not_before_ms = 0;
        let e = step_claim(&mut rows, &[pick(1), pick(2)], &input(1), &mut CoreRules);
        assert!(matches!(e, Err(StepError::Precondition { .. })), "{e:?}");
        let e = step_claim(&mut rows, &[pick(2), pick(1)], &input(2), &mut CoreRules);
        assert!(matches!(e, Err(StepError::Precondition { .. })), "{e:?}");
        assert_eq!(rows[0].state, State::Pending, "nothing changed");
        // Positions order within a cluster only: another cluster may start lower.
        rows[1].destination.cluster = "b".into();
        let ok = step_claim(&mut rows, &[pick(2), pick(1)], &input(2), &mut CoreRules).unwrap();
        assert_eq!(ok.sends().count(), 2);
    }

    fn sent_row(n: u8) -> EventRow {
        let mut rows = vec![row(n, "c")];
        let st = step_claim(&mut rows, &[pick(1)], &input(1), &mut CoreRules).unwrap();
        assert_eq!(st.sends().count(), 1);
        rows.pop().unwrap()
    }

    fn ack(r: &EventRow, sequence: u64) -> Receipt {
        Receipt {
            event_id: r.event_id,
            member: r.member,
            envelope_generation: r.envelope_generation,
            attempt_id: 101,
            payload_digest: r.payload_digest,
            destination_digest: r.destination_digest,
            cluster: r.destination.cluster.clone(),
            stream: r.destination.topic.clone(),
            partition: None,
            sequence,
            broker_duplicate: false,
            source: ReceiptSource::Ack,
        }
    }

    #[test]
    fn receipts_for_one_row_compete_for_its_slot_in_order() {
        let mut rows = vec![sent_row(1)];
        let first = ack(&rows[0], 5);
        let again = ack(&rows[0], 5);
        let mut stranger = ack(&rows[0], 6);
        stranger.event_id = EventId([9; 16]);
        let out = step_accept(&mut rows, &[first, again, stranger], 2_000, &mut CoreRules).unwrap();
        assert_eq!(
            out,
            vec![
                Acceptance::Judged {
                    row: 0,
                    verdict: ReceiptVerdict::Primary,
                    evidence: None
                },
                Acceptance::Judged {
                    row: 0,
                    verdict: ReceiptVerdict::Duplicate(DuplicateKind::SamePosition),
                    evidence: Some(Evidence::SamePosition)
                },
                Acceptance::UnknownEvent,
            ]
        );
        assert!(rows[0].state.is_published());
        let twice = vec![rows[0].clone(), rows[0].clone()];
        let e = step_accept(&mut twice.clone(), &[], 0, &mut CoreRules);
        assert!(matches!(e, Err(StepError::Precondition { .. })), "{e:?}");
    }

    #[test]
    fn the_guarded_step_takes_only_an_ordinary_first_ack() {
        let held = sent_row(1);
        let r = ack(&held, 5);
        let after = step_guarded(&held, &r, 1, 2_000, receipt::decide_receipt)
            .unwrap()
            .expect("guarded");
        assert!(after.state.is_published());
        assert_eq!(
            step_guarded(&held, &r, 2, 2_000, receipt::decide_receipt),
            Ok(None)
        );
        let mut dup = r.clone();
        dup.broker_duplicate = true;
        assert_eq!(
            step_guarded(&held, &dup, 1, 2_000, receipt::decide_receipt),
            Ok(None)
        );
        let mut forged = r.clone();
        forged.payload_digest = crate::Digest([0; 32]);
        assert_eq!(
            step_guarded(&held, &forged, 1, 2_000, receipt::decide_receipt),
            Ok(None)
        );
    }

    #[test]
    fn the_reconciler_claims_due_unknowns_and_expires_stale_sends_only() {
        let mut unknown = sent_row(1);
        let mut sending = sent_row(2);
        // Both leases (500 ms from 1,000) are over at 2,000.
        let rep = OutcomeReport {
            event_id: unknown.event_id,
            member: 0,
            token: unknown
                .claim
                .as_ref()
                .map(|c| ClaimToken {
                    owner: c.owner,
                    generation: c.generation,
                })
                .unwrap(),
            attempt_id: 101,
            outcome: SendOutcome::AckTimeout,
            detail: String::new(),
        };
        let out = step_report(
            std::slice::from_mut(&mut unknown),
            &[rep],
            3,
            1_200,
            &mut CoreRules,
        )
        .unwrap();
        assert_eq!(out[0].decision, SendOutcomeDecision::ToUnknown);
        assert!(
            !out[0].records_error,
            "an ACK timeout is no reason a row cannot leave"
        );
        assert!(picks_for_reconcile(&unknown, 2_000));
        assert!(picks_for_reconcile(&sending, 2_000));
        assert!(
            !picks_for_reconcile(&sending, 1_200),
            "its lease still runs"
        );
        let mut rows = vec![&mut unknown, &mut sending];
        let got = step_claim_unknown(&mut rows, 9, 2_000, 1_000).unwrap();
        assert!(matches!(
            got[0],
            UnknownPick::Claimed {
                superseding: false,
                ..
            }
        ));
        assert_eq!(got[1], UnknownPick::ExpiredToUnknown);
        assert_eq!(unknown.state, State::Reconciling);
        assert_eq!(sending.state, State::DispatchUnknown);
        let mut pending = vec![row(3, "c")];
        let e = step_claim_unknown(&mut pending, 9, 2_000, 1_000);
        assert!(matches!(e, Err(StepError::Precondition { .. })), "{e:?}");
    }

    #[test]
    fn an_earlier_version_holds_back_while_ordered_and_unresolved() {
        let mut r = row(1, "c");
        assert!(!holds_back(&r), "unordered");
        r.destination.ordering = EventOrdering::PerAggregate;
        for s in State::ALL {
            r.state = s;
            assert_eq!(holds_back(&r), !s.is_published(), "{s}");
        }
    }
}
