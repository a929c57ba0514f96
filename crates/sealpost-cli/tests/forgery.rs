//! Signed envelopes against forgers, on the machine's PostgreSQL and NATS. The forger is an
//! independent client (plain `async-nats`, not Sealpost's adapter) that may publish to the
//! stream and has read a genuine message: it copies headers, computes payload digests from
//! `docs/encoding.md`, and replays a genuine signature.
//!
//! * Look-alike messages under new event ids (unsigned; a genuine signature replayed with
//!   another event id, another payload, another event type; an unknown key; a malformed
//!   header) are each quarantined by the library consumer with the reason, and never reach
//!   the handler; every genuine event is applied once. The same messages read by a consumer
//!   that checks no signature are applied (the hole the keyring closes: the test can fail).
//! * The same look-alikes on RabbitMQ (a plain `lapin` client) and Kafka (a plain `rdkafka`
//!   producer; the Kafka test needs a Kafka-protocol broker, `.ci/run` starts tansu).
//! * A forged copy that takes an event's subject before the genuine send (create-if-absent
//!   then refuses the genuine one) is never adopted by the reconciler: the row ends
//!   `QUARANTINED` with `UnsealedCopy` for an operator, not `PUBLISHED`.

use common::wait_for;
use std::sync::Arc;
use std::time::Duration;

use crate::common;
use crate::teardown_kafka;
use crate::teardown_nats;
use crate::teardown_rabbitmq;

use futures::future::BoxFuture;
use sealpost::consumer::{self, CancellationToken, Databases, Delivery, HandlerError, Options};
use sealpost::runtime::{self, Config, Counters};
use sealpost::signing::Keyring;
use sealpost::store;
use sealpost_core::envelope::{payload_digest, EventId};
use sealpost_core::signature::{SignaturePolicy, H_SIGNATURE};
use sealpost_nats::async_nats;
use sealpost_nats::async_nats::HeaderMap;

const ADMIN_URL: &str = "host=127.0.0.1 user=postgres dbname=postgres";

/// A fresh database `sealpost_forgery_<tag>` with the schema and the handler's table, its
/// guard, and a config whose dispatchers sign with a new key `k1` and whose readers require
/// signatures.
async fn fresh(tag: &str) -> (Config, tokio_postgres::Client, impl Sized, common::KeyDir) {
    let db = format!("sealpost_forgery_{tag}");
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
    let mut cfg = Config {
        database_url: format!("host=127.0.0.1 user=postgres dbname={db}"),
        lease_ms: 2_000,
        ack_timeout_ms: 1_000,
        reconcile_every_ms: 200,
        ..Config::default()
    };
    let keys = common::signing_keys(&mut cfg, &db);
    assert_eq!(cfg.keys.keyring.policy(), SignaturePolicy::Require);
    let pg = runtime::pg_connect(&cfg.database_url).await.unwrap();
    store::migrate(&pg).await.expect("migrate");
    pg.batch_execute(
        "CREATE TABLE applied (consumer text NOT NULL, event_id uuid NOT NULL, event_type text)",
    )
    .await
    .unwrap();
    (cfg, pg, guard, keys)
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

/// The handlers: one row per applied event, naming the consumer.
fn record_as<'a>(
    consumer: &'static str,
    tx: &'a tokio_postgres::Transaction<'a>,
    d: &'a Delivery,
) -> BoxFuture<'a, Result<(), HandlerError>> {
    Box::pin(async move {
        tx.execute(
            "INSERT INTO applied (consumer, event_id, event_type) VALUES ($1, $2, $3)",
            &[
                &consumer,
                &uuid::Uuid::from_bytes(d.event_id.0),
                &d.envelope.as_ref().map(|e| e.event_type.clone()),
            ],
        )
        .await?;
        Ok(())
    })
}

fn record_signed<'a>(
    tx: &'a tokio_postgres::Transaction<'a>,
    d: &'a Delivery,
) -> BoxFuture<'a, Result<(), HandlerError>> {
    record_as("signed", tx, d)
}

fn record_open<'a>(
    tx: &'a tokio_postgres::Transaction<'a>,
    d: &'a Delivery,
) -> BoxFuture<'a, Result<(), HandlerError>> {
    record_as("open", tx, d)
}

async fn nats(topic: &str) -> sealpost_nats::Nats {
    let n = sealpost_nats::Nats::connect(
        &common::nats_url(),
        common::NATS_CLUSTER,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    n.ensure_stream(topic).await.unwrap();
    n
}

fn enqueue_orders(n: usize) -> (Vec<String>, Vec<u8>) {
    let keys = (0..n).map(|i| format!("o-{i}")).collect();
    (
        keys,
        br#"{"order_id":"genuine","total_cents":4200}"#.to_vec(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn look_alike_messages_are_quarantined_and_every_genuine_event_applied_once() {
    const N: usize = 40;
    let tag = runtime::owner_id() % 1_000_000;
    let (cfg, pg, _db, _keys) = fresh(&format!("look_{tag}")).await;
    let topic = format!("FORGE{tag}L");
    let route = format!("r-{topic}");
    store::set_route(&pg, &route, common::NATS_CLUSTER, &topic)
        .await
        .unwrap();
    let n = nats(&topic).await;
    let _stream = teardown_nats::stream(&common::nats_url(), &topic);

    // N genuine events, published by a signing dispatcher.
    let (keys, payload) = enqueue_orders(N);
    let events = sealpost_cli::demo::order_batch(&keys, &payload);
    let ids: Vec<EventId> = events.iter().map(|e| e.0).collect();
    {
        let mut pg = runtime::pg_connect(&cfg.database_url).await.unwrap();
        let tx = pg.transaction().await.unwrap();
        store::enqueue_many(&tx, &route, &events).await.unwrap();
        tx.commit().await.unwrap();
    }
    let stop = CancellationToken::new();
    let tasks = runtime::spawn_fleet(
        &cfg,
        &common::pg_source(&cfg),
        &Arc::new(n.clone()),
        1,
        false,
        &stop,
        &Arc::new(Counters::default()),
    );
    wait_for(
        "every genuine event PUBLISHED",
        Duration::from_secs(30),
        async || {
            let published: i64 = pg
                .query_one(
                    "SELECT count(*) FROM sealpost.outbox WHERE state = 'PUBLISHED'",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            published == N as i64
        },
    )
    .await;
    stop.cancel();
    for t in tasks {
        t.await.unwrap().unwrap();
    }

    // The forger reads one genuine message and publishes look-alikes under new event ids.
    let client = async_nats::connect(common::nats_url()).await.unwrap();
    let js = async_nats::jetstream::new(client.clone());
    let stream = js.get_stream(&topic).await.unwrap();
    let genuine = stream
        .get_last_raw_message_by_subject(&sealpost_nats::subject(&topic, ids[0], 0))
        .await
        .unwrap();
    let signed = genuine
        .headers
        .get(H_SIGNATURE)
        .map(|v| v.as_str().to_string())
        .expect("the dispatcher signed the genuine message");
    assert!(signed.starts_with("ed25519 kid=k1 sig="), "{signed}");
    let read: Vec<(String, String)> = genuine
        .headers
        .iter()
        .filter(|(k, _)| AsRef::<str>::as_ref(*k).starts_with("Sealpost-"))
        .flat_map(|(k, vs)| {
            vs.iter()
                .map(|v| (AsRef::<str>::as_ref(k).to_string(), v.as_str().to_string()))
        })
        .collect();
    let forgeries = look_alikes(&read, &genuine.payload);
    for Forgery {
        what,
        id,
        headers,
        body,
    } in &forgeries
    {
        let mut h = HeaderMap::new();
        for (k, v) in headers {
            h.insert(k.as_str(), v.as_str());
        }
        js.publish_with_headers(
            sealpost_nats::subject(&topic, *id, 0),
            h,
            body.clone().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap_or_else(|e| panic!("the forger publishes ({what}): {e}"));
    }
    let sub = async |c: &str| {
        sealpost_nats::NatsSubscription::subscribe(&n, &topic, c, Duration::from_secs(10))
            .await
            .unwrap()
    };
    let (signed_sub, open_sub) = (sub("signed").await, sub("open").await);
    consume_and_check(&cfg, &pg, signed_sub, open_sub, &ids, &forgeries).await;
    let _ = client.drain().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_copy_in_an_events_place_is_never_adopted() {
    let tag = runtime::owner_id() % 1_000_000;
    let (cfg, mut pg, _db, _keys) = fresh(&format!("place_{tag}")).await;
    let topic = format!("FORGE{tag}P");
    let route = format!("r-{topic}");
    store::set_route(&pg, &route, common::NATS_CLUSTER, &topic)
        .await
        .unwrap();
    let n = nats(&topic).await;
    let _stream = teardown_nats::stream(&common::nats_url(), &topic);
    let (keys, payload) = enqueue_orders(2);
    let events = sealpost_cli::demo::order_batch(&keys, &payload);
    let (victim, control) = (events[0].0, events[1].0);
    {
        let tx = pg.transaction().await.unwrap();
        store::enqueue_many(&tx, &route, &events[..1])
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    // The forger learns the victim's event, payload and headers (here: from a claim that
    // never sends, whose lease then runs out) and publishes an unsigned copy with the same
    // payload at the event's subject first. Create-if-absent keeps it there.
    let claimed = store::claim_batch(&mut pg, 77, 10, 1_000).await.unwrap();
    assert_eq!(claimed.outgoing.len(), 1);
    let r = claimed.outgoing[0].send_request();
    let mut h = HeaderMap::new();
    h.insert(sealpost_nats::H_EVENT_ID, r.event_id.to_string().as_str());
    h.insert(sealpost_nats::H_MEMBER, "0");
    h.insert(sealpost_nats::H_ENVELOPE_GENERATION, "1");
    h.insert(
        sealpost_nats::H_ATTEMPT_ID,
        r.attempt_id.to_string().as_str(),
    );
    h.insert(
        sealpost_nats::H_PAYLOAD_DIGEST,
        r.payload_digest.to_prefixed_hex().as_str(),
    );
    h.insert(
        sealpost_nats::H_DESTINATION_DIGEST,
        r.destination_digest.to_prefixed_hex().as_str(),
    );
    for (k, v) in r.envelope.headers() {
        h.insert(k, v.as_str());
    }
    let client = async_nats::connect(common::nats_url()).await.unwrap();
    let js = async_nats::jetstream::new(client.clone());
    js.publish_with_headers(
        sealpost_nats::subject(&topic, victim, 0),
        h,
        r.payload.clone().into(),
    )
    .await
    .unwrap()
    .await
    .expect("the forger publishes first");
    {
        let tx = pg.transaction().await.unwrap();
        store::enqueue_many(&tx, &route, &events[1..])
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    // A signing dispatcher and a reconciler that requires signatures.
    let stop = CancellationToken::new();
    let tasks = runtime::spawn_fleet(
        &cfg,
        &common::pg_source(&cfg),
        &Arc::new(n.clone()),
        1,
        true,
        &stop,
        &Arc::new(Counters::default()),
    );
    wait_for(
        "the victim quarantined, the control published",
        Duration::from_secs(60),
        async || {
            state_of(&pg, victim).await == "QUARANTINED"
                && state_of(&pg, control).await == "PUBLISHED"
        },
    )
    .await;
    stop.cancel();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let status = store::status(&pg).await.unwrap();
    let victim_text = victim.to_string();
    let why = status
        .quarantined_rows
        .iter()
        .find(|(id, _)| *id == victim_text)
        .map(|(_, why)| why.clone())
        .expect("the victim is listed for the operator");
    assert!(why.contains("UnsealedCopy"), "{why}");
    let _ = client.drain().await;
}

/// One look-alike message: what it tries, its new event id, its headers and its body.
struct Forgery {
    what: &'static str,
    id: EventId,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

/// How one look-alike differs from the genuine message: its signature header, its body, and
/// an event type of its own.
type Change = (&'static str, Option<String>, Vec<u8>, Option<&'static str>);

/// The look-alikes of one genuine, signed message under new event ids: the forger copies
/// every header of the genuine message and changes what it needs.
fn look_alikes(genuine: &[(String, String)], genuine_payload: &[u8]) -> Vec<Forgery> {
    let signed = genuine
        .iter()
        .find(|(k, _)| k == H_SIGNATURE)
        .map(|(_, v)| v.clone())
        .expect("the genuine message is signed");
    let foreign = br#"{"order_id":"forged","total_cents":1}"#.to_vec();
    let cases: Vec<Change> = vec![
        ("unsigned, foreign payload", None, foreign.clone(), None),
        (
            "genuine signature, foreign payload",
            Some(signed.clone()),
            foreign.clone(),
            None,
        ),
        (
            "genuine signature and payload, another event id",
            Some(signed.clone()),
            genuine_payload.to_vec(),
            None,
        ),
        (
            "genuine signature and payload, another event type",
            Some(signed),
            genuine_payload.to_vec(),
            Some("order.cancelled.v1"),
        ),
        (
            "a key nobody holds",
            Some(format!("ed25519 kid=k9 sig={}", "ab".repeat(64))),
            foreign.clone(),
            None,
        ),
        (
            "a malformed signature",
            Some("ed25519 kid=k1 sig=not-hex".to_string()),
            foreign,
            None,
        ),
    ];
    cases
        .into_iter()
        .enumerate()
        .map(|(i, (what, sig, body, event_type))| {
            let id = sealpost_cli::demo::mint_event_id();
            let set = |h: &mut Vec<(String, String)>, k: &str, v: Option<String>| {
                h.retain(|(n, _)| n != k);
                if let Some(v) = v {
                    h.push((k.to_string(), v));
                }
            };
            let mut h = genuine.to_vec();
            set(&mut h, sealpost_rabbitmq::H_EVENT_ID, Some(id.to_string()));
            set(
                &mut h,
                sealpost_rabbitmq::H_ATTEMPT_ID,
                Some((9_000_000 + i).to_string()),
            );
            set(
                &mut h,
                sealpost_rabbitmq::H_PAYLOAD_DIGEST,
                Some(payload_digest(&body).to_prefixed_hex()),
            );
            set(&mut h, H_SIGNATURE, sig);
            if let Some(t) = event_type {
                set(&mut h, "Sealpost-Event-Type", Some(t.to_string()));
            }
            Forgery {
                what,
                id,
                headers: h,
                body,
            }
        })
        .collect()
}

/// The reason the consumer recorded must name the cause of each look-alike (in
/// [`look_alikes`] order).
fn expected_reason(i: usize) -> &'static str {
    match i {
        0 => "unsigned",
        4 => "k9",
        5 => "malformed",
        _ => "does not verify",
    }
}

/// Enqueues `n` events on `route` and publishes them through `broker` as a signing dispatcher
/// does (claim, sign, send, accept); returns their ids and the first message sent.
async fn publish_signed<B: sealpost_core::port::Broker>(
    cfg: &Config,
    pg: &mut tokio_postgres::Client,
    broker: &B,
    route: &str,
    n: usize,
) -> (Vec<EventId>, sealpost_core::port::SendRequest) {
    let (keys, payload) = enqueue_orders(n);
    let events = sealpost_cli::demo::order_batch(&keys, &payload);
    let ids: Vec<EventId> = events.iter().map(|e| e.0).collect();
    let tx = pg.transaction().await.unwrap();
    store::enqueue_many(&tx, route, &events).await.unwrap();
    tx.commit().await.unwrap();
    let signer = cfg.keys.signer.as_deref().expect("a signing key");
    let genuine = common::publish_claimed(pg, broker, n, Some(signer))
        .await
        .remove(0);
    (ids, genuine)
}

/// The headers of a genuine message as the forger read them (every adapter writes these).
fn headers_of(r: &sealpost_core::port::SendRequest) -> Vec<(String, String)> {
    let mut h = vec![
        (
            sealpost_rabbitmq::H_EVENT_ID.to_string(),
            r.event_id.to_string(),
        ),
        (
            sealpost_rabbitmq::H_MEMBER.to_string(),
            r.member.to_string(),
        ),
        (
            sealpost_rabbitmq::H_ENVELOPE_GENERATION.to_string(),
            r.envelope_generation.to_string(),
        ),
        (
            sealpost_rabbitmq::H_ATTEMPT_ID.to_string(),
            r.attempt_id.to_string(),
        ),
        (
            sealpost_rabbitmq::H_PAYLOAD_DIGEST.to_string(),
            r.payload_digest.to_prefixed_hex(),
        ),
        (
            sealpost_rabbitmq::H_DESTINATION_DIGEST.to_string(),
            r.destination_digest.to_prefixed_hex(),
        ),
        (H_SIGNATURE.to_string(), r.signature.clone().unwrap()),
    ];
    for (k, v) in r.envelope.headers() {
        h.push((k.to_string(), v));
    }
    h
}

/// Runs a consumer that requires signatures (`signed`) and one that checks none (`open`)
/// until each has seen the `ids` and every look-alike, then checks: `signed` applied each
/// genuine event once and nothing else, and quarantined each look-alike with its cause;
/// `open` applied every look-alike.
async fn consume_and_check<S: sealpost_core::subscription::Subscription + Send + 'static>(
    cfg: &Config,
    pg: &tokio_postgres::Client,
    signed_sub: S,
    open_sub: S,
    ids: &[EventId],
    forgeries: &[Forgery],
) where
    S::Error: Send,
{
    let total = ids.len() + forgeries.len();
    let url = cfg.database_url.clone();
    let mut signed = Options::new("signed").with_keyring(cfg.keys.keyring.clone());
    signed.effect = "record".into();
    let mut open = Options::new("open").with_keyring(Arc::new(Keyring::off()));
    open.effect = "record".into();
    let stop = CancellationToken::new();
    let signed_task = tokio::spawn(consumer::run(
        signed_sub,
        Databases::from_urls(&url, None),
        signed,
        record_signed,
        stop.clone(),
    ));
    let open_task = tokio::spawn(consumer::run(
        open_sub,
        Databases::from_urls(&url, None),
        open,
        record_open,
        stop.clone(),
    ));
    let count = async |sql: &str| -> i64 { pg.query_one(sql, &[]).await.unwrap().get(0) };
    wait_for(
        "both consumers through every message",
        Duration::from_secs(90),
        async || {
            count(
                "SELECT (SELECT count(*) FROM applied WHERE consumer = 'signed')
                      + (SELECT count(*) FROM sealpost.inbox_quarantine WHERE consumer_id = 'signed')",
            )
            .await
                == total as i64
                && count("SELECT count(*) FROM applied WHERE consumer = 'open'").await
                    == total as i64
        },
    )
    .await;
    stop.cancel();
    signed_task.await.unwrap().unwrap();
    open_task.await.unwrap().unwrap();
    let applied: Vec<uuid::Uuid> = pg
        .query(
            "SELECT event_id FROM applied WHERE consumer = 'signed' ORDER BY event_id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut want: Vec<uuid::Uuid> = ids.iter().map(|i| uuid::Uuid::from_bytes(i.0)).collect();
    want.sort();
    assert_eq!(
        applied, want,
        "each genuine event applied once, nothing else"
    );
    for (i, Forgery { what, id, .. }) in forgeries.iter().enumerate() {
        let reasons: Vec<String> = pg
            .query(
                "SELECT reason FROM sealpost.inbox_quarantine
                 WHERE consumer_id = 'signed' AND event_id = $1",
                &[&uuid::Uuid::from_bytes(id.0)],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        assert_eq!(reasons.len(), 1, "{what}: quarantined once: {reasons:?}");
        assert!(
            reasons[0].contains(expected_reason(i)),
            "{what}: the reason names the cause: {}",
            reasons[0]
        );
    }
    let open_forged = count(&format!(
        "SELECT count(*) FROM applied WHERE consumer = 'open' AND event_id IN ({})",
        forgeries
            .iter()
            .map(|f| format!("'{}'", uuid::Uuid::from_bytes(f.id.0)))
            .collect::<Vec<_>>()
            .join(",")
    ))
    .await;
    assert_eq!(
        open_forged,
        forgeries.len() as i64,
        "without a keyring every look-alike is applied"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_look_alike_messages_are_quarantined_and_every_genuine_event_applied_once() {
    use sealpost_rabbitmq::lapin;
    let tag = runtime::owner_id() % 1_000_000;
    let (cfg, mut pg, _db, _keys) = fresh(&format!("rabbit_{tag}")).await;
    let topic = format!("sp-forge-{tag}");
    let route = format!("r-{topic}");
    store::set_route(&pg, &route, common::RABBITMQ_CLUSTER, &topic)
        .await
        .unwrap();
    let consumers = ["signed".to_string(), "open".to_string()];
    let rabbit = sealpost_rabbitmq::Rabbit::connect(
        &common::rabbitmq_url(),
        common::RABBITMQ_CLUSTER,
        Duration::from_secs(5),
        &format!("sealpost-test-forgery-{tag}"),
    )
    .await
    .expect("RabbitMQ must be running at 127.0.0.1:5672 (guest/guest)");
    let _destination = teardown_rabbitmq::destination(&common::rabbitmq_url(), &topic, &consumers);
    rabbit.ensure_destination(&topic, &consumers).await.unwrap();
    let (ids, genuine) = publish_signed(&cfg, &mut pg, &rabbit, &route, 20).await;

    // The forger: a plain AMQP client with the genuine message's headers.
    let forgeries = look_alikes(&headers_of(&genuine), &genuine.payload);
    let conn = lapin::Connection::connect(
        &common::rabbitmq_url(),
        lapin::ConnectionProperties::default(),
    )
    .await
    .unwrap();
    let ch = conn.create_channel().await.unwrap();
    for Forgery {
        what,
        id,
        headers,
        body,
    } in &forgeries
    {
        let mut table = lapin::types::FieldTable::default();
        for (k, v) in headers {
            table.insert(
                k.as_str().into(),
                lapin::types::AMQPValue::LongString(v.as_str().into()),
            );
        }
        ch.basic_publish(
            topic.as_str().into(),
            genuine.destination.routing_key.as_str().into(),
            lapin::options::BasicPublishOptions::default(),
            body,
            lapin::BasicProperties::default()
                .with_message_id(id.to_string().as_str().into())
                .with_delivery_mode(2)
                .with_headers(table),
        )
        .await
        .unwrap()
        .await
        .unwrap_or_else(|e| panic!("the forger publishes ({what}): {e}"));
    }
    let sub = async |c: &str| {
        sealpost_rabbitmq::RabbitSubscription::subscribe(
            &common::rabbitmq_url(),
            &Default::default(),
            &topic,
            c,
            1_000,
        )
        .await
        .unwrap()
    };
    let (signed, open) = (sub("signed").await, sub("open").await);
    consume_and_check(&cfg, &pg, signed, open, &ids, &forgeries).await;
    let _ = conn.close(0, "done".into()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_look_alike_messages_are_quarantined_and_every_genuine_event_applied_once() {
    use sealpost_kafka::rdkafka;
    use sealpost_kafka::rdkafka::message::{Header, OwnedHeaders};
    let tag = runtime::owner_id() % 1_000_000;
    let (cfg, mut pg, _db, _keys) = fresh(&format!("kafka_{tag}")).await;
    let topic = format!("sp-forge-{tag}");
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
    let partitions = kafka.ensure_topic(&topic, 2).await.unwrap();
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
    let (ids, genuine) = publish_signed(&cfg, &mut pg, &kafka, &route, 20).await;

    // The forger: a plain Kafka producer with the genuine record's headers.
    let forgeries = look_alikes(&headers_of(&genuine), &genuine.payload);
    let mut pc = rdkafka::ClientConfig::new();
    pc.set("bootstrap.servers", common::kafka_brokers());
    for (k, v) in &kcfg.client_properties {
        pc.set(k, v);
    }
    let producer: rdkafka::producer::FutureProducer = pc.create().unwrap();
    for Forgery {
        what,
        headers,
        body,
        ..
    } in &forgeries
    {
        let mut h = OwnedHeaders::new();
        for (k, v) in headers {
            h = h.insert(Header {
                key: k,
                value: Some(v.as_str()),
            });
        }
        producer
            .send(
                rdkafka::producer::FutureRecord::to(&topic)
                    .key(&genuine.destination.routing_key)
                    .payload(body)
                    .headers(h),
                Duration::from_secs(10),
            )
            .await
            .unwrap_or_else(|(e, _)| panic!("the forger publishes ({what}): {e}"));
    }
    let signed = sealpost_kafka::KafkaSubscription::subscribe(&kcfg, &topic, "signed").unwrap();
    let open = sealpost_kafka::KafkaSubscription::subscribe(&kcfg, &topic, "open").unwrap();
    consume_and_check(&cfg, &pg, signed, open, &ids, &forgeries).await;
}
