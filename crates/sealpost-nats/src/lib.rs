//! NATS JetStream adapter: the only crate that knows JetStream's wire format. It implements
//! the broker port [`sealpost_core::port::Broker`] and knows no SQL (it depends on
//! `sealpost-core` and `async-nats`, not on the `sealpost` store).
//!
//! **What maps to what.** A destination's cluster is the identity this connection was opened
//! with ([`Nats::cluster`]); its topic is a stream named after it, with subjects `sp.<topic>.>`.
//! A [`SendRequest`] is published on `sp.<topic>.<event-id>.<member>` — a subject per event —
//! with `Nats-Msg-Id` = event id (the stream's 2-minute duplicate window answers a re-publish
//! with the original sequence and `duplicate: true`, which stays a receipt with
//! `broker_duplicate`), `Nats-Expected-Last-Subject-Sequence: 0` (create-if-absent: after the
//! window the stream refuses a second copy with JetStream error 10071, which becomes
//! [`SendResult::AlreadyStored`] and the reconciler looks the copy up; a duplicate answer
//! is a receipt only once the message it names was read and is this very message,
//! `sealpost_core::signature::is_this_message`), and headers carrying
//! the event id, member, envelope generation, attempt id and digests. The publish
//! acknowledgement (stream, sequence) is the [`Receipt`]. No message is handed to the client
//! once the batch deadline has passed ([`NeverSentReason::DeadlinePassed`]), nor while the
//! connection is down ([`NeverSentReason::NotConnected`]), nor for another cluster
//! ([`NeverSentReason::WrongCluster`]). A missing stream (no responders) is
//! [`NeverSentReason::NoSuchDestination`]; a message over the server's `max_payload` (checked
//! by the client before sending) or the stream's `max_msg_size` is refused as
//! [`RefusalKind::PayloadTooLarge`]; a publish the server refuses with a permissions
//! violation is refused as [`RefusalKind::NotPermitted`]; a message whose strings NATS cannot
//! carry (a CR or LF ends a header line) is refused alone as [`RefusalKind::Unencodable`]
//! before it is handed to the client, and the rest of its batch is sent
//! ([`sealpost_core::port::encode_request`]); any other failure after the request
//! left is [`SendResult::NoAnswer`]. The lookup ("did you store event X at D?") reads every
//! message on the event's subject, oldest first, for the reader to judge by their seals; it
//! works for as long as the stream retains the message, not only inside the duplicate
//! window. The cost is one subject per
//! event in the stream's subject index (tens of bytes of server memory per retained event).
//!
//! **Durability and clusters.** The destination's frozen durability names the stream's
//! storage and replica count ([`Durability`]: `file`, `memory`, `file/r3`, ...);
//! [`Nats::ensure_stream_for`] creates the stream that way and refuses an existing stream
//! with fewer replicas or other storage. [`Nats::connect`] takes one URL or several,
//! comma-separated (the servers of one cluster): the client connects to one of them and
//! moves to another when its server dies. With R3 a publish is acknowledged only once a
//! majority of the stream's replicas hold it, so the acknowledged message survives the loss
//! of any one node; a publish in flight when the stream leader dies ends as a receipt (the
//! new leader answered), [`SendResult::NoAnswer`] (an unknown the reconciler looks up on the
//! new leader) or never sent (no leader yet, no responders).
//!
//! **Rights.** A least-privilege user (docs/security.md, docs/nats-permissions.conf) may be
//! refused a JetStream API call: the server answers `-ERR 'Permissions Violation ...'` and
//! the request itself only times out. The adapter remembers the refused subject, so creating
//! a stream ([`Nats::ensure_stream_for`]) or opening a consumer ([`NatsSubscription`]) the
//! user may not ends in [`NatsError::NotPermitted`], naming the subject to grant, and any other
//! refused API call (a lookup) is logged with the subject.
//!
//! **TLS and credentials.** [`Nats::connect_with`] takes [`NatsOptions`]: the CA that signs
//! the servers' certificates, a client certificate for servers that verify clients, TLS
//! required (never plaintext), and one of a `.creds` file, an nkey seed file, a user with a
//! password file, or a token file. A connect that fails says which of them to check.

mod config;
mod options;
mod subscription;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use async_nats::connection::State;
use async_nats::header::{HeaderName, HeaderValue};
use async_nats::jetstream::{self, context::PublishErrorKind, stream::LastRawMessageErrorKind};
use async_nats::{HeaderMap, ServerError};
use sealpost_core::encoding::Digest;
use sealpost_core::envelope::{payload_digest, Destination, EventId};
use sealpost_core::port::{
    encode_request, may_leave, Broker, Capabilities, NeverSentReason, RefusalKind, ScannedMessage,
    SendRequest, SendResult, StreamCursor, StreamScan, WireEnvelope,
};
use sealpost_core::receipt::{Receipt, ReceiptSource};
use sealpost_core::reconcile::Lookup;
/// Header: the dispatcher's signature (`sealpost_core::signature`).
pub use sealpost_core::signature::H_SIGNATURE;
use sealpost_core::signature::{is_this_message, FoundCopy, SignedClaim, COPIES_MAX};
use tokio::sync::Semaphore;

pub use async_nats;
pub use config::NatsConfig;
pub use options::NatsOptions;
pub use subscription::{unreadable_reason, NatsSubscription};

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

/// The streams' duplicate window ([`Nats::ensure_stream`]).
pub const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

/// Publish acknowledgements in flight per connection at most.
const ACKS_IN_FLIGHT_MAX: usize = 8_192;

/// Permission violations remembered at most (subjects whose publish the server refused and
/// whose acknowledgement has not been mapped yet).
const DENIED_REMEMBERED_MAX: usize = 10_000;

/// Adapter errors.
#[derive(Debug, thiserror::Error)]
pub enum NatsError {
    /// Could not connect.
    #[error("cannot connect to NATS at {url}: {source}; {hint}")]
    Connect {
        /// URL tried, without its password or token
        /// ([`sealpost_core::secret::redact_url`]).
        url: String,
        /// Cause.
        source: async_nats::ConnectError,
        /// What to check, from the cause and the options ([`NatsOptions`]).
        hint: String,
    },
    /// A TLS or credential option is unusable ([`NatsOptions`]).
    #[error("NATS option {key}: {message}")]
    Options {
        /// The configuration key (`nats.security.tls_ca_file`, ...).
        key: &'static str,
        /// What is wrong and what to do.
        message: String,
    },
    /// A file an option names cannot be read.
    #[error("cannot read the {key} file {}: {source}; check the path and that this process may read it", path.display())]
    Read {
        /// The configuration key.
        key: &'static str,
        /// The file.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// The server refused a JetStream API call for lack of permission: this NATS user may
    /// not do it (docs/security.md). Not retried: it fails the same way until the rights
    /// change.
    #[error("the NATS user may not {action}: the server refused `{subject}` ({detail}); {hint}")]
    NotPermitted {
        /// What was being done (`create stream ORDERS`, ...).
        action: String,
        /// The JetStream API subject the server refused.
        subject: String,
        /// The server's words.
        detail: String,
        /// What to do.
        hint: String,
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

/// Storage of a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Storage {
    /// JetStream file store (survives a server restart).
    File,
    /// JetStream memory store.
    Memory,
}

/// The durability a destination asks of a JetStream stream, parsed from
/// `Destination::durability`: `file` or `memory`, optionally followed by `/rN` with N the
/// replica count (1 to 5, JetStream's limit). `file` is `file/r1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Durability {
    /// Storage.
    pub storage: Storage,
    /// Replicas (each message is acknowledged once a majority hold it).
    pub replicas: usize,
}

/// JetStream's largest replica count.
pub const REPLICAS_MAX: usize = 5;

impl Durability {
    /// Parses `file`, `memory`, `file/r3`, `memory/r2`, ...
    pub fn parse(s: &str) -> Result<Durability, String> {
        let bad = || {
            format!("durability `{s}`: expected `file` or `memory`, optionally with `/rN` (N replicas, 1 to {REPLICAS_MAX}), e.g. `file/r3`")
        };
        let (storage, replicas) = match s.split_once('/') {
            Some((st, r)) => (
                st,
                r.strip_prefix('r')
                    .and_then(|n| n.parse::<usize>().ok())
                    .ok_or_else(bad)?,
            ),
            None => (s, 1),
        };
        let storage = match storage {
            "file" => Storage::File,
            "memory" => Storage::Memory,
            _ => return Err(bad()),
        };
        if !(1..=REPLICAS_MAX).contains(&replicas) {
            return Err(bad());
        }
        Ok(Durability { storage, replicas })
    }
}

/// The servers of a comma-separated NATS URL list (`nats://a:4222,nats://b:4222`).
pub fn server_urls(urls: &str) -> Vec<String> {
    urls.split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .map(str::to_string)
        .collect()
}

/// The headers of one send: Sealpost's (event id, member, envelope generation, attempt id,
/// digests and the [`WireEnvelope`](sealpost_core::port::WireEnvelope)), `Nats-Msg-Id` and
/// `Nats-Expected-Last-Subject-Sequence: 0`. Names are static. Each value is checked and
/// copied once by `HeaderValue`'s `FromStr` (its `From<String>` would move it, but panics on
/// a CR or LF), and a dispatcher builds one map per event sent.
///
/// A value NATS cannot carry (a CR or LF ends a header line) is an error naming the header,
/// never a panic: the caller refuses that one message ([`encode_request`]).
///
/// `async_nats::HeaderMap` is a hash map that starts empty and grows (and rehashes every
/// name) four times on the way to these 15 or 16 names. Every send carries the same names
/// (the signature's only when the dispatcher signs), so the first message's map is kept as
/// a shape and each later message starts from a copy of it: its inserts replace values in a
/// table already the right size. The shape's values are empty, and every name of it is
/// written again for each message.
fn send_headers(r: &SendRequest) -> Result<HeaderMap, String> {
    static SHAPES: HeaderShapes = HeaderShapes::new();
    SHAPES.build(r)
}

/// The header names of a signed and of an unsigned send, each kept from the first such send
/// with empty values (see [`send_headers`]).
struct HeaderShapes {
    signed: OnceLock<HeaderMap>,
    unsigned: OnceLock<HeaderMap>,
}

impl HeaderShapes {
    const fn new() -> Self {
        HeaderShapes {
            signed: OnceLock::new(),
            unsigned: OnceLock::new(),
        }
    }

    fn build(&self, r: &SendRequest) -> Result<HeaderMap, String> {
        let shape = if r.signature.is_some() {
            &self.signed
        } else {
            &self.unsigned
        };
        match shape.get() {
            Some(headers) => fill_send_headers(headers.clone(), r),
            None => {
                let headers = fill_send_headers(HeaderMap::new(), r)?;
                // Its names with empty values: a copy then allocates no value of its own.
                let _ = shape.set(
                    headers
                        .iter()
                        .map(|(name, _)| (name.clone(), HeaderValue::new()))
                        .collect(),
                );
                Ok(headers)
            }
        }
    }
}

/// Writes every header of one send into `headers` (see [`send_headers`]).
fn fill_send_headers(mut headers: HeaderMap, r: &SendRequest) -> Result<HeaderMap, String> {
    fn name(n: &'static str) -> HeaderName {
        HeaderName::from_static(n)
    }
    let value = |n: &str, v: String| -> Result<HeaderValue, String> {
        v.parse::<HeaderValue>()
            .map_err(|e| format!("NATS cannot carry header `{n}`: {e}"))
    };
    let event_id = r.event_id.to_string();
    let msg_id = if r.member == 0 {
        event_id.clone()
    } else {
        format!("{event_id}.{}", r.member)
    };
    headers.insert(name(H_EVENT_ID), value(H_EVENT_ID, event_id)?);
    headers.insert(name(H_MEMBER), value(H_MEMBER, r.member.to_string())?);
    headers.insert(
        name(H_ENVELOPE_GENERATION),
        value(H_ENVELOPE_GENERATION, r.envelope_generation.to_string())?,
    );
    headers.insert(
        name(H_ATTEMPT_ID),
        value(H_ATTEMPT_ID, r.attempt_id.to_string())?,
    );
    headers.insert(
        name(H_PAYLOAD_DIGEST),
        value(H_PAYLOAD_DIGEST, r.payload_digest.to_prefixed_hex())?,
    );
    headers.insert(
        name(H_DESTINATION_DIGEST),
        value(H_DESTINATION_DIGEST, r.destination_digest.to_prefixed_hex())?,
    );
    for (n, v) in r.envelope.headers() {
        headers.insert(name(n), value(n, v)?);
    }
    if let Some(sig) = &r.signature {
        headers.insert(name(H_SIGNATURE), value(H_SIGNATURE, sig.clone())?);
    }
    headers.insert(
        async_nats::header::NATS_MESSAGE_ID,
        value("Nats-Msg-Id", msg_id)?,
    );
    headers.insert(
        async_nats::header::NATS_EXPECTED_LAST_SUBJECT_SEQUENCE,
        HeaderValue::from(0u64),
    );
    Ok(headers)
}

/// The subject of one event member on a topic.
pub fn subject(topic: &str, event_id: EventId, member: u16) -> String {
    format!("sp.{topic}.{event_id}.{member}")
}

/// A connection to one JetStream cluster, named by the cluster identity frozen into
/// destinations. Clones share the connection, the in-flight limit and what the server said.
#[derive(Clone)]
pub struct Nats {
    /// Cluster identity (must equal `Destination::cluster` of what it sends).
    pub cluster: String,
    /// Core client.
    pub client: async_nats::Client,
    /// JetStream context.
    pub js: jetstream::Context,
    /// Our own in-flight permits, taken before the deadline check so that no wait for a
    /// permit happens after it (the client's own limit is higher and never waits).
    inflight: Arc<Semaphore>,
    /// Subjects whose publish the server refused with a permissions violation (`-ERR`), with
    /// the server's words; the acknowledgement of such a publish never comes.
    denied: Arc<Mutex<HashMap<String, String>>>,
}

const PERMISSION_VIOLATION_PUBLISH: &str = "permissions violation for publish to ";

/// The subject of a server's "Permissions Violation for Publish to "SUBJECT"" error.
fn denied_subject(error: &str) -> Option<String> {
    let lower = error.to_ascii_lowercase();
    let at = lower.find(PERMISSION_VIOLATION_PUBLISH)? + PERMISSION_VIOLATION_PUBLISH.len();
    let s = error[at..].trim().trim_matches(|c| c == '"' || c == '\'');
    (!s.is_empty()).then(|| s.to_string())
}

impl Nats {
    /// Connects to `url`, one server or several of one cluster, comma-separated;
    /// `ack_timeout` bounds each publish acknowledgement. No TLS or credentials of our own:
    /// [`Nats::connect_with`] with [`NatsOptions::default`].
    pub async fn connect(
        url: &str,
        cluster: &str,
        ack_timeout: Duration,
    ) -> Result<Nats, NatsError> {
        Nats::connect_with(url, cluster, ack_timeout, &NatsOptions::default()).await
    }

    /// [`Nats::connect`] with TLS and credentials ([`NatsOptions`]: CA, client certificate,
    /// TLS required, creds file, nkey seed, user and password, token). The files are read
    /// and checked first; a failed connect says which option to check.
    pub async fn connect_with(
        url: &str,
        cluster: &str,
        ack_timeout: Duration,
        options: &NatsOptions,
    ) -> Result<Nats, NatsError> {
        let denied: Arc<Mutex<HashMap<String, String>>> = Arc::default();
        let seen = denied.clone();
        let client = options
            .apply(async_nats::ConnectOptions::new())
            .await?
            .connection_timeout(Duration::from_secs(5))
            .event_callback(move |event| {
                let seen = seen.clone();
                async move {
                    match event {
                        async_nats::Event::ServerError(ServerError::Other(e)) => {
                            match denied_subject(&e) {
                                Some(subject) => {
                                    // A refused event publish becomes that message's refusal;
                                    // a refused JetStream API call is named here as well, as
                                    // it may be a lookup that only ever sees a timeout.
                                    if subject.starts_with("$JS.") {
                                        tracing::warn!(error = %e, subject = %subject,
                                            "the NATS user may not call this JetStream API: grant it (docs/security.md) or run this as a user who may");
                                    }
                                    let mut m = seen.lock().unwrap_or_else(|p| p.into_inner());
                                    if m.len() >= DENIED_REMEMBERED_MAX {
                                        m.clear();
                                    }
                                    m.insert(subject, e);
                                }
                                None => tracing::warn!(error = %e, "NATS server error"),
                            }
                        }
                        async_nats::Event::Disconnected => tracing::warn!("NATS disconnected"),
                        async_nats::Event::Connected => tracing::info!("NATS connected"),
                        other => tracing::info!(event = %other, "NATS event"),
                    }
                }
            })
            // Fail fast at startup with a clear error; once connected, the client reconnects
            // by itself and sends in the meantime end as never sent (not connected) or as
            // unknown outcomes for the reconciler.
            .connect(server_urls(url))
            .await
            .map_err(|source| NatsError::Connect {
                url: sealpost_core::secret::redact_url(url),
                hint: options.hint(&source),
                source,
            })?;
        let js = jetstream::ContextBuilder::new()
            .timeout(ack_timeout)
            // Above our own limit, so the client never waits for a permit itself.
            .max_ack_inflight(2 * ACKS_IN_FLIGHT_MAX)
            .backpressure_on_inflight(true)
            .build(client.clone());
        Ok(Nats {
            cluster: cluster.to_string(),
            client,
            js,
            inflight: Arc::new(Semaphore::new(ACKS_IN_FLIGHT_MAX)),
            denied,
        })
    }

    /// Creates the stream for `topic` if it does not exist (file storage, one replica,
    /// 2-minute duplicate window).
    pub async fn ensure_stream(&self, topic: &str) -> Result<(), NatsError> {
        self.ensure_stream_for(topic, "file").await
    }

    /// Creates the stream for `topic` with the durability a destination freezes
    /// ([`Durability`], e.g. `file/r3`) if it does not exist, and checks that an existing
    /// stream keeps at least that: the same storage and no fewer replicas.
    pub async fn ensure_stream_for(&self, topic: &str, durability: &str) -> Result<(), NatsError> {
        let err = |detail: String| NatsError::Stream {
            stream: topic.to_string(),
            detail,
        };
        let d = Durability::parse(durability).map_err(err)?;
        let storage = match d.storage {
            Storage::File => jetstream::stream::StorageType::File,
            Storage::Memory => jetstream::stream::StorageType::Memory,
        };
        let stream = self
            .js
            .get_or_create_stream(jetstream::stream::Config {
                name: topic.to_string(),
                subjects: vec![format!("sp.{topic}.>")],
                storage,
                num_replicas: d.replicas,
                duplicate_window: DUPLICATE_WINDOW,
                ..Default::default()
            })
            .await;
        let mut stream = match stream {
            Ok(s) => s,
            Err(e) => {
                for (call, action) in [
                    ("STREAM.INFO", "read the info of stream"),
                    ("STREAM.CREATE", "create stream"),
                ] {
                    let subject = format!("$JS.API.{call}.{topic}");
                    if let Some(detail) = self.take_denied(&subject) {
                        return Err(NatsError::NotPermitted {
                            action: format!("{action} `{topic}`"),
                            hint: format!(
                                "create the stream as an administrator (`nats stream add {topic} --subjects 'sp.{topic}.>'`, docs/security.md) or grant this user publish on `{subject}`"
                            ),
                            subject,
                            detail,
                        });
                    }
                }
                return Err(err(format!(
                    "{e}; a stream of {} replicas needs a JetStream cluster of at least as many servers",
                    d.replicas
                )));
            }
        };
        let have = &stream.info().await.map_err(|e| err(e.to_string()))?.config;
        if have.storage != storage || have.num_replicas < d.replicas {
            return Err(err(format!(
                "the stream exists with {:?} storage and {} replica(s), the destination asks for `{durability}`; \
                 edit the stream (`nats stream edit {topic} --replicas {}`) or route to another stream",
                have.storage, have.num_replicas, d.replicas
            )));
        }
        Ok(())
    }

    /// [`Nats::ensure_stream_for`], then gives the stream the retention a route policy sets
    /// (`max_age`, `None` for no limit): an existing stream with another limit is updated
    /// (an administrator's right: `$JS.API.STREAM.UPDATE`).
    pub async fn ensure_stream_max_age(
        &self,
        topic: &str,
        durability: &str,
        max_age: Option<Duration>,
    ) -> Result<(), NatsError> {
        self.ensure_stream_for(topic, durability).await?;
        let err = |detail: String| NatsError::Stream {
            stream: topic.to_string(),
            detail,
        };
        let mut stream = self
            .js
            .get_stream(topic)
            .await
            .map_err(|e| err(e.to_string()))?;
        let mut config = stream
            .info()
            .await
            .map_err(|e| err(e.to_string()))?
            .config
            .clone();
        let want = max_age.unwrap_or(Duration::ZERO);
        if config.max_age == want {
            return Ok(());
        }
        config.max_age = want;
        if let Err(e) = self.js.update_stream(config).await {
            let subject = format!("$JS.API.STREAM.UPDATE.{topic}");
            if let Some(detail) = self.take_denied(&subject) {
                return Err(NatsError::NotPermitted {
                    action: format!("set the max age of stream `{topic}`"),
                    hint: format!(
                        "run it as an administrator (`nats stream edit {topic} --max-age {}s`, docs/security.md)",
                        want.as_secs()
                    ),
                    subject,
                    detail,
                });
            }
            return Err(err(format!("setting its max age: {e}")));
        }
        Ok(())
    }

    /// The server name of the stream leader of `topic`, if the stream is replicated and has
    /// a leader now.
    pub async fn stream_leader(&self, topic: &str) -> Option<String> {
        let mut stream = self.js.get_stream(topic).await.ok()?;
        stream.info().await.ok()?.cluster.as_ref()?.leader.clone()
    }

    /// The server's words if it refused a publish on `subject` for lack of permission.
    fn take_denied(&self, subject: &str) -> Option<String> {
        self.denied
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(subject)
    }

    /// The first refused subject starting with `prefix`, and the server's words.
    fn take_denied_prefix(&self, prefix: &str) -> Option<(String, String)> {
        let mut m = self.denied.lock().unwrap_or_else(|p| p.into_inner());
        let subject = m.keys().find(|s| s.starts_with(prefix))?.clone();
        let detail = m.remove(&subject)?;
        Some((subject, detail))
    }

    /// "Did you store event X at topic T?" (R13): every message on the event's subject, oldest
    /// first (at most [`COPIES_MAX`]), for the reader to judge. Not only the last one: anyone
    /// who may publish on `sp.>` can put a look-alike after the genuine copy (a publish
    /// without the expected-sequence header is not refused), and it must not hide the
    /// genuine one.
    pub async fn lookup_topic(&self, topic: &str, event_id: EventId, member: u16) -> Lookup {
        let stream = match self.js.get_stream_no_info(topic).await {
            Ok(s) => s,
            Err(_) => return Lookup::Unavailable,
        };
        let subject = subject(topic, event_id, member);
        let mut copies = Vec::new();
        let mut from = 1;
        while copies.len() < COPIES_MAX {
            match stream
                .get_first_raw_message_by_subject(&subject, from)
                .await
            {
                Ok(m) => {
                    from = m.sequence + 1;
                    match self.copy_of(topic, &m) {
                        Some(c) => copies.push(c),
                        // A message on our subject without our headers: someone else
                        // published there. Not proof of our send; if nothing else is
                        // there, leave it unknown for an operator.
                        None if copies.is_empty() => return Lookup::Unavailable,
                        None => {}
                    }
                }
                Err(e) if matches!(e.kind(), LastRawMessageErrorKind::NoMessageFound) => break,
                // Nothing learned past what was read: an answer without every copy could
                // hide the genuine one.
                Err(_) => return Lookup::Unavailable,
            }
        }
        if copies.is_empty() {
            Lookup::Absent
        } else {
            Lookup::Copies(copies)
        }
    }

    /// A stored message as a copy for the reader to judge: the receipt its headers describe
    /// (payload digest of the stored bytes), its envelope description and its signature;
    /// `None` when it lacks Sealpost's headers.
    fn copy_of(&self, topic: &str, m: &jetstream::message::StreamMessage) -> Option<FoundCopy> {
        let h = |name: &str| m.headers.get(name).map(|v| v.as_str().to_string());
        let receipt = Receipt {
            event_id: EventId::parse(&h(H_EVENT_ID)?)?,
            member: h(H_MEMBER)?.parse().ok()?,
            envelope_generation: h(H_ENVELOPE_GENERATION)?.parse().ok()?,
            attempt_id: h(H_ATTEMPT_ID)?.parse().ok()?,
            // The digest of the bytes stored, not the header's claim: a copy someone else
            // published with our headers is no proof of our send.
            payload_digest: payload_digest(&m.payload),
            destination_digest: Digest::from_hex(&h(H_DESTINATION_DIGEST)?)?,
            cluster: self.cluster.clone(),
            stream: topic.to_string(),
            partition: None,
            sequence: m.sequence,
            broker_duplicate: false,
            source: ReceiptSource::Lookup,
        };
        Some(FoundCopy::read(
            receipt,
            WireEnvelope::from_headers(|n| m.headers.get(n).map(|v| v.as_str())),
            h(H_SIGNATURE),
        ))
    }

    /// Whether the message a duplicate acknowledgement names (stream `topic`, `sequence`) is
    /// the one `r` sent (`sealpost_core::signature::is_this_message`). JetStream answers a
    /// publish whose `Nats-Msg-Id` it saw within the duplicate window with the first
    /// message's sequence, whoever published that: a forger who publishes first under the
    /// event's id would otherwise have its copy taken for our receipt. `false` when the copy
    /// cannot be read (then the outcome is a lookup away).
    async fn duplicate_is_ours(&self, r: &SendRequest, topic: &str, sequence: u64) -> bool {
        let Ok(stream) = self.js.get_stream_no_info(topic).await else {
            return false;
        };
        let Ok(m) = stream.get_raw_message(sequence).await else {
            return false;
        };
        self.copy_of(topic, &m).is_some_and(|copy| {
            is_this_message(&SignedClaim::of_request(r), r.signature.as_deref(), &copy)
        })
    }

    /// Maps the broker's answer to one publish that left.
    fn answer(
        &self,
        r: &SendRequest,
        subject: &str,
        ack: Result<jetstream::publish::PublishAck, jetstream::context::PublishError>,
    ) -> SendResult {
        let e = match ack {
            Ok(ack) => {
                return SendResult::Receipt(Receipt {
                    event_id: r.event_id,
                    member: r.member,
                    envelope_generation: r.envelope_generation,
                    attempt_id: r.attempt_id,
                    payload_digest: r.payload_digest,
                    destination_digest: r.destination_digest,
                    cluster: self.cluster.clone(),
                    stream: ack.stream,
                    partition: None,
                    sequence: ack.sequence,
                    broker_duplicate: ack.duplicate,
                    source: ReceiptSource::Ack,
                })
            }
            Err(e) => e,
        };
        let js_code = std::error::Error::source(&e)
            .and_then(|s| s.downcast_ref::<jetstream::Error>())
            .map(jetstream::Error::error_code);
        if let Some(detail) = self.take_denied(subject) {
            return SendResult::Refused {
                kind: RefusalKind::NotPermitted,
                detail: format!(
                    "NATS: {detail}: this user may not publish on `sp.{}.>`; a dispatcher's user needs publish on `sp.>` (docs/security.md): grant it; the event is sent once it is granted",
                    r.destination.topic
                ),
            };
        }
        match e.kind() {
            // Create-if-absent: a copy of this event is already stored on its subject.
            PublishErrorKind::WrongLastSequence => SendResult::AlreadyStored,
            // No stream listens on the subject: the broker answered before storing anything.
            PublishErrorKind::StreamNotFound => SendResult::NeverSent(
                NeverSentReason::NoSuchDestination(format!("{subject}: {e}")),
            ),
            _ if js_code == Some(jetstream::ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM) => {
                SendResult::Refused {
                    kind: RefusalKind::PayloadTooLarge,
                    detail: e.to_string(),
                }
            }
            _ => {
                tracing::debug!(event_id = %r.event_id, error = %e, "no publish ack: outcome unknown");
                SendResult::NoAnswer
            }
        }
    }
}

/// What a delivered message's Sealpost headers and JetStream metadata say. The consumer
/// digests the payload itself and lets the core decide (`sealpost_core::inbox`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delivered {
    /// Event id from the headers.
    pub event_id: EventId,
    /// Delivery-set member from the headers.
    pub member: u16,
    /// Payload digest the headers claim.
    pub claimed_digest: Digest,
    /// Stream that delivered it.
    pub stream: String,
    /// Stream sequence.
    pub sequence: u64,
}

/// Reads the Sealpost headers and JetStream metadata of a delivered message; `None` when
/// they are missing or malformed (not a Sealpost message).
pub fn delivery_of(msg: &jetstream::Message) -> Option<Delivered> {
    let h = msg.headers.as_ref()?;
    let get = |n: &str| h.get(n).map(|v| v.as_str().to_string());
    let info = msg.info().ok()?;
    Some(Delivered {
        event_id: EventId::parse(&get(H_EVENT_ID)?)?,
        member: get(H_MEMBER)?.parse().ok()?,
        claimed_digest: Digest::from_hex(&get(H_PAYLOAD_DIGEST)?)?,
        stream: info.stream.to_string(),
        sequence: info.stream_sequence,
    })
}

impl Broker for Nats {
    fn cluster(&self) -> &str {
        &self.cluster
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            lookup_by_event_id: true,
            duplicate_window_ms: Some(DUPLICATE_WINDOW.as_millis() as u64),
            create_if_absent: true,
            per_key_ordering: false,
            // The publish is written to the connection at once.
            handover_margin_ms: 0,
            lookup_scan: None,
        }
    }

    /// Publishes the batch concurrently and waits for every acknowledgement. Every attempt
    /// was registered in the database before this is called.
    async fn send_batch(&self, mut batch: Vec<SendRequest>, deadline: Instant) -> Vec<SendResult> {
        let mut out: Vec<Option<SendResult>> = vec![None; batch.len()];
        let caps = self.capabilities();
        let mut pending = Vec::with_capacity(batch.len());
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
            // Any wait for an in-flight permit happens before the deadline check.
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
            let state = self.client.connection_state();
            if state != State::Connected {
                out[i] = Some(SendResult::NeverSent(NeverSentReason::NotConnected(
                    format!("connection {state:?}"),
                )));
                continue;
            }
            // Encoded alone: a message NATS cannot carry is refused by itself, and the rest
            // of the batch still leaves.
            let publish = match encode_request(r, |r| {
                let headers = send_headers(r)?;
                Ok(jetstream::message::PublishMessage::build()
                    .payload(std::mem::take(&mut r.payload).into())
                    .headers(headers))
            }) {
                Ok(p) => p,
                Err(refused) => {
                    out[i] = Some(refused.into());
                    continue;
                }
            };
            let subject = subject(&r.destination.topic, r.event_id, r.member);
            match self.js.send_publish(subject.clone(), publish).await {
                Ok(ack) => pending.push((i, subject, permit, ack)),
                // Checked by the client against the server's max_payload before sending.
                Err(e) if e.kind() == PublishErrorKind::MaxPayloadExceeded => {
                    out[i] = Some(SendResult::Refused {
                        kind: RefusalKind::PayloadTooLarge,
                        detail: e.to_string(),
                    });
                }
                // Refused before the request left (the client's queue is closed or full).
                Err(e) => {
                    out[i] = Some(SendResult::NeverSent(NeverSentReason::NotConnected(
                        e.to_string(),
                    )));
                }
            }
        }
        let acks = futures::future::join_all(pending.into_iter().map(
            |(i, subject, permit, ack)| async move {
                let a = ack.await;
                drop(permit);
                (i, subject, a)
            },
        ))
        .await;
        for (i, subject, a) in acks {
            let mut result = self.answer(&batch[i], &subject, a);
            if let SendResult::Receipt(r) = &result {
                if r.broker_duplicate
                    && !self
                        .duplicate_is_ours(&batch[i], &r.stream, r.sequence)
                        .await
                {
                    tracing::warn!(
                        event_id = %batch[i].event_id,
                        stream = %r.stream,
                        sequence = r.sequence,
                        "duplicate publish ack names a message that is not this event's (a look-alike published first under its id?); the reconciler looks it up"
                    );
                    result = SendResult::AlreadyStored;
                }
            }
            out[i] = Some(result);
        }
        out.into_iter()
            .map(|r| r.unwrap_or(SendResult::NoAnswer))
            .collect()
    }

    async fn lookup(&self, destination: &Destination, event_id: EventId, member: u16) -> Lookup {
        if destination.cluster != self.cluster {
            return Lookup::Unavailable;
        }
        self.lookup_topic(&destination.topic, event_id, member)
            .await
    }
}

/// A stream read from its start by an ordered consumer (the reconciliation report's
/// out-of-band check): a message's event id comes from its `Sealpost-Event-Id` header.
pub struct NatsScan {
    messages: jetstream::consumer::pull::Ordered,
}

impl StreamScan for Nats {
    type Cursor = NatsScan;

    async fn open_scan(&self, stream: &str) -> Option<NatsScan> {
        use jetstream::consumer::{pull, DeliverPolicy};
        let st = self.js.get_stream(stream).await.ok()?;
        let c = st
            .create_consumer(pull::OrderedConfig {
                deliver_policy: DeliverPolicy::All,
                ..Default::default()
            })
            .await
            .ok()?;
        Some(NatsScan {
            messages: c.messages().await.ok()?,
        })
    }
}

impl StreamCursor for NatsScan {
    /// Waits up to 500 ms for the next message.
    async fn next_message(&mut self) -> Option<(ScannedMessage, u64)> {
        use futures::StreamExt;
        let next = tokio::time::timeout(Duration::from_millis(500), self.messages.next()).await;
        let Ok(Some(Ok(m))) = next else { return None };
        let left = m.info().map_or(0, |i| i.pending);
        let id = m
            .headers
            .as_ref()
            .and_then(|h| h.get(H_EVENT_ID))
            .and_then(|v| EventId::parse(v.as_str()));
        let msg = match id {
            Some(id) => ScannedMessage::Event(id),
            None => ScannedMessage::Foreign(m.subject.to_string()),
        };
        Some((msg, left))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permission_violation_names_the_subject() {
        assert_eq!(
            denied_subject(r#"Permissions Violation for Publish to "sp.T.x.0""#).as_deref(),
            Some("sp.T.x.0")
        );
        assert_eq!(
            denied_subject("permissions violation for publish to sp.T.x.1").as_deref(),
            Some("sp.T.x.1")
        );
        assert_eq!(
            denied_subject(r#"Permissions Violation for Subscription to "x""#),
            None
        );
    }

    #[test]
    fn durability_names_storage_and_replicas() {
        let d = |s: &str| Durability::parse(s);
        assert_eq!(
            d("file"),
            Ok(Durability {
                storage: Storage::File,
                replicas: 1
            })
        );
        assert_eq!(
            d("file/r3"),
            Ok(Durability {
                storage: Storage::File,
                replicas: 3
            })
        );
        assert_eq!(
            d("memory/r2"),
            Ok(Durability {
                storage: Storage::Memory,
                replicas: 2
            })
        );
        for bad in [
            "",
            "disk",
            "file/3",
            "file/r0",
            "file/r6",
            "file/r",
            "file/r3/x",
        ] {
            let e = d(bad).expect_err(bad);
            assert!(e.contains("file/r3"), "{bad}: {e}");
        }
    }

    #[test]
    fn several_servers_comma_separated() {
        assert_eq!(
            server_urls("nats://127.0.0.1:4222"),
            ["nats://127.0.0.1:4222"]
        );
        assert_eq!(
            server_urls("nats://a:1, nats://b:2,,nats://c:3 "),
            ["nats://a:1", "nats://b:2", "nats://c:3"]
        );
    }

    fn request(n: u8, signature: Option<&str>) -> SendRequest {
        use sealpost_core::envelope::{EventOrdering, PartitionAlgorithm, RoutePolicy};
        let destination = RoutePolicy {
            generation: 1,
            cluster: "c".into(),
            topic: format!("T{n}"),
            partition_algorithm: PartitionAlgorithm::None,
            serializer: "json.v1".into(),
            durability: "file".into(),
            required_ack: "stream".into(),
            ordering: EventOrdering::Unordered,
        }
        .resolve("k");
        SendRequest {
            event_id: EventId([n; 16]),
            member: u16::from(n),
            envelope_generation: u32::from(n),
            attempt_id: u64::from(n),
            payload_digest: Digest([n; 32]),
            destination_digest: destination.digest(),
            destination,
            payload: b"{}".to_vec(),
            envelope: WireEnvelope {
                event_type: format!("order.created.v{n}"),
                aggregate_type: format!("order{n}"),
                aggregate_id: format!("o-{n}"),
                aggregate_version: u64::from(n),
                occurred_at_ms: u64::from(n),
                tenant: format!("t{n}"),
                payload_schema_digest: Digest([n; 32]),
            },
            signature: signature.map(str::to_string),
        }
    }

    /// Every header of a map, sorted, one line each.
    fn lines(h: &HeaderMap) -> Vec<String> {
        let mut v: Vec<String> = h
            .iter()
            .flat_map(|(k, vs)| vs.iter().map(move |v| format!("{k}: {v}")))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_send_built_on_the_first_sends_shape_carries_its_own_headers_only() {
        // Signed sends first, then unsigned ones, and the other way round, each order on
        // shapes of its own.
        for signed_first in [true, false] {
            let shapes = HeaderShapes::new();
            let kinds = if signed_first {
                [Some("sig"), None]
            } else {
                [None, Some("sig")]
            };
            for signature in kinds {
                for n in 1..=3u8 {
                    let sig = signature.map(|s| format!("{s}-{n}"));
                    let r = request(n, sig.as_deref());
                    let built = shapes.build(&r).unwrap();
                    // The same names and values as a map built from nothing.
                    let fresh = fill_send_headers(HeaderMap::new(), &r).unwrap();
                    assert_eq!(lines(&built), lines(&fresh), "send {n}, {signature:?}");
                    assert_eq!(built.len(), 15 + usize::from(signature.is_some()));
                    assert_eq!(
                        built.get(H_SIGNATURE).map(|v| v.as_str()),
                        sig.as_deref(),
                        "send {n}"
                    );
                    // Nothing of the shape's first send is left in a later one.
                    let n_event_id = EventId([n; 16]).to_string();
                    assert_eq!(
                        built.get(H_EVENT_ID).map(|v| v.as_str()),
                        Some(n_event_id.as_str())
                    );
                }
            }
        }
        // The process-wide shapes give the same.
        let r = request(4, Some("sig-4"));
        assert_eq!(
            lines(&send_headers(&r).unwrap()),
            lines(&fill_send_headers(HeaderMap::new(), &r).unwrap())
        );
    }

    #[test]
    fn subject_per_event_member() {
        let id = EventId([1; 16]);
        assert_eq!(subject("ORDERS", id, 2), format!("sp.ORDERS.{id}.2"));
    }
}
