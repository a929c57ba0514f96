//! The example fulfilment consumer (`sealpost consume`): a durable JetStream pull consumer
//! whose effect is a row in `demo_fulfilment`, applied through the library's inbox
//! ([`sealpost::inbox::process_batch`]): each fetched batch (up to 500 messages) is applied in
//! one inbox transaction, and its messages are acked only after that transaction commits.
//! A message whose effect failed is rolled back alone and sent back with a delay (nak).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sealpost::inbox::{self, BatchOutcome, Delivery};
use sealpost::runtime::{pg_connect, Config, RunError};
use sealpost_core::envelope::PAYLOAD_DOMAIN;
use sealpost_core::Digest;
use sealpost_nats::{Nats, NatsError};

/// Runs the example consumer `consumer_id` on `topic` until `stop` is set, counting each
/// effect applied in `consumed`.
pub async fn run(
    cfg: Config,
    nats: Nats,
    consumer_id: String,
    topic: String,
    stop: Arc<AtomicBool>,
    consumed: Arc<AtomicU64>,
) -> Result<(), RunError> {
    use async_nats::jetstream::consumer::{pull, AckPolicy};
    use futures::StreamExt;
    let mut pg = pg_connect(&cfg.database_url).await?;
    crate::demo::prepare(&pg).await?;
    let stream_error = |e: &dyn std::fmt::Display| {
        RunError::broker(NatsError::Stream {
            stream: topic.clone(),
            detail: e.to_string(),
        })
    };
    let stream = nats
        .js
        .get_stream(&topic)
        .await
        .map_err(|e| stream_error(&e))?;
    let jc = stream
        .get_or_create_consumer(
            &consumer_id,
            pull::Config {
                durable_name: Some(consumer_id.clone()),
                filter_subject: format!("sp.{topic}.>"),
                ack_policy: AckPolicy::Explicit,
                ack_wait: Duration::from_millis(cfg.consumer_ack_wait_ms),
                max_ack_pending: 20_000,
                ..Default::default()
            },
        )
        .await
        .map_err(|e| stream_error(&e))?;
    let consumer_label = sealpost::observe::consumers().label(&consumer_id);
    let mut lag_read_at: Option<std::time::Instant> = None;
    while !stop.load(Ordering::Relaxed) {
        if lag_read_at.is_none_or(|t| t.elapsed() >= LAG_EVERY) {
            lag_read_at = Some(std::time::Instant::now());
            record_lag(&jc, &consumer_label).await;
        }
        let batch = jc
            .fetch()
            .max_messages(500)
            .expires(Duration::from_millis(300))
            .messages()
            .await;
        let mut batch = match batch {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, "fetch failed; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        let mut messages = Vec::new();
        while let Some(msg) = batch.next().await {
            let Ok(msg) = msg else { break };
            messages.push(msg);
        }
        let mut held = Vec::with_capacity(messages.len());
        let mut deliveries = Vec::with_capacity(messages.len());
        let mut rows = Vec::with_capacity(messages.len());
        for msg in messages {
            let Some(d) = delivery(&msg) else {
                tracing::error!(subject = %msg.subject, "message without Sealpost headers; terminating it");
                let _ = msg.ack_with(async_nats::jetstream::AckKind::Term).await;
                continue;
            };
            rows.push(FulfilmentRow {
                event_id: uuid::Uuid::from_bytes(d.event_id.0),
                order_id: order_id(&msg.payload),
                idempotency_key: sealpost_core::inbox::idempotency_key(
                    d.event_id,
                    &consumer_id,
                    "fulfil",
                ),
            });
            deliveries.push(d);
            held.push(msg);
        }
        if held.is_empty() {
            continue;
        }
        let effect = fulfil(consumer_id.clone(), rows);
        match inbox::process_batch(&mut pg, &consumer_id, &deliveries, effect).await {
            Ok(outcomes) => {
                // Committed: ack what the inbox holds, send the failed ones back for later.
                for (msg, outcome) in held.iter().zip(outcomes) {
                    if matches!(outcome, BatchOutcome::Applied { .. }) {
                        consumed.fetch_add(1, Ordering::Relaxed);
                    }
                    let label = match &outcome {
                        BatchOutcome::Applied { .. } => "applied",
                        BatchOutcome::Duplicate { .. } => "duplicate",
                        BatchOutcome::Quarantined => "quarantined",
                        BatchOutcome::Failed { .. } => "failed",
                    };
                    metrics::counter!(sealpost::observe::CONSUMER_MESSAGES,
                        "consumer" => consumer_label.clone(), "outcome" => label)
                    .increment(1);
                    if let BatchOutcome::Failed { error } = &outcome {
                        tracing::warn!(subject = %msg.subject, %error, "effect failed; the message comes back after a delay");
                        nak(msg).await;
                        continue;
                    }
                    if cfg.drill_skip_consumer_ack {
                        continue; // drill: committed, then the ack is "lost"
                    }
                    if let Err(e) = msg.ack().await {
                        tracing::warn!(error = %e, "ack lost; the broker will redeliver and the inbox absorbs it");
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, messages = held.len(), "inbox transaction failed; the batch comes back after a delay");
                for msg in &held {
                    nak(msg).await;
                }
                if pg.is_closed() {
                    pg = pg_connect(&cfg.database_url).await?;
                }
            }
        }
    }
    Ok(())
}

/// How often the consumer reads its lag from the broker.
const LAG_EVERY: Duration = Duration::from_secs(5);

/// Sets the consumer's lag gauge: the messages JetStream holds for it that it has not acked
/// (not yet delivered, plus delivered and unacknowledged). A failed read leaves the gauge.
async fn record_lag(
    jc: &async_nats::jetstream::consumer::Consumer<async_nats::jetstream::consumer::pull::Config>,
    label: &str,
) {
    match jc.get_info().await {
        Ok(i) => metrics::gauge!(sealpost::observe::CONSUMER_LAG, "consumer" => label.to_string())
            .set((i.num_pending + i.num_ack_pending as u64) as f64),
        Err(e) => tracing::warn!(error = %e, "metrics: cannot read the consumer's lag"),
    }
}

/// One `demo_fulfilment` row, the example effect of one message.
struct FulfilmentRow {
    event_id: uuid::Uuid,
    order_id: String,
    idempotency_key: String,
}

/// The `order_id` of a demo order payload (empty if it has none).
fn order_id(payload: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(payload)
        .ok()
        .and_then(|v| {
            v.get("order_id")
                .and_then(|o| o.as_str())
                .map(str::to_string)
        })
        .unwrap_or_default()
}

/// The example effect for a batch: one `demo_fulfilment` row per message it is given (the
/// indices are those of `rows`), written with one statement.
fn fulfil(consumer_id: String, rows: Vec<FulfilmentRow>) -> inbox::BatchEffect<'static> {
    Box::new(move |tx, apply| {
        let ids: Vec<uuid::Uuid> = apply.iter().map(|&i| rows[i].event_id).collect();
        let orders: Vec<String> = apply.iter().map(|&i| rows[i].order_id.clone()).collect();
        let keys: Vec<String> = apply
            .iter()
            .map(|&i| rows[i].idempotency_key.clone())
            .collect();
        let cid = consumer_id.clone();
        Box::pin(async move {
            tx.execute(
                "INSERT INTO demo_fulfilment (consumer_id, event_id, order_id, idempotency_key)
                 SELECT $1, * FROM unnest($2::uuid[], $3::text[], $4::text[])",
                &[&cid, &ids, &orders, &keys],
            )
            .await
            .map(|_| ())
        })
    })
}

/// How long a message whose effect failed waits before the broker redelivers it: 100 ms,
/// doubling with each delivery, at most 30 s.
pub fn redelivery_delay(delivered: i64) -> Duration {
    let doublings = delivered.saturating_sub(1).clamp(0, 9) as u32;
    Duration::from_millis(100 << doublings).min(Duration::from_secs(30))
}

/// Sends a message back to the broker for redelivery after [`redelivery_delay`].
async fn nak(msg: &async_nats::jetstream::Message) {
    let delivered = msg.info().map_or(1, |i| i.delivered);
    let delay = redelivery_delay(delivered);
    if let Err(e) = msg
        .ack_with(async_nats::jetstream::AckKind::Nak(Some(delay)))
        .await
    {
        tracing::warn!(error = %e, "nak lost; the broker redelivers after the ack wait");
    }
}

/// The inbox's view of a delivered message: what its Sealpost headers claim
/// ([`sealpost_nats::delivery_of`]) and the digest of the payload actually received. The
/// inbox (the core's `decide_inbox`) compares the two.
pub fn delivery(msg: &async_nats::jetstream::Message) -> Option<Delivery> {
    let d = sealpost_nats::delivery_of(msg)?;
    Some(Delivery {
        event_id: d.event_id,
        member: d.member,
        claimed_digest: d.claimed_digest,
        payload_digest: Digest::of_bytes(PAYLOAD_DOMAIN, &msg.payload),
        stream: d.stream,
        sequence: d.sequence,
    })
}
