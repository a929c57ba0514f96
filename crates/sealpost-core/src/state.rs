//! The envelope state machine (R5–R6) as one transition table. Every state change any shell
//! makes goes through [`transition`]; anything not in [`TRANSITIONS`] is a typed error.

/// State of one envelope row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum State {
    /// Committed with the business change, waiting for a dispatcher.
    Pending,
    /// A dispatcher holds a lease; no send has been registered yet.
    Claimed,
    /// An attempt is registered and the send may be in flight.
    Sending,
    /// The publish slot holds a primary receipt.
    Published,
    /// Published and past consumption; kept for the replay window.
    Retained,
    /// Evidence removed after the replay window and every required watermark.
    Purged,
    /// A send may or may not have been stored (ACK lost, lease expired while sending).
    DispatchUnknown,
    /// The reconciler holds the event while it asks the broker.
    Reconciling,
    /// The reconciler granted a redelivery to the same frozen destination.
    RetryClaimed,
    /// Poison: permanently rejected past the retry limit; waits for an operator.
    Quarantined,
}

impl State {
    /// Every state, in table order.
    pub const ALL: [State; 10] = [
        State::Pending,
        State::Claimed,
        State::Sending,
        State::Published,
        State::Retained,
        State::Purged,
        State::DispatchUnknown,
        State::Reconciling,
        State::RetryClaimed,
        State::Quarantined,
    ];

    /// The name stored in the database and printed by the CLI.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Pending => "PENDING",
            State::Claimed => "CLAIMED",
            State::Sending => "SENDING",
            State::Published => "PUBLISHED",
            State::Retained => "RETAINED",
            State::Purged => "PURGED",
            State::DispatchUnknown => "DISPATCH_UNKNOWN",
            State::Reconciling => "RECONCILING",
            State::RetryClaimed => "RETRY_CLAIMED",
            State::Quarantined => "QUARANTINED",
        }
    }

    /// Parses [`State::as_str`].
    pub fn parse(s: &str) -> Option<State> {
        State::ALL.into_iter().find(|st| st.as_str() == s)
    }

    /// True once the publish slot is filled (the event was accepted by the broker): the
    /// [`Phase::Settled`] states.
    pub fn is_published(self) -> bool {
        self.phase() == Phase::Settled
    }

    /// The group of states a store indexes this state under ([`Phase`]).
    pub fn phase(self) -> Phase {
        match self {
            State::Pending | State::Claimed | State::Sending | State::RetryClaimed => {
                Phase::Dispatchable
            }
            State::DispatchUnknown | State::Reconciling => Phase::Unknown,
            State::Published | State::Retained | State::Purged => Phase::Settled,
            State::Quarantined => Phase::Parked,
        }
    }

    /// True while the broker outcome of some attempt is not known.
    pub fn is_unknown(self) -> bool {
        matches!(self, State::DispatchUnknown | State::Reconciling)
    }
}

impl std::fmt::Display for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The groups of states the store's indexes are partial on (the work row's `phase` column):
/// one definition, used by the claim and reconcile steps, the store's writes and the SQL
/// predicates it generates ([`Phase::code`]), and the simulator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Phase {
    /// `PENDING`, `CLAIMED`, `SENDING`, `RETRY_CLAIMED`: the dispatch claim scans these.
    Dispatchable,
    /// `DISPATCH_UNKNOWN`, `RECONCILING`: the reconciler's scan.
    Unknown,
    /// `PUBLISHED`, `RETAINED`, `PURGED`: the publish slot is filled; never unresolved again.
    Settled,
    /// `QUARANTINED`: waits for an operator; still unresolved (it holds back later versions
    /// of an ordered aggregate, R29).
    Parked,
}

impl Phase {
    /// Every phase.
    pub const ALL: [Phase; 4] = [
        Phase::Dispatchable,
        Phase::Unknown,
        Phase::Settled,
        Phase::Parked,
    ];

    /// The value stored in the work row's `phase` column (migrations 3 and 5).
    pub const fn code(self) -> i16 {
        match self {
            Phase::Dispatchable => 0,
            Phase::Unknown => 1,
            Phase::Settled => 2,
            Phase::Parked => 3,
        }
    }

    /// True while the event's outcome is not settled: it holds back later versions of its
    /// aggregate at an ordered destination (R29).
    pub fn is_unresolved(self) -> bool {
        self != Phase::Settled
    }
}

/// Why a transition was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("transition {from} -> {to} is not in the state table (R5-R6); this is a bug in the caller")]
pub struct TransitionError {
    /// State the row was in.
    pub from: State,
    /// State that was requested.
    pub to: State,
}

/// The whole state table. Self-loops that appear here are re-claims (a new claim
/// generation over an expired lease), not no-ops.
pub const TRANSITIONS: &[(State, State)] = &[
    // main path (R5)
    (State::Pending, State::Claimed),
    (State::Claimed, State::Sending),
    (State::Sending, State::Published),
    (State::Published, State::Retained),
    (State::Retained, State::Purged),
    (State::Published, State::Purged),
    // a claim that expired before any attempt was registered may be re-claimed or released
    (State::Claimed, State::Claimed),
    (State::Claimed, State::Pending),
    // unknown path (R6)
    (State::Sending, State::DispatchUnknown),
    (State::DispatchUnknown, State::Reconciling),
    (State::DispatchUnknown, State::Published),
    (State::Reconciling, State::Published),
    (State::Reconciling, State::RetryClaimed),
    (State::Reconciling, State::DispatchUnknown),
    // a reconciler whose lease ran out is superseded by another
    (State::Reconciling, State::Reconciling),
    (State::RetryClaimed, State::RetryClaimed),
    (State::RetryClaimed, State::Sending),
    (State::RetryClaimed, State::Published),
    // definite "not stored": the request never left, or the broker said no
    (State::Sending, State::Pending),
    // poison past the retry limit, a conflicting copy at a create-if-absent broker, and the
    // operator's exit path
    (State::Sending, State::Quarantined),
    (State::Reconciling, State::Quarantined),
    (State::Quarantined, State::Pending),
    // a quarantined row whose older attempt's late ACK arrives is published (R11)
    (State::Quarantined, State::Published),
    // an explicit migration (R15) re-enters the main path under a new envelope generation
    (State::Pending, State::Pending),
];

/// Checks one transition against [`TRANSITIONS`].
pub fn transition(from: State, to: State) -> Result<State, TransitionError> {
    if TRANSITIONS.contains(&(from, to)) {
        Ok(to)
    } else {
        Err(TransitionError { from, to })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn main_path_is_allowed() {
        let path = [
            State::Pending,
            State::Claimed,
            State::Sending,
            State::Published,
            State::Retained,
            State::Purged,
        ];
        for w in path.windows(2) {
            assert_eq!(transition(w[0], w[1]), Ok(w[1]));
        }
    }

    #[test]
    fn unknown_never_goes_back_to_pending() {
        assert!(transition(State::DispatchUnknown, State::Pending).is_err());
        assert!(transition(State::Reconciling, State::Pending).is_err());
        assert!(transition(State::Sending, State::Claimed).is_err());
    }

    #[test]
    fn nothing_leaves_purged_and_published_is_final_for_sending() {
        for to in State::ALL {
            assert!(transition(State::Purged, to).is_err(), "PURGED -> {to}");
            if !matches!(to, State::Retained | State::Purged) {
                assert!(
                    transition(State::Published, to).is_err(),
                    "PUBLISHED -> {to}"
                );
            }
        }
    }

    #[test]
    fn names_round_trip() {
        for s in State::ALL {
            assert_eq!(State::parse(s.as_str()), Some(s));
        }
        assert_eq!(State::parse("SENT"), None);
    }

    #[test]
    fn table_has_no_duplicates() {
        for (i, a) in TRANSITIONS.iter().enumerate() {
            assert!(!TRANSITIONS[i + 1..].contains(a), "{a:?} listed twice");
        }
    }
}
