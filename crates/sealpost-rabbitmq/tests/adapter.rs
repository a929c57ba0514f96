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

// Broker rights (docs/security.md): each test makes a vhost of its own and the users of
// docs/rabbitmq-permissions.sh, by running that script (the template is what is tested), and
// removes the vhost and the users when it ends (pass or fail).

/// A vhost with a dispatcher and a consumer user as docs/rabbitmq-permissions.sh makes them,
/// for the exchange `ORDERS` and the consumer `fulfilment`; `guest` administers it.
struct Rights {
    vhost: String,
    dispatcher: String,
    consumer: String,
    dir: std::path::PathBuf,
    _guard: teardown_rabbitmq::Teardown,
}

fn rabbitmqctl(args: &[&str]) -> Result<(), String> {
    let out = std::process::Command::new("rabbitmqctl")
        .arg("-q")
        .args(args)
        .output()
        .map_err(|e| format!("rabbitmqctl {args:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "rabbitmqctl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

impl Rights {
    /// `None` (the test is skipped) only outside CI when there is no `rabbitmqctl`.
    fn make() -> Option<Rights> {
        Rights::make_with(false)
    }

    /// [`Rights::make`], the script told whether the exchange has a lookup stream.
    fn make_with(lookup_stream: bool) -> Option<Rights> {
        if std::process::Command::new("rabbitmqctl")
            .arg("help")
            .output()
            .is_err()
        {
            // .ci/run runs as root next to the broker: there it must work.
            assert!(
                std::env::var("CI").is_err(),
                "the broker rights tests need rabbitmqctl (run as root on the RabbitMQ node)"
            );
            eprintln!("skipped: no rabbitmqctl");
            return None;
        }
        let n = uuid::Uuid::now_v7().as_u128() as u64 % 1_000_000_000;
        let vhost = format!("sealpost-rights-{n}");
        let dispatcher = format!("sealpost_dispatcher_{n}");
        let consumer = format!("sealpost_consumer_{n}");
        let guard = {
            let (vhost, dispatcher, consumer) =
                (vhost.clone(), dispatcher.clone(), consumer.clone());
            teardown_rabbitmq::Teardown::new(
                format!("RabbitMQ vhost {vhost} and users {dispatcher}, {consumer}"),
                move || async move {
                    // Users that were never made are fine; the vhost goes with what is in it.
                    let _ = rabbitmqctl(&["delete_user", &dispatcher]);
                    let _ = rabbitmqctl(&["delete_user", &consumer]);
                    rabbitmqctl(&["delete_vhost", &vhost])
                },
            )
        };
        let dir = std::env::temp_dir().join(&vhost);
        std::fs::create_dir_all(&dir).unwrap();
        for user in [&dispatcher, &consumer] {
            std::fs::write(dir.join(user), format!("pw-{user}\n")).unwrap();
        }
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../docs/rabbitmq-permissions.sh"
        );
        let out = std::process::Command::new("sh")
            .arg(script)
            .env("SEALPOST_VHOST", &vhost)
            .env("SEALPOST_EXCHANGE", "ORDERS")
            .env("SEALPOST_CONSUMER", "fulfilment")
            .env("SEALPOST_DISPATCHER_USER", &dispatcher)
            .env("SEALPOST_DISPATCHER_PASSWORD_FILE", dir.join(&dispatcher))
            .env("SEALPOST_CONSUMER_USER", &consumer)
            .env("SEALPOST_CONSUMER_PASSWORD_FILE", dir.join(&consumer))
            .env(
                "SEALPOST_LOOKUP_STREAM",
                if lookup_stream { "1" } else { "0" },
            )
            .output()
            .expect("sh");
        assert!(
            out.status.success(),
            "docs/rabbitmq-permissions.sh failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        rabbitmqctl(&["set_permissions", "-p", &vhost, "guest", ".*", ".*", ".*"]).unwrap();
        Some(Rights {
            vhost,
            dispatcher,
            consumer,
            dir,
            _guard: guard,
        })
    }

    /// The URL of `user` in the vhost, without a password (it is in the user's file).
    fn url_of(&self, user: &str) -> String {
        format!("amqp://{user}@127.0.0.1:5672/{}", self.vhost)
    }

    fn options_of(&self, user: &str) -> sealpost_rabbitmq::RabbitOptions {
        sealpost_rabbitmq::RabbitOptions {
            password_file: Some(self.dir.join(user)),
            ..Default::default()
        }
    }

    /// The adapter as `user` (`guest` is the administrator).
    async fn connect(&self, user: &str) -> Rabbit {
        let (url, options) = if user == "guest" {
            (
                format!("amqp://guest:guest@127.0.0.1:5672/{}", self.vhost),
                Default::default(),
            )
        } else {
            (self.url_of(user), self.options_of(user))
        };
        Rabbit::connect_with(&url, CLUSTER, Duration::from_secs(5), user, &options)
            .await
            .unwrap_or_else(|e| panic!("connect as {user}: {e}"))
    }

    /// A plain connection as `user`, independent of the adapter.
    async fn witness(&self, user: &str) -> sealpost_rabbitmq::lapin::Connection {
        let url = format!("amqp://{user}:pw-{user}@127.0.0.1:5672/{}", self.vhost);
        sealpost_rabbitmq::lapin::Connection::connect(&url, Default::default())
            .await
            .unwrap_or_else(|e| panic!("connect as {user}: {e}"))
    }

    /// Messages ready in `queue`, as the administrator sees them.
    async fn ready(&self, queue: &str) -> u32 {
        use sealpost_rabbitmq::lapin::options::QueueDeclareOptions;
        let c = sealpost_rabbitmq::lapin::Connection::connect(
            &format!("amqp://guest:guest@127.0.0.1:5672/{}", self.vhost),
            Default::default(),
        )
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
}

/// Asserts that the broker refused `action` (run on a fresh channel of `conn`) with 403.
async fn assert_refused<F, Fut, T>(
    conn: &sealpost_rabbitmq::lapin::Connection,
    what: &str,
    action: F,
) where
    F: FnOnce(sealpost_rabbitmq::lapin::Channel) -> Fut,
    Fut: std::future::Future<Output = Result<T, sealpost_rabbitmq::lapin::Error>>,
{
    let ch = conn.create_channel().await.unwrap();
    match action(ch).await {
        Ok(_) => panic!("{what}: allowed, expected ACCESS_REFUSED"),
        Err(e) => assert!(
            sealpost_rabbitmq::access_refused(&e).is_some(),
            "{what}: expected ACCESS_REFUSED, got {e}"
        ),
    }
}

#[tokio::test]
async fn rights_a_dispatcher_publishes_but_may_not_declare_delete_or_purge() {
    use sealpost_rabbitmq::lapin::options::{
        ExchangeDeleteOptions, QueueDeclareOptions, QueueDeleteOptions, QueuePurgeOptions,
    };
    let Some(rights) = Rights::make() else {
        return;
    };
    let fulfilment = vec!["fulfilment".to_string()];
    let admin = rights.connect("guest").await;
    admin
        .ensure_destination("ORDERS", &fulfilment)
        .await
        .unwrap();
    admin
        .ensure_destination("AUDIT", &fulfilment)
        .await
        .unwrap();
    let dispatcher = rights.connect(&rights.dispatcher).await;

    // It may publish to ORDERS; AUDIT is not its exchange: that one message is refused as
    // NotPermitted, in words naming what to grant, and its neighbours are never refused.
    let orders = destination(CLUSTER, "ORDERS", "o-1");
    let audit = destination(CLUSTER, "AUDIT", "a-1");
    let out = dispatcher
        .send_batch(
            vec![
                request(&orders, 1, b"{}"),
                request(&audit, 2, b"{}"),
                request(&orders, 3, b"{}"),
            ],
            later(),
        )
        .await;
    match &out[1] {
        SendResult::Refused {
            kind: RefusalKind::NotPermitted,
            detail,
        } => {
            assert!(detail.contains("ACCESS_REFUSED"), "{detail}");
            assert!(detail.contains("exchange `AUDIT`"), "{detail}");
            assert!(detail.contains("docs/security.md"), "{detail}");
        }
        other => panic!("a publish without write permission: {other:?}"),
    }
    // Its neighbours are never refused: confirmed, unknown (outstanding when the refusal
    // closed the channel), or, for one that reached the channel after it closed, never sent.
    for o in [&out[0], &out[2]] {
        assert!(
            matches!(
                o,
                SendResult::Receipt(_)
                    | SendResult::NoAnswer
                    | SendResult::NeverSent(NeverSentReason::NotConnected(_))
            ),
            "a permitted neighbour is never refused: {o:?}"
        );
    }
    // The refusal closed the channel; the next batch gets a new one.
    let next = dispatcher
        .send_batch(vec![request(&orders, 4, b"{}")], later())
        .await;
    assert!(matches!(next[0], SendResult::Receipt(_)), "{next:?}");
    assert_eq!(
        rights.ready("AUDIT.fulfilment").await,
        0,
        "nothing refused was stored"
    );

    // Declaring is an administrator's: a clear error naming the permission.
    let e = dispatcher
        .ensure_destination("ORDERS", &fulfilment)
        .await
        .expect_err("the dispatcher may not declare");
    assert!(e.is_not_permitted(), "{e}");
    let e = e.to_string();
    assert!(e.contains("configure permission on `ORDERS`"), "{e}");
    assert!(e.contains("docs/security.md"), "{e}");

    // Purge, delete, declare: each refused by the broker, and the queue keeps its messages.
    let before = rights.ready("ORDERS.fulfilment").await;
    assert!(before >= 1, "the permitted publishes are in the queue");
    let w = rights.witness(&rights.dispatcher).await;
    assert_refused(&w, "purge", |ch| async move {
        ch.queue_purge("ORDERS.fulfilment".into(), QueuePurgeOptions::default())
            .await
    })
    .await;
    assert_refused(&w, "delete queue", |ch| async move {
        ch.queue_delete("ORDERS.fulfilment".into(), QueueDeleteOptions::default())
            .await
    })
    .await;
    assert_refused(&w, "delete exchange", |ch| async move {
        ch.exchange_delete("ORDERS".into(), ExchangeDeleteOptions::default())
            .await
    })
    .await;
    assert_refused(&w, "declare queue", |ch| async move {
        ch.queue_declare(
            "ORDERS.rogue".into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
    })
    .await;
    assert_eq!(rights.ready("ORDERS.fulfilment").await, before);
}

#[tokio::test]
async fn rights_a_consumer_consumes_its_queue_but_may_not_publish_or_delete() {
    use sealpost_core::subscription::{FetchLimits, Settlement, Subscription};
    use sealpost_rabbitmq::lapin::options::{
        ExchangeDeleteOptions, QueueDeleteOptions, QueuePurgeOptions,
    };
    use sealpost_rabbitmq::RabbitSubscription;
    let Some(rights) = Rights::make() else {
        return;
    };
    let admin = rights.connect("guest").await;
    admin
        .ensure_destination("ORDERS", &["fulfilment".into(), "billing".into()])
        .await
        .unwrap();
    let dispatcher = rights.connect(&rights.dispatcher).await;
    let orders = destination(CLUSTER, "ORDERS", "o-1");
    let sent = vec![request(&orders, 1, b"{}"), request(&orders, 2, b"{}")];
    for o in dispatcher.send_batch(sent.clone(), later()).await {
        assert!(matches!(o, SendResult::Receipt(_)), "{o:?}");
    }

    // Its own queue, through Sealpost's subscription: it may not declare it, finds it
    // declared by the administrator, consumes and acks.
    let url = rights.url_of(&rights.consumer);
    let options = rights.options_of(&rights.consumer);
    let mut sub = RabbitSubscription::subscribe(&url, &options, "ORDERS", "fulfilment", 1_000)
        .await
        .expect("the consumer may consume its own queue");
    let mut got = Vec::new();
    for _ in 0..20 {
        let limits = FetchLimits {
            messages_max: 10,
            bytes_max: 1 << 20,
            wait_ms: 500,
        };
        got.extend(sub.fetch(limits).await.expect("fetch"));
        if got.len() >= sent.len() {
            break;
        }
    }
    let ids: Vec<EventId> = got
        .iter()
        .map(|m| sub.read(m).headers.expect("Sealpost headers").event_id)
        .collect();
    assert_eq!(ids, sent.iter().map(|r| r.event_id).collect::<Vec<_>>());
    sub.settle(got.into_iter().map(|m| (m, Settlement::Ack)).collect())
        .await
        .unwrap();

    // Another consumer's queue: refused, naming the permission.
    let e = match RabbitSubscription::subscribe(&url, &options, "ORDERS", "billing", 1_000).await {
        Ok(_) => panic!("the consumer may not consume another consumer's queue"),
        Err(e) => e,
    };
    assert!(e.is_not_permitted(), "{e}");
    assert!(
        e.to_string()
            .contains("read permission on `ORDERS.billing`"),
        "{e}"
    );
    // A queue nobody declared: it may not declare it, and says who must.
    let e = match RabbitSubscription::subscribe(&url, &options, "ORDERS", "ghost", 1_000).await {
        Ok(_) => panic!("the consumer may not declare a queue"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("an administrator declares"), "{e}");
    assert!(e.contains("`ORDERS.ghost`"), "{e}");

    // It cannot forge an upstream event: Sealpost's adapter reports NotPermitted.
    let consumer = rights.connect(&rights.consumer).await;
    match consumer
        .send_batch(vec![request(&orders, 9, b"{\"forged\":true}")], later())
        .await
        .remove(0)
    {
        SendResult::Refused {
            kind: RefusalKind::NotPermitted,
            detail,
        } => assert!(detail.contains("exchange `ORDERS`"), "{detail}"),
        other => panic!("a consumer's publish must be refused: {other:?}"),
    }

    // Nor delete its queue or the exchange, nor purge another consumer's queue.
    let w = rights.witness(&rights.consumer).await;
    assert_refused(&w, "delete own queue", |ch| async move {
        ch.queue_delete("ORDERS.fulfilment".into(), QueueDeleteOptions::default())
            .await
    })
    .await;
    assert_refused(&w, "delete exchange", |ch| async move {
        ch.exchange_delete("ORDERS".into(), ExchangeDeleteOptions::default())
            .await
    })
    .await;
    assert_refused(&w, "purge another queue", |ch| async move {
        ch.queue_purge("ORDERS.billing".into(), QueuePurgeOptions::default())
            .await
    })
    .await;
    assert_eq!(
        rights.ready("ORDERS.billing").await,
        2,
        "nothing forged, nothing purged"
    );
}

/// With a lookup stream (`SEALPOST_LOOKUP_STREAM=1`) the script's dispatcher asks the stream
/// (its reconciler appends a marker and reads the stream) and still reads no consumer's queue,
/// declares nothing and cannot purge the stream.
#[tokio::test]
async fn rights_a_dispatcher_asks_its_lookup_stream_and_reads_nothing_else() {
    use sealpost_rabbitmq::lapin::options::{QueueDeclareOptions, QueuePurgeOptions};
    let Some(rights) = Rights::make_with(true) else {
        return;
    };
    let lookup = sealpost_rabbitmq::LookupStream {
        enabled: true,
        clock_margin_ms: 0,
        ..Default::default()
    };
    let fulfilment = vec!["fulfilment".to_string()];
    let admin = rights
        .connect("guest")
        .await
        .with_lookup_stream(lookup.clone());
    admin
        .ensure_destination("ORDERS", &fulfilment)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let dispatcher = rights
        .connect(&rights.dispatcher)
        .await
        .with_lookup_stream(lookup);
    let orders = destination(CLUSTER, "ORDERS", "o-1");
    let sent = request(&orders, 1, b"{}");
    let never = request(&orders, 2, b"{}");
    let out = dispatcher.send_batch(vec![sent.clone()], later()).await;
    assert!(matches!(out[0], SendResult::Receipt(_)), "{out:?}");
    let answers = dispatcher
        .lookup_many(&orders, &[(sent.event_id, 0), (never.event_id, 0)])
        .await;
    assert!(matches!(answers[0], Lookup::Copies(_)), "{answers:?}");
    assert_eq!(answers[1], Lookup::Absent);
    assert_eq!(rights.ready(&queue_name("ORDERS", "fulfilment")).await, 1);

    let conn = rights.witness(&rights.dispatcher).await;
    assert_refused(
        &conn,
        "the dispatcher reads the consumer's queue",
        |ch| async move {
            ch.basic_consume(
                queue_name("ORDERS", "fulfilment").as_str().into(),
                "x".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
        },
    )
    .await;
    assert_refused(&conn, "the dispatcher declares a queue", |ch| async move {
        ch.queue_declare(
            "sealpost.lookup.OTHER".into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
    })
    .await;
    // A stream cannot be purged at all; the dispatcher is refused for want of the right
    // or by the stream itself, and the stream keeps the event.
    let ch = conn.create_channel().await.unwrap();
    assert!(ch
        .queue_purge(
            sealpost_rabbitmq::lookup_stream_name("ORDERS")
                .as_str()
                .into(),
            QueuePurgeOptions::default(),
        )
        .await
        .is_err());
    assert!(matches!(
        dispatcher.lookup(&orders, sent.event_id, 0).await,
        Lookup::Copies(_)
    ));
}
