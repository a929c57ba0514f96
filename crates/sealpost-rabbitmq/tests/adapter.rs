//! The adapter against the real RabbitMQ (127.0.0.1:5672, or `RABBITMQ_URL`), with no
//! database: how each broker answer maps to a [`SendResult`], the headers and properties a
//! consumer sees, the deadline, and the lookup that cannot be asked. Every test uses its own
//! exchange and queues and deletes them at the end.

#[path = "../../sealpost/tests/common/teardown_rabbitmq.rs"]
mod teardown_rabbitmq;

use std::time::{Duration, Instant};

use futures::StreamExt;
use sealpost_core::envelope::{Destination, EventId, PartitionAlgorithm, PAYLOAD_DOMAIN};
use sealpost_core::port::{Broker, NeverSentReason, RefusalKind, SendRequest, SendResult};
use sealpost_core::reconcile::Lookup;
use sealpost_core::Digest;
use sealpost_rabbitmq::lapin::options::{BasicAckOptions, BasicConsumeOptions};
use sealpost_rabbitmq::lapin::types::FieldTable;
use sealpost_rabbitmq::{delivery_of, header_str, queue_name, Rabbit, H_ATTEMPT_ID};

const CLUSTER: &str = "rabbitmq-local";

fn url() -> String {
    std::env::var("RABBITMQ_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

fn destination(cluster: &str, topic: &str, routing_key: &str) -> Destination {
    Destination {
        cluster: cluster.into(),
        topic: topic.into(),
        routing_key: routing_key.into(),
        partition_algorithm: PartitionAlgorithm::None,
        route_policy_generation: 1,
        serializer: "json.v1".into(),
        durability: "quorum".into(),
        required_ack: "confirm".into(),
        ordering: sealpost_core::envelope::EventOrdering::Unordered,
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
        envelope: Default::default(),
        signature: None,
    }
}

fn later() -> Instant {
    Instant::now() + Duration::from_secs(30)
}

/// A fresh exchange name per test run.
fn topic(tag: &str) -> String {
    let r = uuid::Uuid::now_v7().as_u128() as u64 % 1_000_000_000;
    format!("sp-test-{tag}-{r}")
}

async fn connect(name: &str) -> Rabbit {
    Rabbit::connect(&url(), CLUSTER, Duration::from_secs(5), name)
        .await
        .expect("RabbitMQ must be running at 127.0.0.1:5672 (guest/guest)")
}

#[tokio::test]
async fn a_confirm_is_a_receipt_at_the_attempt_and_the_consumer_sees_the_headers() {
    let t = topic("ack");
    // The exchange and queue `c1`, removed when the test ends (pass or fail).
    let _destination = teardown_rabbitmq::destination(&url(), &t, &["c1"]);
    let rabbit = connect(&t).await;
    let consumers = vec!["c1".to_string()];
    rabbit.ensure_destination(&t, &consumers).await.unwrap();
    assert!(!rabbit.capabilities().lookup_by_event_id);
    assert!(!rabbit.capabilities().create_if_absent);
    let d = destination(CLUSTER, &t, "tenant-1.order.o-1");
    let reqs = vec![request(&d, 41, b"{\"a\":1}"), request(&d, 42, b"{\"a\":2}")];
    let ids: Vec<EventId> = reqs.iter().map(|r| r.event_id).collect();
    let out = rabbit.send_batch(reqs.clone(), later()).await;
    for (r, o) in reqs.iter().zip(&out) {
        let SendResult::Receipt(rc) = o else {
            panic!("expected a receipt, got {o:?}")
        };
        assert_eq!((rc.event_id, rc.attempt_id), (r.event_id, r.attempt_id));
        assert_eq!((rc.stream.as_str(), rc.partition), (t.as_str(), None));
        assert_eq!(rc.sequence, r.attempt_id, "the position is the attempt id");
        assert_eq!(rc.cluster, CLUSTER);
    }
    // The queue holds both, persistent, with the event id as message id and our headers.
    let ch = rabbit_channel().await;
    let mut consumer = ch
        .basic_consume(
            queue_name(&t, "c1").as_str().into(),
            "test".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    for (i, id) in ids.iter().enumerate() {
        let m = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await
            .expect("a delivery")
            .unwrap()
            .unwrap();
        let got = delivery_of(m.exchange.as_str(), &m.properties).expect("Sealpost headers");
        assert_eq!(got.event_id, *id);
        assert_eq!(got.stream, t);
        assert_eq!(got.sequence, 41 + i as u64);
        assert_eq!(
            got.claimed_digest,
            Digest::of_bytes(PAYLOAD_DOMAIN, &m.data)
        );
        assert_eq!(
            m.properties.message_id().as_ref().map(|s| s.to_string()),
            Some(id.to_string())
        );
        assert_eq!(*m.properties.delivery_mode(), Some(2));
        assert_eq!(
            header_str(&m.properties, H_ATTEMPT_ID).as_deref(),
            Some(&*(41 + i).to_string())
        );
        m.ack(BasicAckOptions::default()).await.unwrap();
    }
    assert_eq!(
        rabbit.lookup(&d, ids[0], 0).await,
        Lookup::Unqueryable,
        "RabbitMQ cannot be asked"
    );
    rabbit.delete_destination(&t, &consumers).await.unwrap();
}

async fn rabbit_channel() -> sealpost_rabbitmq::lapin::Channel {
    let c = sealpost_rabbitmq::lapin::Connection::connect(&url(), Default::default())
        .await
        .unwrap();
    let ch = c.create_channel().await.unwrap();
    // Keep the connection open for the test's duration.
    std::mem::forget(c);
    ch
}

#[tokio::test]
async fn an_unroutable_message_is_a_refusal_in_the_brokers_words() {
    let t = topic("noroute");
    // The exchange and queue `c1`, removed when the test ends (pass or fail).
    let _destination = teardown_rabbitmq::destination(&url(), &t, &["c1"]);
    let rabbit = connect(&t).await;
    // The exchange exists, but no queue is bound.
    rabbit.ensure_destination(&t, &[]).await.unwrap();
    let d = destination(CLUSTER, &t, "k");
    let out = rabbit
        .send_batch(vec![request(&d, 7, b"x"), request(&d, 8, b"y")], later())
        .await;
    for o in &out {
        match o {
            SendResult::Refused {
                kind: RefusalKind::Rejected,
                detail,
            } => assert!(detail.contains("NO_ROUTE"), "{detail}"),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
    // The channel stays usable: a bound queue makes the next send a receipt.
    rabbit
        .ensure_destination(&t, &["c1".to_string()])
        .await
        .unwrap();
    let out = rabbit.send_batch(vec![request(&d, 9, b"z")], later()).await;
    assert!(matches!(out[0], SendResult::Receipt(_)), "{out:?}");
    rabbit
        .delete_destination(&t, &["c1".to_string()])
        .await
        .unwrap();
}

#[tokio::test]
async fn a_missing_exchange_wrong_cluster_and_passed_deadline_are_never_sent() {
    let t = topic("missing");
    // The exchange and queue `c1`, removed when the test ends (pass or fail).
    let _destination = teardown_rabbitmq::destination(&url(), &t, &["c1"]);
    let rabbit = connect(&t).await;
    let d = destination(CLUSTER, &t, "k");
    let out = rabbit.send_batch(vec![request(&d, 1, b"x")], later()).await;
    match &out[0] {
        SendResult::NeverSent(NeverSentReason::NoSuchDestination(why)) => {
            assert!(why.contains(&t) && why.contains("NOT_FOUND"), "{why}")
        }
        other => panic!("expected no such destination, got {other:?}"),
    }
    let other = destination("rabbitmq-elsewhere", &t, "k");
    let out = rabbit
        .send_batch(vec![request(&other, 2, b"x")], later())
        .await;
    assert!(
        matches!(
            out[0],
            SendResult::NeverSent(NeverSentReason::WrongCluster(_))
        ),
        "{out:?}"
    );
    rabbit
        .ensure_destination(&t, &["c1".to_string()])
        .await
        .unwrap();
    let past = Instant::now() - Duration::from_millis(1);
    let out = rabbit.send_batch(vec![request(&d, 3, b"x")], past).await;
    assert_eq!(
        out[0],
        SendResult::NeverSent(NeverSentReason::DeadlinePassed)
    );
    // The failed passive declare closed only its own channel: publishing still works.
    let out = rabbit.send_batch(vec![request(&d, 4, b"x")], later()).await;
    assert!(matches!(out[0], SendResult::Receipt(_)), "{out:?}");
    rabbit
        .delete_destination(&t, &["c1".to_string()])
        .await
        .unwrap();
}

/// A routing key over AMQP's 255-byte short string (it wrote a corrupt frame in release
/// builds) or a header value with a line break is refused alone; its neighbours are
/// confirmed.
#[tokio::test]
async fn an_unencodable_message_is_refused_alone_and_its_batch_is_sent() {
    let t = topic("enc");
    // The exchange and queue `c1`, removed when the test ends (pass or fail).
    let _destination = teardown_rabbitmq::destination(&url(), &t, &["c1"]);
    let rabbit = connect(&t).await;
    let consumers = vec!["c1".to_string()];
    rabbit.ensure_destination(&t, &consumers).await.unwrap();
    let d = destination(CLUSTER, &t, "k");
    let long = destination(CLUSTER, &t, &"k".repeat(300));
    let mut reqs = vec![
        request(&d, 1, b"{}"),
        request(&long, 2, b"{}"),
        request(&d, 3, b"{}"),
        request(&d, 4, b"{}"),
    ];
    reqs[2].envelope.event_type = "order.created\n".into();
    let out = rabbit.send_batch(reqs, later()).await;
    assert!(matches!(out[0], SendResult::Receipt(_)), "{:?}", out[0]);
    assert!(matches!(out[3], SendResult::Receipt(_)), "{:?}", out[3]);
    for (o, field) in [(&out[1], "`routing_key`"), (&out[2], "`event_type`")] {
        match o {
            SendResult::Refused {
                kind: RefusalKind::Unencodable,
                detail,
            } => assert!(detail.contains(field), "{detail}"),
            other => panic!("expected an Unencodable refusal, got {other:?}"),
        }
    }
    rabbit.delete_destination(&t, &consumers).await.unwrap();
}
