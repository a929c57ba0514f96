//! Hostile producer strings against the real PostgreSQL and every broker (issue 20's
//! measurement: one CR/LF in an aggregate id kept its whole batch unknown for good).
//!
//! * `enqueue` and `enqueue_many` (and the sqlx flavour, `crates/sealpost/tests/sqlx.rs`)
//!   refuse each hostile string before
//!   anything is written, with an error naming the field and the rule; the ordinary events of
//!   the same transaction commit.
//! * A row that holds such a string anyway (written before the check existed, or by hand:
//!   here by an `UPDATE` of the sealed envelope) is refused by the adapter alone, counted
//!   toward the rejection limit and quarantined with the reason, while every ordinary event
//!   batched with it is published, on NATS JetStream, RabbitMQ and Kafka.
//!
//! Every test has its own database and its own stream, exchange or topic, removed at the end.

use crate::common;
use crate::teardown_kafka;
use crate::teardown_nats;
use crate::teardown_rabbitmq;

use common::count;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sealpost::runtime::CancellationToken;
use sealpost::runtime::{self, Config, Counters};
use sealpost::store::{self, StoreError};
use sealpost_core::envelope::{EventId, NewEvent, PartitionAlgorithm};
use sealpost_core::port::Broker;
use sealpost_core::wire::WireRule;

fn event<'a>(aggregate_id: &'a str, event_type: &'a str, tenant: &'a str) -> NewEvent<'a> {
    NewEvent {
        aggregate_type: "order",
        aggregate_id,
        aggregate_version: 1,
        event_type,
        payload_schema: "order.created.v1",
        payload: br#"{"order_id":"x"}"#,
        tenant,
        occurred_at_ms: 1,
        creating_txid: 0,
    }
}

fn new_id() -> EventId {
    EventId(*uuid::Uuid::now_v7().as_bytes())
}

/// The test's database (dropped when the guard drops, also when the test fails).
async fn fresh(tag: &str) -> (common::TestDb, tokio_postgres::Client) {
    let db = format!(
        "sealpost_hostile_{tag}_{}",
        runtime::owner_id() % 1_000_000_000
    );
    let cfg = common::fresh_database(&db).await;
    let pg = runtime::pg_connect(&cfg.database_url).await.unwrap();
    store::migrate(&pg).await.expect("migrate");
    (cfg, pg)
}

/// The hostile strings of the measurement, as (field, value, the rule `enqueue` names). The
/// NUL is here too: before the check PostgreSQL refused it with "invalid byte sequence".
fn hostile_cases() -> Vec<(&'static str, String, WireRule)> {
    vec![
        (
            "aggregate_id",
            "o-1\r\nX-Evil: 1".into(),
            WireRule::ControlCharacter { at: 3, code: 0x0d },
        ),
        (
            "event_type",
            "order.created\n".into(),
            WireRule::ControlCharacter { at: 13, code: 0x0a },
        ),
        (
            "aggregate_id",
            "o-\u{7}\u{1b}[31m".into(),
            WireRule::ControlCharacter { at: 2, code: 0x07 },
        ),
        (
            "routing_key",
            "k".repeat(300),
            WireRule::TooLong { len: 300, max: 255 },
        ),
        (
            "tenant",
            "t".repeat(64 * 1024),
            WireRule::TooLong {
                len: 65_536,
                max: 255,
            },
        ),
        ("aggregate_id", String::new(), WireRule::Empty),
        (
            "routing_key",
            "orders *.>".into(),
            WireRule::Whitespace { at: 6 },
        ),
        (
            "tenant",
            "t\0".into(),
            WireRule::ControlCharacter { at: 1, code: 0 },
        ),
    ]
}

/// Builds the event of one hostile case: the hostile value in its field, ordinary elsewhere.
fn hostile_event<'a>(field: &str, value: &'a str) -> (NewEvent<'a>, &'a str) {
    match field {
        "aggregate_id" => (event(value, "order.created.v1", "t-1"), "k"),
        "event_type" => (event("o-1", value, "t-1"), "k"),
        "tenant" => (event("o-1", "order.created.v1", value), "k"),
        "routing_key" => (event("o-1", "order.created.v1", "t-1"), value),
        other => unreachable!("{other}"),
    }
}

#[tokio::test]
async fn hostile_strings_are_refused_at_enqueue_with_the_field_and_nothing_is_written() {
    let (_cfg, mut pg) = fresh("enqueue").await;
    store::set_route(&pg, "orders", common::NATS_CLUSTER, "HOSTILE")
        .await
        .unwrap();
    let cases = hostile_cases();
    let tx = pg.transaction().await.unwrap();
    let mut ordinary = 0;
    for (field, value, rule) in &cases {
        // An ordinary event before and after each hostile one, in the same transaction.
        store::enqueue(
            &tx,
            "orders",
            new_id(),
            &event("o-ok", "order.created.v1", "t"),
            "k",
        )
        .await
        .unwrap();
        let (ev, key) = hostile_event(field, value);
        let e = store::enqueue(&tx, "orders", new_id(), &ev, key)
            .await
            .expect_err(field);
        match &e {
            StoreError::InvalidInput { index, source } => {
                assert_eq!(*index, 0);
                assert_eq!(source.field, *field);
                assert_eq!(&source.rule, rule, "{field}");
            }
            other => panic!("{field}: expected InvalidInput, got {other:?}"),
        }
        let m = e.to_string();
        assert!(m.contains(&format!("`{field}`")), "{m}");
        assert!(m.contains("nothing was written"), "{m}");
        store::enqueue(
            &tx,
            "orders",
            new_id(),
            &event("o-ok", "order.created.v1", "t"),
            "k",
        )
        .await
        .unwrap();
        ordinary += 2;
    }
    // A batch with one hostile event is refused whole, naming its position.
    let (bad, key) = hostile_event("aggregate_id", "o\n");
    let batch = vec![
        (
            new_id(),
            event("o-a", "order.created.v1", "t"),
            "k".to_string(),
        ),
        (new_id(), bad, key.to_string()),
    ];
    match store::enqueue_many(&tx, "orders", &batch).await {
        Err(StoreError::InvalidInput { index: 1, source }) => {
            assert_eq!(source.field, "aggregate_id")
        }
        other => panic!("expected InvalidInput at index 1, got {other:?}"),
    }
    // The transaction was never poisoned by a failed statement: it commits the rest.
    tx.commit().await.unwrap();
    assert_eq!(
        count(&pg, "SELECT count(*) FROM sealpost.envelope").await,
        ordinary
    );
    assert_eq!(
        count(
            &pg,
            "SELECT count(*) FROM sealpost.outbox WHERE state = 'PENDING'"
        )
        .await,
        ordinary
    );
}

/// What the tests below write into a sealed envelope behind `enqueue`'s back: (column, value).
/// A NUL cannot be stored in PostgreSQL `text` at all, so it has no row here; an empty
/// aggregate id is refused at enqueue but can be carried, so it has none either.
fn tampered() -> Vec<(&'static str, String)> {
    vec![
        ("aggregate_id", "o-1\r\nX-Evil: 1".into()),
        ("event_type", "order.created\n".into()),
        ("aggregate_id", "o-\u{7}\u{1b}[31m".into()),
        ("dest_routing_key", "k".repeat(300)),
        ("tenant", "t".repeat(64 * 1024)),
        ("dest_routing_key", "orders *.>".into()),
        ("tenant", "t\u{7f}".into()),
    ]
}

/// Enqueues ordinary events two by two, then makes the second of each pair hostile in the
/// envelope table; returns (ordinary ids, hostile ids), interleaved in commit order.
async fn interleaved(pg: &mut tokio_postgres::Client) -> (Vec<EventId>, Vec<EventId>) {
    let (mut good, mut bad) = (Vec::new(), Vec::new());
    let tx = pg.transaction().await.unwrap();
    for i in 0..tampered().len() {
        for list in [&mut good, &mut bad] {
            let id = new_id();
            let agg = format!("o-{i}-{}", list.len());
            store::enqueue(
                &tx,
                "orders",
                id,
                &event(&agg, "order.created.v1", "t"),
                &agg,
            )
            .await
            .unwrap();
            list.push(id);
        }
    }
    for ((column, value), id) in tampered().iter().zip(&bad) {
        tx.execute(
            &format!("UPDATE sealpost.envelope SET {column} = $1 WHERE event_id = $2"),
            &[value, &uuid::Uuid::from_bytes(id.0)],
        )
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    (good, bad)
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

/// Runs one dispatcher over `broker` until every ordinary event is `PUBLISHED` and every
/// hostile one `QUARANTINED`, then checks the reasons and the counters.
async fn every_neighbour_publishes<B: Broker>(
    cfg: &Config,
    pg: &mut tokio_postgres::Client,
    broker: B,
) {
    let (good, bad) = interleaved(pg).await;
    let mut cfg = cfg.clone();
    cfg.rejection_limit = 2;
    // One batch holds every row: each hostile row sits among ordinary ones.
    cfg.batch_size_max = 64;
    let stop = CancellationToken::new();
    let counters = Arc::new(Counters::default());
    let tasks = runtime::spawn_fleet(
        &cfg,
        &common::pg_source(&cfg),
        &Arc::new(broker),
        1,
        false,
        &stop,
        &counters,
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut done = true;
        for id in &good {
            done &= state_of(pg, *id).await == "PUBLISHED";
        }
        for id in &bad {
            done &= state_of(pg, *id).await == "QUARANTINED";
        }
        if done {
            break;
        }
        if Instant::now() > deadline {
            let states = pg
                .query(
                    "SELECT state, count(*)::int8 FROM sealpost.outbox GROUP BY 1 ORDER BY 1",
                    &[],
                )
                .await
                .unwrap()
                .iter()
                .map(|r| format!("{} {}", r.get::<_, String>(0), r.get::<_, i64>(1)))
                .collect::<Vec<_>>();
            panic!("not converged in 60 s: {states:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.cancel();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    // Each hostile row was refused exactly up to its limit, alone; no ordinary row was ever
    // refused, and nothing was left unknown.
    assert_eq!(
        counters.refused.load(Ordering::Relaxed),
        2 * bad.len() as u64
    );
    assert_eq!(
        count(
            pg,
            "SELECT count(*) FROM sealpost.work WHERE state = 'DISPATCH_UNKNOWN'"
        )
        .await,
        0
    );
    let status = store::status(pg).await.unwrap();
    assert_eq!(status.quarantined_rows.len(), bad.len());
    let fields = [
        "`aggregate_id` contains the control character U+000D",
        "`event_type` contains the control character U+000A",
        "`aggregate_id` contains the control character U+0007",
        "`routing_key` is 300 bytes",
        "`tenant` is 65536 bytes",
        "`routing_key` contains whitespace",
        "`tenant` contains the control character U+007F",
    ];
    for (id, want) in bad.iter().zip(fields) {
        let (_, why) = status
            .quarantined_rows
            .iter()
            .find(|(q, _)| *q == id.to_string())
            .expect("every hostile row is quarantined");
        assert!(why.contains("Unencodable"), "{why}");
        assert!(why.contains(want), "{want}: {why}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unencodable_row_is_quarantined_alone_on_nats() {
    let (cfg, mut pg) = fresh("nats").await;
    let topic = format!("HOSTILE{}", runtime::owner_id() % 1_000_000_000);
    let nats = sealpost_nats::Nats::connect(
        &common::nats_url(),
        common::NATS_CLUSTER,
        Duration::from_millis(cfg.ack_timeout_ms),
    )
    .await
    .expect("NATS must be running");
    let _stream = teardown_nats::stream(&common::nats_url(), &topic);
    nats.ensure_stream(&topic).await.unwrap();
    store::set_route(&pg, "orders", common::NATS_CLUSTER, &topic)
        .await
        .unwrap();
    every_neighbour_publishes(&cfg, &mut pg, nats.clone()).await;
    let mut s = nats.js.get_stream(&topic).await.unwrap();
    assert_eq!(
        s.info().await.unwrap().state.messages,
        tampered().len() as u64,
        "the ordinary events and nothing else are at the broker"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unencodable_row_is_quarantined_alone_on_rabbitmq() {
    let (cfg, mut pg) = fresh("rabbitmq").await;
    let topic = format!("sp-hostile-{}", runtime::owner_id() % 1_000_000_000);
    let rabbit = sealpost_rabbitmq::Rabbit::connect(
        &common::rabbitmq_url(),
        common::RABBITMQ_CLUSTER,
        Duration::from_secs(5),
        "sealpost-test-hostile",
    )
    .await
    .expect("RabbitMQ must be running at 127.0.0.1:5672 (guest/guest)");
    let consumers = vec!["c1".to_string()];
    let _destination = teardown_rabbitmq::destination(&common::rabbitmq_url(), &topic, &consumers);
    rabbit.ensure_destination(&topic, &consumers).await.unwrap();
    store::set_route(&pg, "orders", common::RABBITMQ_CLUSTER, &topic)
        .await
        .unwrap();
    every_neighbour_publishes(&cfg, &mut pg, rabbit.clone()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unencodable_row_is_quarantined_alone_on_kafka() {
    let (cfg, mut pg) = fresh("kafka").await;
    let topic = format!("sp-test-hostile-{}", runtime::owner_id() % 1_000_000_000);
    let kcfg = teardown_kafka::config(
        &common::kafka_brokers(),
        common::KAFKA_CLUSTER,
        &common::kafka_client_properties(),
    );
    let _topic = teardown_kafka::topic(&kcfg, &topic);
    let kafka = sealpost_kafka::Kafka::connect(kcfg)
        .await
        .expect("a Kafka-protocol broker must listen on 127.0.0.1:9092 (.ci/run starts tansu)");
    kafka.ensure_topic(&topic, 2).await.unwrap();
    store::set_route(&pg, "orders", common::KAFKA_CLUSTER, &topic)
        .await
        .unwrap();
    store::set_route_partitions(
        &pg,
        "orders",
        PartitionAlgorithm::KafkaMurmur2 { partitions: 2 },
    )
    .await
    .unwrap();
    every_neighbour_publishes(&cfg, &mut pg, kafka.clone()).await;
}
