//! The failure matrix's last window (R28, R18): an external side effect (a payment, a mail)
//! that fails after the inbox committed, or whose reply is lost. Sealpost keeps no outbox for
//! a consumer's external calls; what it gives the consuming service is the inbox row and a
//! key, `sealpost_core::inbox::idempotency_key(event id, consumer, effect)`, that every
//! delivery of the event derives the same. The service calls the external system after the
//! inbox commit, on a first delivery and on a duplicate alike (it cannot know whether its
//! earlier call took effect), and retries a failed call itself; an external system that
//! honours idempotency keys then applies the effect once.
//!
//! Against the real PostgreSQL inbox (`sealpost::inbox::process`) and a real JetStream
//! redelivery; the external system is modelled in memory ([`Sink`]). What this shows is that
//! the key holds across a redelivery and across the service's own retry; it does not show a
//! compensation path, because Sealpost has none.

use crate::common;
use crate::teardown_nats;

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use sealpost::inbox::{self, Effect, InboxOutcome};
use sealpost::runtime;
use sealpost_core::envelope::EventId;
use sealpost_core::inbox::idempotency_key;
use sealpost_nats::async_nats::jetstream::{self, consumer::pull, Message};
use sealpost_nats::Nats;

/// The effect's name in the key.
const EFFECT: &str = "charge";

/// Why a call to the external system failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SinkError {
    /// Down: the call took no effect.
    Unavailable,
    /// The call took effect and its reply was lost on the way back.
    ReplyLost,
}

/// An external system that honours idempotency keys, as a payment provider does: the first
/// call with a key takes effect; a later call with the same key answers as the first did and
/// takes none.
#[derive(Default)]
struct Sink {
    /// Key -> number of the call that took effect.
    applied: BTreeMap<String, u32>,
    /// Calls made, per key.
    calls: BTreeMap<String, u32>,
    /// The next calls fail before taking effect.
    down: bool,
    /// The next call takes effect and its reply is lost.
    lose_reply: bool,
}

impl Sink {
    fn charge(&mut self, key: &str) -> Result<(), SinkError> {
        let n = self.calls.entry(key.to_string()).or_default();
        *n += 1;
        let n = *n;
        if self.down {
            return Err(SinkError::Unavailable);
        }
        self.applied.entry(key.to_string()).or_insert(n);
        if std::mem::take(&mut self.lose_reply) {
            return Err(SinkError::ReplyLost);
        }
        Ok(())
    }
}

/// The service's inbox transaction: the inbox row and a `demo_fulfilment` row carrying the
/// key of the external call it owes, committed together.
async fn apply(
    pg: &mut tokio_postgres::Client,
    consumer: &str,
    msg: &Message,
) -> (InboxOutcome, EventId, String) {
    let d = sealpost_cli::consumer::delivery(msg).expect("a Sealpost message");
    let key = idempotency_key(d.event_id, consumer, EFFECT);
    let (c, k, id) = (
        consumer.to_string(),
        key.clone(),
        uuid::Uuid::from_bytes(d.event_id.0),
    );
    let effect: Effect<'_> = Box::new(move |tx| {
        Box::pin(async move {
            tx.execute(
                "INSERT INTO demo_fulfilment (consumer_id, event_id, order_id, idempotency_key)
                 VALUES ($1, $2, 'o', $3)",
                &[&c, &id, &k],
            )
            .await
            .map(|_| ())
        })
    });
    let outcome = inbox::process(pg, consumer, &d, effect).await.unwrap();
    (outcome, d.event_id, key)
}

/// Fetches up to `max` messages, waiting at most `wait`.
async fn fetch(jc: &jetstream::consumer::PullConsumer, max: usize, wait: Duration) -> Vec<Message> {
    let mut batch = jc
        .fetch()
        .max_messages(max)
        .expires(wait)
        .messages()
        .await
        .unwrap();
    let mut out = Vec::new();
    while let Some(m) = batch.next().await {
        out.push(m.unwrap());
    }
    out
}

fn delivered(msg: &Message) -> i64 {
    msg.info().unwrap().delivered
}

#[tokio::test]
async fn an_external_effect_keyed_by_the_idempotency_key_happens_once_across_a_redelivery_and_a_retry(
) {
    let tag = runtime::owner_id() % 1_000_000;
    let cfg = common::fresh_database(&format!("sealpost_effects_{tag}")).await;
    let nats = Nats::connect(
        &common::nats_url(),
        common::NATS_CLUSTER,
        Duration::from_secs(5),
    )
    .await
    .expect("NATS must be running");
    let topic = format!("FX{tag}");
    let _stream = teardown_nats::stream(&common::nats_url(), &topic);
    // Two events published through the dispatchers (`orders` o-0 and o-1).
    sealpost_cli::consume_bench::prefill(&cfg, &nats, &format!("r-{topic}"), &topic, 2)
        .await
        .unwrap();
    let mut pg = runtime::pg_connect(&cfg.database_url).await.unwrap();
    sealpost_cli::demo::prepare(&pg).await.unwrap();
    let consumer = format!("billing-{tag}");
    let ack_wait = Duration::from_secs(2);
    let jc: jetstream::consumer::PullConsumer = nats
        .js
        .get_stream(&topic)
        .await
        .unwrap()
        .create_consumer(pull::Config {
            durable_name: Some(consumer.clone()),
            ack_wait,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut sink = Sink::default();

    let first = fetch(&jc, 2, Duration::from_secs(5)).await;
    assert_eq!(first.len(), 2, "both events delivered");
    let (a, b) = (&first[0], &first[1]);

    // Event B: the inbox commits and the message is acked; then the external call fails (the
    // async side effect failing after the ack). The broker will not deliver B again.
    let (outcome, b_id, b_key) = apply(&mut pg, &consumer, b).await;
    assert!(
        matches!(outcome, InboxOutcome::Applied { .. }),
        "{outcome:?}"
    );
    b.double_ack().await.unwrap();
    sink.down = true;
    assert_eq!(sink.charge(&b_key), Err(SinkError::Unavailable));
    sink.down = false;

    // Event A: the inbox commits, the call takes effect but its reply is lost, and the service
    // dies before it acks.
    let (outcome, a_id, a_key) = apply(&mut pg, &consumer, a).await;
    let InboxOutcome::Applied { receipt_id } = outcome else {
        panic!("a first delivery applies: {outcome:?}");
    };
    sink.lose_reply = true;
    assert_eq!(sink.charge(&a_key), Err(SinkError::ReplyLost));

    // A comes back after the ack wait: a duplicate for the inbox (the original receipt, no
    // second row), the same key, and the call made again is answered without a second
    // effect.
    let again = fetch(&jc, 1, Duration::from_secs(10)).await;
    assert_eq!(again.len(), 1, "A is redelivered");
    assert_eq!(delivered(&again[0]), 2);
    let (outcome, id, key) = apply(&mut pg, &consumer, &again[0]).await;
    assert_eq!(id, a_id, "the redelivery is A");
    assert_eq!(outcome, InboxOutcome::Duplicate { receipt_id });
    assert_eq!(key, a_key, "every delivery derives the same key");
    assert_eq!(sink.charge(&key), Ok(()));
    again[0].double_ack().await.unwrap();

    // Nothing else comes: B was acked, so its failed call is the service's own to retry.
    assert!(
        fetch(&jc, 10, ack_wait * 2).await.is_empty(),
        "no redelivery of an acked message, none of A after its ack"
    );
    // The retry needs only the service's durable record: the key it committed with the
    // inbox row. Retried twice, applied once.
    let owed: String = pg
        .query_one(
            "SELECT idempotency_key FROM demo_fulfilment WHERE consumer_id = $1 AND event_id = $2",
            &[&consumer, &uuid::Uuid::from_bytes(b_id.0)],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(owed, b_key);
    assert_eq!(sink.charge(&owed), Ok(()));
    assert_eq!(sink.charge(&owed), Ok(()));

    // Each effect once, though A was called twice and B three times.
    assert_eq!(sink.applied.len(), 2);
    assert_eq!(sink.applied.get(&a_key), Some(&1));
    assert_eq!(
        sink.applied.get(&b_key),
        Some(&2),
        "the call after the outage"
    );
    assert_eq!(sink.calls.get(&a_key), Some(&2));
    assert_eq!(sink.calls.get(&b_key), Some(&3));
    assert_ne!(a_key, b_key);
    let rows: (i64, i64) = {
        let r = pg
            .query_one(
                "SELECT (SELECT count(*) FROM sealpost.inbox WHERE consumer_id = $1),
                        (SELECT count(*) FROM demo_fulfilment WHERE consumer_id = $1)",
                &[&consumer],
            )
            .await
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!(rows, (2, 2), "one inbox row and one owed call per event");
    let _ = nats.js.delete_stream(&topic).await;
}
