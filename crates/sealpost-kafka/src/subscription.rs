//! The consumer side of the Kafka adapter: [`KafkaSubscription`] implements the subscription
//! port ([`sealpost_core::subscription::Subscription`]) with a consumer group named after
//! the consumer id, automatic commits and offset stores off. A record's position is
//! `(<topic>/<partition>, offset + 1)`, the numbers of the dispatcher's receipt.
//!
//! **Settlement.** Kafka has no per-record ack: the group's offset of a partition is
//! committed up to the first record of the batch that is not settled for good, and only
//! after the inbox transaction committed (the consumer settles after its commit). A record
//! to retry keeps its partition's offset there; the partition is sought back to it once the
//! core's delay has passed, and until then nothing more of that partition is handed out
//! (what was fetched of it is read again after the seek, and the inbox absorbs what it
//! already applied). A terminated record (its dead letter committed) is passed. Delivery
//! counts are kept in memory per (partition, offset): a restart counts from 1 again.
//!
//! **Watermark.** The group's committed offset of each partition, reported as stream
//! `<topic>/<partition>`: a row at (partition p, offset + 1) at or below it is below p's
//! committed offset, so the group settled it (`sealpost purge` reads a Kafka row's
//! watermark under the same name).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{Message, OwnedMessage};
use rdkafka::{Offset, TopicPartitionList};
use sealpost_core::encoding::Digest;
use sealpost_core::envelope::EventId;
use sealpost_core::subscription::{
    FetchLimits, Received, SealpostHeaders, Settlement, Subscription,
};

use crate::{
    client_config, create_client, header_str, scrub_secrets, with_properties, with_secrets,
    KafkaAdapterError, KafkaConfig, H_EVENT_ID, H_MEMBER, H_PAYLOAD_DIGEST,
};

/// How long a fetch waits for more records once the first arrived.
const LINGER: Duration = Duration::from_millis(50);
/// Bound on a seek, a commit read and a metadata read.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// A consumer group member reading one topic.
pub struct KafkaSubscription {
    cfg: KafkaConfig,
    topic: String,
    group: String,
    consumer: Arc<StreamConsumer>,
    /// Deliveries per (partition, offset) of records not yet passed.
    delivered: HashMap<(i32, i64), u64>,
    /// Partitions waiting to be sought back: (offset, when).
    pending: BTreeMap<i32, (i64, Instant)>,
}

fn consumer(
    cfg: &KafkaConfig,
    topic: &str,
    group: &str,
) -> Result<StreamConsumer, KafkaAdapterError> {
    let mut c: ClientConfig = client_config(cfg);
    c.set("group.id", group)
        .set(
            "client.id",
            format!("sealpost-consume-{group}-{}", std::process::id()),
        )
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "10000");
    // The user's properties and the SASL password file, applied last; a configuration
    // error never shows a secret's value.
    let props = with_secrets(&cfg.client_properties, cfg.sasl_password_file.as_deref())?;
    let c: StreamConsumer = create_client(&with_properties(c, &props)).map_err(|source| {
        KafkaAdapterError::Connect {
            brokers: sealpost_core::secret::redact_url(&cfg.brokers),
            cause: scrub_secrets(&source.to_string(), &props),
            source: Box::new(source),
            last: String::new(),
        }
    })?;
    c.subscribe(&[topic])
        .map_err(|e| KafkaAdapterError::Topology {
            what: format!("subscribing group `{group}` to topic `{topic}`"),
            detail: e.to_string(),
        })?;
    Ok(c)
}

impl KafkaSubscription {
    /// Joins consumer group `group` on `topic` (from the earliest offset when the group has
    /// none), with the adapter's settings and client properties.
    pub fn subscribe(
        cfg: &KafkaConfig,
        topic: &str,
        group: &str,
    ) -> Result<KafkaSubscription, KafkaAdapterError> {
        Ok(KafkaSubscription {
            cfg: cfg.clone(),
            topic: topic.to_string(),
            group: group.to_string(),
            consumer: Arc::new(consumer(cfg, topic, group)?),
            delivered: HashMap::new(),
            pending: BTreeMap::new(),
        })
    }

    /// Seeks back the partitions whose delay has passed; a failed seek is tried again.
    fn seek_due(&mut self) {
        let now = Instant::now();
        let due: Vec<(i32, i64)> = self
            .pending
            .iter()
            .filter(|(_, (_, at))| *at <= now)
            .map(|(p, (o, _))| (*p, *o))
            .collect();
        for (p, o) in due {
            match self
                .consumer
                .seek(&self.topic, p, Offset::Offset(o), CALL_TIMEOUT)
            {
                Ok(()) => {
                    self.pending.remove(&p);
                }
                Err(e) => {
                    tracing::warn!(error = %e, partition = p, offset = o,
                        "seek failed; the partition stays held and the seek is tried again");
                }
            }
        }
    }

    fn error(&self, what: &str, e: impl std::fmt::Display) -> KafkaAdapterError {
        KafkaAdapterError::Topology {
            what: format!("{what} (group `{}`, topic `{}`)", self.group, self.topic),
            detail: e.to_string(),
        }
    }
}

/// What is wrong with a record's Sealpost headers, in words for the dead letter.
pub fn unreadable_reason(m: &OwnedMessage) -> String {
    if m.headers().is_none() {
        return "no headers: not a Sealpost record".into();
    }
    let mut wrong = Vec::new();
    if header_str(m, H_EVENT_ID).and_then(EventId::parse).is_none() {
        wrong.push(format!("{H_EVENT_ID} missing or not a UUID"));
    }
    if header_str(m, H_MEMBER)
        .and_then(|v| v.parse::<u16>().ok())
        .is_none()
    {
        wrong.push(format!("{H_MEMBER} missing or not a number"));
    }
    if header_str(m, H_PAYLOAD_DIGEST)
        .and_then(Digest::from_hex)
        .is_none()
    {
        wrong.push(format!("{H_PAYLOAD_DIGEST} missing or not a hex digest"));
    }
    format!("unreadable Sealpost headers: {}", wrong.join(", "))
}

fn headers_of(m: &OwnedMessage) -> Result<SealpostHeaders, String> {
    let read = || {
        Some(
            SealpostHeaders {
                event_id: EventId::parse(header_str(m, H_EVENT_ID)?)?,
                member: header_str(m, H_MEMBER)?.parse().ok()?,
                claimed_digest: Digest::from_hex(header_str(m, H_PAYLOAD_DIGEST)?)?,
                envelope: None,
                envelope_generation: None,
                destination_digest: None,
                signature: None,
            }
            .with_seal(|n| header_str(m, n)),
        )
    };
    read().ok_or_else(|| unreadable_reason(m))
}

impl Subscription for KafkaSubscription {
    type Message = OwnedMessage;
    type Error = KafkaAdapterError;

    /// Waits up to `wait_ms` for the first record, then takes what arrives within 50 ms, up
    /// to the limits. Records of a partition waiting for its seek are not handed out.
    async fn fetch(&mut self, limits: FetchLimits) -> Result<Vec<OwnedMessage>, Self::Error> {
        if let Some((code, why)) = self.consumer.client().fatal_error() {
            return Err(self.error("the consumer failed for good", format!("{code}: {why}")));
        }
        self.seek_due();
        let mut out = Vec::new();
        let mut bytes = 0usize;
        let mut until = Instant::now() + Duration::from_millis(limits.wait_ms.max(1));
        loop {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            match tokio::time::timeout(left, self.consumer.recv()).await {
                Err(_) => break,
                Ok(Ok(m)) => {
                    if self.pending.contains_key(&m.partition()) {
                        continue; // read again after its partition's seek
                    }
                    let size = m.payload().map_or(0, <[u8]>::len);
                    if !limits.admits(out.len(), bytes, size) {
                        // Over the limits: read again with the next batch.
                        self.pending
                            .insert(m.partition(), (m.offset(), Instant::now()));
                        break;
                    }
                    if out.is_empty() {
                        until = Instant::now() + LINGER;
                    }
                    bytes += size;
                    *self
                        .delivered
                        .entry((m.partition(), m.offset()))
                        .or_insert(0) += 1;
                    out.push(m.detach());
                    if out.len() >= limits.messages_max.max(1) {
                        break;
                    }
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "Kafka consumer error; fetching again");
                    break;
                }
            }
        }
        Ok(out)
    }

    fn read<'m>(&self, m: &'m OwnedMessage) -> Received<'m> {
        Received {
            headers: headers_of(m),
            stream: format!("{}/{}", m.topic(), m.partition()),
            sequence: m.offset() as u64 + 1,
            subject: m
                .key()
                .map(|k| String::from_utf8_lossy(k).into_owned())
                .unwrap_or_default(),
            delivered: self
                .delivered
                .get(&(m.partition(), m.offset()))
                .copied()
                .unwrap_or(1),
            payload: m.payload().unwrap_or_default(),
        }
    }

    /// Commits each partition's offset past the records settled for good before the first
    /// one to retry, and holds that partition until its seek back.
    async fn settle(&mut self, batch: Vec<(OwnedMessage, Settlement)>) -> Result<(), Self::Error> {
        let mut batch = batch;
        batch.sort_by_key(|(m, _)| (m.partition(), m.offset()));
        let mut commit: BTreeMap<i32, i64> = BTreeMap::new();
        let mut retry: BTreeMap<i32, (i64, u64)> = BTreeMap::new();
        for (m, s) in &batch {
            let p = m.partition();
            if retry.contains_key(&p) {
                continue;
            }
            match s {
                Settlement::Ack | Settlement::Terminate => {
                    commit.insert(p, m.offset() + 1);
                }
                Settlement::RetryAfter { delay_ms } => {
                    retry.insert(p, (m.offset(), *delay_ms));
                }
            }
        }
        let mut tpl = TopicPartitionList::new();
        for (p, o) in &commit {
            let _ = tpl.add_partition_offset(&self.topic, *p, Offset::Offset(*o));
        }
        if tpl.count() > 0 {
            if let Err(e) = self.consumer.commit(&tpl, CommitMode::Async) {
                tracing::warn!(error = %e, "offset commit lost; the records come again and the inbox absorbs them");
            }
        }
        let now = Instant::now();
        for (p, (o, delay_ms)) in retry {
            tracing::debug!(
                partition = p,
                offset = o,
                delay_ms,
                "partition held until its seek back"
            );
            self.pending
                .insert(p, (o, now + Duration::from_millis(delay_ms)));
        }
        self.delivered
            .retain(|(p, o), _| commit.get(p).is_none_or(|c| *o >= *c));
        Ok(())
    }

    /// The group's committed offset of every partition of the topic, as
    /// `<topic>/<partition>` (the stream `sealpost purge` reads for a Kafka row).
    async fn watermarks(&mut self) -> Result<Vec<(String, u64)>, Self::Error> {
        let c = self.consumer.clone();
        let topic = self.topic.clone();
        let r = tokio::task::spawn_blocking(move || -> Result<Vec<(String, u64)>, String> {
            let md = c
                .fetch_metadata(Some(&topic), CALL_TIMEOUT)
                .map_err(|e| e.to_string())?;
            let Some(t) = md.topics().iter().find(|t| t.name() == topic) else {
                return Ok(Vec::new());
            };
            let mut tpl = TopicPartitionList::new();
            for p in t.partitions() {
                tpl.add_partition(&topic, p.id());
            }
            if tpl.count() == 0 {
                return Ok(Vec::new());
            }
            let committed = c
                .committed_offsets(tpl, CALL_TIMEOUT)
                .map_err(|e| e.to_string())?;
            Ok(committed
                .elements()
                .iter()
                .filter_map(|e| match e.offset() {
                    Offset::Offset(o) if o > 0 => {
                        Some((format!("{topic}/{}", e.partition()), o as u64))
                    }
                    _ => None,
                })
                .collect())
        })
        .await
        .map_err(|e| self.error("reading the committed offsets", e))?
        .map_err(|e| self.error("reading the committed offsets", e))?;
        Ok(r)
    }

    async fn lag(&mut self) -> Option<u64> {
        None
    }

    /// A new group member; it starts from the committed offsets, so what was held comes
    /// again.
    async fn reconnect(&mut self) -> Result<(), Self::Error> {
        self.consumer = Arc::new(consumer(&self.cfg, &self.topic, &self.group)?);
        self.pending.clear();
        Ok(())
    }
}
