//! The batch lease: how a claim authorises the first send of a row without writing the row.
//!
//! A dispatcher's claim grants most rows their first claim: `PENDING`, never claimed, never
//! sent. For such a row the claim step's result is fully determined by four values shared by
//! the batch or drawn per row (owner, lease end, registration time, attempt id): the row
//! becomes `SENDING` under claim generation 1 with attempt generation 1 and one registered
//! attempt. The store records those values in **one lease row per batch** instead of
//! writing each work row, and every reader sees the row through [`leased_view`]: the work
//! row as committed plus the lease that lists it. The first write of the row after enqueue
//! is then the acceptance (or the outcome report, or the expiry), and that write stores the
//! whole row, so from then on the work row stands alone.
//!
//! The rules that keep this exact, each one function here, used by the store and by the
//! simulator's store model alike:
//! - a lease may only stand for a row that is [`never_claimed`], and only for a claim
//!   step's result that [`lease_entry_of`] reproduces exactly from the entry;
//! - a row read with a lease entry is [`leased_view`] of the stored row, and only if the
//!   stored row is still [`never_claimed`] (a row written since stands alone);
//! - a write of a row that may be a lease's view writes every column the view sets
//!   ([`as_leased`]), so the stored row never keeps a `never_claimed` remainder;
//! - a lease may be dropped only when no row it lists is still [`never_claimed`]
//!   ([`may_drop`]): dropping it earlier would turn a row that was sent back into one that
//!   reads as never sent.

use crate::row::{Attempt, AttemptStatus, Claim, EventRow};
use crate::state::State;

/// The claim generation and the attempt generation a lease grants: a row's first.
pub const LEASED_GENERATION: u32 = 1;

/// The lowest row protocol ([`crate::rollout::PROTOCOL_VERSION`]) a lease may stand for.
/// A dispatcher that predates leases claims rows of protocol 1 and would read a leased row
/// as never claimed; it never claims a row of a protocol it does not speak, so rows of
/// protocol 2 and later may be leased, and rows of protocol 1 keep their claims in the row.
pub const LEASED_FROM_PROTOCOL: u16 = 2;

/// What a lease records of one row it authorised: the batch's owner, lease end and
/// registration time, and the row's drawn attempt id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LeasedSend {
    /// The claiming process.
    pub owner: u64,
    /// Lease end (database clock).
    pub lease_until_ms: u64,
    /// The attempt registered for the row.
    pub attempt_id: u64,
    /// Registration time of the attempt (database clock): the claim's.
    pub started_at_ms: u64,
}

/// A row no claim has written: `PENDING`, no claim held or ever granted, no attempt
/// registered, no receipt. The only rows a lease may stand for.
pub fn never_claimed(row: &EventRow) -> bool {
    row.state == State::Pending
        && row.claim.is_none()
        && row.claim_generation == 0
        && row.attempt_generation == 0
        && row.attempts.is_empty()
        && row.primary.is_none()
}

/// The row as a lease that lists it makes it: `SENDING` under claim generation 1, with its
/// first attempt registered under `send`'s id. `None` if the stored row is not
/// [`never_claimed`]: a row written since the lease stands alone.
pub fn leased_view(row: &EventRow, send: &LeasedSend) -> Option<EventRow> {
    if !never_claimed(row) {
        return None;
    }
    let generation = u64::from(LEASED_GENERATION);
    let mut r = row.clone();
    r.state = State::Sending;
    r.claim_generation = generation;
    r.attempt_generation = LEASED_GENERATION;
    r.claim = Some(Claim {
        owner: send.owner,
        generation,
        lease_until_ms: send.lease_until_ms,
    });
    r.attempts.push(Attempt {
        id: send.attempt_id,
        attempt_generation: LEASED_GENERATION,
        claim_generation: generation,
        owner: send.owner,
        envelope_generation: row.envelope_generation,
        destination_digest: row.destination_digest,
        status: AttemptStatus::Sending,
        started_at_ms: send.started_at_ms,
    });
    Some(r)
}

/// The entry a lease would record for a row written under `protocol` that the claim step
/// took from `before` to `after`: `Some` only if the protocol allows leases
/// ([`LEASED_FROM_PROTOCOL`]), `before` is [`never_claimed`] and [`leased_view`] of it with
/// that entry is exactly `after`. Anything else (a retry, an expiry, a row with history, a
/// row an older dispatcher may claim) is written as a row of its own.
pub fn lease_entry_of(before: &EventRow, after: &EventRow, protocol: u16) -> Option<LeasedSend> {
    if protocol < LEASED_FROM_PROTOCOL {
        return None;
    }
    let send = entry_in(after)?;
    (leased_view(before, &send).as_ref() == Some(after)).then_some(send)
}

/// `Some(entry)` if `row` is what a lease with that entry makes of some never-claimed row:
/// a write of such a row must store every column the view sets, not only the ones that
/// differ from it (the stored row may still be the never-claimed one).
pub fn as_leased(row: &EventRow) -> Option<LeasedSend> {
    let send = entry_in(row)?;
    let mut stored = row.clone();
    stored.state = State::Pending;
    stored.claim = None;
    stored.claim_generation = 0;
    stored.attempt_generation = 0;
    stored.attempts.clear();
    (leased_view(&stored, &send).as_ref() == Some(row)).then_some(send)
}

fn entry_in(row: &EventRow) -> Option<LeasedSend> {
    let claim = row.claim.as_ref()?;
    let [attempt] = row.attempts.as_slice() else {
        return None;
    };
    Some(LeasedSend {
        owner: claim.owner,
        lease_until_ms: claim.lease_until_ms,
        attempt_id: attempt.id,
        started_at_ms: attempt.started_at_ms,
    })
}

/// May a lease be dropped, given how many of the rows it lists are still
/// [`never_claimed`]? Only when none is: each of those reads as sent only through the lease.
pub fn may_drop(still_never_claimed: usize) -> bool {
    still_never_claimed == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::claim::{apply_begin_send, apply_claim, decide_begin_send, decide_dispatch_claim};
    use crate::encoding::Digest;
    use crate::envelope::{EventId, EventOrdering, PartitionAlgorithm, RoutePolicy};

    fn row() -> EventRow {
        EventRow::new_pending(
            EventId([7; 16]),
            0,
            Digest([1; 32]),
            RoutePolicy {
                generation: 1,
                cluster: "c".into(),
                topic: "t".into(),
                partition_algorithm: PartitionAlgorithm::None,
                serializer: "json.v1".into(),
                durability: "file".into(),
                required_ack: "stream".into(),
                ordering: EventOrdering::Unordered,
            }
            .resolve("k"),
        )
    }

    /// The claim's own decisions on a never-claimed row, as `step_claim` applies them.
    fn claimed(before: &EventRow, owner: u64, now: u64, attempt_id: u64) -> EventRow {
        let mut r = before.clone();
        let d = decide_dispatch_claim(&r, now, 30_000);
        let token = apply_claim(&mut r, &d, owner, now).unwrap().unwrap();
        let begin = decide_begin_send(&r, token, now).unwrap();
        apply_begin_send(&mut r, &begin, token, attempt_id, now).unwrap();
        r
    }

    #[test]
    fn a_first_claim_is_exactly_what_its_lease_entry_makes_of_the_row() {
        let before = row();
        let after = claimed(&before, 9, 1_000, 44);
        assert_eq!(
            lease_entry_of(&before, &after, 1),
            None,
            "protocol 1 rows stay in the row"
        );
        let send = lease_entry_of(&before, &after, LEASED_FROM_PROTOCOL)
            .expect("a first claim can be leased");
        assert_eq!(
            send,
            LeasedSend {
                owner: 9,
                lease_until_ms: 31_000,
                attempt_id: 44,
                started_at_ms: 1_000
            }
        );
        assert_eq!(leased_view(&before, &send), Some(after.clone()));
        assert_eq!(as_leased(&after), Some(send));
    }

    #[test]
    fn a_row_with_history_is_never_leased_nor_read_through_a_lease() {
        let before = row();
        let first = claimed(&before, 9, 1_000, 44);
        // Sent, then "never sent": PENDING again, with an attempt and a claim generation.
        let mut again = first.clone();
        again.state = State::Pending;
        again.claim = None;
        again.attempts[0].status = AttemptStatus::Failed;
        assert!(!never_claimed(&again));
        let retry = claimed(&again, 9, 70_000, 45);
        assert_eq!(lease_entry_of(&again, &retry, LEASED_FROM_PROTOCOL), None);
        assert_eq!(as_leased(&retry), None);
        let send = as_leased(&first).unwrap();
        assert_eq!(
            leased_view(&again, &send),
            None,
            "a written row stands alone"
        );
    }

    #[test]
    fn an_acceptance_of_a_leased_row_is_not_itself_a_lease_view() {
        let before = row();
        let mut published = claimed(&before, 9, 1_000, 44);
        published.state = State::Published;
        published.claim = None;
        published.attempts[0].status = AttemptStatus::Acked;
        assert_eq!(as_leased(&published), None);
        assert!(!never_claimed(&published));
        assert!(may_drop(0) && !may_drop(1));
    }
}
