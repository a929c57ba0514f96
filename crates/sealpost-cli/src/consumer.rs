//! The example fulfilment consumer (`sealpost consume`, and the demo's consumers): a thin
//! wrapper over the library's consumer ([`sealpost::consumer::run`]) whose handler writes a
//! row in `demo_fulfilment` ([`Fulfil`]) with the event's idempotency key (R18), one
//! statement per batch. The broker is whichever subscription it is given: NATS
//! ([`run`], `sealpost_nats::NatsSubscription`), RabbitMQ ([`run_rabbitmq`]) or Kafka
//! ([`run_kafka`]). Fetching, the inbox, settlements, dead letters, the watermark reports,
//! reconnects and metrics are the library's; every decision is the core's.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use crate::config::Settings;
use futures::future::BoxFuture;
use sealpost::consumer::{
    CancellationToken, Databases, Delivery as Event, Handler, HandlerError, Options,
};
use sealpost::inbox::Delivery;
use sealpost::runtime::Config;
use sealpost::runtime::{pg_connect, RunError};
use sealpost_core::envelope::PAYLOAD_DOMAIN;
use sealpost_core::signature::{Presented, SignaturePolicy};
use sealpost_core::subscription::Subscription;
use sealpost_core::Digest;
use sealpost_nats::async_nats::jetstream::Message;
use sealpost_nats::{Nats, NatsSubscription};

/// Runs the example consumer `consumer_id` on the NATS stream `topic` until `shutdown` is cancelled,
/// counting each effect applied in `consumed`.
pub async fn run(
    cfg: Config,
    nats: Nats,
    consumer_id: String,
    topic: String,
    shutdown: CancellationToken,
    consumed: Arc<AtomicU64>,
) -> Result<(), RunError> {
    let ack_wait = Duration::from_millis(cfg.consumer_ack_wait_ms);
    let sub = NatsSubscription::subscribe(&nats, &topic, &consumer_id, ack_wait)
        .await
        .map_err(RunError::broker)?;
    serve(&cfg, sub, consumer_id, shutdown, consumed).await
}

/// Runs the example consumer `consumer_id` on the RabbitMQ exchange `topic` (its own quorum
/// queue `<topic>.<consumer>`, declared if missing) until `shutdown` is cancelled.
pub async fn run_rabbitmq(
    cfg: Settings,
    consumer_id: String,
    topic: String,
    shutdown: CancellationToken,
    consumed: Arc<AtomicU64>,
) -> Result<(), RunError> {
    // A message's attempt id is allocated at its claim; it reaches the queue within the
    // lease (R9) and the confirm's time.
    let settle_ms = cfg.lease_ms + cfg.ack_timeout_ms;
    let sub = sealpost_rabbitmq::RabbitSubscription::subscribe(
        &cfg.rabbitmq.url,
        &cfg.rabbitmq.security,
        &topic,
        &consumer_id,
        settle_ms,
    )
    .await
    .map_err(RunError::broker)?;
    serve(&cfg, sub, consumer_id, shutdown, consumed).await
}

/// Runs the example consumer `consumer_id` (its consumer group) on the Kafka topic `topic`
/// until `shutdown` is cancelled.
pub async fn run_kafka(
    cfg: Settings,
    consumer_id: String,
    topic: String,
    shutdown: CancellationToken,
    consumed: Arc<AtomicU64>,
) -> Result<(), RunError> {
    let k = crate::brokers::kafka_config(&cfg, "consume");
    let sub = sealpost_kafka::KafkaSubscription::subscribe(&k, &topic, &consumer_id)
        .map_err(RunError::broker)?;
    serve(&cfg, sub, consumer_id, shutdown, consumed).await
}

/// Runs the demo's handler over `subscription` until `shutdown` is cancelled.
pub async fn serve<S: Subscription>(
    cfg: &Config,
    subscription: S,
    consumer_id: String,
    shutdown: CancellationToken,
    consumed: Arc<AtomicU64>,
) -> Result<(), RunError> {
    let pg = pg_connect(&cfg.database_url).await?;
    crate::demo::prepare(&pg).await?;
    drop(pg);
    let mut options = Options::from_config(cfg, consumer_id.clone());
    options.effect = "fulfil".to_string();
    options.applied = consumed;
    sealpost::consumer::run(
        subscription,
        Databases::from_config(cfg),
        options,
        Fulfil { consumer_id },
        shutdown,
    )
    .await
}

/// The demo's effect: one `demo_fulfilment` row per event (consumer, event id, the order id
/// of the payload, the idempotency key), a batch written with one statement.
pub struct Fulfil {
    /// The consumer id written into each row.
    pub consumer_id: String,
}

impl Handler for Fulfil {
    fn handle<'a>(
        &'a self,
        tx: &'a tokio_postgres::Transaction<'a>,
        delivery: &'a Event,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        self.handle_batch(tx, vec![delivery])
    }

    fn handle_batch<'a>(
        &'a self,
        tx: &'a tokio_postgres::Transaction<'a>,
        deliveries: Vec<&'a Event>,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            let ids: Vec<uuid::Uuid> = deliveries
                .iter()
                .map(|d| uuid::Uuid::from_bytes(d.event_id.0))
                .collect();
            let orders: Vec<String> = deliveries.iter().map(|d| order_id(&d.payload)).collect();
            let keys: Vec<&str> = deliveries
                .iter()
                .map(|d| d.idempotency_key.as_str())
                .collect();
            tx.execute(
                "INSERT INTO demo_fulfilment (consumer_id, event_id, order_id, idempotency_key)
                 SELECT $1, * FROM unnest($2::uuid[], $3::text[], $4::text[])",
                &[&self.consumer_id, &ids, &orders, &keys],
            )
            .await?;
            Ok(())
        })
    }
}

/// The `order_id` of a demo order payload (empty if it has none).
pub fn order_id(payload: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(payload)
        .ok()
        .and_then(|v| {
            v.get("order_id")
                .and_then(|o| o.as_str())
                .map(str::to_string)
        })
        .unwrap_or_default()
}

/// The inbox's view of a delivered message: what its Sealpost headers claim
/// ([`sealpost_nats::delivery_of`]) and the digest of the payload actually received. The
/// inbox (the core's `decide_inbox`) compares the two.
pub fn delivery(msg: &Message) -> Option<Delivery> {
    let d = sealpost_nats::delivery_of(msg)?;
    Some(Delivery {
        event_id: d.event_id,
        member: d.member,
        claimed_digest: d.claimed_digest,
        payload_digest: Digest::of_bytes(PAYLOAD_DOMAIN, &msg.payload),
        // This view checks no signature (the library consumer does, with its keyring).
        signatures: SignaturePolicy::Off,
        presented: Presented::Missing,
        stream: d.stream,
        sequence: d.sequence,
    })
}
