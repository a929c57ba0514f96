//! The consumer inbox against the real PostgreSQL and NATS JetStream: reordered and
//! duplicated deliveries (F8), a consumer that commits and then loses its ack (F9), and a
//! different payload under a known event id. Each asserts zero duplicate effects and zero
//! lost events.

use crate::common;
use crate::teardown_nats;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sealpost::inbox::{self, Delivery, Effect, InboxOutcome};
use sealpost::runtime;
use sealpost::runtime::CancellationToken;
use sealpost::store;
use sealpost_core::envelope::{EventId, PAYLOAD_DOMAIN};
use sealpost_core::port::{Broker, SendResult};
use sealpost_core::Digest;
use sealpost_nats::Nats;

static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Sends through the broker port as a dispatcher does, with a deadline far enough away that
/// the test decides when a send happens (a "delayed request" is one sent late).
async fn send(nats: &Nats, outgoing: &[store::Outgoing]) -> Vec<SendResult> {
    let batch = outgoing.iter().map(store::Outgoing::send_request).collect();
    nats.send_batch(batch, std::time::Instant::now() + Duration::from_secs(60))
        .await
}

/// A database of the test's own (`sealpost_consumers_<tag>`), migrated, with the demo's
/// consumer tables.
async fn pg(tag: &str) -> (tokio_postgres::Client, common::TestDb) {
    let cfg = common::fresh_database(&format!("sealpost_consumers_{tag}")).await;
    let pg = runtime::pg_connect(&cfg.database_url)
        .await
        .expect("PostgreSQL must be running");
    store::migrate(&pg).await.unwrap();
    sealpost_cli::demo::prepare(&pg).await.unwrap();
    (pg, cfg)
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

fn effect(consumer: &str, id: EventId) -> Effect<'static> {
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

async fn effects(pg: &tokio_postgres::Client, consumer: &str) -> (i64, i64) {
    let r = pg
        .query_one(
            "SELECT count(*), count(DISTINCT event_id) FROM demo_fulfilment WHERE consumer_id = $1",
            &[&consumer],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1))
}

#[tokio::test]
async fn reordered_and_duplicated_deliveries_apply_once() {
    let _g = LOCK.lock().await;
    let (mut pg, _db) = pg("reorder").await;
    let consumer = format!("f8-{}", runtime::owner_id());
    let ids: Vec<EventId> = (0..50)
        .map(|_| EventId(*uuid::Uuid::now_v7().as_bytes()))
        .collect();
    // Every event delivered three times, in a scrambled order.
    let mut order: Vec<usize> = (0..150).map(|i| (i * 37) % 50).collect();
    order.reverse();
    let mut first_receipt = std::collections::HashMap::new();
    let mut applied = 0;
    for (n, i) in order.into_iter().enumerate() {
        let payload = format!("order-{i}");
        let d = delivery(ids[i], payload.as_bytes(), n as u64 + 1);
        match inbox::process(&mut pg, &consumer, &d, effect(&consumer, ids[i]))
            .await
            .unwrap()
        {
            InboxOutcome::Applied { receipt_id } => {
                applied += 1;
                assert!(
                    first_receipt.insert(i, receipt_id).is_none(),
                    "applied twice"
                );
            }
            InboxOutcome::Duplicate { receipt_id } => {
                assert_eq!(
                    Some(&receipt_id),
                    first_receipt.get(&i),
                    "the original receipt is returned"
                );
            }
            InboxOutcome::Quarantined => panic!("nothing here should be quarantined"),
        }
    }
    assert_eq!(applied, 50);
    assert_eq!(
        effects(&pg, &consumer).await,
        (50, 50),
        "zero duplicate effects, zero lost events"
    );
}

#[tokio::test]
async fn different_payload_under_a_known_event_id_is_quarantined() {
    let _g = LOCK.lock().await;
    let (mut pg, _db) = pg("quarantine").await;
    let consumer = format!("q-{}", runtime::owner_id());
    let id = EventId(*uuid::Uuid::now_v7().as_bytes());
    let ok = inbox::process(
        &mut pg,
        &consumer,
        &delivery(id, b"v1", 1),
        effect(&consumer, id),
    )
    .await
    .unwrap();
    assert!(matches!(ok, InboxOutcome::Applied { .. }));
    let other = inbox::process(
        &mut pg,
        &consumer,
        &delivery(id, b"v2", 2),
        effect(&consumer, id),
    )
    .await
    .unwrap();
    assert_eq!(other, InboxOutcome::Quarantined);
    // A payload that does not match its own digest header is refused before the inbox.
    let id2 = EventId(*uuid::Uuid::now_v7().as_bytes());
    let mut bad = delivery(id2, b"x", 3);
    bad.claimed_digest = Digest([1; 32]);
    assert_eq!(
        inbox::process(&mut pg, &consumer, &bad, effect(&consumer, id2))
            .await
            .unwrap(),
        InboxOutcome::Quarantined
    );
    assert_eq!(effects(&pg, &consumer).await, (1, 1));
    let q: i64 = pg
        .query_one(
            "SELECT count(*) FROM sealpost.inbox_quarantine WHERE consumer_id = $1",
            &[&consumer],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(q, 2);
}

#[tokio::test]
async fn consumer_commits_then_loses_its_ack_and_redelivery_has_no_second_effect() {
    let _g = LOCK.lock().await;
    let (mut pg, cfg) = pg("lostack").await;
    let topic = format!("C{}", runtime::owner_id() % 1_000_000);
    let route = format!("r-{topic}");
    store::set_route(&pg, &route, common::NATS_CLUSTER, &topic)
        .await
        .unwrap();
    let nats = Nats::connect(
        &common::nats_url(),
        common::NATS_CLUSTER,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    let _stream = teardown_nats::stream(&common::nats_url(), &topic);
    nats.ensure_stream(&topic).await.unwrap();
    // Publish 20 events through the real path.
    let n = 20;
    let tx = pg.transaction().await.unwrap();
    let keys: Vec<String> = (0..n).map(|i| format!("o-{i}")).collect();
    let events = sealpost_cli::demo::order_batch(&keys, br#"{"order_id":"x"}"#);
    store::enqueue_many(&tx, &route, &events).await.unwrap();
    tx.commit().await.unwrap();
    let mut claimed = Vec::new();
    while claimed.len() < n {
        let b = store::claim_batch(&mut pg, 5, 100, 10_000).await.unwrap();
        claimed.extend(
            b.outgoing
                .into_iter()
                .filter(|o| o.destination.topic == topic),
        );
    }
    let receipts: Vec<_> = send(&nats, &claimed)
        .await
        .into_iter()
        .map(|r| match r {
            SendResult::Receipt(r) => r,
            other => panic!("{other:?}"),
        })
        .collect();
    store::accept_receipts(&mut pg, &receipts).await.unwrap();

    // F9: the consumer commits every effect but never acks; the broker redelivers after
    // ack_wait to a second, healthy incarnation of the same durable consumer.
    let consumer = format!("f9-{topic}");
    let mut lossy = cfg.clone();
    lossy.consumer_ack_wait_ms = 1_000;
    lossy.drill_skip_consumer_ack = true;
    let stop = CancellationToken::new();
    let applied = Arc::new(AtomicU64::new(0));
    let t = tokio::spawn(sealpost_cli::consumer::run(
        lossy.clone(),
        nats.clone(),
        consumer.clone(),
        topic.clone(),
        stop.clone(),
        applied.clone(),
    ));
    let deadline = Instant::now() + Duration::from_secs(30);
    while effects(&pg, &consumer).await.0 < n as i64 {
        assert!(
            Instant::now() < deadline,
            "first incarnation never applied everything"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.cancel();
    t.await.unwrap().unwrap();
    let mut healthy = lossy.clone();
    healthy.drill_skip_consumer_ack = false;
    let stop2 = CancellationToken::new();
    let t2 = tokio::spawn(sealpost_cli::consumer::run(
        healthy,
        nats.clone(),
        consumer.clone(),
        topic.clone(),
        stop2.clone(),
        applied.clone(),
    ));
    // Wait until the broker has no unacked messages for this consumer.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut stream = nats.js.get_stream(&topic).await.unwrap();
        let mut c: async_nats::jetstream::consumer::PullConsumer =
            stream.get_consumer(&consumer).await.unwrap();
        let info = c.info().await.unwrap();
        if info.num_ack_pending == 0
            && info.num_pending == 0
            && info.delivered.stream_sequence >= n as u64
        {
            assert!(
                info.delivered.consumer_sequence >= 2 * n as u64,
                "every message must have been redelivered at least once: {info:?}"
            );
            break;
        }
        let _ = &mut stream;
        assert!(
            Instant::now() < deadline,
            "redeliveries never drained: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop2.cancel();
    t2.await.unwrap().unwrap();
    assert_eq!(
        effects(&pg, &consumer).await,
        (n as i64, n as i64),
        "zero duplicate effects after redelivery"
    );
    assert_eq!(
        applied.load(Ordering::Relaxed),
        n as u64,
        "the second incarnation applied nothing new"
    );
    let inbox_rows: i64 = pg
        .query_one(
            "SELECT count(*) FROM sealpost.inbox WHERE consumer_id = $1",
            &[&consumer],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(inbox_rows, n as i64);
}
