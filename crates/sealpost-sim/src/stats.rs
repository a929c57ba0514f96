//! What a run counts: violations per class (G1), late-ACK convergence (G2), unknown
//! resolution times (G3) and how often each fault was injected. Everything merges, so
//! threads can count separately.

/// A checked property class. The names are the JSON keys of `violations`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Violation {
    /// A committed fact without its envelope, a published row whose receipt names a position
    /// that does not hold it, or an accepted receipt that vanished from the store.
    LostEvents,
    /// The broker stored an event id that no committed fact owns.
    SecondEventIds,
    /// A send to anything but the frozen destination, or elsewhere while unknown.
    CrossDestinationRetries,
    /// An accepted receipt or an applied effect whose digests differ from the envelope.
    DivergentPayloads,
    /// A consumer applied one event's effect twice.
    DuplicateEffects,
    /// An `UNKNOWN` row without an open attempt to trace it to.
    UntraceableUnknowns,
    /// A purge before the replay window and every required consumer.
    EarlyPurges,
    /// After faults stop, an event not published, or not applied exactly once per consumer;
    /// or a trace that hit its step bound (a loop that spins instead of waiting).
    Liveness,
    /// A second stored copy of an event at a broker whose adapter declared create-if-absent.
    SecondCopies,
    /// A request that left the process after its claim's lease ended (R9: an expired claim
    /// cannot start a new send).
    SendsPastLease,
    /// R29: an event of a per-aggregate-ordered destination stored at the broker after a
    /// later version of its aggregate, or applied by a consumer after a later version.
    Ordering,
    /// R13: a lookup answered "absent" while the broker held the event (a retry is granted
    /// only once absence is proven).
    FalseAbsences,
    /// Signed envelopes: a consumer applied a message no dispatcher signed (a forged event, a
    /// forged copy, or a genuine signature replayed onto other facts).
    ForgeryApplied,
    /// Signed envelopes: a row's primary receipt, or a verification pass's "held", points at
    /// a message no dispatcher signed (a forged copy adopted as the event's publication).
    ForgedCopyAdopted,
    /// CDC (R32): the slot's confirmed position passed a row that never left the
    /// dispatchable phase (a restarted reader resumes after it: the log would never name it
    /// again).
    CdcConfirmedUnsettled,
    /// R16: a delivery set reported complete while fewer of its members than its completion
    /// rule needs were held at their brokers.
    SetCompletedEarly,
    /// R25: a claim authorised a send for an implementation that the rollout aliases current
    /// when the claim committed do not name as the row's claimant (the alias fence failed).
    SendWithoutAlias,
    /// R25: the shadow reported a divergence for a copy the protocol itself sent for the
    /// row (its sealed event, member, generation, payload, destination digest and event
    /// type), or an ordering divergence while the first stored copies were in order.
    ShadowFalseDivergence,
    /// R25: the shadow compared a copy that differs from the row's sealed envelope (a
    /// forged look-alike read back under the primary's attempt id) and reported nothing.
    ShadowMissedDivergence,
    /// R26: a consumer could not read an event it was handed: its reader refused a
    /// registered version (a breaking change got registered), the writer's version was not
    /// in the registry (an event enqueued with an unregistered schema), or the payload did
    /// not decode as the version it names.
    UnreadableEvents,
    /// R8: an attempt the store registered is no longer among its row's attempts: the
    /// store's layout lost the record of a send (a batch lease dropped while a row it stood
    /// for had not been written since).
    LostAttempts,
}

impl Violation {
    /// Every class, in JSON order.
    pub const ALL: [Violation; 21] = [
        Violation::LostEvents,
        Violation::SecondEventIds,
        Violation::CrossDestinationRetries,
        Violation::DivergentPayloads,
        Violation::DuplicateEffects,
        Violation::UntraceableUnknowns,
        Violation::EarlyPurges,
        Violation::Liveness,
        Violation::SecondCopies,
        Violation::SendsPastLease,
        Violation::Ordering,
        Violation::FalseAbsences,
        Violation::ForgeryApplied,
        Violation::ForgedCopyAdopted,
        Violation::CdcConfirmedUnsettled,
        Violation::SetCompletedEarly,
        Violation::SendWithoutAlias,
        Violation::ShadowFalseDivergence,
        Violation::ShadowMissedDivergence,
        Violation::UnreadableEvents,
        Violation::LostAttempts,
    ];

    /// JSON key.
    pub fn key(self) -> &'static str {
        match self {
            Violation::LostEvents => "lost_events",
            Violation::SecondEventIds => "second_event_ids",
            Violation::CrossDestinationRetries => "cross_destination_retries",
            Violation::DivergentPayloads => "divergent_payloads",
            Violation::DuplicateEffects => "duplicate_effects",
            Violation::UntraceableUnknowns => "untraceable_unknowns",
            Violation::EarlyPurges => "early_purges",
            Violation::Liveness => "liveness",
            Violation::SecondCopies => "second_copies",
            Violation::SendsPastLease => "sends_past_lease",
            Violation::Ordering => "ordering",
            Violation::FalseAbsences => "false_absences",
            Violation::ForgeryApplied => "forgery_applied",
            Violation::ForgedCopyAdopted => "forged_copy_adopted",
            Violation::CdcConfirmedUnsettled => "cdc_confirmed_unsettled",
            Violation::SetCompletedEarly => "set_completed_early",
            Violation::SendWithoutAlias => "send_without_alias",
            Violation::ShadowFalseDivergence => "shadow_false_divergence",
            Violation::ShadowMissedDivergence => "shadow_missed_divergence",
            Violation::UnreadableEvents => "unreadable_events",
            Violation::LostAttempts => "lost_attempts",
        }
    }
}

/// Counts per violation class.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Violations(pub [u64; Violation::ALL.len()]);

impl Violations {
    /// Adds one.
    pub fn add(&mut self, v: Violation) {
        self.0[v as usize] += 1;
    }
    /// Count of one class.
    pub fn get(&self, v: Violation) -> u64 {
        self.0[v as usize]
    }
    /// Sum over classes.
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }
    fn merge(&mut self, o: &Violations) {
        for (a, b) in self.0.iter_mut().zip(o.0) {
            *a += b;
        }
    }
}

/// An injected fault, counted so a run shows each was exercised.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fault {
    /// F1: writer killed before its commit.
    CrashBeforeCommit,
    /// F1: writer killed after its commit, before the response.
    CrashAfterCommit,
    /// F2: an ACK delayed past the claim's lease.
    AckLate,
    /// An ACK lost on the way back.
    AckLost,
    /// F4/F8: an ACK delivered twice.
    AckDuplicated,
    /// Broker answered a duplicate with sequence 0.
    DuplicateSeqZero,
    /// Network partition mid-send: the request never arrived.
    PartitionMidSend,
    /// F3: a claim superseded over an expired lease.
    ClaimSuperseded,
    /// F5: a migration requested while unknown at an unqueryable broker.
    MigrationWhileUnknownUnqueryable,
    /// F6: route policy revised.
    RoutePolicyRevision,
    /// F7: the receipt transaction rolled back.
    ReceiptRollback,
    /// F8: consumer deliveries reordered and duplicated.
    ReorderedDuplicated,
    /// F9: consumer committed, then crashed before acking.
    ConsumerCrashAfterCommit,
    /// Consumer crashed before its commit.
    ConsumerCrashBeforeCommit,
    /// F10: a purge attempted early.
    EarlyPurgeAttempt,
    /// F11: database restored from a backup.
    DatabaseRestored,
    /// Broker outage.
    BrokerDown,
    /// Dispatcher paused (possibly past its lease).
    DispatcherPaused,
    /// Dispatcher killed.
    DispatcherKilled,
    /// An ACK for an unregistered attempt.
    ForgedAck,
    /// An ACK whose payload digest was altered.
    CorruptAck,
    /// A poison message refused by the broker.
    PoisonRejected,
    /// A dispatcher stalled between its claim and the moment the batch leaves.
    StallBeforeSend,
    /// A destination stream deleted for a while (its sends come back "never sent").
    StreamDeleted,
    /// The dispatchers' publish grant on a stream revoked for a while: the broker refuses
    /// every publish there as not permitted, storing nothing (a deployment's fault, never
    /// the event's: nothing may be quarantined for it).
    GrantRevoked,
    /// A create-if-absent broker refused a second copy.
    CopyRefused,
    /// A send refused at its deadline (it would have left after the lease).
    DeadlineRefused,
    /// A message the adapter cannot encode (a header value its wire cannot carry): refused
    /// alone, the rest of its batch sent.
    Unencodable,
    /// A consumer's effect failed (a downstream error): rolled back alone, no inbox row,
    /// settled by the core's `decide_settlement` (sent back with a delay, dead-lettered at
    /// the delivery limit).
    EffectFailed,
    /// The database unreachable: a claim or a receipt transaction could not start (nothing
    /// of it ran); the machine backs off, growing with the failures in a row, and the shell
    /// reconnects when the next one is due. A receipt transaction's tries that never
    /// reached the database do not count toward its limit.
    DatabaseUnreachable,
    /// A bulk lookup scan stopped at its record bound before the end it fixed (a bound, a
    /// time limit or a fetch error in production): nothing learned about the events it did
    /// not see; they stay unknown and are asked again.
    ScanCutShort,
    /// R25: a rollout command moved a route's alias (shadow, takeover, promote, rollback).
    RolloutSwitch,
    /// Adversary: a message with a fresh event id and no valid signature published on a
    /// stream (no signature, a malformed one, an unknown key, or a made-up signature).
    ForgedNewEvent,
    /// Adversary: a copy of a genuine request in flight (its headers, without a valid
    /// signature) published at its subject before the genuine message arrives.
    ForgedCopyFirst,
    /// Adversary: a forged copy of an event published at its subject just before a lookup
    /// (the reconciler's or the verification pass's) reads it.
    ForgedCopyAtLookup,
    /// Adversary: a genuine message's signature replayed onto another event id, payload or
    /// event type.
    ReplayedSignature,
}

impl Fault {
    /// Every fault, in report order.
    pub const ALL: [Fault; 36] = [
        Fault::CrashBeforeCommit,
        Fault::CrashAfterCommit,
        Fault::AckLate,
        Fault::AckLost,
        Fault::AckDuplicated,
        Fault::DuplicateSeqZero,
        Fault::PartitionMidSend,
        Fault::ClaimSuperseded,
        Fault::MigrationWhileUnknownUnqueryable,
        Fault::RoutePolicyRevision,
        Fault::ReceiptRollback,
        Fault::ReorderedDuplicated,
        Fault::ConsumerCrashAfterCommit,
        Fault::ConsumerCrashBeforeCommit,
        Fault::EarlyPurgeAttempt,
        Fault::DatabaseRestored,
        Fault::BrokerDown,
        Fault::DispatcherPaused,
        Fault::DispatcherKilled,
        Fault::ForgedAck,
        Fault::CorruptAck,
        Fault::PoisonRejected,
        Fault::StallBeforeSend,
        Fault::StreamDeleted,
        Fault::GrantRevoked,
        Fault::CopyRefused,
        Fault::DeadlineRefused,
        Fault::Unencodable,
        Fault::EffectFailed,
        Fault::DatabaseUnreachable,
        Fault::ScanCutShort,
        Fault::RolloutSwitch,
        Fault::ForgedNewEvent,
        Fault::ForgedCopyFirst,
        Fault::ForgedCopyAtLookup,
        Fault::ReplayedSignature,
    ];

    /// Label for the report, with the SPEC number where there is one.
    pub fn label(self) -> &'static str {
        match self {
            Fault::CrashBeforeCommit => "F1 writer killed before commit",
            Fault::CrashAfterCommit => "F1 writer killed after commit",
            Fault::AckLate => "F2 ACK after its claim expired",
            Fault::ClaimSuperseded => "F3 claim superseded (UNKNOWN vs retry race)",
            Fault::AckDuplicated => "F4 ACK delivered twice",
            Fault::MigrationWhileUnknownUnqueryable => "F5 migration while unknown, unqueryable",
            Fault::RoutePolicyRevision => "F6 route policy revised",
            Fault::ReceiptRollback => "F7 receipt transaction rolled back",
            Fault::ReorderedDuplicated => "F8 deliveries reordered and duplicated",
            Fault::ConsumerCrashAfterCommit => "F9 consumer crashed after commit",
            Fault::EarlyPurgeAttempt => "F10 early purge attempt",
            Fault::DatabaseRestored => "F11 database restored from backup",
            Fault::AckLost => "ACK lost",
            Fault::DuplicateSeqZero => "duplicate ACK with sequence 0",
            Fault::PartitionMidSend => "network partition mid-send",
            Fault::ConsumerCrashBeforeCommit => "consumer crashed before commit",
            Fault::BrokerDown => "broker down (up to 10 min)",
            Fault::DispatcherPaused => "dispatcher paused",
            Fault::DispatcherKilled => "dispatcher killed",
            Fault::ForgedAck => "ACK for unregistered attempt",
            Fault::CorruptAck => "ACK with altered payload digest",
            Fault::PoisonRejected => "poison refused by broker",
            Fault::DatabaseUnreachable => "database unreachable (transaction never started)",
            Fault::ScanCutShort => "bulk lookup scan cut short at its bound",
            Fault::RolloutSwitch => "R25 rollout alias switched",
            Fault::StallBeforeSend => "dispatcher stalled between claim and send",
            Fault::StreamDeleted => "destination stream deleted",
            Fault::GrantRevoked => "publish grant revoked (refused as not permitted)",
            Fault::CopyRefused => "second copy refused (create-if-absent)",
            Fault::DeadlineRefused => "send refused at its deadline",
            Fault::Unencodable => "message the adapter cannot encode",
            Fault::EffectFailed => "consumer effect failed (rolled back, sent back)",
            Fault::ForgedNewEvent => "forged new event (no valid signature)",
            Fault::ForgedCopyFirst => "forged copy at the subject before the genuine send",
            Fault::ForgedCopyAtLookup => "forged copy found by a lookup",
            Fault::ReplayedSignature => "genuine signature replayed onto other facts",
        }
    }
}

/// Counts per fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Faults(pub [u64; Fault::ALL.len()]);

impl Default for Faults {
    fn default() -> Self {
        Faults([0; Fault::ALL.len()])
    }
}

impl Faults {
    /// Adds one.
    pub fn add(&mut self, f: Fault) {
        self.0[f as usize] += 1;
    }
    /// Count of one fault.
    pub fn get(&self, f: Fault) -> u64 {
        self.0[f as usize]
    }
}

/// Histogram of unknown-episode durations in whole seconds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UnknownTimes {
    /// `buckets[s]` counts episodes resolved in `s` seconds (last bucket: longer).
    pub buckets: Vec<u64>,
    /// Episodes still unknown when the trace ended.
    pub unresolved: u64,
}

const UNKNOWN_BUCKETS: usize = 7_201;

impl UnknownTimes {
    /// Records one resolved episode.
    pub fn record_ms(&mut self, ms: u64) {
        if self.buckets.is_empty() {
            self.buckets = vec![0; UNKNOWN_BUCKETS];
        }
        let s = ms.div_ceil(1000).min(UNKNOWN_BUCKETS as u64 - 1) as usize;
        self.buckets[s] += 1;
    }
    /// Resolved episodes.
    pub fn resolved(&self) -> u64 {
        self.buckets.iter().sum()
    }
    /// The q-quantile in seconds, counting unresolved episodes as never resolved
    /// (`f64::INFINITY` when the quantile falls among them).
    pub fn quantile_s(&self, q: f64) -> f64 {
        let total = self.resolved() + self.unresolved;
        if total == 0 {
            return 0.0;
        }
        let rank = ((q * total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (s, n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return s as f64;
            }
        }
        f64::INFINITY
    }
    fn merge(&mut self, o: &UnknownTimes) {
        if !o.buckets.is_empty() {
            if self.buckets.is_empty() {
                self.buckets = vec![0; UNKNOWN_BUCKETS];
            }
            for (a, b) in self.buckets.iter_mut().zip(&o.buckets) {
                *a += b;
            }
        }
        self.unresolved += o.unresolved;
    }
}

/// Everything one trace (or a merged run) counted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TraceStats {
    /// Traces merged in.
    pub traces: u64,
    /// Simulation steps.
    pub steps: u64,
    /// Violations per class.
    pub violations: Violations,
    /// Genuine ACKs of registered attempts that reached acceptance after their claim ended.
    pub late_acks: u64,
    /// Of those, accepted as primary or duplicate transport receipt.
    pub late_acks_converged: u64,
    /// Unknown episodes.
    pub unknown: UnknownTimes,
    /// Faults injected.
    pub faults: Faults,
    /// Duplicate transport receipts kept.
    pub duplicate_receipts: u64,
    /// Receipts quarantined.
    pub quarantined_receipts: u64,
    /// Receipts rejected (audited).
    pub rejected_receipts: u64,
    /// Writes refused by a fence (stale claims).
    pub fenced_writes: u64,
    /// Second stored copies of one event at the broker (absorbed by inboxes).
    pub second_copies: u64,
    /// Inbox duplicates absorbed.
    pub inbox_duplicates: u64,
    /// Inbox quarantines.
    pub inbox_quarantined: u64,
    /// Deliveries whose effect failed and that the consumer sent back for later.
    pub effect_retries: u64,
    /// Messages a consumer dead-lettered at its delivery limit (recorded, then acked).
    pub dead_lettered: u64,
    /// Migrations granted.
    pub migrations_granted: u64,
    /// Migrations refused.
    pub migrations_refused: u64,
    /// Rows purged.
    pub purged: u64,
    /// Early purge attempts refused.
    pub purges_refused: u64,
    /// Quarantined rows released by the operator path.
    pub quarantine_released: u64,
    /// Unknown-age alerts raised by the reconciler machine.
    pub unknown_alerts: u64,
    /// Published rows re-checked at the broker by the verification pass (R31).
    pub verified: u64,
    /// "Never sent" outcomes reported by dispatchers.
    pub never_sent: u64,
    /// Rows parked in `QUARANTINED` at the end as a conflict (a contradicting copy at a
    /// create-if-absent destination), waiting for an operator.
    pub conflicts_parked: u64,
    /// Claims that waited for an earlier event of their aggregate (R29).
    pub ordering_waits: u64,
    /// Receipts accepted by the dispatcher's guarded fast path (the held row unchanged).
    pub guarded_accepts: u64,
    /// Batch leases the claims took (migration 12), and the first sends they stood for.
    pub leases_taken: u64,
    /// First sends recorded in a lease instead of their row.
    pub leased_sends: u64,
    /// Leases dropped once every row they stood for was written (answered or expired).
    pub leases_dropped: u64,
    /// Deliveries an ordered consumer held back for an earlier version (R29).
    pub ordering_holds: u64,
    /// Ordered events a consumer could not apply because a restore lost an earlier version
    /// before it reached the broker (the consumer's owner's exit: seed the version).
    pub ordering_gaps_parked: u64,
    /// Deliveries a consumer refused by their seal (forged or replayed), recorded and acked.
    pub deliveries_unsealed: u64,
    /// Copies a lookup found whose seal the reader refused (`Lookup::Unsealed`).
    pub copies_unsealed: u64,
    /// Rows parked in `QUARANTINED` as an unsealed copy (a forgery occupies their subject at a
    /// create-if-absent broker), waiting for an operator.
    pub unsealed_parked: u64,
    /// Duplicate ACKs whose stored copy the adapter found not to be the message sent
    /// (answered "already stored": the genuine message's outcome is a lookup away).
    pub duplicate_acks_not_this_message: u64,
    /// Verification findings ("published but missing") caused by a forged copy shadowing the
    /// genuine one at its subject: a true alarm for the operator, not a lost event.
    pub forgeries_reported: u64,
    /// CDC: the reader's counts.
    pub cdc: CdcCounts,
    /// Delivery sets (R16) committed and still in the store at the end of the trace.
    pub sets: u64,
    /// Of those, complete at the end (`delivery_set::set_status`).
    pub sets_complete: u64,
    /// Of those, blocked at the end (a member parked for an operator).
    pub sets_blocked: u64,
    /// R25: the rollout's counts.
    pub rollout: RolloutCounts,
    /// R26: the contracts' counts.
    pub contracts: ContractCounts,
    /// Writers' transactions that committed after others that drew higher positions.
    pub late: LateCommitCounts,
}

/// What the late-commit model did (traces whose writers sometimes commit late).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LateCommitCounts {
    /// Traces with late commits.
    pub traces: u64,
    /// Transactions that drew their positions, stayed open and then committed.
    pub commits: u64,
    /// Their rows that committed behind a dispatcher's scan (a scan had passed their
    /// position).
    pub behind_scan: u64,
    /// Of those, first claimed by a scan that started behind the dispatcher's previous
    /// batch, because the positions were not known to be final (`ScanHorizon`).
    pub found_by_scan_from_behind: u64,
    /// First claimed by a full scan (from the start).
    pub found_by_full_scan: u64,
    /// First claimed by the CDC publisher from the log.
    pub found_by_log: u64,
}

impl LateCommitCounts {
    fn merge(&mut self, o: &LateCommitCounts) {
        self.traces += o.traces;
        self.commits += o.commits;
        self.behind_scan += o.behind_scan;
        self.found_by_scan_from_behind += o.found_by_scan_from_behind;
        self.found_by_full_scan += o.found_by_full_scan;
        self.found_by_log += o.found_by_log;
    }
}

/// What the contract registry and the readers did (traces with contracts only).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ContractCounts {
    /// Traces whose routes require contracts (a registrar, producers writing several
    /// versions, readers at the oldest and the newest version).
    pub traces: u64,
    /// Versions registered (`contract::Check` allowed them), including re-registrations
    /// after a restore.
    pub registered: u64,
    /// Registrations refused as breaking (every candidate the registrar tries that breaks a
    /// rule of the table).
    pub refused: u64,
    /// Enqueues refused by `contract::check_payload` (an unregistered version, or a payload
    /// that is not a datum of the version it names): the producer's transaction rolled back.
    pub enqueue_refused: u64,
    /// Payloads a consumer's `contract::Reader` read.
    pub reads: u64,
    /// Of those, written with another version than the reader's (old readers of new
    /// events, new readers of history).
    pub reads_across_versions: u64,
}

impl ContractCounts {
    fn merge(&mut self, o: &ContractCounts) {
        self.traces += o.traces;
        self.registered += o.registered;
        self.refused += o.refused;
        self.enqueue_refused += o.enqueue_refused;
        self.reads += o.reads;
        self.reads_across_versions += o.reads_across_versions;
    }
}

/// What the rollout (R25) did (traces with a rollout only).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RolloutCounts {
    /// Traces with a rollout (two implementations, alias records, switches).
    pub traces: u64,
    /// Rollout commands that moved an alias (`Switch::To`).
    pub switches: u64,
    /// Rollout commands the core refused (`RolloutError`).
    pub refused: u64,
    /// Rollout commands that changed nothing (`Switch::Unchanged`).
    pub unchanged: u64,
    /// Of the switches: to shadow, takeover, promoted, incumbent (rollback).
    pub to_stage: [u64; 4],
    /// Sends authorised by claims, per implementation ("a", "b").
    pub sends: [u64; 2],
    /// Rows a claim scan skipped because the alias gives them to another implementation.
    pub skipped: u64,
    /// Shadow reads: rounds in which a candidate's process read back what the other
    /// implementation published on a route at stage shadow or takeover.
    pub shadow_reads: u64,
    /// Rows the shadow compared (`rollout::shadow_compare`), each once per primary receipt.
    pub shadow_compared: u64,
    /// Divergences the shadow reported (one per differing field).
    pub shadow_divergences: u64,
    /// Of the rows compared, those whose copy read back was not the sealed envelope (a
    /// forged look-alike under the primary's attempt id).
    pub shadow_foreign: u64,
}

impl RolloutCounts {
    fn merge(&mut self, o: &RolloutCounts) {
        self.traces += o.traces;
        self.switches += o.switches;
        self.refused += o.refused;
        self.unchanged += o.unchanged;
        for (a, b) in self.to_stage.iter_mut().zip(o.to_stage) {
            *a += b;
        }
        for (a, b) in self.sends.iter_mut().zip(o.sends) {
            *a += b;
        }
        self.skipped += o.skipped;
        self.shadow_reads += o.shadow_reads;
        self.shadow_compared += o.shadow_compared;
        self.shadow_divergences += o.shadow_divergences;
        self.shadow_foreign += o.shadow_foreign;
    }
}

/// What the CDC log reader did (traces with a CDC publisher only).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CdcCounts {
    /// Traces with a CDC publisher.
    pub traces: u64,
    /// Of those, traces without a polling dispatcher (the publisher alone).
    pub alone: u64,
    /// Publisher process restarts (after a crash, a lost slot or a restore): a new window
    /// from the slot's confirmed position.
    pub restarts: u64,
    /// Reader reconnects after a stream error (the window kept).
    pub reconnects: u64,
    /// Transactions the log delivered again (after a restart or a reconnect).
    pub repeats: u64,
    /// Slots lost (dropped, invalidated, or gone with a restored database).
    pub slot_losses: u64,
    /// Times the reader stopped reading on a full window.
    pub window_full: u64,
    /// Reader stalls.
    pub stalls: u64,
    /// Rows claimed from the window (named by the log).
    pub claimed_from_log: u64,
    /// Sweep (scan) claims of the publisher.
    pub sweeps: u64,
    /// Confirmed positions written to the slot.
    pub confirms: u64,
}

impl CdcCounts {
    fn merge(&mut self, o: &CdcCounts) {
        self.traces += o.traces;
        self.alone += o.alone;
        self.restarts += o.restarts;
        self.reconnects += o.reconnects;
        self.repeats += o.repeats;
        self.slot_losses += o.slot_losses;
        self.window_full += o.window_full;
        self.stalls += o.stalls;
        self.claimed_from_log += o.claimed_from_log;
        self.sweeps += o.sweeps;
        self.confirms += o.confirms;
    }
}

impl TraceStats {
    /// Adds another run's counts.
    pub fn merge(&mut self, o: &TraceStats) {
        self.traces += o.traces;
        self.steps += o.steps;
        self.violations.merge(&o.violations);
        self.late_acks += o.late_acks;
        self.late_acks_converged += o.late_acks_converged;
        self.unknown.merge(&o.unknown);
        for (a, b) in self.faults.0.iter_mut().zip(o.faults.0) {
            *a += b;
        }
        self.duplicate_receipts += o.duplicate_receipts;
        self.quarantined_receipts += o.quarantined_receipts;
        self.rejected_receipts += o.rejected_receipts;
        self.fenced_writes += o.fenced_writes;
        self.second_copies += o.second_copies;
        self.unknown_alerts += o.unknown_alerts;
        self.verified += o.verified;
        self.never_sent += o.never_sent;
        self.conflicts_parked += o.conflicts_parked;
        self.ordering_waits += o.ordering_waits;
        self.guarded_accepts += o.guarded_accepts;
        self.leases_taken += o.leases_taken;
        self.leased_sends += o.leased_sends;
        self.leases_dropped += o.leases_dropped;
        self.ordering_holds += o.ordering_holds;
        self.ordering_gaps_parked += o.ordering_gaps_parked;
        self.deliveries_unsealed += o.deliveries_unsealed;
        self.copies_unsealed += o.copies_unsealed;
        self.unsealed_parked += o.unsealed_parked;
        self.duplicate_acks_not_this_message += o.duplicate_acks_not_this_message;
        self.forgeries_reported += o.forgeries_reported;
        self.cdc.merge(&o.cdc);
        self.sets += o.sets;
        self.sets_complete += o.sets_complete;
        self.sets_blocked += o.sets_blocked;
        self.rollout.merge(&o.rollout);
        self.contracts.merge(&o.contracts);
        self.late.merge(&o.late);
        self.inbox_duplicates += o.inbox_duplicates;
        self.inbox_quarantined += o.inbox_quarantined;
        self.effect_retries += o.effect_retries;
        self.dead_lettered += o.dead_lettered;
        self.migrations_granted += o.migrations_granted;
        self.migrations_refused += o.migrations_refused;
        self.purged += o.purged;
        self.purges_refused += o.purges_refused;
        self.quarantine_released += o.quarantine_released;
    }

    /// True when this trace or run broke a gate: any violation, or a late ACK that did not
    /// converge (G2).
    pub fn failed(&self) -> bool {
        self.violations.total() > 0 || self.late_acks_converged != self.late_acks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_count_unresolved_as_never() {
        let mut u = UnknownTimes::default();
        for s in 1..=99 {
            u.record_ms(s * 1000);
        }
        assert_eq!(u.quantile_s(0.5), 50.0);
        assert_eq!(u.quantile_s(0.99), 99.0);
        u.unresolved = 2;
        assert!(u.quantile_s(0.99).is_infinite());
    }
}
