//! The library consumer (`sealpost::consumer::run`) with a user handler, on each broker
//! (NATS JetStream, RabbitMQ, Kafka): a published backlog is applied exactly once through
//! the handler (one row per event in the handler's own table, written in the inbox
//! transaction, with the event's envelope and idempotency key), the consumer's watermark is
//! reported to the outbox database, and `sealpost purge --consumer C` then purges every row
//! without `--no-consumers`. The permanent-bad-message drill on each broker: the handler of
//! one event always fails; it is sent back with the core's delay, dead-lettered at its third
//! delivery with the database's words, the rest applied once, and the watermark passes it.
//! The hot-key drill on each broker: 80% of the events on one aggregate, two instances of one
//! consumer, each event applied once. The downstream-timeout drill on each broker: the handler of one event hangs past the time
//! limit, is rolled back alone and retried, and applies once when the downstream recovers.
//! The example binaries (`examples/consume_{nats,rabbitmq,kafka}.rs`) run as a service
//! would run them: each applies a backlog once with its handler, reports its watermark, the
//! real `sealpost purge --consumer C` then purges every row, and SIGINT stops it cleanly.
//! Each test has its own database and destination.

use common::wait_for;
use std::time::{Duration, Instant};

use crate::common;
use crate::teardown_kafka;
use crate::teardown_nats;
use crate::teardown_rabbitmq;

use futures::future::BoxFuture;
use sealpost::consumer::{self, CancellationToken, Databases, Delivery, HandlerError, Options};
use sealpost::runtime;
use sealpost::store::{self, Accepted};
use sealpost_cli::ops;
use sealpost_core::port::{Broker, SendResult};
use sealpost_core::subscription::Subscription;
use sealpost_core::ReceiptVerdict;

const ADMIN_URL: &str = "host=127.0.0.1 user=postgres dbname=postgres";

/// A fresh database `sealpost_api_<tag>` with the schema and the handler's table, dropped
/// when the returned guard drops (also when the test fails).
async fn fresh_db(tag: &str) -> (String, tokio_postgres::Client, impl Sized) {
    let db = format!("sealpost_api_{tag}");
    let guard = common::drop_database_guard(&db);
    let admin = runtime::pg_connect(ADMIN_URL)
        .await
        .expect("PostgreSQL must be running");
    admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .await
        .unwrap();
    admin
        .batch_execute(&format!("CREATE DATABASE {db}"))
        .await
        .expect("create the test database");
    let url = format!("host=127.0.0.1 user=postgres dbname={db}");
    let pg = runtime::pg_connect(&url).await.unwrap();
    store::migrate(&pg).await.expect("migrate");
    pg.batch_execute(
        "CREATE TABLE api_applied (event_id uuid NOT NULL, event_type text, aggregate_id text,
             idempotency_key text NOT NULL)",
    )
    .await
    .unwrap();
    (url, pg, guard)
}

/// The user's handler: one row per event, in the inbox transaction.
fn record<'a>(
    tx: &'a tokio_postgres::Transaction<'a>,
    d: &'a Delivery,
) -> BoxFuture<'a, Result<(), HandlerError>> {
    Box::pin(async move {
        let e = d.envelope.as_ref();
        tx.execute(
            "INSERT INTO api_applied (event_id, event_type, aggregate_id, idempotency_key)
             VALUES ($1, $2, $3, $4)",
            &[
                &uuid::Uuid::from_bytes(d.event_id.0),
                &e.map(|e| e.event_type.clone()),
                &e.map(|e| e.aggregate_id.clone()),
                &d.idempotency_key,
            ],
        )
        .await?;
        Ok(())
    })
}

/// Enqueues `n` events on `route` and publishes them all through `broker` as a dispatcher
/// does (claim, send, accept); returns the receipts.
async fn publish<B: Broker>(
    pg: &mut tokio_postgres::Client,
    broker: &B,
    route: &str,
    n: usize,
    hot: bool,
) -> Vec<sealpost_core::Receipt> {
    let keys: Vec<String> = (0..n)
        .map(|i| {
            if hot && i % 5 != 0 {
                "o-hot".to_string()
            } else {
                format!("o-{i}")
            }
        })
        .collect();
    let events = sealpost_cli::demo::order_batch(&keys, br#"{"order_id":"api"}"#);
    let tx = pg.transaction().await.unwrap();
    store::enqueue_many(&tx, route, &events).await.unwrap();
    tx.commit().await.unwrap();
    let mut receipts = Vec::new();
    while receipts.len() < n {
        let b = store::claim_batch(pg, 77, n, 10_000).await.unwrap();
        assert!(!b.outgoing.is_empty(), "nothing left to claim");
        let batch = b
            .outgoing
            .iter()
            .map(store::Outgoing::send_request)
            .collect();
        let sent: Vec<_> = broker
            .send_batch(batch, std::time::Instant::now() + Duration::from_secs(30))
            .await
            .into_iter()
            .map(|r| match r {
                SendResult::Receipt(r) => r,
                other => panic!("{other:?}"),
            })
            .collect();
        let v = store::accept_receipts(pg, &sent).await.unwrap();
        assert!(v
            .iter()
            .all(|a| *a == Accepted::Verdict(ReceiptVerdict::Primary)));
        receipts.extend(sent);
    }
    receipts
}

/// Runs the library consumer over `sub` until every published row can be purged with the
/// consumer named, checks the handler's rows, purges, and stops the consumer.
async fn applied_once_then_purged<S: Subscription + 'static>(
    sub: S,
    url: &str,
    pg: &mut tokio_postgres::Client,
    consumer_id: &str,
    n: usize,
    poison: bool,
) {
    if poison {
        // The handler of o-7 always fails: a permanent bad message.
        pg.batch_execute(
            "ALTER TABLE api_applied ADD CONSTRAINT no_o7 CHECK (aggregate_id <> 'o-7')",
        )
        .await
        .unwrap();
    }
    let shutdown = CancellationToken::new();
    let mut options = Options::new(consumer_id);
    options.redelivery.max_deliveries = 3;
    options.progress_every_ms = 200;
    options.effect = "record".into();
    let applied = options.applied.clone();
    let task = tokio::spawn(consumer::run(
        sub,
        Databases::from_urls(url, None),
        options,
        record,
        shutdown.clone(),
    ));
    let required = vec![consumer_id.to_string()];
    wait_for(
        "every row purgeable (applied, the watermark reported)",
        Duration::from_secs(90),
        async || {
            let mut o = ops::PurgeOptions::new(&required, 0);
            o.dry_run = true;
            let r = ops::purge(pg, &o).await.unwrap();
            r.purged == n as u64
        },
    )
    .await;
    let rows = pg
        .query_one(
            "SELECT count(*), count(DISTINCT event_id), count(DISTINCT idempotency_key),
                    count(*) FILTER (WHERE event_type = 'order.created.v1')
             FROM api_applied",
            &[],
        )
        .await
        .unwrap();
    let (all, distinct, keys, typed): (i64, i64, i64, i64) =
        (rows.get(0), rows.get(1), rows.get(2), rows.get(3));
    let ok = n as i64 - i64::from(poison);
    assert_eq!((all, distinct, keys), (ok, ok, ok));
    assert_eq!(typed, ok, "the handler sees the envelope (R30)");
    assert_eq!(
        applied.load(std::sync::atomic::Ordering::Relaxed),
        ok as u64
    );
    let dead = pg
        .query(
            "SELECT o.aggregate_id, q.delivered, q.reason, q.payload = o.payload
             FROM sealpost.inbox_quarantine q JOIN sealpost.outbox o USING (event_id)
             WHERE q.consumer_id = $1 AND q.kind = 'dead_letter'",
            &[&consumer_id],
        )
        .await
        .unwrap();
    if poison {
        assert_eq!(dead.len(), 1);
        assert_eq!(dead[0].get::<_, String>(0), "o-7");
        assert_eq!(
            dead[0].get::<_, i32>(1),
            3,
            "dead-lettered at the third delivery"
        );
        let reason: String = dead[0].get(2);
        assert!(
            reason.contains("no_o7"),
            "the database's own words: {reason}"
        );
        assert!(
            dead[0].get::<_, bool>(3),
            "the payload is kept for the operator"
        );
    } else {
        assert!(dead.is_empty());
    }
    let r = ops::purge(pg, &ops::PurgeOptions::new(&required, 0))
        .await
        .unwrap();
    assert_eq!(r.purged, n as u64, "{r:?}");
    shutdown.cancel();
    task.await.unwrap().unwrap();
    // The rows the handler wrote are still there, once each.
    let again: i64 = pg
        .query_one("SELECT count(*) FROM api_applied", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(again, ok);
}

/// The downstream-timeout drill through the library consumer: the handler of o-7 waits for a
/// row another session holds; each try runs past the time limit and is rolled back alone
/// (no inbox row), sent back, and applied once when the downstream recovers; then purge.
async fn downstream_timeout<S: Subscription + 'static>(
    sub: S,
    url: &str,
    pg: &mut tokio_postgres::Client,
    consumer_id: &str,
    n: usize,
) {
    pg.batch_execute(
        "CREATE TABLE downstream (k text PRIMARY KEY);
         INSERT INTO downstream VALUES ('o-7');
         CREATE FUNCTION call_downstream() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             PERFORM 1 FROM downstream WHERE k = NEW.aggregate_id FOR UPDATE;
             RETURN NEW;
         END $$;
         CREATE TRIGGER call_downstream BEFORE INSERT ON api_applied
             FOR EACH ROW EXECUTE FUNCTION call_downstream();",
    )
    .await
    .unwrap();
    let mut holder = runtime::pg_connect(url).await.unwrap();
    let hang = holder.transaction().await.unwrap();
    hang.execute("SELECT 1 FROM downstream WHERE k = 'o-7' FOR UPDATE", &[])
        .await
        .unwrap();
    let shutdown = CancellationToken::new();
    let mut options = Options::new(consumer_id);
    options.effect_timeout_ms = 300;
    options.redelivery.max_deliveries = 1_000; // the timeout drill must not dead-letter
    options.progress_every_ms = 200;
    let task = tokio::spawn(consumer::run(
        sub,
        Databases::from_urls(url, None),
        options,
        record,
        shutdown.clone(),
    ));
    let count = async |pg: &tokio_postgres::Client, sql: &str| -> i64 {
        pg.query_one(sql, &[]).await.unwrap().get(0)
    };
    wait_for("the others applied", Duration::from_secs(60), async || {
        count(pg, "SELECT count(*) FROM api_applied").await == n as i64 - 1
    })
    .await;
    // Retried, never recorded while it hangs.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        count(
            pg,
            "SELECT count(*) FROM sealpost.inbox i JOIN sealpost.outbox o USING (event_id)
             WHERE o.aggregate_id = 'o-7'"
        )
        .await,
        0,
        "the hanging handler was rolled back with its inbox row"
    );
    hang.commit().await.unwrap();
    let required = vec![consumer_id.to_string()];
    wait_for(
        "o-7 applied and every row purgeable",
        Duration::from_secs(90),
        async || {
            let mut o = ops::PurgeOptions::new(&required, 0);
            o.dry_run = true;
            ops::purge(pg, &o).await.unwrap().purged == n as u64
        },
    )
    .await;
    assert_eq!(
        count(pg, "SELECT count(DISTINCT event_id) FROM api_applied").await,
        n as i64
    );
    assert_eq!(
        count(pg, "SELECT count(*) FROM api_applied").await,
        n as i64
    );
    assert_eq!(
        count(pg, "SELECT count(*) FROM sealpost.inbox_quarantine").await,
        0
    );
    shutdown.cancel();
    task.await.unwrap().unwrap();
    drop(holder);
}

/// The hot-key drill through the library consumer: 80% of the events on one aggregate,
/// consumed by two instances of one consumer; every event applied once.
async fn hot_key<S: Subscription + 'static>(
    subs: [S; 2],
    url: &str,
    pg: &tokio_postgres::Client,
    consumer_id: &str,
    n: usize,
) {
    let shutdown = CancellationToken::new();
    let tasks: Vec<_> = subs
        .into_iter()
        .map(|sub| {
            tokio::spawn(consumer::run(
                sub,
                Databases::from_urls(url, None),
                Options::new(consumer_id),
                record,
                shutdown.clone(),
            ))
        })
        .collect();
    wait_for("every event applied", Duration::from_secs(90), async || {
        let r: i64 = pg
            .query_one("SELECT count(DISTINCT event_id) FROM api_applied", &[])
            .await
            .unwrap()
            .get(0);
        r == n as i64
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    shutdown.cancel();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let r = pg
        .query_one(
            "SELECT count(*), count(DISTINCT event_id),
                    count(*) FILTER (WHERE aggregate_id = 'o-hot')
             FROM api_applied",
            &[],
        )
        .await
        .unwrap();
    let hot = (0..n).filter(|i| i % 5 != 0).count() as i64;
    assert_eq!(
        (r.get::<_, i64>(0), r.get::<_, i64>(1), r.get::<_, i64>(2)),
        (n as i64, n as i64, hot),
        "each event applied once, the hot aggregate's too"
    );
}

/// The example binary `examples/<example>.rs`, run as a service would run it: over a
/// published backlog of `n` events its handler writes `n` distinct rows (`shipments`), it
/// reports its watermark so that the real `sealpost purge --consumer C` purges every row
/// (no `--no-consumers`), and Ctrl-C (SIGINT) stops it cleanly. The examples are built by
/// `cargo test --all-targets` (`.ci/run`); run alone, build them first.
async fn example_binary(
    example: &str,
    topic: &str,
    consumer_id: &str,
    url: &str,
    pg: &mut tokio_postgres::Client,
    n: usize,
) {
    let exe = std::env::current_exe().unwrap();
    let bin = exe
        .parent()
        .and_then(|deps| deps.parent())
        .unwrap()
        .join("examples")
        .join(example);
    assert!(
        bin.exists(),
        "{} is missing: build the examples first (`cargo build --release -p sealpost-cli --examples`, or `cargo test --all-targets`)",
        bin.display()
    );
    let mut child = std::process::Command::new(&bin)
        .args([topic, consumer_id])
        .env("DATABASE_URL", url)
        .stdin(std::process::Stdio::null())
        .spawn()
        .unwrap();
    struct Kill(u32);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", &self.0.to_string()])
                .status();
        }
    }
    let _kill = Kill(child.id());
    let required = vec![consumer_id.to_string()];
    wait_for(
        "the example applied every event and reported its watermark",
        Duration::from_secs(90),
        async || {
            let mut o = ops::PurgeOptions::new(&required, 0);
            o.dry_run = true;
            ops::purge(pg, &o).await.unwrap().purged == n as u64
        },
    )
    .await;
    let rows = pg
        .query_one(
            "SELECT count(*), count(DISTINCT event_id), count(DISTINCT idempotency_key) FROM shipments",
            &[],
        )
        .await
        .unwrap();
    let n = n as i64;
    assert_eq!((rows.get(0), rows.get(1), rows.get(2)), (n, n, n));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sealpost"))
        .args([
            "purge",
            "--consumer",
            consumer_id,
            "--replay-window-s",
            "0",
            "--json",
        ])
        .env("DATABASE_URL", url)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["purged"], serde_json::json!(n), "{report}");
    std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "{example} did not stop on SIGINT"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(status.success(), "{example} exited with {status}");
}

const N: usize = 200;

#[tokio::test]
async fn nats_backlog_applied_once_reported_and_purged() {
    nats(0).await;
}

#[tokio::test]
async fn nats_downstream_timeout_rolled_back_retried_and_applied_once() {
    nats(2).await;
}

#[tokio::test]
async fn nats_hot_key_two_instances_apply_each_event_once() {
    nats(3).await;
}

#[tokio::test]
async fn nats_permanent_bad_message_dead_lettered_and_passed() {
    nats(1).await;
}

#[tokio::test]
async fn nats_example_binary_applies_a_backlog_once_and_purge_follows() {
    nats(4).await;
}

async fn nats(mode: u8) {
    let poison = mode == 1;
    let tag = runtime::owner_id() % 1_000_000;
    let (url, mut pg, _db) = fresh_db(&format!("nats_{tag}_{}", mode)).await;
    let topic = format!("API{tag}P{}", mode);
    let route = format!("r-{topic}");
    store::set_route(&pg, &route, common::NATS_CLUSTER, &topic)
        .await
        .unwrap();
    let nats = sealpost_nats::Nats::connect(
        &common::nats_url(),
        common::NATS_CLUSTER,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    nats.ensure_stream(&topic).await.unwrap();
    let _stream = teardown_nats::stream(&common::nats_url(), &topic);
    publish(&mut pg, &nats, &route, N, mode == 3).await;
    let c = format!("api-{topic}");
    if mode == 4 {
        return example_binary("consume_nats", &topic, &c, &url, &mut pg, N).await;
    }
    let sub =
        sealpost_nats::NatsSubscription::subscribe(&nats, &topic, &c, Duration::from_secs(10))
            .await
            .unwrap();
    if mode == 3 {
        let second =
            sealpost_nats::NatsSubscription::subscribe(&nats, &topic, &c, Duration::from_secs(2))
                .await
                .unwrap();
        hot_key([sub, second], &url, &pg, &c, N).await;
    } else if mode == 2 {
        downstream_timeout(sub, &url, &mut pg, &c, N).await;
    } else {
        applied_once_then_purged(sub, &url, &mut pg, &c, N, poison).await;
    }
    drop(pg);
}

#[tokio::test]
async fn rabbitmq_backlog_applied_once_reported_and_purged() {
    rabbitmq(0).await;
}

#[tokio::test]
async fn rabbitmq_downstream_timeout_rolled_back_retried_and_applied_once() {
    rabbitmq(2).await;
}

#[tokio::test]
async fn rabbitmq_hot_key_two_instances_apply_each_event_once() {
    rabbitmq(3).await;
}

#[tokio::test]
async fn rabbitmq_permanent_bad_message_dead_lettered_and_passed() {
    rabbitmq(1).await;
}

#[tokio::test]
async fn rabbitmq_example_binary_applies_a_backlog_once_and_purge_follows() {
    rabbitmq(4).await;
}

async fn rabbitmq(mode: u8) {
    let poison = mode == 1;
    let tag = runtime::owner_id() % 1_000_000;
    let (url, mut pg, _db) = fresh_db(&format!("rabbit_{tag}_{}", mode)).await;
    let topic = format!("sp-api-{tag}-{}", mode);
    let route = format!("r-{topic}");
    store::set_route(&pg, &route, common::RABBITMQ_CLUSTER, &topic)
        .await
        .unwrap();
    let rabbit = sealpost_rabbitmq::Rabbit::connect(
        &common::rabbitmq_url(),
        common::RABBITMQ_CLUSTER,
        Duration::from_secs(5),
        &format!("sealpost-test-api-{tag}"),
    )
    .await
    .expect("RabbitMQ must be running at 127.0.0.1:5672 (guest/guest)");
    let c = format!("api-{tag}-{}", mode);
    let _destination =
        teardown_rabbitmq::destination(&common::rabbitmq_url(), &topic, std::slice::from_ref(&c));
    rabbit
        .ensure_destination(&topic, std::slice::from_ref(&c))
        .await
        .unwrap();
    publish(&mut pg, &rabbit, &route, N, mode == 3).await;
    if mode == 4 {
        return example_binary("consume_rabbitmq", &topic, &c, &url, &mut pg, N).await;
    }
    // The test's dispatcher sends at once: a settle time of 1 s covers it.
    let sub = sealpost_rabbitmq::RabbitSubscription::subscribe(
        &common::rabbitmq_url(),
        &Default::default(),
        &topic,
        &c,
        1_000,
    )
    .await
    .unwrap();
    if mode == 3 {
        let second = sealpost_rabbitmq::RabbitSubscription::subscribe(
            &common::rabbitmq_url(),
            &Default::default(),
            &topic,
            &c,
            1_000,
        )
        .await
        .unwrap();
        hot_key([sub, second], &url, &pg, &c, N).await;
    } else if mode == 2 {
        downstream_timeout(sub, &url, &mut pg, &c, N).await;
    } else {
        applied_once_then_purged(sub, &url, &mut pg, &c, N, poison).await;
    }
    drop(pg);
}

#[tokio::test]
async fn kafka_backlog_applied_once_reported_and_purged() {
    kafka(0).await;
}

#[tokio::test]
async fn kafka_downstream_timeout_rolled_back_retried_and_applied_once() {
    kafka(2).await;
}

#[tokio::test]
async fn kafka_hot_key_two_instances_apply_each_event_once() {
    kafka(3).await;
}

#[tokio::test]
async fn kafka_permanent_bad_message_dead_lettered_and_passed() {
    kafka(1).await;
}

#[tokio::test]
async fn kafka_example_binary_applies_a_backlog_once_and_purge_follows() {
    kafka(4).await;
}

async fn kafka(mode: u8) {
    let poison = mode == 1;
    let tag = runtime::owner_id() % 1_000_000;
    let (url, mut pg, _db) = fresh_db(&format!("kafka_{tag}_{}", mode)).await;
    let topic = format!("sp-api-{tag}-{}", mode);
    let route = format!("r-{topic}");
    let kcfg = teardown_kafka::config(
        &common::kafka_brokers(),
        common::KAFKA_CLUSTER,
        &common::kafka_client_properties(),
    );
    let kafka = sealpost_kafka::Kafka::connect(kcfg.clone())
        .await
        .expect("a Kafka-protocol broker must listen on 127.0.0.1:9092 (.ci/run starts tansu)");
    let _topic = teardown_kafka::topic(&kcfg, &topic);
    let partitions = kafka.ensure_topic(&topic, 3).await.unwrap();
    store::set_route(&pg, &route, common::KAFKA_CLUSTER, &topic)
        .await
        .unwrap();
    store::set_route_partitions(
        &pg,
        &route,
        sealpost_core::envelope::PartitionAlgorithm::KafkaMurmur2 { partitions },
    )
    .await
    .unwrap();
    publish(&mut pg, &kafka, &route, N, mode == 3).await;
    let c = format!("api-{tag}-{}", mode);
    if mode == 4 {
        return example_binary("consume_kafka", &topic, &c, &url, &mut pg, N).await;
    }
    let sub = sealpost_kafka::KafkaSubscription::subscribe(&kcfg, &topic, &c).unwrap();
    if mode == 3 {
        let second = sealpost_kafka::KafkaSubscription::subscribe(&kcfg, &topic, &c).unwrap();
        hot_key([sub, second], &url, &pg, &c, N).await;
    } else if mode == 2 {
        downstream_timeout(sub, &url, &mut pg, &c, N).await;
    } else {
        applied_once_then_purged(sub, &url, &mut pg, &c, N, poison).await;
    }
    drop(pg);
}
