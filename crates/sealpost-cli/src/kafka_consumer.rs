//! The example fulfilment consumer over Kafka (`sealpost consume --broker kafka`): a consumer
//! group named after the consumer id reads the topic with automatic commits off, applies what
//! arrives in batches (up to 500 records, or what came within 50 ms of the first) through the
//! library's inbox ([`sealpost::inbox::process_batch_within`]) with the same effect as the
//! NATS consumer, and commits the group's offsets **only after** that transaction commits. A
//! crash between the two redelivers records the inbox has already applied: duplicates,
//! acknowledged and applied once. A second copy of an event (an unknown outcome retried to
//! the frozen partition) is the same.
//!
//! A record's position is `(<topic>/<partition>, offset + 1)`, the same numbers the
//! dispatcher's receipt holds (topic, partition, offset + 1).
//!
//! Every decision is the core's (`decide_failed_delivery`, `decide_unreadable_delivery`).
//! Kafka has no per-record nack: when a record's effect fails, the partition's committed
//! offset stays at that record, the consumer waits the core's delay and seeks the partition
//! back to it (records after it that were applied come again and are duplicates). The
//! delivery count is kept in memory per (partition, offset); a restart counts from 1 again. A
//! record given up on is written to `sealpost.inbox_quarantine` first and only then passed
//! (its offset committed); if the record cannot be written, the partition is sought back.
//! The wait stalls this consumer's other partitions too (a simple example, not a scheduler).
//!
//! Not done here: the consumer-progress report `sealpost purge` reads (as for RabbitMQ);
//! purging Kafka-routed rows needs `--no-consumers` or consumers it does not wait for.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sealpost::inbox::{self, BatchOutcome, DeadLetter, DeadLetterKind, Delivery};
use sealpost::runtime::{pg_connect, Config, RunError};
use sealpost_core::envelope::{EventId, PAYLOAD_DOMAIN};
use sealpost_core::inbox::{
    decide_failed_delivery, decide_unreadable_delivery, FailedDelivery, Failure, RedeliveryPolicy,
};
use sealpost_core::Digest;
use sealpost_kafka::rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use sealpost_kafka::rdkafka::message::{Message, OwnedMessage};
use sealpost_kafka::rdkafka::{ClientConfig, Offset, TopicPartitionList};
use sealpost_kafka::{H_EVENT_ID, H_MEMBER, H_PAYLOAD_DIGEST};

/// Records applied in one inbox transaction at most.
const BATCH_MAX: usize = 500;

use sealpost_kafka::header_str as header;

/// The record's position in the consumer's inbox: `<topic>/<partition>`, offset + 1.
fn position(m: &OwnedMessage) -> (String, u64) {
    (
        format!("{}/{}", m.topic(), m.partition()),
        m.offset() as u64 + 1,
    )
}

fn delivery_of(m: &OwnedMessage) -> Option<Delivery> {
    let (stream, sequence) = position(m);
    Some(Delivery {
        event_id: EventId::parse(header(m, H_EVENT_ID)?)?,
        member: header(m, H_MEMBER)?.parse().ok()?,
        claimed_digest: Digest::from_hex(header(m, H_PAYLOAD_DIGEST)?)?,
        payload_digest: Digest::of_bytes(PAYLOAD_DOMAIN, m.payload().unwrap_or_default()),
        stream,
        sequence,
    })
}

fn unreadable_reason(m: &OwnedMessage) -> String {
    if m.headers().is_none() {
        return "no headers: not a Sealpost record".into();
    }
    let mut wrong = Vec::new();
    if header(m, H_EVENT_ID).and_then(EventId::parse).is_none() {
        wrong.push(format!("{H_EVENT_ID} missing or not a UUID"));
    }
    if header(m, H_MEMBER)
        .and_then(|v| v.parse::<u16>().ok())
        .is_none()
    {
        wrong.push(format!("{H_MEMBER} missing or not a number"));
    }
    if header(m, H_PAYLOAD_DIGEST)
        .and_then(Digest::from_hex)
        .is_none()
    {
        wrong.push(format!("{H_PAYLOAD_DIGEST} missing or not a hex digest"));
    }
    format!("unreadable Sealpost headers: {}", wrong.join(", "))
}

fn subscribe(cfg: &Config, consumer_id: &str, topic: &str) -> Result<StreamConsumer, RunError> {
    let mut cc = ClientConfig::new();
    cc.set("bootstrap.servers", &cfg.kafka_brokers)
        .set("broker.address.family", "v4")
        .set("group.id", consumer_id)
        .set(
            "client.id",
            format!("sealpost-consume-{consumer_id}-{}", std::process::id()),
        )
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "10000");
    let props = sealpost_kafka::parse_properties(&cfg.kafka_client_properties).map_err(|e| {
        RunError::broker(std::io::Error::other(format!(
            "config key `kafka_client_properties` (or KAFKA_CLIENT_PROPERTIES): {e}"
        )))
    })?;
    let password_file = (!cfg.kafka_sasl_password_file.is_empty())
        .then(|| std::path::Path::new(&cfg.kafka_sasl_password_file));
    for (k, v) in sealpost_kafka::with_secrets(&props, password_file).map_err(RunError::broker)? {
        cc.set(k, v);
    }
    let c: StreamConsumer = sealpost_kafka::create_client(&cc).map_err(RunError::broker)?;
    c.subscribe(&[topic]).map_err(RunError::broker)?;
    Ok(c)
}

/// Up to [`BATCH_MAX`] records: waits up to 300 ms for the first, then takes what arrives
/// within 50 ms.
async fn next_batch(c: &StreamConsumer) -> Vec<OwnedMessage> {
    let mut out = Vec::new();
    let mut until = Instant::now() + Duration::from_millis(300);
    while out.len() < BATCH_MAX {
        let left = until.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, c.recv()).await {
            Err(_) => break,
            Ok(Ok(m)) => {
                if out.is_empty() {
                    until = Instant::now() + Duration::from_millis(50);
                }
                out.push(m.detach());
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "Kafka consumer error; retrying");
                break;
            }
        }
    }
    out
}

/// What to do with each partition after a batch.
#[derive(Default)]
struct PartitionPlan {
    /// Next offset to commit (one past the last record passed).
    commit: Option<i64>,
    /// Seek back to this offset after this delay: the first record not passed.
    retry: Option<(i64, u64)>,
}

/// Runs the example consumer `consumer_id` on topic `topic` until `stop` is set, counting each
/// effect applied in `consumed`.
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
    let consumer = subscribe(&cfg, &consumer_id, &topic)?;
    let mut delivered: HashMap<(i32, i64), u64> = HashMap::new();
    while !stop.load(Ordering::Relaxed) {
        let records = next_batch(&consumer).await;
        if records.is_empty() {
            continue;
        }
        let mut plans: BTreeMap<i32, PartitionPlan> = BTreeMap::new();
        // A record is passed (its offset may be committed) unless an earlier record of its
        // partition is being retried.
        let pass = |plans: &mut BTreeMap<i32, PartitionPlan>, m: &OwnedMessage| {
            let p = plans.entry(m.partition()).or_default();
            if p.retry.is_none() {
                p.commit = Some(m.offset() + 1);
            }
        };
        let retry = |plans: &mut BTreeMap<i32, PartitionPlan>, m: &OwnedMessage, delay_ms: u64| {
            let p = plans.entry(m.partition()).or_default();
            if p.retry.is_none() {
                p.retry = Some((m.offset(), delay_ms));
            }
        };
        let mut held = Vec::with_capacity(records.len());
        let mut deliveries = Vec::with_capacity(records.len());
        let mut rows = Vec::with_capacity(records.len());
        let mut letters: Vec<(OwnedMessage, DeadLetterKind, String, u64)> = Vec::new();
        for m in records {
            let count = delivered.entry((m.partition(), m.offset())).or_insert(0);
            *count += 1;
            let count = *count;
            let Some(d) = delivery_of(&m) else {
                match decide_unreadable_delivery() {
                    FailedDelivery::DeadLetter => {
                        let why = unreadable_reason(&m);
                        letters.push((m, DeadLetterKind::Unreadable, why, count));
                    }
                    FailedDelivery::Retry { delay_ms } => retry(&mut plans, &m, delay_ms),
                }
                continue;
            };
            rows.push(crate::consumer::FulfilmentRow {
                event_id: uuid::Uuid::from_bytes(d.event_id.0),
                order_id: crate::consumer::order_id(m.payload().unwrap_or_default()),
                idempotency_key: sealpost_core::inbox::idempotency_key(
                    d.event_id,
                    &consumer_id,
                    "fulfil",
                ),
            });
            deliveries.push(d);
            held.push(m);
        }
        // Records in batch order, with what happened to each, for the offsets below.
        let mut settled: Vec<(OwnedMessage, Option<u64>)> = Vec::new();
        if !held.is_empty() {
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
                    for (m, outcome) in held.into_iter().zip(outcomes) {
                        let what = outcome.name();
                        metrics::counter!(sealpost::observe::CONSUMER_MESSAGES,
                            "consumer" => label.clone(), "outcome" => what)
                        .increment(1);
                        if matches!(outcome, BatchOutcome::Applied { .. }) {
                            consumed.fetch_add(1, Ordering::Relaxed);
                        }
                        if let BatchOutcome::Failed { error } = outcome {
                            let n = delivered
                                .get(&(m.partition(), m.offset()))
                                .copied()
                                .unwrap_or(1);
                            match decide_failed_delivery(n, Failure::Message, policy) {
                                FailedDelivery::Retry { delay_ms } => {
                                    tracing::warn!(topic = %m.topic(), partition = m.partition(), offset = m.offset(),
                                        delivered = n, delay_ms, %error,
                                        "effect failed and was rolled back; the partition is read again from this record after the delay");
                                    settled.push((m, Some(delay_ms)));
                                }
                                FailedDelivery::DeadLetter => {
                                    letters.push((m, DeadLetterKind::EffectFailed, error, n));
                                }
                            }
                            continue;
                        }
                        settled.push((m, None));
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, records = held.len(), "inbox transaction failed; the records are read again after a delay");
                    for m in held {
                        let n = delivered
                            .get(&(m.partition(), m.offset()))
                            .copied()
                            .unwrap_or(1);
                        let delay_ms = match decide_failed_delivery(n, Failure::Transaction, policy)
                        {
                            FailedDelivery::Retry { delay_ms } => delay_ms,
                            FailedDelivery::DeadLetter => policy.backoff_first_ms,
                        };
                        settled.push((m, Some(delay_ms)));
                    }
                    if pg.is_closed() {
                        pg = pg_connect(&cfg.database_url).await?;
                    }
                }
            }
        }
        // Dead letters are recorded before their offsets pass; a failed record keeps them.
        if !letters.is_empty() {
            let recorded = give_up(&pg, &consumer_id, &letters).await;
            for (m, _, _, _) in letters {
                settled.push((m, (!recorded).then_some(policy.backoff_first_ms)));
            }
        }
        settled.sort_by_key(|(m, _)| (m.partition(), m.offset()));
        for (m, retry_after) in &settled {
            match retry_after {
                None => pass(&mut plans, m),
                Some(d) => retry(&mut plans, m, *d),
            }
        }
        if cfg.drill_skip_consumer_ack {
            continue; // drill: committed, then the offset commit is "lost"
        }
        let mut tpl = TopicPartitionList::new();
        for (p, plan) in &plans {
            if let Some(o) = plan.commit {
                let _ = tpl.add_partition_offset(&topic, *p, Offset::Offset(o));
            }
        }
        if tpl.count() > 0 {
            if let Err(e) = consumer.commit(&tpl, CommitMode::Async) {
                tracing::warn!(error = %e, "offset commit lost; the records come again and the inbox absorbs them");
            }
        }
        let waits: Vec<(i32, i64, u64)> = plans
            .iter()
            .filter_map(|(p, plan)| plan.retry.map(|(o, d)| (*p, o, d)))
            .collect();
        if let Some(delay) = waits.iter().map(|w| w.2).max() {
            tokio::time::sleep(Duration::from_millis(delay)).await;
            for (p, o, _) in waits {
                if let Err(e) = consumer.seek(&topic, p, Offset::Offset(o), Duration::from_secs(5))
                {
                    tracing::warn!(error = %e, partition = p, offset = o,
                        "seek failed; the record comes again after a rebalance or restart (its offset was not committed)");
                }
            }
        }
        delivered.retain(|(p, o), _| {
            plans
                .get(p)
                .is_none_or(|plan| plan.commit.is_none_or(|c| *o >= c))
        });
    }
    Ok(())
}

/// Records the records given up on as dead letters; `false` if the record could not be
/// written (then nothing passes: the records are read again).
async fn give_up(
    pg: &tokio_postgres::Client,
    consumer_id: &str,
    letters: &[(OwnedMessage, DeadLetterKind, String, u64)],
) -> bool {
    let rows: Vec<DeadLetter> = letters
        .iter()
        .map(|(m, kind, reason, n)| {
            let d = delivery_of(m);
            let (stream, sequence) = position(m);
            DeadLetter {
                kind: *kind,
                event: d.as_ref().map(|d| (d.event_id, d.member)),
                stream,
                sequence,
                subject: m
                    .key()
                    .map(|k| String::from_utf8_lossy(k).into_owned())
                    .unwrap_or_default(),
                delivered: *n,
                reason: reason.clone(),
                payload: m.payload().unwrap_or_default().to_vec(),
            }
        })
        .collect();
    match inbox::dead_letter(pg, consumer_id, &rows).await {
        Ok(()) => {
            for l in &rows {
                tracing::error!(stream = %l.stream, offset = l.sequence - 1, reason = %l.reason,
                    "record dead-lettered: recorded in sealpost.inbox_quarantine, its offset passes");
            }
            true
        }
        Err(e) => {
            tracing::warn!(error = %e, records = rows.len(), "cannot record dead letters; the records are read again");
            false
        }
    }
}
