//! Kafka adapter: the only crate that knows the Kafka protocol. It implements the broker port
//! [`sealpost_core::port::Broker`] over `rdkafka` (librdkafka, bundled) and knows no SQL.
//!
//! **What maps to what.** A destination's cluster is the identity this adapter was connected
//! with ([`Kafka::cluster`]); its topic is the Kafka topic; its routing key is the record key
//! (the aggregate id by default, so a Java consumer sees the key it expects). The partition
//! is **Sealpost's choice**, not the client's: the destination freezes
//! `kafka-murmur2/<n>` ([`PartitionAlgorithm::KafkaMurmur2`]), Kafka's default partitioner
//! over the partition count `n` the topic had when the route was set, and the record is
//! produced to exactly that partition. Adding partitions to the topic later moves no
//! committed event, so an aggregate's events stay in one partition, in order.
//!
//! **The producer.** `acks=all`, `enable.idempotence=true` (the broker drops librdkafka's own
//! retries of a batch by producer id and sequence), `message.timeout.ms` = the ack timeout.
//! Each record carries the Sealpost headers (event id, member, envelope generation, attempt
//! id, digests, and the envelope's [`sealpost_core::port::WireEnvelope`]).
//!
//! **Answers.** A delivery report with (partition, offset) is the [`Receipt`]: `stream` is
//! the topic, `partition` the partition, and `sequence` the **offset + 1** (a receipt's
//! position is never 0; Kafka's first offset is). A record over the size limit, or a topic
//! the producer may not write, is a permanent refusal. An unknown topic or partition is
//! [`NeverSentReason::NoSuchDestination`]. A timed-out or otherwise failed delivery is
//! [`SendResult::NoAnswer`]: librdkafka may have written it. A message whose strings break
//! the rules every broker shares (`sealpost_core::wire`) is refused alone as
//! [`RefusalKind::Unencodable`] before it is produced, and the rest of its batch is sent.
//!
//! **The deadline.** The dispatcher's batch deadline is the lease end minus the ack timeout
//! (`send_deadline_ms`): the time left after it is for the answer. librdkafka retries a
//! record internally until `message.timeout.ms` (= the ack timeout) after it was handed over,
//! and never transmits it after reporting it. So a record is handed over only while the
//! deadline is more than [`DEADLINE_MARGIN`] away (declared as the capability
//! `handover_margin_ms` and checked by the core's one deadline rule, `port::may_leave`);
//! every transmission of it then ends before the lease does, and no other dispatcher or the reconciler can have taken the row over
//! (R9). Past that point the answer is [`NeverSentReason::DeadlinePassed`]: it never left.
//!
//! **Lookup** ("did you store event X?", R13). Kafka has no read by key. The adapter scans the
//! *frozen* partition only: from the first offset whose timestamp is at or after the event's
//! own time (a UUIDv7 event id carries its mint time; an event cannot be sent before it was
//! committed) minus [`KafkaConfig::lookup_clock_margin_ms`] (producer clock skew), up to the
//! partition's high watermark read when the lookup began, matching the event-id and member
//! headers. Cost: one ListOffsets, one watermark query and a read of the partition's traffic
//! since the event was minted (plus the margin); bound: [`KafkaConfig::lookup_scan_max`]
//! records, past which the answer is [`Lookup::Unavailable`] (nothing learned; the reconciler
//! asks again later and an operator sees the row age). When the first retained record is
//! newer than the scan's start, records the scan needed may have been deleted by retention:
//! the answer is [`Lookup::Unqueryable`] ("cannot be asked"), and the reconciler retries to the
//! same destination (R14). An event id that is not a UUIDv7 is scanned from the partition's
//! start, and is unqueryable once retention has deleted anything.
//!
//! **Many unknowns, one scan.** The adapter declares a lookup scan
//! ([`Capabilities::lookup_scan`]: [`KafkaConfig::lookup_group_max`] events minted within
//! [`KafkaConfig::lookup_group_window_ms`]), so the reconciler hands it groups of unknown
//! events of one partition ([`Broker::lookup_many`]); one read from the earliest one's time
//! answers them all, through the core's `reconcile::decide_scanned` (absent only for a scan
//! that read its whole range; a scan cut short learned nothing about the events it did not
//! see). The consumers of finished scans are kept for the next ones.
//!
//! **TLS and credentials.** librdkafka is built with OpenSSL (`security.protocol` `SSL` or
//! `SASL_SSL`, `ssl.ca.location`, `ssl.certificate.location`, `ssl.key.location`; SASL
//! `PLAIN`, `SCRAM-SHA-256`, `SCRAM-SHA-512`), all set through
//! [`KafkaConfig::client_properties`]. The SASL password can come from a file instead
//! ([`KafkaConfig::sasl_password_file`], read at connect). No error or log line of this
//! adapter carries a secret property's value ([`create_client`], the `Debug` of
//! [`KafkaConfig`]); a connect that fails says librdkafka's last error (a failed TLS
//! handshake or SASL authentication is otherwise only "all brokers down").

mod subscription;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::config::{ClientConfig, FromClientConfig, FromClientConfigAndContext};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::{Offset, TopicPartitionList};
use sealpost_core::encoding::Digest;
use sealpost_core::envelope::{payload_digest, Destination, EventId, PartitionAlgorithm};
use sealpost_core::port::{
    encode_request, may_leave, Broker, Capabilities, NeverSentReason, RefusalKind, SendRequest,
    SendResult, WireEnvelope,
};
use sealpost_core::receipt::{Receipt, ReceiptSource};
use sealpost_core::reconcile::{decide_scanned, Lookup, LookupScan, ScanReach};
/// Header: the dispatcher's signature (`sealpost_core::signature`).
pub use sealpost_core::signature::H_SIGNATURE;
use sealpost_core::signature::{FoundCopy, COPIES_MAX};

pub use rdkafka;
pub use subscription::{unreadable_reason, KafkaSubscription};

/// Header: event id.
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

/// A record is handed to librdkafka only while the batch deadline is at least this far away
/// (librdkafka enforces message timeouts about once a second, so a report can be that late).
pub const DEADLINE_MARGIN: Duration = Duration::from_millis(1_500);

/// Adapter errors.
#[derive(Debug, thiserror::Error)]
pub enum KafkaAdapterError {
    /// The client could not be created or the cluster did not answer.
    #[error("cannot connect to Kafka at {brokers}: {cause}{last}; is the broker running and `brokers` right (`[kafka]` table or KAFKA_BROKERS: host:port[,host:port])? With TLS or SASL: `security.protocol`, `ssl.ca.location`, `sasl.mechanism`, `sasl.username` and the password")]
    Connect {
        /// Bootstrap servers tried (credentials removed).
        brokers: String,
        /// The cause as librdkafka words it, with the values of the secret client properties
        /// scrubbed (librdkafka quotes a value it refuses).
        cause: String,
        /// Cause (boxed: the error stays small on every `Result` path).
        source: Box<KafkaError>,
        /// librdkafka's last error before giving up (`; last error: ...`), or empty.
        last: String,
    },
    /// A setting is wrong (e.g. the SASL password file); names the option and a file's path,
    /// never a secret.
    #[error("Kafka option `{option}`: {detail}")]
    Setting {
        /// The option (config key).
        option: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// Creating, deleting or describing a topic failed.
    #[error("Kafka {what}: {detail}")]
    Topology {
        /// What was being done.
        what: String,
        /// The broker's or client's words.
        detail: String,
    },
}

/// Settings of the adapter. Its `Debug` shows the client properties with their secrets
/// (`sasl.password`, ...) redacted. A service builds it in code ([`KafkaConfig::new`]), reads
/// it from the environment ([`KafkaConfig::from_env`]) or deserializes it (the `sealpost`
/// command's `[kafka]` table; `client_properties` there is the `key=value[,key=value]`
/// string).
#[derive(Clone, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KafkaConfig {
    /// Bootstrap servers, `host:port[,host:port]` (`KAFKA_BROKERS`).
    pub brokers: String,
    /// Cluster identity frozen into destinations (`KAFKA_CLUSTER`).
    pub cluster: String,
    /// Bound on one delivery report (librdkafka's `message.timeout.ms`); the runtime's
    /// `ack_timeout_ms`, not read from a file.
    #[serde(skip)]
    pub ack_timeout: Duration,
    /// Partitions of a topic Sealpost creates (the demo's); an existing topic keeps its own
    /// count, and a route freezes the count the topic has.
    pub partitions: u32,
    /// How far before the event's mint time a lookup starts its scan (producer clock skew).
    pub lookup_clock_margin_ms: u64,
    /// Records one lookup scan reads at most.
    pub lookup_scan_max: u64,
    /// Unknown events one lookup scan answers at most (the reconciler groups them by
    /// partition and mint time).
    pub lookup_group_max: usize,
    /// Events grouped into one scan are minted at most this far from the group's first.
    pub lookup_group_window_ms: u64,
    /// The client id the broker logs (`sealpost-<role>-<pid>`).
    #[serde(skip)]
    pub client_id: String,
    /// librdkafka properties set on every client this adapter creates, after its own (e.g.
    /// `security.protocol`, or `batch.num.messages=1` for tansu 0.6, see docs/operations.md)
    /// (`KAFKA_CLIENT_PROPERTIES`, `key=value[,key=value]`).
    #[serde(deserialize_with = "properties_from_str")]
    pub client_properties: Vec<(String, String)>,
    /// A file holding the SASL password (`sasl.password`), read at connect; its trailing line
    /// break is dropped. Not together with a `sasl.password` property
    /// (`KAFKA_SASL_PASSWORD_FILE`).
    pub sasl_password_file: Option<PathBuf>,
}

/// `client_properties` from its `key=value[,key=value]` string.
fn properties_from_str<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Vec<(String, String)>, D::Error> {
    let s = <String as serde::Deserialize>::deserialize(d)?;
    parse_properties(&s).map_err(serde::de::Error::custom)
}

impl Default for KafkaConfig {
    fn default() -> Self {
        KafkaConfig::new("127.0.0.1:9092", "kafka-local", Duration::from_secs(5))
    }
}

impl std::fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let properties: Vec<(&str, &str)> = self
            .client_properties
            .iter()
            .map(|(k, v)| {
                let shown = if sealpost_core::secret::is_secret_key(k) {
                    sealpost_core::secret::REDACTED
                } else {
                    v.as_str()
                };
                (k.as_str(), shown)
            })
            .collect();
        f.debug_struct("KafkaConfig")
            .field("brokers", &self.brokers)
            .field("cluster", &self.cluster)
            .field("ack_timeout", &self.ack_timeout)
            .field("partitions", &self.partitions)
            .field("lookup_clock_margin_ms", &self.lookup_clock_margin_ms)
            .field("lookup_scan_max", &self.lookup_scan_max)
            .field("lookup_group_max", &self.lookup_group_max)
            .field("lookup_group_window_ms", &self.lookup_group_window_ms)
            .field("client_id", &self.client_id)
            .field("client_properties", &properties)
            .field("sasl_password_file", &self.sasl_password_file)
            .finish()
    }
}

/// Whether librdkafka property `key` holds a secret (a password, a client secret, a private
/// key given inline): its value is never shown.
pub fn is_secret(key: &str) -> bool {
    sealpost_core::secret::is_secret_key(key)
}

/// The properties with the SASL password read from `sasl_password_file` (if given) added as
/// `sasl.password`. Errors name the file, never its contents.
// `KafkaAdapterError` carries rdkafka's error; this runs once per connect, where the size of
// an error costs nothing.
#[allow(clippy::result_large_err)]
pub fn with_secrets(
    properties: &[(String, String)],
    sasl_password_file: Option<&Path>,
) -> Result<Vec<(String, String)>, KafkaAdapterError> {
    let mut out = properties.to_vec();
    let Some(path) = sasl_password_file else {
        return Ok(out);
    };
    let bad = |detail: String| KafkaAdapterError::Setting {
        option: "kafka.sasl_password_file",
        detail,
    };
    if properties.iter().any(|(k, _)| k == "sasl.password") {
        return Err(bad(format!(
            "{} is set and kafka_client_properties has sasl.password too; keep one",
            path.display()
        )));
    }
    let bytes =
        std::fs::read(path).map_err(|e| bad(format!("cannot read {}: {e}", path.display())))?;
    let text = String::from_utf8(bytes)
        .map_err(|_| bad(format!("{} is not UTF-8 text", path.display())))?;
    let password = text.trim_end_matches(['\n', '\r']);
    if password.is_empty() {
        return Err(bad(format!("{} is empty", path.display())));
    }
    out.push(("sasl.password".to_string(), password.to_string()));
    Ok(out)
}

/// `e` with the value of a secret property replaced by `***` (rdkafka's configuration error
/// shows the value it refused).
pub fn scrub(e: KafkaError) -> KafkaError {
    match e {
        KafkaError::ClientConfig(code, desc, key, _) if is_secret(&key) => {
            KafkaError::ClientConfig(code, desc, key, "***".to_string())
        }
        e => e,
    }
}

/// Creates a client from `c`; a configuration error never shows a secret's value.
pub fn create_client<T: FromClientConfig>(c: &ClientConfig) -> Result<T, KafkaError> {
    c.create().map_err(scrub)
}

/// The producer's client context: librdkafka's errors are logged and the last one (other
/// than "all brokers down") is kept, so a connect that fails can say why (a failed TLS
/// handshake or SASL authentication shows up only there). Clones share the record.
#[derive(Clone, Default)]
pub struct LinkContext {
    last: std::sync::Arc<std::sync::Mutex<Option<String>>>,
}

impl LinkContext {
    /// librdkafka's last error, if any.
    pub fn last_error(&self) -> Option<String> {
        self.last.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl ClientContext for LinkContext {
    fn error(&self, error: KafkaError, reason: &str) {
        tracing::warn!(%error, reason, "librdkafka error");
        if error.rdkafka_error_code() != Some(RDKafkaErrorCode::AllBrokersDown) {
            *self.last.lock().unwrap_or_else(|p| p.into_inner()) =
                Some(format!("{error}: {reason}"));
        }
    }
}

type LinkProducer = FutureProducer<LinkContext>;

impl KafkaConfig {
    /// Defaults for `brokers` and `cluster`: 60 s clock margin, 1,000,000 records per lookup.
    pub fn new(brokers: &str, cluster: &str, ack_timeout: Duration) -> KafkaConfig {
        KafkaConfig {
            brokers: brokers.to_string(),
            cluster: cluster.to_string(),
            ack_timeout,
            partitions: 6,
            lookup_clock_margin_ms: 60_000,
            lookup_scan_max: 1_000_000,
            lookup_group_max: 500,
            lookup_group_window_ms: 300_000,
            client_id: format!("sealpost-{}", std::process::id()),
            client_properties: Vec::new(),
            sasl_password_file: None,
        }
    }

    /// The defaults with the environment applied ([`KafkaConfig::apply_env`]), checked.
    pub fn from_env() -> Result<KafkaConfig, KafkaAdapterError> {
        let mut c = KafkaConfig::default();
        c.apply_env()?;
        c.validate()?;
        Ok(c)
    }

    /// Applies the `KAFKA_*` variables that are set (`KAFKA_BROKERS`, `KAFKA_CLUSTER`,
    /// `KAFKA_CLIENT_PROPERTIES`, `KAFKA_SASL_PASSWORD_FILE`) over what the configuration
    /// says. Malformed properties are named by position, never quoted.
    pub fn apply_env(&mut self) -> Result<(), KafkaAdapterError> {
        let var = |name: &str| std::env::var(name).ok();
        if let Some(v) = var("KAFKA_BROKERS") {
            self.brokers = v;
        }
        if let Some(v) = var("KAFKA_CLUSTER") {
            self.cluster = v;
        }
        if let Some(v) = var("KAFKA_CLIENT_PROPERTIES") {
            self.client_properties =
                parse_properties(&v).map_err(|detail| KafkaAdapterError::Setting {
                    option: "KAFKA_CLIENT_PROPERTIES",
                    detail,
                })?;
        }
        if let Some(v) = var("KAFKA_SASL_PASSWORD_FILE") {
            self.sasl_password_file = (!v.is_empty()).then(|| PathBuf::from(v));
        }
        Ok(())
    }

    /// Range checks; the error names the key.
    pub fn validate(&self) -> Result<(), KafkaAdapterError> {
        let bad = |option: &'static str, detail: &str| {
            Err(KafkaAdapterError::Setting {
                option,
                detail: detail.to_string(),
            })
        };
        if self.partitions == 0 || self.partitions > 10_000 {
            return bad("partitions", "must be 1..=10000");
        }
        if self.lookup_scan_max == 0 {
            return bad("lookup_scan_max", "must be at least 1");
        }
        if self.lookup_group_max == 0 {
            return bad("lookup_group_max", "must be at least 1");
        }
        if self.brokers.trim().is_empty() {
            return bad("brokers", "is empty; give host:port[,host:port]");
        }
        Ok(())
    }
}

/// A producer connected to one Kafka cluster. Clones share the producer. A producer that
/// librdkafka declares failed for good (a fatal error, e.g. the idempotent producer fenced)
/// is replaced before the next batch; its records in flight were answered as no answer.
#[derive(Clone)]
pub struct Kafka {
    cfg: KafkaConfig,
    /// `cfg.client_properties` with the secrets read from their files.
    props: std::sync::Arc<[(String, String)]>,
    producer: std::sync::Arc<std::sync::RwLock<LinkProducer>>,
    /// Consumers of finished lookup scans, reused by the next ones.
    lookup_pool: std::sync::Arc<std::sync::Mutex<Vec<BaseConsumer>>>,
}

/// Lookup consumers kept for reuse.
const LOOKUP_POOL_MAX: usize = 8;

fn new_producer(
    cfg: &KafkaConfig,
    props: &[(String, String)],
    context: LinkContext,
) -> Result<LinkProducer, KafkaError> {
    let timeout_ms = cfg.ack_timeout.as_millis().max(1_000).to_string();
    let mut c = client_config(cfg);
    c.set("acks", "all")
        .set("enable.idempotence", "true")
        .set("message.timeout.ms", &timeout_ms)
        .set("request.timeout.ms", &timeout_ms)
        .set("linger.ms", "2")
        .set("queue.buffering.max.messages", "1000000");
    LinkProducer::from_config_and_context(&with_properties(c, props), context).map_err(scrub)
}

fn client_config(cfg: &KafkaConfig) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &cfg.brokers)
        .set("client.id", &cfg.client_id)
        .set("broker.address.family", "v4");
    c
}

/// Applies the user's properties last (they win over the adapter's).
fn with_properties(mut c: ClientConfig, props: &[(String, String)]) -> ClientConfig {
    for (k, v) in props {
        c.set(k, v);
    }
    c
}

/// `text` with the value of every secret client property (`sasl.password`, ...,
/// [`sealpost_core::secret::is_secret_key`]) replaced.
fn scrub_secrets(text: &str, properties: &[(String, String)]) -> String {
    let secrets: Vec<&str> = properties
        .iter()
        .filter(|(k, _)| sealpost_core::secret::is_secret_key(k))
        .map(|(_, v)| v.as_str())
        .collect();
    sealpost_core::secret::scrub(text, &secrets)
}

/// Parses `key=value[,key=value]` (the `KAFKA_CLIENT_PROPERTIES` form). An error names the
/// entry by its position and never quotes it: it could be part of a password.
pub fn parse_properties(s: &str) -> Result<Vec<(String, String)>, String> {
    s.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .enumerate()
        .map(|(i, p)| {
            p.split_once('=')
                .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
                .filter(|(k, _)| !k.is_empty())
                .ok_or_else(|| {
                    format!(
                        "entry {} is not key=value (entries are comma-separated, so a value cannot hold a comma)",
                        i + 1
                    )
                })
        })
        .collect()
}

fn topology(what: impl Into<String>) -> impl FnOnce(KafkaError) -> KafkaAdapterError {
    let what = what.into();
    move |e| KafkaAdapterError::Topology {
        what,
        detail: e.to_string(),
    }
}

impl Kafka {
    /// Creates the producer and checks that the cluster answers a metadata request.
    /// The SASL password file is read here.
    pub async fn connect(cfg: KafkaConfig) -> Result<Kafka, KafkaAdapterError> {
        let props: std::sync::Arc<[(String, String)]> =
            with_secrets(&cfg.client_properties, cfg.sasl_password_file.as_deref())?.into();
        let context = LinkContext::default();
        let connect = |source: KafkaError, last: Option<String>| KafkaAdapterError::Connect {
            brokers: sealpost_core::secret::redact_url(&cfg.brokers),
            cause: scrub_secrets(&source.to_string(), &props),
            source: Box::new(source),
            last: last
                .map(|l| format!("; last error: {}", scrub_secrets(&l, &props)))
                .unwrap_or_default(),
        };
        let producer = new_producer(&cfg, &props, context.clone()).map_err(|e| connect(e, None))?;
        let p = producer.clone();
        tokio::task::spawn_blocking(move || {
            p.client().fetch_metadata(None, Duration::from_secs(10))
        })
        .await
        .map_err(|e| KafkaAdapterError::Topology {
            what: "checking the connection".into(),
            detail: e.to_string(),
        })?
        .map_err(|e| connect(e, context.last_error()))?;
        Ok(Kafka {
            cfg,
            props,
            producer: std::sync::Arc::new(std::sync::RwLock::new(producer)),
            lookup_pool: Default::default(),
        })
    }

    /// The current producer, replaced first if librdkafka declared it failed for good.
    fn producer(&self) -> LinkProducer {
        let current = self
            .producer
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let Some((code, why)) = current.client().fatal_error() else {
            return current;
        };
        let mut slot = self.producer.write().unwrap_or_else(|p| p.into_inner());
        if slot.client().fatal_error().is_none() {
            return slot.clone(); // another batch replaced it already
        }
        match new_producer(&self.cfg, &self.props, LinkContext::default()) {
            Ok(p) => {
                tracing::warn!(%code, %why, "Kafka producer failed for good; replaced with a new one");
                *slot = p.clone();
                p
            }
            Err(e) => {
                tracing::warn!(error = %e, "Kafka producer failed for good and cannot be replaced yet");
                current
            }
        }
    }

    /// The adapter's settings.
    pub fn config(&self) -> &KafkaConfig {
        &self.cfg
    }

    /// Creates `topic` with `partitions` partitions if it does not exist; returns the
    /// partition count it has (freeze this into the route: `kafka-murmur2/<n>`).
    pub async fn ensure_topic(
        &self,
        topic: &str,
        partitions: u32,
    ) -> Result<u32, KafkaAdapterError> {
        if let Some(n) = self.partition_count(topic).await? {
            return Ok(n);
        }
        let admin: AdminClient<DefaultClientContext> =
            create_client(&with_properties(client_config(&self.cfg), &self.props))
                .map_err(topology("creating an admin client"))?;
        let t = NewTopic::new(topic, partitions as i32, TopicReplication::Fixed(1));
        let r = admin
            .create_topics(
                [&t],
                &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
            )
            .await
            .map_err(topology(format!("creating topic `{topic}`")))?;
        for x in r {
            if let Err((name, code)) = x {
                if code != RDKafkaErrorCode::TopicAlreadyExists {
                    return Err(KafkaAdapterError::Topology {
                        what: format!("creating topic `{name}`"),
                        detail: code.to_string(),
                    });
                }
            }
        }
        // Metadata reaches every broker shortly after the creation is acknowledged.
        for _ in 0..50 {
            if let Some(n) = self.partition_count(topic).await? {
                return Ok(n);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(KafkaAdapterError::Topology {
            what: format!("creating topic `{topic}`"),
            detail: "created, but not in the cluster's metadata after 5 s".into(),
        })
    }

    /// Deletes `topic` (tests, demos).
    pub async fn delete_topic(&self, topic: &str) -> Result<(), KafkaAdapterError> {
        let admin: AdminClient<DefaultClientContext> =
            create_client(&with_properties(client_config(&self.cfg), &self.props))
                .map_err(topology("creating an admin client"))?;
        admin
            .delete_topics(&[topic], &AdminOptions::new())
            .await
            .map_err(topology(format!("deleting topic `{topic}`")))?;
        Ok(())
    }

    /// The number of partitions of `topic`, `None` if the cluster does not know it.
    pub async fn partition_count(&self, topic: &str) -> Result<Option<u32>, KafkaAdapterError> {
        let p = self.producer();
        let t = topic.to_string();
        let md = tokio::task::spawn_blocking(move || {
            p.client().fetch_metadata(Some(&t), Duration::from_secs(10))
        })
        .await
        .map_err(|e| KafkaAdapterError::Topology {
            what: format!("describing topic `{topic}`"),
            detail: e.to_string(),
        })?
        .map_err(topology(format!("describing topic `{topic}`")))?;
        Ok(md
            .topics()
            .iter()
            .find(|m| m.name() == topic && m.error().is_none() && !m.partitions().is_empty())
            .map(|m| m.partitions().len() as u32))
    }

    fn receipt(&self, r: &SendRequest, partition: i32, offset: i64) -> Receipt {
        Receipt {
            event_id: r.event_id,
            member: r.member,
            envelope_generation: r.envelope_generation,
            attempt_id: r.attempt_id,
            payload_digest: r.payload_digest,
            destination_digest: r.destination_digest,
            cluster: self.cfg.cluster.clone(),
            stream: r.destination.topic.clone(),
            partition: Some(partition as u32),
            sequence: offset as u64 + 1,
            broker_duplicate: false,
            source: ReceiptSource::Ack,
        }
    }

    /// A consumer for a lookup scan: one from the pool, or a new one (a connection and a
    /// metadata round trip saved per scan when the pool has one).
    fn lookup_consumer(&self) -> Result<BaseConsumer, KafkaError> {
        if let Some(c) = self
            .lookup_pool
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
        {
            return Ok(c);
        }
        let mut c = client_config(&self.cfg);
        c.set("group.id", "sealpost-lookup")
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest");
        create_client(&with_properties(c, &self.props))
    }

    /// Gives a scan's consumer back to the pool (unassigned), unless the pool is full.
    fn return_consumer(&self, consumer: BaseConsumer) {
        if consumer.unassign().is_err() {
            return;
        }
        let mut pool = self.lookup_pool.lock().unwrap_or_else(|p| p.into_inner());
        if pool.len() < LOOKUP_POOL_MAX {
            pool.push(consumer);
        }
    }

    /// A scan's blocking part: one read of the frozen partition answers every event of
    /// `events` (grouped by the core, `reconcile::shares_scan`). It starts at the earliest
    /// event's mint time minus `lookup_clock_margin_ms` (the partition's start for an id
    /// without a mint time), fixes the end at the high watermark it reads first, and reads
    /// to it, at most `lookup_scan_max` records or 60 s; the answers are the core's
    /// (`reconcile::decide_scanned`: absent only if the scan read its whole range).
    fn scan_blocking(&self, topic: &str, partition: i32, events: &[(EventId, u16)]) -> Vec<Lookup> {
        let all = |l: Lookup| vec![l; events.len()];
        let consumer = match self.lookup_consumer() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "Kafka lookup: cannot create a consumer");
                return all(Lookup::Unavailable);
            }
        };
        let out = self.scan_with(&consumer, topic, partition, events);
        self.return_consumer(consumer);
        out
    }

    fn scan_with(
        &self,
        consumer: &BaseConsumer,
        topic: &str,
        partition: i32,
        events: &[(EventId, u16)],
    ) -> Vec<Lookup> {
        let all = |l: Lookup| vec![l; events.len()];
        let timeout = Duration::from_secs(10);
        let (low, high) = match consumer.fetch_watermarks(topic, partition, timeout) {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!(error = %e, topic, partition, "Kafka lookup: no watermarks");
                return all(Lookup::Unavailable);
            }
        };
        if high <= low {
            // Nothing retained. Absent only if nothing was ever deleted.
            return all(if low == 0 {
                Lookup::Absent
            } else {
                Lookup::Unqueryable
            });
        }
        // The scan's start: the earliest mint time minus the clock margin (UUIDv7), else the
        // partition's start.
        let minted: Option<Vec<u64>> = events.iter().map(|(e, _)| e.minted_unix_ms()).collect();
        let from_ms = minted
            .and_then(|m| m.into_iter().min())
            .map(|t| t.saturating_sub(self.cfg.lookup_clock_margin_ms));
        let start = match from_ms {
            None => low,
            Some(t) => {
                let mut tpl = TopicPartitionList::new();
                if tpl
                    .add_partition_offset(topic, partition, Offset::Offset(t as i64))
                    .is_err()
                {
                    return all(Lookup::Unavailable);
                }
                match consumer.offsets_for_times(tpl, timeout) {
                    Ok(found) => match found.find_partition(topic, partition).map(|e| e.offset()) {
                        Some(Offset::Offset(o)) => o.max(low),
                        // No record at or after that time.
                        Some(Offset::End) => return all(Lookup::Absent),
                        _ => return all(Lookup::Unavailable),
                    },
                    Err(e) => {
                        tracing::warn!(error = %e, topic, partition, "Kafka lookup: ListOffsets failed");
                        return all(Lookup::Unavailable);
                    }
                }
            }
        };
        if start >= high {
            return all(Lookup::Absent);
        }
        let mut tpl = TopicPartitionList::new();
        if tpl
            .add_partition_offset(topic, partition, Offset::Offset(start))
            .is_err()
            || consumer.assign(&tpl).is_err()
        {
            return all(Lookup::Unavailable);
        }
        let wanted: std::collections::HashMap<(String, String), (EventId, u16)> = events
            .iter()
            .map(|&(e, m)| ((e.to_string(), m.to_string()), (e, m)))
            .collect();
        // Every copy of each event in the range, oldest first: a look-alike published before
        // the genuine copy must not hide it (the reader judges them all).
        let mut found: std::collections::HashMap<(EventId, u16), Vec<FoundCopy>> =
            Default::default();
        // Our id without our headers: not proof of our send.
        let mut unusable: std::collections::HashSet<(EventId, u16)> = Default::default();
        let began = Instant::now();
        let mut read: u64 = 0;
        let mut first = true;
        let mut reach = ScanReach {
            finished: false,
            start_deleted: false,
        };
        loop {
            // No early stop once every event was seen: a later copy may be the sealed one.
            if read >= self.cfg.lookup_scan_max {
                tracing::warn!(topic, partition, read, events = events.len(), "Kafka lookup: scan bound reached; nothing learned about the events not seen (raise lookup_scan_max, or resolve by hand)");
                break;
            }
            if began.elapsed() > Duration::from_secs(60) {
                tracing::warn!(
                    topic,
                    partition,
                    read,
                    "Kafka lookup: scan took over 60 s; nothing learned about the events not seen"
                );
                break;
            }
            let m = match consumer.poll(Duration::from_millis(500)) {
                None => continue,
                Some(Err(e)) => {
                    tracing::warn!(error = %e, topic, partition, "Kafka lookup: fetch failed");
                    break;
                }
                Some(Ok(m)) => m,
            };
            read += 1;
            if first {
                first = false;
                // Retention deleted records the scan needed: the first retained one is
                // already newer than the scan's start.
                if low > 0 && m.offset() == low {
                    let ts = m.timestamp().to_millis().unwrap_or(i64::MAX);
                    if from_ms.is_none_or(|t| ts > t as i64) {
                        reach.start_deleted = true;
                    }
                }
            }
            let get = |name: &str| header_str(&m, name);
            if let (Some(id), Some(member)) = (get(H_EVENT_ID), get(H_MEMBER)) {
                if let Some(&(event_id, member)) = wanted.get(&(id.to_string(), member.to_string()))
                {
                    let parsed = (|| {
                        Some(Receipt {
                            event_id,
                            member,
                            envelope_generation: get(H_ENVELOPE_GENERATION)?.parse().ok()?,
                            attempt_id: get(H_ATTEMPT_ID)?.parse().ok()?,
                            // The digest of the bytes stored, not the header's claim.
                            payload_digest: payload_digest(m.payload().unwrap_or_default()),
                            destination_digest: Digest::from_hex(get(H_DESTINATION_DIGEST)?)?,
                            cluster: self.cfg.cluster.clone(),
                            stream: topic.to_string(),
                            partition: Some(partition as u32),
                            sequence: m.offset() as u64 + 1,
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
                                    WireEnvelope::from_headers(|n| header_str(&m, n)),
                                    get(H_SIGNATURE).map(str::to_string),
                                ));
                            }
                        }
                        None => {
                            unusable.insert((event_id, member));
                        }
                    }
                }
            }
            if m.offset() + 1 >= high {
                reach.finished = true;
                break;
            }
        }
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
}

/// The text of header `name` of a record, if present and UTF-8.
pub fn header_str<'a, M: Message>(m: &'a M, name: &str) -> Option<&'a str> {
    m.headers()?
        .iter()
        .find(|h| h.key == name)
        .and_then(|h| h.value)
        .and_then(|v| std::str::from_utf8(v).ok())
}

/// The message id Sealpost gives a member's copy (the event id for member 0).
fn header_pairs(r: &SendRequest) -> OwnedHeaders {
    let fixed = [
        (H_EVENT_ID, r.event_id.to_string()),
        (H_MEMBER, r.member.to_string()),
        (H_ENVELOPE_GENERATION, r.envelope_generation.to_string()),
        (H_ATTEMPT_ID, r.attempt_id.to_string()),
        (H_PAYLOAD_DIGEST, r.payload_digest.to_prefixed_hex()),
        (H_DESTINATION_DIGEST, r.destination_digest.to_prefixed_hex()),
    ];
    let mut h = OwnedHeaders::new();
    for (key, value) in fixed.iter().chain(r.envelope.headers().iter()) {
        h = h.insert(Header {
            key,
            value: Some(value.as_str()),
        });
    }
    if let Some(sig) = &r.signature {
        h = h.insert(Header {
            key: H_SIGNATURE,
            value: Some(sig.as_str()),
        });
    }
    h
}

/// Maps a failed delivery (or a refused enqueue: `left` false) to the port's answer.
fn failure(e: &KafkaError, left: bool) -> SendResult {
    let code = e.rdkafka_error_code();
    use RDKafkaErrorCode as C;
    match code {
        Some(C::MessageSizeTooLarge | C::InvalidMessageSize | C::MessageBatchTooLarge) => {
            SendResult::Refused {
                kind: RefusalKind::PayloadTooLarge,
                detail: format!("Kafka: {e} (raise the topic's max.message.bytes or shrink the payload, then release the event)"),
            }
        }
        Some(C::TopicAuthorizationFailed | C::ClusterAuthorizationFailed) => SendResult::Refused {
            kind: RefusalKind::NotPermitted,
            detail: format!("Kafka: {e} (grant WRITE on the topic; the event is sent once it is granted)"),
        },
        Some(C::UnknownTopicOrPartition | C::UnknownTopic | C::UnknownPartition) => {
            SendResult::NeverSent(NeverSentReason::NoSuchDestination(format!(
                "Kafka: {e} (create the topic with at least the frozen partition count)"
            )))
        }
        Some(C::InvalidRecord) => SendResult::Refused {
            kind: RefusalKind::Rejected,
            detail: format!("Kafka: {e}"),
        },
        _ if !left => SendResult::NeverSent(NeverSentReason::NotConnected(format!("Kafka: {e}"))),
        _ => SendResult::NoAnswer,
    }
}

impl Broker for Kafka {
    fn cluster(&self) -> &str {
        &self.cfg.cluster
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            lookup_by_event_id: true,
            duplicate_window_ms: None,
            create_if_absent: false,
            per_key_ordering: true,
            handover_margin_ms: DEADLINE_MARGIN.as_millis() as u64,
            lookup_scan: Some(LookupScan {
                events_max: self.cfg.lookup_group_max,
                window_ms: self.cfg.lookup_group_window_ms,
            }),
        }
    }

    async fn send_batch(&self, mut batch: Vec<SendRequest>, deadline: Instant) -> Vec<SendResult> {
        let mut out: Vec<Option<SendResult>> = vec![None; batch.len()];
        let caps = self.capabilities();
        let producer = self.producer();
        let mut waiting = Vec::with_capacity(batch.len());
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64);
        for (i, r) in batch.iter_mut().enumerate() {
            if r.destination.cluster != self.cfg.cluster {
                out[i] = Some(SendResult::NeverSent(NeverSentReason::WrongCluster(
                    r.destination.cluster.clone(),
                )));
                continue;
            }
            let partition = match (r.destination.partition_algorithm, r.destination.partition()) {
                (PartitionAlgorithm::KafkaMurmur2 { .. }, Some(p)) => p as i32,
                (alg, _) => {
                    out[i] = Some(SendResult::Refused {
                        kind: RefusalKind::Rejected,
                        detail: format!(
                            "destination frozen with partition algorithm `{}`: a Kafka route needs `kafka-murmur2/<n>` (set the route's partitions, then migrate the event to the new route generation)",
                            alg.name()
                        ),
                    });
                    continue;
                }
            };
            if !may_leave(deadline.saturating_duration_since(Instant::now()), &caps) {
                out[i] = Some(SendResult::NeverSent(NeverSentReason::DeadlinePassed));
                continue;
            }
            // Encoded alone: a message that cannot be carried is refused by itself, and the
            // rest of the batch still leaves.
            let headers = match encode_request(r, |r| Ok(header_pairs(r))) {
                Ok(h) => h,
                Err(refused) => {
                    out[i] = Some(refused.into());
                    continue;
                }
            };
            let record = FutureRecord::to(&r.destination.topic)
                .partition(partition)
                .key(r.destination.routing_key.as_bytes())
                .payload(&r.payload)
                .timestamp(now_ms)
                .headers(headers);
            match producer.send_result(record) {
                Ok(f) => waiting.push((i, f)),
                Err((e, _)) => out[i] = Some(failure(&e, false)),
            }
        }
        let wait = self.cfg.ack_timeout + DEADLINE_MARGIN;
        let reports = futures::future::join_all(
            waiting
                .into_iter()
                .map(|(i, f)| async move { (i, tokio::time::timeout(wait, f).await) }),
        )
        .await;
        for (i, rep) in reports {
            let r = &batch[i];
            out[i] = Some(match rep {
                Ok(Ok(Ok(d))) => SendResult::Receipt(self.receipt(r, d.partition, d.offset)),
                Ok(Ok(Err((e, _)))) => {
                    tracing::debug!(event_id = %r.event_id, error = %e, "Kafka delivery failed");
                    failure(&e, true)
                }
                Ok(Err(_)) | Err(_) => SendResult::NoAnswer,
            });
        }
        out.into_iter()
            .map(|o| o.unwrap_or(SendResult::NoAnswer))
            .collect()
    }

    async fn lookup(&self, destination: &Destination, event_id: EventId, member: u16) -> Lookup {
        self.lookup_many(destination, &[(event_id, member)])
            .await
            .pop()
            .unwrap_or(Lookup::Unavailable)
    }

    /// One scan of the frozen partition for every event of the group.
    async fn lookup_many(
        &self,
        destination: &Destination,
        events: &[(EventId, u16)],
    ) -> Vec<Lookup> {
        if destination.cluster != self.cfg.cluster {
            return vec![Lookup::Unavailable; events.len()];
        }
        let Some(partition) = destination.partition() else {
            return vec![Lookup::Unqueryable; events.len()];
        };
        let me = self.clone();
        let topic = destination.topic.clone();
        let owned = events.to_vec();
        let n = events.len();
        tokio::task::spawn_blocking(move || me.scan_blocking(&topic, partition as i32, &owned))
            .await
            .unwrap_or_else(|_| vec![Lookup::Unavailable; n])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_v7_event_id_carries_its_mint_time() {
        let id = EventId::mint(1_764_000_000_123, [7; 10]);
        assert_eq!(id.minted_unix_ms(), Some(1_764_000_000_123));
        let mut v4 = id;
        v4.0[6] = 0x40 | (v4.0[6] & 0x0f);
        assert_eq!(v4.minted_unix_ms(), None);
    }

    #[test]
    fn properties_errors_and_debug_never_show_a_secret() {
        // A password holding a comma leaves a piece without `=`: named by position only.
        let e = parse_properties("sasl.username=app,sasl.password=hun,ter2").unwrap_err();
        assert!(e.contains("entry 3") && !e.contains("ter2"), "{e}");
        let mut cfg = KafkaConfig::new("127.0.0.1:9092", "k", Duration::from_secs(5));
        cfg.client_properties =
            parse_properties("sasl.username=app,sasl.password=hunter2,ssl.key.password=k3y")
                .unwrap();
        let debug = format!("{cfg:?}");
        assert!(
            !debug.contains("hunter2") && !debug.contains("k3y"),
            "{debug}"
        );
        assert!(debug.contains("\"sasl.username\", \"app\""), "{debug}");
        assert_eq!(
            scrub_secrets(
                "Invalid value \"hunter2\" for \"sasl.password\"",
                &cfg.client_properties
            ),
            "Invalid value \"***\" for \"sasl.password\""
        );
    }
}
