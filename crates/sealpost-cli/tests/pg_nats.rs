//! Against the real PostgreSQL (127.0.0.1:5432, a database of its own per test, `sealpost_pgnats_<tag>`) and NATS JetStream
//! (127.0.0.1:4222): the producer's transaction, the acceptance point, late ACKs, receipt
//! rollbacks, quarantine and reconciliation (process-level drills are in `processes.rs`). Tests
//! share the `sealpost` schema, so they run one at a time under a lock and each uses its own
//! stream.

use crate::common;
use crate::teardown_nats;

use std::time::Duration;

use sealpost::runtime;
use sealpost::store::{self, Accepted, OutcomeReport};
use sealpost_core::claim::SendOutcome;
use sealpost_core::envelope::{EventId, NewEvent};
use sealpost_core::port::{Broker, SendResult};
use sealpost_core::reconcile::{Lookup, ReconcileDecision};
use sealpost_core::{DuplicateKind, QuarantineReason, ReceiptVerdict, RejectReason};
use sealpost_nats::Nats;

static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Sends through the broker port as a dispatcher does, with a deadline far enough away that
/// the test decides when a send happens (a "delayed request" is one sent late).
async fn send(nats: &Nats, outgoing: &[store::Outgoing]) -> Vec<SendResult> {
    let batch = outgoing.iter().map(store::Outgoing::send_request).collect();
    nats.send_batch(batch, std::time::Instant::now() + Duration::from_secs(60))
        .await
}

struct Env {
    pg: tokio_postgres::Client,
    nats: Nats,
    topic: String,
    cfg: common::TestDb,
    /// This test's streams, deleted when it ends.
    streams: Vec<teardown_nats::Teardown>,
}

impl Env {
    /// Creates stream `topic` for this test only.
    async fn ensure_stream(&mut self, topic: &str) {
        self.streams
            .push(teardown_nats::stream(&common::nats_url(), topic));
        self.nats.ensure_stream(topic).await.expect("stream");
    }
}

async fn env(tag: &str) -> Env {
    let cfg = common::fresh_database(&format!("sealpost_pgnats_{tag}")).await;
    let pg = runtime::pg_connect(&cfg.database_url)
        .await
        .expect("PostgreSQL must be running");
    store::migrate(&pg).await.expect("migrate");
    let topic = format!("T{}{}", tag.to_uppercase(), runtime::owner_id() % 1_000_000);
    store::set_route(&pg, "orders", common::NATS_CLUSTER, &topic)
        .await
        .expect("route");
    let nats = Nats::connect(
        &common::nats_url(),
        common::NATS_CLUSTER,
        Duration::from_millis(cfg.ack_timeout_ms),
    )
    .await
    .expect("NATS must be running");
    let streams = vec![teardown_nats::stream(&common::nats_url(), &topic)];
    nats.ensure_stream(&topic).await.expect("stream");
    Env {
        pg,
        nats,
        topic,
        cfg,
        streams,
    }
}

fn new_event<'a>(id: &'a str, payload: &'a [u8]) -> NewEvent<'a> {
    NewEvent {
        aggregate_type: "order",
        aggregate_id: id,
        aggregate_version: 1,
        event_type: "order.created.v1",
        payload_schema: "order.created.v1",
        payload,
        tenant: "t",
        occurred_at_ms: 1,
        creating_txid: 0,
    }
}

async fn enqueue_n(pg: &mut tokio_postgres::Client, n: usize) -> Vec<EventId> {
    let mut ids = Vec::with_capacity(n);
    let payload = vec![b'x'; 200];
    for chunk in 0..n.div_ceil(1000) {
        let tx = pg.transaction().await.unwrap();
        for i in chunk * 1000..((chunk + 1) * 1000).min(n) {
            let id = EventId(*uuid::Uuid::now_v7().as_bytes());
            store::enqueue(
                &tx,
                "orders",
                id,
                &new_event(&format!("o-{i}"), &payload),
                "k",
            )
            .await
            .unwrap();
            ids.push(id);
        }
        tx.commit().await.unwrap();
    }
    ids
}

async fn state_of(pg: &tokio_postgres::Client, id: EventId) -> String {
    pg.query_one(
        "SELECT state FROM sealpost.outbox WHERE event_id = $1",
        &[&uuid::Uuid::from_bytes(id.0)],
    )
    .await
    .unwrap()
    .get(0)
}

async fn receipt_kinds(pg: &tokio_postgres::Client, id: EventId) -> Vec<String> {
    pg.query(
        "SELECT kind FROM sealpost.receipts WHERE event_id = $1 ORDER BY receipt_id",
        &[&uuid::Uuid::from_bytes(id.0)],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}

#[tokio::test]
async fn rolled_back_business_transaction_leaves_no_envelope() {
    let _g = LOCK.lock().await;
    let mut e = env("rb").await;
    let id = EventId(*uuid::Uuid::now_v7().as_bytes());
    let tx = e.pg.transaction().await.unwrap();
    store::enqueue(&tx, "orders", id, &new_event("o-1", b"{}"), "k")
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    let n: i64 =
        e.pg.query_one("SELECT count(*) FROM sealpost.outbox", &[])
            .await
            .unwrap()
            .get(0);
    assert_eq!(
        n, 0,
        "R4: a rolled-back business transaction leaves no envelope"
    );
    // Bad input gets a clear error and writes nothing.
    let tx = e.pg.transaction().await.unwrap();
    let err = store::enqueue(&tx, "no-such-route", id, &new_event("o-1", b"{}"), "k")
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("no route policy named `no-such-route`"),
        "{err}"
    );
    drop(tx);
    let tx = e.pg.transaction().await.unwrap();
    let big = vec![0u8; store::PAYLOAD_BYTES_MAX + 1];
    let err = store::enqueue(&tx, "orders", id, &new_event("o-1", &big), "k")
        .await
        .unwrap_err();
    assert!(
        matches!(err, store::StoreError::PayloadTooLarge { .. }),
        "{err}"
    );
}

#[tokio::test]
async fn dispatch_publishes_with_one_primary_and_route_revision_keeps_frozen_destination() {
    let _g = LOCK.lock().await;
    let mut e = env("rt").await;
    let ids = enqueue_n(&mut e.pg, 3).await;
    // F6: the route policy is revised after commit, before send.
    let other = format!("{}X", e.topic);
    e.ensure_stream(&other).await;
    store::set_route(&e.pg, "orders", common::NATS_CLUSTER, &other)
        .await
        .unwrap();
    let batch = store::claim_batch(&mut e.pg, 7, 100, 10_000).await.unwrap();
    assert_eq!(batch.outgoing.len(), 3);
    assert!(
        batch
            .outgoing
            .iter()
            .all(|o| o.destination.topic == e.topic),
        "frozen destination"
    );
    let results = send(&e.nats, &batch.outgoing).await;
    let receipts: Vec<_> = results
        .into_iter()
        .map(|r| match r {
            SendResult::Receipt(r) => r,
            other => panic!("publish failed: {other:?}"),
        })
        .collect();
    let v = store::accept_receipts(&mut e.pg, &receipts).await.unwrap();
    assert!(
        v.iter()
            .all(|a| *a == Accepted::Verdict(ReceiptVerdict::Primary)),
        "{v:?}"
    );
    for id in &ids {
        assert_eq!(state_of(&e.pg, *id).await, "PUBLISHED");
        assert_eq!(receipt_kinds(&e.pg, *id).await, vec!["primary"]);
        match sealpost::signing::Keyring::off().judge(e.nats.lookup_topic(&e.topic, *id, 0).await) {
            Lookup::Found(r) => assert_eq!(r.event_id, *id),
            other => panic!("lookup: {other:?}"),
        }
        assert_eq!(
            e.nats.lookup_topic(&other, *id, 0).await,
            Lookup::Absent,
            "nothing at the new destination"
        );
    }
    // New events see the new policy.
    let id2 = enqueue_n(&mut e.pg, 1).await[0];
    let b2 = store::claim_batch(&mut e.pg, 7, 100, 10_000).await.unwrap();
    assert_eq!(b2.outgoing[0].event_id, id2);
    assert_eq!(b2.outgoing[0].destination.topic, other);
}

#[tokio::test]
async fn paused_dispatcher_late_ack_converges_as_duplicate() {
    let _g = LOCK.lock().await;
    let mut e = env("late").await;
    let id = enqueue_n(&mut e.pg, 1).await[0];
    // Dispatcher A claims with a short lease, publishes, then "pauses" past its lease
    // before reporting the ACK.
    let a = store::claim_batch(&mut e.pg, 1, 10, 1_000).await.unwrap();
    let ack_a = match send(&e.nats, &a.outgoing).await.remove(0) {
        SendResult::Receipt(r) => r,
        other => panic!("{other:?}"),
    };
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    // The lease ran out while SENDING: the next scan makes it DISPATCH_UNKNOWN, never PENDING.
    let b = store::claim_batch(&mut e.pg, 2, 10, 1_000).await.unwrap();
    assert!(b.outgoing.is_empty());
    assert_eq!(b.expired_to_unknown, 1);
    assert_eq!(state_of(&e.pg, id).await, "DISPATCH_UNKNOWN");
    // A's stale outcome report is fenced (audit only).
    let rep = OutcomeReport {
        event_id: id,
        member: 0,
        token: a.outgoing[0].token,
        attempt_id: a.outgoing[0].attempt_id,
        outcome: SendOutcome::AckTimeout,
        detail: String::new(),
    };
    let d = store::report_outcomes(&mut e.pg, &[rep], 5).await.unwrap();
    assert!(
        matches!(d[0], sealpost_core::SendOutcomeDecision::Audit(_)),
        "{d:?}"
    );
    // The reconciler finds the message and accepts it through the acceptance point.
    let items = store::claim_unknown(&mut e.pg, 3, 10, 5_000).await.unwrap();
    assert_eq!(items.len(), 1);
    // Judged as the reconciler judges it (no keyring here: every seal admitted).
    let lookup =
        sealpost::signing::Keyring::off().judge(e.nats.lookup_topic(&e.topic, id, 0).await);
    let d = store::finish_reconcile(&mut e.pg, &items[0], &lookup)
        .await
        .unwrap();
    assert!(matches!(d, ReconcileDecision::Accept(_)), "{d:?}");
    assert_eq!(state_of(&e.pg, id).await, "PUBLISHED");
    // A's late, genuine ACK still converges: a duplicate transport receipt, same position.
    let v = store::accept_receipts(&mut e.pg, &[ack_a]).await.unwrap();
    assert_eq!(
        v,
        vec![Accepted::Verdict(ReceiptVerdict::Duplicate(
            DuplicateKind::SamePosition
        ))]
    );
    assert_eq!(
        receipt_kinds(&e.pg, id).await,
        vec!["primary", "same_position"]
    );
}

#[tokio::test]
async fn retry_after_unknown_and_both_acks_converge() {
    let _g = LOCK.lock().await;
    let mut e = env("f4").await;
    let id = enqueue_n(&mut e.pg, 1).await[0];
    // A claims and registers an attempt, but its request is "lost" (never published yet).
    let a = store::claim_batch(&mut e.pg, 1, 10, 1_000).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    store::claim_batch(&mut e.pg, 2, 10, 1_000).await.unwrap();
    // Lookup proves absence: retry to the same destination.
    let items = store::claim_unknown(&mut e.pg, 3, 10, 5_000).await.unwrap();
    let lookup = e.nats.lookup_topic(&e.topic, id, 0).await;
    assert_eq!(lookup, Lookup::Absent);
    let d = store::finish_reconcile(&mut e.pg, &items[0], &lookup)
        .await
        .unwrap();
    assert!(
        matches!(d, ReconcileDecision::RetrySameDestination { .. }),
        "{d:?}"
    );
    assert_eq!(state_of(&e.pg, id).await, "RETRY_CLAIMED");
    let b = store::claim_batch(&mut e.pg, 4, 10, 10_000).await.unwrap();
    assert_eq!(b.outgoing.len(), 1);
    assert_eq!(
        b.outgoing[0].destination_digest, a.outgoing[0].destination_digest,
        "same frozen destination"
    );
    // Now A's delayed request reaches the broker, then B's: both ACK (F4).
    let ack_a = match send(&e.nats, &a.outgoing).await.remove(0) {
        SendResult::Receipt(r) => r,
        other => panic!("{other:?}"),
    };
    let ack_b = match send(&e.nats, &b.outgoing).await.remove(0) {
        SendResult::Receipt(r) => r,
        other => panic!("{other:?}"),
    };
    assert!(
        ack_b.broker_duplicate,
        "NATS deduplicates on Nats-Msg-Id = event id"
    );
    assert_eq!(ack_a.sequence, ack_b.sequence);
    let v = store::accept_receipts(&mut e.pg, &[ack_a, ack_b])
        .await
        .unwrap();
    assert_eq!(
        v,
        vec![
            Accepted::Verdict(ReceiptVerdict::Primary),
            Accepted::Verdict(ReceiptVerdict::Duplicate(DuplicateKind::SamePosition))
        ],
        "the old attempt's ACK wins; the new one is a duplicate transport receipt"
    );
    assert_eq!(state_of(&e.pg, id).await, "PUBLISHED");
}

#[tokio::test]
async fn receipt_transaction_rollback_then_retry_fills_slot() {
    let _g = LOCK.lock().await;
    let mut e = env("f7").await;
    let id = enqueue_n(&mut e.pg, 1).await[0];
    let a = store::claim_batch(&mut e.pg, 1, 10, 10_000).await.unwrap();
    let ack = match send(&e.nats, &a.outgoing).await.remove(0) {
        SendResult::Receipt(r) => r,
        other => panic!("{other:?}"),
    };
    // F7: the receipt transaction is killed before it commits: a conflicting lock makes it
    // time out, and it rolls back.
    let mut other = runtime::pg_connect(&e.cfg.database_url).await.unwrap();
    let holder = other.transaction().await.unwrap();
    holder
        .execute(
            "SELECT 1 FROM sealpost.work WHERE event_id = $1 FOR UPDATE",
            &[&uuid::Uuid::from_bytes(id.0)],
        )
        .await
        .unwrap();
    e.pg.batch_execute("SET lock_timeout = '300ms'")
        .await
        .unwrap();
    let err = store::accept_receipts(&mut e.pg, std::slice::from_ref(&ack)).await;
    assert!(
        err.is_err(),
        "the receipt transaction must fail while the row is locked"
    );
    holder.rollback().await.unwrap();
    e.pg.batch_execute("SET lock_timeout = 0").await.unwrap();
    assert_eq!(
        state_of(&e.pg, id).await,
        "SENDING",
        "a rolled-back receipt changes nothing"
    );
    assert!(receipt_kinds(&e.pg, id).await.is_empty());
    let v = store::accept_receipts(&mut e.pg, &[ack]).await.unwrap();
    assert_eq!(v, vec![Accepted::Verdict(ReceiptVerdict::Primary)]);
    assert_eq!(state_of(&e.pg, id).await, "PUBLISHED");
}

#[tokio::test]
async fn divergent_and_forged_receipts_never_fill_the_slot() {
    let _g = LOCK.lock().await;
    let mut e = env("q").await;
    let id = enqueue_n(&mut e.pg, 1).await[0];
    let a = store::claim_batch(&mut e.pg, 1, 10, 10_000).await.unwrap();
    let ack = match send(&e.nats, &a.outgoing).await.remove(0) {
        SendResult::Receipt(r) => r,
        other => panic!("{other:?}"),
    };
    let mut bad = ack.clone();
    bad.payload_digest = sealpost_core::Digest([7; 32]);
    let mut forged = ack.clone();
    forged.attempt_id = 999_999_999;
    let mut seq0 = ack.clone();
    seq0.sequence = 0;
    let mut unknown = ack.clone();
    unknown.event_id = EventId([9; 16]);
    let v = store::accept_receipts(&mut e.pg, &[bad, forged, seq0, unknown])
        .await
        .unwrap();
    assert_eq!(
        v,
        vec![
            Accepted::Verdict(ReceiptVerdict::Quarantine(
                QuarantineReason::PayloadDigestMismatch
            )),
            Accepted::Verdict(ReceiptVerdict::Reject(RejectReason::UnregisteredAttempt)),
            Accepted::Verdict(ReceiptVerdict::Reject(RejectReason::NoPosition)),
            Accepted::UnknownEvent,
        ]
    );
    assert_eq!(
        state_of(&e.pg, id).await,
        "SENDING",
        "the slot is untouched"
    );
    let q: i64 =
        e.pg.query_one("SELECT count(*) FROM sealpost.quarantine", &[])
            .await
            .unwrap()
            .get(0);
    let audit: i64 =
        e.pg.query_one("SELECT count(*) FROM sealpost.audit", &[])
            .await
            .unwrap()
            .get(0);
    assert_eq!((q, audit), (1, 3));
    let v = store::accept_receipts(&mut e.pg, &[ack]).await.unwrap();
    assert_eq!(v, vec![Accepted::Verdict(ReceiptVerdict::Primary)]);
}

#[tokio::test]
async fn migration_refused_while_unknown_and_old_receipt_after_migration_is_a_conflict() {
    let _g = LOCK.lock().await;
    let mut e = env("mig").await;
    let new_topic = format!("{}M", e.topic);
    e.ensure_stream(&new_topic).await;
    store::set_route(&e.pg, "orders-v2", common::NATS_CLUSTER, &new_topic)
        .await
        .unwrap();
    let ids = enqueue_n(&mut e.pg, 2).await;
    // Event 0: its send's outcome is unknown (lease ran out mid-send): migration refused (F5).
    let a = store::claim_batch(&mut e.pg, 1, 1, 1_000).await.unwrap();
    assert_eq!(a.outgoing[0].event_id, ids[0]);
    let ack_old = match send(&e.nats, &a.outgoing).await.remove(0) {
        SendResult::Receipt(r) => r,
        other => panic!("{other:?}"),
    };
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let rep = OutcomeReport {
        event_id: ids[0],
        member: 0,
        token: a.outgoing[0].token,
        attempt_id: a.outgoing[0].attempt_id,
        outcome: SendOutcome::AckTimeout,
        detail: String::new(),
    };
    store::report_outcomes(&mut e.pg, &[rep], 5).await.unwrap();
    store::claim_unknown(&mut e.pg, 9, 10, 5_000).await.unwrap();
    let refused = store::migrate_event(&mut e.pg, ids[0], 0, "orders-v2")
        .await
        .unwrap();
    assert_eq!(
        refused,
        Err(sealpost_core::migration::MigrationRefusal::OldDestinationUnknown)
    );
    // Event 1 never left: it may move, under envelope generation 2, with a migration receipt.
    let grant = store::migrate_event(&mut e.pg, ids[1], 0, "orders-v2")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(grant.envelope_generation, 2);
    let b = store::claim_batch(&mut e.pg, 2, 10, 10_000).await.unwrap();
    let mine: Vec<_> = b
        .outgoing
        .iter()
        .filter(|o| o.event_id == ids[1])
        .cloned()
        .collect();
    assert_eq!(mine[0].destination.topic, new_topic);
    assert_eq!(mine[0].envelope_generation, 2);
    let ack_new = match send(&e.nats, &mine).await.remove(0) {
        SendResult::Receipt(r) => r,
        other => panic!("{other:?}"),
    };
    let v = store::accept_receipts(&mut e.pg, &[ack_new]).await.unwrap();
    assert_eq!(v, vec![Accepted::Verdict(ReceiptVerdict::Primary)]);
    // A receipt claiming the old destination for the migrated event: the absence proof
    // would have been wrong. Quarantined, never accepted.
    let mut conflict = ack_old.clone();
    conflict.event_id = ids[1];
    conflict.destination_digest = a.outgoing[0].destination_digest;
    let v = store::accept_receipts(&mut e.pg, &[conflict])
        .await
        .unwrap();
    assert_eq!(
        v,
        vec![Accepted::Verdict(ReceiptVerdict::Quarantine(
            QuarantineReason::MigrationConflict
        ))]
    );
    let m: i64 =
        e.pg.query_one(
            "SELECT count(*) FROM sealpost.migration WHERE event_id = $1",
            &[&uuid::Uuid::from_bytes(ids[1].0)],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(m, 1, "one migration receipt");
    // The unknown event still publishes to its frozen destination.
    let v = store::accept_receipts(&mut e.pg, &[ack_old]).await.unwrap();
    assert_eq!(v, vec![Accepted::Verdict(ReceiptVerdict::Primary)]);
}
