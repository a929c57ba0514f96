//! The drills NATS has, on RabbitMQ and Kafka (issue 25, item 3), against the real
//! PostgreSQL, the shared RabbitMQ and tansu.
//!
//! **Restore (F11, R21)**, as NATS has it
//! (`retention.rs::restore_from_a_dump_taken_mid_run_keeps_event_ids_and_has_no_second_effects`):
//! 200 events are enqueued and 100 of them published; the outbox database is dumped
//! (`pg_dump`); then everything is published and the library consumer (its inbox in a
//! database of its own, so a restore of the outbox does not roll back what it applied)
//! applies all 200. The outbox is then restored from the mid-run dump, so 100 events that
//! the broker already holds are `PENDING` again. Neither broker can refuse a second copy
//! (RabbitMQ and Kafka without idempotence have no duplicate horizon at all: the restore
//! is "after the horizon" from its first second), so the dispatchers send those 100 again.
//! Proven: the restored rows keep their event ids (none minted anew), every row ends
//! `PUBLISHED`, the broker holds at least 300 copies (the second copies are the evidence,
//! counted on an audit queue or the topic's high watermark), and the consumer, having read
//! every copy, applied each event exactly once: 200 effect rows, 200 distinct.
//!
//! **A record lost at the broker (R31)** on Kafka, as `loops.rs::an_acknowledged_message_lost_at_the_broker_is_a_finding`
//! has it on NATS: three events are published, the topic is deleted and made again empty
//! behind Sealpost's back, and the verification pass finds all three missing
//! (`published_missing_at_broker` in `status` and in the `reconcile` report). On RabbitMQ
//! the pass asks the destination's lookup stream (`[rabbitmq.lookup]`; a queue hands a
//! message to one consumer and forgets it, so without the stream a loss is not detected):
//! five events are confirmed, the stream lacks three of them, and the pass finds exactly
//! those three.
//!
//! Each test has its own databases and its own exchange or topic, removed at the end, pass
//! or fail.

use crate::common;
use crate::teardown_kafka;
use crate::teardown_rabbitmq;

use common::{count, wait_for};
use std::collections::BTreeSet;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use sealpost::consumer::{self, CancellationToken, Databases, Delivery, HandlerError, Options};
use sealpost::runtime::{self, Config, Counters};
use sealpost::store;
use sealpost_core::envelope::EventId;
use sealpost_core::port::Broker;
use sealpost_core::subscription::Subscription;

/// Events in all; half are published before the dump.
const EVENTS: usize = 200;
const BEFORE_DUMP: usize = 100;

struct Drill {
    outbox: common::TestDb,
    inbox: common::TestDb,
    cfg: Config,
    route: String,
}

async fn setup(tag: &str, cluster: &str, topic: &str) -> Drill {
    let n = runtime::owner_id() % 1_000_000;
    let outbox = common::fresh_database(&format!("sealpost_restore_{tag}_{n}")).await;
    let inbox = common::fresh_database(&format!("sealpost_restore_{tag}_{n}_inbox")).await;
    let cfg = Config {
        database_url: outbox.database_url.clone(),
        lease_ms: 3_000,
        ack_timeout_ms: 1_000,
        ..Config::default()
    };
    let pg = runtime::pg_connect(&outbox.database_url).await.unwrap();
    store::migrate(&pg).await.expect("migrate the outbox");
    let route = format!("r-{topic}");
    store::set_route(&pg, &route, cluster, topic).await.unwrap();
    let ipg = runtime::pg_connect(&inbox.database_url).await.unwrap();
    store::migrate(&ipg).await.expect("migrate the inbox");
    ipg.batch_execute("CREATE TABLE applied (event_id uuid NOT NULL)")
        .await
        .unwrap();
    Drill {
        outbox,
        inbox,
        cfg,
        route,
    }
}

/// Every effect row the handler writes; no key on it, so a second effect would show.
fn handler() -> impl for<'a> Fn(
    &'a tokio_postgres::Transaction<'a>,
    &'a Delivery,
) -> BoxFuture<'a, Result<(), HandlerError>>
       + Send
       + Sync
       + 'static {
    |tx, d| {
        Box::pin(async move {
            tx.execute(
                "INSERT INTO applied VALUES ($1)",
                &[&uuid::Uuid::from_bytes(d.event_id.0)],
            )
            .await?;
            Ok(())
        })
    }
}

/// Enqueues `events` events and publishes the first `published` as a dispatcher does
/// (claim, send, accept); returns every id.
async fn enqueue_and_publish<B: Broker>(
    d: &Drill,
    broker: &B,
    events: usize,
    published: usize,
) -> Vec<EventId> {
    let mut pg = runtime::pg_connect(&d.outbox.database_url).await.unwrap();
    let keys: Vec<String> = (0..events).map(|i| format!("o-{i}")).collect();
    let events = sealpost_cli::demo::order_batch(&keys, br#"{"order_id":"r"}"#);
    let tx = pg.transaction().await.unwrap();
    store::enqueue_many(&tx, &d.route, &events).await.unwrap();
    tx.commit().await.unwrap();
    common::publish_claimed(&mut pg, broker, published, None).await;
    events.iter().map(|e| e.0).collect()
}

fn pg_tool(tool: &str, args: &[&str]) {
    let out = Command::new(tool)
        .args(["-h", "127.0.0.1", "-U", "postgres"])
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{tool}: {e}"));
    assert!(
        out.status.success(),
        "{tool} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Drops the outbox database and restores it from `dump`.
async fn restore(d: &Drill, dump: &std::path::Path) {
    let admin = runtime::pg_connect(common::ADMIN_URL).await.unwrap();
    let name = d.outbox.name();
    for sql in [
        format!("DROP DATABASE {name} WITH (FORCE)"),
        format!("CREATE DATABASE {name}"),
    ] {
        admin.batch_execute(&sql).await.unwrap();
    }
    pg_tool("pg_restore", &["-d", name, &dump.display().to_string()]);
}

async fn dispatch_until_published<B: Broker>(d: &Drill, broker: &Arc<B>) {
    let stop = CancellationToken::new();
    let counters = Arc::new(Counters::default());
    let tasks = runtime::spawn_fleet(
        &d.cfg,
        &common::pg_source(&d.cfg),
        broker,
        1,
        true,
        &stop,
        &counters,
    );
    let pg = runtime::pg_connect(&d.outbox.database_url).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let states: Vec<(String, i64)> = pg
            .query(
                "SELECT state, count(*) FROM sealpost.outbox GROUP BY 1 ORDER BY 1",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        if states.iter().all(|(s, _)| s == "PUBLISHED") {
            break;
        }
        if Instant::now() > deadline {
            let errors: Vec<Option<String>> = pg
                .query(
                    "SELECT DISTINCT last_error FROM sealpost.work WHERE state <> 'PUBLISHED' LIMIT 5",
                    &[],
                )
                .await
                .unwrap()
                .iter()
                .map(|r| r.get(0))
                .collect();
            panic!("not every row PUBLISHED after 120 s: {states:?}; last errors: {errors:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.cancel();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
}

/// The drill over `broker`; `subscription` is the consumer's, `copies` counts the copies the
/// broker holds, `caught_up` says whether the consumer has read all of them.
async fn drill<B, S>(
    d: &Drill,
    broker: B,
    subscription: S,
    mut copies: impl AsyncFnMut() -> u64,
    mut caught_up: impl AsyncFnMut() -> bool,
) where
    B: Broker,
    S: Subscription + 'static,
    S::Error: Send,
{
    let broker = Arc::new(broker);
    let ids = enqueue_and_publish(d, &*broker, EVENTS, BEFORE_DUMP).await;
    let dump = std::env::temp_dir().join(format!("{}.dump", d.outbox.name()));
    pg_tool(
        "pg_dump",
        &[
            "-d",
            d.outbox.name(),
            "-Fc",
            "-f",
            &dump.display().to_string(),
        ],
    );
    struct Removed(std::path::PathBuf);
    impl Drop for Removed {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let _dump = Removed(dump.clone());

    let ipg = runtime::pg_connect(&d.inbox.database_url).await.unwrap();
    let stop_consumer = CancellationToken::new();
    let consumer = tokio::spawn(consumer::run(
        subscription,
        Databases::from_urls(&d.inbox.database_url, None),
        Options::new("c1"),
        handler(),
        stop_consumer.clone(),
    ));
    dispatch_until_published(d, &broker).await;
    wait_for(
        "every event applied",
        Duration::from_secs(120),
        async || count(&ipg, "SELECT count(*) FROM applied").await == EVENTS as i64,
    )
    .await;
    assert_eq!(
        copies().await,
        EVENTS as u64,
        "one copy each before the restore"
    );

    // F11: the outbox is restored from the mid-run dump; the consumer keeps running.
    restore(d, &dump).await;
    let pg = runtime::pg_connect(&d.outbox.database_url).await.unwrap();
    assert_eq!(
        count(
            &pg,
            "SELECT count(*) FROM sealpost.outbox WHERE state = 'PENDING'"
        )
        .await,
        (EVENTS - BEFORE_DUMP) as i64,
        "the rows published after the dump are PENDING again"
    );
    dispatch_until_published(d, &broker).await;
    wait_for(
        "the second copies at the broker",
        Duration::from_secs(60),
        async || copies().await >= (EVENTS + EVENTS - BEFORE_DUMP) as u64,
    )
    .await;
    wait_for(
        "the consumer to read every copy",
        Duration::from_secs(60),
        async || caught_up().await,
    )
    .await;
    stop_consumer.cancel();
    consumer.await.unwrap().unwrap();

    let restored: BTreeSet<String> = pg
        .query("SELECT event_id::text FROM sealpost.envelope", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let original: BTreeSet<String> = ids
        .iter()
        .map(|i| uuid::Uuid::from_bytes(i.0).to_string())
        .collect();
    assert_eq!(restored, original, "the same event ids, none minted anew");
    let held = copies().await;
    let (effects, distinct): (i64, i64) = {
        let r = ipg
            .query_one(
                "SELECT count(*), count(DISTINCT event_id) FROM applied",
                &[],
            )
            .await
            .unwrap();
        (r.get(0), r.get(1))
    };
    eprintln!(
        "restore drill: {held} copies at the broker for {EVENTS} events, {effects} effects ({distinct} distinct)"
    );
    assert!(held >= (EVENTS + EVENTS - BEFORE_DUMP) as u64, "{held}");
    assert_eq!(
        (effects, distinct),
        (EVENTS as i64, EVENTS as i64),
        "each event applied once: zero second effects"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_restore_from_a_dump_taken_mid_run_keeps_event_ids_and_has_no_second_effects() {
    use sealpost_rabbitmq::lapin::options::QueueDeclareOptions;
    use sealpost_rabbitmq::lapin::types::FieldTable;
    let topic = format!("sp-restore-{}", runtime::owner_id() % 1_000_000);
    let d = setup("rabbit", common::RABBITMQ_CLUSTER, &topic).await;
    let consumers = vec!["c1".to_string(), "audit".to_string()];
    let rabbit = sealpost_rabbitmq::Rabbit::connect(
        &common::rabbitmq_url(),
        common::RABBITMQ_CLUSTER,
        Duration::from_secs(5),
        "sealpost-test-restore",
    )
    .await
    .expect("RabbitMQ must be running at 127.0.0.1:5672 (guest/guest)");
    let _destination = teardown_rabbitmq::destination(&common::rabbitmq_url(), &topic, &consumers);
    rabbit.ensure_destination(&topic, &consumers).await.unwrap();
    let admin =
        sealpost_rabbitmq::lapin::Connection::connect(&common::rabbitmq_url(), Default::default())
            .await
            .unwrap();
    let ready = async |consumer: &str| -> u64 {
        let ch = admin.create_channel().await.unwrap();
        let q = ch
            .queue_declare(
                sealpost_rabbitmq::queue_name(&topic, consumer)
                    .as_str()
                    .into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        let _ = ch.close(200, "done".into()).await;
        q.message_count() as u64
    };
    let subscription = sealpost_rabbitmq::RabbitSubscription::subscribe(
        &common::rabbitmq_url(),
        &Default::default(),
        &topic,
        "c1",
        1_000,
    )
    .await
    .unwrap();
    // The audit queue is never read: it holds every copy the exchange routed.
    drill(
        &d,
        rabbit,
        subscription,
        async || ready("audit").await,
        async || ready("c1").await == 0,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_restore_from_a_dump_taken_mid_run_keeps_event_ids_and_has_no_second_effects() {
    use sealpost_kafka::rdkafka::consumer::{BaseConsumer, Consumer};
    use sealpost_kafka::rdkafka::{ClientConfig, Offset, TopicPartitionList};
    let topic = format!("sp-restore-{}", runtime::owner_id() % 1_000_000);
    let (d, kcfg, kafka, _topic) = kafka_drill("kafka", &topic).await;
    // The consumer group's committed offset and the topic's high watermark, read by a client
    // of the test's own (the group's member is the subscription).
    let offsets = || -> (i64, i64) {
        let c: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", common::kafka_brokers())
            .set("group.id", "c1")
            .create()
            .unwrap();
        let (_, high) = c
            .fetch_watermarks(&topic, 0, Duration::from_secs(10))
            .unwrap();
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition(&topic, 0);
        let list = c.committed_offsets(tpl, Duration::from_secs(10)).ok();
        let committed = match list
            .as_ref()
            .and_then(|l| l.find_partition(&topic, 0))
            .map(|p| p.offset())
        {
            Some(Offset::Offset(o)) => o,
            _ => 0,
        };
        (high, committed)
    };
    let subscription = sealpost_kafka::KafkaSubscription::subscribe(&kcfg, &topic, "c1").unwrap();
    drill(
        &d,
        kafka,
        subscription,
        async || tokio::task::block_in_place(|| offsets().0 as u64),
        async || {
            tokio::task::block_in_place(|| {
                let (high, committed) = offsets();
                committed >= high
            })
        },
    )
    .await;
}

/// A drill's databases and a one-partition topic of its own on tansu, the route bound to it;
/// the topic's guard comes back with the adapter.
async fn kafka_drill(
    tag: &str,
    topic: &str,
) -> (
    Drill,
    sealpost_kafka::KafkaConfig,
    sealpost_kafka::Kafka,
    impl Sized,
) {
    let d = setup(tag, common::KAFKA_CLUSTER, topic).await;
    let kcfg = teardown_kafka::config(
        &common::kafka_brokers(),
        common::KAFKA_CLUSTER,
        &common::kafka_client_properties(),
    );
    let kafka = sealpost_kafka::Kafka::connect(kcfg.clone())
        .await
        .expect("a Kafka-protocol broker must listen on 127.0.0.1:9092 (.ci/run starts tansu)");
    let guard = teardown_kafka::topic(&kcfg, topic);
    let partitions = kafka.ensure_topic(topic, 1).await.unwrap();
    let pg = runtime::pg_connect(&d.outbox.database_url).await.unwrap();
    store::set_route_partitions(
        &pg,
        &d.route,
        sealpost_core::envelope::PartitionAlgorithm::KafkaMurmur2 { partitions },
    )
    .await
    .unwrap();
    (d, kcfg, kafka, guard)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_a_record_lost_at_the_broker_is_a_finding() {
    let topic = format!("sp-loss-{}", runtime::owner_id() % 1_000_000);
    let (mut d, _kcfg, kafka, _topic) = kafka_drill("kloss", &topic).await;
    d.cfg.verify_every_ms = 100;
    enqueue_and_publish(&d, &kafka, 3, 3).await;
    // Lost behind Sealpost's back: the topic's data is gone, the topic is there again.
    kafka.delete_topic(&topic).await.unwrap();
    let mut made = kafka.ensure_topic(&topic, 1).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while made.is_err() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(500)).await;
        made = kafka.ensure_topic(&topic, 1).await;
    }
    made.expect("the topic made again");

    let pg = runtime::pg_connect(&d.outbox.database_url).await.unwrap();
    let stop = CancellationToken::new();
    let counters = Arc::new(Counters::default());
    let tasks = runtime::spawn_fleet(
        &d.cfg,
        &common::pg_source(&d.cfg),
        &Arc::new(kafka),
        0,
        true,
        &stop,
        &counters,
    );
    wait_for("the findings", Duration::from_secs(60), async || {
        store::status(&pg).await.unwrap().missing_at_broker == 3
    })
    .await;
    stop.cancel();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert!(counters.missing.load(std::sync::atomic::Ordering::Relaxed) >= 3);
    let report = sealpost_cli::ops::reconcile(
        &pg,
        None::<&sealpost::ops::NoScan>,
        &sealpost_cli::ops::ReconcileOptions {
            pending_age_s: 3_600,
            unconsumed_age_s: 3_600,
            unknown_age_s: 3_600,
            consumers: vec![],
            streams: vec![],
            scan_max: 0,
        },
    )
    .await
    .unwrap();
    let f = report
        .findings
        .iter()
        .find(|f| f.kind == "published_missing_at_broker")
        .expect("the finding is in the reconcile report");
    assert_eq!(f.count, 3);
}

/// R31 on RabbitMQ with the lookup stream (issue 25, item 2): five events are published and
/// confirmed, but the stream, the broker's own record of what it stored, lacks three of
/// them (the drill unbinds it from the exchange while those three are published: the same
/// hole a lost stream segment leaves, with older and newer messages around it). The
/// verification pass finds exactly those three missing (`published_missing_at_broker` in
/// `status` and in the `reconcile` report), and not the two the stream holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_a_message_lost_at_the_broker_is_a_finding() {
    use sealpost_rabbitmq::lapin::options::QueueBindOptions;
    use sealpost_rabbitmq::lapin::types::FieldTable;
    let topic = format!("sp-rloss-{}", runtime::owner_id() % 1_000_000);
    let mut d = setup("rloss", common::RABBITMQ_CLUSTER, &topic).await;
    d.cfg.verify_every_ms = 100;
    let consumers = vec!["c1".to_string()];
    let rabbit = sealpost_rabbitmq::Rabbit::connect(
        &common::rabbitmq_url(),
        common::RABBITMQ_CLUSTER,
        Duration::from_secs(5),
        "sealpost-test-rloss",
    )
    .await
    .expect("RabbitMQ must be running at 127.0.0.1:5672 (guest/guest)")
    .with_lookup_stream(sealpost_rabbitmq::LookupStream {
        enabled: true,
        clock_margin_ms: 0,
        ..Default::default()
    });
    let _destination = teardown_rabbitmq::destination(&common::rabbitmq_url(), &topic, &consumers);
    rabbit.ensure_destination(&topic, &consumers).await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut pg = runtime::pg_connect(&d.outbox.database_url).await.unwrap();
    let keys: Vec<String> = (0..5).map(|i| format!("o-{i}")).collect();
    let events = sealpost_cli::demo::order_batch(&keys, br#"{"order_id":"r"}"#);
    let tx = pg.transaction().await.unwrap();
    store::enqueue_many(&tx, &d.route, &events).await.unwrap();
    tx.commit().await.unwrap();
    common::publish_claimed(&mut pg, &rabbit, 1, None).await;
    let admin =
        sealpost_rabbitmq::lapin::Connection::connect(&common::rabbitmq_url(), Default::default())
            .await
            .unwrap();
    let ch = admin.create_channel().await.unwrap();
    let stream = sealpost_rabbitmq::lookup_stream_name(&topic);
    ch.queue_unbind(
        stream.as_str().into(),
        topic.as_str().into(),
        "#".into(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let lost = common::publish_claimed(&mut pg, &rabbit, 3, None).await;
    ch.queue_bind(
        stream.as_str().into(),
        topic.as_str().into(),
        "#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    common::publish_claimed(&mut pg, &rabbit, 1, None).await;

    let stop = CancellationToken::new();
    let counters = Arc::new(Counters::default());
    let tasks = runtime::spawn_fleet(
        &d.cfg,
        &common::pg_source(&d.cfg),
        &Arc::new(rabbit),
        0,
        true,
        &stop,
        &counters,
    );
    wait_for("the findings", Duration::from_secs(60), async || {
        store::status(&pg).await.unwrap().missing_at_broker == 3
    })
    .await;
    // A few more passes: the two the stream holds never become findings.
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.cancel();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(store::status(&pg).await.unwrap().missing_at_broker, 3);
    let missing: BTreeSet<uuid::Uuid> = pg
        .query(
            "SELECT event_id FROM sealpost.finding WHERE kind = 'published_missing_at_broker'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let expected: BTreeSet<uuid::Uuid> = lost
        .iter()
        .map(|r| uuid::Uuid::from_bytes(r.event_id.0))
        .collect();
    assert_eq!(missing, expected, "exactly the three the stream lacks");
    let report = sealpost_cli::ops::reconcile(
        &pg,
        None::<&sealpost::ops::NoScan>,
        &sealpost_cli::ops::ReconcileOptions {
            pending_age_s: 3_600,
            unconsumed_age_s: 3_600,
            unknown_age_s: 3_600,
            consumers: vec![],
            streams: vec![],
            scan_max: 0,
        },
    )
    .await
    .unwrap();
    let f = report
        .findings
        .iter()
        .find(|f| f.kind == "published_missing_at_broker")
        .expect("the finding is in the reconcile report");
    assert_eq!(f.count, 3);
}
