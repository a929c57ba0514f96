//! The consumer side of the NATS adapter: [`NatsSubscription`] implements the subscription
//! port ([`sealpost_core::subscription::Subscription`]) over a durable JetStream pull
//! consumer. Fetches are bounded in messages and bytes; a message is settled with `ack`,
//! `nak` with the core's delay, or `term`; the watermark is the durable consumer's ack
//! floor (every stream sequence up to it acked or terminated, and nothing is acked or
//! terminated before its inbox row or dead letter commits). The JetStream consumer has no
//! `max_deliver` of its own: the broker would silently stop delivering a message the
//! consumer has not recorded; the redelivery limit is the core's.

use std::time::Duration;

use async_nats::jetstream::consumer::{pull, AckPolicy, Consumer};
use async_nats::jetstream::{AckKind, Message};
use futures::StreamExt;
use sealpost_core::encoding::Digest;
use sealpost_core::envelope::EventId;
use sealpost_core::subscription::{
    FetchLimits, Received, SealpostHeaders, Settlement, Subscription,
};

use crate::{delivery_of, Nats, NatsError, H_EVENT_ID, H_MEMBER, H_PAYLOAD_DIGEST};

/// Messages delivered and not yet acked per durable consumer at most.
const ACK_PENDING_MAX: i64 = 20_000;

/// A durable JetStream pull consumer named after the consumer id, filtered to the topic's
/// subjects (`sp.<topic>.>`), with explicit acks.
pub struct NatsSubscription {
    nats: Nats,
    topic: String,
    consumer_id: String,
    ack_wait: Duration,
    consumer: Consumer<pull::Config>,
    /// The next batch, requested as soon as the last one was taken, so JetStream delivers
    /// it while the consumer applies the last one (its messages wait in the client).
    next: Option<pull::Batch>,
}

impl NatsSubscription {
    /// Opens (or creates) the durable consumer `consumer_id` on the stream `topic`.
    /// `ack_wait` is how long JetStream waits for a settlement before it redelivers.
    pub async fn subscribe(
        nats: &Nats,
        topic: &str,
        consumer_id: &str,
        ack_wait: Duration,
    ) -> Result<NatsSubscription, NatsError> {
        let consumer = open(nats, topic, consumer_id, ack_wait).await?;
        Ok(NatsSubscription {
            nats: nats.clone(),
            topic: topic.to_string(),
            consumer_id: consumer_id.to_string(),
            ack_wait,
            consumer,
            next: None,
        })
    }

    fn error(&self, e: impl std::fmt::Display) -> NatsError {
        NatsError::Stream {
            stream: self.topic.clone(),
            detail: format!("consumer `{}`: {e}", self.consumer_id),
        }
    }

    /// Sends one pull request bounded by `limits` (in bytes too when `bytes`); its messages
    /// arrive in the returned batch.
    async fn request(&self, limits: FetchLimits, bytes: bool) -> Result<pull::Batch, NatsError> {
        let mut req = self
            .consumer
            .fetch()
            .max_messages(limits.messages_max.max(1))
            .expires(Duration::from_millis(limits.wait_ms.max(1)));
        if bytes {
            req = req.max_bytes(limits.bytes_max.max(1));
        }
        req.messages().await.map_err(|e| self.error(e))
    }

    /// Takes one batch: the one requested ahead if there is one, else a new request.
    async fn fetch_once(
        &mut self,
        limits: FetchLimits,
        bytes: bool,
    ) -> Result<(Vec<Message>, Option<String>), NatsError> {
        let mut batch = match self.next.take() {
            Some(b) => b,
            None => self.request(limits, bytes).await?,
        };
        let mut out = Vec::new();
        let mut failed = None;
        while let Some(m) = batch.next().await {
            match m {
                Ok(m) => out.push(m),
                Err(e) => {
                    failed = Some(e.to_string());
                    break;
                }
            }
        }
        Ok((out, failed))
    }
}

async fn open(
    nats: &Nats,
    topic: &str,
    consumer_id: &str,
    ack_wait: Duration,
) -> Result<Consumer<pull::Config>, NatsError> {
    let error = |e: &dyn std::fmt::Display| {
        // A call the user may not make only times out; the server named it meanwhile.
        for prefix in [
            format!("$JS.API.STREAM.INFO.{topic}"),
            format!("$JS.API.CONSUMER.INFO.{topic}.{consumer_id}"),
            format!("$JS.API.CONSUMER.CREATE.{topic}.{consumer_id}"),
        ] {
            if let Some((subject, detail)) = nats.take_denied_prefix(&prefix) {
                return NatsError::NotPermitted {
                    action: format!("open consumer `{consumer_id}` on stream `{topic}`"),
                    hint: format!(
                        "give this user a consumer's rights for stream `{topic}` and consumer `{consumer_id}` (docs/security.md, docs/nats-permissions.conf), or have an administrator create the consumer"
                    ),
                    subject,
                    detail,
                };
            }
        }
        NatsError::Stream {
            stream: topic.to_string(),
            detail: format!("consumer `{consumer_id}`: {e}"),
        }
    };
    let stream = nats.js.get_stream(topic).await.map_err(|e| error(&e))?;
    stream
        .get_or_create_consumer(
            consumer_id,
            pull::Config {
                durable_name: Some(consumer_id.to_string()),
                filter_subject: format!("sp.{topic}.>"),
                ack_policy: AckPolicy::Explicit,
                ack_wait,
                max_ack_pending: ACK_PENDING_MAX,
                ..Default::default()
            },
        )
        .await
        .map_err(|e| error(&e))
}

/// How many times JetStream has delivered `msg` (this delivery included).
fn delivered(msg: &Message) -> u64 {
    msg.info().map_or(1, |i| i.delivered.max(1) as u64)
}

/// What is wrong with a message's Sealpost headers, in words for the dead letter.
pub fn unreadable_reason(msg: &Message) -> String {
    let Some(h) = msg.headers.as_ref() else {
        return "no headers: not a Sealpost message".into();
    };
    let get = |n: &str| h.get(n).map(|v| v.as_str().to_string());
    let mut wrong = Vec::new();
    match get(H_EVENT_ID) {
        None => wrong.push(format!("{H_EVENT_ID} missing")),
        Some(v) if EventId::parse(&v).is_none() => {
            wrong.push(format!("{H_EVENT_ID} `{v}` is not a UUID"))
        }
        _ => {}
    }
    match get(H_MEMBER) {
        None => wrong.push(format!("{H_MEMBER} missing")),
        Some(v) if v.parse::<u16>().is_err() => {
            wrong.push(format!("{H_MEMBER} `{v}` is not a number"))
        }
        _ => {}
    }
    match get(H_PAYLOAD_DIGEST) {
        None => wrong.push(format!("{H_PAYLOAD_DIGEST} missing")),
        Some(v) if Digest::from_hex(&v).is_none() => {
            wrong.push(format!("{H_PAYLOAD_DIGEST} `{v}` is not a hex digest"))
        }
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

impl Subscription for NatsSubscription {
    type Message = Message;
    type Error = NatsError;

    /// One pull request bounded by `messages_max`, `bytes_max` and `wait_ms`. A message
    /// larger than `bytes_max` alone (the server refuses such a request) is fetched alone.
    ///
    /// While messages keep coming, the next request is sent as soon as a batch is taken:
    /// JetStream delivers it while the caller applies this one (the ack wait of those
    /// messages starts then; one batch's apply is far shorter). An idle consumer sends one
    /// request per fetch, as before.
    async fn fetch(&mut self, limits: FetchLimits) -> Result<Vec<Message>, NatsError> {
        let (out, failed) = self.fetch_once(limits, true).await?;
        if !out.is_empty() && failed.is_none() {
            // A failed request ahead is not an error yet: the next fetch asks again.
            self.next = self.request(limits, true).await.ok();
        }
        match failed {
            Some(e) if out.is_empty() && e.to_ascii_lowercase().contains("bytes") => {
                let one = FetchLimits {
                    messages_max: 1,
                    ..limits
                };
                let (out, failed) = self.fetch_once(one, false).await?;
                match failed {
                    Some(e) if out.is_empty() => Err(self.error(e)),
                    _ => Ok(out),
                }
            }
            Some(e) if out.is_empty() && !e.to_ascii_lowercase().contains("timed out") => {
                Err(self.error(e))
            }
            _ => Ok(out),
        }
    }

    fn read<'m>(&self, m: &'m Message) -> Received<'m> {
        let info = m.info().ok();
        let headers = match delivery_of(m) {
            Some(d) => Ok(SealpostHeaders {
                event_id: d.event_id,
                member: d.member,
                claimed_digest: d.claimed_digest,
                envelope: None,
                envelope_generation: None,
                destination_digest: None,
                signature: None,
            }
            .with_seal(|n| m.headers.as_ref()?.get(n).map(|v| v.as_str()))),
            None => Err(unreadable_reason(m)),
        };
        Received {
            headers,
            stream: info
                .as_ref()
                .map_or(self.topic.clone(), |i| i.stream.to_string()),
            sequence: info.as_ref().map_or(0, |i| i.stream_sequence),
            subject: m.subject.to_string(),
            delivered: delivered(m),
            payload: &m.payload,
        }
    }

    /// `ack`, `nak` with the delay, or `term`, one message after the other. A lost one is
    /// logged: JetStream redelivers after the ack wait and the inbox absorbs it.
    async fn settle(&mut self, batch: Vec<(Message, Settlement)>) -> Result<(), NatsError> {
        for (m, s) in batch {
            let kind = match s {
                Settlement::Ack => AckKind::Ack,
                Settlement::RetryAfter { delay_ms } => {
                    AckKind::Nak(Some(Duration::from_millis(delay_ms)))
                }
                Settlement::Terminate => AckKind::Term,
            };
            if let Err(e) = m.ack_with(kind).await {
                tracing::warn!(error = %e, subject = %m.subject, settlement = ?s,
                    "settlement lost; JetStream redelivers after the ack wait and the inbox absorbs it");
            }
        }
        Ok(())
    }

    /// The durable consumer's ack floor on its stream.
    async fn watermarks(&mut self) -> Result<Vec<(String, u64)>, NatsError> {
        let info = self.consumer.get_info().await.map_err(|e| self.error(e))?;
        Ok(vec![(
            info.stream_name.clone(),
            info.ack_floor.stream_sequence,
        )])
    }

    /// Not yet delivered, plus delivered and not acked.
    async fn lag(&mut self) -> Option<u64> {
        match self.consumer.get_info().await {
            Ok(i) => Some(i.num_pending + i.num_ack_pending as u64),
            Err(e) => {
                tracing::warn!(error = %e, "metrics: cannot read the consumer's lag");
                None
            }
        }
    }

    async fn reconnect(&mut self) -> Result<(), NatsError> {
        // What the request ahead delivered comes back after the ack wait.
        self.next = None;
        self.consumer = open(&self.nats, &self.topic, &self.consumer_id, self.ack_wait).await?;
        Ok(())
    }
}
