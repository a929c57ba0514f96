//! The reconciler as a sans-IO state machine (the `quinn-proto` shape), driven by the tokio
//! shell in production and by the simulator in tests. It decides when to claim unknown rows,
//! how many lookups run at once, when the unknown-age alert is checked (also while busy),
//! and when the rolling verification pass re-checks `PUBLISHED` rows at the broker (R31).
//! What a lookup *means* is decided per row by [`crate::reconcile::decide_reconcile`], and
//! when a row is due again by its persisted [`crate::row::Pacing`], so every reconciler
//! process honours the same backoff and the oldest-due rows go first.

use std::collections::VecDeque;

use crate::claim::ClaimToken;
use crate::envelope::{Destination, EventId};
use crate::port::{Capabilities, Lookup};
use crate::reconcile::{shares_scan, LookupScan};

/// Limits and timings of one reconciler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReconcilerConfig {
    /// Unknown rows claimed per scan (only rows whose lookup is due).
    pub batch_max: usize,
    /// Reconciler lease (database clock).
    pub lease_ms: u64,
    /// Broker lookups outstanding at once.
    pub lookups_in_flight_max: usize,
    /// Wait after a scan found nothing due.
    pub idle_poll_ms: u64,
    /// Wait after a failed claim; it doubles with each failure in a row
    /// ([`crate::subscription::backoff_ms`]).
    pub error_backoff_ms: u64,
    /// The longest wait while the database keeps failing.
    pub error_backoff_max_ms: u64,
    /// Unknown rows older than this raise an alert (G3 asks for p99 within 15 minutes).
    pub unknown_alert_ms: u64,
    /// How often the unknown age is checked, busy or not.
    pub age_check_every_ms: u64,
    /// How often a verification batch of `PUBLISHED` rows is looked up (0: never).
    pub verify_every_ms: u64,
    /// Published rows per verification batch.
    pub verify_batch_max: usize,
}

impl Default for ReconcilerConfig {
    fn default() -> Self {
        ReconcilerConfig {
            batch_max: 200,
            lease_ms: 10_000,
            lookups_in_flight_max: 32,
            idle_poll_ms: 1_000,
            error_backoff_ms: 1_000,
            error_backoff_max_ms: 10_000,
            unknown_alert_ms: 900_000,
            age_check_every_ms: 10_000,
            verify_every_ms: 5_000,
            verify_batch_max: 100,
        }
    }
}

/// A row the reconciler holds in `RECONCILING`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReconcileItem {
    /// Event id.
    pub event_id: EventId,
    /// Member.
    pub member: u16,
    /// The reconciler's claim.
    pub token: ClaimToken,
    /// The frozen destination to ask.
    pub destination: Destination,
}

/// A `PUBLISHED` row to re-check at the broker (R31).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifyItem {
    /// Event id.
    pub event_id: EventId,
    /// Member.
    pub member: u16,
    /// Its frozen destination.
    pub destination: Destination,
    /// The position of its primary receipt.
    pub sequence: u64,
}

/// How many rows, in primary-key order from the pass's cursor, one verification batch of
/// at most `max` items examines (R31). The batch is the `PUBLISHED` rows among them, the
/// first `max` of them; the cursor moves past the last row returned when `max` were found,
/// else past the whole window, and back to the start when the window was empty (the pass
/// wrapped around). Bounding the rows examined, not only the rows returned, bounds a
/// batch's cost by the window: a pass over a backlog of rows not yet published walks it a
/// window per batch instead of reading the whole backlog to find `max` published rows (or
/// the whole table, the plan PostgreSQL picked when its statistics said no row was
/// `PUBLISHED`). A window without a published row answers an empty batch, so the pass
/// rests until its next turn, as after a wrap.
pub fn verify_window_rows(max: usize) -> usize {
    max.saturating_mul(10).max(1_000)
}

/// What the shell must do next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReconcileAction {
    /// Claim at most `max` due unknown rows; answer with
    /// [`ReconcilerMachine::handle_claimed`] or [`ReconcilerMachine::handle_claim_failed`].
    ClaimUnknown {
        /// Batch size.
        max: usize,
    },
    /// Ask the broker; answer with [`ReconcilerMachine::handle_lookup`].
    Lookup(ReconcileItem),
    /// Ask the broker about every row of the group with one scan (`Broker::lookup_many`:
    /// one frozen partition, mint times within the declared window, grouped by
    /// [`shares_scan`]); answer with [`ReconcilerMachine::handle_lookups`], one lookup per
    /// row in order.
    LookupMany(Vec<ReconcileItem>),
    /// Apply the verdict for this row in one transaction (`decide_reconcile`); answer with
    /// [`ReconcilerMachine::handle_finished`].
    Finish(ReconcileItem, Lookup),
    /// Read the count and age of unknown rows; answer with
    /// [`ReconcilerMachine::handle_unknown_age`].
    CheckUnknownAge,
    /// Raise the unknown-age alert (log it, count it). No answer.
    Alert {
        /// Unknown rows.
        unknown: u64,
        /// Age of the oldest.
        oldest_unknown_ms: u64,
    },
    /// Load the next `max` published rows of the rolling verification pass; answer with
    /// [`ReconcilerMachine::handle_verify_batch`].
    LoadPublished {
        /// Batch size.
        max: usize,
    },
    /// Look a published row up; answer with [`ReconcilerMachine::handle_verify_lookup`].
    VerifyLookup(VerifyItem),
    /// Record the finding "published but missing at the broker" (R31). No answer.
    ReportMissing(VerifyItem),
}

/// Counts of what the machine saw.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReconcileCounts {
    /// Rows claimed.
    pub claimed: u64,
    /// Lookups asked (one per row, whether alone or in a scan).
    pub lookups: u64,
    /// Scans asked ([`ReconcileAction::LookupMany`]), each answering one or more rows.
    pub scans: u64,
    /// Verdicts applied.
    pub finished: u64,
    /// Alerts raised.
    pub alerts: u64,
    /// Published rows re-checked.
    pub verified: u64,
    /// Published rows missing at the broker.
    pub missing: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scan {
    Idle { wake_at_ms: u64 },
    Claiming,
    Working,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verify {
    Idle { wake_at_ms: u64 },
    Loading,
    Working,
}

/// The reconciler state machine.
#[derive(Clone, Debug)]
pub struct ReconcilerMachine {
    cfg: ReconcilerConfig,
    caps: Capabilities,
    scan: Scan,
    verify: Verify,
    queue: VecDeque<ReconcileItem>,
    finishing: VecDeque<(ReconcileItem, Lookup)>,
    verify_queue: VecDeque<VerifyItem>,
    missing: VecDeque<VerifyItem>,
    in_flight: usize,
    verify_in_flight: usize,
    finish_outstanding: usize,
    next_age_check_ms: u64,
    age_outstanding: bool,
    alert: Option<(u64, u64)>,
    counts: ReconcileCounts,
    /// The clusters this process's adapter can ask (`None`: every cluster).
    clusters: Option<Vec<String>>,
    /// Told to stop: finish the rows it holds, claim and verify nothing more.
    stopping: bool,
    /// Failed claims in a row: the backoff grows with them.
    claim_failures_in_row: u32,
}

impl ReconcilerMachine {
    /// A machine that scans at `now_ms`, for a broker with `caps`.
    pub fn new(cfg: ReconcilerConfig, caps: Capabilities, now_ms: u64) -> ReconcilerMachine {
        let verify_wake = if cfg.verify_every_ms == 0 || !caps.lookup_by_event_id {
            u64::MAX
        } else {
            now_ms + cfg.verify_every_ms
        };
        ReconcilerMachine {
            cfg,
            caps,
            scan: Scan::Idle { wake_at_ms: now_ms },
            verify: Verify::Idle {
                wake_at_ms: verify_wake,
            },
            queue: VecDeque::new(),
            finishing: VecDeque::new(),
            verify_queue: VecDeque::new(),
            missing: VecDeque::new(),
            in_flight: 0,
            verify_in_flight: 0,
            finish_outstanding: 0,
            next_age_check_ms: now_ms + cfg.age_check_every_ms,
            age_outstanding: false,
            alert: None,
            counts: ReconcileCounts::default(),
            clusters: None,
            stopping: false,
            claim_failures_in_row: 0,
        }
    }

    /// Restricts the lookups to `clusters` (the one the adapter is connected to): a row of
    /// another cluster cannot be asked here, so its verdict is "unavailable" (it stays
    /// unknown and waits out its backoff) without a round trip, and its published rows are
    /// not verified here.
    pub fn with_clusters(mut self, clusters: Vec<String>) -> ReconcilerMachine {
        self.clusters = Some(clusters);
        self
    }

    fn can_ask(&self, destination: &Destination) -> bool {
        self.clusters
            .as_ref()
            .is_none_or(|c| c.contains(&destination.cluster))
    }

    /// Stops the machine: the rows it holds in `RECONCILING` are still looked up and finished
    /// (so a stopped reconciler leaves none of them waiting for its lease to run out), but it
    /// claims, verifies and checks nothing more.
    pub fn handle_stop(&mut self) {
        self.stopping = true;
        self.verify_queue.clear();
    }

    /// Whether the machine holds no row and waits for no answer about one (after
    /// [`ReconcilerMachine::handle_stop`]: it may be dropped).
    pub fn is_idle(&self) -> bool {
        self.queue.is_empty()
            && self.finishing.is_empty()
            && self.in_flight == 0
            && self.finish_outstanding == 0
            && self.scan != Scan::Claiming
    }

    /// What the machine saw so far.
    pub fn counts(&self) -> ReconcileCounts {
        self.counts
    }

    /// The next action due at `now_ms`; call until `None`.
    pub fn poll_action(&mut self, now_ms: u64) -> Option<ReconcileAction> {
        if let Some((unknown, oldest_unknown_ms)) = self.alert.take() {
            return Some(ReconcileAction::Alert {
                unknown,
                oldest_unknown_ms,
            });
        }
        if !self.stopping && !self.age_outstanding && now_ms >= self.next_age_check_ms {
            self.age_outstanding = true;
            return Some(ReconcileAction::CheckUnknownAge);
        }
        if let Some(item) = self.missing.pop_front() {
            return Some(ReconcileAction::ReportMissing(item));
        }
        if let Some((item, lookup)) = self.finishing.pop_front() {
            self.finish_outstanding += 1;
            return Some(ReconcileAction::Finish(item, lookup));
        }
        if self.in_flight + self.verify_in_flight < self.cfg.lookups_in_flight_max {
            if let Some(item) = self.queue.pop_front() {
                if !self.caps.lookup_by_event_id {
                    // This broker cannot be asked: the verdict needs no round trip (R14).
                    self.finish_outstanding += 1;
                    return Some(ReconcileAction::Finish(item, Lookup::Unqueryable));
                }
                if !self.can_ask(&item.destination) {
                    self.finish_outstanding += 1;
                    return Some(ReconcileAction::Finish(item, Lookup::Unavailable));
                }
                self.in_flight += 1;
                if let Some(scan) = self.caps.lookup_scan {
                    let group = self.scan_group(item, scan);
                    self.counts.lookups += group.len() as u64;
                    self.counts.scans += 1;
                    return Some(ReconcileAction::LookupMany(group));
                }
                self.counts.lookups += 1;
                return Some(ReconcileAction::Lookup(item));
            }
            while let Some(item) = self.verify_queue.pop_front() {
                if !self.can_ask(&item.destination) {
                    continue; // another process's cluster: nothing to learn here
                }
                self.verify_in_flight += 1;
                return Some(ReconcileAction::VerifyLookup(item));
            }
            if self.verify == Verify::Working && self.verify_in_flight == 0 {
                self.verify = Verify::Idle {
                    wake_at_ms: now_ms + self.cfg.verify_every_ms,
                };
            }
        }
        if self.stopping {
            return None;
        }
        if let Scan::Idle { wake_at_ms } = self.scan {
            if now_ms >= wake_at_ms {
                self.scan = Scan::Claiming;
                return Some(ReconcileAction::ClaimUnknown {
                    max: self.cfg.batch_max,
                });
            }
        }
        if let Verify::Idle { wake_at_ms } = self.verify {
            if now_ms >= wake_at_ms {
                self.verify = Verify::Loading;
                return Some(ReconcileAction::LoadPublished {
                    max: self.cfg.verify_batch_max,
                });
            }
        }
        None
    }

    /// When the machine wants to be polled again without any answer arriving.
    pub fn poll_timeout(&self) -> Option<u64> {
        let mut t = if self.age_outstanding {
            u64::MAX
        } else {
            self.next_age_check_ms
        };
        if let Scan::Idle { wake_at_ms } = self.scan {
            t = t.min(wake_at_ms);
        }
        if let Verify::Idle { wake_at_ms } = self.verify {
            t = t.min(wake_at_ms);
        }
        (t != u64::MAX).then_some(t)
    }

    /// A send went unknown in this process (or a commit asked for it): scan now if idle.
    pub fn handle_notify(&mut self, now_ms: u64) {
        if let Scan::Idle { wake_at_ms } = &mut self.scan {
            *wake_at_ms = (*wake_at_ms).min(now_ms);
        }
    }

    /// The claim committed with these rows (each now `RECONCILING` under `token`).
    pub fn handle_claimed(&mut self, now_ms: u64, items: Vec<ReconcileItem>) {
        debug_assert_eq!(self.scan, Scan::Claiming);
        self.claim_failures_in_row = 0;
        if items.is_empty() {
            self.scan = Scan::Idle {
                wake_at_ms: now_ms + self.cfg.idle_poll_ms,
            };
            return;
        }
        self.counts.claimed += items.len() as u64;
        self.queue.extend(items);
        self.scan = Scan::Working;
    }

    /// The claim failed (the database unreachable included): try again after a backoff
    /// that grows while the failures go on; the shell reconnects when the next claim is due.
    pub fn handle_claim_failed(&mut self, now_ms: u64) {
        self.claim_failures_in_row = self.claim_failures_in_row.saturating_add(1);
        let backoff = crate::subscription::backoff_ms(
            self.cfg.error_backoff_ms,
            self.cfg.error_backoff_max_ms,
            self.claim_failures_in_row,
        );
        self.scan = Scan::Idle {
            wake_at_ms: now_ms + backoff,
        };
    }

    /// `head` and the queued rows one scan can answer with it ([`shares_scan`]), at most
    /// `scan.events_max`, taken out of the queue.
    fn scan_group(&mut self, head: ReconcileItem, scan: LookupScan) -> Vec<ReconcileItem> {
        let mut group = vec![head];
        let mut i = 0;
        while group.len() < scan.events_max.max(1) && i < self.queue.len() {
            let joins = shares_scan(
                (&group[0].destination, group[0].event_id),
                (&self.queue[i].destination, self.queue[i].event_id),
                scan.window_ms,
            );
            if joins {
                group.extend(self.queue.remove(i));
            } else {
                i += 1;
            }
        }
        group
    }

    /// The broker answered a scan: one lookup per row of the group, in order (a missing
    /// answer is nothing learned).
    pub fn handle_lookups(&mut self, group: Vec<ReconcileItem>, lookups: Vec<Lookup>) {
        debug_assert!(self.in_flight > 0);
        debug_assert_eq!(group.len(), lookups.len());
        self.in_flight -= 1;
        let mut lookups = lookups.into_iter();
        for item in group {
            let l = lookups.next().unwrap_or(Lookup::Unavailable);
            self.finishing.push_back((item, l));
        }
    }

    /// The broker answered a lookup.
    pub fn handle_lookup(&mut self, item: ReconcileItem, lookup: Lookup) {
        debug_assert!(self.in_flight > 0);
        self.in_flight -= 1;
        self.finishing.push_back((item, lookup));
    }

    /// A verdict was applied (or its transaction failed: the row's reconciler lease runs out
    /// and a later scan takes it again).
    pub fn handle_finished(&mut self, now_ms: u64) {
        debug_assert!(self.finish_outstanding > 0);
        self.finish_outstanding -= 1;
        self.counts.finished += 1;
        if self.scan == Scan::Working
            && self.queue.is_empty()
            && self.finishing.is_empty()
            && self.in_flight == 0
            && self.finish_outstanding == 0
        {
            // The batch is done: scan again at once. Rows that stayed unknown carry their
            // own next-lookup time, so the next scan takes other rows, not these.
            self.scan = Scan::Idle { wake_at_ms: now_ms };
        }
    }

    /// The unknown count and the age of the oldest unknown row.
    pub fn handle_unknown_age(&mut self, now_ms: u64, unknown: u64, oldest_unknown_ms: u64) {
        self.age_outstanding = false;
        self.next_age_check_ms = now_ms + self.cfg.age_check_every_ms;
        if unknown > 0 && oldest_unknown_ms > self.cfg.unknown_alert_ms {
            self.counts.alerts += 1;
            self.alert = Some((unknown, oldest_unknown_ms));
        }
    }

    /// The next published rows of the rolling pass (empty: the pass wrapped around).
    pub fn handle_verify_batch(&mut self, now_ms: u64, items: Vec<VerifyItem>) {
        if items.is_empty() {
            self.verify = Verify::Idle {
                wake_at_ms: now_ms + self.cfg.verify_every_ms,
            };
            return;
        }
        self.verify_queue.extend(items);
        self.verify = Verify::Working;
    }

    /// The broker answered a verification lookup.
    pub fn handle_verify_lookup(&mut self, now_ms: u64, item: VerifyItem, lookup: &Lookup) {
        debug_assert!(self.verify_in_flight > 0);
        self.verify_in_flight -= 1;
        self.counts.verified += 1;
        if decide_verify(&item, lookup) == VerifyVerdict::Missing {
            self.counts.missing += 1;
            self.missing.push_back(item);
        }
        if self.verify == Verify::Working
            && self.verify_queue.is_empty()
            && self.verify_in_flight == 0
        {
            self.verify = Verify::Idle {
                wake_at_ms: now_ms + self.cfg.verify_every_ms,
            };
        }
    }
}

/// What a verification lookup of a `PUBLISHED` row shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VerifyVerdict {
    /// The broker still holds it.
    Held,
    /// The broker answered and holds no copy: the acknowledged message was lost (a lost
    /// replica, a stream purged behind Sealpost's back). A finding, never silence (R31).
    Missing,
    /// Nothing was learned this time (broker unavailable, cannot be asked).
    Unknown,
}

/// Decides what a verification lookup shows.
pub fn decide_verify(item: &VerifyItem, lookup: &Lookup) -> VerifyVerdict {
    match lookup {
        Lookup::Found(r) if r.event_id == item.event_id && r.member == item.member => {
            VerifyVerdict::Held
        }
        // A copy whose seal was refused is not the event: the genuine one is missing.
        Lookup::Found(_) | Lookup::Unsealed { .. } | Lookup::Absent => VerifyVerdict::Missing,
        // Not judged: nothing learned.
        Lookup::Copies(_) | Lookup::Unavailable | Lookup::Unqueryable => VerifyVerdict::Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::{PartitionAlgorithm, RoutePolicy};

    fn caps(lookup: bool) -> Capabilities {
        Capabilities {
            lookup_by_event_id: lookup,
            duplicate_window_ms: Some(120_000),
            create_if_absent: lookup,
            per_key_ordering: false,
            handover_margin_ms: 0,
            lookup_scan: None,
        }
    }

    fn item(i: u8) -> ReconcileItem {
        ReconcileItem {
            event_id: EventId([i; 16]),
            member: 0,
            token: ClaimToken {
                owner: 1,
                generation: u64::from(i),
            },
            destination: RoutePolicy {
                generation: 1,
                cluster: "c".into(),
                topic: "T".into(),
                partition_algorithm: PartitionAlgorithm::None,
                serializer: "json.v1".into(),
                durability: "file".into(),
                required_ack: "stream".into(),
                ordering: crate::envelope::EventOrdering::Unordered,
            }
            .resolve("k"),
        }
    }

    fn cfg() -> ReconcilerConfig {
        ReconcilerConfig {
            lookups_in_flight_max: 2,
            verify_every_ms: 0,
            ..ReconcilerConfig::default()
        }
    }

    #[test]
    fn lookups_are_bounded_and_a_finished_batch_scans_again_at_once() {
        let mut m = ReconcilerMachine::new(cfg(), caps(true), 0);
        assert_eq!(
            m.poll_action(0),
            Some(ReconcileAction::ClaimUnknown { max: 200 })
        );
        m.handle_claimed(1, vec![item(1), item(2), item(3)]);
        assert_eq!(m.poll_action(1), Some(ReconcileAction::Lookup(item(1))));
        assert_eq!(m.poll_action(1), Some(ReconcileAction::Lookup(item(2))));
        assert_eq!(m.poll_action(1), None, "two lookups at most");
        m.handle_lookup(item(1), Lookup::Unavailable);
        assert_eq!(
            m.poll_action(2),
            Some(ReconcileAction::Finish(item(1), Lookup::Unavailable))
        );
        assert_eq!(m.poll_action(2), Some(ReconcileAction::Lookup(item(3))));
        m.handle_finished(3);
        m.handle_lookup(item(2), Lookup::Absent);
        m.handle_lookup(item(3), Lookup::Absent);
        assert!(matches!(
            m.poll_action(4),
            Some(ReconcileAction::Finish(..))
        ));
        assert!(matches!(
            m.poll_action(4),
            Some(ReconcileAction::Finish(..))
        ));
        m.handle_finished(5);
        assert_eq!(m.poll_action(5), None, "one verdict still outstanding");
        m.handle_finished(6);
        assert!(matches!(
            m.poll_action(6),
            Some(ReconcileAction::ClaimUnknown { .. })
        ));
        m.handle_claimed(7, vec![]);
        assert_eq!(m.poll_timeout(), Some(7 + cfg().idle_poll_ms));
    }

    #[test]
    fn a_stopped_machine_finishes_the_rows_it_holds_and_claims_nothing_more() {
        let mut m = ReconcilerMachine::new(cfg(), caps(true), 0);
        m.poll_action(0);
        m.handle_claimed(1, vec![item(1), item(2), item(3)]);
        assert_eq!(m.poll_action(1), Some(ReconcileAction::Lookup(item(1))));
        m.handle_stop();
        assert!(!m.is_idle(), "three rows are held");
        assert_eq!(m.poll_action(1), Some(ReconcileAction::Lookup(item(2))));
        m.handle_lookup(item(1), Lookup::Absent);
        m.handle_lookup(item(2), Lookup::Absent);
        let mut finished = 0;
        let mut now = 2;
        while !m.is_idle() {
            match m.poll_action(now) {
                Some(ReconcileAction::Finish(..)) => {
                    finished += 1;
                    m.handle_finished(now);
                }
                Some(ReconcileAction::Lookup(i)) => m.handle_lookup(i, Lookup::Absent),
                Some(other) => panic!("a stopped machine asked for {other:?}"),
                None => panic!("held rows but nothing to do"),
            }
            now += 1_000_000;
        }
        assert_eq!(finished, 3, "every held row gets its verdict");
        assert_eq!(
            m.poll_action(now + 1_000_000),
            None,
            "no new claim or check"
        );
    }

    #[test]
    fn the_age_alert_is_checked_while_busy() {
        let c = cfg();
        let mut m = ReconcilerMachine::new(c, caps(true), 0);
        m.poll_action(0);
        m.handle_claimed(0, (1..=10).map(item).collect());
        let t = c.age_check_every_ms;
        // Lookups are outstanding and never answered: the machine is busy.
        m.poll_action(1);
        m.poll_action(1);
        assert_eq!(m.poll_action(t), Some(ReconcileAction::CheckUnknownAge));
        m.handle_unknown_age(t, 10, c.unknown_alert_ms + 1);
        assert_eq!(
            m.poll_action(t),
            Some(ReconcileAction::Alert {
                unknown: 10,
                oldest_unknown_ms: c.unknown_alert_ms + 1
            })
        );
        assert_eq!(m.counts().alerts, 1);
    }

    #[test]
    fn rows_of_another_cluster_are_not_asked_here() {
        let mut m = ReconcilerMachine::new(cfg(), caps(true), 0).with_clusters(vec!["x".into()]);
        m.poll_action(0);
        m.handle_claimed(0, vec![item(1)]);
        assert_eq!(
            m.poll_action(0),
            Some(ReconcileAction::Finish(item(1), Lookup::Unavailable))
        );
        assert_eq!(m.counts().lookups, 0);
    }

    #[test]
    fn an_unqueryable_broker_is_never_asked() {
        let mut m = ReconcilerMachine::new(cfg(), caps(false), 0);
        m.poll_action(0);
        m.handle_claimed(0, vec![item(1)]);
        assert_eq!(
            m.poll_action(0),
            Some(ReconcileAction::Finish(item(1), Lookup::Unqueryable))
        );
        assert_eq!(m.counts().lookups, 0);
    }

    #[test]
    fn verification_reports_published_rows_missing_at_the_broker() {
        let c = ReconcilerConfig {
            verify_every_ms: 100,
            ..cfg()
        };
        let mut m = ReconcilerMachine::new(c, caps(true), 0);
        m.poll_action(0); // claim
        m.handle_claimed(0, vec![]);
        assert_eq!(
            m.poll_action(100),
            Some(ReconcileAction::LoadPublished { max: 100 })
        );
        let v = VerifyItem {
            event_id: EventId([9; 16]),
            member: 0,
            destination: item(1).destination,
            sequence: 4,
        };
        m.handle_verify_batch(100, vec![v.clone()]);
        assert_eq!(
            m.poll_action(100),
            Some(ReconcileAction::VerifyLookup(v.clone()))
        );
        m.handle_verify_lookup(101, v.clone(), &Lookup::Absent);
        assert_eq!(m.poll_action(101), Some(ReconcileAction::ReportMissing(v)));
        assert_eq!(m.counts().missing, 1);
    }

    #[test]
    fn failed_claims_in_a_row_double_the_wait_up_to_the_cap_and_a_claim_resets_it() {
        let cfg = ReconcilerConfig {
            error_backoff_ms: 1_000,
            error_backoff_max_ms: 5_000,
            verify_every_ms: 0,
            age_check_every_ms: 1_000_000,
            ..ReconcilerConfig::default()
        };
        let mut m = ReconcilerMachine::new(cfg, caps(true), 0);
        let mut now = 0;
        let mut waits = Vec::new();
        for _ in 0..5 {
            loop {
                match m.poll_action(now) {
                    Some(ReconcileAction::ClaimUnknown { .. }) => break,
                    Some(ReconcileAction::CheckUnknownAge) => m.handle_unknown_age(now, 0, 0),
                    Some(other) => panic!("unexpected {other:?}"),
                    None => now = m.poll_timeout().unwrap(),
                }
            }
            m.handle_claim_failed(now);
            let due = m.poll_timeout().unwrap();
            waits.push(due - now);
            now = due;
        }
        assert_eq!(waits, vec![1_000, 2_000, 4_000, 5_000, 5_000]);
        loop {
            match m.poll_action(now) {
                Some(ReconcileAction::ClaimUnknown { .. }) => break,
                Some(ReconcileAction::CheckUnknownAge) => m.handle_unknown_age(now, 0, 0),
                Some(other) => panic!("unexpected {other:?}"),
                None => now = m.poll_timeout().unwrap(),
            }
        }
        m.handle_claimed(now, vec![item(1)]);
        assert!(matches!(
            m.poll_action(now),
            Some(ReconcileAction::Lookup(_))
        ));
    }
}
