//! RabbitMQ adapter: the only crate that knows AMQP 0-9-1. It implements the broker port
//! [`sealpost_core::port::Broker`] over `lapin` and knows no SQL.
//!
//! **What maps to what.** A destination's cluster is the identity this connection was opened
//! with ([`Rabbit::cluster`]); its topic is a durable *topic exchange* of that name; its
//! routing key is the AMQP routing key. Consumers read durable **quorum queues** bound to the
//! exchange with `#`, one per consumer ([`queue_name`]: `<topic>.<consumer>`), declared by
//! [`Rabbit::ensure_destination`] (or by `sealpost consume` for its own queue). A
//! [`SendRequest`] is published with publisher confirms, `mandatory`, `delivery_mode` 2
//! (persistent), `message_id` = event id (`<event id>.<member>` for members above 0) and
//! AMQP headers carrying the event id, member, envelope generation, attempt id and digests
//! (the same names as the NATS adapter's).
//!
//! **Answers.** A confirm (`basic.ack`) is the [`Receipt`]. A message the broker returns
//! (`basic.return`, e.g. 312 NO_ROUTE: no queue is bound for its routing key) is a permanent
//! refusal ([`RefusalKind::Rejected`]), never a success: nothing was stored, and publishing
//! it again would be returned again until an operator binds a queue. A `basic.nack`, a
//! confirm that does not come within the ack timeout, or a channel that closes with confirms
//! outstanding is [`SendResult::NoAnswer`] (a nack means at least one queue did not take the
//! message; another may have). No message is handed to the client once the batch deadline
//! has passed ([`NeverSentReason::DeadlinePassed`]), nor while there is no open channel
//! ([`NeverSentReason::NotConnected`]), nor for another cluster
//! ([`NeverSentReason::WrongCluster`]). An exchange that does not exist is found by a passive
//! declare on a channel of its own before anything is published to it
//! ([`NeverSentReason::NoSuchDestination`]); publishing to it would close the shared channel.
//! A message AMQP cannot carry (a routing key over the 255 bytes of a short string, which
//! would write a corrupt frame; a control character in a header) is refused alone as
//! [`RefusalKind::Unencodable`] before it is published, and the rest of its batch is sent
//! ([`sealpost_core::port::encode_request`]).
//!
//! **The broker that cannot be asked, unless it keeps a stream.** RabbitMQ has no read by
//! message id: a queue is a buffer that forgets what its consumers took. By default the
//! adapter declares `lookup_by_event_id: false`, no duplicate window and no create-if-absent,
//! and [`Broker::lookup`] answers [`Lookup::Unqueryable`]. An unknown outcome is therefore
//! retried to the same frozen destination under the same event id (R14); the consumers'
//! inboxes absorb the second copy. With the **lookup stream** ([`LookupStream`],
//! `[rabbitmq.lookup] enabled`) every destination also feeds a RabbitMQ stream queue, which
//! keeps what it stored for its retention whatever its readers do: a lookup scans it (one
//! scan answers a group of unknown events, [`Broker::lookup_many`]) and finds an event or
//! proves it absent, and the verification pass (R31) runs on RabbitMQ too. Still no
//! create-if-absent: a retry after "absent" can race nothing (the lease fenced the first
//! send), but nothing at the broker refuses a second copy.
//!
//! **The position.** AMQP gives a published message no position (a confirm's delivery tag is
//! a per-channel counter that restarts with every channel). The receipt's `stream` is the
//! exchange, its `partition` is none, and its `sequence` is the **attempt id** the message
//! carries: unique per publish attempt, never 0, and the same for every confirm of one
//! publish. So at the acceptance point a second confirm of the same attempt is
//! `SamePosition`, and the confirm of a retry (a new attempt) after an unknown outcome is
//! `SecondCopy`, recorded as evidence of a second stored copy: exactly what happened. The
//! consumer reports the same position (the attempt-id header) for what it applies.
//!
//! **TLS and credentials.** `amqps://` over rustls (ring) against a CA file, a client
//! certificate, the password from a file: [`RabbitOptions`], [`Rabbit::connect_with`],
//! [`open_connection`].

mod subscription;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lapin::message::BasicReturnMessage;
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, ExchangeDeleteOptions,
    QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use sealpost_core::encoding::Digest;
use sealpost_core::envelope::{Destination, EventId};
use sealpost_core::port::{
    encode_request, may_leave, Broker, Capabilities, NeverSentReason, RefusalKind, SendRequest,
    SendResult,
};
use sealpost_core::receipt::{Receipt, ReceiptSource};
use sealpost_core::reconcile::{Lookup, LookupScan};
/// Header: the dispatcher's signature (`sealpost_core::signature`).
pub use sealpost_core::signature::H_SIGNATURE;
use tokio::sync::{Mutex, Semaphore};

pub use config::RabbitConfig;
pub use lapin;
pub use options::{open_connection, RabbitOptions};
pub use subscription::{ConsumeError, RabbitSubscription};

use options::Target;

mod config;
mod lookup;
mod options;

pub use lookup::{lookup_stream_name, LookupStream, H_LOOKUP_MARKER, H_MARKER_AT_MS};

/// Header: event id.
pub const H_EVENT_ID: &str = "Sealpost-Event-Id";
/// Header: delivery-set member.
pub const H_MEMBER: &str = "Sealpost-Member";
/// Header: envelope generation.
pub const H_ENVELOPE_GENERATION: &str = "Sealpost-Envelope-Generation";
/// Header: attempt id (also the receipt's position, see the crate docs).
pub const H_ATTEMPT_ID: &str = "Sealpost-Attempt-Id";
/// Header: payload digest.
pub const H_PAYLOAD_DIGEST: &str = "Sealpost-Payload-Digest";
/// Header: destination digest.
pub const H_DESTINATION_DIGEST: &str = "Sealpost-Destination-Digest";
/// Header quorum queues add to a redelivered message: deliveries before this one.
pub const H_DELIVERY_COUNT: &str = "x-delivery-count";

/// Publishes awaiting their confirm per connection at most.
const CONFIRMS_IN_FLIGHT_MAX: usize = 8_192;

/// Adapter errors.
#[derive(Debug, thiserror::Error)]
pub enum RabbitError {
    /// Could not connect or open a channel.
    #[error("cannot connect to RabbitMQ at {url}: {source}; {hint}")]
    Connect {
        /// URL tried, without its password ([`sealpost_core::secret::redact_url`]).
        url: String,
        /// What to check, in terms of the options ([`RabbitOptions`]).
        hint: String,
        /// Cause.
        source: lapin::Error,
    },
    /// A TLS or credential setting is wrong: a file missing, unreadable or not what it should
    /// hold, or settings that do not go together. Names the option (the `sealpost` config
    /// key), and a file's path, never a secret.
    #[error("RabbitMQ option `{option}`: {detail}")]
    Setting {
        /// The option (config key).
        option: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// The broker refused an action for lack of permission (AMQP 403 ACCESS_REFUSED): this
    /// user's configure, write or read pattern in the vhost does not cover it
    /// (docs/security.md). Not retried: it fails the same way until the rights change.
    #[error("RabbitMQ refused {what}: {detail}; {hint}")]
    NotPermitted {
        /// What was being done.
        what: String,
        /// The server's words (they name the resource, the vhost and the user).
        detail: String,
        /// The permission that covers it and what to do.
        hint: String,
    },
    /// Declaring or deleting an exchange, a queue or a binding failed.
    #[error("RabbitMQ {what}: {source}")]
    Topology {
        /// What was being done.
        what: String,
        /// The server's words.
        source: lapin::Error,
    },
}

impl RabbitError {
    /// Whether the broker refused for lack of permission ([`RabbitError::NotPermitted`]).
    pub fn is_not_permitted(&self) -> bool {
        matches!(self, RabbitError::NotPermitted { .. })
    }
}

/// The server's words if `e` is an AMQP 403 ACCESS_REFUSED (the channel or connection was
/// closed for lack of permission).
pub fn access_refused(e: &lapin::Error) -> Option<String> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) if amqp.get_id() == 403 => {
            Some(format!("{} {}", amqp.get_id(), amqp.get_message()))
        }
        _ => None,
    }
}

/// The exchange named by RabbitMQ's "access to exchange 'X' in vhost 'V' refused for user 'U'".
fn refused_exchange(detail: &str) -> Option<&str> {
    let rest = detail.split_once("access to exchange '")?.1;
    let (name, rest) = rest.split_once("' in vhost ")?;
    rest.contains("refused").then_some(name)
}

/// A failed topology action as an error: [`RabbitError::NotPermitted`] naming `permission`
/// when the broker refused it for lack of permission, else [`RabbitError::Topology`].
fn topology_error(what: String, permission: &str, source: lapin::Error) -> RabbitError {
    match access_refused(&source) {
        Some(detail) => RabbitError::NotPermitted {
            hint: format!(
                "it needs {permission} in this vhost: run it as an administrator, or grant it with `rabbitmqctl set_permissions` (docs/security.md)"
            ),
            what,
            detail,
        },
        None => RabbitError::Topology { what, source },
    }
}

/// The quorum queue of `consumer` on exchange `topic`.
pub fn queue_name(topic: &str, consumer: &str) -> String {
    format!("{topic}.{consumer}")
}

/// One open connection and its publishing channel (publisher confirms on).
struct Link {
    conn: Arc<Connection>,
    channel: Channel,
}

/// A connection to one RabbitMQ cluster, named by the cluster identity frozen into
/// destinations. Clones share the connection. A closed channel or connection is reopened by
/// the next batch (before its deadline check); nothing is ever republished by the client.
#[derive(Clone)]
pub struct Rabbit {
    cluster: String,
    target: Arc<Target>,
    name: String,
    ack_timeout: Duration,
    link: Arc<Mutex<Option<Link>>>,
    exchanges: Arc<std::sync::Mutex<HashSet<String>>>,
    inflight: Arc<Semaphore>,
    /// The lookup stream's settings, when destinations have one ([`LookupStream`]).
    lookup: Option<Arc<LookupStream>>,
}

async fn open(target: &Target, name: &str) -> Result<Link, RabbitError> {
    let err = |source| RabbitError::Connect {
        url: target.shown.clone(),
        hint: "opening the publishing channel".into(),
        source,
    };
    let conn = options::dial(
        target,
        ConnectionProperties::default().with_connection_name(LongString::from(name)),
    )
    .await?;
    let channel = conn.create_channel().await.map_err(err)?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(err)?;
    Ok(Link {
        conn: Arc::new(conn),
        channel,
    })
}

impl Rabbit {
    /// Connects to `url` as cluster `cluster`; `ack_timeout` bounds each publisher confirm;
    /// `name` is the connection name the broker shows (`rabbitmqctl list_connections
    /// client_properties`).
    pub async fn connect(
        url: &str,
        cluster: &str,
        ack_timeout: Duration,
        name: &str,
    ) -> Result<Rabbit, RabbitError> {
        Rabbit::connect_with(url, cluster, ack_timeout, name, &RabbitOptions::default()).await
    }

    /// [`Rabbit::connect`] with TLS and credentials ([`RabbitOptions`]): every file is read
    /// and checked first (a wrong one is named); reconnects reuse what was read.
    pub async fn connect_with(
        url: &str,
        cluster: &str,
        ack_timeout: Duration,
        name: &str,
        options: &RabbitOptions,
    ) -> Result<Rabbit, RabbitError> {
        let target = Arc::new(options.prepare(url)?);
        let link = open(&target, name).await?;
        Ok(Rabbit {
            cluster: cluster.to_string(),
            target,
            name: name.to_string(),
            ack_timeout,
            link: Arc::new(Mutex::new(Some(link))),
            exchanges: Arc::default(),
            inflight: Arc::new(Semaphore::new(CONFIRMS_IN_FLIGHT_MAX)),
            lookup: None,
        })
    }

    /// Answers lookups from each destination's lookup stream ([`LookupStream`], when
    /// `enabled`): the adapter then declares `lookup_by_event_id` and a lookup scan, and
    /// [`Rabbit::ensure_destination`] declares the stream.
    pub fn with_lookup_stream(mut self, lookup: LookupStream) -> Rabbit {
        self.lookup = lookup.enabled.then(|| Arc::new(lookup));
        self
    }

    /// The connection name this adapter opens its connections with.
    pub fn connection_name(&self) -> &str {
        &self.name
    }

    /// The connection's publishing channel, reopening the channel (or the whole connection)
    /// when it is closed.
    async fn channel(&self) -> Result<Channel, String> {
        let mut link = self.link.lock().await;
        if let Some(l) = link.as_ref() {
            if l.channel.status().connected() {
                return Ok(l.channel.clone());
            }
            if l.conn.status().connected() {
                let reopened = async {
                    let ch = l.conn.create_channel().await?;
                    ch.confirm_select(ConfirmSelectOptions::default()).await?;
                    Ok::<_, lapin::Error>(ch)
                }
                .await;
                if let Ok(ch) = reopened {
                    let conn = l.conn.clone();
                    *link = Some(Link {
                        conn,
                        channel: ch.clone(),
                    });
                    return Ok(ch);
                }
            }
        }
        *link = None;
        let l = open(&self.target, &self.name)
            .await
            .map_err(|e| e.to_string())?;
        tracing::info!(connection = %self.name, "RabbitMQ connection reopened");
        let ch = l.channel.clone();
        *link = Some(l);
        Ok(ch)
    }

    /// A fresh channel for topology work (declarations that fail close their channel).
    async fn side_channel(&self) -> Result<Channel, lapin::Error> {
        let conn = {
            let link = self.link.lock().await;
            link.as_ref().map(|l| l.conn.clone())
        };
        match conn {
            Some(c) if c.status().connected() => c.create_channel().await,
            _ => {
                let l = open(&self.target, &self.name).await.map_err(|e| match e {
                    RabbitError::Connect { source, .. } | RabbitError::Topology { source, .. } => {
                        source
                    }
                    RabbitError::Setting { .. } | RabbitError::NotPermitted { .. } => {
                        lapin::Error::from(std::io::Error::other(e.to_string()))
                    }
                })?;
                let ch = l.conn.create_channel().await?;
                *self.link.lock().await = Some(l);
                Ok(ch)
            }
        }
    }

    /// Declares the durable topic exchange `topic` and, for each consumer, its durable quorum
    /// queue ([`queue_name`]) bound with `#`, and, with a [`LookupStream`], the destination's
    /// lookup stream and its marker exchange ([`lookup_stream_name`]). Idempotent; run it before dispatching (a
    /// message with no bound queue is returned and counts as a refusal).
    pub async fn ensure_destination(
        &self,
        topic: &str,
        consumers: &[String],
    ) -> Result<(), RabbitError> {
        let ch = self
            .side_channel()
            .await
            .map_err(|source| RabbitError::Topology {
                what: "opening a channel".into(),
                source,
            })?;
        declare_exchange(&ch, topic).await?;
        for c in consumers {
            declare_queue(&ch, topic, c).await?;
        }
        if let Some(l) = &self.lookup {
            lookup::declare(&ch, topic, l).await?;
        }
        let _ = ch.close(200, "done".into()).await;
        self.exchanges
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(topic.to_string());
        Ok(())
    }

    /// Deletes the exchange `topic`, the consumers' queues and the destination's lookup
    /// stream with its marker exchange (tests, demos).
    pub async fn delete_destination(
        &self,
        topic: &str,
        consumers: &[String],
    ) -> Result<(), RabbitError> {
        let ch = self
            .side_channel()
            .await
            .map_err(|source| RabbitError::Topology {
                what: "opening a channel".into(),
                source,
            })?;
        for c in consumers {
            let q = queue_name(topic, c);
            ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                .await
                .map_err(|source| {
                    topology_error(
                        format!("deleting queue `{q}`"),
                        &format!("configure permission on `{q}`"),
                        source,
                    )
                })?;
        }
        // The lookup stream and its marker exchange, if it has them ([`LookupStream`]).
        let stream = lookup_stream_name(topic);
        ch.queue_delete(stream.as_str().into(), QueueDeleteOptions::default())
            .await
            .map_err(|source| {
                topology_error(
                    format!("deleting lookup stream `{stream}`"),
                    &format!("configure permission on `{stream}`"),
                    source,
                )
            })?;
        ch.exchange_delete(stream.as_str().into(), ExchangeDeleteOptions::default())
            .await
            .map_err(|source| {
                topology_error(
                    format!("deleting exchange `{stream}`"),
                    &format!("configure permission on `{stream}`"),
                    source,
                )
            })?;
        ch.exchange_delete(topic.into(), ExchangeDeleteOptions::default())
            .await
            .map_err(|source| {
                topology_error(
                    format!("deleting exchange `{topic}`"),
                    &format!("configure permission on `{topic}`"),
                    source,
                )
            })?;
        let _ = ch.close(200, "done".into()).await;
        self.exchanges
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(topic);
        Ok(())
    }

    /// `None` when exchange `topic` exists (checked once per adapter, by a passive declare on
    /// a channel of its own); else the reason nothing may be published to it.
    async fn check_exchange(&self, topic: &str) -> Option<NeverSentReason> {
        if self
            .exchanges
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(topic)
        {
            return None;
        }
        let ch = match self.side_channel().await {
            Ok(ch) => ch,
            Err(e) => return Some(NeverSentReason::NotConnected(e.to_string())),
        };
        let r = ch
            .exchange_declare(
                topic.into(),
                lapin::ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await;
        match r {
            Ok(()) => {
                let _ = ch.close(200, "done".into()).await;
                self.exchanges
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(topic.to_string());
                None
            }
            Err(e) if e.to_string().contains("NOT_FOUND") || e.to_string().contains("404") => {
                Some(NeverSentReason::NoSuchDestination(format!(
                    "exchange `{topic}`: {e} (declare it, e.g. with `sealpost demo --broker rabbitmq` or your topology tooling)"
                )))
            }
            Err(e) => Some(NeverSentReason::NotConnected(e.to_string())),
        }
    }

    fn receipt(&self, r: &SendRequest) -> Receipt {
        Receipt {
            event_id: r.event_id,
            member: r.member,
            envelope_generation: r.envelope_generation,
            attempt_id: r.attempt_id,
            payload_digest: r.payload_digest,
            destination_digest: r.destination_digest,
            cluster: self.cluster.clone(),
            stream: r.destination.topic.clone(),
            partition: None,
            sequence: r.attempt_id,
            broker_duplicate: false,
            source: ReceiptSource::Ack,
        }
    }

    /// Maps the broker's answer to one publish that left.
    fn answer(
        &self,
        r: &SendRequest,
        confirm: Result<Result<Confirmation, lapin::Error>, tokio::time::error::Elapsed>,
    ) -> SendResult {
        match confirm {
            Ok(Ok(Confirmation::Ack(None))) => SendResult::Receipt(self.receipt(r)),
            Ok(Ok(Confirmation::Ack(Some(returned)))) => SendResult::Refused {
                kind: RefusalKind::Rejected,
                detail: returned_detail(&returned),
            },
            Ok(Ok(Confirmation::Nack(_))) => {
                tracing::debug!(event_id = %r.event_id, "RabbitMQ nacked a publish: outcome unknown");
                SendResult::NoAnswer
            }
            // Confirms are selected on every channel this adapter publishes on.
            Ok(Ok(Confirmation::NotRequested)) => SendResult::NoAnswer,
            Ok(Err(e)) => not_permitted(r, &e).unwrap_or_else(|| {
                tracing::debug!(event_id = %r.event_id, error = %e, "no confirm: outcome unknown");
                SendResult::NoAnswer
            }),
            Err(_) => SendResult::NoAnswer,
        }
    }
}

/// A publish to `r`'s exchange that the broker refused for lack of write permission: the
/// channel closed with 403 ACCESS_REFUSED naming that exchange. Every confirm outstanding on
/// the channel fails with the same error, so a message to another exchange (or one whose
/// exchange the words do not name) is not refused by it: its outcome stays unknown.
fn not_permitted(r: &SendRequest, e: &lapin::Error) -> Option<SendResult> {
    let detail = access_refused(e)?;
    let topic = r.destination.topic.as_str();
    (refused_exchange(&detail)? == topic).then(|| SendResult::Refused {
        kind: RefusalKind::NotPermitted,
        detail: format!(
            "RabbitMQ: {detail}: this user may not publish to exchange `{topic}`; a dispatcher's user needs write permission on it (`rabbitmqctl set_permissions`, docs/security.md): grant it; the event is sent once it is granted"
        ),
    })
}

/// Declares the durable topic exchange `topic` (idempotent); a refusal names the configure
/// permission it needs.
pub(crate) async fn declare_exchange(ch: &Channel, topic: &str) -> Result<(), RabbitError> {
    ch.exchange_declare(
        topic.into(),
        lapin::ExchangeKind::Topic,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .map_err(|source| {
        topology_error(
            format!("declaring exchange `{topic}`"),
            &format!("configure permission on `{topic}`"),
            source,
        )
    })
}

/// Declares `consumer`'s durable quorum queue on `topic` and binds it with `#`.
pub async fn declare_queue(ch: &Channel, topic: &str, consumer: &str) -> Result<(), RabbitError> {
    let q = queue_name(topic, consumer);
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    ch.queue_declare(
        q.as_str().into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .map_err(|source| {
        topology_error(
            format!("declaring quorum queue `{q}`"),
            &format!("configure permission on `{q}`"),
            source,
        )
    })?;
    ch.queue_bind(
        q.as_str().into(),
        topic.into(),
        "#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .map_err(|source| {
        topology_error(
            format!("binding queue `{q}` to exchange `{topic}`"),
            &format!("write permission on `{q}` and read permission on `{topic}`"),
            source,
        )
    })?;
    Ok(())
}

/// The broker's words for a returned message.
fn returned_detail(m: &BasicReturnMessage) -> String {
    format!(
        "returned by RabbitMQ: {} {} (exchange `{}`, routing key `{}`): no queue is bound for this routing key; bind one, then release the event",
        m.reply_code, m.reply_text, m.delivery.exchange, m.delivery.routing_key
    )
}

fn header(value: impl Into<String>) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value.into()))
}

/// The AMQP headers and properties of one request.
fn properties(r: &SendRequest) -> BasicProperties {
    let mut h = FieldTable::default();
    h.insert(H_EVENT_ID.into(), header(r.event_id.to_string()));
    h.insert(H_MEMBER.into(), header(r.member.to_string()));
    h.insert(
        H_ENVELOPE_GENERATION.into(),
        header(r.envelope_generation.to_string()),
    );
    h.insert(H_ATTEMPT_ID.into(), header(r.attempt_id.to_string()));
    h.insert(
        H_PAYLOAD_DIGEST.into(),
        header(r.payload_digest.to_prefixed_hex()),
    );
    h.insert(
        H_DESTINATION_DIGEST.into(),
        header(r.destination_digest.to_prefixed_hex()),
    );
    for (name, value) in r.envelope.headers() {
        h.insert(name.into(), header(value));
    }
    if let Some(sig) = &r.signature {
        h.insert(H_SIGNATURE.into(), header(sig.as_str()));
    }
    let msg_id = if r.member == 0 {
        r.event_id.to_string()
    } else {
        format!("{}.{}", r.event_id, r.member)
    };
    BasicProperties::default()
        .with_message_id(ShortString::from(msg_id))
        .with_delivery_mode(2)
        .with_app_id("sealpost".into())
        // When it was published (seconds): a lookup stream's oldest message says how far
        // back the stream can prove an absence ([`LookupStream`]).
        .with_timestamp(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        )
        .with_headers(h)
}

/// A header's text (long or short string), if present.
pub fn header_str(props: &BasicProperties, name: &str) -> Option<String> {
    let h = props.headers().as_ref()?;
    match h.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
        _ => None,
    }
}

/// How many times the broker has delivered a message (this delivery included): quorum
/// queues count earlier deliveries in `x-delivery-count`; without it, a redelivered message
/// counts as its second delivery.
pub fn delivered_count(props: &BasicProperties, redelivered: bool) -> u64 {
    match lookup::int_header(props, H_DELIVERY_COUNT) {
        Some(n) => n + 1,
        None => 1 + u64::from(redelivered),
    }
}

/// What a delivered message's Sealpost headers say. The consumer digests the payload itself
/// and lets the core decide (`sealpost_core::inbox`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delivered {
    /// Event id from the headers.
    pub event_id: EventId,
    /// Delivery-set member from the headers.
    pub member: u16,
    /// Payload digest the headers claim.
    pub claimed_digest: Digest,
    /// The exchange it was published to (the destination's topic).
    pub stream: String,
    /// Its position: the attempt id of the publish that stored it (see the crate docs).
    pub sequence: u64,
}

/// Reads the Sealpost headers of a delivered message; `None` when they are missing or
/// malformed (not a Sealpost message).
pub fn delivery_of(exchange: &str, props: &BasicProperties) -> Option<Delivered> {
    Some(Delivered {
        event_id: EventId::parse(&header_str(props, H_EVENT_ID)?)?,
        member: header_str(props, H_MEMBER)?.parse().ok()?,
        claimed_digest: Digest::from_hex(&header_str(props, H_PAYLOAD_DIGEST)?)?,
        stream: exchange.to_string(),
        sequence: header_str(props, H_ATTEMPT_ID)?
            .parse()
            .ok()
            .filter(|s| *s != 0)?,
    })
}

/// What is wrong with a message's Sealpost headers, in words for a dead letter.
pub fn unreadable_reason(props: &BasicProperties) -> String {
    if props.headers().is_none() {
        return "no headers: not a Sealpost message".into();
    }
    let mut wrong = Vec::new();
    let mut check =
        |name: &str, ok: &dyn Fn(&str) -> bool, what: &str| match header_str(props, name) {
            None => wrong.push(format!("{name} missing")),
            Some(v) if !ok(&v) => wrong.push(format!("{name} `{v}` is not {what}")),
            _ => {}
        };
    check(H_EVENT_ID, &|v| EventId::parse(v).is_some(), "a UUID");
    check(H_MEMBER, &|v| v.parse::<u16>().is_ok(), "a number");
    check(
        H_PAYLOAD_DIGEST,
        &|v| Digest::from_hex(v).is_some(),
        "a hex digest",
    );
    check(
        H_ATTEMPT_ID,
        &|v| v.parse::<u64>().is_ok_and(|n| n != 0),
        "a positive number",
    );
    if wrong.is_empty() {
        "unreadable Sealpost headers".into()
    } else {
        format!("unreadable Sealpost headers: {}", wrong.join("; "))
    }
}

impl Broker for Rabbit {
    fn cluster(&self) -> &str {
        &self.cluster
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            // Only with a lookup stream ([`LookupStream`]): a queue cannot be asked.
            lookup_by_event_id: self.lookup.is_some(),
            duplicate_window_ms: None,
            create_if_absent: false,
            per_key_ordering: false,
            // The publish frames are written to the channel at once.
            handover_margin_ms: 0,
            lookup_scan: self.lookup.as_ref().map(|l| LookupScan {
                events_max: l.group_max,
                window_ms: l.group_window_ms,
            }),
        }
    }

    /// Publishes the batch in order on the connection's confirm channel, then waits for every
    /// confirm (each bounded by the ack timeout).
    async fn send_batch(&self, mut batch: Vec<SendRequest>, deadline: Instant) -> Vec<SendResult> {
        let mut out: Vec<Option<SendResult>> = vec![None; batch.len()];
        let caps = self.capabilities();
        let channel = match self.channel().await {
            Ok(ch) => ch,
            Err(e) => {
                return batch
                    .iter()
                    .map(|_| SendResult::NeverSent(NeverSentReason::NotConnected(e.clone())))
                    .collect()
            }
        };
        let mut missing: Vec<(String, NeverSentReason)> = Vec::new();
        let mut pending = Vec::new();
        for (i, r) in batch.iter_mut().enumerate() {
            if r.destination.cluster != self.cluster {
                out[i] = Some(SendResult::NeverSent(NeverSentReason::WrongCluster(
                    format!(
                        "destination cluster `{}` is not this connection's `{}`",
                        r.destination.cluster, self.cluster
                    ),
                )));
                continue;
            }
            let topic = r.destination.topic.clone();
            if let Some((_, why)) = missing.iter().find(|(t, _)| *t == topic) {
                out[i] = Some(SendResult::NeverSent(why.clone()));
                continue;
            }
            if let Some(why) = self.check_exchange(&topic).await {
                missing.push((topic, why.clone()));
                out[i] = Some(SendResult::NeverSent(why));
                continue;
            }
            // Any wait for a permit happens before the deadline check.
            let Ok(permit) = self.inflight.clone().acquire_owned().await else {
                out[i] = Some(SendResult::NeverSent(NeverSentReason::NotConnected(
                    "the adapter is shut down".into(),
                )));
                continue;
            };
            if !may_leave(deadline.saturating_duration_since(Instant::now()), &caps) {
                out[i] = Some(SendResult::NeverSent(NeverSentReason::DeadlinePassed));
                continue;
            }
            let status = channel.status();
            if !status.connected() {
                out[i] = Some(SendResult::NeverSent(NeverSentReason::NotConnected(
                    "the channel closed (it is reopened by the next batch)".into(),
                )));
                continue;
            }
            // Encoded alone: a message AMQP cannot carry (a short string over 255 bytes would
            // write a corrupt frame) is refused by itself, and the rest of the batch leaves.
            let (payload, props) =
                match encode_request(r, |r| Ok((std::mem::take(&mut r.payload), properties(r)))) {
                    Ok(m) => m,
                    Err(refused) => {
                        out[i] = Some(refused.into());
                        continue;
                    }
                };
            match channel
                .basic_publish(
                    topic.as_str().into(),
                    r.destination.routing_key.as_str().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        immediate: false,
                    },
                    &payload,
                    props,
                )
                .await
            {
                Ok(confirm) => pending.push((i, permit, confirm)),
                // The channel closed for lack of write permission on this exchange.
                Err(e) if not_permitted(r, &e).is_some() => {
                    out[i] = not_permitted(r, &e);
                }
                // The frames may have been partly written: the outcome is unknown.
                Err(e) => {
                    tracing::debug!(event_id = %r.event_id, error = %e, "publish failed after the channel check: outcome unknown");
                    out[i] = Some(SendResult::NoAnswer);
                }
            }
        }
        let timeout = self.ack_timeout;
        let confirms =
            futures::future::join_all(pending.into_iter().map(|(i, permit, confirm)| async move {
                let c = tokio::time::timeout(timeout, confirm).await;
                drop(permit);
                (i, c)
            }))
            .await;
        let mut nacked = 0usize;
        for (i, c) in confirms {
            nacked += usize::from(matches!(c, Ok(Ok(Confirmation::Nack(_)))));
            out[i] = Some(self.answer(&batch[i], c));
        }
        if nacked > 0 {
            // A channel that published to a quorum queue while it had no leader (a node
            // failover) can keep a stale view of the queue and be nacked after the queue has
            // a new leader (seen on RabbitMQ 3.10 in `tests/rabbitmq_failover.rs`); a new
            // channel asks afresh. Confirms still outstanding on it become unknown outcomes.
            tracing::warn!(
                nacked,
                batch = batch.len(),
                "RabbitMQ nacked publishes: their outcomes are unknown (the reconciler resolves them); reopening the publishing channel"
            );
            let _ = channel.close(200, "reopening after a nack".into()).await;
        }
        out.into_iter()
            .map(|r| r.unwrap_or(SendResult::NoAnswer))
            .collect()
    }

    /// Without a lookup stream the broker cannot be asked ([`Lookup::Unqueryable`]: the
    /// reconciler retries to the same exchange, R14); with one, a scan of it.
    async fn lookup(&self, destination: &Destination, event_id: EventId, member: u16) -> Lookup {
        self.lookup_many(destination, &[(event_id, member)])
            .await
            .pop()
            .unwrap_or(Lookup::Unavailable)
    }

    /// One scan of the destination's lookup stream answers every event of `events`
    /// ([`LookupStream`]).
    async fn lookup_many(
        &self,
        destination: &Destination,
        events: &[(EventId, u16)],
    ) -> Vec<Lookup> {
        let Some(cfg) = self.lookup.clone() else {
            return vec![Lookup::Unqueryable; events.len()];
        };
        if destination.cluster != self.cluster {
            return vec![Lookup::Unavailable; events.len()];
        }
        let ch = match self.side_channel().await {
            Ok(ch) => ch,
            Err(e) => {
                tracing::warn!(error = %e, "RabbitMQ lookup: no channel; nothing learned");
                return vec![Lookup::Unavailable; events.len()];
            }
        };
        let place = lookup::ScanPlace {
            cluster: &self.cluster,
            topic: &destination.topic,
            ack_timeout: self.ack_timeout,
        };
        let out = lookup::scan(&ch, place, &cfg, events).await;
        let _ = ch.close(200, "done".into()).await;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_stay_out_of_messages() {
        use sealpost_core::secret::redact_url as redact;
        assert_eq!(
            redact("amqp://guest:secret@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(redact("amqp://127.0.0.1"), "amqp://127.0.0.1");
        // An unencoded `@` in the password (the old rule kept the user and cut at the last
        // `@`; this one too, but it also covers an unencoded `/`).
        assert_eq!(
            redact("amqp://guest:se/cr@t@127.0.0.1/%2f"),
            "amqp://guest:***@127.0.0.1/%2f"
        );
    }

    #[test]
    fn an_access_refusal_names_its_exchange() {
        let words = "403 ACCESS_REFUSED - access to exchange 'ORDERS' in vhost 'v1' refused for user 'fulfilment'";
        assert_eq!(refused_exchange(words), Some("ORDERS"));
        assert_eq!(
            refused_exchange("403 ACCESS_REFUSED - access to queue 'ORDERS.c' in vhost 'v1' refused for user 'u'"),
            None
        );
        assert_eq!(
            refused_exchange("NOT_FOUND - no exchange 'X' in vhost '/'"),
            None
        );
    }

    #[test]
    fn delivery_count_counts_this_delivery() {
        let p = BasicProperties::default();
        assert_eq!(delivered_count(&p, false), 1);
        assert_eq!(delivered_count(&p, true), 2);
        let mut h = FieldTable::default();
        h.insert(H_DELIVERY_COUNT.into(), AMQPValue::LongLongInt(3));
        assert_eq!(
            delivered_count(&BasicProperties::default().with_headers(h), true),
            4
        );
    }
}
