//! The consumer side of the RabbitMQ adapter: [`RabbitSubscription`] implements the
//! subscription port ([`sealpost_core::subscription::Subscription`]) over the consumer's own
//! durable quorum queue (`<topic>.<consumer>`, bound to the topic exchange with `#`, declared
//! if missing; a least-privilege user who may not declare finds them declared by an
//! administrator, docs/security.md), manual acks and a prefetch of 1,000. Its delivery count is the quorum
//! queue's `x-delivery-count` plus this delivery.
//!
//! **Settlement.** `Ack` is `basic.ack`; `Terminate` is `basic.reject` without requeue (the
//! queue has no dead-letter exchange: the consumer's dead letter, committed first, is the
//! record); RabbitMQ has no delayed nack, so `RetryAfter` holds the message unacked (no
//! other consumer of the queue gets it) for the delay, then `basic.nack` with requeue.
//!
//! **Watermark at drained moments.** A queue has no ack floor, and a message's position is
//! the attempt id of the publish that stored it. Attempt ids are allocated in increasing
//! order when a claim registers them and a message leaves only within its claim's lease, so
//! every message whose attempt id is at most the highest one this consumer had seen at time
//! T reached the queue (if ever) within `settle_ms` after T. At a *drained* moment at least
//! `settle_ms` later — no message ready in the queue, no other consumer on it, nothing held
//! unsettled by this one — all of them were settled: that highest attempt id is the
//! watermark (the core's `decide_drained_watermark`). Several instances of one consumer on
//! one queue never see a drained moment (the other instance may hold messages); the
//! watermark then waits until one runs alone.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{FutureExt, StreamExt};
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions, BasicRejectOptions,
    ExchangeDeclareOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use sealpost_core::subscription::{
    decide_drained_watermark, DrainCandidate, FetchLimits, Received, SealpostHeaders, Settlement,
    Subscription,
};

use crate::{
    declare_exchange, declare_queue, delivered_count, delivery_of, open_connection, queue_name,
    topology_error, RabbitError, RabbitOptions,
};

/// Why a subscription needs reopening.
#[derive(Debug, thiserror::Error)]
pub enum ConsumeError {
    /// Connecting, declaring or consuming failed.
    #[error(transparent)]
    Rabbit(#[from] RabbitError),
    /// The consumer's channel or connection closed under it.
    #[error("RabbitMQ consuming queue `{queue}`: the consumer ended (its channel or connection closed); it reconnects")]
    Ended {
        /// The queue.
        queue: String,
    },
}

/// Messages the broker may have delivered and not yet seen settled, per consumer.
const PREFETCH: u16 = 1_000;
/// How long a fetch waits for more messages once the first arrived.
const LINGER: Duration = Duration::from_millis(50);

/// One consumer's queue on one exchange.
pub struct RabbitSubscription {
    url: String,
    /// TLS and credentials, kept for reconnects.
    options: RabbitOptions,
    topic: String,
    consumer_id: String,
    settle_ms: u64,
    link: Link,
    /// Deliveries taken while looking for a drained moment, handed out first.
    stash: VecDeque<Delivery>,
    /// Messages held for a delayed requeue.
    held: Arc<AtomicUsize>,
    /// The highest attempt id delivered so far.
    seen_max: u64,
    candidate: Option<DrainCandidate>,
    reported: u64,
    epoch: Instant,
}

struct Link {
    _conn: Connection,
    channel: Channel,
    consumer: lapin::Consumer,
}

async fn open(
    url: &str,
    options: &RabbitOptions,
    topic: &str,
    consumer_id: &str,
) -> Result<Link, RabbitError> {
    let name = format!("sealpost-consume-{consumer_id}-{}", std::process::id());
    // TLS, client certificate and password file as the options say; the error names the
    // option to check and never a secret.
    let conn = open_connection(
        url,
        options,
        ConnectionProperties::default().with_connection_name(LongString::from(name)),
    )
    .await?;
    let topo = |what: String| move |source| RabbitError::Topology { what, source };
    let channel = conn
        .create_channel()
        .await
        .map_err(topo("opening the consuming channel".into()))?;
    let channel = match declare(&channel, topic, consumer_id).await {
        Ok(()) => channel,
        // A least-privilege consumer (docs/security.md) may not declare: an administrator
        // declared the exchange, the queue and its binding. The refusal closed the channel;
        // on a new one, check that they exist (a passive declare needs no permission).
        Err(e) if e.is_not_permitted() => {
            let channel = conn
                .create_channel()
                .await
                .map_err(topo("opening the consuming channel".into()))?;
            expect_declared(&channel, topic, consumer_id, &e).await?;
            channel
        }
        Err(e) => return Err(e),
    };
    channel
        .basic_qos(PREFETCH, BasicQosOptions::default())
        .await
        .map_err(topo("setting the prefetch".into()))?;
    let q = queue_name(topic, consumer_id);
    let consumer = channel
        .basic_consume(
            q.as_str().into(),
            consumer_id.into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|source| {
            topology_error(
                format!("consuming queue `{q}`"),
                &format!("read permission on `{q}`"),
                source,
            )
        })?;
    Ok(Link {
        _conn: conn,
        channel,
        consumer,
    })
}

/// Declares the exchange `topic` and the consumer's queue, bound with `#` (idempotent).
async fn declare(channel: &Channel, topic: &str, consumer_id: &str) -> Result<(), RabbitError> {
    declare_exchange(channel, topic).await?;
    declare_queue(channel, topic, consumer_id).await
}

/// The queue `name` as the broker holds it (a passive declare: creates nothing, fails if it
/// does not exist).
async fn passive_queue(channel: &Channel, name: &str) -> Result<lapin::Queue, lapin::Error> {
    channel
        .queue_declare(
            name.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
}

/// Checks, by passive declares, that the exchange `topic` and the consumer's queue exist;
/// if one does not, the error is `refused` (this user may not declare it) and says that an
/// administrator declares them.
async fn expect_declared(
    channel: &Channel,
    topic: &str,
    consumer_id: &str,
    refused: &RabbitError,
) -> Result<(), RabbitError> {
    let q = queue_name(topic, consumer_id);
    let passive = async {
        channel
            .exchange_declare(
                topic.into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await?;
        passive_queue(channel, &q).await.map(|_| ())
    };
    passive.await.map_err(|e| RabbitError::NotPermitted {
        what: format!("opening consumer `{consumer_id}` on exchange `{topic}`"),
        detail: format!("{refused}; and they are not there: {e}"),
        hint: format!(
            "an administrator declares exchange `{topic}` and queue `{q}` bound to it with `#` (`sealpost demo` or your topology tooling, docs/security.md)"
        ),
    })
}

impl RabbitSubscription {
    /// Opens a connection, declares the exchange `topic` and the consumer's quorum queue,
    /// and starts consuming. `settle_ms` bounds how long after its attempt id is allocated a
    /// message may still reach the queue (the dispatchers' lease plus the confirm timeout).
    pub async fn subscribe(
        url: &str,
        options: &RabbitOptions,
        topic: &str,
        consumer_id: &str,
        settle_ms: u64,
    ) -> Result<RabbitSubscription, RabbitError> {
        Ok(RabbitSubscription {
            url: url.to_string(),
            options: options.clone(),
            topic: topic.to_string(),
            consumer_id: consumer_id.to_string(),
            settle_ms,
            link: open(url, options, topic, consumer_id).await?,
            stash: VecDeque::new(),
            held: Arc::new(AtomicUsize::new(0)),
            seen_max: 0,
            candidate: None,
            reported: 0,
            epoch: Instant::now(),
        })
    }

    fn closed(&self, source: lapin::Error) -> ConsumeError {
        ConsumeError::Rabbit(RabbitError::Topology {
            what: format!(
                "consuming queue `{}`",
                queue_name(&self.topic, &self.consumer_id)
            ),
            source,
        })
    }

    /// Nothing ready in the queue, no other consumer on it, nothing held by this one. The
    /// queue is asked on the consuming channel, so a delivery sent before the answer has
    /// arrived by then; one that did is stashed and the moment is not drained.
    async fn drained(&mut self) -> Result<bool, ConsumeError> {
        if self.held.load(Ordering::SeqCst) > 0 || !self.stash.is_empty() {
            return Ok(false);
        }
        let q = queue_name(&self.topic, &self.consumer_id);
        let queue = passive_queue(&self.link.channel, &q)
            .await
            .map_err(|e| self.closed(e))?;
        let mut drained = queue.message_count() == 0 && queue.consumer_count() <= 1;
        while let Some(Some(Ok(d))) = self.link.consumer.next().now_or_never() {
            self.stash.push_back(d);
            drained = false;
        }
        Ok(drained)
    }
}

/// The message's AMQP headers that are strings, by name.
pub(crate) fn string_headers(d: &Delivery) -> HashMap<String, String> {
    let Some(h) = d.properties.headers().as_ref() else {
        return HashMap::new();
    };
    h.inner()
        .iter()
        .filter_map(|(k, v)| {
            let v = match v {
                AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
                AMQPValue::ShortString(s) => s.as_str().to_string(),
                _ => return None,
            };
            Some((k.as_str().to_string(), v))
        })
        .collect()
}

impl Subscription for RabbitSubscription {
    type Message = Delivery;
    type Error = ConsumeError;

    /// Waits up to `wait_ms` for the first delivery, then takes what arrives within 50 ms,
    /// up to the limits. A closed consumer is an error (the caller reconnects).
    async fn fetch(&mut self, limits: FetchLimits) -> Result<Vec<Delivery>, ConsumeError> {
        let mut out = Vec::new();
        let mut bytes = 0usize;
        while let Some(d) = self.stash.front() {
            if !limits.admits(out.len(), bytes, d.data.len()) {
                return Ok(out);
            }
            bytes += d.data.len();
            out.extend(self.stash.pop_front());
        }
        let mut until = Instant::now()
            + if out.is_empty() {
                Duration::from_millis(limits.wait_ms.max(1))
            } else {
                LINGER
            };
        loop {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() || out.len() >= limits.messages_max.max(1) {
                break;
            }
            match tokio::time::timeout(left, self.link.consumer.next()).await {
                Err(_) => break,
                Ok(Some(Ok(d))) => {
                    if !limits.admits(out.len(), bytes, d.data.len()) {
                        self.stash.push_back(d);
                        break;
                    }
                    if out.is_empty() {
                        until = Instant::now() + LINGER;
                    }
                    bytes += d.data.len();
                    out.push(d);
                }
                Ok(Some(Err(e))) => {
                    if out.is_empty() {
                        return Err(self.closed(e));
                    }
                    break;
                }
                Ok(None) => {
                    if out.is_empty() {
                        return Err(ConsumeError::Ended {
                            queue: queue_name(&self.topic, &self.consumer_id),
                        });
                    }
                    break;
                }
            }
        }
        Ok(out)
    }

    fn read<'m>(&self, m: &'m Delivery) -> Received<'m> {
        let headers = match delivery_of(m.exchange.as_str(), &m.properties) {
            Some(d) => {
                let all = string_headers(m);
                Ok(SealpostHeaders {
                    event_id: d.event_id,
                    member: d.member,
                    claimed_digest: d.claimed_digest,
                    envelope: None,
                    envelope_generation: None,
                    destination_digest: None,
                    signature: None,
                }
                .with_seal(|n| all.get(n).map(String::as_str)))
            }
            None => Err(crate::unreadable_reason(&m.properties)),
        };
        Received {
            headers,
            stream: m.exchange.to_string(),
            sequence: delivery_of(m.exchange.as_str(), &m.properties).map_or(0, |d| d.sequence),
            subject: m.routing_key.to_string(),
            delivered: delivered_count(&m.properties, m.redelivered),
            payload: &m.data,
        }
    }

    async fn settle(&mut self, batch: Vec<(Delivery, Settlement)>) -> Result<(), ConsumeError> {
        for (m, s) in batch {
            if let Some(d) = delivery_of(m.exchange.as_str(), &m.properties) {
                self.seen_max = self.seen_max.max(d.sequence);
            }
            match s {
                Settlement::Ack => {
                    if let Err(e) = m.ack(BasicAckOptions::default()).await {
                        tracing::warn!(error = %e, "ack lost; the broker redelivers and the inbox absorbs it");
                    }
                }
                Settlement::Terminate => {
                    if let Err(e) = m.reject(BasicRejectOptions { requeue: false }).await {
                        tracing::warn!(error = %e, "reject lost; the redelivery finds the dead letter already recorded");
                    }
                }
                Settlement::RetryAfter { delay_ms } => {
                    let held = self.held.clone();
                    held.fetch_add(1, Ordering::SeqCst);
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
                        held.fetch_sub(1, Ordering::SeqCst);
                    });
                }
            }
        }
        Ok(())
    }

    /// The highest attempt id known settled at a drained moment, for the exchange.
    async fn watermarks(&mut self) -> Result<Vec<(String, u64)>, ConsumeError> {
        let now_ms = self.epoch.elapsed().as_millis() as u64;
        if let Some(c) = self.candidate {
            let drained = self.drained().await?;
            if let Some(w) = decide_drained_watermark(c, now_ms, self.settle_ms, drained) {
                self.reported = self.reported.max(w);
                self.candidate = None;
            }
        }
        if self.candidate.is_none() && self.seen_max > self.reported {
            self.candidate = Some(DrainCandidate {
                position: self.seen_max,
                seen_at_ms: now_ms,
            });
        }
        Ok(if self.reported > 0 {
            vec![(self.topic.clone(), self.reported)]
        } else {
            Vec::new()
        })
    }

    /// Messages ready in the queue (those delivered and unsettled are not counted).
    async fn lag(&mut self) -> Option<u64> {
        let q = queue_name(&self.topic, &self.consumer_id);
        passive_queue(&self.link.channel, &q)
            .await
            .ok()
            .map(|q| u64::from(q.message_count()))
    }

    /// A new connection; what this one held unsettled comes back to the queue.
    async fn reconnect(&mut self) -> Result<(), ConsumeError> {
        self.link = open(&self.url, &self.options, &self.topic, &self.consumer_id).await?;
        self.stash.clear();
        Ok(())
    }
}
