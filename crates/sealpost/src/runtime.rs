//! The dispatcher and reconciler loops: claim in one short transaction, send with no
//! transaction open, accept receipts (or report outcomes) in one more. The loops are generic
//! over the broker port ([`Broker`]); they never see a broker's wire format. The
//! configuration is a plain struct: the `sealpost` command loads it from a TOML file, and
//! [`Config::apply_env`] applies `DATABASE_URL` / `NATS_URL`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};
use sealpost_core::dispatcher::{DispatchAction, DispatcherConfig, DispatcherMachine, Submission};
use sealpost_core::port::{Broker, SendResult};
use sealpost_core::reconcile::{Lookup, ReconcilePolicy};
use sealpost_core::reconciler::{
    ReconcileAction, ReconcileItem, ReconcilerConfig, ReconcilerMachine, VerifyItem,
};
use sealpost_core::ReceiptVerdict;

use std::fmt;

use crate::observe;
use crate::secret;
use crate::store::{self, Accepted, StoreError, Submitted};

/// Runtime configuration. Every field has a default; `DATABASE_URL` and `NATS_URL` override
/// the file ([`Config::apply_env`]). Its `Debug` shows the URLs redacted
/// ([`crate::secret`]), never a password or token.
#[derive(Clone, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// PostgreSQL connection string.
    pub database_url: String,
    /// File holding the password of `database_url` (`DATABASE_PASSWORD_FILE`): read by
    /// [`Config::apply_secret_files`] and appended to `database_url` as its `password`, so the
    /// password need not be in the connection string, the file or the environment. One
    /// trailing newline is ignored. It applies to `database_url` only, not to
    /// `outbox_database_url`.
    pub database_password_file: String,
    /// NATS URL.
    pub nats_url: String,
    /// Cluster identity of the NATS connection (frozen into destinations).
    pub nats_cluster: String,
    /// PEM file of the CA that signs the NATS servers' certificates (empty: the system's
    /// roots).
    pub nats_tls_ca_file: String,
    /// PEM client certificate for NATS servers that verify clients (with `nats_tls_key_file`).
    pub nats_tls_cert_file: String,
    /// PEM private key of `nats_tls_cert_file`.
    pub nats_tls_key_file: String,
    /// Refuse a NATS server that does not do TLS (never plaintext).
    pub nats_require_tls: bool,
    /// NATS `.creds` file (user JWT and nkey seed).
    pub nats_creds_file: String,
    /// File holding a NATS nkey user seed.
    pub nats_nkey_seed_file: String,
    /// NATS user (with `nats_password_file`).
    pub nats_user: String,
    /// File holding the password of `nats_user`.
    pub nats_password_file: String,
    /// File holding a NATS authentication token.
    pub nats_token_file: String,
    /// Claim lease, milliseconds of the database clock.
    pub lease_ms: u64,
    /// Rows claimed per dispatcher transaction.
    pub batch_size_max: usize,
    /// Publish acknowledgement timeout.
    pub ack_timeout_ms: u64,
    /// Sleep when a scan found nothing.
    pub idle_poll_ms: u64,
    /// Refusals before a row is quarantined as poison.
    pub rejection_limit: u32,
    /// Rows the reconciler takes per scan.
    pub reconcile_batch_max: usize,
    /// Reconciler scan interval when nothing is due.
    pub reconcile_every_ms: u64,
    /// Broker lookups the reconciler runs at once.
    pub lookups_in_flight_max: usize,
    /// How often the reconciler checks the unknown age (busy or not).
    pub unknown_check_every_ms: u64,
    /// How often a batch of published rows is re-checked at the broker (R31; 0: never).
    pub verify_every_ms: u64,
    /// Published rows per verification batch.
    pub verify_batch_max: usize,
    /// Unknown rows older than this are logged as alerts by the reconciler and make
    /// `sealpost status --check` exit non-zero (G3 asks for p99 within 15 minutes).
    pub unknown_alert_s: u64,
    /// Failure drills only: sleep this long between a publish and its receipt transaction
    /// (0 in production), so a drill can kill the process in that window.
    pub drill_pause_after_publish_ms: u64,
    /// How long the broker waits for a consumer's ack before redelivering.
    pub consumer_ack_wait_ms: u64,
    /// Failure drills only: the consumer commits but never acks (F9).
    pub drill_skip_consumer_ack: bool,
    /// Deliveries of one message whose effect fails before the consumer dead-letters it
    /// (records it in `sealpost.inbox_quarantine` and tells the broker to stop).
    pub consumer_max_deliveries: u32,
    /// Time limit of one try of the consumer's effect (and its statements); past it the try
    /// is rolled back and the message retried.
    pub consumer_effect_timeout_ms: u64,
    /// How often a consumer reports its contiguous watermark to the outbox database.
    pub consumer_progress_every_ms: u64,
    /// The outbox database a consumer reports its watermark to (empty: `database_url`, the
    /// demo layout where inbox and outbox share one database).
    pub outbox_database_url: String,
    /// Consumers that must have passed an event before `sealpost purge` removes it (the
    /// `--consumer` flags add to these).
    pub required_consumers: Vec<String>,
    /// The broker the `sealpost` command's dispatch, consume, demo and reconcile use:
    /// `nats`, `rabbitmq` or `kafka` (the `--broker` flag overrides it).
    pub broker: String,
    /// RabbitMQ AMQP URL (`RABBITMQ_URL` overrides it).
    pub rabbitmq_url: String,
    /// Cluster identity of the RabbitMQ connection (frozen into destinations).
    pub rabbitmq_cluster: String,
    /// PEM file of the CA that signs the RabbitMQ broker's certificate; required by an
    /// `amqps://` URL, and the only CA trusted.
    pub rabbitmq_tls_ca_file: String,
    /// PEM client certificate for a broker that verifies its peers (with
    /// `rabbitmq_tls_key_file`).
    pub rabbitmq_tls_cert_file: String,
    /// PEM private key of `rabbitmq_tls_cert_file`.
    pub rabbitmq_tls_key_file: String,
    /// File holding the password of the `rabbitmq_url`'s user (the URL then has none).
    pub rabbitmq_password_file: String,
    /// Kafka bootstrap servers, `host:port[,host:port]` (`KAFKA_BROKERS` overrides it).
    pub kafka_brokers: String,
    /// Cluster identity of the Kafka connection (frozen into destinations).
    pub kafka_cluster: String,
    /// Partitions of a Kafka topic Sealpost creates (the demo's); an existing topic keeps its
    /// own count, and a route freezes the count the topic has.
    pub kafka_partitions: u32,
    /// How far before an event's mint time a Kafka lookup starts its scan (producer clock
    /// skew).
    pub kafka_lookup_clock_margin_ms: u64,
    /// Records one Kafka lookup reads at most before answering "nothing learned".
    pub kafka_lookup_scan_max: u64,
    /// librdkafka properties for every Kafka client, `key=value[,key=value]`
    /// (`KAFKA_CLIENT_PROPERTIES` overrides it).
    pub kafka_client_properties: String,
    /// File holding the SASL password (librdkafka's `sasl.password`), read at connect.
    pub kafka_sasl_password_file: String,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            database_url: "host=127.0.0.1 user=postgres dbname=test".to_string(),
            database_password_file: String::new(),
            nats_url: "nats://127.0.0.1:4222".to_string(),
            nats_cluster: "nats-local".to_string(),
            nats_tls_ca_file: String::new(),
            nats_tls_cert_file: String::new(),
            nats_tls_key_file: String::new(),
            nats_require_tls: false,
            nats_creds_file: String::new(),
            nats_nkey_seed_file: String::new(),
            nats_user: String::new(),
            nats_password_file: String::new(),
            nats_token_file: String::new(),
            lease_ms: 10_000,
            batch_size_max: 1000,
            ack_timeout_ms: 5_000,
            idle_poll_ms: 50,
            rejection_limit: 5,
            reconcile_batch_max: 200,
            reconcile_every_ms: 1_000,
            lookups_in_flight_max: 32,
            unknown_check_every_ms: 10_000,
            verify_every_ms: 5_000,
            verify_batch_max: 100,
            unknown_alert_s: 900,
            drill_pause_after_publish_ms: 0,
            consumer_ack_wait_ms: 10_000,
            drill_skip_consumer_ack: false,
            consumer_max_deliveries: 10,
            consumer_effect_timeout_ms: 5_000,
            consumer_progress_every_ms: 1_000,
            outbox_database_url: String::new(),
            required_consumers: Vec::new(),
            broker: "nats".to_string(),
            rabbitmq_url: "amqp://guest:guest@127.0.0.1:5672/%2f".to_string(),
            rabbitmq_cluster: "rabbitmq-local".to_string(),
            rabbitmq_tls_ca_file: String::new(),
            rabbitmq_tls_cert_file: String::new(),
            rabbitmq_tls_key_file: String::new(),
            rabbitmq_password_file: String::new(),
            kafka_brokers: "127.0.0.1:9092".to_string(),
            kafka_cluster: "kafka-local".to_string(),
            kafka_partitions: 6,
            kafka_lookup_clock_margin_ms: 60_000,
            kafka_lookup_scan_max: 1_000_000,
            kafka_client_properties: String::new(),
            kafka_sasl_password_file: String::new(),
        }
    }
}

impl fmt::Debug for Config {
    /// Every field, the connection strings, URLs and Kafka properties redacted
    /// ([`crate::secret`]). The destructuring names every field, so a new one cannot be
    /// forgotten here.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Config {
            database_url,
            database_password_file,
            nats_url,
            nats_cluster,
            nats_tls_ca_file,
            nats_tls_cert_file,
            nats_tls_key_file,
            nats_require_tls,
            nats_creds_file,
            nats_nkey_seed_file,
            nats_user,
            nats_password_file,
            nats_token_file,
            lease_ms,
            batch_size_max,
            ack_timeout_ms,
            idle_poll_ms,
            rejection_limit,
            reconcile_batch_max,
            reconcile_every_ms,
            lookups_in_flight_max,
            unknown_check_every_ms,
            verify_every_ms,
            verify_batch_max,
            unknown_alert_s,
            drill_pause_after_publish_ms,
            consumer_ack_wait_ms,
            drill_skip_consumer_ack,
            consumer_max_deliveries,
            consumer_effect_timeout_ms,
            consumer_progress_every_ms,
            outbox_database_url,
            required_consumers,
            broker,
            rabbitmq_url,
            rabbitmq_cluster,
            rabbitmq_tls_ca_file,
            rabbitmq_tls_cert_file,
            rabbitmq_tls_key_file,
            rabbitmq_password_file,
            kafka_brokers,
            kafka_cluster,
            kafka_partitions,
            kafka_lookup_clock_margin_ms,
            kafka_lookup_scan_max,
            kafka_client_properties,
            kafka_sasl_password_file,
        } = self;
        f.debug_struct("Config")
            .field("database_url", &secret::redact_dsn(database_url))
            .field("database_password_file", database_password_file)
            .field("nats_url", &secret::redact_url(nats_url))
            .field("nats_cluster", nats_cluster)
            .field("nats_tls_ca_file", nats_tls_ca_file)
            .field("nats_tls_cert_file", nats_tls_cert_file)
            .field("nats_tls_key_file", nats_tls_key_file)
            .field("nats_require_tls", nats_require_tls)
            .field("nats_creds_file", nats_creds_file)
            .field("nats_nkey_seed_file", nats_nkey_seed_file)
            .field("nats_user", nats_user)
            .field("nats_password_file", nats_password_file)
            .field("nats_token_file", nats_token_file)
            .field("lease_ms", lease_ms)
            .field("batch_size_max", batch_size_max)
            .field("ack_timeout_ms", ack_timeout_ms)
            .field("idle_poll_ms", idle_poll_ms)
            .field("rejection_limit", rejection_limit)
            .field("reconcile_batch_max", reconcile_batch_max)
            .field("reconcile_every_ms", reconcile_every_ms)
            .field("lookups_in_flight_max", lookups_in_flight_max)
            .field("unknown_check_every_ms", unknown_check_every_ms)
            .field("verify_every_ms", verify_every_ms)
            .field("verify_batch_max", verify_batch_max)
            .field("unknown_alert_s", unknown_alert_s)
            .field("drill_pause_after_publish_ms", drill_pause_after_publish_ms)
            .field("consumer_ack_wait_ms", consumer_ack_wait_ms)
            .field("drill_skip_consumer_ack", drill_skip_consumer_ack)
            .field("consumer_max_deliveries", consumer_max_deliveries)
            .field("consumer_effect_timeout_ms", consumer_effect_timeout_ms)
            .field("consumer_progress_every_ms", consumer_progress_every_ms)
            .field(
                "outbox_database_url",
                &secret::redact_dsn(outbox_database_url),
            )
            .field("required_consumers", required_consumers)
            .field("broker", broker)
            .field("rabbitmq_url", &secret::redact_url(rabbitmq_url))
            .field("rabbitmq_cluster", rabbitmq_cluster)
            .field("rabbitmq_tls_ca_file", rabbitmq_tls_ca_file)
            .field("rabbitmq_tls_cert_file", rabbitmq_tls_cert_file)
            .field("rabbitmq_tls_key_file", rabbitmq_tls_key_file)
            .field("rabbitmq_password_file", rabbitmq_password_file)
            .field("kafka_brokers", &secret::redact_url(kafka_brokers))
            .field("kafka_cluster", kafka_cluster)
            .field("kafka_partitions", kafka_partitions)
            .field("kafka_lookup_clock_margin_ms", kafka_lookup_clock_margin_ms)
            .field("kafka_lookup_scan_max", kafka_lookup_scan_max)
            .field(
                "kafka_client_properties",
                &secret::redact_properties(kafka_client_properties),
            )
            .field("kafka_sasl_password_file", kafka_sasl_password_file)
            .finish()
    }
}

/// Configuration errors name the offending key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A secret file (`database_password_file`) cannot be used; names the file, never what it
    /// holds.
    #[error(transparent)]
    SecretFile(#[from] secret::SecretFileError),
    /// A value out of range.
    #[error("config key `{key}`: {message}")]
    Invalid {
        /// Key.
        key: &'static str,
        /// What is wrong.
        message: String,
    },
}

impl Config {
    /// Applies `DATABASE_URL` and `NATS_URL` (and `NATS_TLS_CA_FILE`, `NATS_TLS_CERT_FILE`,
    /// `NATS_TLS_KEY_FILE`, `NATS_REQUIRE_TLS`, `NATS_CREDS_FILE`, `NATS_NKEY_SEED_FILE`,
    /// `NATS_USER`, `NATS_PASSWORD_FILE`, `NATS_TOKEN_FILE`, `RABBITMQ_URL`,
    /// `RABBITMQ_TLS_CA_FILE`, `RABBITMQ_TLS_CERT_FILE`, `RABBITMQ_TLS_KEY_FILE`,
    /// `RABBITMQ_PASSWORD_FILE`, `KAFKA_BROKERS`, `KAFKA_CLIENT_PROPERTIES`,
    /// `KAFKA_SASL_PASSWORD_FILE`) from the environment, when
    /// set, over whatever the configuration says.
    pub fn apply_env(&mut self) {
        if let Ok(v) = std::env::var("DATABASE_URL") {
            self.database_url = v;
        }
        if let Ok(v) = std::env::var("DATABASE_PASSWORD_FILE") {
            self.database_password_file = v;
        }
        if let Ok(v) = std::env::var("NATS_URL") {
            self.nats_url = v;
        }
        for (name, slot) in [
            ("NATS_TLS_CA_FILE", &mut self.nats_tls_ca_file),
            ("NATS_TLS_CERT_FILE", &mut self.nats_tls_cert_file),
            ("NATS_TLS_KEY_FILE", &mut self.nats_tls_key_file),
            ("NATS_CREDS_FILE", &mut self.nats_creds_file),
            ("NATS_NKEY_SEED_FILE", &mut self.nats_nkey_seed_file),
            ("NATS_USER", &mut self.nats_user),
            ("NATS_PASSWORD_FILE", &mut self.nats_password_file),
            ("NATS_TOKEN_FILE", &mut self.nats_token_file),
            ("RABBITMQ_TLS_CA_FILE", &mut self.rabbitmq_tls_ca_file),
            ("RABBITMQ_TLS_CERT_FILE", &mut self.rabbitmq_tls_cert_file),
            ("RABBITMQ_TLS_KEY_FILE", &mut self.rabbitmq_tls_key_file),
            ("RABBITMQ_PASSWORD_FILE", &mut self.rabbitmq_password_file),
            (
                "KAFKA_SASL_PASSWORD_FILE",
                &mut self.kafka_sasl_password_file,
            ),
        ] {
            if let Ok(v) = std::env::var(name) {
                *slot = v;
            }
        }
        if let Ok(v) = std::env::var("NATS_REQUIRE_TLS") {
            // Anything but an explicit "off" keeps TLS required (fails closed).
            self.nats_require_tls = !matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "" | "0" | "false" | "no" | "off"
            );
        }
        if let Ok(v) = std::env::var("RABBITMQ_URL") {
            self.rabbitmq_url = v;
        }
        if let Ok(v) = std::env::var("KAFKA_BROKERS") {
            self.kafka_brokers = v;
        }
        if let Ok(v) = std::env::var("KAFKA_CLIENT_PROPERTIES") {
            self.kafka_client_properties = v;
        }
    }

    /// The outbox database a consumer reports its progress to: `outbox_database_url`, or
    /// `database_url` when that is empty.
    pub fn outbox_url(&self) -> &str {
        if self.outbox_database_url.is_empty() {
            &self.database_url
        } else {
            &self.outbox_database_url
        }
    }

    /// Reads `database_password_file`, if set, and appends its secret to `database_url` as
    /// its `password` ([`secret::with_password`]: it wins over a password the string holds).
    /// Call it once, after the file and the environment are applied; the error names the
    /// file, never its contents.
    pub fn apply_secret_files(&mut self) -> Result<(), ConfigError> {
        if !self.database_password_file.is_empty() {
            let password = secret::read_secret_file(
                "database_password_file",
                std::path::Path::new(&self.database_password_file),
            )?;
            self.database_url = secret::with_password(&self.database_url, &password);
        }
        Ok(())
    }

    /// The defaults, then the environment ([`Config::apply_env`]), the secret files
    /// ([`Config::apply_secret_files`]), validated.
    pub fn from_env() -> Result<Config, ConfigError> {
        let mut c = Config::default();
        c.apply_env();
        c.apply_secret_files()?;
        c.validate()?;
        Ok(c)
    }

    /// Range checks.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.lease_ms < 1_000 {
            return Err(ConfigError::Invalid {
                key: "lease_ms",
                message: "must be at least 1000".into(),
            });
        }
        if self.ack_timeout_ms >= self.lease_ms {
            return Err(ConfigError::Invalid {
                key: "ack_timeout_ms",
                message: format!(
                    "must be below lease_ms ({}) so a send ends inside its lease",
                    self.lease_ms
                ),
            });
        }
        if self.batch_size_max == 0 || self.batch_size_max > 10_000 {
            return Err(ConfigError::Invalid {
                key: "batch_size_max",
                message: "must be 1..=10000".into(),
            });
        }
        if self.lookups_in_flight_max == 0 || self.lookups_in_flight_max > 1_000 {
            return Err(ConfigError::Invalid {
                key: "lookups_in_flight_max",
                message: "must be 1..=1000".into(),
            });
        }
        if self.rejection_limit == 0 {
            return Err(ConfigError::Invalid {
                key: "rejection_limit",
                message: "must be at least 1".into(),
            });
        }
        if self.consumer_max_deliveries == 0 {
            return Err(ConfigError::Invalid {
                key: "consumer_max_deliveries",
                message: "must be at least 1 (one delivery, then the dead letter)".into(),
            });
        }
        if self.kafka_partitions == 0 || self.kafka_partitions > 10_000 {
            return Err(ConfigError::Invalid {
                key: "kafka_partitions",
                message: "must be 1..=10000".into(),
            });
        }
        if self.kafka_lookup_scan_max == 0 {
            return Err(ConfigError::Invalid {
                key: "kafka_lookup_scan_max",
                message: "must be at least 1".into(),
            });
        }
        if self.consumer_effect_timeout_ms == 0 {
            return Err(ConfigError::Invalid {
                key: "consumer_effect_timeout_ms",
                message: "must be at least 1".into(),
            });
        }
        Ok(())
    }
}

/// Errors of a running loop.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The connection string's TLS settings are unusable, or the TLS handshake failed (the
    /// message names the cause and the setting to change).
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
    /// Store failure.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Broker adapter failure (connecting, managing a destination).
    #[error(transparent)]
    Broker(Box<dyn std::error::Error + Send + Sync>),
    /// Cannot connect to Postgres.
    #[error(
        "cannot connect to PostgreSQL ({server}): {cause}; is it running, and is DATABASE_URL right?"
    )]
    Connect {
        /// The connection string redacted ([`secret::redact_dsn`]): host, port, user and
        /// database, never the password.
        server: String,
        /// The cause and its causes, with the password scrubbed should a library have quoted
        /// it.
        cause: String,
        /// Cause.
        source: tokio_postgres::Error,
    },
}

impl RunError {
    /// Wraps a broker adapter's error.
    pub fn broker(e: impl std::error::Error + Send + Sync + 'static) -> RunError {
        RunError::Broker(Box::new(e))
    }
}

/// How long a connect may take when the connection string sets no `connect_timeout`: an
/// unreachable host that drops packets fails after this, not after the kernel's minutes.
pub const CONNECT_TIMEOUT_DEFAULT: Duration = Duration::from_secs(10);

/// Opens a Postgres connection and drives it on a task, over TLS as the connection string's
/// `sslmode` says (libpq's meanings, default `prefer`; see [`crate::tls`]). A connect takes
/// at most the string's `connect_timeout`, [`CONNECT_TIMEOUT_DEFAULT`] without one. Its
/// errors carry the connection string redacted, never the password.
pub async fn pg_connect(url: &str) -> Result<tokio_postgres::Client, RunError> {
    // libpq's sslmode, sslrootcert, sslcert and sslkey (and PGSSL*), over rustls.
    let mut pg = crate::tls::pg_tls(url)?;
    if pg.config.get_connect_timeout().is_none() {
        pg.config.connect_timeout(CONNECT_TIMEOUT_DEFAULT);
    }
    let (client, conn) = match pg.config.connect(pg.connector.clone()).await {
        Ok(c) => c,
        Err(source) => {
            return Err(match pg.explain(&source) {
                Some(tls) => RunError::Tls(tls),
                None => {
                    let password = pg
                        .config
                        .get_password()
                        .map(String::from_utf8_lossy)
                        .unwrap_or_default();
                    RunError::Connect {
                        server: secret::redact_dsn(url),
                        cause: secret::scrub(&with_causes(&source), &[&password]),
                        source,
                    }
                }
            })
        }
    };
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::warn!(error = %e, "postgres connection closed");
        }
    });
    Ok(client)
}

/// An error and its causes, `: `-separated, each cause once (tokio-postgres's `Display`
/// may or may not repeat its cause).
fn with_causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        let c = cause.to_string();
        if !text.ends_with(&c) {
            text.push_str(": ");
            text.push_str(&c);
        }
        next = cause.source();
    }
    text
}

/// Counters shared by loops for progress lines.
#[derive(Debug, Default)]
pub struct Counters {
    /// Receipts accepted as primary.
    pub published: AtomicU64,
    /// Duplicate receipts.
    pub duplicates: AtomicU64,
    /// Attempts that went unknown.
    pub unknown: AtomicU64,
    /// Unknowns resolved by the reconciler.
    pub reconciled: AtomicU64,
    /// Sends that never left (deadline passed, no connection, destination missing).
    pub never_sent: AtomicU64,
    /// Permanent refusals by the broker.
    pub refused: AtomicU64,
    /// Unknown-age alerts raised by the reconciler.
    pub alerts: AtomicU64,
    /// "Published but missing at the broker" findings (R31).
    pub missing: AtomicU64,
}

impl Counters {
    /// Counts what one committed submission did.
    pub fn count(&self, done: &Submitted, sub: &Submission) {
        for a in &done.accepted {
            match a {
                Accepted::Verdict(ReceiptVerdict::Primary) => {
                    self.published.fetch_add(1, Ordering::Relaxed);
                }
                Accepted::Verdict(ReceiptVerdict::Duplicate(_)) => {
                    self.duplicates.fetch_add(1, Ordering::Relaxed);
                }
                _ => {}
            }
        }
        for r in &sub.reports {
            let c = match r.outcome {
                sealpost_core::SendOutcome::AckTimeout => &self.unknown,
                sealpost_core::SendOutcome::NeverSent => &self.never_sent,
                sealpost_core::SendOutcome::Rejected => &self.refused,
            };
            c.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// A random owner id for this process/task.
pub fn owner_id() -> u64 {
    let u = uuid::Uuid::now_v7();
    let b = u.as_bytes();
    u64::from_be_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]])
        & 0x7fff_ffff_ffff_ffff
}

impl Config {
    /// The dispatcher machine's limits from this configuration. The send margin is the
    /// acknowledgement timeout: a message leaves early enough for its answer to arrive
    /// inside the lease.
    pub fn dispatcher_config(&self) -> DispatcherConfig {
        DispatcherConfig {
            batch_size_max: self.batch_size_max,
            lease_ms: self.lease_ms,
            send_margin_ms: self.ack_timeout_ms,
            idle_poll_ms: self.idle_poll_ms,
            error_backoff_ms: 500,
            submit_tries_max: 5,
            rescan_every_ms: DispatcherConfig::default().rescan_every_ms,
        }
    }

    /// The reconciler machine's limits from this configuration.
    pub fn reconciler_config(&self) -> ReconcilerConfig {
        ReconcilerConfig {
            batch_max: self.reconcile_batch_max,
            lease_ms: self.lease_ms,
            lookups_in_flight_max: self.lookups_in_flight_max,
            idle_poll_ms: self.reconcile_every_ms,
            error_backoff_ms: self.reconcile_every_ms,
            unknown_alert_ms: self.unknown_alert_s * 1_000,
            age_check_every_ms: self.unknown_check_every_ms,
            verify_every_ms: self.verify_every_ms,
            verify_batch_max: self.verify_batch_max,
        }
    }
}

/// The shell's monotonic clock in milliseconds since `epoch`: the machines' `now`.
fn ms_since(epoch: Instant) -> u64 {
    epoch.elapsed().as_millis() as u64
}

/// One dispatcher: the core's [`DispatcherMachine`] driven under tokio. The machine decides
/// when to claim, the deadline of every send, how each broker answer counts and when a
/// failed receipt transaction is retried; this loop only performs its actions (claim,
/// send through `broker`, submit) and sleeps until the machine's next timeout.
pub async fn dispatcher<B: Broker>(
    cfg: Config,
    broker: Arc<B>,
    stop: Arc<AtomicBool>,
    counters: Arc<Counters>,
) -> Result<(), RunError> {
    let mut pg = pg_connect(&cfg.database_url).await?;
    let owner = owner_id();
    let cluster = broker.cluster().to_string();
    let epoch = Instant::now();
    let mut m = DispatcherMachine::new(cfg.dispatcher_config(), 0);
    tracing::info!(owner, %cluster, "dispatcher started");
    // Actions the machine returned from a `handle_*` call, performed before polling again.
    let mut next: VecDeque<DispatchAction> = VecDeque::new();
    // The rows this dispatcher claimed, as its claims wrote them (guarded acceptance).
    let mut held = store::Held::default();
    // The batch on the wire: a task of its own, so the claim of the next batch (and the
    // previous batch's submission) run on the database connection meanwhile.
    let mut on_wire: Option<tokio::task::JoinHandle<Vec<SendResult>>> = None;
    let mut on_wire_len = 0usize;
    // The answer of the batch that left the wire, not yet handed to the machine.
    let mut done: Option<Result<Vec<SendResult>, tokio::task::JoinError>> = None;
    let mut stopping = false;
    loop {
        if !stopping && stop.load(Ordering::Relaxed) {
            // The batches in hand are sent and submitted; nothing new is claimed, so a
            // stopped dispatcher leaves no row SENDING behind it.
            m.handle_stop();
            stopping = true;
        }
        if done.is_none() && on_wire.as_ref().is_some_and(|h| h.is_finished()) {
            let h = on_wire.take().expect("checked");
            done = Some(h.await);
        }
        if let Some(joined) = done.take() {
            let results = sent_results(joined, on_wire_len);
            next.extend(m.handle_sent(ms_since(epoch), results));
        }
        if stopping && next.is_empty() && on_wire.is_none() && done.is_none() && m.is_idle() {
            break;
        }
        let Some(action) = next.pop_front().or_else(|| m.poll_action(ms_since(epoch))) else {
            let wake = m
                .poll_timeout()
                .unwrap_or(ms_since(epoch) + cfg.idle_poll_ms);
            let wait = wake.saturating_sub(ms_since(epoch)).min(STOP_CHECK_MS);
            match on_wire.as_mut() {
                // Wake for the broker's answer or the machine's timeout, whichever is first.
                Some(h) => {
                    if let Ok(joined) = tokio::time::timeout(Duration::from_millis(wait), h).await {
                        on_wire = None;
                        done = Some(joined);
                    }
                }
                None => tokio::time::sleep(Duration::from_millis(wait)).await,
            }
            continue;
        };
        match action {
            DispatchAction::Claim {
                batch_size_max,
                from_position,
            } => {
                let started = ms_since(epoch);
                match store::claim_batch_held(
                    &mut pg,
                    owner,
                    Some(&cluster),
                    from_position,
                    batch_size_max,
                    cfg.lease_ms,
                    &mut held,
                )
                .await
                {
                    Ok(batch) => {
                        // No transaction is open from here on: the claim committed.
                        observe::record_claim(
                            batch.outgoing.len(),
                            batch.expired_to_unknown,
                            Duration::from_millis(ms_since(epoch) - started),
                        );
                        tracing::debug!(
                            rows = batch.outgoing.len(),
                            claim_ms = ms_since(epoch) - started,
                            "claimed"
                        );
                        next.extend(m.handle_claimed(ms_since(epoch), batch.claimed(started)));
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "claim failed; retrying after a pause");
                        if pg.is_closed() {
                            let Some(c) = reconnect(&cfg, &stop).await else {
                                stopped_while_down("dispatcher");
                                return Ok(());
                            };
                            pg = c;
                            held.forget_statements();
                        }
                        m.handle_claim_failed(ms_since(epoch));
                    }
                }
            }
            DispatchAction::Send { batch, deadline_ms } => {
                debug_assert!(on_wire.is_none(), "the machine keeps one batch on the wire");
                on_wire_len = batch.len();
                let deadline = epoch + Duration::from_millis(deadline_ms);
                let broker = broker.clone();
                let pause = cfg.drill_pause_after_publish_ms;
                on_wire = Some(tokio::spawn(async move {
                    let t_send = Instant::now();
                    let n = batch.len();
                    let results = broker.send_batch(batch, deadline).await;
                    tracing::debug!(
                        rows = n,
                        send_ms = t_send.elapsed().as_millis() as u64,
                        "sent"
                    );
                    if pause > 0 {
                        tracing::warn!(ms = pause, "drill: pausing between publish and receipt");
                        tokio::time::sleep(Duration::from_millis(pause)).await;
                    }
                    results
                }));
            }
            DispatchAction::Submit(sub) => {
                let t_submit = ms_since(epoch);
                let result =
                    store::submit_held(&mut pg, &sub, cfg.rejection_limit, &mut held).await;
                observe::record_accept_duration(
                    Duration::from_millis(ms_since(epoch) - t_submit),
                    result.is_ok(),
                );
                tracing::debug!(
                    receipts = sub.receipts.len(),
                    reports = sub.reports.len(),
                    submit_ms = ms_since(epoch) - t_submit,
                    "submitted"
                );
                let ok = match result {
                    Ok(done) => {
                        counters.count(&done, &sub);
                        observe::record_submitted(&done, &sub);
                        for (event_id, n, why) in &done.stuck {
                            tracing::error!(%event_id, never_sent = n, why, "ALERT: event cannot leave (retrying with backoff); check the destination");
                        }
                        true
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "receipt transaction failed; the machine retries it");
                        if pg.is_closed() {
                            let Some(c) = reconnect(&cfg, &stop).await else {
                                stopped_while_down("dispatcher");
                                return Ok(());
                            };
                            pg = c;
                            held.forget_statements();
                        }
                        false
                    }
                };
                m.handle_submitted(ms_since(epoch), ok);
            }
        }
    }
    let c = m.counts();
    tracing::info!(
        owner,
        batches = c.batches,
        deadline_passed = c.deadline_passed,
        "dispatcher stopped"
    );
    Ok(())
}

/// The send task's answers, one per request: a task that panicked or returned the wrong
/// number leaves the missing ones unknown (`NoAnswer`), never dropped.
fn sent_results(
    joined: Result<Vec<SendResult>, tokio::task::JoinError>,
    n: usize,
) -> Vec<SendResult> {
    let mut results = match joined {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, "send task failed; its messages are unknown");
            Vec::new()
        }
    };
    if results.len() != n {
        tracing::error!(
            sent = n,
            results = results.len(),
            "broker adapter answered a different number of results; missing ones are unknown"
        );
        results.resize(n, SendResult::NoAnswer);
    }
    results
}

/// How often a sleeping loop looks at its stop flag.
const STOP_CHECK_MS: u64 = 200;

/// Logs that a loop stopped while PostgreSQL was unreachable: what it held is left to the
/// leases (the reconciler resolves a row whose send's outcome was not recorded).
fn stopped_while_down(role: &str) {
    tracing::warn!(
        role,
        "stopped while PostgreSQL is unreachable; the rows it held are left to their leases and the reconciler"
    );
}

/// Pause between two connects while PostgreSQL is unreachable.
const RECONNECT_PAUSE_MS: u64 = 1_000;

/// Reconnects to PostgreSQL, waiting [`RECONNECT_PAUSE_MS`] between tries until it answers,
/// or `None` once `stop` is set (looked at every [`STOP_CHECK_MS`], so a stopped process
/// does not wait for a database that is down). The error logged is redacted
/// ([`RunError::Connect`]).
async fn reconnect(cfg: &Config, stop: &AtomicBool) -> Option<tokio_postgres::Client> {
    loop {
        if stop.load(Ordering::Relaxed) {
            return None;
        }
        match pg_connect(&cfg.database_url).await {
            Ok(c) => return Some(c),
            Err(e) => {
                tracing::warn!(error = %e, "PostgreSQL unreachable; retrying in 1 s");
                let until = Instant::now() + Duration::from_millis(RECONNECT_PAUSE_MS);
                while Instant::now() < until && !stop.load(Ordering::Relaxed) {
                    tokio::time::sleep(Duration::from_millis(STOP_CHECK_MS)).await;
                }
            }
        }
    }
}

/// One reconciler: the core's [`ReconcilerMachine`] driven under tokio (R13–R14, R31).
/// Lookups run concurrently up to the machine's bound; verdicts, age checks and the
/// verification pass go through the store one at a time.
pub async fn reconciler<B: Broker>(
    cfg: Config,
    broker: Arc<B>,
    stop: Arc<AtomicBool>,
    counters: Arc<Counters>,
) -> Result<(), RunError> {
    let mut pg = pg_connect(&cfg.database_url).await?;
    let owner = owner_id();
    let epoch = Instant::now();
    let mut m = ReconcilerMachine::new(cfg.reconciler_config(), broker.capabilities(), 0)
        .with_clusters(vec![broker.cluster().to_string()]);
    let policy = ReconcilePolicy::for_capabilities(broker.capabilities());
    let mut lookups: FuturesUnordered<futures::future::BoxFuture<'static, Answer>> =
        FuturesUnordered::new();
    // On stop the machine still looks up and finishes the rows it holds in `RECONCILING`
    // (bounded by the lease: past it they are another reconciler's anyway).
    let mut stop_deadline: Option<Instant> = None;
    loop {
        if stop_deadline.is_none() && stop.load(Ordering::Relaxed) {
            m.handle_stop();
            stop_deadline = Some(Instant::now() + Duration::from_millis(cfg.lease_ms));
        }
        if let Some(d) = stop_deadline {
            if (m.is_idle() && lookups.is_empty()) || Instant::now() >= d {
                break;
            }
        }
        while let Some(action) = m.poll_action(ms_since(epoch)) {
            match action {
                ReconcileAction::ClaimUnknown { max } => {
                    match store::claim_unknown(&mut pg, owner, max, cfg.lease_ms).await {
                        Ok(items) => m.handle_claimed(ms_since(epoch), items),
                        Err(e) => {
                            tracing::warn!(error = %e, "reconcile claim failed");
                            if pg.is_closed() {
                                let Some(c) = reconnect(&cfg, &stop).await else {
                                    stopped_while_down("reconciler");
                                    return Ok(());
                                };
                                pg = c;
                            }
                            m.handle_claim_failed(ms_since(epoch));
                        }
                    }
                }
                ReconcileAction::Lookup(item) => {
                    let b = broker.clone();
                    lookups.push(Box::pin(async move {
                        let l = b
                            .lookup(&item.destination, item.event_id, item.member)
                            .await;
                        Answer::Unknown(item, l)
                    }));
                }
                ReconcileAction::Finish(item, lookup) => {
                    match store::finish_reconcile_published(&mut pg, &item, &lookup, policy).await {
                        Ok((d, published)) => {
                            tracing::debug!(event_id = %item.event_id, decision = ?d, "reconciled");
                            counters.reconciled.fetch_add(1, Ordering::Relaxed);
                            if published.is_some() {
                                counters.published.fetch_add(1, Ordering::Relaxed);
                            }
                            observe::record_reconciled(&d, published.as_ref());
                        }
                        Err(e) => {
                            // The row's reconciler lease runs out and a later scan takes it.
                            tracing::warn!(event_id = %item.event_id, error = %e, "reconcile failed");
                            if pg.is_closed() {
                                let Some(c) = reconnect(&cfg, &stop).await else {
                                    stopped_while_down("reconciler");
                                    return Ok(());
                                };
                                pg = c;
                            }
                        }
                    }
                    m.handle_finished(ms_since(epoch));
                }
                ReconcileAction::CheckUnknownAge => {
                    let (n, oldest_ms) = match store::unknown_age(&pg).await {
                        Ok((n, s)) => (n.max(0) as u64, (s * 1000.0) as u64),
                        Err(e) => {
                            tracing::warn!(error = %e, "unknown-age check failed");
                            (0, 0)
                        }
                    };
                    m.handle_unknown_age(ms_since(epoch), n, oldest_ms);
                }
                ReconcileAction::Alert {
                    unknown,
                    oldest_unknown_ms,
                } => {
                    counters.alerts.fetch_add(1, Ordering::Relaxed);
                    observe::record_unknown_alert();
                    tracing::error!(
                        unknown,
                        oldest_unknown_s = oldest_unknown_ms / 1000,
                        threshold_s = cfg.unknown_alert_s,
                        "ALERT: unknown outcomes older than the threshold"
                    );
                }
                ReconcileAction::LoadPublished { max } => {
                    let items = match store::published_after_cursor(&mut pg, max).await {
                        Ok(v) => v,
                        Err(e) => {
                            tracing::warn!(error = %e, "verification batch failed");
                            Vec::new()
                        }
                    };
                    m.handle_verify_batch(ms_since(epoch), items);
                }
                ReconcileAction::VerifyLookup(item) => {
                    let b = broker.clone();
                    lookups.push(Box::pin(async move {
                        let l = b
                            .lookup(&item.destination, item.event_id, item.member)
                            .await;
                        Answer::Verify(item, l)
                    }));
                }
                ReconcileAction::ReportMissing(item) => {
                    counters.missing.fetch_add(1, Ordering::Relaxed);
                    observe::record_missing_found();
                    tracing::error!(event_id = %item.event_id, stream = %item.destination.topic, sequence = item.sequence,
                        "FINDING: published but missing at the broker");
                    if let Err(e) = store::record_missing(&pg, &item).await {
                        tracing::warn!(error = %e, "could not record the finding");
                    }
                }
            }
        }
        let wake = m
            .poll_timeout()
            .unwrap_or(ms_since(epoch) + cfg.reconcile_every_ms);
        let wait = wake.saturating_sub(ms_since(epoch)).min(STOP_CHECK_MS);
        tokio::select! {
            Some(answer) = lookups.next(), if !lookups.is_empty() => match answer {
                Answer::Unknown(item, l) => {
                    observe::record_lookup("unknown", &l);
                    m.handle_lookup(item, l)
                }
                Answer::Verify(item, l) => {
                    observe::record_lookup("verify", &l);
                    m.handle_verify_lookup(ms_since(epoch), item, &l)
                }
            },
            _ = tokio::time::sleep(Duration::from_millis(wait)) => {}
        }
    }
    Ok(())
}

/// A broker's answer for the reconciler machine.
enum Answer {
    Unknown(ReconcileItem, Lookup),
    Verify(VerifyItem, Lookup),
}

/// Spawns `dispatchers` dispatcher tasks and, if asked, one reconciler beside them, all
/// stopping on `stop`. The demo, the bench and `sealpost dispatch` run the same fleet.
pub fn spawn_fleet<B: Broker>(
    cfg: &Config,
    broker: &Arc<B>,
    dispatchers: usize,
    with_reconciler: bool,
    stop: &Arc<AtomicBool>,
    counters: &Arc<Counters>,
) -> Vec<tokio::task::JoinHandle<Result<(), RunError>>> {
    let mut tasks: Vec<_> = (0..dispatchers)
        .map(|_| {
            tokio::spawn(dispatcher(
                cfg.clone(),
                broker.clone(),
                stop.clone(),
                counters.clone(),
            ))
        })
        .collect();
    if with_reconciler {
        tasks.push(tokio::spawn(reconciler(
            cfg.clone(),
            broker.clone(),
            stop.clone(),
            counters.clone(),
        )));
    }
    tasks
}
