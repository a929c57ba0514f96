//! Delivery to several destinations (R16) is an explicit contract: the set of members (one
//! envelope row each, same event id, each with its own frozen destination), a state per
//! member and a completion rule. It is never a retry in disguise.

use crate::state::State;

/// When a delivery set is complete.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompletionRule {
    /// Every member published.
    All,
    /// At least `n` members published.
    AtLeast(u16),
}

/// Status of a delivery set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetStatus {
    /// The completion rule holds.
    Complete,
    /// Not yet; `published` of `members` so far.
    InProgress {
        /// Members published.
        published: u16,
        /// Members in the set.
        members: u16,
    },
    /// Cannot complete without an operator (a member is quarantined and the rule needs it).
    Blocked,
}

/// Evaluates the completion rule over the members' states.
pub fn set_status(members: &[State], rule: CompletionRule) -> SetStatus {
    let n = members.len() as u16;
    let published = members.iter().filter(|s| s.is_published()).count() as u16;
    let quarantined = members.iter().filter(|s| **s == State::Quarantined).count() as u16;
    let needed = match rule {
        CompletionRule::All => n,
        CompletionRule::AtLeast(k) => k.min(n),
    };
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

#[cfg(test)]
mod tests {
    use super::*;

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
            set_status(&[Published, Pending], CompletionRule::AtLeast(1)),
            SetStatus::Complete
        );
        assert_eq!(
            set_status(&[Quarantined, Pending], CompletionRule::All),
            SetStatus::Blocked
        );
    }
}
