//! The example fulfilment consumer (`sealpost consume`): a durable JetStream pull consumer
//! whose effect is a row in `demo_fulfilment`, applied through the library's inbox
//! ([`sealpost::inbox::process_batch`]): each fetched batch (up to 500 messages) is applied in
//! one inbox transaction, and its messages are acked only after that transaction commits.
//! A message whose effect failed (or ran past `consumer_effect_timeout_ms`) is rolled back
//! alone and sent back with a delay that grows with its delivery count (nak); at
//! `consumer_max_deliveries` it is recorded as a dead letter in `sealpost.inbox_quarantine`
//! and the broker is told never to redeliver it (`AckKind::Term`). A message without
//! readable Sealpost headers is recorded the same way, never dropped silently. The loop
//! reports its contiguous watermark (the durable consumer's ack floor: every position up to
//! it is applied or dead-lettered, since nothing is acked or terminated before its record
//! commits) to the outbox database for `sealpost purge`. Every decision is the core's
//! (`decide_failed_delivery`, `decide_unreadable_delivery`); this loop executes them.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{AckKind, Message};
use sealpost::inbox::{self, BatchOutcome, DeadLetter, DeadLetterKind, Delivery};
use sealpost::runtime::{pg_connect, Config, RunError};
use sealpost_core::envelope::{EventId, PAYLOAD_DOMAIN};
use sealpost_core::inbox::{
    decide_failed_delivery, decide_unreadable_delivery, FailedDelivery, Failure, RedeliveryPolicy,
};
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
    let policy = RedeliveryPolicy {
        max_deliveries: cfg.consumer_max_deliveries,
        ..RedeliveryPolicy::default()
    };
    let effect_timeout = Duration::from_millis(cfg.consumer_effect_timeout_ms);
    let mut progress = Progress::new(&cfg, &consumer_id, &topic);
    let consumer_label = sealpost::observe::consumers().label(&consumer_id);
    let mut lag_read_at: Option<std::time::Instant> = None;
    while !stop.load(Ordering::Relaxed) {
        progress.maybe_report(&jc).await;
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
        let mut unreadable = Vec::new();
        for msg in messages {
            let Some(d) = delivery(&msg) else {
                unreadable.push(msg);
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
        let mut letters: Vec<(&Message, String)> = Vec::new();
        for m in &unreadable {
            match decide_unreadable_delivery() {
                FailedDelivery::DeadLetter => letters.push((m, unreadable_reason(m))),
                FailedDelivery::Retry { delay_ms } => nak(m, delay_ms).await,
            }
        }
        give_up(
            &pg,
            &consumer_id,
            DeadLetterKind::Unreadable,
            &letters,
            policy,
        )
        .await;
        if held.is_empty() {
            continue;
        }
        let effect = fulfil(consumer_id.clone(), rows);
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
                // Committed: ack what the inbox holds; the failed ones go back for later or,
                // at the limit, to the dead letters.
                let mut dead = Vec::new();
                for (msg, outcome) in held.iter().zip(outcomes) {
                    if matches!(outcome, BatchOutcome::Applied { .. }) {
                        consumed.fetch_add(1, Ordering::Relaxed);
                    }
                    let label = outcome.name();
                    metrics::counter!(sealpost::observe::CONSUMER_MESSAGES,
                        "consumer" => consumer_label.clone(), "outcome" => label)
                    .increment(1);
                    if let BatchOutcome::Failed { error } = outcome {
                        let delivered = delivered(msg);
                        match decide_failed_delivery(delivered, Failure::Message, policy) {
                            FailedDelivery::Retry { delay_ms } => {
                                tracing::warn!(subject = %msg.subject, delivered, delay_ms, %error,
                                    "effect failed and was rolled back; the message comes back after the delay");
                                nak(msg, delay_ms).await;
                            }
                            FailedDelivery::DeadLetter => dead.push((msg, error)),
                        }
                        continue;
                    }
                    if cfg.drill_skip_consumer_ack {
                        continue; // drill: committed, then the ack is "lost"
                    }
                    if let Err(e) = msg.ack().await {
                        tracing::warn!(error = %e, "ack lost; the broker will redeliver and the inbox absorbs it");
                    }
                }
                give_up(
                    &pg,
                    &consumer_id,
                    DeadLetterKind::EffectFailed,
                    &dead,
                    policy,
                )
                .await;
            }
            Err(e) => {
                tracing::warn!(error = %e, messages = held.len(), "inbox transaction failed; the batch comes back after a delay");
                for msg in &held {
                    // Not the messages' fault: never dead-lettered for it.
                    if let FailedDelivery::Retry { delay_ms } =
                        decide_failed_delivery(delivered(msg), Failure::Transaction, policy)
                    {
                        nak(msg, delay_ms).await;
                    }
                }
                if pg.is_closed() {
                    pg = pg_connect(&cfg.database_url).await?;
                }
            }
        }
    }
    progress.report(&jc).await;
    Ok(())
}

/// How many times the broker has delivered `msg` (this delivery included).
fn delivered(msg: &Message) -> u64 {
    msg.info().map_or(1, |i| i.delivered.max(1) as u64)
}

/// Records messages the consumer gives up on as dead letters, then terminates them at the
/// broker. If the record cannot be written, nothing is terminated: each is sent back with
/// its delay (the record is the only evidence; a message is never dropped without it).
async fn give_up(
    pg: &tokio_postgres::Client,
    consumer_id: &str,
    kind: DeadLetterKind,
    messages: &[(&Message, String)],
    policy: RedeliveryPolicy,
) {
    if messages.is_empty() {
        return;
    }
    let letters: Vec<DeadLetter> = messages
        .iter()
        .map(|(m, reason)| {
            let info = m.info().ok();
            let d = sealpost_nats::delivery_of(m);
            DeadLetter {
                kind,
                event: d.as_ref().map(|d| (d.event_id, d.member)),
                stream: info
                    .as_ref()
                    .map_or(String::new(), |i| i.stream.to_string()),
                sequence: info.as_ref().map_or(0, |i| i.stream_sequence),
                subject: m.subject.to_string(),
                delivered: delivered(m),
                reason: reason.clone(),
                payload: m.payload.to_vec(),
            }
        })
        .collect();
    match inbox::dead_letter(pg, consumer_id, &letters).await {
        Ok(()) => {
            for ((m, reason), l) in messages.iter().zip(&letters) {
                tracing::error!(subject = %m.subject, stream = %l.stream, sequence = l.sequence,
                    delivered = l.delivered, %reason,
                    "message dead-lettered: recorded in sealpost.inbox_quarantine, the broker will not redeliver it");
                if let Err(e) = m.ack_with(AckKind::Term).await {
                    tracing::warn!(error = %e, "terminate lost; the redelivery finds the dead letter already recorded");
                }
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, messages = messages.len(),
                "cannot record dead letters; the messages come back after a delay");
            for (m, _) in messages {
                if let FailedDelivery::Retry { delay_ms } =
                    decide_failed_delivery(delivered(m), Failure::Transaction, policy)
                {
                    nak(m, delay_ms).await;
                }
            }
        }
    }
}

/// What is wrong with a message's Sealpost headers, in words for the dead letter.
fn unreadable_reason(msg: &Message) -> String {
    let Some(h) = msg.headers.as_ref() else {
        return "no headers: not a Sealpost message".into();
    };
    let get = |n: &str| h.get(n).map(|v| v.as_str().to_string());
    let mut wrong = Vec::new();
    match get(sealpost_nats::H_EVENT_ID) {
        None => wrong.push(format!("{} missing", sealpost_nats::H_EVENT_ID)),
        Some(v) if EventId::parse(&v).is_none() => {
            wrong.push(format!("{} `{v}` is not a UUID", sealpost_nats::H_EVENT_ID))
        }
        _ => {}
    }
    match get(sealpost_nats::H_MEMBER) {
        None => wrong.push(format!("{} missing", sealpost_nats::H_MEMBER)),
        Some(v) if v.parse::<u16>().is_err() => {
            wrong.push(format!("{} `{v}` is not a number", sealpost_nats::H_MEMBER))
        }
        _ => {}
    }
    match get(sealpost_nats::H_PAYLOAD_DIGEST) {
        None => wrong.push(format!("{} missing", sealpost_nats::H_PAYLOAD_DIGEST)),
        Some(v) if Digest::from_hex(&v).is_none() => wrong.push(format!(
            "{} `{v}` is not a hex digest",
            sealpost_nats::H_PAYLOAD_DIGEST
        )),
        _ => {}
    }
    if msg.info().is_err() {
        wrong.push("no JetStream metadata".into());
    }
    if wrong.is_empty() {
        "unreadable Sealpost headers".into()
    } else {
        format!("unreadable Sealpost headers: {}", wrong.join("; "))
    }
}

/// The consumer's reports of its contiguous watermark to the outbox database.
struct Progress {
    url: String,
    consumer_id: String,
    stream: String,
    every: Duration,
    last: Option<std::time::Instant>,
    outbox: Option<tokio_postgres::Client>,
}

impl Progress {
    fn new(cfg: &Config, consumer_id: &str, stream: &str) -> Progress {
        Progress {
            url: cfg.outbox_url().to_string(),
            consumer_id: consumer_id.to_string(),
            stream: stream.to_string(),
            every: Duration::from_millis(cfg.consumer_progress_every_ms),
            last: None,
            outbox: None,
        }
    }

    /// Reports when `consumer_progress_every_ms` has passed since the last report.
    async fn maybe_report(&mut self, jc: &PullConsumer) {
        if self.last.is_none_or(|t| t.elapsed() >= self.every) {
            self.report(jc).await;
        }
    }

    /// Reports the durable consumer's ack floor. A failure is logged with its cause and
    /// retried at the next report; it never stops consumption (purge just waits longer).
    async fn report(&mut self, jc: &PullConsumer) {
        self.last = Some(std::time::Instant::now());
        let floor = match jc.get_info().await {
            Ok(i) => i.ack_floor.stream_sequence,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the consumer's ack floor; progress not reported");
                return;
            }
        };
        if self.outbox.as_ref().is_none_or(|c| c.is_closed()) {
            match pg_connect(&self.url).await {
                Ok(c) => self.outbox = Some(c),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot reach the outbox database; progress not reported");
                    return;
                }
            }
        }
        let Some(outbox) = &self.outbox else { return };
        if let Err(e) = inbox::report_progress(outbox, &self.consumer_id, &self.stream, floor).await
        {
            tracing::warn!(error = %e, "progress not reported to the outbox database (is it migrated, and may this consumer write sealpost.consumer_progress?)");
        }
    }
}

type PullConsumer =
    async_nats::jetstream::consumer::Consumer<async_nats::jetstream::consumer::pull::Config>;

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
pub(crate) struct FulfilmentRow {
    pub(crate) event_id: uuid::Uuid,
    pub(crate) order_id: String,
    pub(crate) idempotency_key: String,
}

/// The `order_id` of a demo order payload (empty if it has none).
pub(crate) fn order_id(payload: &[u8]) -> String {
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
pub(crate) fn fulfil(consumer_id: String, rows: Vec<FulfilmentRow>) -> inbox::BatchEffect<'static> {
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

/// Sends a message back to the broker for redelivery after `delay_ms` (the core's delay).
async fn nak(msg: &Message, delay_ms: u64) {
    if let Err(e) = msg
        .ack_with(AckKind::Nak(Some(Duration::from_millis(delay_ms))))
        .await
    {
        tracing::warn!(error = %e, "nak lost; the broker redelivers after the ack wait");
    }
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
        stream: d.stream,
        sequence: d.sequence,
    })
}
