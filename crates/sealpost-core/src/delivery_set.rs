//! Delivery to several destinations (R16) is an explicit contract: the set of members (one
//! envelope row each, same event id, each with its own frozen destination, state, publish
//! slot and receipts), a state per member and a completion rule. It is never a retry in
//! disguise: a member is a different destination, never a second copy for the same one.
//!
//! Everything that says whether a set is complete — `status`, `trace`, the page, the
//! reconciler's "stuck incomplete" finding and the simulator — asks [`set_status`].

use crate::envelope::Destination;
use crate::state::State;

/// Members a delivery set has at most (one per destination).
pub const MEMBERS_MAX: usize = 16;

/// When a delivery set is complete.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CompletionRule {
    /// Every member published.
    All,
    /// At least one member published.
    Any,
}

impl CompletionRule {
    /// The stored and CLI name (`all`, `any`).
    pub fn name(self) -> &'static str {
        match self {
            CompletionRule::All => "all",
            CompletionRule::Any => "any",
        }
    }

    /// Parses [`CompletionRule::name`].
    pub fn parse(s: &str) -> Option<CompletionRule> {
        match s {
            "all" => Some(CompletionRule::All),
            "any" => Some(CompletionRule::Any),
            _ => None,
        }
    }

    /// Members that must be published for a set of `members` to be complete.
    pub fn needed(self, members: u16) -> u16 {
        match self {
            CompletionRule::All => members,
            CompletionRule::Any => members.min(1),
        }
    }
}

/// Status of a delivery set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetStatus {
    /// The completion rule holds: enough members' publish slots are filled.
    Complete,
    /// Not yet; `published` of `members` so far.
    InProgress {
        /// Members published.
        published: u16,
        /// Members in the set.
        members: u16,
    },
    /// Cannot complete without an operator: too many members are quarantined for the rule.
    Blocked,
}

impl SetStatus {
    /// The name `status`, `trace` and the page show (`complete`, `in_progress`, `blocked`).
    pub fn name(self) -> &'static str {
        match self {
            SetStatus::Complete => "complete",
            SetStatus::InProgress { .. } => "in_progress",
            SetStatus::Blocked => "blocked",
        }
    }
}

/// Evaluates the completion rule over the members' states. A member counts once its publish
/// slot is filled ([`State::is_published`]: published, retained or purged); a member on its
/// way (claimed, sending, unknown, reconciling) does not, whatever the broker may hold.
pub fn set_status(members: &[State], rule: CompletionRule) -> SetStatus {
    let n = members.len() as u16;
    let published = members.iter().filter(|s| s.is_published()).count() as u16;
    let quarantined = members.iter().filter(|s| **s == State::Quarantined).count() as u16;
    let needed = rule.needed(n);
    if published >= needed {
        SetStatus::Complete
    } else if n - quarantined < needed {
        SetStatus::Blocked
    } else {
        SetStatus::InProgress {
            published,
            members: n,
        }
    }
}

/// Whether a set is *stuck incomplete* (the reconciler reports it): blocked at once (only an
/// operator can finish it), or still in progress `stuck_after_ms` after it committed.
pub fn set_stuck(status: SetStatus, age_ms: u64, stuck_after_ms: u64) -> bool {
    match status {
        SetStatus::Complete => false,
        SetStatus::Blocked => true,
        SetStatus::InProgress { .. } => age_ms >= stuck_after_ms,
    }
}

/// Why a set cannot be enqueued.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SetError {
    /// Fewer than two members: an ordinary `enqueue` is the one-destination case.
    #[error("a delivery set needs at least two routes, got {0}; use enqueue for one destination")]
    TooFew(usize),
    /// More members than [`MEMBERS_MAX`].
    #[error("a delivery set has at most {MEMBERS_MAX} routes, got {0}")]
    TooMany(usize),
    /// Two members resolve to the same cluster and topic: a second copy for one destination
    /// is a retry in disguise, and a consumer of that topic would apply one of them only.
    #[error(
        "routes `{first}` and `{second}` both deliver to topic `{topic}` on cluster `{cluster}`; \
         a delivery set names each destination once"
    )]
    SameDestination {
        /// The first route naming it.
        first: String,
        /// The second.
        second: String,
        /// The cluster.
        cluster: String,
        /// The topic.
        topic: String,
    },
}

/// Checks a set's members before anything is written: 2..=[`MEMBERS_MAX`] routes, each
/// resolving to its own (cluster, topic). `members` pairs each route name with the
/// destination it resolved to; member `k` of the set is `members[k]`.
pub fn check_members(members: &[(&str, &Destination)]) -> Result<(), SetError> {
    if members.len() < 2 {
        return Err(SetError::TooFew(members.len()));
    }
    if members.len() > MEMBERS_MAX {
        return Err(SetError::TooMany(members.len()));
    }
    for (i, (first, a)) in members.iter().enumerate() {
        if let Some((second, _)) = members[..i]
            .iter()
            .find(|(_, b)| b.cluster == a.cluster && b.topic == a.topic)
        {
            return Err(SetError::SameDestination {
                first: second.to_string(),
                second: first.to_string(),
                cluster: a.cluster.clone(),
                topic: a.topic.clone(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::{EventOrdering, PartitionAlgorithm, RoutePolicy};

    #[test]
    fn rules() {
        use State::*;
        assert_eq!(
            set_status(&[Published, Retained], CompletionRule::All),
            SetStatus::Complete
        );
        assert_eq!(
            set_status(&[Published, DispatchUnknown], CompletionRule::All),
            SetStatus::InProgress {
                published: 1,
                members: 2
            }
        );
        assert_eq!(
            set_status(&[Sending, Reconciling, Claimed], CompletionRule::Any),
            SetStatus::InProgress {
                published: 0,
                members: 3
            }
        );
        assert_eq!(
            set_status(&[Published, Pending], CompletionRule::Any),
            SetStatus::Complete
        );
        assert_eq!(
            set_status(&[Quarantined, Pending], CompletionRule::All),
            SetStatus::Blocked
        );
        assert_eq!(
            set_status(&[Quarantined, Pending], CompletionRule::Any),
            SetStatus::InProgress {
                published: 0,
                members: 2
            }
        );
        assert_eq!(
            set_status(&[Quarantined, Quarantined], CompletionRule::Any),
            SetStatus::Blocked
        );
        assert_eq!(
            set_status(&[Quarantined, Purged], CompletionRule::Any),
            SetStatus::Complete
        );
    }

    #[test]
    fn every_state_combination_of_two_members() {
        // Complete exactly when the rule's count of settled members holds; blocked exactly
        // when the quarantined members leave too few.
        for a in State::ALL {
            for b in State::ALL {
                let states = [a, b];
                let settled = states.iter().filter(|s| s.is_published()).count();
                let parked = states.iter().filter(|s| **s == State::Quarantined).count();
                for rule in [CompletionRule::All, CompletionRule::Any] {
                    let needed = if rule == CompletionRule::All { 2 } else { 1 };
                    let got = set_status(&states, rule);
                    let want = if settled >= needed {
                        SetStatus::Complete
                    } else if 2 - parked < needed {
                        SetStatus::Blocked
                    } else {
                        SetStatus::InProgress {
                            published: settled as u16,
                            members: 2,
                        }
                    };
                    assert_eq!(got, want, "{states:?} under {rule:?}");
                }
            }
        }
    }

    #[test]
    fn stuck() {
        let progress = SetStatus::InProgress {
            published: 1,
            members: 2,
        };
        assert!(!set_stuck(SetStatus::Complete, u64::MAX, 0));
        assert!(set_stuck(SetStatus::Blocked, 0, 60_000));
        assert!(!set_stuck(progress, 59_999, 60_000));
        assert!(set_stuck(progress, 60_000, 60_000));
    }

    #[test]
    fn names_round_trip() {
        for r in [CompletionRule::All, CompletionRule::Any] {
            assert_eq!(CompletionRule::parse(r.name()), Some(r));
        }
        assert_eq!(CompletionRule::parse("most"), None);
    }

    fn dest(cluster: &str, topic: &str, key: &str) -> Destination {
        RoutePolicy {
            generation: 1,
            cluster: cluster.into(),
            topic: topic.into(),
            partition_algorithm: PartitionAlgorithm::None,
            serializer: "json.v1".into(),
            durability: "file".into(),
            required_ack: "stream".into(),
            ordering: EventOrdering::Unordered,
        }
        .resolve(key)
    }

    #[test]
    fn members_are_distinct_destinations() {
        let (a, b) = (dest("n", "orders", "k"), dest("n", "billing", "k"));
        let same_topic_other_key = dest("n", "orders", "other");
        let other_cluster = dest("k", "orders", "k");
        assert_eq!(check_members(&[("a", &a)]), Err(SetError::TooFew(1)));
        assert!(check_members(&[("a", &a), ("b", &b)]).is_ok());
        assert!(check_members(&[("a", &a), ("c", &other_cluster)]).is_ok());
        let err = check_members(&[("a", &a), ("b", &b), ("a2", &same_topic_other_key)]);
        assert_eq!(
            err,
            Err(SetError::SameDestination {
                first: "a".into(),
                second: "a2".into(),
                cluster: "n".into(),
                topic: "orders".into()
            })
        );
        let many: Vec<Destination> = (0..17).map(|i| dest("n", &format!("t{i}"), "k")).collect();
        let named: Vec<(&str, &Destination)> = many.iter().map(|d| ("r", d)).collect();
        assert_eq!(check_members(&named), Err(SetError::TooMany(17)));
    }
}
