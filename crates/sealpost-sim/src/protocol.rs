//! The simulator's only door to the protocol: every decision goes through [`Protocol`],
//! which calls `sealpost-core` and, when a mutant is switched on, alters exactly one
//! decision. Mutants exist only here, never in production code paths (G4).

use sealpost_core::cdc::{self as cdc, RowCheck};
use sealpost_core::claim::{self, BeginSend, ClaimToken};
use sealpost_core::cleanup::{self, PurgeRefusal, RetentionPolicy, Watermark};
use sealpost_core::contract::{self, ContractError, SchemaVersion};
use sealpost_core::delivery_set::{self, CompletionRule, SetStatus};
use sealpost_core::dispatcher::OutcomeReport;
use sealpost_core::encoding::Digest;
use sealpost_core::envelope::EventId;
use sealpost_core::inbox::{self, InboxDecision, InboxRecord};
use sealpost_core::port::WireEnvelope;
use sealpost_core::receipt::{self, Receipt, ReceiptVerdict, RejectReason};
use sealpost_core::reconcile::{self, Lookup, ReconcileDecision, ReconcilePolicy};
use sealpost_core::rollout;
use sealpost_core::row::EventRow;
use sealpost_core::signature::{self as seal, Crypto, Presented, SignaturePolicy, SIGNATURE_LEN};
use sealpost_core::state::State;
use sealpost_core::step::{
    self, AcceptRules, Acceptance, ClaimInput, ClaimRules, ClaimStep, Finished, Pick,
    ReconcileRules, ReportRules, Reported, Served, StepError,
};
use sealpost_core::subscription;
use sealpost_core::QuarantineReason;

/// A deliberate protocol bug the checker must catch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mutant {
    /// The acceptance point skips the payload and destination digest checks.
    AcceptWithoutDigestCheck,
    /// A retry after `UNKNOWN` goes to the current route policy's destination.
    RetryToOtherDestination,
    /// The acceptance point accepts an ACK for an attempt it never registered.
    AcceptUnregisteredAttempt,
    /// The acceptance point drops an ACK whose claim has expired or been superseded.
    DropLateAck,
    /// An ACK from a stale claim overwrites the primary receipt.
    StaleClaimOverwritesPrimary,
    /// Every retry mints a new event id.
    NewEventIdOnRetry,
    /// The consumer records its inbox row in a second transaction after the effect.
    ConsumerDedupOutsideTx,
    /// Cleanup purges as soon as the event is published.
    PurgeAtAck,
    /// The adapter sends a batch whatever its deadline (lease end minus margin) says.
    SendPastDeadline,
    /// "Never sent" outcomes go straight back to `PENDING` without count or backoff.
    UnboundedNeverSent,
    /// The adapter publishes without create-if-absent although it declares it.
    NoCreateIfAbsent,
    /// A copy found at the broker under an attempt the store never registered (a restore)
    /// is retried instead of filling the slot.
    RetryOverFoundCopy,
    /// "Stay unknown" releases the row for an immediate new lookup (no per-row backoff): with
    /// the broker down the reconciler spins on the same rows.
    ReconcileWithoutBackoff,
    /// The adapter reports a broker's permanent refusal as "no answer" (poison is never
    /// counted, never quarantined: retried forever).
    RefusalAsNoAnswer,
    /// The claim scan is a high-water-mark cursor: it never goes back behind the highest
    /// position it reached (no rescans), so a late commit, a released row or a row whose
    /// backoff ended behind it is stranded.
    HighWaterCursor,
    /// Cleanup ignores the restore point: it purges rows published after the oldest backup
    /// that may still be restored.
    PurgeIgnoresRestorePoint,
    /// The claim ignores "an earlier event of this aggregate is unresolved" (R29): an
    /// ordered aggregate's later event is sent while an earlier one is pending or unknown.
    OrderingIgnoresEarlierEvent,
    /// The adapter encodes a batch as a whole: one message it cannot encode (a panic in
    /// the header encoder) fails the whole batch as "no answer" (issue 20's measurement: the
    /// bad row is never counted toward its rejection limit and keeps its neighbours unknown).
    RefusalFailsBatch,
    /// The consumer acks a delivery whose effect failed (rolled back): the event is never
    /// applied and nothing records it.
    AckFailedEffect,
    /// A bulk lookup (one scan for many unknown events) answers "absent" for every event it
    /// did not see, even when the scan stopped short of the end it fixed (its record bound).
    AbsentFromUnfinishedScan,
    /// The dispatcher's guarded fast path writes its receipt on the row as its claim left it
    /// without checking that the row is still that version (no `xmin` guard): a late ACK
    /// overwrites whatever the reconciler or another dispatcher wrote since.
    UnguardedFastPath,
    /// The reader admits every copy a lookup finds, whatever its seal (`judge_copy` under no
    /// policy): a forged copy is adopted as the event's publication or counted present.
    AdoptUnsignedCopy,
    /// The consumer's delivery check ignores the seal (only the digest header is checked):
    /// a forged or replayed message is applied.
    ConsumerSkipsSignature,
    /// The adapter takes a broker's "duplicate of the message at N" for a receipt of its
    /// send without reading the copy at N (`signature::is_this_message`): a forger who
    /// published first under the event's duplicate id gets its copy adopted.
    TrustDuplicateAck,
    /// A broker's permission refusal is counted as poison (`RefusalKind::NotPermitted`
    /// handed to the dispatcher as an ordinary refusal): a grant missing for a while
    /// quarantines the deliverable events it refused.
    PermissionRefusalIsPoison,
    /// The CDC publisher takes a row that is claimed and on its way (in flight, a live
    /// lease) for settled when it feeds its state checks into the log window: the slot's
    /// confirmed position passes the transaction before the acceptance point committed
    /// anything, so a restarted reader never names the row again.
    CdcConfirmBeforeAccept,
    /// The CDC publisher's steady sweep (a scan of the claim index) runs only when its window
    /// offers nothing, as `sealpost::cdc::LogScope::claim` did before `ClaimSource`: rows
    /// offered again and again that no claim can take (ordered behind an earlier version the
    /// log no longer names) keep the sweep away for ever.
    CdcSweepOnlyWhenWindowEmpty,
    /// A delivery set's completion counts members on their way (sending, unknown,
    /// reconciling) as published: the set reports complete while a member's copy may never
    /// have reached its broker.
    SetCompletesEarly,
    /// R25: the claim does not read the rollout aliases in its own transaction: it filters
    /// its pick and checks its rows against the copy its process read earlier (at its
    /// previous claim, or when it started), so a switch committed since is not seen and an
    /// implementation that lost the alias starts a send.
    ClaimWithoutAliasFence,
    /// R25: the shadow's comparison takes the receipt fields (destination digest, payload
    /// digest, envelope generation) from the row's primary receipt in the store (the
    /// incumbent's own account of what it sent) instead of the copy read back from the
    /// broker: a stored copy that differs from the sealed envelope is never reported.
    ShadowComparesOwnReceipt,
    /// R26: the registry stores a candidate schema without checking it against the
    /// registered versions (the breaches `contract::Check` found are ignored): a rename or a
    /// changed field meaning becomes a version that readers of the others cannot read.
    RegisterWithoutCompatibilityCheck,
    /// R26: `enqueue` on a route that requires contracts skips `contract::check_payload`:
    /// an event written with a schema nobody registered reaches the consumers.
    EnqueueWithoutContractCheck,
    /// One row write per event: the dispatcher drops its batch lease once it has answered
    /// every row of it, without checking that each of them was written since
    /// (`lease::may_drop`): a row whose answer left it unwritten (a rejected receipt) reads
    /// as never sent again, and the record of its send is lost.
    LeaseDroppedWhenAnswered,
}

impl Mutant {
    /// Every mutant, in `--list-mutants` order.
    pub const ALL: [Mutant; 33] = [
        Mutant::AcceptWithoutDigestCheck,
        Mutant::RetryToOtherDestination,
        Mutant::AcceptUnregisteredAttempt,
        Mutant::DropLateAck,
        Mutant::StaleClaimOverwritesPrimary,
        Mutant::NewEventIdOnRetry,
        Mutant::ConsumerDedupOutsideTx,
        Mutant::PurgeAtAck,
        Mutant::SendPastDeadline,
        Mutant::UnboundedNeverSent,
        Mutant::NoCreateIfAbsent,
        Mutant::RetryOverFoundCopy,
        Mutant::ReconcileWithoutBackoff,
        Mutant::RefusalAsNoAnswer,
        Mutant::HighWaterCursor,
        Mutant::PurgeIgnoresRestorePoint,
        Mutant::OrderingIgnoresEarlierEvent,
        Mutant::RefusalFailsBatch,
        Mutant::AckFailedEffect,
        Mutant::AbsentFromUnfinishedScan,
        Mutant::UnguardedFastPath,
        Mutant::AdoptUnsignedCopy,
        Mutant::ConsumerSkipsSignature,
        Mutant::TrustDuplicateAck,
        Mutant::PermissionRefusalIsPoison,
        Mutant::CdcConfirmBeforeAccept,
        Mutant::CdcSweepOnlyWhenWindowEmpty,
        Mutant::SetCompletesEarly,
        Mutant::ClaimWithoutAliasFence,
        Mutant::ShadowComparesOwnReceipt,
        Mutant::RegisterWithoutCompatibilityCheck,
        Mutant::EnqueueWithoutContractCheck,
        Mutant::LeaseDroppedWhenAnswered,
    ];

    /// The CLI name.
    pub fn name(self) -> &'static str {
        match self {
            Mutant::AcceptWithoutDigestCheck => "accept-without-digest-check",
            Mutant::RetryToOtherDestination => "retry-to-other-destination",
            Mutant::AcceptUnregisteredAttempt => "accept-unregistered-attempt",
            Mutant::DropLateAck => "drop-late-ack",
            Mutant::StaleClaimOverwritesPrimary => "stale-claim-overwrites-primary",
            Mutant::NewEventIdOnRetry => "new-event-id-on-retry",
            Mutant::ConsumerDedupOutsideTx => "consumer-dedup-outside-tx",
            Mutant::PurgeAtAck => "purge-at-ack",
            Mutant::SendPastDeadline => "send-past-deadline",
            Mutant::UnboundedNeverSent => "unbounded-never-sent",
            Mutant::NoCreateIfAbsent => "no-create-if-absent",
            Mutant::RetryOverFoundCopy => "retry-over-found-copy",
            Mutant::ReconcileWithoutBackoff => "reconcile-without-backoff",
            Mutant::RefusalAsNoAnswer => "refusal-as-no-answer",
            Mutant::HighWaterCursor => "high-water-cursor",
            Mutant::PurgeIgnoresRestorePoint => "purge-ignores-restore-point",
            Mutant::OrderingIgnoresEarlierEvent => "ordering-ignores-earlier-event",
            Mutant::RefusalFailsBatch => "refusal-fails-batch",
            Mutant::AckFailedEffect => "ack-failed-effect",
            Mutant::AbsentFromUnfinishedScan => "absent-from-unfinished-scan",
            Mutant::UnguardedFastPath => "unguarded-fast-path",
            Mutant::AdoptUnsignedCopy => "adopt-unsigned-copy",
            Mutant::ConsumerSkipsSignature => "consumer-skips-signature",
            Mutant::TrustDuplicateAck => "trust-duplicate-ack",
            Mutant::PermissionRefusalIsPoison => "permission-refusal-is-poison",
            Mutant::CdcConfirmBeforeAccept => "cdc-confirm-before-accept",
            Mutant::CdcSweepOnlyWhenWindowEmpty => "cdc-sweep-only-when-window-empty",
            Mutant::SetCompletesEarly => "set-completes-early",
            Mutant::ClaimWithoutAliasFence => "claim-without-alias-fence",
            Mutant::ShadowComparesOwnReceipt => "shadow-compares-own-receipt",
            Mutant::RegisterWithoutCompatibilityCheck => "register-without-compatibility-check",
            Mutant::EnqueueWithoutContractCheck => "enqueue-without-contract-check",
            Mutant::LeaseDroppedWhenAnswered => "lease-dropped-when-answered",
        }
    }

    /// Parses [`Mutant::name`].
    pub fn parse(s: &str) -> Option<Mutant> {
        Mutant::ALL.into_iter().find(|m| m.name() == s)
    }
}

/// Calls the core, possibly through one mutant.
#[derive(Clone, Copy, Debug, Default)]
pub struct Protocol {
    /// The switched-on mutant, if any.
    pub mutant: Option<Mutant>,
}

/// A receipt verdict plus whether the (mutated) verdict overwrites a filled slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// The verdict.
    pub verdict: ReceiptVerdict,
    /// Only a mutant sets this: replace the primary receipt.
    pub overwrite_primary: bool,
}

impl Protocol {
    fn is(&self, m: Mutant) -> bool {
        self.mutant == Some(m)
    }

    /// Where the store's claim scan starts: where the dispatcher machine asks (`asked`), or,
    /// with the `high-water-cursor` mutant, never behind the highest position this
    /// dispatcher's scans reached.
    pub fn scan_from(&self, asked: u64, high_water: u64) -> u64 {
        if self.is(Mutant::HighWaterCursor) {
            asked.max(high_water)
        } else {
            asked
        }
    }

    /// The store's fact "an earlier event of this aggregate is unresolved" as the claim
    /// decision takes it (the mutant drops the fact).
    pub fn earlier_unresolved(&self, fact: bool) -> bool {
        fact && !self.is(Mutant::OrderingIgnoresEarlierEvent)
    }

    /// The rollout aliases ([`sealpost_core::rollout::Alias`]) a claim applies (R25): those read in the claim's own transaction
    /// (`current`, under the lock a switch conflicts with), or, with the
    /// `claim-without-alias-fence` mutant, the copy the process read earlier (`cached`). The
    /// store's pick filter and the claim step's check both take what this returns.
    pub fn claim_aliases<'a, T: ?Sized>(&self, current: &'a T, cached: &'a T) -> &'a T {
        if self.is(Mutant::ClaimWithoutAliasFence) {
            cached
        } else {
            current
        }
    }

    /// The shadow's comparison (R25): the core's [`rollout::shadow_compare`] of what the
    /// candidate would have sent for `row` (envelope description `envelope`) with the copy
    /// read back (`observed`). The shadow-compares-own-receipt mutant hands it `own` (the
    /// row's primary receipt as the store holds it) in place of the copy's receipt.
    pub fn shadow_compare(
        &self,
        row: &EventRow,
        envelope: &WireEnvelope,
        observed: rollout::Observed<'_>,
        own: &Receipt,
    ) -> Vec<rollout::Divergence> {
        let observed = if self.is(Mutant::ShadowComparesOwnReceipt) {
            rollout::Observed {
                receipt: own,
                ..observed
            }
        } else {
            observed
        };
        rollout::shadow_compare(row, envelope, observed)
    }

    /// The store's claim transaction: the core's [`step::step_claim`] with this protocol's
    /// claim and begin-send decisions as its hooks (so the mutants of either apply).
    /// `policy_destination(i)` and `fresh_id()` are only called by the mutants.
    pub fn step_claim<R: std::borrow::BorrowMut<EventRow>>(
        &self,
        rows: &mut [R],
        picked: &[Pick<'_>],
        input: &ClaimInput<'_>,
        policy_destination: impl FnMut(usize) -> Digest,
        fresh_id: impl FnMut() -> EventId,
    ) -> Result<ClaimStep, StepError> {
        let mut hooks = Hooks {
            proto: self,
            policy_destination,
            fresh_id,
        };
        step::step_claim(rows, picked, input, &mut hooks)
    }

    /// The store's locked acceptance: the core's [`step::step_accept`] with this protocol's
    /// receipt decision (and a mutant's slot overwrite) as its hooks.
    pub fn step_accept<R: std::borrow::BorrowMut<EventRow>>(
        &self,
        rows: &mut [R],
        receipts: &[Receipt],
        now_ms: u64,
    ) -> Result<Vec<Acceptance>, StepError> {
        let mut hooks = AcceptHooks {
            proto: self,
            now_ms,
            overwrite: false,
        };
        step::step_accept(rows, receipts, now_ms, &mut hooks)
    }

    /// The store's finish-reconcile step: the core's [`step::step_finish_reconcile`] with this
    /// protocol's reconcile decision and apply, and its receipt decision for a found copy.
    pub fn step_finish_reconcile(
        &self,
        row: &mut EventRow,
        token: ClaimToken,
        lookup: &Lookup,
        policy: ReconcilePolicy,
        now_ms: u64,
    ) -> Result<Finished, StepError> {
        let mut hooks = AcceptHooks {
            proto: self,
            now_ms,
            overwrite: false,
        };
        step::step_finish_reconcile(row, token, lookup, policy, now_ms, &mut hooks)
    }

    /// The store's outcome reports: the core's [`step::step_report`] with this protocol's
    /// apply (a mutant drops the never-sent count and backoff).
    pub fn step_report<R: std::borrow::BorrowMut<EventRow>>(
        &self,
        rows: &mut [R],
        reports: &[OutcomeReport],
        rejection_limit: u32,
        now_ms: u64,
    ) -> Result<Vec<Reported>, StepError> {
        step::step_report(
            rows,
            reports,
            rejection_limit,
            now_ms,
            &mut ReportHooks { proto: self },
        )
    }

    /// The guarded fast path's guard: the stored row is still the version the dispatcher's
    /// claim wrote (PostgreSQL compares the row's `xmin`; the model compares the rows, which
    /// is as strict: every write changes a generation, a state or an attempt).
    pub fn guard_holds(&self, held: &EventRow, stored: &EventRow) -> bool {
        self.is(Mutant::UnguardedFastPath) || held == stored
    }

    /// May a batch lease be dropped, with `still_never_claimed` of its rows not written
    /// since it was taken (`lease::may_drop`)? `answered`: its dispatcher has answered
    /// every row of it (the mutant drops on that alone).
    pub fn may_drop_lease(&self, still_never_claimed: usize, answered: bool) -> bool {
        (answered && self.is(Mutant::LeaseDroppedWhenAnswered))
            || sealpost_core::lease::may_drop(still_never_claimed)
    }

    /// The ordered consumer's gap rule.
    pub fn decide_apply_order(&self, last_applied: Option<u64>, version: u64) -> inbox::ApplyOrder {
        inbox::decide_apply_order(last_applied, version)
    }

    /// `acceptDispatchReceipt`'s decision.
    pub fn decide_receipt(&self, row: &EventRow, r: &Receipt, now_ms: u64) -> Verdict {
        let v = receipt::decide_receipt(row, r);
        let plain = Verdict {
            verdict: v,
            overwrite_primary: false,
        };
        let slot_verdict = || {
            if row.primary.is_some() {
                ReceiptVerdict::Duplicate(sealpost_core::DuplicateKind::SecondCopy)
            } else {
                ReceiptVerdict::Primary
            }
        };
        match self.mutant {
            Some(Mutant::AcceptWithoutDigestCheck)
                if matches!(
                    v,
                    ReceiptVerdict::Quarantine(
                        QuarantineReason::PayloadDigestMismatch
                            | QuarantineReason::DestinationDigestMismatch
                    )
                ) && !row.state.is_published()
                    && row.state != State::Pending =>
            {
                Verdict {
                    verdict: slot_verdict(),
                    overwrite_primary: false,
                }
            }
            Some(Mutant::AcceptUnregisteredAttempt)
                if v == ReceiptVerdict::Reject(RejectReason::UnregisteredAttempt)
                    && row.state != State::Pending
                    && row.state != State::Claimed =>
            {
                Verdict {
                    verdict: slot_verdict(),
                    overwrite_primary: false,
                }
            }
            Some(Mutant::DropLateAck)
                if matches!(v, ReceiptVerdict::Primary | ReceiptVerdict::Duplicate(_)) =>
            {
                let current = row
                    .claim
                    .as_ref()
                    .filter(|c| c.lease_until_ms > now_ms)
                    .map(|c| c.generation);
                let claim_gen = row.attempt(r.attempt_id).map(|a| a.claim_generation);
                if claim_gen.is_some() && claim_gen != current {
                    Verdict {
                        verdict: ReceiptVerdict::Reject(RejectReason::NotInFlight(row.state)),
                        overwrite_primary: false,
                    }
                } else {
                    plain
                }
            }
            Some(Mutant::StaleClaimOverwritesPrimary)
                if matches!(v, ReceiptVerdict::Duplicate(_)) =>
            {
                let current = row.claim.as_ref().map(|c| c.generation);
                let stale = row
                    .attempt(r.attempt_id)
                    .map(|a| Some(a.claim_generation) != current);
                if stale == Some(true) {
                    Verdict {
                        verdict: ReceiptVerdict::Primary,
                        overwrite_primary: true,
                    }
                } else {
                    plain
                }
            }
            _ => plain,
        }
    }

    /// The send authorisation. `policy_destination` is what the *current* route policy
    /// would pick; only the retry-to-other-destination mutant ever uses it.
    pub fn decide_begin_send(
        &self,
        row: &EventRow,
        token: ClaimToken,
        now_ms: u64,
        policy_destination: impl FnOnce() -> Digest,
        fresh_id: impl FnOnce() -> EventId,
    ) -> Result<BeginSend, claim::Fenced> {
        let mut b = claim::decide_begin_send(row, token, now_ms)?;
        let is_retry = row.state == State::RetryClaimed;
        if is_retry && self.is(Mutant::RetryToOtherDestination) {
            b.destination_digest = policy_destination();
        }
        if is_retry && self.is(Mutant::NewEventIdOnRetry) {
            b.event_id = fresh_id();
        }
        Ok(b)
    }

    /// The cleanup decision.
    pub fn decide_purge(
        &self,
        row: &EventRow,
        now_ms: u64,
        mut policy: RetentionPolicy,
        required: &[Watermark],
    ) -> Result<(), PurgeRefusal> {
        if self.is(Mutant::PurgeAtAck) && row.primary.is_some() && row.state != State::Purged {
            return Ok(());
        }
        if self.is(Mutant::PurgeIgnoresRestorePoint) {
            policy.restore_point_ms = None;
        }
        cleanup::decide_purge(row, now_ms, policy, required)
    }

    /// True when the consumer must record the inbox row in the effect's own transaction.
    pub fn inbox_in_effect_tx(&self) -> bool {
        !self.is(Mutant::ConsumerDedupOutsideTx)
    }

    /// How a consumer settles a delivery (the ack-failed-effect mutant acks one whose effect
    /// failed).
    pub fn decide_settlement(
        &self,
        processed: subscription::Processed,
        delivered: u64,
        policy: inbox::RedeliveryPolicy,
    ) -> subscription::Settlement {
        if self.is(Mutant::AckFailedEffect)
            && processed == subscription::Processed::Failed(inbox::Failure::Message)
        {
            return subscription::Settlement::Ack;
        }
        subscription::decide_settlement(processed, delivered, policy)
    }

    /// The inbox decision.
    pub fn decide_inbox(
        &self,
        existing: Option<InboxRecord>,
        payload_digest: Digest,
    ) -> InboxDecision {
        inbox::decide_inbox(existing, payload_digest)
    }

    /// May a request leave at `now_ms` under a batch deadline? The core's rule
    /// ([`sealpost_core::port::may_leave`], the one every adapter calls with its monotonic
    /// clock), with the adapter's declared handover margin.
    pub fn may_leave(
        &self,
        now_ms: u64,
        deadline_ms: u64,
        caps: &sealpost_core::port::Capabilities,
    ) -> bool {
        let left = std::time::Duration::from_millis(deadline_ms.saturating_sub(now_ms));
        self.is(Mutant::SendPastDeadline) || sealpost_core::port::may_leave(left, caps)
    }

    /// Does a request to a broker that declares create-if-absent carry the condition?
    pub fn create_if_absent(&self, declared: bool) -> bool {
        declared && !self.is(Mutant::NoCreateIfAbsent)
    }

    /// Applies a send-outcome verdict (the unbounded-never-sent mutant forgets the count and
    /// the backoff afterwards).
    pub fn apply_send_outcome(
        &self,
        row: &mut EventRow,
        decision: claim::SendOutcomeDecision,
        attempt_id: u64,
        outcome: claim::SendOutcome,
        now_ms: u64,
    ) -> Result<(), sealpost_core::TransitionError> {
        claim::apply_send_outcome(row, decision, attempt_id, outcome, now_ms)?;
        if self.is(Mutant::UnboundedNeverSent) && outcome == claim::SendOutcome::NeverSent {
            row.pacing.never_sent = 0;
            row.pacing.not_before_ms = 0;
        }
        Ok(())
    }

    /// Applies a reconcile verdict (the reconcile-without-backoff mutant makes a "stay
    /// unknown" row due again at once).
    pub fn apply_reconcile(
        &self,
        row: &mut EventRow,
        decision: &ReconcileDecision,
        now_ms: u64,
    ) -> Result<(), sealpost_core::TransitionError> {
        reconcile::apply_reconcile(row, decision, now_ms)?;
        if self.is(Mutant::ReconcileWithoutBackoff) && *decision == ReconcileDecision::StayUnknown {
            row.pacing.next_lookup_at_ms = now_ms;
        }
        Ok(())
    }

    /// Does one message the adapter cannot encode fail its whole batch?
    pub fn refusal_fails_batch(&self) -> bool {
        self.is(Mutant::RefusalFailsBatch)
    }

    /// Does the adapter report a broker's permanent refusal as a refusal?
    pub fn reports_refusals(&self) -> bool {
        !self.is(Mutant::RefusalAsNoAnswer)
    }

    /// How the broker's permission refusal reaches the dispatcher machine: as it is (the
    /// machine's `classify` makes it "never sent"), or, with the mutant, as poison.
    pub fn permission_refusal(&self) -> sealpost_core::port::RefusalKind {
        if self.is(Mutant::PermissionRefusalIsPoison) {
            sealpost_core::port::RefusalKind::Rejected
        } else {
            sealpost_core::port::RefusalKind::NotPermitted
        }
    }

    /// The reconciler's decision on a lookup.
    /// One scan's answers (`reconcile::decide_scanned`); the `absent-from-unfinished-scan`
    /// mutant takes a scan that stopped short for a finished one.
    pub fn decide_scanned(
        &self,
        group: &[(EventId, u16)],
        found: impl Fn(EventId, u16) -> Vec<seal::FoundCopy>,
        reach: reconcile::ScanReach,
    ) -> Vec<Lookup> {
        let reach = if self.is(Mutant::AbsentFromUnfinishedScan) {
            reconcile::ScanReach {
                finished: true,
                ..reach
            }
        } else {
            reach
        };
        reconcile::decide_scanned(group, found, reach)
    }

    pub fn decide_reconcile(
        &self,
        row: &EventRow,
        token: ClaimToken,
        lookup: &Lookup,
        policy: ReconcilePolicy,
        now_ms: u64,
    ) -> ReconcileDecision {
        let d = reconcile::decide_reconcile(row, token, lookup, policy, now_ms);
        match (&d, lookup) {
            (ReconcileDecision::Accept(r), Lookup::Found(_))
                if self.is(Mutant::RetryOverFoundCopy) && row.attempt(r.attempt_id).is_none() =>
            {
                ReconcileDecision::RetrySameDestination {
                    destination_digest: row.destination_digest,
                    quarantine: None,
                }
            }
            _ => d,
        }
    }

    /// The reader's judgement of a copy a lookup found (`signature::judge_copy` under the
    /// reader's `policy`, with the shell's `verify`); the adopt-unsigned-copy mutant judges
    /// under no policy, so every copy is admitted.
    pub fn judge_copy(
        &self,
        lookup: Lookup,
        policy: SignaturePolicy,
        verify: impl FnMut(&str, &[u8; SIGNATURE_LEN], &Digest) -> Crypto,
    ) -> Lookup {
        let policy = if self.is(Mutant::AdoptUnsignedCopy) {
            SignaturePolicy::Off
        } else {
            policy
        };
        seal::judge_copy(lookup, policy, verify)
    }

    /// Whether the copy a duplicate acknowledgement names is the message the adapter sent
    /// (`signature::is_this_message`); the trust-duplicate-ack mutant never reads the copy
    /// and takes every duplicate acknowledgement for a receipt.
    pub fn is_this_message(
        &self,
        claim: &seal::SignedClaim,
        signature: Option<&str>,
        copy: &seal::FoundCopy,
    ) -> bool {
        self.is(Mutant::TrustDuplicateAck) || seal::is_this_message(claim, signature, copy)
    }

    /// The consumer's check of a delivery before its effect (`inbox::decide_delivery`); the
    /// consumer-skips-signature mutant checks the digest header only.
    pub fn decide_delivery(
        &self,
        claimed_digest: Digest,
        payload_digest: Digest,
        policy: SignaturePolicy,
        presented: &Presented,
    ) -> Result<(), inbox::DeliveryRefusal> {
        let policy = if self.is(Mutant::ConsumerSkipsSignature) {
            SignaturePolicy::Off
        } else {
            policy
        };
        inbox::decide_delivery(claimed_digest, payload_digest, policy, presented)
    }

    /// What the CDC publisher's state check makes of an offered row (`cdc::check_of`, as
    /// the shell runs it); the cdc-confirm-before-accept mutant takes a row in flight for
    /// settled.
    pub fn cdc_check(&self, seen: Option<cdc::Seen<'_>>, now_ms: u64) -> RowCheck {
        let c = cdc::check_of(seen, now_ms);
        if c == RowCheck::InFlight && self.is(Mutant::CdcConfirmBeforeAccept) {
            RowCheck::Settled
        } else {
            c
        }
    }

    /// Where the CDC publisher's next claim comes from: the core's [`cdc::ClaimSource`]
    /// rule, which the shell (`LogScope::claim`) runs. The
    /// cdc-sweep-only-when-window-empty mutant (the shell before the rule) turns a steady
    /// scan that is due into an offer of the log's rows while the window has any: the scan
    /// stays due and runs only once the window offers nothing.
    pub fn cdc_choose(
        &self,
        source: &cdc::ClaimSource,
        now_ms: u64,
        window: &mut cdc::LogWindow,
        max: usize,
    ) -> cdc::ClaimFrom {
        let from = source.choose(now_ms, window, max);
        if from == cdc::ClaimFrom::Scan
            && source.next_scan_ms().is_some()
            && self.is(Mutant::CdcSweepOnlyWhenWindowEmpty)
        {
            let offered = window.offer(max);
            if !offered.is_empty() {
                return cdc::ClaimFrom::Log(offered);
            }
        }
        from
    }

    /// A delivery set's status over its members' states: the core's
    /// [`delivery_set::set_status`], the one `status`, `trace`, the page and the reconciler
    /// ask. The set-completes-early mutant hands it the members on their way (sending,
    /// unknown, reconciling) as published.
    pub fn set_status(&self, members: &[State], rule: CompletionRule) -> SetStatus {
        if !self.is(Mutant::SetCompletesEarly) {
            return delivery_set::set_status(members, rule);
        }
        let mut seen = [State::Pending; delivery_set::MEMBERS_MAX];
        let seen = &mut seen[..members.len()];
        for (s, m) in seen.iter_mut().zip(members) {
            *s = match m {
                State::Sending | State::DispatchUnknown | State::Reconciling => State::Published,
                other => *other,
            };
        }
        delivery_set::set_status(seen, rule)
    }

    /// R26: registering `candidate` after `registered` (oldest first): the core's
    /// [`contract::Check`], the decision `sealpost::contract::register` stores. The
    /// register-without-compatibility-check mutant drops the breaches it found.
    pub fn register_contract(
        &self,
        registered: &[SchemaVersion],
        candidate: SchemaVersion,
    ) -> Result<(SchemaVersion, bool), ContractError> {
        let mut check = contract::Check::new(registered, candidate);
        if self.is(Mutant::RegisterWithoutCompatibilityCheck) {
            check.breaches.clear();
        }
        check.registration()
    }

    /// R26: `enqueue`'s check of one event on a route that requires contracts: the core's
    /// [`contract::check_payload`], which both store flavours run. The
    /// enqueue-without-contract-check mutant lets every payload through.
    pub fn check_payload(
        &self,
        event_type: &str,
        payload_schema: &str,
        text: Option<&str>,
        payload: &[u8],
    ) -> Result<(), ContractError> {
        if self.is(Mutant::EnqueueWithoutContractCheck) {
            return Ok(());
        }
        contract::check_payload(event_type, payload_schema, text, payload)
    }

    /// True when cleanup should also run right at acceptance (only the purge-at-ack mutant).
    pub fn purge_on_accept(&self) -> bool {
        self.is(Mutant::PurgeAtAck)
    }
}

/// [`Protocol`]'s decisions as the claim step's hooks.
struct Hooks<'a, D, F> {
    proto: &'a Protocol,
    policy_destination: D,
    fresh_id: F,
}

impl<D: FnMut(usize) -> Digest, F: FnMut() -> EventId> ClaimRules for Hooks<'_, D, F> {
    fn decide_claim(
        &mut self,
        index: usize,
        row: &EventRow,
        served: Served<'_>,
        earlier_unresolved: bool,
        now_ms: u64,
        lease_ms: u64,
    ) -> claim::ClaimDecision {
        let earlier_unresolved = self.proto.earlier_unresolved(earlier_unresolved);
        step::CoreRules.decide_claim(index, row, served, earlier_unresolved, now_ms, lease_ms)
    }

    fn decide_begin_send(
        &mut self,
        index: usize,
        row: &EventRow,
        token: ClaimToken,
        now_ms: u64,
    ) -> Result<BeginSend, claim::Fenced> {
        let (dest, fresh) = (&mut self.policy_destination, &mut self.fresh_id);
        self.proto
            .decide_begin_send(row, token, now_ms, || dest(index), fresh)
    }
}

/// [`Protocol`]'s receipt decision as the acceptance step's hooks.
struct AcceptHooks<'a> {
    proto: &'a Protocol,
    now_ms: u64,
    /// The last verdict came from a mutant that overwrites a filled slot.
    overwrite: bool,
}

impl AcceptRules for AcceptHooks<'_> {
    fn decide_receipt(&mut self, row: &EventRow, r: &Receipt) -> ReceiptVerdict {
        let v = self.proto.decide_receipt(row, r, self.now_ms);
        self.overwrite = v.overwrite_primary;
        v.verdict
    }

    fn apply_receipt(
        &mut self,
        row: &mut EventRow,
        r: &Receipt,
        verdict: ReceiptVerdict,
        now_ms: u64,
    ) -> Result<(), sealpost_core::TransitionError> {
        if self.overwrite && verdict == ReceiptVerdict::Primary {
            // Mutant path only: the slot is overwritten.
            row.primary = Some(r.clone());
            return Ok(());
        }
        receipt::apply_receipt(row, r, verdict, now_ms)
    }
}

/// [`Protocol`]'s send-outcome apply as the report step's hook.
struct ReportHooks<'a> {
    proto: &'a Protocol,
}

impl ReportRules for ReportHooks<'_> {
    fn apply_send_outcome(
        &mut self,
        row: &mut EventRow,
        decision: claim::SendOutcomeDecision,
        rep: &OutcomeReport,
        now_ms: u64,
    ) -> Result<(), sealpost_core::TransitionError> {
        self.proto
            .apply_send_outcome(row, decision, rep.attempt_id, rep.outcome, now_ms)
    }
}

impl ReconcileRules for AcceptHooks<'_> {
    fn decide_reconcile(
        &mut self,
        row: &EventRow,
        token: ClaimToken,
        lookup: &Lookup,
        policy: ReconcilePolicy,
        now_ms: u64,
    ) -> ReconcileDecision {
        self.proto
            .decide_reconcile(row, token, lookup, policy, now_ms)
    }

    fn apply_reconcile(
        &mut self,
        row: &mut EventRow,
        decision: &ReconcileDecision,
        now_ms: u64,
    ) -> Result<(), sealpost_core::TransitionError> {
        self.proto.apply_reconcile(row, decision, now_ms)
    }
}
