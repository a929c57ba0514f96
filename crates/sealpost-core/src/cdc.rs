//! The CDC publisher's window over the database log (R32): the committed transactions the
//! log reader decoded and not yet confirmed to the replication slot, in commit order.
//!
//! The log names the rows a transaction inserted into the sealed-envelope table; the rows'
//! state stays in the work table, and the same claim, send and acceptance point publish them
//! as for a polling dispatcher. The window only decides two things, both here so the shell
//! and the simulator run one rule:
//! * which rows to offer to the next claim (oldest first, each once until its state says it
//!   must be offered again);
//! * how far the slot's confirmed position may advance: past a transaction only once every
//!   row it inserted is *settled* — its state has left the dispatchable phase (published,
//!   quarantined, parked, or unknown and handed to the reconciler) or the row is gone. A
//!   confirmed position is where a restarted reader resumes; confirming past a row that is
//!   still dispatchable would leave it to the polling dispatchers alone, and cleanup could
//!   run ahead of it.
//!
//! The window is bounded: [`LogWindow::has_room`] says whether the reader may decode more;
//! while it is full the reader stops reading and the server buffers the log (the slot
//! retains it), so memory never grows with the backlog.

use std::collections::VecDeque;

use crate::envelope::EventId;
use crate::state::{Phase, State};

/// A row the log named: an `(event, member)` of the work table.
pub type RowKey = (EventId, u16);

/// What a state check found for an offered row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowCheck {
    /// The row left the dispatchable phase (published, quarantined, parked, or unknown:
    /// the reconciler's now), or it is gone (purged, or never there): nothing left to send.
    Settled,
    /// Claimed and on its way (a live lease): wait for its receipt, do not offer again.
    InFlight,
    /// Dispatchable and unclaimed (an ordering wait, a backoff, a lease that ran out, a
    /// claim that lost it to another dispatcher who released it): offer it again.
    Waiting,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    Open,
    Offered,
    Settled,
}

#[derive(Clone, Debug)]
struct Txn {
    end_lsn: u64,
    commit_ms: u64,
    rows: Vec<(RowKey, Status)>,
    unsettled: usize,
}

/// Bytes one row holds in the window (its key and status, and the vector's slot).
pub const ROW_BYTES: usize = std::mem::size_of::<(RowKey, u8)>() + 8;
/// Bytes one transaction holds in the window besides its rows.
pub const TXN_BYTES: usize = std::mem::size_of::<Txn>();

/// The decoded, not yet confirmed transactions, in commit order.
#[derive(Clone, Debug)]
pub struct LogWindow {
    txns: VecDeque<Txn>,
    bytes: usize,
    bytes_max: usize,
    confirmed_lsn: u64,
    received_lsn: u64,
}

/// Figures of the window, for status and metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WindowFigures {
    /// Transactions held.
    pub txns: usize,
    /// Rows held and not settled.
    pub unsettled: usize,
    /// Bytes held ([`ROW_BYTES`], [`TXN_BYTES`]).
    pub bytes: usize,
    /// The position confirmed to the slot.
    pub confirmed_lsn: u64,
    /// The end of the last transaction (or keepalive) received.
    pub received_lsn: u64,
    /// Commit time of the oldest transaction held (database clock, ms).
    pub oldest_commit_ms: Option<u64>,
}

impl LogWindow {
    /// An empty window that resumes from `confirmed_lsn` and holds at most `bytes_max`
    /// bytes (one transaction larger than that is still admitted into an empty window).
    pub fn new(confirmed_lsn: u64, bytes_max: usize) -> LogWindow {
        LogWindow {
            txns: VecDeque::new(),
            bytes: 0,
            bytes_max,
            confirmed_lsn,
            received_lsn: confirmed_lsn,
        }
    }

    /// Whether the reader may decode another transaction.
    pub fn has_room(&self) -> bool {
        self.txns.is_empty() || self.bytes < self.bytes_max
    }

    /// A committed transaction ending at `end_lsn` inserted `rows`. Transactions arrive in
    /// commit order; one at or before a position already received is a repeat after a
    /// restart and is ignored. A transaction that inserted no envelope row behind an empty
    /// window confirms its end at once (the slot must advance while only other tables
    /// change).
    pub fn push(&mut self, end_lsn: u64, commit_ms: u64, rows: Vec<RowKey>) {
        if end_lsn <= self.received_lsn {
            return;
        }
        self.received_lsn = end_lsn;
        if rows.is_empty() {
            if self.txns.is_empty() {
                self.confirmed_lsn = end_lsn;
            } else {
                // Held behind the open transactions: confirmed when they are.
                self.txns.push_back(Txn {
                    end_lsn,
                    commit_ms,
                    rows: Vec::new(),
                    unsettled: 0,
                });
                self.bytes += TXN_BYTES;
            }
            return;
        }
        self.bytes += TXN_BYTES + rows.len() * ROW_BYTES;
        let unsettled = rows.len();
        self.txns.push_back(Txn {
            end_lsn,
            commit_ms,
            rows: rows.into_iter().map(|k| (k, Status::Open)).collect(),
            unsettled,
        });
    }

    /// The server has sent everything up to `wal_end` (a keepalive): behind an empty window
    /// that position is confirmed, so an idle outbox does not hold the server's log.
    pub fn idle_up_to(&mut self, wal_end: u64) {
        if wal_end > self.received_lsn {
            self.received_lsn = wal_end;
        }
        if self.txns.is_empty() && self.received_lsn > self.confirmed_lsn {
            self.confirmed_lsn = self.received_lsn;
        }
    }

    /// Up to `max` open rows, oldest first, now marked offered (a claim takes them).
    pub fn offer(&mut self, max: usize) -> Vec<RowKey> {
        let mut out = Vec::new();
        'txns: for t in &mut self.txns {
            for (k, s) in &mut t.rows {
                if out.len() >= max {
                    break 'txns;
                }
                if *s == Status::Open {
                    *s = Status::Offered;
                    out.push(*k);
                }
            }
        }
        out
    }

    /// Up to `max` offered rows whose state the shell should check, oldest first.
    pub fn offered(&self, max: usize) -> Vec<RowKey> {
        self.txns
            .iter()
            .flat_map(|t| t.rows.iter())
            .filter(|(_, s)| *s == Status::Offered)
            .map(|(k, _)| *k)
            .take(max)
            .collect()
    }

    /// Applies what a state check found for offered rows (rows not offered, or not held,
    /// are ignored).
    pub fn checked(&mut self, results: &[(RowKey, RowCheck)]) {
        let found: std::collections::HashMap<RowKey, RowCheck> = results.iter().copied().collect();
        for t in &mut self.txns {
            for (k, s) in &mut t.rows {
                if *s != Status::Offered {
                    continue;
                }
                match found.get(k) {
                    Some(RowCheck::Settled) => {
                        *s = Status::Settled;
                        t.unsettled -= 1;
                    }
                    Some(RowCheck::Waiting) => *s = Status::Open,
                    Some(RowCheck::InFlight) | None => {}
                }
            }
        }
    }

    /// Drops the settled transactions at the front and returns the new confirmed position
    /// if it moved: the end of the last transaction whose rows, and every earlier
    /// transaction's rows, are all settled.
    pub fn confirm(&mut self) -> Option<u64> {
        let before = self.confirmed_lsn;
        while let Some(t) = self.txns.front() {
            if t.unsettled > 0 {
                break;
            }
            let t = self.txns.pop_front().expect("checked");
            self.bytes -= TXN_BYTES + t.rows.len() * ROW_BYTES;
            self.confirmed_lsn = t.end_lsn;
        }
        if self.txns.is_empty() && self.received_lsn > self.confirmed_lsn {
            // Only row-less transactions and keepalives came after the last one settled.
            self.confirmed_lsn = self.received_lsn;
        }
        (self.confirmed_lsn > before).then_some(self.confirmed_lsn)
    }

    /// The position confirmed to the slot.
    pub fn confirmed_lsn(&self) -> u64 {
        self.confirmed_lsn
    }

    /// Figures for status and metrics.
    pub fn figures(&self) -> WindowFigures {
        WindowFigures {
            txns: self.txns.len(),
            unsettled: self.txns.iter().map(|t| t.unsettled).sum(),
            bytes: self.bytes,
            confirmed_lsn: self.confirmed_lsn,
            received_lsn: self.received_lsn,
            oldest_commit_ms: self.txns.front().map(|t| t.commit_ms),
        }
    }
}

/// Where the CDC publisher's next claim comes from ([`ClaimSource::choose`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClaimFrom {
    /// The rows the log named, oldest first (now offered).
    Log(Vec<RowKey>),
    /// A scan of the claim index, as a polling dispatcher claims.
    Scan,
    /// Nothing to claim now: wait for the log (or the next scan).
    Nothing,
}

/// The CDC publisher's choice between the log and a scan of the claim index. Scans are the
/// safety net of every row the log does not (or no longer) name:
/// * **catching up** (at start, and after the slot was lost and created again): scan while
///   scans find work, so whatever committed before the slot's position is published;
/// * **log lost** (the slot is gone): every claim scans, as a polling dispatcher's;
/// * **steady**: one scan every `sweep_every_ms` *whatever the window holds*, and the log's
///   rows otherwise. A row the log named once and that later needs another send (an unknown
///   outcome the reconciler hands back, an operator's release, an earlier version that
///   blocked it under R29 and settled after its last offer) is found by the next scan, so a
///   window full of rows that cannot be claimed never starves the rows behind them.
#[derive(Clone, Debug)]
pub struct ClaimSource {
    next_scan_ms: Option<u64>,
    catching_up: bool,
    log_lost: bool,
    sweep_every_ms: u64,
}

impl ClaimSource {
    /// A publisher that starts by catching up.
    pub fn new(sweep_every_ms: u64) -> ClaimSource {
        ClaimSource {
            next_scan_ms: None,
            catching_up: true,
            log_lost: false,
            sweep_every_ms,
        }
    }

    /// The next claim's source at `now_ms`; a [`ClaimFrom::Log`] marks its rows offered.
    pub fn choose(&self, now_ms: u64, window: &mut LogWindow, max: usize) -> ClaimFrom {
        if self.log_lost || self.catching_up || self.next_scan_ms.is_none_or(|t| now_ms >= t) {
            return ClaimFrom::Scan;
        }
        let offered = window.offer(max);
        if offered.is_empty() {
            ClaimFrom::Nothing
        } else {
            ClaimFrom::Log(offered)
        }
    }

    /// A scan committed at `now_ms`; `found_work`: it picked at least one row. Catching up
    /// ends with the first scan that finds nothing; the next steady scan is due a sweep
    /// interval later.
    pub fn scanned(&mut self, now_ms: u64, found_work: bool) {
        if self.catching_up && found_work {
            self.next_scan_ms = None;
            return;
        }
        self.catching_up = false;
        self.next_scan_ms = Some(now_ms + self.sweep_every_ms);
    }

    /// The slot is gone: every claim scans from now on.
    pub fn lose_log(&mut self) {
        self.log_lost = true;
    }

    /// When the next steady scan is due (`None`: every claim scans now).
    pub fn next_scan_ms(&self) -> Option<u64> {
        if self.log_lost || self.catching_up {
            None
        } else {
            self.next_scan_ms
        }
    }
}

/// What the publisher's state check read of an offered row.
#[derive(Clone, Copy, Debug)]
pub struct Seen<'a> {
    /// `work.phase`.
    pub phase: i16,
    /// `work.state`.
    pub state: &'a str,
    /// The claim's lease end, if the row is claimed (database clock).
    pub lease_until_ms: Option<u64>,
}

/// What an offered row means for the window, given what the check read of it (`None`: no
/// such row, purged or never committed under this key, so nothing to send) at `now_ms`
/// (database clock): settled once it left the dispatchable phase, in flight while a claim's
/// lease is live ([`crate::claim::lease_live`]), waiting otherwise. A state this build does
/// not know is waiting: the slot never passes a row it cannot judge.
pub fn check_of(seen: Option<Seen<'_>>, now_ms: u64) -> RowCheck {
    let Some(seen) = seen else {
        return RowCheck::Settled;
    };
    let Some(state) = State::parse(seen.state) else {
        return RowCheck::Waiting;
    };
    debug_assert_eq!(state.phase().code(), seen.phase, "phase and state disagree");
    let live = seen
        .lease_until_ms
        .is_some_and(|l| crate::claim::lease_live(l, now_ms));
    match state.phase() {
        Phase::Dispatchable if state != State::Pending && live => RowCheck::InFlight,
        Phase::Dispatchable => RowCheck::Waiting,
        Phase::Unknown | Phase::Settled | Phase::Parked => RowCheck::Settled,
    }
}

/// The text form of a log position, as PostgreSQL writes a `pg_lsn` (`16/B374D848`).
pub fn lsn_text(lsn: u64) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xFFFF_FFFF)
}

/// Parses a `pg_lsn` text (`16/B374D848`).
pub fn parse_lsn(s: &str) -> Option<u64> {
    let (hi, lo) = s.split_once('/')?;
    let hi = u64::from_str_radix(hi, 16).ok()?;
    let lo = u64::from_str_radix(lo, 16).ok()?;
    (hi <= u32::MAX as u64 && lo <= u32::MAX as u64).then_some((hi << 32) | lo)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u8) -> RowKey {
        (EventId([n; 16]), 0)
    }

    #[test]
    fn confirms_only_a_settled_prefix() {
        let mut w = LogWindow::new(10, 1 << 20);
        w.push(20, 1, vec![key(1), key(2)]);
        w.push(30, 2, vec![key(3)]);
        assert_eq!(w.offer(10), vec![key(1), key(2), key(3)]);
        // The later transaction settles first: nothing moves.
        w.checked(&[(key(3), RowCheck::Settled), (key(1), RowCheck::Settled)]);
        assert_eq!(w.confirm(), None);
        assert_eq!(w.confirmed_lsn(), 10);
        // A waiting row is offered again; an in-flight one is not.
        w.checked(&[(key(2), RowCheck::Waiting)]);
        assert_eq!(w.offer(10), vec![key(2)]);
        w.checked(&[(key(2), RowCheck::InFlight)]);
        assert_eq!(w.offer(10), Vec::<RowKey>::new());
        assert_eq!(w.offered(10), vec![key(2)]);
        w.checked(&[(key(2), RowCheck::Settled)]);
        assert_eq!(w.confirm(), Some(30));
        assert_eq!(w.figures().bytes, 0);
    }

    #[test]
    fn repeats_after_a_restart_are_ignored_and_idle_log_is_confirmed() {
        let mut w = LogWindow::new(100, 1 << 20);
        w.push(90, 1, vec![key(1)]);
        assert_eq!(w.figures().txns, 0);
        // Only other tables changed: the slot still advances.
        w.push(120, 2, Vec::new());
        assert_eq!(w.confirmed_lsn(), 120);
        w.idle_up_to(150);
        assert_eq!(w.confirmed_lsn(), 150);
        // Behind an open transaction nothing is confirmed early.
        w.push(160, 3, vec![key(2)]);
        w.push(170, 4, Vec::new());
        w.idle_up_to(200);
        assert_eq!(w.confirm(), None);
        w.offer(1);
        w.checked(&[(key(2), RowCheck::Settled)]);
        assert_eq!(w.confirm(), Some(200));
    }

    #[test]
    fn the_window_is_bounded_but_admits_one_large_transaction() {
        let mut w = LogWindow::new(0, 3 * ROW_BYTES + TXN_BYTES);
        assert!(w.has_room());
        w.push(10, 1, (0..50).map(key).collect());
        assert!(!w.has_room());
        w.offer(100);
        let all: Vec<_> = (0..50).map(|n| (key(n), RowCheck::Settled)).collect();
        w.checked(&all);
        w.confirm();
        assert!(w.has_room());
    }

    #[test]
    fn scans_catch_up_then_run_on_schedule_whatever_the_window_holds() {
        let mut w = LogWindow::new(0, 1 << 20);
        w.push(10, 1, vec![key(1)]);
        let mut s = ClaimSource::new(1_000);
        // Catching up: scans while they find work, the log waits.
        assert_eq!(s.choose(0, &mut w, 10), ClaimFrom::Scan);
        s.scanned(0, true);
        assert_eq!(s.choose(1, &mut w, 10), ClaimFrom::Scan);
        s.scanned(1, false);
        // Steady: the log's rows, then nothing, until the next scan is due.
        assert_eq!(s.choose(2, &mut w, 10), ClaimFrom::Log(vec![key(1)]));
        assert_eq!(s.choose(3, &mut w, 10), ClaimFrom::Nothing);
        w.checked(&[(key(1), RowCheck::Waiting)]);
        // A due scan runs even while the window has rows to offer.
        assert_eq!(s.choose(1_001, &mut w, 10), ClaimFrom::Scan);
        s.scanned(1_001, true);
        assert_eq!(s.choose(1_002, &mut w, 10), ClaimFrom::Log(vec![key(1)]));
        // The log lost: scans only.
        s.lose_log();
        assert_eq!(s.next_scan_ms(), None);
        assert_eq!(s.choose(1_003, &mut w, 10), ClaimFrom::Scan);
    }

    #[test]
    fn a_row_is_in_flight_only_under_a_live_lease_and_unknown_states_wait() {
        let seen = |state: &'static str, lease: Option<u64>| {
            let phase = State::parse(state).map_or(0, |s| s.phase().code());
            Some(Seen {
                phase,
                state,
                lease_until_ms: lease,
            })
        };
        assert_eq!(check_of(None, 100), RowCheck::Settled);
        assert_eq!(
            check_of(seen("SENDING", Some(101)), 100),
            RowCheck::InFlight
        );
        // The lease ends at its instant (the claim rule's `lease_live`).
        assert_eq!(check_of(seen("SENDING", Some(100)), 100), RowCheck::Waiting);
        assert_eq!(check_of(seen("PENDING", Some(500)), 100), RowCheck::Waiting);
        assert_eq!(check_of(seen("PUBLISHED", None), 100), RowCheck::Settled);
        assert_eq!(
            check_of(seen("DISPATCH_UNKNOWN", None), 100),
            RowCheck::Settled
        );
        assert_eq!(
            check_of(seen("FROM_A_NEWER_BUILD", None), 100),
            RowCheck::Waiting
        );
    }

    #[test]
    fn lsn_text_round_trips() {
        assert_eq!(lsn_text(0x16_B374_D848), "16/B374D848");
        assert_eq!(parse_lsn("16/B374D848"), Some(0x16_B374_D848));
        assert_eq!(parse_lsn("0/0"), Some(0));
        assert_eq!(parse_lsn("x"), None);
    }
}
