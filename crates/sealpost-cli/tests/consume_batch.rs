//! The batched consumer inbox (`sealpost::inbox::process_batch`, issue "throughput" item 6)
//! against the real PostgreSQL and NATS JetStream: a failing effect is isolated to its own
//! message (rolled back, not acked, redelivered, applied once when it can be), a duplicate
//! of a consumed event in a batch applies once, and a batch quarantines exactly what
//! `process` quarantines. Every test has its own database and its own stream.

use crate::common;
use crate::teardown_nats;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sealpost::inbox::{self, BatchEffect, BatchOutcome, Delivery, Effect, InboxOutcome};
use sealpost::runtime;
use sealpost::runtime::CancellationToken;
use sealpost::store;
use sealpost_core::envelope::{EventId, PAYLOAD_DOMAIN};
use sealpost_core::Digest;
use sealpost_nats::async_nats::jetstream;
use sealpost_nats::Nats;

/// A fresh database `sealpost_consume_<tag>` with the schema and the demo tables, and a
/// config pointing at it.
async fn fresh(tag: &str) -> (common::TestDb, tokio_postgres::Client) {
    let cfg = common::fresh_database(&format!("sealpost_consume_{tag}")).await;
    let pg = runtime::pg_connect(&cfg.database_url).await.unwrap();
    store::migrate(&pg).await.expect("migrate");
    sealpost_cli::demo::prepare(&pg).await.unwrap();
    (cfg, pg)
}

fn new_id() -> EventId {
    EventId(*uuid::Uuid::now_v7().as_bytes())
}

fn delivery(id: EventId, payload: &[u8], seq: u64) -> Delivery {
    let d = Digest::of_bytes(PAYLOAD_DOMAIN, payload);
    Delivery {
        event_id: id,
        member: 0,
        claimed_digest: d,
        signatures: sealpost_core::signature::SignaturePolicy::Off,
        presented: sealpost_core::signature::Presented::Missing,
        payload_digest: d,
        stream: "S".into(),
        sequence: seq,
    }
}

/// One `demo_fulfilment` row per applied message, with the order id given per message, in
/// one statement per call (as the example consumer does).
fn batch_effect(consumer: &str, ds: &[Delivery], orders: &[&str]) -> BatchEffect<'static> {
    let consumer = consumer.to_string();
    let ids: Vec<uuid::Uuid> = ds
        .iter()
        .map(|d| uuid::Uuid::from_bytes(d.event_id.0))
        .collect();
    let orders: Vec<String> = orders.iter().map(|o| o.to_string()).collect();
    Box::new(move |tx, apply| {
        let ids: Vec<uuid::Uuid> = apply.iter().map(|&i| ids[i]).collect();
        let orders: Vec<String> = apply.iter().map(|&i| orders[i].clone()).collect();
        let consumer = consumer.clone();
        Box::pin(async move {
            tx.execute(
                "INSERT INTO demo_fulfilment (consumer_id, event_id, order_id, idempotency_key)
                 SELECT $1, e, o, 'k' FROM unnest($2::uuid[], $3::text[]) AS t(e, o)",
                &[&consumer, &ids, &orders],
            )
            .await
            .map(|_| ())
        })
    })
}

fn single_effect(consumer: &str, id: EventId) -> Effect<'static> {
    let consumer = consumer.to_string();
    let eid = uuid::Uuid::from_bytes(id.0);
    Box::new(move |tx| {
        Box::pin(async move {
            tx.execute(
                "INSERT INTO demo_fulfilment (consumer_id, event_id, order_id, idempotency_key) VALUES ($1, $2, 'o', 'k')",
                &[&consumer, &eid],
            )
            .await
            .map(|_| ())
        })
    })
}

async fn count(pg: &tokio_postgres::Client, sql: &str, consumer: &str) -> i64 {
    pg.query_one(sql, &[&consumer]).await.unwrap().get(0)
}

/// (effect rows, distinct events with an effect, inbox rows) of a consumer.
async fn state(pg: &tokio_postgres::Client, consumer: &str) -> (i64, i64, i64) {
    let r = pg
        .query_one(
            "SELECT (SELECT count(*) FROM demo_fulfilment WHERE consumer_id = $1),
                    (SELECT count(DISTINCT event_id) FROM demo_fulfilment WHERE consumer_id = $1),
                    (SELECT count(*) FROM sealpost.inbox WHERE consumer_id = $1)",
            &[&consumer],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1), r.get(2))
}

async fn has_inbox_row(pg: &tokio_postgres::Client, consumer: &str, id: uuid::Uuid) -> bool {
    pg.query_one(
        "SELECT count(*) FROM sealpost.inbox WHERE consumer_id = $1 AND event_id = $2",
        &[&consumer, &id],
    )
    .await
    .unwrap()
    .get::<_, i64>(0)
        == 1
}

async fn watermark(pg: &tokio_postgres::Client, consumer: &str) -> Option<i64> {
    pg.query_opt(
        "SELECT high_water FROM sealpost.consumer_watermark WHERE consumer_id = $1 AND stream = 'S'",
        &[&consumer],
    )
    .await
    .unwrap()
    .map(|r| r.get(0))
}

#[tokio::test]
async fn a_failing_effect_in_a_batch_is_rolled_back_alone_and_not_acked() {
    let (_db, mut pg) = fresh("fail").await;
    pg.batch_execute(
        "ALTER TABLE demo_fulfilment ADD CONSTRAINT no_poison CHECK (order_id NOT LIKE 'poison%')",
    )
    .await
    .unwrap();
    let consumer = "batch-fail";
    let ids: Vec<EventId> = (0..10).map(|_| new_id()).collect();
    let ds: Vec<Delivery> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| delivery(*id, format!("order-{i}").as_bytes(), i as u64 + 1))
        .collect();
    // Messages 3 and 9 (the highest sequence) cannot apply; the other eight can.
    let mut orders = vec!["ok"; 10];
    orders[3] = "poison-3";
    orders[9] = "poison-9";
    let outcomes =
        inbox::process_batch(&mut pg, consumer, &ds, batch_effect(consumer, &ds, &orders))
            .await
            .unwrap();
    assert_eq!(outcomes.len(), 10);
    for (i, o) in outcomes.iter().enumerate() {
        if i == 3 || i == 9 {
            let BatchOutcome::Failed { error } = o else {
                panic!("message {i} must fail: {o:?}")
            };
            assert!(
                error.contains("violates check constraint \"no_poison\"")
                    && error.contains("SQLSTATE 23514"),
                "the database's own words: {error}"
            );
            assert!(!o.ack(), "a failed message is not acked");
        } else {
            assert!(
                matches!(o, BatchOutcome::Applied { .. }),
                "message {i}: {o:?}"
            );
            assert!(o.ack());
        }
    }
    assert_eq!(
        state(&pg, consumer).await,
        (8, 8, 8),
        "eight effects and eight inbox rows"
    );
    for i in [3, 9] {
        assert!(
            !has_inbox_row(&pg, consumer, uuid::Uuid::from_bytes(ids[i].0)).await,
            "the failed message {i} holds no inbox row"
        );
    }
    assert_eq!(
        watermark(&pg, consumer).await,
        Some(9),
        "the watermark stops at the highest applied sequence"
    );
    // Redelivered once the cause is gone, the two apply; the eight are duplicates.
    pg.batch_execute("ALTER TABLE demo_fulfilment DROP CONSTRAINT no_poison")
        .await
        .unwrap();
    let again = inbox::process_batch(&mut pg, consumer, &ds, batch_effect(consumer, &ds, &orders))
        .await
        .unwrap();
    let applied = again
        .iter()
        .filter(|o| matches!(o, BatchOutcome::Applied { .. }))
        .count();
    let duplicates = again
        .iter()
        .filter(|o| matches!(o, BatchOutcome::Duplicate { .. }))
        .count();
    assert_eq!((applied, duplicates), (2, 8));
    assert!(matches!(again[3], BatchOutcome::Applied { .. }));
    assert!(matches!(again[9], BatchOutcome::Applied { .. }));
    assert_eq!(state(&pg, consumer).await, (10, 10, 10));
    assert_eq!(watermark(&pg, consumer).await, Some(10));
}

#[tokio::test]
async fn a_duplicate_of_a_consumed_event_in_a_batch_applies_once() {
    let (_db, mut pg) = fresh("dup").await;
    let consumer = "batch-dup";
    let a = new_id();
    let first = inbox::process(
        &mut pg,
        consumer,
        &delivery(a, b"order-a", 1),
        single_effect(consumer, a),
    )
    .await
    .unwrap();
    let InboxOutcome::Applied {
        receipt_id: a_receipt,
    } = first
    else {
        panic!("{first:?}")
    };
    // A batch: A again (redelivered), B, C, and B again within the same batch.
    let (b, c) = (new_id(), new_id());
    let ds = vec![
        delivery(a, b"order-a", 2),
        delivery(b, b"order-b", 3),
        delivery(c, b"order-c", 4),
        delivery(b, b"order-b", 5),
    ];
    let outcomes = inbox::process_batch(
        &mut pg,
        consumer,
        &ds,
        batch_effect(consumer, &ds, &["o"; 4]),
    )
    .await
    .unwrap();
    assert_eq!(
        outcomes[0],
        BatchOutcome::Duplicate {
            receipt_id: a_receipt
        },
        "the consumed event returns its original receipt"
    );
    let BatchOutcome::Applied {
        receipt_id: b_receipt,
    } = outcomes[1]
    else {
        panic!("{:?}", outcomes[1])
    };
    assert!(matches!(outcomes[2], BatchOutcome::Applied { .. }));
    assert_eq!(
        outcomes[3],
        BatchOutcome::Duplicate {
            receipt_id: b_receipt
        },
        "the second copy in the batch is a duplicate of the first"
    );
    assert!(outcomes.iter().all(BatchOutcome::ack));
    assert_eq!(
        state(&pg, consumer).await,
        (3, 3, 3),
        "three events, each applied once"
    );
    let per_event: Vec<i64> = pg
        .query(
            "SELECT count(*) FROM demo_fulfilment WHERE consumer_id = $1 GROUP BY event_id",
            &[&consumer],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(per_event, vec![1, 1, 1]);
    assert_eq!(watermark(&pg, consumer).await, Some(4));
    assert_eq!(
        count(
            &pg,
            "SELECT count(*) FROM sealpost.inbox_quarantine WHERE consumer_id = $1",
            consumer
        )
        .await,
        0
    );
}

/// Quarantine rows of a consumer, without ids and times.
async fn quarantined(
    pg: &tokio_postgres::Client,
    consumer: &str,
) -> BTreeSet<(String, i64, String)> {
    pg.query(
        "SELECT event_id::text, sequence, reason FROM sealpost.inbox_quarantine WHERE consumer_id = $1",
        &[&consumer],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2)))
    .collect()
}

/// Inbox rows of a consumer, without receipt ids and times.
async fn inbox_rows(
    pg: &tokio_postgres::Client,
    consumer: &str,
) -> BTreeSet<(String, Vec<u8>, i64)> {
    pg.query(
        "SELECT event_id::text, payload_digest, sequence FROM sealpost.inbox WHERE consumer_id = $1",
        &[&consumer],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2)))
    .collect()
}

#[tokio::test]
async fn a_batch_quarantines_exactly_what_process_quarantines() {
    let (_db, mut pg) = fresh("quarantine").await;
    let (a, b, c) = (new_id(), new_id(), new_id());
    // A consumed earlier; then: B whose payload does not match its digest header, A with a
    // different payload, C, C with a different payload, and B intact.
    let mut forged = delivery(b, b"order-b", 2);
    forged.claimed_digest = Digest([7; 32]);
    let ds = vec![
        forged,
        delivery(a, b"order-a-altered", 3),
        delivery(c, b"order-c", 4),
        delivery(c, b"order-c-altered", 5),
        delivery(b, b"order-b", 6),
    ];
    let one_by_one = "quarantine-process";
    let batched = "quarantine-batch";
    for consumer in [one_by_one, batched] {
        let first = inbox::process(
            &mut pg,
            consumer,
            &delivery(a, b"order-a", 1),
            single_effect(consumer, a),
        )
        .await
        .unwrap();
        assert!(matches!(first, InboxOutcome::Applied { .. }));
    }
    let mut expected = Vec::new();
    for d in &ds {
        let o = inbox::process(
            &mut pg,
            one_by_one,
            d,
            single_effect(one_by_one, d.event_id),
        )
        .await
        .unwrap();
        expected.push(BatchOutcome::from(o));
    }
    let outcomes =
        inbox::process_batch(&mut pg, batched, &ds, batch_effect(batched, &ds, &["o"; 5]))
            .await
            .unwrap();
    let kind = |o: &BatchOutcome| match o {
        BatchOutcome::Applied { .. } => "applied",
        BatchOutcome::Duplicate { .. } => "duplicate",
        BatchOutcome::Quarantined => "quarantined",
        BatchOutcome::Failed { .. } => "failed",
    };
    let kinds: Vec<&str> = outcomes.iter().map(kind).collect();
    assert_eq!(
        kinds,
        [
            "quarantined",
            "quarantined",
            "applied",
            "quarantined",
            "applied"
        ]
    );
    assert_eq!(kinds, expected.iter().map(kind).collect::<Vec<_>>());
    let q = quarantined(&pg, batched).await;
    assert_eq!(q.len(), 3);
    let reasons: BTreeSet<(i64, &str)> = q.iter().map(|(_, s, r)| (*s, r.as_str())).collect();
    assert_eq!(
        reasons,
        BTreeSet::from([
            (2, "payload does not match its digest header"),
            (3, "a different payload under an event id already consumed"),
            (5, "a different payload under an event id already consumed"),
        ])
    );
    assert_eq!(
        q,
        quarantined(&pg, one_by_one).await,
        "the same rows as process"
    );
    assert_eq!(
        inbox_rows(&pg, batched).await,
        inbox_rows(&pg, one_by_one).await
    );
    assert_eq!(state(&pg, batched).await, (3, 3, 3));
    assert_eq!(state(&pg, one_by_one).await, (3, 3, 3));
    assert_eq!(watermark(&pg, batched).await, Some(6));
    assert_eq!(
        watermark(&pg, batched).await,
        watermark(&pg, one_by_one).await
    );
}

#[tokio::test]
async fn the_consumer_naks_a_failing_message_and_applies_it_once_when_it_can() {
    let (cfg, pg) = fresh("consumer").await;
    let nats = Nats::connect(
        &common::nats_url(),
        common::NATS_CLUSTER,
        Duration::from_secs(5),
    )
    .await
    .expect("NATS must be running");
    let topic = format!("CBATCH{}", runtime::owner_id() % 1_000_000);
    let _stream = teardown_nats::stream(&common::nats_url(), &topic);
    let n = 40u64;
    sealpost_cli::consume_bench::prefill(&cfg, &nats, &format!("r-{topic}"), &topic, n)
        .await
        .unwrap();
    let poison: uuid::Uuid = pg
        .query_one(
            "SELECT event_id FROM sealpost.outbox WHERE aggregate_id = 'o-7'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    pg.batch_execute("ALTER TABLE demo_fulfilment ADD CONSTRAINT no_o7 CHECK (order_id <> 'o-7')")
        .await
        .unwrap();
    let consumer = format!("batch-{topic}");
    let stop = CancellationToken::new();
    let applied = Arc::new(AtomicU64::new(0));
    let mut c = cfg.clone();
    c.consumer_ack_wait_ms = 30_000; // a redelivery within the test comes from the nak
    let task = tokio::spawn(sealpost_cli::consumer::run(
        c,
        nats.clone(),
        consumer.clone(),
        topic.clone(),
        stop.clone(),
        applied.clone(),
    ));
    let info = || async {
        let stream = nats.js.get_stream(&topic).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut jc: jetstream::consumer::PullConsumer = loop {
            // The consumer task creates the durable consumer.
            match stream.get_consumer(&consumer).await {
                Ok(jc) => break jc,
                Err(e) => assert!(Instant::now() < deadline, "no consumer: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        jc.info().await.unwrap().clone()
    };
    // Every other message applies and is acked; the poison is sent back again and again.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let i = info().await;
        let s = state(&pg, &consumer).await;
        if s == (n as i64 - 1, n as i64 - 1, n as i64 - 1)
            && i.num_pending == 0
            && i.num_ack_pending == 1
            && i.num_redelivered >= 1
        {
            break;
        }
        assert!(Instant::now() < deadline, "state {s:?}, consumer {i:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        !has_inbox_row(&pg, &consumer, poison).await,
        "the failing message holds no inbox row"
    );
    assert_eq!(applied.load(Ordering::Relaxed), n - 1);
    // The cause goes away: the next redelivery applies it, once.
    pg.batch_execute("ALTER TABLE demo_fulfilment DROP CONSTRAINT no_o7")
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let i = info().await;
        if i.num_ack_pending == 0 && i.num_pending == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "never drained: {i:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.cancel();
    task.await.unwrap().unwrap();
    assert_eq!(state(&pg, &consumer).await, (n as i64, n as i64, n as i64));
    assert!(has_inbox_row(&pg, &consumer, poison).await);
    assert_eq!(applied.load(Ordering::Relaxed), n);
    let _ = nats.js.delete_stream(&topic).await;
}
