//! Erasure of a data subject (R34, issue 23 item 5): on a route that encrypts payloads per
//! aggregate, `sealpost erase order/o-42` leaves no readable payload of that aggregate
//! anywhere Sealpost wrote one — the outbox envelopes, every broker copy and the consumer's
//! dead letters — while every other aggregate's events still read, consumers keep going
//! (an erased event reaches the handler marked erased) and the subject never gets a key again.
//!
//! Each test runs the drill on one broker: three events (two of `order/o-42`, one of
//! `order/o-7`) are published by a signing dispatcher; consumer `before` applies two and
//! dead-letters one; an `audit` consumer that never settles reads the broker's copies as the
//! broker delivers them; the binary erases; every copy is opened again with the database's keys.

use common::{count, wait_for};
use std::collections::HashMap;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common;
use crate::teardown_kafka;
use crate::teardown_nats;
use crate::teardown_rabbitmq;

use futures::future::BoxFuture;
use sealpost::consumer::{self, CancellationToken, Databases, Delivery, HandlerError, Options};
use sealpost::payload_key::{self, KeyState, Keying, Opened, Subject};
use sealpost::runtime::{self, Config};
use sealpost::store::{self, StoreError};
use sealpost_core::envelope::{EventId, NewEvent};
use sealpost_core::inbox::RedeliveryPolicy;
use sealpost_core::port::Broker;
use sealpost_core::subscription::{FetchLimits, Subscription};

/// The personal data the drill must make unreadable.
const SECRET: &str = "ada.lovelace@example.org";

/// A fresh database with the schema, a route keyed per aggregate, and a signing config.
async fn fresh(
    tag: &str,
    cluster: &str,
    topic: &str,
) -> (
    Config,
    tokio_postgres::Client,
    impl Sized,
    common::KeyDir,
    String,
) {
    let db = common::fresh_database(&format!("sealpost_erasure_{tag}")).await;
    // The test's own keys: a config whose keys are not read yet.
    let mut cfg = Config {
        database_url: db.database_url.clone(),
        lease_ms: 2_000,
        ack_timeout_ms: 1_000,
        ..Config::default()
    };
    let keys = common::signing_keys(&mut cfg, db.name());
    let pg = runtime::pg_connect(&cfg.database_url).await.unwrap();
    store::migrate(&pg).await.expect("migrate");
    pg.batch_execute(
        "CREATE TABLE applied (consumer text, event_id uuid, erased bool, payload bytea)",
    )
    .await
    .unwrap();
    let route = format!("r-{topic}");
    store::set_route(&pg, &route, cluster, topic).await.unwrap();
    assert!(
        store::set_route_lifecycle(&pg, &route, Some(Keying::Aggregate), None)
            .await
            .unwrap()
    );
    (cfg, pg, db, keys, route)
}

fn payload_of(order: &str) -> Vec<u8> {
    format!(r#"{{"order_id":"{order}","email":"{SECRET}","total_cents":4200}}"#).into_bytes()
}

fn new_event<'a>(order: &'a str, payload: &'a [u8]) -> NewEvent<'a> {
    NewEvent {
        aggregate_type: "order",
        aggregate_id: order,
        aggregate_version: 1,
        event_type: "order.created.v1",
        payload_schema: "order.created.v1",
        payload,
        tenant: "acme",
        occurred_at_ms: 1,
        creating_txid: 0,
    }
}

/// Enqueues two events of `order/o-42` and one of `order/o-7`, publishes them as a signing
/// dispatcher does (claim, sign, send, accept); returns the ids (o-42, o-42, o-7).
async fn publish<B: Broker>(
    cfg: &Config,
    pg: &mut tokio_postgres::Client,
    broker: &B,
    route: &str,
) -> Vec<EventId> {
    let (p42, p7) = (payload_of("o-42"), payload_of("o-7"));
    let events: Vec<(EventId, NewEvent<'_>, String)> =
        [("o-42", &p42), ("o-42", &p42), ("o-7", &p7)]
            .into_iter()
            .map(|(o, p)| {
                (
                    sealpost_cli::demo::mint_event_id(),
                    new_event(o, p),
                    o.to_string(),
                )
            })
            .collect();
    let ids = events.iter().map(|e| e.0).collect();
    let tx = pg.transaction().await.unwrap();
    store::enqueue_many(&tx, route, &events).await.unwrap();
    tx.commit().await.unwrap();
    let signer = cfg.keys.signer.as_deref().expect("a signing key");
    common::publish_claimed(pg, broker, 3, Some(signer)).await;
    ids
}

/// Records each delivery (its payload as the handler sees it, and whether it was erased);
/// consumer `before` fails `order/o-42`'s second event until it is dead-lettered.
fn handler(
    consumer_id: &'static str,
    fail: Option<EventId>,
) -> impl for<'a> Fn(
    &'a tokio_postgres::Transaction<'a>,
    &'a Delivery,
) -> BoxFuture<'a, Result<(), HandlerError>>
       + Send
       + Sync
       + 'static {
    move |tx, d| {
        Box::pin(async move {
            if Some(d.event_id) == fail {
                return Err("the downstream refuses this order".into());
            }
            tx.execute(
                "INSERT INTO applied VALUES ($1, $2, $3, $4)",
                &[
                    &consumer_id,
                    &uuid::Uuid::from_bytes(d.event_id.0),
                    &d.payload_erased,
                    &d.payload,
                ],
            )
            .await?;
            Ok(())
        })
    }
}

/// Runs the library consumer `consumer_id` until `applied` rows and `dead` dead letters are
/// recorded for it.
async fn consume<S: Subscription + 'static>(
    cfg: &Config,
    pg: &tokio_postgres::Client,
    sub: S,
    consumer_id: &'static str,
    fail: Option<EventId>,
    applied: i64,
    dead: i64,
) where
    S::Error: Send,
{
    let mut options = Options::new(consumer_id).with_keyring(cfg.keys.keyring.clone());
    options.redelivery = RedeliveryPolicy {
        max_deliveries: 2,
        backoff_first_ms: 50,
        backoff_max_ms: 100,
    };
    let stop = CancellationToken::new();
    let task = tokio::spawn(consumer::run(
        sub,
        Databases::from_urls(&cfg.database_url, None),
        options,
        handler(consumer_id, fail),
        stop.clone(),
    ));
    wait_for(
        &format!("consumer {consumer_id}: {applied} applied, {dead} dead-lettered"),
        Duration::from_secs(60),
        async || {
            count(
                pg,
                &format!("SELECT count(*) FROM applied WHERE consumer = '{consumer_id}'"),
            )
            .await
                == applied
                && count(
                    pg,
                    &format!(
                        "SELECT count(*) FROM sealpost.inbox_quarantine WHERE consumer_id = '{consumer_id}'"
                    ),
                )
                .await
                    == dead
        },
    )
    .await;
    stop.cancel();
    task.await.unwrap().unwrap();
}

/// The payloads the broker holds, as it delivers them to the `audit` consumer (which never
/// settles: it only reads).
async fn broker_copies<S: Subscription>(mut audit: S, n: usize) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while out.len() < n {
        assert!(
            Instant::now() < deadline,
            "the broker delivered {} of {n} copies",
            out.len()
        );
        let batch = audit
            .fetch(FetchLimits {
                messages_max: n,
                bytes_max: 1 << 20,
                wait_ms: 1_000,
            })
            .await
            .unwrap();
        out.extend(batch.iter().map(|m| audit.read(m).payload.to_vec()));
    }
    out
}

/// Every payload Sealpost wrote for the three events: the envelopes, the dead letters and
/// the broker's copies, each with where it was read.
async fn copies(pg: &tokio_postgres::Client, broker: &[Vec<u8>]) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for r in pg
        .query(
            "SELECT payload FROM sealpost.envelope ORDER BY event_id",
            &[],
        )
        .await
        .unwrap()
    {
        out.push(("outbox envelope".to_string(), r.get(0)));
    }
    for r in pg
        .query("SELECT payload FROM sealpost.inbox_quarantine", &[])
        .await
        .unwrap()
    {
        out.push(("dead letter".to_string(), r.get(0)));
    }
    for p in broker {
        out.push(("broker copy".to_string(), p.clone()));
    }
    out
}

fn o42() -> Subject {
    Subject::Aggregate {
        aggregate_type: "order".into(),
        id: "o-42".into(),
    }
}

fn o7() -> Subject {
    Subject::Aggregate {
        aggregate_type: "order".into(),
        id: "o-7".into(),
    }
}

/// Checks every copy against the keys: none shows the personal data in the clear; before the
/// erasure each opens to its event's payload; after it, `order/o-42`'s read as erased and
/// `order/o-7`'s still open. Returns how many copies of each kind were checked.
fn check(
    copies: &[(String, Vec<u8>)],
    keys: &HashMap<Subject, KeyState>,
    erased: bool,
) -> HashMap<String, usize> {
    let mut checked: HashMap<String, usize> = HashMap::new();
    for (where_, bytes) in copies {
        assert!(
            !bytes.windows(SECRET.len()).any(|w| w == SECRET.as_bytes()),
            "{where_} holds the personal data in the clear"
        );
        let subject = match payload_key::frame(bytes) {
            Some(Ok(f)) => f.subject,
            other => panic!("{where_} is not an encrypted frame: {other:?}"),
        };
        let opened = payload_key::open_with(bytes, keys);
        if subject == o42() && erased {
            assert_eq!(opened, Opened::Erased(o42()), "{where_} of order/o-42");
        } else {
            let order = if subject == o7() { "o-7" } else { "o-42" };
            assert_eq!(
                opened,
                Opened::Opened(payload_of(order)),
                "{where_} of order/{order} opens"
            );
        }
        *checked.entry(where_.clone()).or_default() += 1;
    }
    checked
}

/// Runs the `sealpost` binary against `database_url` (and the tests' NATS).
fn sealpost(args: &[&str], database_url: Option<&str>) -> std::process::Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_sealpost"));
    c.args(args)
        .env("NATS_URL", common::nats_url())
        .env_remove("SEALPOST_CONFIG");
    if let Some(url) = database_url {
        c.env("DATABASE_URL", url);
    }
    c.output().expect("run sealpost")
}

async fn erase_with_the_binary(cfg: &Config, subject: &str) -> String {
    let out = sealpost(&["erase", subject], Some(&cfg.database_url));
    let said = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "sealpost erase: {said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    said
}

/// The drill after publication: `before` applies o-42's first event and o-7's and
/// dead-letters o-42's second; the audit reads the broker's copies; the binary erases
/// order/o-42; every copy is checked again; `after` applies all three (o-42's marked erased);
/// a new event of order/o-42 is refused.
async fn drill<S: Subscription + 'static>(
    cfg: &Config,
    pg: &mut tokio_postgres::Client,
    route: &str,
    ids: &[EventId],
    mut subscribe: impl AsyncFnMut(&'static str) -> S,
) where
    S::Error: Send,
{
    let before = subscribe("before").await;
    consume(cfg, pg, before, "before", Some(ids[1]), 2, 1).await;
    let seen: Vec<(uuid::Uuid, bool, Vec<u8>)> = pg
        .query(
            "SELECT event_id, erased, payload FROM applied WHERE consumer = 'before' ORDER BY event_id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    for (id, erased, payload) in &seen {
        let order = if *id == uuid::Uuid::from_bytes(ids[2].0) {
            "o-7"
        } else {
            "o-42"
        };
        assert!(!erased);
        assert_eq!(
            payload,
            &payload_of(order),
            "the handler saw the producer's bytes"
        );
    }
    let broker = broker_copies(subscribe("audit").await, 3).await;
    let subjects = [o42(), o7()];
    let keys = payload_key::keys_of(&*pg, &subjects).await.unwrap();
    let checked = check(&copies(pg, &broker).await, &keys, false);
    assert_eq!(checked["outbox envelope"], 3);
    assert_eq!(checked["dead letter"], 1);
    assert_eq!(checked["broker copy"], 3);

    let said = erase_with_the_binary(cfg, "order/o-42").await;
    assert!(said.contains("erased data subject order/o-42"), "{said}");
    assert!(said.contains("2 envelope(s)"), "{said}");
    let keys = payload_key::keys_of(&*pg, &subjects).await.unwrap();
    assert!(matches!(keys[&o42()], KeyState::Erased { .. }));
    assert!(matches!(keys[&o7()], KeyState::Live(_)));
    // The broker still holds its copies (the audit consumer never settled): read them again.
    let broker = broker_copies(subscribe("audit2").await, 3).await;
    let checked = check(&copies(pg, &broker).await, &keys, true);
    eprintln!(
        "checked after the erasure: {} outbox envelopes, {} dead letter(s), {} broker copies",
        checked["outbox envelope"], checked["dead letter"], checked["broker copy"]
    );
    assert_eq!(
        count(
            pg,
            "SELECT count(*) FROM sealpost.subject_erasure WHERE subject_id = 'o-42'"
        )
        .await,
        1
    );

    // A consumer reading after the erasure: o-42's events arrive erased, o-7's in the clear.
    consume(cfg, pg, subscribe("after").await, "after", None, 3, 0).await;
    let after: Vec<(uuid::Uuid, bool, Vec<u8>)> = pg
        .query(
            "SELECT event_id, erased, payload FROM applied WHERE consumer = 'after'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    for (id, erased, payload) in &after {
        if *id == uuid::Uuid::from_bytes(ids[2].0) {
            assert!(!erased);
            assert_eq!(payload, &payload_of("o-7"));
        } else {
            assert!(
                erased,
                "order/o-42's event reaches the handler marked erased"
            );
            assert!(payload.is_empty());
        }
    }

    // No key is made again for an erased subject.
    let p = payload_of("o-42");
    let tx = pg.transaction().await.unwrap();
    let refused = store::enqueue(
        &tx,
        route,
        sealpost_cli::demo::mint_event_id(),
        &new_event("o-42", &p),
        "o-42",
    )
    .await
    .unwrap_err();
    assert!(
        matches!(&refused, StoreError::PayloadKey { .. }),
        "{refused}"
    );
    assert!(refused.to_string().contains("was erased"), "{refused}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_erase_leaves_no_readable_payload_of_the_subject() {
    let tag = runtime::owner_id() % 1_000_000;
    let topic = format!("ERASE{tag}");
    let (cfg, mut pg, _db, _keys, route) =
        fresh(&format!("nats_{tag}"), common::NATS_CLUSTER, &topic).await;
    let n = sealpost_nats::Nats::connect(
        &common::nats_url(),
        common::NATS_CLUSTER,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    n.ensure_stream(&topic).await.unwrap();
    let _stream = teardown_nats::stream(&common::nats_url(), &topic);
    let ids = publish(&cfg, &mut pg, &n, &route).await;
    drill(&cfg, &mut pg, &route, &ids, async |c| {
        sealpost_nats::NatsSubscription::subscribe(&n, &topic, c, Duration::from_secs(10))
            .await
            .unwrap()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_erase_leaves_no_readable_payload_of_the_subject() {
    let tag = runtime::owner_id() % 1_000_000;
    let topic = format!("sp-erase-{tag}");
    let (cfg, mut pg, _db, _keys, route) =
        fresh(&format!("rabbit_{tag}"), common::RABBITMQ_CLUSTER, &topic).await;
    let consumers: Vec<String> = ["before", "audit", "audit2", "after"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let rabbit = sealpost_rabbitmq::Rabbit::connect(
        &common::rabbitmq_url(),
        common::RABBITMQ_CLUSTER,
        Duration::from_secs(5),
        &format!("sealpost-test-erasure-{tag}"),
    )
    .await
    .expect("RabbitMQ must be running at 127.0.0.1:5672 (guest/guest)");
    let _destination = teardown_rabbitmq::destination(&common::rabbitmq_url(), &topic, &consumers);
    rabbit.ensure_destination(&topic, &consumers).await.unwrap();
    let ids = publish(&cfg, &mut pg, &rabbit, &route).await;
    drill(&cfg, &mut pg, &route, &ids, async |c| {
        sealpost_rabbitmq::RabbitSubscription::subscribe(
            &common::rabbitmq_url(),
            &Default::default(),
            &topic,
            c,
            1_000,
        )
        .await
        .unwrap()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_erase_leaves_no_readable_payload_of_the_subject() {
    let tag = runtime::owner_id() % 1_000_000;
    let topic = format!("sp-erase-{tag}");
    let (cfg, mut pg, _db, _keys, route) =
        fresh(&format!("kafka_{tag}"), common::KAFKA_CLUSTER, &topic).await;
    let kcfg = teardown_kafka::config(
        &common::kafka_brokers(),
        common::KAFKA_CLUSTER,
        &common::kafka_client_properties(),
    );
    let kafka = sealpost_kafka::Kafka::connect(kcfg.clone())
        .await
        .expect("a Kafka-protocol broker must listen on 127.0.0.1:9092 (.ci/run starts tansu)");
    let _topic = teardown_kafka::topic(&kcfg, &topic);
    let partitions = kafka.ensure_topic(&topic, 1).await.unwrap();
    store::set_route_partitions(
        &pg,
        &route,
        sealpost_core::envelope::PartitionAlgorithm::KafkaMurmur2 { partitions },
    )
    .await
    .unwrap();
    let ids = publish(&cfg, &mut pg, &kafka, &route).await;
    drill(&cfg, &mut pg, &route, &ids, async |c| {
        sealpost_kafka::KafkaSubscription::subscribe(&kcfg, &topic, c).unwrap()
    })
    .await;
}

/// Enqueues `ev` on `route` in a transaction of its own and expects a refusal whose words
/// contain `needle`; nothing is committed.
async fn refused(pg: &mut tokio_postgres::Client, route: &str, ev: &NewEvent<'_>, needle: &str) {
    let tx = pg.transaction().await.unwrap();
    let e = store::enqueue(&tx, route, sealpost_cli::demo::mint_event_id(), ev, "o-1")
        .await
        .unwrap_err();
    assert!(e.to_string().contains(needle), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_routes_refuse_what_they_cannot_key_and_plain_routes_refuse_a_frame() {
    let tag = runtime::owner_id() % 1_000_000;
    let topic = format!("ERASEREFUSE{tag}");
    let (_cfg, mut pg, _db, _keys, route) =
        fresh(&format!("refuse_{tag}"), common::NATS_CLUSTER, &topic).await;
    let p = b"{}".to_vec();
    let mut slashed = new_event("o-1", &p);
    slashed.aggregate_type = "shop/order";
    refused(&mut pg, &route, &slashed, "contains `/`").await;
    // A tenant-keyed route needs a tenant.
    assert!(
        store::set_route_lifecycle(&pg, &route, Some(Keying::Tenant), None)
            .await
            .unwrap()
    );
    let mut no_tenant = new_event("o-1", &p);
    no_tenant.tenant = "";
    refused(&mut pg, &route, &no_tenant, "has no tenant").await;
    // A route that does not encrypt refuses a payload that looks like a frame.
    assert!(
        store::set_route_lifecycle(&pg, &route, Some(Keying::None), None)
            .await
            .unwrap()
    );
    let framed = payload_key::seal(&o42(), &payload_key::fresh_key(), b"x");
    refused(
        &mut pg,
        &route,
        &new_event("o-1", &framed),
        "encryption frame marker",
    )
    .await;
    // The operator names subjects clearly, or is told how.
    let out = sealpost(&["erase", "o-42"], None);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("TYPE/ID") && err.contains("tenant:ID"),
        "{err}"
    );
}

/// `sealpost migrate --max-age-s` records the route's retention and gives its NATS stream
/// that `max_age`: created with it, changed with it, cleared by 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routes_max_age_becomes_its_streams() {
    let tag = runtime::owner_id() % 1_000_000;
    let topic = format!("ERASEAGE{tag}");
    let (cfg, pg, _db, _keys, route) =
        fresh(&format!("age_{tag}"), common::NATS_CLUSTER, &topic).await;
    let _stream = teardown_nats::stream(&common::nats_url(), &topic);
    let js = sealpost_nats::async_nats::jetstream::new(
        sealpost_nats::async_nats::connect(common::nats_url())
            .await
            .unwrap(),
    );
    let route_arg = format!("{route}={}/{topic}", common::NATS_CLUSTER);
    for (given, want) in [(3600u64, 3600u64), (600, 600), (0, 0)] {
        let out = sealpost(
            &[
                "migrate",
                "--route",
                &route_arg,
                "--payload-key",
                "aggregate",
                "--max-age-s",
                &given.to_string(),
            ],
            Some(&cfg.database_url),
        );
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{said}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(said.contains("payload key aggregate"), "{said}");
        let mut stream = js.get_stream(&topic).await.unwrap();
        let max_age = stream.info().await.unwrap().config.max_age;
        assert_eq!(max_age, Duration::from_secs(want), "--max-age-s {given}");
        let recorded = store::route_lifecycle(&pg, &route).await.unwrap();
        assert_eq!(
            recorded,
            Some((Keying::Aggregate, (want > 0).then_some(want as i64 * 1000)))
        );
    }
    // Less than the duplicate window is refused before anything is written.
    let out = sealpost(
        &["migrate", "--route", &route_arg, "--max-age-s", "60"],
        Some(&cfg.database_url),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("duplicate window"), "{err}");
    assert_eq!(
        store::route_lifecycle(&pg, &route).await.unwrap(),
        Some((Keying::Aggregate, None))
    );
}

/// Dead letters are capped in bytes: a payload over the cap is not kept, only its size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_keeps_no_payload_over_the_cap() {
    use sealpost::inbox::{self, DeadLetter, DeadLetterKind, DEAD_LETTER_PAYLOAD_BYTES_MAX};
    let tag = runtime::owner_id() % 1_000_000;
    let (_cfg, pg, _db, _keys, _route) =
        fresh(&format!("cap_{tag}"), common::NATS_CLUSTER, "CAP").await;
    let letter = |sequence: u64, len: usize| DeadLetter {
        kind: DeadLetterKind::EffectFailed,
        event: Some((sealpost_cli::demo::mint_event_id(), 0)),
        stream: "CAP".into(),
        sequence,
        subject: "sp.CAP.x.0".into(),
        delivered: 5,
        reason: "the downstream refuses it".into(),
        payload: vec![b'x'; len],
    };
    inbox::dead_letter(
        &pg,
        "c",
        &[
            letter(1, DEAD_LETTER_PAYLOAD_BYTES_MAX),
            letter(2, DEAD_LETTER_PAYLOAD_BYTES_MAX + 1),
        ],
    )
    .await
    .unwrap();
    let rows: Vec<(i64, Option<Vec<u8>>, i32)> = pg
        .query(
            "SELECT sequence, payload, payload_bytes FROM sealpost.inbox_quarantine ORDER BY sequence",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(rows.len(), 2);
    assert_eq!(
        rows[0].1.as_ref().map(Vec::len),
        Some(DEAD_LETTER_PAYLOAD_BYTES_MAX)
    );
    assert_eq!(rows[1].1, None, "over the cap: not kept");
    assert_eq!(rows[1].2 as usize, DEAD_LETTER_PAYLOAD_BYTES_MAX + 1);
}
