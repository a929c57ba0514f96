//! The batch lease of migration 12 against the real PostgreSQL, through the store's own
//! transactions: a claim's first sends live in one lease row and read as `SENDING`; a dead
//! dispatcher's leased rows expire to `DISPATCH_UNKNOWN` with their attempt, whether a
//! dispatcher's claim or the reconciler finds them; a receipt the acceptance point rejects
//! leaves its row leased (the lease is not dropped under it); two dispatchers claiming at
//! once never lease a row twice; and the lease goes once every row of it is written. No
//! broker: the receipts are made up as a broker would answer. Each test has its own
//! database.

use std::time::Duration;

use crate::common;

use sealpost::runtime;
use sealpost::store;
use sealpost_core::dispatcher::Submission;
use sealpost_core::envelope::EventId;
use sealpost_core::receipt::{Receipt, ReceiptSource};
use sealpost_core::row::AttemptStatus;
use sealpost_core::state::State;

async fn enqueue(pg: &mut tokio_postgres::Client, n: usize, tag: &str) -> Vec<(EventId, u16)> {
    let orders: Vec<String> = (0..n).map(|i| format!("o-{tag}-{i}")).collect();
    let tx = pg.transaction().await.unwrap();
    let envs = store::enqueue_many(
        &tx,
        "orders",
        &sealpost_cli::demo::order_batch(&orders, b"{}"),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    envs.iter().map(|e| (e.event_id, 0)).collect()
}

fn ack(o: &store::Outgoing, sequence: u64) -> Receipt {
    Receipt {
        event_id: o.event_id,
        member: o.member,
        envelope_generation: o.envelope_generation,
        attempt_id: o.attempt_id,
        payload_digest: o.payload_digest,
        destination_digest: o.destination_digest,
        cluster: o.destination.cluster.clone(),
        stream: o.destination.topic.clone(),
        partition: None,
        sequence,
        broker_duplicate: false,
        source: ReceiptSource::Ack,
    }
}

/// Submits genuine ACKs for the first two of `outgoing` and, for the third, one naming an
/// attempt nobody registered (rejected, audited), through the dispatcher's guarded path.
async fn two_acks_and_a_forged_one(
    pg: &mut tokio_postgres::Client,
    outgoing: &[store::Outgoing],
    held: &mut store::Held,
) -> store::Submitted {
    let mut receipts: Vec<Receipt> = outgoing[..2]
        .iter()
        .enumerate()
        .map(|(k, o)| ack(o, k as u64 + 1))
        .collect();
    receipts.push(Receipt {
        attempt_id: 999_999,
        ..ack(&outgoing[2], 3)
    });
    store::submit_held(
        pg,
        &Submission {
            receipts,
            reports: vec![],
        },
        5,
        held,
    )
    .await
    .unwrap()
}

async fn setup(name: &str) -> (common::TestDb, tokio_postgres::Client) {
    let tag = runtime::owner_id() % 1_000_000;
    let db = common::fresh_database(&format!("sealpost_leases_{name}_{tag}")).await;
    let pg = runtime::pg_connect(&db.database_url).await.unwrap();
    store::migrate(&pg).await.unwrap();
    store::set_route(&pg, "orders", common::NATS_CLUSTER, "LEASES")
        .await
        .unwrap();
    (db, pg)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_dispatchers_leased_rows_expire_to_unknown_with_their_attempts() {
    let (_db, mut pg) = setup("expiry").await;
    let keys = enqueue(&mut pg, 6, "expiry").await;
    let cluster = Some(common::NATS_CLUSTER);
    // Dispatcher 1 claims all six under a 300 ms lease, then dies (nothing answered).
    let mut held = store::Held::default();
    let first = store::claim(
        &mut pg,
        &store::ClaimRequest::new(1, 6, 300).cluster(cluster),
        Some(&mut held),
    )
    .await
    .unwrap();
    assert_eq!(first.outgoing.len(), 6);
    assert_eq!(
        common::count(&pg, "SELECT count(*) FROM sealpost.lease").await,
        1,
        "one lease row for the batch"
    );
    assert_eq!(
        common::count(
            &pg,
            "SELECT count(*) FROM sealpost.work WHERE state = 'PENDING'"
        )
        .await,
        6,
        "the claim wrote no work row"
    );
    let rows = store::snapshot(&mut pg, &keys).await.unwrap();
    for (r, o) in rows.iter().zip(&first.outgoing) {
        assert_eq!(r.state, State::Sending);
        assert_eq!(r.claim.as_ref().map(|c| c.owner), Some(1));
        assert_eq!(r.attempts.len(), 1);
        assert_eq!(r.attempts[0].id, o.attempt_id, "the attempt is registered");
    }
    // While the lease is live, nobody else claims them.
    let other = store::claim(
        &mut pg,
        &store::ClaimRequest::new(2, 6, 300).cluster(cluster),
        None,
    )
    .await
    .unwrap();
    assert_eq!((other.outgoing.len(), other.expired_to_unknown), (0, 0));
    tokio::time::sleep(Duration::from_millis(400)).await;
    // Three expire through the reconciler, the other three through a dispatcher's claim.
    let items = store::claim_unknown(&mut pg, 9, 3, 5_000).await.unwrap();
    assert!(items.is_empty(), "an expiry is not yet due for a lookup");
    let after_reconciler = store::snapshot(&mut pg, &keys).await.unwrap();
    let unknown = after_reconciler
        .iter()
        .filter(|r| r.state == State::DispatchUnknown)
        .count();
    assert_eq!(
        unknown, 3,
        "the reconciler picks expired leases' rows, a batch of 3"
    );
    assert_eq!(store::check_lease_rule(&pg).await.unwrap(), vec![]);
    let b = store::claim(
        &mut pg,
        &store::ClaimRequest::new(2, 6, 300).cluster(cluster),
        None,
    )
    .await
    .unwrap();
    assert_eq!(
        b.expired_to_unknown, 3,
        "a dispatcher's claim expires the rest"
    );
    assert!(b.outgoing.is_empty());
    let rows = store::snapshot(&mut pg, &keys).await.unwrap();
    for (r, o) in rows.iter().zip(&first.outgoing) {
        assert_eq!(r.state, State::DispatchUnknown);
        let statuses: Vec<(u64, AttemptStatus)> =
            r.attempts.iter().map(|a| (a.id, a.status)).collect();
        assert_eq!(
            statuses,
            vec![(o.attempt_id, AttemptStatus::Unknown)],
            "the leased attempt is on record, unknown"
        );
    }
    assert_eq!(
        common::count(&pg, "SELECT count(*) FROM sealpost.lease").await,
        0,
        "the expired lease stands for nothing and is gone"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_receipt_leaves_its_row_leased_and_the_rest_drop_the_lease() {
    let (_db, mut pg) = setup("reject").await;
    let keys = enqueue(&mut pg, 3, "reject").await;
    let mut held = store::Held::default();
    let b = store::claim(
        &mut pg,
        &store::ClaimRequest::new(1, 3, 60_000).cluster(Some(common::NATS_CLUSTER)),
        Some(&mut held),
    )
    .await
    .unwrap();
    assert_eq!(b.outgoing.len(), 3);
    // Two genuine ACKs, and one for an attempt nobody registered (rejected, audited).
    let done = two_acks_and_a_forged_one(&mut pg, &b.outgoing, &mut held).await;
    assert_eq!(done.guarded, 2, "the ordinary ACKs took the guarded write");
    let rows = store::snapshot(&mut pg, &keys).await.unwrap();
    assert_eq!(
        rows.iter().map(|r| r.state).collect::<Vec<_>>(),
        vec![State::Published, State::Published, State::Sending],
        "the rejected receipt left its row as the lease stands for it"
    );
    assert_eq!(rows[2].attempts[0].id, b.outgoing[2].attempt_id);
    assert_eq!(
        common::count(&pg, "SELECT count(*) FROM sealpost.lease").await,
        1,
        "the lease still stands for the third row"
    );
    // Its genuine ACK, late, through the locked path: now the lease stands for nothing.
    let done = store::submit(
        &mut pg,
        &Submission {
            receipts: vec![ack(&b.outgoing[2], 3)],
            reports: vec![],
        },
        5,
    )
    .await
    .unwrap();
    assert_eq!(done.published.len(), 1);
    let rows = store::snapshot(&mut pg, &keys).await.unwrap();
    assert!(rows.iter().all(|r| r.state == State::Published));
    for (r, o) in rows.iter().zip(&b.outgoing) {
        assert_eq!(r.attempts.len(), 1);
        assert_eq!(r.attempts[0].id, o.attempt_id);
        assert_eq!(r.attempts[0].status, AttemptStatus::Acked);
        assert_eq!(r.primary.as_ref().map(|p| p.attempt_id), Some(o.attempt_id));
    }
    assert_eq!(
        common::count(&pg, "SELECT count(*) FROM sealpost.leased").await,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_dispatchers_claiming_at_once_never_lease_a_row_twice() {
    let (db, mut pg) = setup("race").await;
    let keys = enqueue(&mut pg, 400, "race").await;
    let url = db.database_url.clone();
    let mut tasks = Vec::new();
    for owner in [1u64, 2] {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            let mut pg = runtime::pg_connect(&url).await.unwrap();
            let mut held = store::Held::default();
            let mut got = Vec::new();
            loop {
                let b = store::claim(
                    &mut pg,
                    &store::ClaimRequest::new(owner, 7, 60_000).cluster(Some(common::NATS_CLUSTER)),
                    Some(&mut held),
                )
                .await
                .unwrap();
                if b.outgoing.is_empty() {
                    break;
                }
                got.extend(b.outgoing.iter().map(|o| (o.event_id, o.attempt_id)));
            }
            got
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    assert_eq!(all.len(), 400, "every row claimed exactly once");
    let mut ids: Vec<EventId> = all.iter().map(|(e, _)| *e).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 400, "no row leased twice");
    let rows = store::snapshot(&mut pg, &keys).await.unwrap();
    assert!(rows
        .iter()
        .all(|r| r.state == State::Sending && r.attempts.len() == 1));
}

/// The lease rule is said in three places the compiler cannot tie together: the core's
/// `lease::never_claimed`, the store's SQL (the claim's pick, the lease drop) and the view
/// `sealpost.leased` of migration 12. Here they are checked row by row against each other
/// on rows in every state a lease meets (listed and untouched, published through the guarded
/// write, rejected, expired to unknown, never listed) and on rows that differ from a
/// never-claimed one in a single column of the rule each: one missed column in any of the
/// three shows up as a disagreement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lease_rule_reads_the_same_in_the_core_the_sql_and_the_view() {
    let (_db, mut pg) = setup("rule").await;
    let keys = enqueue(&mut pg, 16, "rule").await;
    let cluster = Some(common::NATS_CLUSTER);
    assert_eq!(store::check_lease_rule(&pg).await.unwrap(), vec![]);
    // Rows 0..4 under a lease that expires; rows 4..14 under a live one; 14 and 15 never listed.
    let mut held = store::Held::default();
    let short = store::claim(
        &mut pg,
        &store::ClaimRequest::new(1, 4, 200).cluster(cluster),
        Some(&mut held),
    )
    .await
    .unwrap();
    assert_eq!(short.outgoing.len(), 4);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let b = store::claim(
        &mut pg,
        &store::ClaimRequest::new(2, 14, 60_000).cluster(cluster),
        Some(&mut held),
    )
    .await
    .unwrap();
    assert_eq!(
        (b.outgoing.len(), b.expired_to_unknown),
        (10, 4),
        "the second claim expired the first lease's rows and leased ten more (its limit counts both)"
    );
    // Rows 4 and 5 published through the guarded write, row 6's receipt rejected.
    let done = two_acks_and_a_forged_one(&mut pg, &b.outgoing, &mut held).await;
    assert_eq!(done.guarded, 2);
    assert_eq!(store::check_lease_rule(&pg).await.unwrap(), vec![]);

    // Rows 7..14 are listed and never claimed in storage; each now differs from that in one
    // column of the rule (as no store transaction would leave it, so that each column is
    // tested on its own): an owner without a lease is a claim (one that ran out), a lease
    // without an owner is none, in all three.
    let listed: Vec<uuid::Uuid> = b.outgoing[3..]
        .iter()
        .map(|o| uuid::Uuid::from_bytes(o.event_id.0))
        .collect();
    let crafted = [
        "claim_generation = 1",
        "attempt_generation = 1",
        "primary_sequence = 77",
        "claim_owner = 9, lease_until_ms = 1",
        "claim_owner = 9",
        "lease_until_ms = 1",
        "attempt_id = 424242, attempt_agen = 1, attempt_claim_generation = 1, attempt_owner = 9,
         attempt_envelope_generation = envelope_generation, attempt_status = 'SENDING',
         attempt_started_ms = 1",
    ];
    for (set, id) in crafted.iter().zip(&listed) {
        let n = pg
            .execute(
                &format!("UPDATE sealpost.work SET {set} WHERE event_id = $1"),
                &[id],
            )
            .await
            .unwrap();
        assert_eq!(n, 1);
    }
    assert_eq!(
        store::check_lease_rule(&pg).await.unwrap(),
        vec![],
        "the three statements of the rule agree on every row"
    );
    let in_view = common::count(&pg, "SELECT count(*) FROM sealpost.leased").await;
    assert_eq!(
        in_view, 2,
        "of the live lease's rows only the rejected one and the one with a lease but no owner are still stood for"
    );
    let _ = keys;
}
