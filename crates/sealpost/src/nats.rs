//! NATS JetStream adapter: the only module that knows JetStream's wire format.
//!
//! Each destination topic is a stream named after it, with subjects `sp.<topic>.>`. A message
//! is published on `sp.<topic>.<event-id>.<member>` — a subject per event — with
//! `Nats-Msg-Id` = event id (the broker's duplicate window answers a re-publish with the
//! original sequence and `duplicate: true`) and headers carrying the event id, envelope
//! generation, attempt id and digests. The reconciler asks "did you store event X at D?" with
//! a last-by-subject lookup on that subject, which works for as long as the stream retains
//! the message, not only inside the duplicate window. The cost is one subject per event in
//! the stream's subject index (tens of bytes of server memory per retained event).

use std::time::Duration;

use async_nats::jetstream::{self, context::PublishErrorKind, stream::LastRawMessageErrorKind};
use async_nats::HeaderMap;
use sealpost_core::encoding::Digest;
use sealpost_core::envelope::EventId;
use sealpost_core::receipt::{Receipt, ReceiptSource};
use sealpost_core::reconcile::Lookup;

use crate::store::Outgoing;

/// Header names.
pub const H_EVENT_ID: &str = "Sealpost-Event-Id";
/// Header: delivery-set member.
pub const H_MEMBER: &str = "Sealpost-Member";
/// Header: envelope generation.
pub const H_ENVELOPE_GENERATION: &str = "Sealpost-Envelope-Generation";
/// Header: attempt id.
pub const H_ATTEMPT_ID: &str = "Sealpost-Attempt-Id";
/// Header: payload digest.
pub const H_PAYLOAD_DIGEST: &str = "Sealpost-Payload-Digest";
/// Header: destination digest.
pub const H_DESTINATION_DIGEST: &str = "Sealpost-Destination-Digest";

/// Adapter errors.
#[derive(Debug, thiserror::Error)]
pub enum NatsError {
    /// Could not connect.
    #[error(
        "cannot connect to NATS at {url}: {source}; is nats-server running with JetStream (-js)?"
    )]
    Connect {
        /// URL tried.
        url: String,
        /// Cause.
        source: async_nats::ConnectError,
    },
    /// Stream management failed.
    #[error("JetStream stream `{stream}`: {detail}")]
    Stream {
        /// Stream name.
        stream: String,
        /// What failed.
        detail: String,
    },
}

/// The subject of one event member on a topic.
pub fn subject(topic: &str, event_id: EventId, member: u16) -> String {
    format!("sp.{topic}.{event_id}.{member}")
}

/// A connection to one JetStream cluster, named by the cluster identity frozen into
/// destinations.
#[derive(Clone)]
pub struct Nats {
    /// Cluster identity (must equal `Destination::cluster` of what it sends).
    pub cluster: String,
    /// Core client.
    pub client: async_nats::Client,
    /// JetStream context.
    pub js: jetstream::Context,
}

/// The result of one publish.
#[derive(Debug)]
pub enum PublishResult {
    /// The broker's receipt.
    Ack(Receipt),
    /// Definitely not sent (refused before the request left, e.g. no connection).
    NeverSent(String),
    /// No answer in time: it may have been stored.
    Timeout,
}

impl Nats {
    /// Connects; `ack_timeout` bounds each publish acknowledgement.
    pub async fn connect(
        url: &str,
        cluster: &str,
        ack_timeout: Duration,
    ) -> Result<Nats, NatsError> {
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(5))
            // Fail fast at startup with a clear error; once connected, the client reconnects
            // by itself and sends in the meantime end as unknown outcomes for the reconciler.
            .connect(url)
            .await
            .map_err(|source| NatsError::Connect {
                url: url.to_string(),
                source,
            })?;
        let js = jetstream::ContextBuilder::new()
            .timeout(ack_timeout)
            .max_ack_inflight(8_192)
            // Wait for a permit instead of failing when many batches are in flight.
            .backpressure_on_inflight(true)
            .build(client.clone());
        Ok(Nats {
            cluster: cluster.to_string(),
            client,
            js,
        })
    }

    /// Creates the stream for `topic` if it does not exist (file storage, 2-minute duplicate
    /// window).
    pub async fn ensure_stream(&self, topic: &str) -> Result<(), NatsError> {
        self.js
            .get_or_create_stream(jetstream::stream::Config {
                name: topic.to_string(),
                subjects: vec![format!("sp.{topic}.>")],
                storage: jetstream::stream::StorageType::File,
                duplicate_window: Duration::from_secs(120),
                ..Default::default()
            })
            .await
            .map_err(|e| NatsError::Stream {
                stream: topic.to_string(),
                detail: e.to_string(),
            })?;
        Ok(())
    }

    /// Publishes a batch concurrently and waits for every acknowledgement. Every attempt was
    /// registered in the database before this is called.
    pub async fn publish_batch(&self, batch: &[Outgoing]) -> Vec<PublishResult> {
        let mut futures = Vec::with_capacity(batch.len());
        for o in batch {
            if o.destination.cluster != self.cluster {
                futures.push(Err(format!(
                    "destination cluster `{}` is not this connection's `{}`",
                    o.destination.cluster, self.cluster
                )));
                continue;
            }
            let mut headers = HeaderMap::new();
            headers.insert(H_EVENT_ID, o.event_id.to_string().as_str());
            headers.insert(H_MEMBER, o.member.to_string().as_str());
            headers.insert(
                H_ENVELOPE_GENERATION,
                o.envelope_generation.to_string().as_str(),
            );
            headers.insert(H_ATTEMPT_ID, o.attempt_id.to_string().as_str());
            headers.insert(
                H_PAYLOAD_DIGEST,
                o.payload_digest.to_prefixed_hex().as_str(),
            );
            headers.insert(
                H_DESTINATION_DIGEST,
                o.destination_digest.to_prefixed_hex().as_str(),
            );
            let msg_id = if o.member == 0 {
                o.event_id.to_string()
            } else {
                format!("{}.{}", o.event_id, o.member)
            };
            let publish = jetstream::message::PublishMessage::build()
                .payload(o.payload.clone().into())
                .headers(headers)
                .message_id(msg_id);
            match self
                .js
                .send_publish(subject(&o.destination.topic, o.event_id, o.member), publish)
                .await
            {
                Ok(f) => futures.push(Ok(f)),
                Err(e) => futures.push(Err(e.to_string())),
            }
        }
        let mut out = Vec::with_capacity(batch.len());
        let mut pending = Vec::new();
        for (i, f) in futures.into_iter().enumerate() {
            match f {
                Ok(f) => pending.push((i, f)),
                Err(e) => out.push((i, PublishResult::NeverSent(e))),
            }
        }
        let results = futures::future::join_all(
            pending
                .into_iter()
                .map(|(i, f)| async move { (i, f.await) }),
        )
        .await;
        for (i, r) in results {
            let o = &batch[i];
            let res = match r {
                Ok(ack) => PublishResult::Ack(Receipt {
                    event_id: o.event_id,
                    member: o.member,
                    envelope_generation: o.envelope_generation,
                    attempt_id: o.attempt_id,
                    payload_digest: o.payload_digest,
                    destination_digest: o.destination_digest,
                    cluster: self.cluster.clone(),
                    stream: ack.stream,
                    partition: None,
                    sequence: ack.sequence,
                    broker_duplicate: ack.duplicate,
                    source: ReceiptSource::Ack,
                }),
                // A broker "no" (e.g. no stream for the subject) is definite: nothing stored.
                Err(e) if e.kind() == PublishErrorKind::StreamNotFound => {
                    PublishResult::NeverSent(e.to_string())
                }
                Err(e) => {
                    tracing::debug!(event_id = %o.event_id, error = %e, "no publish ack: outcome unknown");
                    PublishResult::Timeout
                }
            };
            out.push((i, res));
        }
        out.sort_by_key(|(i, _)| *i);
        out.into_iter().map(|(_, r)| r).collect()
    }

    /// "Did you store event X at topic T?" (R13): the last message on the event's subject.
    pub async fn lookup(&self, topic: &str, event_id: EventId, member: u16) -> Lookup {
        let stream = match self.js.get_stream(topic).await {
            Ok(s) => s,
            Err(_) => return Lookup::Unavailable,
        };
        match stream
            .get_last_raw_message_by_subject(&subject(topic, event_id, member))
            .await
        {
            Ok(m) => {
                let h = |name: &str| m.headers.get(name).map(|v| v.as_str().to_string());
                let parsed = (|| {
                    Some(Receipt {
                        event_id: EventId::parse(&h(H_EVENT_ID)?)?,
                        member: h(H_MEMBER)?.parse().ok()?,
                        envelope_generation: h(H_ENVELOPE_GENERATION)?.parse().ok()?,
                        attempt_id: h(H_ATTEMPT_ID)?.parse().ok()?,
                        payload_digest: Digest::from_hex(&h(H_PAYLOAD_DIGEST)?)?,
                        destination_digest: Digest::from_hex(&h(H_DESTINATION_DIGEST)?)?,
                        cluster: self.cluster.clone(),
                        stream: topic.to_string(),
                        partition: None,
                        sequence: m.sequence,
                        broker_duplicate: false,
                        source: ReceiptSource::Lookup,
                    })
                })();
                match parsed {
                    Some(r) => Lookup::Found(r),
                    // A message on our subject without our headers: someone else published
                    // there. Not proof of our send; leave it unknown for an operator.
                    None => Lookup::Unavailable,
                }
            }
            Err(e) if matches!(e.kind(), LastRawMessageErrorKind::NoMessageFound) => Lookup::Absent,
            Err(_) => Lookup::Unavailable,
        }
    }
}
