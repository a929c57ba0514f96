//! The fault catalog through the real store: seeded random sequences of claims, genuine,
//! duplicate, stale, forged and corrupted receipts, outcome reports from current and stale
//! claims, and reconciler lookups are applied both to PostgreSQL (through `sealpost::store`)
//! and to an in-memory copy of the rows (through `sealpost-core`'s `apply_*`). After every
//! step each row must be identical in both: the SQL persists exactly what the core decided.
//!
//! The model runs the same core steps as the store: the claim is `step::picks` over the rows in
//! commit order up to the batch, then `step::step_claim`; half the claims and receipts go
//! through the dispatcher's guarded fast path (`claim` with a `Held` / `submit_held`), which the
//! model runs as `step::step_guarded` on the row as its claim left it, guarded by "the row is
//! still exactly that" — and the store must have taken the guarded write for exactly those
//! receipts.

mod common;

use sealpost::runtime;
use sealpost::store::{self, Accepted, OutcomeReport};
use std::collections::HashMap;

use sealpost_core::claim::{ClaimToken, SendOutcome};
use sealpost_core::dispatcher::Submission;
use sealpost_core::envelope::NewEvent;
use sealpost_core::receipt::{decide_receipt, Receipt, ReceiptSource, ReceiptVerdict};
use sealpost_core::reconcile::{Lookup, ReconcilePolicy};
use sealpost_core::rollout::{AliasCheck, ClaimFacts, Implementation};
use sealpost_core::row::EventRow;
use sealpost_core::step::{self, ClaimInput, CoreRules, Pick, Served};
use sealpost_core::{Digest, EventId};

const LEASE_MS: u64 = 3_600_000;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// What must agree between the store and the model (times of the database clock excluded).
fn essence(r: &EventRow) -> String {
    let claim = r.claim.as_ref().map(|c| (c.owner, c.generation));
    let attempts: Vec<_> = r
        .attempts
        .iter()
        .map(|a| {
            (
                a.id,
                a.attempt_generation,
                a.claim_generation,
                a.owner,
                a.status,
            )
        })
        .collect();
    let primary = r
        .primary
        .as_ref()
        .map(|p| (p.attempt_id, p.stream.clone(), p.sequence));
    format!(
        "{} {:?} cg={} ag={} rej={} {:?} {:?} unknown={}",
        r.state,
        claim,
        r.claim_generation,
        r.attempt_generation,
        r.rejections,
        attempts,
        primary,
        r.unknown_since_ms.is_some()
    )
}

/// The locked acceptance step on one model row; its verdict.
fn accept(row: &mut EventRow, r: &Receipt, now: u64) -> ReceiptVerdict {
    match step::step_accept(
        std::slice::from_mut(row),
        std::slice::from_ref(r),
        now,
        &mut CoreRules,
    )
    .unwrap()[0]
    {
        step::Acceptance::Judged { verdict, .. } => verdict,
        step::Acceptance::UnknownEvent => unreachable!("the model row is the receipt's"),
    }
}

fn receipt_for(row: &EventRow, attempt: u64, sequence: u64) -> Receipt {
    Receipt {
        event_id: row.event_id,
        member: row.member,
        envelope_generation: row.envelope_generation,
        attempt_id: attempt,
        payload_digest: row.payload_digest,
        destination_digest: row.destination_digest,
        cluster: row.destination.cluster.clone(),
        stream: row.destination.topic.clone(),
        partition: None,
        sequence,
        broker_duplicate: false,
        source: ReceiptSource::Ack,
    }
}

/// One fresh `order.created.v1` event per key, routed by the key.
fn order_batch<'a>(keys: &'a [String], payload: &'a [u8]) -> Vec<(EventId, NewEvent<'a>, String)> {
    keys.iter()
        .map(|k| {
            let event = NewEvent {
                aggregate_type: "order",
                aggregate_id: k,
                aggregate_version: 1,
                event_type: "order.created.v1",
                payload_schema: "order.created.v1",
                payload,
                tenant: "tenant-1",
                occurred_at_ms: 0,
                creating_txid: 0,
            };
            (EventId(*uuid::Uuid::now_v7().as_bytes()), event, k.clone())
        })
        .collect()
}

#[tokio::test]
async fn random_fault_sequences_persist_exactly_what_the_core_decides() {
    let cfg = common::fresh_database("sealpost_differential").await;
    let mut pg = runtime::pg_connect(&cfg.database_url).await.unwrap();
    store::migrate(&pg).await.unwrap();
    let mut steps = 0;
    let mut guarded_total = 0;
    for seed in 1..=12u64 {
        pg.batch_execute("TRUNCATE sealpost.envelope, sealpost.work, sealpost.attempt, sealpost.receipt, sealpost.quarantine, sealpost.audit, sealpost.lease")
            .await
            .unwrap();
        let topic = format!("D{seed}");
        store::set_route(&pg, "diff", common::NATS_CLUSTER, &topic)
            .await
            .unwrap();
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ seed);
        let keys: Vec<String> = (0..6).map(|i| format!("o-{seed}-{i}")).collect();
        let events = order_batch(&keys, b"{}");
        let tx = pg.transaction().await.unwrap();
        let envs = store::enqueue_many(&tx, "diff", &events).await.unwrap();
        tx.commit().await.unwrap();
        let mut model: Vec<EventRow> = envs.iter().map(|e| EventRow::pending(e, 0)).collect();
        let keyset: Vec<(EventId, u16)> = model.iter().map(|r| (r.event_id, 0)).collect();
        let mut tokens: Vec<(usize, ClaimToken, u64, u64)> = Vec::new(); // (row, token, attempt, owner)
                                                                         // Per owner: the store's held rows, and the model's rows as that owner's claim left them.
        let mut held: HashMap<u64, store::Held> = HashMap::new();
        let mut held_model: HashMap<EventId, (u64, EventRow)> = HashMap::new();
        for _ in 0..60 {
            steps += 1;
            let now = store::db_now_ms(&pg).await.unwrap();
            match rng.below(6) {
                // Claim a batch (registers attempts), plainly or keeping what it claimed.
                0 | 1 => {
                    let owner = 1 + rng.below(3);
                    let max = 1 + rng.below(3) as usize;
                    let keep = rng.below(2) == 0;
                    let b = if keep {
                        let h = held.entry(owner).or_default();
                        store::claim(
                            &mut pg,
                            &store::ClaimRequest::new(owner, max, LEASE_MS),
                            Some(h),
                        )
                        .await
                        .unwrap()
                    } else {
                        store::claim_batch(&mut pg, owner, max, LEASE_MS)
                            .await
                            .unwrap()
                    };
                    // The core's pick over the model, in commit order, up to the batch, at
                    // the claim's own clock (a backoff may end between a reading before the
                    // claim and the claim).
                    let now = b.db_now_ms;
                    let idx: Vec<usize> = (0..model.len())
                        .filter(|&i| step::picks(&model[i], Served::Every, now))
                        .take(max)
                        .collect();
                    let attempt_of = |i: usize| {
                        b.outgoing
                            .iter()
                            .find(|o| o.event_id == model[i].event_id)
                            .map_or(0, |o| o.attempt_id)
                    };
                    let picked: Vec<Pick<'_>> = idx
                        .iter()
                        .map(|&i| Pick {
                            position: i as u64,
                            earlier_unresolved: false,
                            attempt_id: attempt_of(i),
                            facts: ClaimFacts::PLAIN,
                        })
                        .collect();
                    let mut rows: Vec<EventRow> = idx.iter().map(|&i| model[i].clone()).collect();
                    let input = ClaimInput {
                        owner,
                        served: Served::Every,
                        now_ms: now,
                        lease_ms: LEASE_MS,
                        batch_max: max,
                        alias: AliasCheck {
                            implementation: Implementation::this_build(),
                            aliases: &[],
                        },
                    };
                    let st = step::step_claim(&mut rows, &picked, &input, &mut CoreRules).unwrap();
                    let sent: Vec<_> = st
                        .sends()
                        .map(|(k, a)| (rows[k].event_id, a.attempt_id))
                        .collect();
                    let stored: Vec<_> = b
                        .outgoing
                        .iter()
                        .map(|o| (o.event_id, o.attempt_id))
                        .collect();
                    assert_eq!(
                        stored, sent,
                        "seed {seed}: the store's claim and the core's step differ"
                    );
                    assert_eq!(b.expired_to_unknown, st.expired_to_unknown);
                    for (k, a) in st.sends() {
                        tokens.push((idx[k], a.token, a.attempt_id, owner));
                    }
                    for (k, &i) in idx.iter().enumerate() {
                        model[i] = rows[k].clone();
                        if keep && sent.iter().any(|(e, _)| *e == model[i].event_id) {
                            held_model.insert(model[i].event_id, (owner, model[i].clone()));
                        }
                    }
                }
                // A receipt: genuine, duplicate at the same or another position, seq 0,
                // forged attempt, or corrupted digest (F2, F4, F8); through the guarded path
                // of the claim's owner or the locked acceptance.
                2 | 3 => {
                    let Some(&(i, token, attempt, _)) =
                        tokens.get(rng.below(tokens.len() as u64 + 1) as usize)
                    else {
                        continue;
                    };
                    let mut r = receipt_for(&model[i], attempt, 1 + i as u64);
                    match rng.below(6) {
                        0 => r.sequence = 100 + rng.below(5),
                        1 => r.sequence = 0,
                        2 => r.attempt_id = 999_999,
                        3 => r.payload_digest = Digest([9; 32]),
                        _ => {}
                    }
                    if rng.below(2) == 0 {
                        let owner = token.owner;
                        let h = held.entry(owner).or_default();
                        let sub = Submission {
                            receipts: vec![r.clone()],
                            reports: Vec::new(),
                        };
                        let got = store::submit_held(&mut pg, &sub, 3, h).await.unwrap();
                        // The model: the guarded step on the row as the owner's claim left
                        // it, if the row is still exactly that; else the locked decision.
                        let key = model[i].event_id;
                        let snapshot = held_model
                            .get(&key)
                            .filter(|(o, row)| *o == owner && *row == model[i])
                            .map(|(_, row)| row.clone());
                        let guarded = match snapshot {
                            Some(row) => {
                                step::step_guarded(&row, &r, 1, now, decide_receipt).unwrap()
                            }
                            None => None,
                        };
                        let v = decide_receipt(&model[i], &r);
                        let took_guarded = guarded.is_some();
                        match guarded {
                            Some(after) => model[i] = after,
                            None => {
                                accept(&mut model[i], &r, now);
                            }
                        }
                        if held_model.get(&key).is_some_and(|(o, _)| *o == owner) {
                            held_model.remove(&key);
                        }
                        assert_eq!(got.accepted, vec![Accepted::Verdict(v)]);
                        assert_eq!(
                            got.guarded,
                            usize::from(took_guarded),
                            "seed {seed}: the store's guarded write and the core's guarded step differ"
                        );
                        guarded_total += got.guarded;
                    } else {
                        let got = store::accept_receipts(&mut pg, std::slice::from_ref(&r))
                            .await
                            .unwrap();
                        let v = accept(&mut model[i], &r, now);
                        assert_eq!(got, vec![Accepted::Verdict(v)]);
                    }
                }
                // An outcome report from the current or a stale claim (F3, F7 retries).
                4 => {
                    let Some(&(i, token, attempt, _)) =
                        tokens.get(rng.below(tokens.len() as u64 + 1) as usize)
                    else {
                        continue;
                    };
                    let outcome = [
                        SendOutcome::AckTimeout,
                        SendOutcome::NeverSent,
                        SendOutcome::Rejected,
                    ][rng.below(3) as usize];
                    let rep = OutcomeReport {
                        event_id: model[i].event_id,
                        member: 0,
                        token,
                        attempt_id: attempt,
                        outcome,
                        detail: String::new(),
                    };
                    let got = store::report_outcomes(&mut pg, std::slice::from_ref(&rep), 3)
                        .await
                        .unwrap();
                    let d = step::step_report(
                        std::slice::from_mut(&mut model[i]),
                        &[rep],
                        3,
                        now,
                        &mut CoreRules,
                    )
                    .unwrap()[0]
                        .decision;
                    assert_eq!(got, vec![d]);
                }
                // The reconciler: claim unknowns, then a lookup result (F5-style unavailable,
                // proven absent, found, or unqueryable).
                _ => {
                    let items = store::claim_unknown(&mut pg, 9, 10, LEASE_MS)
                        .await
                        .unwrap();
                    // Six rows: the store's due scan and its expiry front reach them all.
                    let mut expected = Vec::new();
                    let mut picked: Vec<&mut EventRow> = model
                        .iter_mut()
                        .filter(|r| step::picks_for_reconcile(r, now))
                        .collect();
                    let outcomes = step::step_claim_unknown(&mut picked, 9, now, LEASE_MS).unwrap();
                    for (row, o) in picked.iter().zip(outcomes) {
                        if let step::UnknownPick::Claimed { token, .. } = o {
                            expected.push((row.event_id, token));
                        }
                    }
                    let mut got: Vec<_> = items.iter().map(|it| (it.event_id, it.token)).collect();
                    got.sort_by_key(|x| x.0);
                    expected.sort_by_key(|x| x.0);
                    assert_eq!(got, expected, "seed {seed}: the reconciler's claim differs");
                    for it in &items {
                        let i = model
                            .iter()
                            .position(|r| r.event_id == it.event_id)
                            .unwrap();
                        let lookup = match rng.below(4) {
                            0 => Lookup::Absent,
                            1 => Lookup::Unavailable,
                            2 => Lookup::Unqueryable,
                            _ => match model[i].attempts.last() {
                                Some(a) => Lookup::Found(Receipt {
                                    source: ReceiptSource::Lookup,
                                    ..receipt_for(&model[i], a.id, 1 + i as u64)
                                }),
                                None => Lookup::Absent,
                            },
                        };
                        let got = store::finish_reconcile(&mut pg, it, &lookup).await.unwrap();
                        let d = step::step_finish_reconcile(
                            &mut model[i],
                            it.token,
                            &lookup,
                            ReconcilePolicy::default(),
                            now,
                            &mut CoreRules,
                        )
                        .unwrap()
                        .decision;
                        assert_eq!(got, d);
                    }
                }
            }
            let stored = store::snapshot(&mut pg, &keyset).await.unwrap();
            for (s, m) in stored.iter().zip(&model) {
                assert_eq!(
                    essence(s),
                    essence(m),
                    "seed {seed}: store and core diverged for {}",
                    m.event_id
                );
            }
        }
        let published = model.iter().filter(|r| r.state.is_published()).count();
        let unknown = model.iter().filter(|r| r.state.is_unknown()).count();
        println!("seed {seed}: {published} published, {unknown} unknown after 60 steps");
    }
    assert_eq!(steps, 12 * 60);
    println!("{guarded_total} receipts accepted by the guarded write");
    assert!(guarded_total > 0, "the guarded path was never taken");
}
