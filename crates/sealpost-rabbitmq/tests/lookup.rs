//! RabbitMQ that can be asked (issue 25, item 2): the lookup stream against the real
//! RabbitMQ (127.0.0.1:5672, or `RABBITMQ_URL`), with no database. A confirmed event is
//! found with the digest of the bytes the stream holds, one never sent is proven absent, a
//! look-alike is read with its own digest (never the header's claim), one scan answers a
//! group, the scan's markers reach no consumer queue, and what the stream cannot prove (an
//! event older than the stream, a destination without one) is "cannot be asked", never
//! "absent". Every test uses its own exchange, queues and stream, deleted at the end.

#[path = "../../sealpost/tests/common/teardown_rabbitmq.rs"]
mod teardown_rabbitmq;

use std::time::Duration;

use sealpost_core::envelope::{Destination, EventId, PartitionAlgorithm, PAYLOAD_DOMAIN};
use sealpost_core::port::{Broker, SendRequest, SendResult};
use sealpost_core::receipt::ReceiptSource;
use sealpost_core::reconcile::Lookup;
use sealpost_core::Digest;
use sealpost_rabbitmq::lapin::options::{BasicPublishOptions, QueueDeclareOptions};
use sealpost_rabbitmq::lapin::types::{AMQPValue, FieldTable, LongString};
use sealpost_rabbitmq::lapin::BasicProperties;
use sealpost_rabbitmq::{queue_name, LookupStream, Rabbit, RabbitConfig};

const CLUSTER: &str = "rabbitmq-local";

fn url() -> String {
    std::env::var("RABBITMQ_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

fn destination(topic: &str) -> Destination {
    Destination {
        cluster: CLUSTER.into(),
        topic: topic.into(),
        routing_key: "tenant-1.order.o-1".into(),
        partition_algorithm: PartitionAlgorithm::None,
        route_policy_generation: 1,
        serializer: "json.v1".into(),
        durability: "quorum".into(),
        required_ack: "confirm".into(),
        ordering: sealpost_core::envelope::EventOrdering::Unordered,
    }
}

fn request(destination: &Destination, attempt_id: u64, payload: &[u8]) -> SendRequest {
    SendRequest {
        event_id: EventId(*uuid::Uuid::now_v7().as_bytes()),
        member: 0,
        envelope_generation: 1,
        attempt_id,
        payload_digest: Digest::of_bytes(PAYLOAD_DOMAIN, payload),
        destination: destination.clone(),
        destination_digest: destination.digest(),
        payload: payload.to_vec(),
        envelope: Default::default(),
        signature: None,
    }
}

fn topic(tag: &str) -> String {
    let r = uuid::Uuid::now_v7().as_u128() as u64 % 1_000_000_000;
    format!("sp-lookup-{tag}-{r}")
}

/// The lookup stream on, scanning from an event's own mint time (one machine, one clock).
fn lookup() -> LookupStream {
    LookupStream {
        enabled: true,
        clock_margin_ms: 0,
        ..LookupStream::default()
    }
}

async fn connect(name: &str, with: Option<LookupStream>) -> Rabbit {
    let r = Rabbit::connect(&url(), CLUSTER, Duration::from_secs(5), name)
        .await
        .expect("RabbitMQ must be running at 127.0.0.1:5672 (guest/guest)");
    match with {
        Some(l) => r.with_lookup_stream(l),
        None => r,
    }
}

async fn ready(queue: &str) -> u32 {
    let c = sealpost_rabbitmq::lapin::Connection::connect(&url(), Default::default())
        .await
        .unwrap();
    let ch = c.create_channel().await.unwrap();
    let q = ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let _ = c.close(200, "done".into()).await;
    q.message_count()
}

#[tokio::test]
async fn a_confirmed_event_is_found_a_never_sent_one_is_absent_and_one_scan_answers_both() {
    let t = topic("found");
    let _guard = teardown_rabbitmq::destination(&url(), &t, &["c1"]);
    let rabbit = connect(&t, Some(lookup())).await;
    let caps = rabbit.capabilities();
    assert!(caps.lookup_by_event_id && caps.lookup_scan.is_some());
    assert!(!caps.create_if_absent, "a stream refuses no second copy");
    rabbit
        .ensure_destination(&t, &["c1".to_string()])
        .await
        .unwrap();
    let d = destination(&t);
    let sent = request(&d, 7, b"{\"order\":1}");
    let never = request(&d, 8, b"{\"order\":2}");
    let out = rabbit
        .send_batch(
            vec![sent.clone()],
            std::time::Instant::now() + Duration::from_secs(30),
        )
        .await;
    assert!(matches!(out[0], SendResult::Receipt(_)), "{out:?}");

    let found = rabbit.lookup(&d, sent.event_id, 0).await;
    let Lookup::Copies(copies) = &found else {
        panic!("the confirmed event must be found, got {found:?}")
    };
    assert_eq!(copies.len(), 1);
    let r = &copies[0].receipt;
    assert_eq!(
        (r.event_id, r.attempt_id, r.sequence),
        (sent.event_id, 7, 7),
        "the position is the attempt id, as a confirm's"
    );
    assert_eq!(r.payload_digest, sent.payload_digest);
    assert_eq!(
        (r.stream.as_str(), r.partition, r.source),
        (t.as_str(), None, ReceiptSource::Lookup)
    );
    assert_eq!(rabbit.lookup(&d, never.event_id, 0).await, Lookup::Absent);

    let both = rabbit
        .lookup_many(&d, &[(never.event_id, 0), (sent.event_id, 0)])
        .await;
    assert_eq!(both[0], Lookup::Absent);
    assert!(matches!(both[1], Lookup::Copies(_)), "{both:?}");

    // The scans' markers went to the stream alone: the consumer's queue holds the one event.
    assert_eq!(ready(&queue_name(&t, "c1")).await, 1);
    rabbit
        .delete_destination(&t, &["c1".to_string()])
        .await
        .unwrap();
}

#[tokio::test]
async fn a_look_alike_is_read_with_the_digest_of_its_own_bytes() {
    let t = topic("forged");
    let _guard = teardown_rabbitmq::destination(&url(), &t, &["c1"]);
    let rabbit = connect(&t, Some(lookup())).await;
    rabbit
        .ensure_destination(&t, &["c1".to_string()])
        .await
        .unwrap();
    let d = destination(&t);
    let genuine = request(&d, 9, b"{\"total_cents\":100}");
    // Someone who may publish puts the event's headers on another payload, with a header
    // digest that matches that payload.
    let forged = b"{\"total_cents\":1}".to_vec();
    let mut h = FieldTable::default();
    let s = |v: String| AMQPValue::LongString(LongString::from(v));
    for (k, v) in [
        (sealpost_rabbitmq::H_EVENT_ID, genuine.event_id.to_string()),
        (sealpost_rabbitmq::H_MEMBER, "0".to_string()),
        (sealpost_rabbitmq::H_ENVELOPE_GENERATION, "1".to_string()),
        (sealpost_rabbitmq::H_ATTEMPT_ID, "99".to_string()),
        (
            sealpost_rabbitmq::H_PAYLOAD_DIGEST,
            Digest::of_bytes(PAYLOAD_DOMAIN, &forged).to_prefixed_hex(),
        ),
        (
            sealpost_rabbitmq::H_DESTINATION_DIGEST,
            genuine.destination_digest.to_prefixed_hex(),
        ),
    ] {
        h.insert(k.into(), s(v));
    }
    let c = sealpost_rabbitmq::lapin::Connection::connect(&url(), Default::default())
        .await
        .unwrap();
    let ch = c.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    ch.basic_publish(
        t.as_str().into(),
        "x".into(),
        BasicPublishOptions::default(),
        &forged,
        BasicProperties::default().with_headers(h),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let _ = c.close(200, "done".into()).await;
    rabbit
        .send_batch(
            vec![genuine.clone()],
            std::time::Instant::now() + Duration::from_secs(30),
        )
        .await;
    let Lookup::Copies(copies) = rabbit.lookup(&d, genuine.event_id, 0).await else {
        panic!("both copies must be read")
    };
    let digests: Vec<Digest> = copies.iter().map(|c| c.receipt.payload_digest).collect();
    assert_eq!(
        digests,
        [
            Digest::of_bytes(PAYLOAD_DOMAIN, &forged),
            genuine.payload_digest
        ],
        "every copy, oldest first, each with the digest of the bytes stored"
    );
    rabbit
        .delete_destination(&t, &["c1".to_string()])
        .await
        .unwrap();
}

#[tokio::test]
async fn what_the_stream_cannot_prove_is_cannot_be_asked_never_absent() {
    // An event minted before its destination's stream existed: the stream cannot know
    // whether it was published before it began.
    let t = topic("older");
    let _guard = teardown_rabbitmq::destination(&url(), &t, &["c1"]);
    let d = destination(&t);
    let early = request(&d, 1, b"{}");
    tokio::time::sleep(Duration::from_millis(20)).await;
    let rabbit = connect(&t, Some(lookup())).await;
    rabbit
        .ensure_destination(&t, &["c1".to_string()])
        .await
        .unwrap();
    assert_eq!(
        rabbit.lookup(&d, early.event_id, 0).await,
        Lookup::Unqueryable
    );
    // An event minted after it: proven absent.
    let later = request(&d, 2, b"{}");
    assert_eq!(rabbit.lookup(&d, later.event_id, 0).await, Lookup::Absent);

    // A destination declared without a stream (lookups switched on later): cannot be asked.
    let bare = topic("bare");
    let _guard2 = teardown_rabbitmq::destination(&url(), &bare, &["c1"]);
    connect(&bare, None)
        .await
        .ensure_destination(&bare, &["c1".to_string()])
        .await
        .unwrap();
    let bd = destination(&bare);
    let e = request(&bd, 3, b"{}");
    assert_eq!(rabbit.lookup(&bd, e.event_id, 0).await, Lookup::Unqueryable);
    // Without the lookup stream the adapter cannot be asked at all.
    let plain = connect(&bare, None).await;
    assert!(!plain.capabilities().lookup_by_event_id);
    assert_eq!(
        plain.lookup(&d, later.event_id, 0).await,
        Lookup::Unqueryable
    );
}

#[test]
fn a_bad_lookup_setting_is_named() {
    let mut c = RabbitConfig::default();
    c.lookup.enabled = true;
    c.lookup.max_age = "seven days".into();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let e = rt
        .block_on(c.connect(Duration::from_secs(1), "bad"))
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("lookup.max_age") && e.contains("7D"), "{e}");
}
