//! Seed 003's consumer drills (R35) against the real PostgreSQL and NATS JetStream, through
//! the example consumer `sealpost consume` runs (`sealpost_cli::consumer::run`): a
//! downstream that hangs past the effect's time limit, a permanent bad message (and one
//! whose headers do not parse), and a hot key taking 80% of the traffic. Each ends with
//! nothing lost (every published event is applied or recorded in
//! `sealpost.inbox_quarantine`), nothing applied twice (the effect rows are counted) and the
//! evidence queryable in SQL. Every test has its own database and its own stream.

use crate::common;
use crate::teardown_nats;

use common::count;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sealpost::runtime::CancellationToken;
use sealpost::runtime::{self, Config, Counters};
use sealpost::store;
use sealpost_nats::async_nats::jetstream;
use sealpost_nats::Nats;

const ADMIN_URL: &str = "host=127.0.0.1 user=postgres dbname=postgres";

/// A fresh database `sealpost_drill_<tag>_<n>` with the schema and the demo tables, a config
/// pointing at it, and a stream name of its own.
async fn fresh(tag: &str) -> (common::TestDb, tokio_postgres::Client, String, String) {
    let n = runtime::owner_id() % 1_000_000;
    let db = format!("sealpost_drill_{tag}_{n}");
    let cfg = common::fresh_database(&db).await;
    let pg = runtime::pg_connect(&cfg.database_url).await.unwrap();
    store::migrate(&pg).await.expect("migrate");
    sealpost_cli::demo::prepare(&pg).await.unwrap();
    let topic = format!("DRILL{}{n}", tag.to_uppercase());
    (cfg, pg, db, topic)
}

async fn drop_db(db: &str) {
    let admin = runtime::pg_connect(ADMIN_URL).await.unwrap();
    admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .await
        .unwrap();
}

/// Enqueues one event per aggregate id in `keys` (payload `{"order_id": key}`) and runs
/// dispatchers until every one is published.
async fn publish(cfg: &Config, nats: &Nats, topic: &str, keys: &[String]) {
    let mut pg = runtime::pg_connect(&cfg.database_url).await.unwrap();
    let route = format!("r-{topic}");
    store::set_route(&pg, &route, common::NATS_CLUSTER, topic)
        .await
        .unwrap();
    nats.ensure_stream(topic).await.unwrap();
    let payloads: Vec<String> = keys
        .iter()
        .map(|k| format!(r#"{{"order_id":"{k}"}}"#))
        .collect();
    let batch: Vec<_> = keys
        .iter()
        .zip(&payloads)
        .map(|(k, p)| {
            (
                sealpost_cli::demo::mint_event_id(),
                sealpost_cli::demo::order_created(k, p.as_bytes()),
                k.clone(),
            )
        })
        .collect();
    let tx = pg.transaction().await.unwrap();
    store::enqueue_many(&tx, &route, &batch).await.unwrap();
    tx.commit().await.unwrap();
    let stop = CancellationToken::new();
    let counters = Arc::new(Counters::default());
    let tasks = runtime::spawn_fleet(
        cfg,
        &common::pg_source(cfg),
        &Arc::new(nats.clone()),
        2,
        true,
        &stop,
        &counters,
    );
    wait_for("publication", Duration::from_secs(60), async || {
        count(
            &pg,
            "SELECT count(*) FROM sealpost.outbox WHERE state <> 'PUBLISHED'",
        )
        .await
            == 0
    })
    .await;
    stop.cancel();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
}

async fn wait_for(what: &str, limit: Duration, mut f: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The durable consumer's state at the broker (the consumer task creates it).
async fn broker_view(nats: &Nats, topic: &str, consumer: &str) -> jetstream::consumer::Info {
    let stream = nats.js.get_stream(topic).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut jc: jetstream::consumer::PullConsumer = loop {
        match stream.get_consumer(consumer).await {
            Ok(jc) => break jc,
            Err(e) => assert!(Instant::now() < deadline, "no consumer: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    jc.info().await.unwrap().clone()
}

/// The three closing checks of every drill. Nothing lost: every published event has an
/// inbox receipt or a dead letter of this consumer. Nothing twice: one effect row per
/// applied event. Returns (applied, dead-lettered).
async fn nothing_lost_nothing_twice(pg: &tokio_postgres::Client, consumer: &str) -> (i64, i64) {
    let lost: Vec<String> = pg
        .query(
            "SELECT o.event_id::text FROM sealpost.outbox o
             WHERE NOT EXISTS (SELECT 1 FROM sealpost.inbox i
                               WHERE i.consumer_id = $1 AND i.event_id = o.event_id)
               AND NOT EXISTS (SELECT 1 FROM sealpost.inbox_quarantine q
                               WHERE q.consumer_id = $1 AND q.event_id = o.event_id)",
            &[&consumer],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(
        lost.is_empty(),
        "events neither applied nor dead-lettered: {lost:?}"
    );
    let r = pg
        .query_one(
            "SELECT (SELECT count(*) FROM demo_fulfilment WHERE consumer_id = $1),
                    (SELECT count(DISTINCT event_id) FROM demo_fulfilment WHERE consumer_id = $1),
                    (SELECT count(*) FROM sealpost.inbox WHERE consumer_id = $1),
                    (SELECT count(*) FROM sealpost.inbox_quarantine
                      WHERE consumer_id = $1 AND event_id IS NOT NULL)",
            &[&consumer],
        )
        .await
        .unwrap();
    let (effects, distinct, inbox, dead): (i64, i64, i64, i64) =
        (r.get(0), r.get(1), r.get(2), r.get(3));
    assert_eq!(effects, distinct, "an event applied twice");
    assert_eq!(effects, inbox, "every effect has its receipt and no more");
    (effects, dead)
}

fn spawn_consumer(
    cfg: &Config,
    nats: &Nats,
    consumer: &str,
    topic: &str,
    stop: &CancellationToken,
) -> tokio::task::JoinHandle<Result<(), runtime::RunError>> {
    tokio::spawn(sealpost_cli::consumer::run(
        cfg.clone(),
        nats.clone(),
        consumer.to_string(),
        topic.to_string(),
        stop.clone(),
        Arc::new(AtomicU64::new(0)),
    ))
}

#[tokio::test]
async fn downstream_timeout_rolls_back_retries_later_and_applies_once() {
    let (mut cfg, pg, db, topic) = fresh("timeout").await;
    let _stream = teardown_nats::stream(&common::nats_url(), &topic);
    let nats = Nats::connect(
        &common::nats_url(),
        common::NATS_CLUSTER,
        Duration::from_secs(5),
    )
    .await
    .expect("NATS must be running");
    let n = 30;
    let keys: Vec<String> = (0..n).map(|i| format!("o-{i}")).collect();
    publish(&cfg, &nats, &topic, &keys).await;
    // The downstream: the effect of o-7 waits for a row another session holds.
    pg.batch_execute(
        "CREATE TABLE downstream (k text PRIMARY KEY);
         INSERT INTO downstream VALUES ('o-7');
         CREATE FUNCTION call_downstream() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             PERFORM 1 FROM downstream WHERE k = NEW.order_id FOR UPDATE;
             RETURN NEW;
         END $$;
         CREATE TRIGGER call_downstream BEFORE INSERT ON demo_fulfilment
             FOR EACH ROW EXECUTE FUNCTION call_downstream();",
    )
    .await
    .unwrap();
    let mut holder = runtime::pg_connect(&cfg.database_url).await.unwrap();
    let hang = holder.transaction().await.unwrap();
    hang.execute("SELECT 1 FROM downstream WHERE k = 'o-7' FOR UPDATE", &[])
        .await
        .unwrap();
    cfg.consumer_effect_timeout_ms = 300;
    cfg.consumer_max_deliveries = 1_000; // the timeout drill must not dead-letter
    cfg.consumer_ack_wait_ms = 30_000; // redeliveries within the test come from the naks
    let consumer = format!("t-{topic}");
    let stop = CancellationToken::new();
    let task = spawn_consumer(&cfg, &nats, &consumer, &topic, &stop);
    // Everything else applies; o-7 times out, is rolled back and comes back, again and again.
    wait_for(
        "the others applied and o-7 retried",
        Duration::from_secs(60),
        async || {
            let i = broker_view(&nats, &topic, &consumer).await;
            count(&pg, "SELECT count(*) FROM demo_fulfilment").await == n as i64 - 1
                && i.num_ack_pending == 1
                && i.num_redelivered >= 1
        },
    )
    .await;
    assert_eq!(
        count(
            &pg,
            "SELECT count(*) FROM sealpost.inbox i JOIN sealpost.outbox o USING (event_id)
             WHERE o.aggregate_id = 'o-7'"
        )
        .await,
        0,
        "the hanging effect was rolled back with its inbox row"
    );
    // The downstream recovers: the next delivery applies o-7, once.
    hang.commit().await.unwrap();
    wait_for("o-7 applied", Duration::from_secs(60), async || {
        let i = broker_view(&nats, &topic, &consumer).await;
        i.num_ack_pending == 0 && i.num_pending == 0
    })
    .await;
    stop.cancel();
    task.await.unwrap().unwrap();
    let (applied, dead) = nothing_lost_nothing_twice(&pg, &consumer).await;
    assert_eq!((applied, dead), (n as i64, 0));
    let _ = nats.js.delete_stream(&topic).await;
    drop((pg, holder));
    drop_db(&db).await;
}

#[tokio::test]
async fn a_permanent_bad_message_is_dead_lettered_after_max_deliveries_and_the_rest_apply_once() {
    let (mut cfg, pg, db, topic) = fresh("poison").await;
    let _stream = teardown_nats::stream(&common::nats_url(), &topic);
    let nats = Nats::connect(
        &common::nats_url(),
        common::NATS_CLUSTER,
        Duration::from_secs(5),
    )
    .await
    .expect("NATS must be running");
    let n = 40;
    let keys: Vec<String> = (0..n).map(|i| format!("o-{i}")).collect();
    publish(&cfg, &nats, &topic, &keys).await;
    // A message no header parser can read: recorded, never dropped silently.
    nats.js
        .publish(format!("sp.{topic}.junk"), "not a sealpost message".into())
        .await
        .unwrap()
        .await
        .unwrap();
    // The effect of o-7 always fails.
    pg.batch_execute("ALTER TABLE demo_fulfilment ADD CONSTRAINT no_o7 CHECK (order_id <> 'o-7')")
        .await
        .unwrap();
    cfg.consumer_max_deliveries = 3;
    cfg.consumer_ack_wait_ms = 30_000;
    cfg.consumer_progress_every_ms = 200;
    let consumer = format!("p-{topic}");
    let stop = CancellationToken::new();
    let task = spawn_consumer(&cfg, &nats, &consumer, &topic, &stop);
    // The consumer moves on: nothing pending, nothing waiting for an ack.
    wait_for("the stream consumed", Duration::from_secs(60), async || {
        let i = broker_view(&nats, &topic, &consumer).await;
        i.num_ack_pending == 0 && i.num_pending == 0
    })
    .await;
    // The reported watermark passes the dead letters (the broker's ack floor).
    wait_for("the watermark reported", Duration::from_secs(10), async || {
        pg.query_opt(
            "SELECT watermark FROM sealpost.consumer_progress WHERE consumer_id = $1 AND stream = $2",
            &[&consumer, &topic],
        )
        .await
        .unwrap()
        .is_some_and(|r| r.get::<_, i64>(0) == n as i64 + 1)
    })
    .await;
    stop.cancel();
    task.await.unwrap().unwrap();
    let (applied, dead) = nothing_lost_nothing_twice(&pg, &consumer).await;
    assert_eq!((applied, dead), (n as i64 - 1, 1));
    // The evidence, in SQL: which event, where it sits at the broker, why, how often.
    let r = pg
        .query_one(
            "SELECT o.aggregate_id, q.stream, q.sequence = o.primary_sequence, q.delivered, q.reason,
                    q.payload = o.payload
             FROM sealpost.inbox_quarantine q JOIN sealpost.outbox o USING (event_id)
             WHERE q.consumer_id = $1 AND q.kind = 'dead_letter'",
            &[&consumer],
        )
        .await
        .unwrap();
    assert_eq!(r.get::<_, String>(0), "o-7");
    assert_eq!(r.get::<_, String>(1), topic);
    assert!(
        r.get::<_, bool>(2),
        "the dead letter holds the broker position"
    );
    assert_eq!(r.get::<_, i32>(3), 3, "dead-lettered at the third delivery");
    let reason: String = r.get(4);
    assert!(
        reason.contains("no_o7") && reason.contains("23514"),
        "the database's own words: {reason}"
    );
    assert!(r.get::<_, bool>(5), "the payload is kept for the operator");
    let junk = pg
        .query_one(
            "SELECT kind, reason, event_id IS NULL, subject, payload FROM sealpost.inbox_quarantine
             WHERE consumer_id = $1 AND kind = 'unreadable'",
            &[&consumer],
        )
        .await
        .unwrap();
    assert!(
        junk.get::<_, String>(1).contains("no headers"),
        "{:?}",
        junk.get::<_, String>(1)
    );
    assert!(junk.get::<_, bool>(2));
    assert_eq!(junk.get::<_, String>(3), format!("sp.{topic}.junk"));
    assert_eq!(junk.get::<_, Vec<u8>>(4), b"not a sealpost message");
    assert_eq!(
        count(&pg, "SELECT count(*) FROM sealpost.inbox_quarantine").await,
        2,
        "each recorded once"
    );
    let _ = nats.js.delete_stream(&topic).await;
    drop(pg);
    drop_db(&db).await;
}

#[tokio::test]
async fn a_hot_key_with_most_of_the_traffic_is_applied_exactly_once() {
    let (mut cfg, pg, db, topic) = fresh("hot").await;
    let _stream = teardown_nats::stream(&common::nats_url(), &topic);
    let nats = Nats::connect(
        &common::nats_url(),
        common::NATS_CLUSTER,
        Duration::from_secs(5),
    )
    .await
    .expect("NATS must be running");
    let n = 1_000;
    // 80% of the events on one aggregate.
    let keys: Vec<String> = (0..n)
        .map(|i| {
            if i % 5 == 0 {
                format!("o-{i}")
            } else {
                "o-hot".into()
            }
        })
        .collect();
    let hot = keys.iter().filter(|k| *k == "o-hot").count() as i64;
    publish(&cfg, &nats, &topic, &keys).await;
    // The effect also counts per aggregate: every batch of both instances locks the hot row.
    pg.batch_execute(
        "CREATE TABLE per_order (order_id text PRIMARY KEY, n bigint NOT NULL);
         CREATE FUNCTION count_order() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             INSERT INTO per_order VALUES (NEW.order_id, 1)
             ON CONFLICT (order_id) DO UPDATE SET n = per_order.n + 1;
             RETURN NEW;
         END $$;
         CREATE TRIGGER count_order AFTER INSERT ON demo_fulfilment
             FOR EACH ROW EXECUTE FUNCTION count_order();",
    )
    .await
    .unwrap();
    cfg.consumer_ack_wait_ms = 2_000; // slow batches are redelivered to the other instance
    let consumer = format!("h-{topic}");
    let stop = CancellationToken::new();
    // Two instances of the same consumer share the durable consumer and the inbox.
    let tasks = [
        spawn_consumer(&cfg, &nats, &consumer, &topic, &stop),
        spawn_consumer(&cfg, &nats, &consumer, &topic, &stop),
    ];
    wait_for(
        "the stream consumed",
        Duration::from_secs(120),
        async || {
            let i = broker_view(&nats, &topic, &consumer).await;
            i.num_ack_pending == 0 && i.num_pending == 0
        },
    )
    .await;
    stop.cancel();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let (applied, dead) = nothing_lost_nothing_twice(&pg, &consumer).await;
    assert_eq!((applied, dead), (n as i64, 0));
    let hot_effects: i64 = pg
        .query_one("SELECT n FROM per_order WHERE order_id = 'o-hot'", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        hot_effects, hot,
        "the hot aggregate's events, each counted once"
    );
    assert_eq!(
        count(&pg, "SELECT sum(n)::bigint FROM per_order").await,
        n as i64
    );
    let _ = nats.js.delete_stream(&topic).await;
    drop(pg);
    drop_db(&db).await;
}
