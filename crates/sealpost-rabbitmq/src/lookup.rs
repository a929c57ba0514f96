//! RabbitMQ that can be asked (R13, R31): the **lookup stream**.
//!
//! A queue forgets what its consumers took, so a plain RabbitMQ destination cannot answer
//! "did you store event X?". With [`LookupStream::enabled`] every destination also feeds a
//! RabbitMQ *stream* (`x-queue-type: stream`, an append-only log RabbitMQ 3.9+ keeps for
//! [`LookupStream::max_age`] whatever its readers do), named [`lookup_stream_name`] and bound
//! to the topic exchange with `#`: a publisher confirm then means the stream holds the message
//! too. The consumers keep reading their own quorum queues; nobody but the reconciler reads
//! the stream.
//!
//! **A lookup is a scan** (the same rules as Kafka's, decided by the core's
//! `reconcile::decide_scanned`). It reads the stream over AMQP 0-9-1 (no stream-protocol
//! client needed) from the earliest event's mint time minus
//! [`LookupStream::clock_margin_ms`] (`x-stream-offset` as a timestamp) to an end it fixes
//! first: before reading, it appends a **marker** of its own (a message with
//! [`H_LOOKUP_MARKER`] and no event, through the fanout exchange of the same name that only
//! the stream is bound to, so no consumer ever sees it) and waits for its confirm. Everything
//! the stream stored before the lookup began lies before the marker, so a scan that reaches
//! its marker has read the whole range, and an event it did not see there is proven absent.
//! A scan cut short (more than [`LookupStream::scan_max`] messages, 60 s, a closed channel)
//! learned nothing about the events it did not see.
//!
//! **What a stream cannot prove.** A stream only holds what was published after it was
//! declared, and retention (`x-max-age`) deletes its oldest segments. So each declare appends
//! a marker first (the stream's oldest message says when it began), and a scan whose first
//! message is the stream's first retained one *and* newer than the scan's start answers
//! "cannot be asked" (the reconciler retries to the same exchange, R14) instead of "absent".
//!
//! **Rights.** Declaring needs configure on `sealpost.lookup.<topic>` (an administrator, or
//! [`crate::Rabbit::ensure_destination`]); the reconciler's user needs read on the stream
//! (consume) and write on the marker exchange of that name (`docs/rabbitmq-permissions.sh`).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel};
use sealpost_core::encoding::Digest;
use sealpost_core::envelope::{payload_digest, EventId};
use sealpost_core::port::WireEnvelope;
use sealpost_core::receipt::{Receipt, ReceiptSource};
use sealpost_core::reconcile::{decide_scanned, Lookup, ScanReach};
use sealpost_core::signature::{FoundCopy, COPIES_MAX};

use crate::subscription::string_headers;
use crate::{
    header_str, topology_error, RabbitError, H_ATTEMPT_ID, H_DESTINATION_DIGEST,
    H_ENVELOPE_GENERATION, H_EVENT_ID, H_MEMBER, H_SIGNATURE,
};

/// Header of a lookup stream's marker: a random id, so each scan knows its own.
pub const H_LOOKUP_MARKER: &str = "Sealpost-Lookup-Marker";
/// Header of a marker: when it was appended (unix ms, the appender's clock).
pub const H_MARKER_AT_MS: &str = "Sealpost-Lookup-Marker-At-Ms";
/// Header RabbitMQ puts on every message read from a stream: its offset.
const H_STREAM_OFFSET: &str = "x-stream-offset";

/// Messages a scan may have in flight (a stream consumer needs a prefetch).
const SCAN_PREFETCH: u16 = 1_000;
/// How long a scan may take before it answers "nothing learned" for what it did not see.
const SCAN_TIME_MAX: Duration = Duration::from_secs(60);
/// How long a scan waits for the next message before it gives up.
const SCAN_IDLE_MAX: Duration = Duration::from_secs(10);

/// The `[rabbitmq.lookup]` table: whether destinations get a lookup stream, and how lookups
/// scan it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LookupStream {
    /// Declare a lookup stream per destination and answer lookups from it
    /// (`RABBITMQ_LOOKUP_STREAM`: `true` or `false`). Off: the broker cannot be asked, and an
    /// unknown outcome is retried to the same exchange (R14).
    pub enabled: bool,
    /// The stream's retention, RabbitMQ's `x-max-age` (`7D`, `24h`, `30m`): lookups and the
    /// verification pass reach back this far, and an event older than that is "cannot be
    /// asked".
    pub max_age: String,
    /// How far before an event's mint time a scan starts (the producer's clock against the
    /// broker's).
    pub clock_margin_ms: u64,
    /// Messages one scan reads at most.
    pub scan_max: u64,
    /// Unknown events one scan answers at most.
    pub group_max: usize,
    /// Events of one scan were minted at most this far apart.
    pub group_window_ms: u64,
}

impl Default for LookupStream {
    fn default() -> Self {
        LookupStream {
            enabled: false,
            max_age: "7D".to_string(),
            clock_margin_ms: 60_000,
            scan_max: 1_000_000,
            group_max: 500,
            group_window_ms: 300_000,
        }
    }
}

impl LookupStream {
    /// Checks the values, naming the key and the rule broken.
    // `RabbitError` carries lapin's error (over 100 bytes); this runs once per connect.
    #[allow(clippy::result_large_err)]
    pub fn check(&self) -> Result<(), RabbitError> {
        let bad =
            |option: &'static str, detail: String| Err(RabbitError::Setting { option, detail });
        let (n, unit) = self.max_age.split_at(
            self.max_age
                .find(|c: char| !c.is_ascii_digit())
                .unwrap_or(self.max_age.len()),
        );
        if n.is_empty() || !matches!(unit, "Y" | "M" | "D" | "h" | "m" | "s") {
            return bad(
                "lookup.max_age",
                format!(
                    "`{}` is not a RabbitMQ x-max-age: a number and one of Y, M, D, h, m, s (`7D`)",
                    self.max_age
                ),
            );
        }
        if self.scan_max == 0 {
            return bad("lookup.scan_max", "must be at least 1".into());
        }
        if self.group_max == 0 {
            return bad("lookup.group_max", "must be at least 1".into());
        }
        Ok(())
    }
}

/// The lookup stream of destination topic `topic`, and the fanout exchange its markers go
/// through.
pub fn lookup_stream_name(topic: &str) -> String {
    format!("sealpost.lookup.{topic}")
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A number header, whichever integer width the broker wrote it in (`x-stream-offset` is a
/// signed 64-bit integer, a quorum queue's `x-delivery-count` may be narrower).
pub(crate) fn int_header(props: &BasicProperties, name: &str) -> Option<u64> {
    match props.headers().as_ref()?.inner().get(name)? {
        AMQPValue::LongLongInt(n) => u64::try_from(*n).ok(),
        AMQPValue::LongInt(n) => u64::try_from(*n).ok(),
        AMQPValue::LongUInt(n) => Some(u64::from(*n)),
        AMQPValue::ShortInt(n) => u64::try_from(*n).ok(),
        AMQPValue::ShortUInt(n) => Some(u64::from(*n)),
        AMQPValue::ShortShortInt(n) => u64::try_from(*n).ok(),
        AMQPValue::ShortShortUInt(n) => Some(u64::from(*n)),
        _ => None,
    }
}

/// The latest a stored message can have been appended (unix ms): a marker says it to the
/// millisecond, a message with an AMQP timestamp to the second (rounded up); `None` when it
/// says nothing.
fn appended_by_ms(props: &BasicProperties) -> Option<u64> {
    if let Some(at) = header_str(props, H_MARKER_AT_MS).and_then(|v| v.parse().ok()) {
        return Some(at);
    }
    props.timestamp().map(|s| s * 1000 + 999)
}

/// Declares `topic`'s lookup stream and its marker exchange, binds the stream to both, and
/// appends a marker (so the stream's first message says when it began). Idempotent.
pub(crate) async fn declare(
    ch: &Channel,
    topic: &str,
    cfg: &LookupStream,
) -> Result<(), RabbitError> {
    let name = lookup_stream_name(topic);
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("stream".into()),
    );
    args.insert(
        "x-max-age".into(),
        AMQPValue::LongString(cfg.max_age.as_str().into()),
    );
    let configure = format!("configure permission on `{name}`");
    ch.queue_declare(
        name.as_str().into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .map_err(|source| {
        topology_error(
            format!("declaring lookup stream `{name}`"),
            &configure,
            source,
        )
    })?;
    ch.exchange_declare(
        name.as_str().into(),
        lapin::ExchangeKind::Fanout,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .map_err(|source| {
        topology_error(
            format!("declaring marker exchange `{name}`"),
            &configure,
            source,
        )
    })?;
    for (exchange, key) in [(name.as_str(), ""), (topic, "#")] {
        ch.queue_bind(
            name.as_str().into(),
            exchange.into(),
            key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|source| {
            topology_error(
                format!("binding lookup stream `{name}` to exchange `{exchange}`"),
                &format!("write permission on `{name}` and read permission on `{exchange}`"),
                source,
            )
        })?;
    }
    append_marker(ch, &name, Duration::from_secs(10))
        .await
        .map_err(|why| RabbitError::Topology {
            what: format!("appending the first marker to lookup stream `{name}`: {why}"),
            source: lapin::Error::from(std::io::Error::other(why.clone())),
        })?;
    Ok(())
}

/// Appends a marker to the stream `name` (through its fanout exchange), with publisher
/// confirms selected on `ch`, and waits for the confirm; returns the marker's id.
async fn append_marker(ch: &Channel, name: &str, timeout: Duration) -> Result<String, String> {
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| format!("selecting publisher confirms: {e}"))?;
    let id = uuid::Uuid::new_v4().to_string();
    let at_ms = now_ms();
    let mut h = FieldTable::default();
    h.insert(
        H_LOOKUP_MARKER.into(),
        AMQPValue::LongString(LongString::from(id.as_str())),
    );
    h.insert(
        H_MARKER_AT_MS.into(),
        AMQPValue::LongString(LongString::from(at_ms.to_string())),
    );
    let props = BasicProperties::default()
        .with_app_id(ShortString::from("sealpost"))
        .with_timestamp(at_ms / 1000)
        .with_headers(h);
    let confirm = ch
        .basic_publish(
            name.into(),
            "".into(),
            BasicPublishOptions {
                mandatory: true,
                immediate: false,
            },
            b"",
            props,
        )
        .await
        .map_err(|e| format!("publishing the marker: {e}"))?;
    match tokio::time::timeout(timeout, confirm).await {
        Ok(Ok(lapin::Confirmation::Ack(None))) => Ok(id),
        Ok(Ok(_)) => {
            Err("the marker was returned or nacked (is the stream bound to its exchange?)".into())
        }
        Ok(Err(e)) => Err(format!("the marker's confirm failed: {e}")),
        Err(_) => Err(format!("no confirm for the marker within {timeout:?}")),
    }
}

/// Where a scan reads: the topic's stream, as the adapter's cluster.
pub(crate) struct ScanPlace<'a> {
    pub cluster: &'a str,
    pub topic: &'a str,
    pub ack_timeout: Duration,
}

/// One scan of `place`'s lookup stream answers every event of `events` (grouped by the core,
/// `reconcile::shares_scan`): the answers are the core's `decide_scanned`.
pub(crate) async fn scan(
    ch: &Channel,
    place: ScanPlace<'_>,
    cfg: &LookupStream,
    events: &[(EventId, u16)],
) -> Vec<Lookup> {
    let all = |l: Lookup| vec![l; events.len()];
    let name = lookup_stream_name(place.topic);
    let scan_started = now_ms();
    let marker = match append_marker(ch, &name, place.ack_timeout).await {
        Ok(m) => m,
        Err(why) if why.contains("NOT_FOUND") || why.contains("404") => {
            tracing::warn!(stream = %name, "RabbitMQ lookup: no lookup stream for this exchange, so it cannot be asked (declare it: Rabbit::ensure_destination with [rabbitmq.lookup] enabled); the event is retried to the same exchange");
            return all(Lookup::Unqueryable);
        }
        Err(why) => {
            tracing::warn!(stream = %name, error = %why, "RabbitMQ lookup: cannot append the scan's marker; nothing learned");
            return all(Lookup::Unavailable);
        }
    };
    // The first retained message: what the stream can still prove.
    let first = match first_retained(ch, &name).await {
        Ok(f) => f,
        Err(why) => {
            tracing::warn!(stream = %name, error = %why, "RabbitMQ lookup: cannot read the stream's first message; nothing learned");
            return all(Lookup::Unavailable);
        }
    };
    let minted: Option<Vec<u64>> = events.iter().map(|(e, _)| e.minted_unix_ms()).collect();
    let from_ms = minted
        .and_then(|m| m.into_iter().min())
        .map(|t| t.saturating_sub(cfg.clock_margin_ms));
    let mut reach = ScanReach {
        finished: false,
        start_deleted: false,
    };
    let (low, low_at) = first;
    let offset = match from_ms {
        Some(from) => AMQPValue::Timestamp(from / 1000),
        None => AMQPValue::LongString("first".into()),
    };
    let wanted: HashMap<(String, String), (EventId, u16)> = events
        .iter()
        .map(|&(e, m)| ((e.to_string(), m.to_string()), (e, m)))
        .collect();
    let mut found: HashMap<(EventId, u16), Vec<FoundCopy>> = HashMap::new();
    // Our id without our headers: not proof of our send.
    let mut unusable: HashSet<(EventId, u16)> = HashSet::new();
    let tag = format!("sealpost-lookup-{}", uuid::Uuid::new_v4());
    let consumer = async {
        ch.basic_qos(SCAN_PREFETCH, BasicQosOptions::default())
            .await?;
        let mut args = FieldTable::default();
        args.insert("x-stream-offset".into(), offset);
        ch.basic_consume(
            name.as_str().into(),
            tag.as_str().into(),
            BasicConsumeOptions::default(),
            args,
        )
        .await
    }
    .await;
    let mut consumer = match consumer {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(stream = %name, error = %e, "RabbitMQ lookup: cannot read the stream (the reconciler's user needs read permission on it); nothing learned");
            return all(Lookup::Unavailable);
        }
    };
    let began = Instant::now();
    let mut read: u64 = 0;
    loop {
        if read >= cfg.scan_max {
            tracing::warn!(stream = %name, read, events = events.len(), "RabbitMQ lookup: scan bound reached; nothing learned about the events not seen (raise [rabbitmq.lookup] scan_max, or resolve by hand)");
            break;
        }
        let left = SCAN_TIME_MAX.saturating_sub(began.elapsed());
        if left.is_zero() {
            tracing::warn!(stream = %name, read, "RabbitMQ lookup: scan took over 60 s; nothing learned about the events not seen");
            break;
        }
        let d = match tokio::time::timeout(left.min(SCAN_IDLE_MAX), consumer.next()).await {
            Ok(Some(Ok(d))) => d,
            Ok(Some(Err(e))) => {
                tracing::warn!(stream = %name, error = %e, "RabbitMQ lookup: the stream read failed");
                break;
            }
            Ok(None) | Err(_) => {
                tracing::warn!(stream = %name, read, "RabbitMQ lookup: the stream stopped before the scan's marker; nothing learned about the events not seen");
                break;
            }
        };
        read += 1;
        if read.is_multiple_of(u64::from(SCAN_PREFETCH / 2)) {
            let _ = d.acker.ack(BasicAckOptions { multiple: true }).await;
        }
        let props = &d.properties;
        if read == 1 {
            // The scan starts at the stream's first retained message, appended after the
            // scan's start: the stream began (or retention cut it) too late to prove that
            // what was published before it is absent. A scan that starts later found older
            // messages before its start, so nothing it needs was cut.
            let at_first = low.is_some() && int_header(props, H_STREAM_OFFSET) == low;
            reach.start_deleted = match from_ms {
                None => true,
                Some(from) => at_first && low_at.is_none_or(|at| at > from),
            };
        }
        if header_str(props, H_LOOKUP_MARKER).as_deref() == Some(marker.as_str()) {
            reach.finished = true;
            break;
        }
        let hs = string_headers(&d);
        let get = |n: &str| hs.get(n).map(String::as_str);
        let (Some(id), Some(member)) = (get(H_EVENT_ID), get(H_MEMBER)) else {
            continue;
        };
        let Some(&(event_id, member)) = wanted.get(&(id.to_string(), member.to_string())) else {
            continue;
        };
        let parsed = (|| {
            Some(Receipt {
                event_id,
                member,
                envelope_generation: get(H_ENVELOPE_GENERATION)?.parse().ok()?,
                attempt_id: get(H_ATTEMPT_ID)?.parse().ok()?,
                // The digest of the bytes stored, not the header's claim.
                payload_digest: payload_digest(&d.data),
                destination_digest: Digest::from_hex(get(H_DESTINATION_DIGEST)?)?,
                cluster: place.cluster.to_string(),
                stream: place.topic.to_string(),
                partition: None,
                // The position every RabbitMQ receipt names: the attempt id (crate docs).
                sequence: get(H_ATTEMPT_ID)?.parse().ok().filter(|s| *s != 0)?,
                broker_duplicate: false,
                source: ReceiptSource::Lookup,
            })
        })();
        match parsed {
            Some(r) => {
                let copies = found.entry((event_id, member)).or_default();
                if copies.len() < COPIES_MAX {
                    copies.push(FoundCopy::read(
                        r,
                        WireEnvelope::from_headers(get),
                        get(H_SIGNATURE).map(str::to_string),
                    ));
                }
            }
            None => {
                unusable.insert((event_id, member));
            }
        }
    }
    let _ = ch
        .basic_cancel(tag.as_str().into(), BasicCancelOptions::default())
        .await;
    tracing::debug!(stream = %name, read, finished = reach.finished, took_ms = now_ms().saturating_sub(scan_started), "RabbitMQ lookup scan");
    let mut out = decide_scanned(
        events,
        |e, m| found.get(&(e, m)).cloned().unwrap_or_default(),
        reach,
    );
    for (i, key) in events.iter().enumerate() {
        if unusable.contains(key) && !found.contains_key(key) {
            out[i] = Lookup::Unavailable;
        }
    }
    out
}

/// The stream's first retained message: its offset and the latest it can have been
/// appended (`None` when it says nothing of its time). The stream holds at least the scan's
/// own marker.
async fn first_retained(ch: &Channel, name: &str) -> Result<(Option<u64>, Option<u64>), String> {
    let tag = format!("sealpost-lookup-first-{}", uuid::Uuid::new_v4());
    let mut args = FieldTable::default();
    args.insert(
        "x-stream-offset".into(),
        AMQPValue::LongString("first".into()),
    );
    ch.basic_qos(1, BasicQosOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    let mut consumer = ch
        .basic_consume(
            name.into(),
            tag.as_str().into(),
            BasicConsumeOptions::default(),
            args,
        )
        .await
        .map_err(|e| e.to_string())?;
    let first = match tokio::time::timeout(SCAN_IDLE_MAX, consumer.next()).await {
        Ok(Some(Ok(d))) => Ok((
            int_header(&d.properties, H_STREAM_OFFSET),
            appended_by_ms(&d.properties),
        )),
        Ok(Some(Err(e))) => Err(e.to_string()),
        Ok(None) | Err(_) => Err("no message came from the stream's start".to_string()),
    };
    let _ = ch
        .basic_cancel(tag.as_str().into(), BasicCancelOptions::default())
        .await;
    first
}
