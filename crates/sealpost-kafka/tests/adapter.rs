//! The adapter against a real Kafka-protocol broker (`KAFKA_BROKERS`, default 127.0.0.1:9092;
//! `.ci/run` starts tansu there), with no database: receipts in the frozen partition with
//! Sealpost's headers, the partition a Java client would choose, the bounded lookup, refusals
//! and the deadline. Every test uses its own topic and deletes it at the end.

#[path = "../../sealpost/tests/common/teardown_kafka.rs"]
mod teardown_kafka;

use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use sealpost_core::envelope::{
    Destination, EventId, EventOrdering, PartitionAlgorithm, PAYLOAD_DOMAIN,
};
use sealpost_core::port::{
    Broker, NeverSentReason, RefusalKind, SendRequest, SendResult, WireEnvelope,
};
use sealpost_core::reconcile::Lookup;
use sealpost_core::Digest;
use sealpost_kafka::{rdkafka, Kafka, KafkaConfig, H_ATTEMPT_ID, H_EVENT_ID};

const CLUSTER: &str = "kafka-local";

fn brokers() -> String {
    std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

fn destination(topic: &str, routing_key: &str, partitions: u32) -> Destination {
    Destination {
        cluster: CLUSTER.into(),
        topic: topic.into(),
        routing_key: routing_key.into(),
        partition_algorithm: PartitionAlgorithm::KafkaMurmur2 { partitions },
        route_policy_generation: 1,
        serializer: "json.v1".into(),
        durability: "all".into(),
        required_ack: "all".into(),
        ordering: EventOrdering::Unordered,
    }
}

fn request(destination: &Destination, attempt_id: u64, payload: &[u8]) -> SendRequest {
    let n = uuid::Uuid::now_v7();
    SendRequest {
        event_id: EventId(*n.as_bytes()),
        member: 0,
        envelope_generation: 1,
        attempt_id,
        payload_digest: Digest::of_bytes(PAYLOAD_DOMAIN, payload),
        destination: destination.clone(),
        destination_digest: destination.digest(),
        payload: payload.to_vec(),
        envelope: WireEnvelope {
            event_type: "order.created.v1".into(),
            aggregate_type: "order".into(),
            aggregate_id: destination.routing_key.clone(),
            aggregate_version: 3,
            occurred_at_ms: 1_764_000_000_000,
            tenant: "tenant-1".into(),
            payload_schema_digest: Digest([9; 32]),
        },
        signature: None,
    }
}

fn later() -> Instant {
    Instant::now() + Duration::from_secs(30)
}

fn topic(tag: &str) -> String {
    let r = uuid::Uuid::now_v7().as_u128() as u64 % 1_000_000_000;
    format!("sp-test-{tag}-{r}")
}

/// `KAFKA_CLIENT_PROPERTIES` (`.ci/run` sets `batch.num.messages=1` for tansu 0.6, whose
/// high watermark is the last batch's base offset + 1).
fn properties() -> Vec<(String, String)> {
    sealpost_kafka::parse_properties(&std::env::var("KAFKA_CLIENT_PROPERTIES").unwrap_or_default())
        .expect("KAFKA_CLIENT_PROPERTIES: key=value[,key=value]")
}

async fn connect() -> Kafka {
    let mut cfg = KafkaConfig::new(&brokers(), CLUSTER, Duration::from_secs(5));
    cfg.client_properties = properties();
    Kafka::connect(cfg)
        .await
        .expect("a Kafka-protocol broker must listen on 127.0.0.1:9092 (.ci/run starts tansu)")
}

/// Reads partition `p` of `topic` from offset `from`, `n` records.
fn read(topic: &str, p: i32, from: i64, n: usize) -> Vec<rdkafka::message::OwnedMessage> {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", "sealpost-test-reader")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, p, Offset::Offset(from))
        .unwrap();
    c.assign(&tpl).unwrap();
    let mut out = Vec::new();
    let until = Instant::now() + Duration::from_secs(20);
    while out.len() < n && Instant::now() < until {
        if let Some(m) = c.poll(Duration::from_millis(200)) {
            out.push(m.unwrap().detach());
        }
    }
    out
}

fn header(m: &rdkafka::message::OwnedMessage, name: &str) -> Option<String> {
    let h = m.headers()?;
    h.iter()
        .find(|x| x.key == name)
        .and_then(|x| x.value)
        .map(|v| String::from_utf8_lossy(v).into_owned())
}

#[tokio::test]
async fn a_receipt_names_the_frozen_partition_and_the_record_carries_the_envelope() {
    let t = topic("ack");
    let kafka = connect().await;
    // Deleted when the test ends, pass or fail.
    let _topic = teardown_kafka::topic(kafka.config(), &t);
    assert_eq!(kafka.ensure_topic(&t, 4).await.unwrap(), 4);
    let caps = kafka.capabilities();
    assert!(caps.lookup_by_event_id && caps.per_key_ordering && !caps.create_if_absent);
    let reqs: Vec<SendRequest> = (0..20)
        .map(|i| request(&destination(&t, &format!("order-{i}"), 4), 100 + i, b"{}"))
        .collect();
    let out = kafka.send_batch(reqs.clone(), later()).await;
    let mut partitions_used = std::collections::HashSet::new();
    for (r, o) in reqs.iter().zip(&out) {
        let SendResult::Receipt(rc) = o else {
            panic!("expected a receipt, got {o:?}")
        };
        assert_eq!(rc.partition, r.destination.partition(), "{rc:?}");
        assert!(rc.sequence >= 1);
        assert_eq!((rc.event_id, rc.attempt_id), (r.event_id, r.attempt_id));
        assert_eq!(rc.stream, t);
        partitions_used.insert(rc.partition);
        // The stored record, read back at offset = sequence - 1.
        let m = read(&t, rc.partition.unwrap() as i32, rc.sequence as i64 - 1, 1);
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].key(), Some(r.destination.routing_key.as_bytes()));
        assert_eq!(header(&m[0], H_EVENT_ID), Some(r.event_id.to_string()));
        assert_eq!(header(&m[0], H_ATTEMPT_ID), Some(r.attempt_id.to_string()));
        let wire = WireEnvelope::from_headers(|n| {
            m[0].headers()?
                .iter()
                .find(|x| x.key == n)
                .and_then(|x| x.value)
                .and_then(|v| std::str::from_utf8(v).ok())
        });
        assert_eq!(wire.as_ref(), Some(&r.envelope));
    }
    assert!(
        partitions_used.len() > 1,
        "20 keys over 4 partitions used one"
    );
    kafka.delete_topic(&t).await.unwrap();
}

/// librdkafka's `murmur2_random` partitioner is the Java client's default for keyed records:
/// records produced *without* a partition land where Sealpost's frozen algorithm says.
#[tokio::test]
async fn sealposts_partition_is_the_one_the_java_partitioner_chooses() {
    let t = topic("java");
    let kafka = connect().await;
    // Deleted when the test ends, pass or fail.
    let _topic = teardown_kafka::topic(kafka.config(), &t);
    kafka.ensure_topic(&t, 6).await.unwrap();
    let p: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("partitioner", "murmur2_random")
        .create()
        .unwrap();
    for i in 0..40 {
        let key = format!("tenant-1.order.o-{i}-{}", i * 7919);
        let d = p
            .send(
                FutureRecord::to(&t).key(key.as_bytes()).payload("x"),
                Duration::from_secs(5),
            )
            .await
            .unwrap();
        let ours = PartitionAlgorithm::KafkaMurmur2 { partitions: 6 }.partition_of(&key);
        assert_eq!(Some(d.partition as u32), ours, "key {key}");
    }
    kafka.delete_topic(&t).await.unwrap();
}

/// A topic with more partitions than the destination froze (what a partition expansion
/// leaves behind): every record still goes where the frozen count says, so an aggregate's
/// events never change partition.
#[tokio::test]
async fn more_partitions_than_frozen_move_no_aggregate() {
    let t = topic("grow");
    let kafka = connect().await;
    // Deleted when the test ends, pass or fail.
    let _topic = teardown_kafka::topic(kafka.config(), &t);
    kafka.ensure_topic(&t, 8).await.unwrap();
    for i in 0..30 {
        let key = format!("order-{i}");
        let frozen = destination(&t, &key, 3);
        let out = kafka
            .send_batch(vec![request(&frozen, 1, b"{}")], later())
            .await;
        let SendResult::Receipt(rc) = &out[0] else {
            panic!("{out:?}")
        };
        let p = rc.partition.unwrap();
        assert!(p < 3, "frozen over 3 partitions, landed in {p}");
        assert_eq!(Some(p), frozen.partition());
    }
    kafka.delete_topic(&t).await.unwrap();
}

#[tokio::test]
async fn lookup_finds_the_stored_record_and_proves_an_unsent_one_absent() {
    let t = topic("lookup");
    let kafka = connect().await;
    // Deleted when the test ends, pass or fail.
    let _topic = teardown_kafka::topic(kafka.config(), &t);
    kafka.ensure_topic(&t, 2).await.unwrap();
    let d = destination(&t, "order-7", 2);
    let reqs: Vec<SendRequest> = (0..50).map(|i| request(&d, 500 + i, b"{}")).collect();
    let out = kafka.send_batch(reqs.clone(), later()).await;
    let target = &reqs[37];
    let SendResult::Receipt(acked) = &out[37] else {
        panic!("{out:?}")
    };
    match kafka.lookup(&d, target.event_id, 0).await {
        // Unjudged: the reader judges its seal (`sealpost_core::signature::judge_copy`).
        Lookup::Copies(c) => {
            assert_eq!(c.len(), 1, "{c:?}");
            let r = c[0].receipt.clone();
            assert_eq!((r.partition, r.sequence), (acked.partition, acked.sequence));
            assert_eq!(r.attempt_id, target.attempt_id);
            assert_eq!(r.payload_digest, target.payload_digest);
            assert_eq!(r.destination_digest, target.destination_digest);
        }
        other => panic!("expected Found, got {other:?}"),
    }
    // Member 1 of the same event was never sent.
    assert_eq!(kafka.lookup(&d, target.event_id, 1).await, Lookup::Absent);
    let never = request(&d, 1, b"{}");
    assert_eq!(kafka.lookup(&d, never.event_id, 0).await, Lookup::Absent);
    // Another cluster cannot be asked through this connection.
    let mut elsewhere = d.clone();
    elsewhere.cluster = "kafka-other".into();
    assert_eq!(
        kafka.lookup(&elsewhere, target.event_id, 0).await,
        Lookup::Unavailable
    );
    kafka.delete_topic(&t).await.unwrap();
}

#[tokio::test]
async fn an_oversized_payload_is_refused_and_a_passed_deadline_sends_nothing() {
    let t = topic("refuse");
    let kafka = connect().await;
    // Deleted when the test ends, pass or fail.
    let _topic = teardown_kafka::topic(kafka.config(), &t);
    kafka.ensure_topic(&t, 1).await.unwrap();
    let d = destination(&t, "order-1", 1);
    let big = vec![b'x'; 2 * 1024 * 1024];
    let out = kafka.send_batch(vec![request(&d, 1, &big)], later()).await;
    assert!(
        matches!(
            &out[0],
            SendResult::Refused {
                kind: RefusalKind::PayloadTooLarge,
                ..
            }
        ),
        "{out:?}"
    );
    let soon = Instant::now() + Duration::from_millis(500);
    let out = kafka.send_batch(vec![request(&d, 2, b"{}")], soon).await;
    assert_eq!(
        out[0],
        SendResult::NeverSent(NeverSentReason::DeadlinePassed)
    );
    let mut none = d.clone();
    none.partition_algorithm = PartitionAlgorithm::None;
    let out = kafka
        .send_batch(vec![request(&none, 3, b"{}")], later())
        .await;
    assert!(
        matches!(&out[0], SendResult::Refused { kind: RefusalKind::Rejected, detail } if detail.contains("kafka-murmur2")),
        "{out:?}"
    );
    // Nothing of the three was stored.
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", "sealpost-test-reader")
        .create()
        .unwrap();
    let (low, high) = c.fetch_watermarks(&t, 0, Duration::from_secs(5)).unwrap();
    assert_eq!(high - low, 0);
    kafka.delete_topic(&t).await.unwrap();
}

#[tokio::test]
async fn an_unreachable_broker_is_a_clear_error() {
    let e = Kafka::connect(KafkaConfig::new(
        "127.0.0.1:1",
        CLUSTER,
        Duration::from_secs(2),
    ))
    .await
    .err()
    .expect("nothing listens on port 1");
    let msg = e.to_string();
    assert!(
        msg.contains("127.0.0.1:1") && msg.contains("KAFKA_BROKERS"),
        "{msg}"
    );
}

/// A message with a header value no broker carries (a line break, 64 KiB) is refused alone;
/// its neighbours are stored.
#[tokio::test]
async fn an_unencodable_message_is_refused_alone_and_its_batch_is_sent() {
    let t = topic("enc");
    let kafka = connect().await;
    // Deleted when the test ends, pass or fail.
    let _topic = teardown_kafka::topic(kafka.config(), &t);
    assert_eq!(kafka.ensure_topic(&t, 1).await.unwrap(), 1);
    let d = destination(&t, "k", 1);
    let mut reqs: Vec<SendRequest> = (0..4).map(|i| request(&d, 10 + i, b"{}")).collect();
    reqs[1].envelope.aggregate_id = "o-\u{7}\u{1b}[31m".into();
    reqs[2].envelope.tenant = "t".repeat(64 * 1024);
    let out = kafka.send_batch(reqs, later()).await;
    assert!(matches!(out[0], SendResult::Receipt(_)), "{:?}", out[0]);
    assert!(matches!(out[3], SendResult::Receipt(_)), "{:?}", out[3]);
    for (o, field) in [(&out[1], "`aggregate_id`"), (&out[2], "`tenant`")] {
        match o {
            SendResult::Refused {
                kind: RefusalKind::Unencodable,
                detail,
            } => assert!(detail.contains(field), "{detail}"),
            other => panic!("expected an Unencodable refusal, got {other:?}"),
        }
    }
    kafka.delete_topic(&t).await.unwrap();
}

/// Simulator finding (issue 23): Kafka refuses no second copy, so a look-alike can sit in the
/// frozen partition *before* the genuine record (published by anyone who may write the
/// topic). The lookup reads every copy in its range, oldest first, and the reader adopts
/// the sealed one; before, the scan kept the first match and the genuine record was never
/// found (the row was retried forever beside the forgery).
#[tokio::test]
async fn a_look_alike_before_the_genuine_record_does_not_hide_it() {
    use rdkafka::message::{Header, OwnedHeaders};
    use sealpost_core::signature::{judge_copy, Crypto, SignatureHeader, SignaturePolicy};
    let t = topic("shadow");
    let kafka = connect().await;
    let _topic = teardown_kafka::topic(kafka.config(), &t);
    kafka.ensure_topic(&t, 2).await.unwrap();
    let d = destination(&t, "order-9", 2);
    let mut genuine = request(&d, 900, b"{\"order\":\"o-9\"}");
    genuine.signature = Some(
        SignatureHeader {
            key_id: "k-1".into(),
            signature: [9; sealpost_core::signature::SIGNATURE_LEN],
        }
        .format(),
    );
    // The forger writes first, into the event's frozen partition, with its headers.
    let mut producer = ClientConfig::new();
    producer.set("bootstrap.servers", brokers());
    for (k, v) in properties() {
        producer.set(&k, &v);
    }
    let producer: FutureProducer = producer.create().unwrap();
    let mut h = OwnedHeaders::new();
    for (k, v) in [
        (H_EVENT_ID, genuine.event_id.to_string()),
        (sealpost_kafka::H_MEMBER, "0".to_string()),
        (sealpost_kafka::H_ENVELOPE_GENERATION, "1".to_string()),
        (H_ATTEMPT_ID, "900".to_string()),
        (
            sealpost_kafka::H_PAYLOAD_DIGEST,
            genuine.payload_digest.to_prefixed_hex(),
        ),
        (
            sealpost_kafka::H_DESTINATION_DIGEST,
            genuine.destination_digest.to_prefixed_hex(),
        ),
    ] {
        h = h.insert(Header {
            key: k,
            value: Some(v.as_str()),
        });
    }
    let partition = d.partition().unwrap() as i32;
    producer
        .send(
            FutureRecord::to(&t)
                .partition(partition)
                .key("order-9")
                .payload("{\"order\":\"o-9\",\"total_cents\":1}")
                .headers(h),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    let SendResult::Receipt(acked) = kafka
        .send_batch(vec![genuine.clone()], later())
        .await
        .remove(0)
    else {
        panic!("genuine send")
    };
    let Lookup::Copies(copies) = kafka.lookup(&d, genuine.event_id, 0).await else {
        panic!("copies expected")
    };
    assert_eq!(copies.len(), 2, "both copies are read: {copies:?}");
    assert!(
        copies[0].receipt.sequence < copies[1].receipt.sequence,
        "oldest first"
    );
    let judged = judge_copy(
        Lookup::Copies(copies),
        SignaturePolicy::Require,
        |_, _, _| Crypto::Valid,
    );
    match judged {
        Lookup::Found(r) => {
            assert_eq!((r.partition, r.sequence), (acked.partition, acked.sequence));
            assert_eq!(r.payload_digest, genuine.payload_digest);
        }
        other => panic!("the genuine record is found: {other:?}"),
    }
    kafka.delete_topic(&t).await.unwrap();
}
