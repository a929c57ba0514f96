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
//! **Gaps.** Each partition's records are handed out in offset order without a hole: a
//! record past the one expected next (the broker served a later record before an earlier
//! one was readable, as tansu 0.6 can while several producers write one partition) is not
//! handed out; the partition is held and read again from the expected offset after 100 ms.
//! Committing past the hole would lose the missing record to this consumer for good. After
//! three re-reads the hole is taken as real (a compacted topic, another producer's
//! transaction markers) and passed with a warning.
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
/// How long a partition with a hole waits before it is read again.
const GAP_DELAY: Duration = Duration::from_millis(100);
/// Re-reads of a hole before it is taken as real.
const GAP_REREADS: u32 = 3;

/// What to do with a record, given where its partition's next record is expected.
#[derive(Debug, PartialEq, Eq)]
enum Admit {
    /// Hand it out.
    Hand,
    /// Not yet: the records before it are missing; read the partition again from this
    /// offset.
    ReadAgainFrom(i64),
    /// Hand it out, passing a hole the re-reads did not fill (`missing` records).
    PassHole { missing: i64 },
}

/// Each partition's next expected offset (known once a record of it was handed out, or it
/// was sought), and the re-reads of the hole in front of it.
#[derive(Default)]
struct Positions {
    next: HashMap<i32, i64>,
    rereads: HashMap<i32, (i64, u32)>,
}

impl Positions {
    fn admit(&mut self, partition: i32, offset: i64) -> Admit {
        let mut admit = Admit::Hand;
        if let Some(&next) = self.next.get(&partition) {
            if offset > next {
                let tries = match self.rereads.get(&partition) {
                    Some(&(at, n)) if at == next => n,
                    _ => 0,
                };
                if tries < GAP_REREADS {
                    self.rereads.insert(partition, (next, tries + 1));
                    return Admit::ReadAgainFrom(next);
                }
                admit = Admit::PassHole {
                    missing: offset - next,
                };
            }
        }
        // In order, a hole passed, or back to an earlier record (a rebalance resumed from
        // the committed offset): expected next is the one after it.
        self.rereads.remove(&partition);
        self.next.insert(partition, offset + 1);
        admit
    }

    /// Where the partition's next record is expected, if known.
    fn expected(&self, partition: i32) -> Option<i64> {
        self.next.get(&partition).copied()
    }

    /// The partition was sought to `offset`: its next record is that one.
    fn sought(&mut self, partition: i32, offset: i64) {
        self.next.insert(partition, offset);
    }
}

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
    /// Where each partition's next record is expected.
    positions: Positions,
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
            positions: Positions::default(),
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
                    self.positions.sought(p, o);
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
                        // Over the limits: read again with the next batch (from the record
                        // expected next, should this one be past a hole).
                        let from = self
                            .positions
                            .expected(m.partition())
                            .map_or(m.offset(), |n| n.min(m.offset()));
                        self.pending.insert(m.partition(), (from, Instant::now()));
                        break;
                    }
                    match self.positions.admit(m.partition(), m.offset()) {
                        Admit::Hand => {}
                        Admit::ReadAgainFrom(o) => {
                            tracing::warn!(partition = m.partition(), expected = o, got = m.offset(),
                                "the broker skipped records of a partition; reading it again from the expected offset");
                            self.pending
                                .insert(m.partition(), (o, Instant::now() + GAP_DELAY));
                            continue;
                        }
                        Admit::PassHole { missing } => {
                            tracing::warn!(partition = m.partition(), offset = m.offset(), missing,
                                "records before this one are still absent after {GAP_REREADS} re-reads; passing the hole (a compacted topic or transaction markers leave such holes)");
                        }
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
        self.positions = Positions::default();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_are_handed_out_in_order_and_a_hole_is_read_again_before_it_is_passed() {
        let mut p = Positions::default();
        // The first record of a partition is taken as it comes (its start is not known).
        assert_eq!(p.admit(0, 10), Admit::Hand);
        assert_eq!(p.admit(0, 11), Admit::Hand);
        // 12 missing: read again from 12, three times.
        for _ in 0..GAP_REREADS {
            assert_eq!(p.admit(0, 13), Admit::ReadAgainFrom(12));
            p.sought(0, 12);
        }
        // The hole filled meanwhile: in order again, and a later hole starts its own count.
        assert_eq!(p.admit(0, 12), Admit::Hand);
        assert_eq!(p.admit(0, 13), Admit::Hand);
        assert_eq!(p.admit(0, 15), Admit::ReadAgainFrom(14));
        for _ in 1..GAP_REREADS {
            assert_eq!(p.admit(0, 15), Admit::ReadAgainFrom(14));
        }
        // Still absent after the re-reads: passed, with the count of what is missing.
        assert_eq!(p.admit(0, 15), Admit::PassHole { missing: 1 });
        assert_eq!(p.admit(0, 16), Admit::Hand);
        // Other partitions are their own.
        assert_eq!(p.admit(1, 500), Admit::Hand);
        assert_eq!(p.admit(1, 502), Admit::ReadAgainFrom(501));
        // Back to an earlier record (a rebalance resumed from the committed offset).
        assert_eq!(p.admit(0, 3), Admit::Hand);
        assert_eq!(p.admit(0, 4), Admit::Hand);
        assert_eq!(p.expected(0), Some(5));
        // A seek says where the next record is.
        p.sought(0, 40);
        assert_eq!(p.admit(0, 41), Admit::ReadAgainFrom(40));
    }
}
