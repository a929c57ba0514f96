//! The dispatcher as a sans-IO state machine (the `quinn-proto` shape). It decides *when* to
//! claim, what deadline a send carries, how each broker answer becomes a receipt or an
//! outcome report, and when to retry a failed receipt transaction. It never sleeps, reads a
//! clock or touches a socket: the tokio shell (`sealpost::runtime`) and the simulator both
//! feed it what happened (`handle_*`, with the time injected) and ask it what to do next
//! ([`DispatcherMachine::poll_action`], [`DispatcherMachine::poll_timeout`]). The simulator
//! therefore runs the same scheduling, batching, deadlines and retries that production runs.
//!
//! One batch is in flight at a time: claim (one short transaction that also registers every
//! attempt), send before the deadline (no transaction open), submit receipts and outcome
//! reports (one transaction). Times are milliseconds of the shell's monotonic clock, except
//! where a name says `db_`.

use std::collections::VecDeque;

use crate::claim::{ClaimToken, SendOutcome};
use crate::envelope::EventId;
use crate::port::{Capabilities, NeverSentReason, RefusalKind, SendRequest, SendResult};
use crate::receipt::Receipt;

/// Limits and timings of one dispatcher.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DispatcherConfig {
    /// Rows claimed per claim transaction.
    pub batch_size_max: usize,
    /// Claim lease (database clock).
    pub lease_ms: u64,
    /// A send must leave at least this long before its lease ends; the room left for the
    /// broker's answer. The batch deadline is the lease end minus this margin.
    pub send_margin_ms: u64,
    /// Sleep when a claim found nothing.
    pub idle_poll_ms: u64,
    /// Wait after a failed claim or receipt transaction; it doubles with each failure in a
    /// row ([`crate::subscription::backoff_ms`]).
    pub error_backoff_ms: u64,
    /// The longest wait while the database keeps failing.
    pub error_backoff_max_ms: u64,
    /// Receipt transactions the database refused before the batch is left to the
    /// reconciler (tries that could not reach the database do not count:
    /// [`DispatcherMachine::handle_submit_unreachable`]).
    pub submit_tries_max: u32,
    /// A claim scans from the commit position after its previous batch (the rows before it
    /// were claimed, are in flight, or wait out a backoff), so it does not walk the queue's
    /// dead head again and again; at least this often it scans from the start instead, and
    /// finds whatever became claimable behind the position: a transaction that committed
    /// late with a lower position, a released row, a backoff that ended, a lease that ran
    /// out.
    pub rescan_every_ms: u64,
}

impl Default for DispatcherConfig {
    fn default() -> Self {
        DispatcherConfig {
            batch_size_max: 500,
            lease_ms: 10_000,
            send_margin_ms: 5_000,
            idle_poll_ms: 50,
            error_backoff_ms: 500,
            error_backoff_max_ms: 10_000,
            submit_tries_max: 5,
            rescan_every_ms: 1_000,
        }
    }
}

impl DispatcherConfig {
    /// Whether a message can ever leave under this lease at a broker with `caps`: the send
    /// window (the lease less [`DispatcherConfig::send_margin_ms`]) must be longer than the
    /// adapter's [`Capabilities::handover_margin_ms`] ([`crate::port::may_leave`]), else
    /// every send ends "deadline passed" and every row stays `PENDING` for good. `Err` says
    /// what to change.
    pub fn fits(&self, caps: &Capabilities) -> Result<(), String> {
        let window = self.lease_ms.saturating_sub(self.send_margin_ms);
        if window > caps.handover_margin_ms {
            return Ok(());
        }
        Err(format!(
            "lease_ms ({}) less ack_timeout_ms ({}) leaves {window} ms to send, but this broker's adapter hands a message over only while more than {} ms of it are left, so nothing would ever leave; raise lease_ms (or lower ack_timeout_ms) so that lease_ms - ack_timeout_ms > {}",
            self.lease_ms, self.send_margin_ms, caps.handover_margin_ms, caps.handover_margin_ms
        ))
    }
}

/// The local time by which a send must have left: the lease end (database clock) mapped onto
/// the local clock, minus the margin. `claim_started_ms` is read *before* the claim
/// transaction starts, so the mapping errs early: the local clock cannot reach the lease end
/// before the database clock does (equal clock rates assumed; the margin absorbs drift).
pub fn send_deadline_ms(
    claim_started_ms: u64,
    db_now_ms: u64,
    db_lease_until_ms: u64,
    send_margin_ms: u64,
) -> u64 {
    claim_started_ms + db_lease_until_ms.saturating_sub(db_now_ms + send_margin_ms)
}

/// One send the claim transaction authorised (the attempt is registered).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimedSend {
    /// What goes on the wire.
    pub request: SendRequest,
    /// The claim to present with the outcome report.
    pub token: ClaimToken,
    /// Lease end of the claim (database clock).
    pub db_lease_until_ms: u64,
}

/// What a claim transaction returned.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Claimed {
    /// Local time read just before the claim transaction started.
    pub claim_started_ms: u64,
    /// The database clock inside the claim transaction.
    pub db_now_ms: u64,
    /// Sends authorised, in claim order.
    pub sends: Vec<ClaimedSend>,
    /// The highest commit position the claim scan locked (claimed or moved to unknown);
    /// `None` if it found nothing.
    pub last_position: Option<u64>,
    /// The lowest commit position among the sends bound for a per-aggregate-ordered
    /// destination (R29). Their successors wait behind them and are committed after them;
    /// once this batch is submitted the next claim scans from here, so a successor that
    /// became claimable is found at once and not only at the next full scan.
    pub ordered_from: Option<u64>,
    /// What the database said about its transactions when the claim began (`None`: not
    /// read; the scan position then moves as if none were in progress).
    pub horizon: Option<Horizon>,
}

/// The database's transactions as a claim saw them, read at its start: a snapshot's bounds
/// and, after that snapshot was taken, the commit-position sequence's last value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Horizon {
    /// `pg_snapshot_xmin`: every transaction with a lower id had ended.
    pub xmin: u64,
    /// `pg_snapshot_xmax`: every transaction that had an id had a lower one.
    pub xmax: u64,
    /// The last commit position drawn (`pg_sequence_last_value`; 0 if none was).
    pub last_position: u64,
}

/// Which commit positions are final: every transaction that could still commit a row with
/// such a position has ended, so a scan from behind them finds whatever they committed.
///
/// Positions are drawn from a sequence when a row is inserted, and the transaction commits
/// later: a transaction that drew a lower position can commit after one that drew a higher
/// one, whose rows a claim already took. Its rows then lie behind the dispatcher's scan
/// position. The rule, from two claims on one connection:
/// * a producer's transaction has its id before it draws a position (`enqueue` reads
///   `txid_current()` first), so a position drawn before claim *k* read the sequence
///   belongs to a transaction whose id is below the `xmax` of any snapshot taken after that
///   read, such as claim *k + 1*'s;
/// * once a later snapshot's `xmin` reaches that `xmax`, all of those transactions have
///   ended: every position up to claim *k*'s reading is final.
///
/// A claim never scans from past the final positions unless they are far behind
/// ([`DispatcherMachine::scan_position`]), so such a row is found by the next claim after
/// its transaction ends, not by the next full scan. The horizon only ever moves a scan
/// *back*: the full scan every [`DispatcherConfig::rescan_every_ms`] stays the backstop.
#[derive(Clone, Debug, Default)]
pub struct ScanHorizon {
    /// The previous claim's sequence reading, waiting for a later snapshot's `xmax`.
    pending: Option<u64>,
    /// (`xmax` of a snapshot taken after the reading, the reading), in claim order.
    marks: VecDeque<(u64, u64)>,
    /// Every position up to this one is final.
    final_through: Option<u64>,
}

/// Marks kept at most; beyond it the oldest go (the final positions then advance later,
/// never wrongly).
const HORIZON_MARKS_MAX: usize = 4_096;

impl ScanHorizon {
    /// Takes a claim's horizon; returns the highest position up to which all are final
    /// (`None`: none is known to be, so a scan must start from the beginning).
    pub fn observe(&mut self, h: Horizon) -> Option<u64> {
        if let Some(reading) = self.pending.replace(h.last_position) {
            self.marks.push_back((h.xmax, reading));
            if self.marks.len() > HORIZON_MARKS_MAX {
                self.marks.pop_front();
            }
        }
        while let Some(&(xmax, reading)) = self.marks.front() {
            if xmax > h.xmin {
                break;
            }
            self.final_through = Some(self.final_through.map_or(reading, |f| f.max(reading)));
            self.marks.pop_front();
        }
        self.final_through
    }
}

/// A sender's report on its own attempt, without a receipt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutcomeReport {
    /// Event id.
    pub event_id: EventId,
    /// Member.
    pub member: u16,
    /// The claim the send was made under.
    pub token: ClaimToken,
    /// Attempt.
    pub attempt_id: u64,
    /// Outcome.
    pub outcome: SendOutcome,
    /// The broker's or adapter's words, kept as evidence (`last_error`, quarantine reason).
    pub detail: String,
}

/// Receipts and outcome reports that commit in one transaction.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Submission {
    /// Receipts for the acceptance point.
    pub receipts: Vec<Receipt>,
    /// Outcome reports.
    pub reports: Vec<OutcomeReport>,
}

impl Submission {
    /// True when there is nothing to write.
    pub fn is_empty(&self) -> bool {
        self.receipts.is_empty() && self.reports.is_empty()
    }
}

/// What the shell must do next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DispatchAction {
    /// Run one claim transaction for at most this many rows; answer with
    /// [`DispatcherMachine::handle_claimed`] or [`DispatcherMachine::handle_claim_failed`].
    Claim {
        /// Batch size.
        batch_size_max: usize,
        /// Scan only rows at or after this commit position (0: the whole queue).
        from_position: u64,
    },
    /// Send the batch, no message after `deadline_ms`; answer with
    /// [`DispatcherMachine::handle_sent`].
    Send {
        /// Requests, in order.
        batch: Vec<SendRequest>,
        /// Local time after which nothing may leave.
        deadline_ms: u64,
    },
    /// Commit receipts and reports in one transaction; answer with
    /// [`DispatcherMachine::handle_submitted`].
    Submit(Submission),
}

/// Counts of what the machine saw, for progress lines and metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DispatchCounts {
    /// Batches claimed (non-empty).
    pub batches: u64,
    /// Receipts handed to the acceptance point.
    pub receipts: u64,
    /// Sends with no answer (unknown outcome).
    pub no_answer: u64,
    /// Sends refused by a create-if-absent broker because a copy exists.
    pub already_stored: u64,
    /// Sends that never left (deadline, connection, missing destination).
    pub never_sent: u64,
    /// Of those, because the deadline had passed.
    pub deadline_passed: u64,
    /// Permanent refusals.
    pub refused: u64,
    /// Receipt transactions given up after every retry (left to the reconciler).
    pub submits_abandoned: u64,
    /// Claims that scanned from the start (the rescan period was over).
    pub full_scans: u64,
}

/// What each send of a batch carries into its outcome report.
type SendMeta = (ClaimToken, EventId, u16, u64);

/// A claimed batch waiting for the wire (the previous batch is still on it).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Ready {
    sends: Vec<SendMeta>,
    batch: Vec<SendRequest>,
    deadline_ms: u64,
}

/// A submission waiting for its transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Submitting {
    submission: Submission,
    tries: u32,
    /// When to (re)issue it.
    due_ms: u64,
    issued: bool,
    /// Claim again this long after the submission commits: at once after a batch, the error
    /// backoff when the broker could not be reached (else the whole backlog would cycle
    /// through "never sent").
    next_claim_in_ms: u64,
}

/// The dispatcher state machine: a two-stage pipeline. While one batch is on the wire the
/// next one is claimed, so the database and the broker work at the same time; the database
/// work (claim, submission) is one transaction at a time, on one connection, and no
/// transaction is open across a send.
#[derive(Clone, Debug)]
pub struct DispatcherMachine {
    cfg: DispatcherConfig,
    /// The next claim is not due before this.
    wake_at_ms: u64,
    /// A claim transaction is running.
    claiming: bool,
    /// Claimed, waiting for the wire.
    ready: Option<Ready>,
    /// On the wire.
    wire: Option<Vec<SendMeta>>,
    /// A submission running or waiting to be retried.
    submitting: Option<Submitting>,
    /// Receipts that arrived after their batch was settled (late ACKs, R11).
    late: VecDeque<Receipt>,
    counts: DispatchCounts,
    /// Where the next claim scan starts (see [`DispatcherConfig::rescan_every_ms`]).
    scan_from: u64,
    /// When the next claim scans from the start.
    full_scan_at_ms: u64,
    /// Told to stop: finishes what it holds, claims nothing more.
    stopping: bool,
    /// [`Claimed::ordered_from`] of the batches not yet submitted.
    ordered_resume: Option<u64>,
    /// Which positions are final, from the claims' horizons.
    horizon: ScanHorizon,
    /// Every position before this one is final (`u64::MAX` until a claim read a horizon).
    final_before: u64,
    /// The previous claim's rows all waited (R29): the next claim scans on after them, not
    /// from behind them again.
    scan_on: bool,
    /// Database failures in a row (claims, receipt transactions, the database unreachable):
    /// the backoff grows with them and resets on the next success.
    failures_in_row: u32,
}

impl DispatcherMachine {
    /// A machine that claims at `now_ms`.
    pub fn new(cfg: DispatcherConfig, now_ms: u64) -> DispatcherMachine {
        DispatcherMachine {
            cfg,
            wake_at_ms: now_ms,
            claiming: false,
            ready: None,
            wire: None,
            submitting: None,
            late: VecDeque::new(),
            counts: DispatchCounts::default(),
            scan_from: 0,
            full_scan_at_ms: now_ms,
            stopping: false,
            ordered_resume: None,
            horizon: ScanHorizon::default(),
            final_before: u64::MAX,
            scan_on: false,
            failures_in_row: 0,
        }
    }

    /// Where the next claim scans from: after its previous batch, or, if positions before
    /// that are not known to be final (a transaction that drew one may still commit, and
    /// its rows would wait for the full scan), from the first of those. A window wider than
    /// ten batches (a long transaction holds the horizon back) is left to the full scan.
    fn scan_position(&self) -> u64 {
        let behind = self.scan_from.saturating_sub(self.final_before);
        if behind > 0 && behind <= 10 * self.cfg.batch_size_max.max(1) as u64 {
            self.final_before
        } else {
            self.scan_from
        }
    }

    /// The wait after one more database failure in a row.
    fn next_backoff_ms(&mut self) -> u64 {
        self.failures_in_row = self.failures_in_row.saturating_add(1);
        crate::subscription::backoff_ms(
            self.cfg.error_backoff_ms,
            self.cfg.error_backoff_max_ms,
            self.failures_in_row,
        )
    }

    /// Stop: the batches in hand are sent and submitted, no new claim starts. The shell
    /// stops once [`DispatcherMachine::is_idle`].
    pub fn handle_stop(&mut self) {
        self.stopping = true;
    }

    /// What the machine saw so far.
    pub fn counts(&self) -> DispatchCounts {
        self.counts
    }

    /// True while no claim, send or submission is outstanding (safe to stop).
    pub fn is_idle(&self) -> bool {
        !self.claiming
            && self.ready.is_none()
            && self.wire.is_none()
            && self.submitting.is_none()
            && self.late.is_empty()
    }

    /// True while a batch is on the wire (its answer comes through
    /// [`DispatcherMachine::handle_sent`]).
    pub fn is_sending(&self) -> bool {
        self.wire.is_some()
    }

    /// The next action, if one is due at `now_ms`. Call until it returns `None`, then wait
    /// for an answer or until [`DispatcherMachine::poll_timeout`]. A `Send` may be returned
    /// while a claim or a submission runs (they use the database, it the broker); a claim or
    /// a submission never while the other runs.
    pub fn poll_action(&mut self, now_ms: u64) -> Option<DispatchAction> {
        if self.wire.is_none() {
            if let Some(r) = self.ready.take() {
                self.wire = Some(r.sends);
                return Some(DispatchAction::Send {
                    batch: r.batch,
                    deadline_ms: r.deadline_ms,
                });
            }
        }
        if self.claiming {
            return None;
        }
        if let Some(sub) = &mut self.submitting {
            if !sub.issued && now_ms >= sub.due_ms {
                sub.issued = true;
                return Some(DispatchAction::Submit(sub.submission.clone()));
            }
            return None;
        }
        if !self.late.is_empty() {
            // Late receipts first: they may fill a slot (R11).
            let submission = Submission {
                receipts: self.late.drain(..).collect(),
                reports: Vec::new(),
            };
            self.submitting = Some(Submitting {
                submission: submission.clone(),
                tries: 1,
                due_ms: now_ms,
                issued: true,
                next_claim_in_ms: self.wake_at_ms.saturating_sub(now_ms),
            });
            return Some(DispatchAction::Submit(submission));
        }
        if self.ready.is_none() && !self.stopping && now_ms >= self.wake_at_ms {
            self.claiming = true;
            if now_ms >= self.full_scan_at_ms {
                self.scan_from = 0;
                self.full_scan_at_ms = now_ms + self.cfg.rescan_every_ms;
                self.counts.full_scans += 1;
            }
            let from_position = if std::mem::take(&mut self.scan_on) {
                self.scan_from
            } else {
                self.scan_position()
            };
            return Some(DispatchAction::Claim {
                batch_size_max: self.cfg.batch_size_max,
                from_position,
            });
        }
        None
    }

    /// When the machine wants to be polled again without any answer arriving.
    pub fn poll_timeout(&self) -> Option<u64> {
        if self.claiming {
            return None;
        }
        match &self.submitting {
            Some(Submitting {
                issued: false,
                due_ms,
                ..
            }) => Some(*due_ms),
            Some(_) => None,
            None if self.ready.is_none() && !self.stopping => Some(self.wake_at_ms),
            None => None,
        }
    }

    /// New work was committed (LISTEN/NOTIFY): claim now if waiting.
    pub fn handle_notify(&mut self, now_ms: u64) {
        self.wake_at_ms = self.wake_at_ms.min(now_ms);
    }

    /// The claim transaction committed. Returns the send action at once if the batch is not
    /// empty and the wire is free (the same one [`DispatcherMachine::poll_action`] would
    /// return); otherwise the batch waits for the wire.
    pub fn handle_claimed(&mut self, now_ms: u64, claimed: Claimed) -> Option<DispatchAction> {
        debug_assert!(self.claiming);
        self.claiming = false;
        self.failures_in_row = 0;
        if let Some(p) = claimed.last_position {
            // Everything before it was claimed, is in flight or waits: the next scan starts
            // after it until the next full scan.
            self.scan_from = self.scan_from.max(p + 1);
        }
        if let Some(h) = claimed.horizon {
            // ... but not past positions that are not known to be final
            // ([`DispatcherMachine::scan_position`]).
            self.final_before = self.horizon.observe(h).map_or(0, |f| f + 1);
        }
        if let Some(p) = claimed.ordered_from {
            self.ordered_resume = Some(self.ordered_resume.map_or(p, |q| q.min(p)));
        }
        if claimed.sends.is_empty() {
            // Rows were found but none could be sent (they wait for an earlier event of
            // their aggregate, R29): scan on behind them at once instead of idling. Each such
            // claim scans from `scan_from` (not from behind it, where the waiting rows still
            // are while the horizon lags) and moves it forward, so this ends with a claim
            // that finds nothing.
            self.scan_on = claimed.last_position.is_some();
            self.wake_at_ms = if self.scan_on {
                now_ms
            } else {
                now_ms + self.cfg.idle_poll_ms
            };
            return None;
        }
        self.counts.batches += 1;
        let lease_until = claimed
            .sends
            .iter()
            .map(|s| s.db_lease_until_ms)
            .min()
            .unwrap_or(claimed.db_now_ms);
        let deadline_ms = send_deadline_ms(
            claimed.claim_started_ms,
            claimed.db_now_ms,
            lease_until,
            self.cfg.send_margin_ms,
        );
        let mut sends = Vec::with_capacity(claimed.sends.len());
        let mut batch = Vec::with_capacity(claimed.sends.len());
        for s in claimed.sends {
            sends.push((
                s.token,
                s.request.event_id,
                s.request.member,
                s.request.attempt_id,
            ));
            batch.push(s.request);
        }
        self.ready = Some(Ready {
            sends,
            batch,
            deadline_ms,
        });
        // The next claim waits until this batch is on the wire and the one before it settled.
        self.wake_at_ms = now_ms;
        if self.wire.is_none() {
            return self.poll_action(now_ms);
        }
        None
    }

    /// The claim transaction failed (database down or unreachable, serialization failure):
    /// try again after a backoff that grows while the failures go on. The shell does not
    /// sleep or loop on reconnects itself: it reconnects when the machine asks for the next
    /// claim or receipt transaction.
    pub fn handle_claim_failed(&mut self, now_ms: u64) {
        self.claiming = false;
        self.wake_at_ms = now_ms + self.next_backoff_ms();
    }

    /// Every message of the batch on the wire has an outcome (`results` in request order).
    /// Returns the submission to commit, unless a claim is running (then
    /// [`DispatcherMachine::poll_action`] returns it once the claim is answered).
    pub fn handle_sent(&mut self, now_ms: u64, results: Vec<SendResult>) -> Option<DispatchAction> {
        let Some(sends) = self.wire.take() else {
            debug_assert!(false, "handle_sent without a batch on the wire");
            return None;
        };
        debug_assert_eq!(sends.len(), results.len());
        let mut submission = Submission::default();
        let unreachable = results
            .iter()
            .any(|r| matches!(r, SendResult::NeverSent(NeverSentReason::NotConnected(_))));
        for ((token, event_id, member, attempt_id), result) in sends.into_iter().zip(results) {
            let report = |outcome: SendOutcome, detail: String| OutcomeReport {
                event_id,
                member,
                token,
                attempt_id,
                outcome,
                detail,
            };
            match classify(result) {
                Classified::Receipt(r) => {
                    self.counts.receipts += 1;
                    submission.receipts.push(r);
                }
                Classified::Report(outcome, detail) => {
                    match outcome {
                        SendOutcome::AckTimeout if detail == ALREADY_STORED => {
                            self.counts.already_stored += 1
                        }
                        SendOutcome::AckTimeout => self.counts.no_answer += 1,
                        SendOutcome::NeverSent => {
                            self.counts.never_sent += 1;
                            if detail == DEADLINE_PASSED {
                                self.counts.deadline_passed += 1;
                            }
                        }
                        SendOutcome::Rejected => self.counts.refused += 1,
                    }
                    submission.reports.push(report(outcome, detail));
                }
            }
        }
        submission.receipts.extend(self.late.drain(..));
        let next_claim_in_ms = if unreachable {
            self.cfg.error_backoff_ms
        } else {
            0
        };
        if let Some(prev) = &mut self.submitting {
            // The previous batch's submission is still waiting for a retry: this one joins
            // it (one transaction for both; nothing is dropped).
            prev.submission.receipts.extend(submission.receipts);
            prev.submission.reports.extend(submission.reports);
            prev.next_claim_in_ms = prev.next_claim_in_ms.max(next_claim_in_ms);
            return None;
        }
        let issue = !self.claiming;
        self.submitting = Some(Submitting {
            submission: submission.clone(),
            tries: 1,
            due_ms: now_ms,
            issued: issue,
            next_claim_in_ms,
        });
        if unreachable {
            self.wake_at_ms = self.wake_at_ms.max(now_ms + self.cfg.error_backoff_ms);
        }
        issue.then_some(DispatchAction::Submit(submission))
    }

    /// A receipt arrived after its batch was settled (a late ACK): it goes to the acceptance
    /// point with the next submission, never dropped (R11).
    pub fn handle_late_receipt(&mut self, receipt: Receipt) {
        if receipt.sequence != 0 {
            self.late.push_back(receipt);
        }
    }

    /// The submission's transaction committed (`ok`) or failed.
    pub fn handle_submitted(&mut self, now_ms: u64, ok: bool) {
        let Some(sub) = &mut self.submitting else {
            debug_assert!(false, "handle_submitted without a submission");
            return;
        };
        if ok {
            self.failures_in_row = 0;
            self.wake_at_ms = self.wake_at_ms.max(now_ms + sub.next_claim_in_ms);
            self.submitting = None;
            if let Some(p) = self.ordered_resume.take() {
                // Ordered events were resolved: their successors are behind the scan position.
                self.scan_from = self.scan_from.min(p);
            }
            return;
        }
        if sub.tries >= self.cfg.submit_tries_max {
            // The rows stay SENDING; their leases run out, they become unknown and the
            // reconciler's lookup fills the slot (R13). Nothing is lost, only delayed.
            self.counts.submits_abandoned += 1;
            self.wake_at_ms = self.wake_at_ms.max(now_ms + sub.next_claim_in_ms);
            self.submitting = None;
            return;
        }
        sub.tries += 1;
        self.failures_in_row = self.failures_in_row.saturating_add(1);
        let backoff = crate::subscription::backoff_ms(
            self.cfg.error_backoff_ms,
            self.cfg.error_backoff_max_ms,
            self.failures_in_row,
        );
        if let Some(sub) = &mut self.submitting {
            sub.due_ms = now_ms + backoff;
            sub.issued = false;
        }
    }

    /// The receipt transaction could not start: the database is unreachable (no transaction
    /// ran, so nothing of it committed). The submission waits and is retried after the
    /// growing backoff, for as long as the database stays away: these tries do not count
    /// toward [`DispatcherConfig::submit_tries_max`], because leaving the batch to the
    /// reconciler would only turn receipts in hand into unknowns to look up later.
    pub fn handle_submit_unreachable(&mut self, now_ms: u64) {
        if self.submitting.is_none() {
            debug_assert!(false, "handle_submit_unreachable without a submission");
            return;
        }
        let backoff = self.next_backoff_ms();
        if let Some(sub) = &mut self.submitting {
            sub.due_ms = now_ms + backoff;
            sub.issued = false;
        }
    }
}

/// Detail of an outcome report for a create-if-absent refusal.
pub const ALREADY_STORED: &str =
    "already stored at the broker (create-if-absent refused a second copy); look it up";
/// Start of an outcome report's detail for a send the broker refused for lack of permission
/// (never poison: the event waits for the grant).
pub const NOT_PERMITTED: &str =
    "not permitted by the broker (a grant is missing; the event waits, it is not poison)";
/// Detail of an outcome report for a send that missed its deadline.
pub const DEADLINE_PASSED: &str = "deadline passed before the message could leave";

enum Classified {
    Receipt(Receipt),
    Report(SendOutcome, String),
}

/// How one broker answer counts (the sequence-0 rule lives here: a "receipt" without a
/// position proves nothing and is an unknown outcome).
fn classify(result: SendResult) -> Classified {
    match result {
        SendResult::Receipt(r) if r.sequence != 0 => Classified::Receipt(r),
        SendResult::Receipt(_) => Classified::Report(
            SendOutcome::AckTimeout,
            "broker answered without a position (sequence 0)".to_string(),
        ),
        SendResult::NoAnswer => {
            Classified::Report(SendOutcome::AckTimeout, "no answer in time".to_string())
        }
        SendResult::AlreadyStored => {
            Classified::Report(SendOutcome::AckTimeout, ALREADY_STORED.to_string())
        }
        SendResult::NeverSent(why) => Classified::Report(
            SendOutcome::NeverSent,
            match why {
                NeverSentReason::DeadlinePassed => DEADLINE_PASSED.to_string(),
                NeverSentReason::WrongCluster(c) => format!("not connected to cluster `{c}`"),
                NeverSentReason::NotConnected(e) => format!("not connected: {e}"),
                NeverSentReason::NoSuchDestination(e) => {
                    format!("destination missing at the broker: {e}")
                }
            },
        ),
        // A permission refusal is the deployment's fault, not the event's: nothing was
        // stored, and the same send will pass once the grant is fixed. It is never counted
        // toward the poison limit (a wrong ACL must not quarantine every event of a route);
        // the event waits under the never-sent backoff, and the report says what to grant.
        SendResult::Refused {
            kind: RefusalKind::NotPermitted,
            detail,
        } => Classified::Report(SendOutcome::NeverSent, format!("{NOT_PERMITTED}: {detail}")),
        SendResult::Refused { kind, detail } => {
            Classified::Report(SendOutcome::Rejected, format!("{kind:?}: {detail}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::encoding::Digest;
    use crate::envelope::{PartitionAlgorithm, RoutePolicy};

    fn request(attempt_id: u64) -> SendRequest {
        let d = RoutePolicy {
            generation: 1,
            cluster: "c".into(),
            topic: "T".into(),
            partition_algorithm: PartitionAlgorithm::None,
            serializer: "json.v1".into(),
            durability: "file".into(),
            required_ack: "stream".into(),
            ordering: crate::envelope::EventOrdering::Unordered,
        }
        .resolve("k");
        SendRequest {
            event_id: EventId([attempt_id as u8; 16]),
            member: 0,
            envelope_generation: 1,
            attempt_id,
            payload_digest: Digest([1; 32]),
            destination_digest: d.digest(),
            destination: d,
            payload: vec![],
            envelope: Default::default(),
            signature: None,
        }
    }

    fn claimed(n: u64, started: u64, db_now: u64, lease_ms: u64) -> Claimed {
        Claimed {
            claim_started_ms: started,
            db_now_ms: db_now,
            sends: (1..=n)
                .map(|i| ClaimedSend {
                    request: request(i),
                    token: ClaimToken {
                        owner: 7,
                        generation: i,
                    },
                    db_lease_until_ms: db_now + lease_ms,
                })
                .collect(),
            last_position: (n > 0).then_some(100 + n),
            ordered_from: None,
            horizon: None,
        }
    }

    #[test]
    fn a_claim_scans_after_the_previous_batch_and_from_the_start_at_least_every_rescan_period() {
        let cfg = DispatcherConfig {
            rescan_every_ms: 1_000,
            ..DispatcherConfig::default()
        };
        let mut m = DispatcherMachine::new(cfg, 0);
        let from = |a: Option<DispatchAction>| match a {
            Some(DispatchAction::Claim { from_position, .. }) => from_position,
            other => panic!("expected a claim, got {other:?}"),
        };
        assert_eq!(
            from(m.poll_action(0)),
            0,
            "the first scan starts at the start"
        );
        m.handle_claimed(0, claimed(3, 0, 0, 10_000));
        m.handle_sent(1, vec![SendResult::NoAnswer; 3]);
        m.handle_submitted(2, true);
        assert_eq!(
            from(m.poll_action(2)),
            104,
            "then after the last position claimed"
        );
        m.handle_claimed(3, Claimed::default());
        assert_eq!(m.poll_action(3), None);
        assert_eq!(
            from(m.poll_action(3 + cfg.idle_poll_ms)),
            104,
            "an empty scan keeps the position"
        );
        m.handle_claimed(60, Claimed::default());
        assert_eq!(
            from(m.poll_action(1_000)),
            0,
            "a full scan when the rescan period is over"
        );
    }

    /// The machine's claim at `now`: it sends one row at `last` (or finds nothing) under
    /// `horizon`, and the batch is settled. Returns where the claim scanned from.
    fn claim_sending(
        m: &mut DispatcherMachine,
        now: u64,
        last: Option<u64>,
        horizon: Horizon,
    ) -> u64 {
        let from = match m.poll_action(now) {
            Some(DispatchAction::Claim { from_position, .. }) => from_position,
            other => panic!("expected a claim, got {other:?}"),
        };
        let mut c = claimed(u64::from(last.is_some()), now, now, 10_000);
        c.last_position = last;
        c.horizon = Some(horizon);
        if m.handle_claimed(now, c).is_some() {
            m.handle_sent(now, vec![SendResult::NoAnswer]);
            m.handle_submitted(now, true);
        }
        from
    }

    /// Positions drawn by transactions that may still commit are scanned again until the
    /// horizon says they are final; a window wider than ten batches is left to the full scan.
    #[test]
    fn a_scan_goes_back_behind_positions_that_are_not_final() {
        let cfg = DispatcherConfig {
            rescan_every_ms: 3_600_000,
            ..DispatcherConfig::default()
        };
        let mut m = DispatcherMachine::new(cfg, 0);
        let mut now = 0;
        let mut claim = |m: &mut DispatcherMachine, last: Option<u64>, (xmin, xmax, l)| {
            now += 100;
            claim_sending(
                m,
                now,
                last,
                Horizon {
                    xmin,
                    xmax,
                    last_position: l,
                },
            )
        };
        assert_eq!(claim(&mut m, Some(10), (100, 101, 10)), 0);
        assert_eq!(
            claim(&mut m, Some(20), (100, 105, 20)),
            0,
            "nothing is known final yet (transaction 100 runs): the scan starts over"
        );
        assert_eq!(
            claim(&mut m, Some(20), (106, 107, 20)),
            0,
            "still from the start: the first reading becomes final only now"
        );
        assert_eq!(
            claim(&mut m, None, (107, 108, 20)),
            11,
            "positions up to the first reading (10) are final: the scan starts after them"
        );
        assert_eq!(
            claim(&mut m, None, (108, 108, 20)),
            21,
            "all final: the scan starts after the last batch"
        );

        let mut h = ScanHorizon::default();
        let at = |xmin, xmax, l| Horizon {
            xmin,
            xmax,
            last_position: l,
        };
        assert_eq!(
            h.observe(at(10, 12, 5)),
            None,
            "a reading waits for a later snapshot"
        );
        assert_eq!(
            h.observe(at(11, 13, 8)),
            None,
            "transaction 11 may hold a position <= 5"
        );
        assert_eq!(h.observe(at(13, 14, 9)), Some(5));
        assert_eq!(
            h.observe(at(20, 20, 12)),
            Some(9),
            "nothing runs: all read so far"
        );
        assert_eq!(
            h.observe(at(20, 21, 12)),
            Some(9),
            "12 waits for transaction 20"
        );

        // A window wider than ten batches (a long transaction) is left to the full scan.
        let cfg = DispatcherConfig {
            batch_size_max: 1,
            rescan_every_ms: 3_600_000,
            ..DispatcherConfig::default()
        };
        let mut m = DispatcherMachine::new(cfg, 0);
        let mut now = 0;
        let mut claim = |m: &mut DispatcherMachine, last: Option<u64>| {
            now += 100;
            claim_sending(
                m,
                now,
                last,
                Horizon {
                    xmin: 1,
                    xmax: 50,
                    last_position: 50,
                },
            )
        };
        assert_eq!(claim(&mut m, Some(5)), 0);
        assert_eq!(claim(&mut m, Some(50)), 0, "six behind: scanned again");
        assert_eq!(
            claim(&mut m, None),
            51,
            "fifty-one behind: left to the full scan"
        );
    }

    /// R29 with a lagging horizon: a claim from behind whose rows all wait scans on from
    /// after the previous batch, not from behind again (that found the same waiting rows at
    /// once, for as long as a transaction held the horizon back: a claim loop).
    #[test]
    fn rows_that_wait_behind_a_lagging_horizon_do_not_make_the_claims_spin() {
        let cfg = DispatcherConfig {
            rescan_every_ms: 3_600_000,
            ..DispatcherConfig::default()
        };
        let mut m = DispatcherMachine::new(cfg, 0);
        // Transaction 100 stays open: positions after 10 never become final.
        let h = |last_position| {
            Some(Horizon {
                xmin: 100,
                xmax: 101,
                last_position,
            })
        };
        let mut claims = Vec::new();
        let mut now = 0;
        for last in [Some(10), Some(20), None] {
            let Some(DispatchAction::Claim { from_position, .. }) = m.poll_action(now) else {
                panic!("expected a claim at {now}");
            };
            claims.push(from_position);
            m.handle_claimed(
                now,
                Claimed {
                    last_position: last,
                    horizon: h(20),
                    ..Claimed::default()
                },
            );
            now = m.poll_timeout().expect("a wake-up");
        }
        assert_eq!(
            claims,
            [0, 11, 21],
            "each claim scans on after the rows that wait"
        );
        assert_eq!(now, cfg.idle_poll_ms, "then an idle poll");
        // After the idle poll the scan starts behind again (the horizon still lags), and
        // the waiting rows found there send the next claim on once more.
        let Some(DispatchAction::Claim { from_position, .. }) = m.poll_action(now) else {
            panic!("expected a claim after the idle poll");
        };
        assert_eq!(from_position, 0, "positions after the first are not final");
        m.handle_claimed(
            now,
            Claimed {
                last_position: Some(20),
                horizon: h(20),
                ..Claimed::default()
            },
        );
        let Some(DispatchAction::Claim { from_position, .. }) = m.poll_action(now) else {
            panic!("expected a claim at once");
        };
        assert_eq!(
            from_position, 21,
            "on from the previous batch, not from behind"
        );
    }

    /// R29: a claim whose rows all wait scans on at once (not after the idle poll); once a
    /// batch with ordered sends is submitted, the next claim scans from its lowest ordered
    /// position, where the successors that just became claimable are.
    #[test]
    fn ordered_batches_bring_the_scan_back_to_their_successors() {
        let cfg = DispatcherConfig {
            rescan_every_ms: 60_000,
            ..DispatcherConfig::default()
        };
        let mut m = DispatcherMachine::new(cfg, 0);
        let from = |a: Option<DispatchAction>| match a {
            Some(DispatchAction::Claim { from_position, .. }) => from_position,
            other => panic!("expected a claim, got {other:?}"),
        };
        assert_eq!(from(m.poll_action(0)), 0);
        let mut c = claimed(3, 0, 0, 10_000);
        c.ordered_from = Some(101);
        assert!(matches!(
            m.handle_claimed(0, c),
            Some(DispatchAction::Send { .. })
        ));
        assert_eq!(
            from(m.poll_action(0)),
            104,
            "while the batch is on the wire the scan moves on"
        );
        let waiting = Claimed {
            last_position: Some(200),
            ..Claimed::default()
        };
        m.handle_claimed(1, waiting);
        assert_eq!(m.poll_timeout(), Some(1), "rows waited: scan on at once");
        assert!(matches!(
            m.handle_sent(1, vec![SendResult::NoAnswer; 3]),
            Some(DispatchAction::Submit(_))
        ));
        m.handle_submitted(2, true);
        assert_eq!(
            from(m.poll_action(2)),
            101,
            "an ordered batch was submitted: the next scan starts at its position"
        );
        m.handle_claimed(3, Claimed::default());
        assert_eq!(m.poll_action(3), None, "an empty claim sleeps");
    }

    #[test]
    fn deadline_is_the_lease_end_on_the_local_clock_minus_the_margin() {
        // Local clock 1_000 when the claim started; database clock 50_000 inside it.
        assert_eq!(send_deadline_ms(1_000, 50_000, 60_000, 4_000), 7_000);
        // A margin larger than the lease leaves no time at all: never later than the start.
        assert_eq!(send_deadline_ms(1_000, 50_000, 60_000, 20_000), 1_000);
    }

    #[test]
    fn a_lease_too_short_for_the_brokers_handover_margin_is_refused() {
        let caps = |margin| Capabilities {
            lookup_by_event_id: false,
            duplicate_window_ms: None,
            create_if_absent: false,
            per_key_ordering: false,
            handover_margin_ms: margin,
            lookup_scan: None,
        };
        let cfg = DispatcherConfig {
            lease_ms: 2_000,
            send_margin_ms: 1_000,
            ..DispatcherConfig::default()
        };
        assert!(cfg.fits(&caps(0)).is_ok());
        assert!(cfg.fits(&caps(999)).is_ok());
        let e = cfg.fits(&caps(1_500)).unwrap_err();
        assert!(
            e.contains("leaves 1000 ms") && e.contains("raise lease_ms"),
            "{e}"
        );
        assert!(cfg.fits(&caps(1_000)).is_err(), "exactly the margin: never");
        assert!(DispatcherConfig::default().fits(&caps(1_500)).is_ok());
    }

    #[test]
    fn a_permission_refusal_is_never_sent_not_poison_and_other_refusals_are_rejections() {
        let cfg = DispatcherConfig::default();
        let mut m = DispatcherMachine::new(cfg, 0);
        m.poll_action(0);
        m.handle_claimed(5, claimed(2, 0, 100, cfg.lease_ms));
        let refused = |kind| SendResult::Refused {
            kind,
            detail: "detail from the broker".into(),
        };
        let Some(DispatchAction::Submit(s)) = m.handle_sent(
            6,
            vec![
                refused(RefusalKind::NotPermitted),
                refused(RefusalKind::PayloadTooLarge),
            ],
        ) else {
            panic!("a submission")
        };
        assert_eq!(s.reports[0].outcome, SendOutcome::NeverSent);
        assert!(s.reports[0].detail.starts_with(NOT_PERMITTED));
        assert!(s.reports[0].detail.ends_with("detail from the broker"));
        assert_eq!(s.reports[1].outcome, SendOutcome::Rejected);
    }

    #[test]
    fn a_batch_goes_claim_send_submit_then_claims_again_at_once() {
        let cfg = DispatcherConfig::default();
        let mut m = DispatcherMachine::new(cfg, 0);
        assert_eq!(
            m.poll_action(0),
            Some(DispatchAction::Claim {
                batch_size_max: cfg.batch_size_max,
                from_position: 0
            })
        );
        assert_eq!(m.poll_action(0), None, "one claim at a time");
        let send = m
            .handle_claimed(5, claimed(2, 0, 100, cfg.lease_ms))
            .unwrap();
        let DispatchAction::Send { batch, deadline_ms } = send else {
            panic!("{send:?}")
        };
        assert_eq!(batch.len(), 2);
        assert_eq!(deadline_ms, cfg.lease_ms - cfg.send_margin_ms);
        // The pipeline: the next batch is claimed while this one is on the wire ...
        assert!(matches!(
            m.poll_action(6),
            Some(DispatchAction::Claim {
                from_position: 103,
                ..
            })
        ));
        assert_eq!(m.poll_action(6), None, "one claim at a time");
        assert_eq!(
            m.handle_claimed(7, claimed(3, 6, 100, cfg.lease_ms)),
            None,
            "... and waits for the wire"
        );
        assert_eq!(m.poll_action(8), None, "no third batch while one waits");
        let sub = m
            .handle_sent(
                9,
                vec![
                    SendResult::NoAnswer,
                    SendResult::NeverSent(NeverSentReason::DeadlinePassed),
                ],
            )
            .unwrap();
        let DispatchAction::Submit(s) = sub else {
            panic!()
        };
        // The waiting batch goes on the wire while the submission commits.
        assert!(matches!(
            m.poll_action(9),
            Some(DispatchAction::Send { ref batch, .. }) if batch.len() == 3
        ));
        assert_eq!(
            m.poll_action(9),
            None,
            "no claim while the submission runs: one transaction at a time"
        );
        assert!(s.receipts.is_empty());
        assert_eq!(s.reports[0].outcome, SendOutcome::AckTimeout);
        assert_eq!(s.reports[1].outcome, SendOutcome::NeverSent);
        assert_eq!(m.counts().deadline_passed, 1);
        m.handle_submitted(10, true);
        assert!(matches!(
            m.poll_action(10),
            Some(DispatchAction::Claim { .. })
        ));
        m.handle_claimed(11, Claimed::default());
        assert_eq!(m.poll_action(11), None, "an empty claim sleeps");
        assert_eq!(m.poll_timeout(), Some(11 + cfg.idle_poll_ms));
        // The second batch's answer arrives: its submission goes at once.
        assert!(matches!(
            m.handle_sent(12, vec![SendResult::NoAnswer; 3]),
            Some(DispatchAction::Submit(_))
        ));
        m.handle_submitted(13, true);
        assert!(m.is_idle());
    }

    #[test]
    fn sequence_zero_and_already_stored_are_unknown_outcomes_not_receipts() {
        let mut m = DispatcherMachine::new(DispatcherConfig::default(), 0);
        m.poll_action(0);
        m.handle_claimed(0, claimed(2, 0, 0, 10_000));
        let mut zero = Receipt {
            event_id: EventId([1; 16]),
            member: 0,
            envelope_generation: 1,
            attempt_id: 1,
            payload_digest: Digest([1; 32]),
            destination_digest: Digest([2; 32]),
            cluster: "c".into(),
            stream: "T".into(),
            partition: None,
            sequence: 0,
            broker_duplicate: true,
            source: crate::receipt::ReceiptSource::Ack,
        };
        let Some(DispatchAction::Submit(s)) = m.handle_sent(
            1,
            vec![SendResult::Receipt(zero.clone()), SendResult::AlreadyStored],
        ) else {
            panic!()
        };
        assert!(s.receipts.is_empty());
        assert!(s
            .reports
            .iter()
            .all(|r| r.outcome == SendOutcome::AckTimeout));
        // A late receipt with a position is kept for the next submission; sequence 0 is not.
        m.handle_late_receipt(zero.clone());
        zero.sequence = 9;
        m.handle_late_receipt(zero.clone());
        m.handle_submitted(2, true);
        assert_eq!(
            m.poll_action(2),
            Some(DispatchAction::Submit(Submission {
                receipts: vec![zero],
                reports: vec![]
            }))
        );
    }

    #[test]
    fn an_unreachable_broker_pauses_the_next_claim() {
        let cfg = DispatcherConfig::default();
        let mut m = DispatcherMachine::new(cfg, 0);
        m.poll_action(0);
        m.handle_claimed(0, claimed(1, 0, 0, 10_000));
        m.handle_sent(
            1,
            vec![SendResult::NeverSent(NeverSentReason::NotConnected(
                "refused".into(),
            ))],
        );
        m.handle_submitted(2, true);
        assert_eq!(m.poll_action(2), None, "no claim straight away");
        assert_eq!(m.poll_timeout(), Some(2 + cfg.error_backoff_ms));
    }

    #[test]
    fn failed_submissions_retry_with_backoff_then_give_up_to_the_reconciler() {
        let cfg = DispatcherConfig {
            submit_tries_max: 3,
            ..DispatcherConfig::default()
        };
        let mut m = DispatcherMachine::new(cfg, 0);
        m.poll_action(0);
        m.handle_claimed(0, claimed(1, 0, 0, 10_000));
        m.handle_sent(1, vec![SendResult::NoAnswer]);
        m.handle_submitted(2, false);
        assert_eq!(m.poll_action(2), None, "not before the backoff");
        let due = m.poll_timeout().unwrap();
        assert!(due > 2);
        assert!(matches!(
            m.poll_action(due),
            Some(DispatchAction::Submit(_))
        ));
        m.handle_submitted(due, false);
        let due = m.poll_timeout().unwrap();
        assert!(matches!(
            m.poll_action(due),
            Some(DispatchAction::Submit(_))
        ));
        m.handle_submitted(due, false);
        assert_eq!(m.counts().submits_abandoned, 1);
        assert!(matches!(
            m.poll_action(due),
            Some(DispatchAction::Claim { .. })
        ));
    }

    #[test]
    fn an_unreachable_database_never_abandons_a_submission_and_backs_off_growing_then_capped() {
        let cfg = DispatcherConfig {
            submit_tries_max: 2,
            error_backoff_ms: 100,
            error_backoff_max_ms: 1_000,
            ..DispatcherConfig::default()
        };
        let mut m = DispatcherMachine::new(cfg, 0);
        m.poll_action(0);
        m.handle_claimed(0, claimed(1, 0, 0, 10_000));
        let sub = m.handle_sent(1, vec![SendResult::NoAnswer]);
        assert!(matches!(sub, Some(DispatchAction::Submit(_))));
        // Ten submissions in a row cannot reach the database: far past `submit_tries_max`,
        // the submission is still held, retried after 100, 200, 400, 800, then 1000 ms.
        let mut now = 1;
        let mut waits = Vec::new();
        for _ in 0..10 {
            m.handle_submit_unreachable(now);
            let due = loop {
                // Claims fail too while the database is away.
                match m.poll_action(now) {
                    Some(DispatchAction::Claim { .. }) => m.handle_claim_failed(now),
                    Some(DispatchAction::Submit(_)) => break now,
                    Some(other) => panic!("unexpected {other:?}"),
                    None => {
                        now = m
                            .poll_timeout()
                            .expect("a timeout while a submission waits")
                    }
                }
            };
            waits.push(due);
            now = due;
        }
        assert_eq!(
            m.counts().submits_abandoned,
            0,
            "nothing left to the reconciler"
        );
        let gaps: Vec<u64> = waits.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(gaps.iter().all(|g| *g <= 1_000), "capped: {gaps:?}");
        assert!(gaps.last() == Some(&1_000), "grew to the cap: {gaps:?}");
        // The database answers: the submission commits and the backoff starts over.
        m.handle_submitted(now, true);
        assert!(matches!(
            m.poll_action(now),
            Some(DispatchAction::Claim { .. })
        ));
        m.handle_claim_failed(now);
        assert_eq!(
            m.poll_timeout(),
            Some(now + 100),
            "one failure after a success: the first step"
        );
    }

    #[test]
    fn claim_failures_in_a_row_double_the_wait_up_to_the_cap_and_a_claim_resets_it() {
        let cfg = DispatcherConfig {
            error_backoff_ms: 500,
            error_backoff_max_ms: 3_000,
            ..DispatcherConfig::default()
        };
        let mut m = DispatcherMachine::new(cfg, 0);
        let mut now = 0;
        let mut waits = Vec::new();
        for _ in 0..5 {
            assert!(matches!(
                m.poll_action(now),
                Some(DispatchAction::Claim { .. })
            ));
            m.handle_claim_failed(now);
            let due = m.poll_timeout().unwrap();
            waits.push(due - now);
            now = due;
        }
        assert_eq!(waits, vec![500, 1_000, 2_000, 3_000, 3_000]);
        assert!(matches!(
            m.poll_action(now),
            Some(DispatchAction::Claim { .. })
        ));
        m.handle_claimed(now, claimed(0, 0, 0, 10_000));
        let idle = m.poll_timeout().unwrap();
        assert!(matches!(
            m.poll_action(idle),
            Some(DispatchAction::Claim { .. })
        ));
        m.handle_claim_failed(idle);
        assert_eq!(m.poll_timeout(), Some(idle + 500));
    }
}
