//! The example fulfilment consumer (`sealpost consume`): a durable JetStream pull consumer
//! whose effect is a row in `demo_fulfilment`, applied through the library's inbox
//! ([`sealpost::inbox`]). The broker message is acked only after the inbox transaction
//! commits.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sealpost::inbox::{self, Delivery};
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
    while !stop.load(Ordering::Relaxed) {
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
        while let Some(msg) = batch.next().await {
            let Ok(msg) = msg else { break };
            let Some(d) = delivery(&msg) else {
                tracing::error!(subject = %msg.subject, "message without Sealpost headers; terminating it");
                let _ = msg.ack_with(async_nats::jetstream::AckKind::Term).await;
                continue;
            };
            let order_id = serde_json::from_slice::<serde_json::Value>(&msg.payload)
                .ok()
                .and_then(|v| {
                    v.get("order_id")
                        .and_then(|o| o.as_str())
                        .map(str::to_string)
                })
                .unwrap_or_default();
            let key = sealpost_core::inbox::idempotency_key(d.event_id, &consumer_id, "fulfil");
            let cid = consumer_id.clone();
            let eid = uuid::Uuid::from_bytes(d.event_id.0);
            let effect: inbox::Effect<'_> = Box::new(move |tx| {
                Box::pin(async move {
                    tx.execute(
                        "INSERT INTO demo_fulfilment (consumer_id, event_id, order_id, idempotency_key)
                         VALUES ($1, $2, $3, $4)",
                        &[&cid, &eid, &order_id, &key],
                    )
                    .await
                    .map(|_| ())
                })
            });
            match inbox::process(&mut pg, &consumer_id, &d, effect).await {
                Ok(outcome) => {
                    if matches!(outcome, inbox::InboxOutcome::Applied { .. }) {
                        consumed.fetch_add(1, Ordering::Relaxed);
                    }
                    if cfg.drill_skip_consumer_ack {
                        continue; // drill: committed, then the ack is "lost"
                    }
                    if let Err(e) = msg.ack().await {
                        tracing::warn!(error = %e, "ack lost; the broker will redeliver and the inbox absorbs it");
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "inbox transaction failed; leaving the message for redelivery");
                    if pg.is_closed() {
                        pg = pg_connect(&cfg.database_url).await?;
                    }
                }
            }
        }
    }
    Ok(())
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
