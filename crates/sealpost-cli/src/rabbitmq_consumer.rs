//! The example fulfilment consumer over RabbitMQ (`sealpost consume --broker rabbitmq`): it
//! reads its own durable quorum queue (`<topic>.<consumer>`, bound to the topic exchange with
//! `#`, declared if missing) with manual acks and a prefetch of 1,000, applies what arrives in
//! batches (up to 500 messages, or what came within 50 ms of the first) through the library's
//! inbox ([`sealpost::inbox::process_batch_within`]) with the same effect as the NATS consumer,
//! and acks only after that transaction commits. Second copies (an unknown outcome retried to
//! the same exchange) are duplicates to the inbox: acked, applied once.
//!
//! Every decision is the core's (`decide_failed_delivery`, `decide_unreadable_delivery`); the
//! delivery count is the quorum queue's `x-delivery-count` plus this delivery. RabbitMQ has no
//! delayed nack: a message to retry is held (unacked, so no other consumer of the queue gets
//! it) for the core's delay, then `basic.nack` with requeue. A dead letter is recorded in
//! `sealpost.inbox_quarantine` first and only then rejected without requeue (the queue has no
//! dead-letter exchange; the record is the evidence). A lost connection is reopened; what was
//! unacked comes back and the inbox absorbs it.
//!
//! Not done here: the contiguous watermark of the NATS consumer (`consumer_progress`, read by
//! `sealpost purge`). A queue forgets what it delivered and has no ack floor, so purge of
//! RabbitMQ-routed rows needs `--no-consumers` (or consumers it does not wait for).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use sealpost::inbox::{self, BatchOutcome, DeadLetter, DeadLetterKind, Delivery};
use sealpost::runtime::{pg_connect, Config, RunError};
use sealpost_core::envelope::PAYLOAD_DOMAIN;
use sealpost_core::inbox::{
    decide_failed_delivery, decide_unreadable_delivery, FailedDelivery, Failure, RedeliveryPolicy,
};
use sealpost_core::Digest;
use sealpost_rabbitmq::lapin::message::Delivery as AmqpDelivery;
use sealpost_rabbitmq::lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions, BasicRejectOptions,
    ExchangeDeclareOptions,
};
use sealpost_rabbitmq::lapin::types::{FieldTable, LongString};
use sealpost_rabbitmq::lapin::{self, Connection, ConnectionProperties, ExchangeKind};
use sealpost_rabbitmq::{declare_queue, delivered_count, queue_name, RabbitError};

/// Messages the broker may have delivered and not yet seen acked, per consumer.
const PREFETCH: u16 = 1_000;
/// Messages applied in one inbox transaction at most.
const BATCH_MAX: usize = 500;

/// Opens the consumer's connection, declares its exchange and queue, and starts consuming.
async fn subscribe(
    cfg: &Config,
    consumer_id: &str,
    topic: &str,
) -> Result<(Connection, lapin::Consumer), RunError> {
    let name = format!("sealpost-consume-{consumer_id}-{}", std::process::id());
    let conn = sealpost_rabbitmq::open_connection(
        &cfg.rabbitmq_url,
        &crate::brokers::rabbitmq_options(cfg),
        ConnectionProperties::default().with_connection_name(LongString::from(name)),
    )
    .await
    .map_err(RunError::broker)?;
    let topo =
        |what: String| move |source| RunError::broker(RabbitError::Topology { what, source });
    let ch = conn
        .create_channel()
        .await
        .map_err(topo("opening a channel".into()))?;
    ch.exchange_declare(
        topic.into(),
        ExchangeKind::Topic,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .map_err(topo(format!("declaring exchange `{topic}`")))?;
    declare_queue(&ch, topic, consumer_id)
        .await
        .map_err(RunError::broker)?;
    ch.basic_qos(PREFETCH, BasicQosOptions::default())
        .await
        .map_err(topo("setting the prefetch".into()))?;
    let q = queue_name(topic, consumer_id);
    let consumer = ch
        .basic_consume(
            q.as_str().into(),
            consumer_id.into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(topo(format!("consuming queue `{q}`")))?;
    Ok((conn, consumer))
}

/// Runs the example consumer `consumer_id` on exchange `topic` until `stop` is set, counting
/// each effect applied in `consumed`.
pub async fn run(
    cfg: Config,
    consumer_id: String,
    topic: String,
    stop: Arc<AtomicBool>,
    consumed: Arc<AtomicU64>,
) -> Result<(), RunError> {
    let mut pg = pg_connect(&cfg.database_url).await?;
    crate::demo::prepare(&pg).await?;
    let policy = RedeliveryPolicy {
        max_deliveries: cfg.consumer_max_deliveries,
        ..RedeliveryPolicy::default()
    };
    let effect_timeout = Duration::from_millis(cfg.consumer_effect_timeout_ms);
    let label = sealpost::observe::consumers().label(&consumer_id);
    let (mut _conn, mut consumer) = subscribe(&cfg, &consumer_id, &topic).await?;
    while !stop.load(Ordering::Relaxed) {
        let (messages, broken) = next_batch(&mut consumer).await;
        if broken {
            tracing::warn!(consumer = %consumer_id, "RabbitMQ consumer closed; reconnecting (unacked messages come back and the inbox absorbs them)");
            tokio::time::sleep(Duration::from_millis(500)).await;
            match subscribe(&cfg, &consumer_id, &topic).await {
                Ok((c, s)) => (_conn, consumer) = (c, s),
                Err(e) => tracing::warn!(error = %e, "cannot reconnect yet"),
            }
        }
        if messages.is_empty() {
            continue;
        }
        let mut held = Vec::with_capacity(messages.len());
        let mut deliveries = Vec::with_capacity(messages.len());
        let mut rows = Vec::with_capacity(messages.len());
        let mut letters = Vec::new();
        for m in messages {
            let Some(d) = sealpost_rabbitmq::delivery_of(m.exchange.as_str(), &m.properties) else {
                match decide_unreadable_delivery() {
                    FailedDelivery::DeadLetter => {
                        let why = sealpost_rabbitmq::unreadable_reason(&m.properties);
                        letters.push((m, why));
                    }
                    FailedDelivery::Retry { delay_ms } => nack_later(m, delay_ms),
                }
                continue;
            };
            rows.push(crate::consumer::FulfilmentRow {
                event_id: uuid::Uuid::from_bytes(d.event_id.0),
                order_id: crate::consumer::order_id(&m.data),
                idempotency_key: sealpost_core::inbox::idempotency_key(
                    d.event_id,
                    &consumer_id,
                    "fulfil",
                ),
            });
            deliveries.push(Delivery {
                event_id: d.event_id,
                member: d.member,
                claimed_digest: d.claimed_digest,
                payload_digest: Digest::of_bytes(PAYLOAD_DOMAIN, &m.data),
                stream: d.stream,
                sequence: d.sequence,
            });
            held.push(m);
        }
        give_up(
            &pg,
            &consumer_id,
            DeadLetterKind::Unreadable,
            letters,
            policy,
        )
        .await;
        if held.is_empty() {
            continue;
        }
        let effect = crate::consumer::fulfil(consumer_id.clone(), rows);
        match inbox::process_batch_within(
            &mut pg,
            &consumer_id,
            &deliveries,
            effect,
            Some(effect_timeout),
        )
        .await
        {
            Ok(outcomes) => {
                let mut dead = Vec::new();
                for (m, outcome) in held.into_iter().zip(outcomes) {
                    let what = outcome.name();
                    metrics::counter!(sealpost::observe::CONSUMER_MESSAGES,
                        "consumer" => label.clone(), "outcome" => what)
                    .increment(1);
                    if matches!(outcome, BatchOutcome::Applied { .. }) {
                        consumed.fetch_add(1, Ordering::Relaxed);
                    }
                    if let BatchOutcome::Failed { error } = outcome {
                        let delivered = delivered_count(&m.properties, m.redelivered);
                        match decide_failed_delivery(delivered, Failure::Message, policy) {
                            FailedDelivery::Retry { delay_ms } => {
                                tracing::warn!(routing_key = %m.routing_key, delivered, delay_ms, %error,
                                    "effect failed and was rolled back; the message is requeued after the delay");
                                nack_later(m, delay_ms);
                            }
                            FailedDelivery::DeadLetter => dead.push((m, error)),
                        }
                        continue;
                    }
                    if cfg.drill_skip_consumer_ack {
                        continue; // drill: committed, then the ack is "lost"
                    }
                    if let Err(e) = m.ack(BasicAckOptions::default()).await {
                        tracing::warn!(error = %e, "ack lost; the broker will redeliver and the inbox absorbs it");
                    }
                }
                give_up(
                    &pg,
                    &consumer_id,
                    DeadLetterKind::EffectFailed,
                    dead,
                    policy,
                )
                .await;
            }
            Err(e) => {
                tracing::warn!(error = %e, messages = held.len(), "inbox transaction failed; the batch is requeued after a delay");
                for m in held {
                    let delivered = delivered_count(&m.properties, m.redelivered);
                    if let FailedDelivery::Retry { delay_ms } =
                        decide_failed_delivery(delivered, Failure::Transaction, policy)
                    {
                        nack_later(m, delay_ms);
                    }
                }
                if pg.is_closed() {
                    pg = pg_connect(&cfg.database_url).await?;
                }
            }
        }
    }
    Ok(())
}

/// Up to [`BATCH_MAX`] deliveries: waits up to 300 ms for the first, then takes what arrives
/// within 50 ms. `true` when the consumer ended (channel or connection closed).
async fn next_batch(consumer: &mut lapin::Consumer) -> (Vec<AmqpDelivery>, bool) {
    let mut out = Vec::new();
    let mut until = Instant::now() + Duration::from_millis(300);
    while out.len() < BATCH_MAX {
        let left = until.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, consumer.next()).await {
            Err(_) => break,
            Ok(Some(Ok(d))) => {
                if out.is_empty() {
                    until = Instant::now() + Duration::from_millis(50);
                }
                out.push(d);
            }
            Ok(Some(Err(e))) => {
                tracing::warn!(error = %e, "RabbitMQ consumer error");
                return (out, true);
            }
            Ok(None) => return (out, true),
        }
    }
    (out, false)
}

/// Holds `m` (unacked) for `delay_ms`, then requeues it: RabbitMQ has no delayed nack.
fn nack_later(m: AmqpDelivery, delay_ms: u64) {
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(delay_ms)).await;
        if let Err(e) = m
            .nack(BasicNackOptions {
                requeue: true,
                ..Default::default()
            })
            .await
        {
            tracing::warn!(error = %e, "nack lost; the message comes back when the channel closes");
        }
    });
}

/// Records messages the consumer gives up on as dead letters, then rejects them without
/// requeue. If the record cannot be written, nothing is rejected: each is requeued after its
/// delay (the record is the only evidence; a message is never dropped without it).
async fn give_up(
    pg: &tokio_postgres::Client,
    consumer_id: &str,
    kind: DeadLetterKind,
    messages: Vec<(AmqpDelivery, String)>,
    policy: RedeliveryPolicy,
) {
    if messages.is_empty() {
        return;
    }
    let letters: Vec<DeadLetter> = messages
        .iter()
        .map(|(m, reason)| {
            let d = sealpost_rabbitmq::delivery_of(m.exchange.as_str(), &m.properties);
            DeadLetter {
                kind,
                event: d.as_ref().map(|d| (d.event_id, d.member)),
                stream: m.exchange.to_string(),
                sequence: d.as_ref().map_or(0, |d| d.sequence),
                subject: m.routing_key.to_string(),
                delivered: delivered_count(&m.properties, m.redelivered),
                reason: reason.clone(),
                payload: m.data.clone(),
            }
        })
        .collect();
    match inbox::dead_letter(pg, consumer_id, &letters).await {
        Ok(()) => {
            for ((m, reason), l) in messages.into_iter().zip(&letters) {
                tracing::error!(routing_key = %m.routing_key, exchange = %l.stream, attempt = l.sequence,
                    delivered = l.delivered, %reason,
                    "message dead-lettered: recorded in sealpost.inbox_quarantine, rejected without requeue");
                if let Err(e) = m.reject(BasicRejectOptions { requeue: false }).await {
                    tracing::warn!(error = %e, "reject lost; the redelivery finds the dead letter already recorded");
                }
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, messages = messages.len(),
                "cannot record dead letters; the messages are requeued after a delay");
            for (m, _) in messages {
                let delivered = delivered_count(&m.properties, m.redelivered);
                if let FailedDelivery::Retry { delay_ms } =
                    decide_failed_delivery(delivered, Failure::Transaction, policy)
                {
                    nack_later(m, delay_ms);
                }
            }
        }
    }
}
