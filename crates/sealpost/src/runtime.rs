//! The dispatcher and reconciler loops: claim in one short transaction, send with no
//! transaction open, accept receipts (or report outcomes) in one more. The loops are generic
//! over the broker port ([`Broker`]); they never see a broker's wire format, take their
//! database connections from an injected [`PgSource`] and stop on a [`CancellationToken`].
//! The configuration is a plain struct of store and loop limits: the `sealpost` command
//! loads it from a TOML file, and [`Config::apply_env`] applies `DATABASE_URL`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};
use sealpost_core::dispatcher::{DispatchAction, DispatcherConfig, DispatcherMachine, Submission};
use sealpost_core::port::{Broker, SendResult};
use sealpost_core::reconcile::{Lookup, ReconcilePolicy};
use sealpost_core::reconciler::{
    ReconcileAction, ReconcileItem, ReconcilerConfig, ReconcilerMachine, VerifyItem,
};
use sealpost_core::rollout::Implementation;
use sealpost_core::signature::SignaturePolicy;
use sealpost_core::ReceiptVerdict;

use std::fmt;

pub use tokio_util::sync::CancellationToken;

use crate::observe;
use crate::pg::{PgConn, PgSource};
use crate::secret;
use crate::signing::{Keyring, Signer};
use crate::store::{self, Accepted, StoreError, Submitted};

/// Runtime configuration of the store and the loops: the database, leases, batch sizes,
/// timeouts and backoffs. Every field has a default; [`Config::apply_env`] applies
/// `DATABASE_URL` and `DATABASE_PASSWORD_FILE` over it. Brokers are configured by their
/// adapters (`sealpost_nats::NatsConfig`, `sealpost_rabbitmq::RabbitConfig`,
/// `sealpost_kafka::KafkaConfig`, each with its own `from_env`), so this type names none.
/// Its `Debug` shows the connection strings redacted ([`crate::secret`]), never a password.
#[derive(Clone, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// PostgreSQL connection string (used by [`PgConnector::from_config`]; a service that
    /// injects its own [`PgSource`] need not set it).
    pub database_url: String,
    /// File holding the password of `database_url` (`DATABASE_PASSWORD_FILE`): read by
    /// [`Config::apply_secret_files`] and appended to `database_url` as its `password`, so the
    /// password need not be in the connection string, the file or the environment. One
    /// trailing newline is ignored. It applies to `database_url` only, not to
    /// `outbox_database_url`.
    pub database_password_file: String,
    /// Claim lease, milliseconds of the database clock.
    pub lease_ms: u64,
    /// Rows claimed per dispatcher transaction.
    pub batch_size_max: usize,
    /// Publish acknowledgement timeout.
    pub ack_timeout_ms: u64,
    /// Sleep when a scan found nothing.
    pub idle_poll_ms: u64,
    /// A claim scans on from the position after its previous batch, and from the start at
    /// least this often. A transaction that took its commit positions before another one
    /// and committed after the dispatcher claimed the other's rows is found only by such a
    /// full scan, so this bounds how long its events wait (`DispatcherConfig::rescan_every_ms`;
    /// docs/performance.md, "Late-committing transactions"). 0: every claim scans from the
    /// start.
    pub rescan_every_ms: u64,
    /// Wait after the first failed claim or receipt transaction (the database unreachable
    /// included); each further failure in a row doubles it, up to `error_backoff_max_ms`.
    pub error_backoff_ms: u64,
    /// The longest wait between two tries while the database keeps failing.
    pub error_backoff_max_ms: u64,
    /// Receipt transaction attempts that the database refused (it answered, with an error)
    /// before the batch is left to the reconciler. Tries that could not reach the database
    /// do not count: those are retried until it answers.
    pub submit_tries_max: u32,
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
    /// Failure drills only (cargo feature `drills`): sleep this long between a publish and
    /// its receipt transaction, so a drill can kill the process in that window.
    #[cfg(feature = "drills")]
    pub drill_pause_after_publish_ms: u64,
    /// How long the broker waits for a consumer's ack before redelivering.
    pub consumer_ack_wait_ms: u64,
    /// Failure drills only (cargo feature `drills`): the consumer commits but never acks
    /// (F9).
    #[cfg(feature = "drills")]
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
    /// The dispatchers' Ed25519 private key, a PKCS#8 PEM file `<key-id>.pem`
    /// (`SEALPOST_SIGNING_KEY_FILE`; [`crate::signing`]): every message sent is signed with
    /// it. Empty: messages go unsigned.
    pub signing_key_file: String,
    /// The readers' public keys, every `<key-id>.pub.pem` of this directory
    /// (`SEALPOST_VERIFY_KEYS_DIR`): consumers, the reconciler and the verification pass check
    /// signatures with them.
    pub verify_keys_dir: String,
    /// What readers demand of signatures (`SEALPOST_SIGNATURES`): `off`, `if-present` (while
    /// dispatchers start signing) or `require`. Empty: `require` when `verify_keys_dir` is
    /// set, `off` otherwise.
    pub signatures: String,
    /// The implementation id this process announces and claims as
    /// (`SEALPOST_IMPLEMENTATION`; R25, `sealpost rollout`): a route's rollout alias names
    /// which implementation claims its rows. Empty: `sealpost-<version>` of this build.
    pub implementation: String,
    /// The CDC publisher (`sealpost cdc`, [`crate::cdc`]): slot, publication and window
    /// (the `[cdc]` table of the file).
    pub cdc: crate::cdc::CdcConfig,
    /// The keys read from the two settings above ([`Config::load_keys`]).
    #[serde(skip)]
    pub keys: LoadedKeys,
}

/// The signing key and keyring a [`Config`] names, once read ([`Config::load_keys`]).
#[derive(Clone, Debug)]
pub struct LoadedKeys {
    /// Read from the files (false: the defaults, nothing read yet).
    pub loaded: bool,
    /// The dispatchers' signer, if a key file is set.
    pub signer: Option<Arc<Signer>>,
    /// The readers' keyring ([`Keyring::off`] without a keys directory).
    pub keyring: Arc<Keyring>,
}

impl Default for LoadedKeys {
    fn default() -> Self {
        LoadedKeys {
            loaded: false,
            signer: None,
            keyring: Arc::new(Keyring::off()),
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            database_url: "host=127.0.0.1 user=postgres dbname=test".to_string(),
            database_password_file: String::new(),
            lease_ms: 10_000,
            batch_size_max: 1000,
            ack_timeout_ms: 5_000,
            idle_poll_ms: 50,
            rescan_every_ms: DispatcherConfig::default().rescan_every_ms,
            error_backoff_ms: 500,
            error_backoff_max_ms: 10_000,
            submit_tries_max: 5,
            rejection_limit: 5,
            reconcile_batch_max: 200,
            reconcile_every_ms: 1_000,
            lookups_in_flight_max: 32,
            unknown_check_every_ms: 10_000,
            verify_every_ms: 5_000,
            verify_batch_max: 100,
            unknown_alert_s: 900,
            #[cfg(feature = "drills")]
            drill_pause_after_publish_ms: 0,
            consumer_ack_wait_ms: 10_000,
            #[cfg(feature = "drills")]
            drill_skip_consumer_ack: false,
            consumer_max_deliveries: 10,
            consumer_effect_timeout_ms: 5_000,
            consumer_progress_every_ms: 1_000,
            outbox_database_url: String::new(),
            required_consumers: Vec::new(),
            signing_key_file: String::new(),
            verify_keys_dir: String::new(),
            signatures: String::new(),
            implementation: String::new(),
            cdc: crate::cdc::CdcConfig::default(),
            keys: LoadedKeys::default(),
        }
    }
}

impl fmt::Debug for Config {
    /// Every field, the connection strings redacted ([`crate::secret`]). The destructuring
    /// names every field, so a new one cannot be forgotten here.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Config {
            database_url,
            database_password_file,
            lease_ms,
            batch_size_max,
            ack_timeout_ms,
            idle_poll_ms,
            rescan_every_ms,
            error_backoff_ms,
            error_backoff_max_ms,
            submit_tries_max,
            rejection_limit,
            reconcile_batch_max,
            reconcile_every_ms,
            lookups_in_flight_max,
            unknown_check_every_ms,
            verify_every_ms,
            verify_batch_max,
            unknown_alert_s,
            #[cfg(feature = "drills")]
            drill_pause_after_publish_ms,
            consumer_ack_wait_ms,
            #[cfg(feature = "drills")]
            drill_skip_consumer_ack,
            consumer_max_deliveries,
            consumer_effect_timeout_ms,
            consumer_progress_every_ms,
            outbox_database_url,
            required_consumers,
            signing_key_file,
            verify_keys_dir,
            signatures,
            implementation,
            cdc,
            keys,
        } = self;
        let mut d = f.debug_struct("Config");
        d.field("database_url", &secret::redact_dsn(database_url))
            .field("database_password_file", database_password_file)
            .field("lease_ms", lease_ms)
            .field("batch_size_max", batch_size_max)
            .field("ack_timeout_ms", ack_timeout_ms)
            .field("idle_poll_ms", idle_poll_ms)
            .field("rescan_every_ms", rescan_every_ms)
            .field("error_backoff_ms", error_backoff_ms)
            .field("error_backoff_max_ms", error_backoff_max_ms)
            .field("submit_tries_max", submit_tries_max)
            .field("rejection_limit", rejection_limit)
            .field("reconcile_batch_max", reconcile_batch_max)
            .field("reconcile_every_ms", reconcile_every_ms)
            .field("lookups_in_flight_max", lookups_in_flight_max)
            .field("unknown_check_every_ms", unknown_check_every_ms)
            .field("verify_every_ms", verify_every_ms)
            .field("verify_batch_max", verify_batch_max)
            .field("unknown_alert_s", unknown_alert_s);
        #[cfg(feature = "drills")]
        d.field("drill_pause_after_publish_ms", drill_pause_after_publish_ms)
            .field("drill_skip_consumer_ack", drill_skip_consumer_ack);
        d.field("consumer_ack_wait_ms", consumer_ack_wait_ms)
            .field("consumer_max_deliveries", consumer_max_deliveries)
            .field("consumer_effect_timeout_ms", consumer_effect_timeout_ms)
            .field("consumer_progress_every_ms", consumer_progress_every_ms)
            .field(
                "outbox_database_url",
                &secret::redact_dsn(outbox_database_url),
            )
            .field("required_consumers", required_consumers)
            .field("signing_key_file", signing_key_file)
            .field("verify_keys_dir", verify_keys_dir)
            .field("signatures", signatures)
            .field("implementation", implementation)
            .field("cdc", cdc)
            .field("keys", keys)
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
    /// A signing key or the keys directory cannot be used (names the file, never a key).
    #[error(transparent)]
    Key(#[from] crate::signing::KeyError),
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
    /// Applies `DATABASE_URL` and `DATABASE_PASSWORD_FILE` from the environment, when set,
    /// over whatever the configuration says. (Each broker adapter's config reads its own
    /// variables: `NATS_*`, `RABBITMQ_*`, `KAFKA_*`.)
    pub fn apply_env(&mut self) {
        if let Ok(v) = std::env::var("DATABASE_URL") {
            self.database_url = v;
        }
        if let Ok(v) = std::env::var("DATABASE_PASSWORD_FILE") {
            self.database_password_file = v;
        }
        for (var, field) in [
            ("SEALPOST_SIGNING_KEY_FILE", &mut self.signing_key_file),
            ("SEALPOST_VERIFY_KEYS_DIR", &mut self.verify_keys_dir),
            ("SEALPOST_SIGNATURES", &mut self.signatures),
            ("SEALPOST_IMPLEMENTATION", &mut self.implementation),
        ] {
            if let Ok(v) = std::env::var(var) {
                *field = v;
            }
        }
    }

    /// The implementation this process claims as (`implementation`; empty: this build's
    /// default id).
    pub fn implementation(&self) -> Result<Implementation, ConfigError> {
        if self.implementation.is_empty() {
            return Ok(Implementation::this_build().clone());
        }
        Implementation::new(&self.implementation).map_err(|e| ConfigError::Invalid {
            key: "implementation",
            message: e.to_string(),
        })
    }

    /// The readers' signature policy (`signatures`; empty: `require` with a keys directory,
    /// `off` without).
    pub fn signature_policy(&self) -> Result<SignaturePolicy, ConfigError> {
        if self.signatures.is_empty() {
            return Ok(if self.verify_keys_dir.is_empty() {
                SignaturePolicy::Off
            } else {
                SignaturePolicy::Require
            });
        }
        let p = SignaturePolicy::parse(&self.signatures).ok_or_else(|| ConfigError::Invalid {
            key: "signatures",
            message: format!(
                "`{}` is not one of off, if-present, require",
                self.signatures
            ),
        })?;
        if p != SignaturePolicy::Off && self.verify_keys_dir.is_empty() {
            return Err(ConfigError::Invalid {
                key: "signatures",
                message: format!(
                    "`{}` needs verify_keys_dir (SEALPOST_VERIFY_KEYS_DIR), the directory of the dispatchers' <key-id>.pub.pem files",
                    p.name()
                ),
            });
        }
        Ok(p)
    }

    /// Reads `signing_key_file` and `verify_keys_dir` into [`Config::keys`] (once; a second
    /// call keeps what the first read). The error names the file and what to do, never a key.
    pub fn load_keys(&mut self) -> Result<(), ConfigError> {
        if self.keys.loaded {
            return Ok(());
        }
        let policy = self.signature_policy()?;
        let signer = if self.signing_key_file.is_empty() {
            None
        } else {
            Some(Arc::new(Signer::from_pem_file(std::path::Path::new(
                &self.signing_key_file,
            ))?))
        };
        let keyring = if self.verify_keys_dir.is_empty() {
            Keyring::off()
        } else {
            Keyring::from_dir(std::path::Path::new(&self.verify_keys_dir), policy)?
        };
        self.keys = LoadedKeys {
            loaded: true,
            signer,
            keyring: Arc::new(keyring),
        };
        Ok(())
    }

    /// The config with its keys read ([`Config::load_keys`]), for a loop starting up.
    fn with_keys(mut self) -> Result<Config, RunError> {
        self.load_keys()
            .map_err(|e| RunError::Config(e.to_string()))?;
        Ok(self)
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
        c.load_keys()?;
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
        if self.error_backoff_ms == 0 || self.error_backoff_max_ms < self.error_backoff_ms {
            return Err(ConfigError::Invalid {
                key: "error_backoff_max_ms",
                message: format!(
                    "must be at least error_backoff_ms ({}), which must be at least 1",
                    self.error_backoff_ms
                ),
            });
        }
        if self.submit_tries_max == 0 {
            return Err(ConfigError::Invalid {
                key: "submit_tries_max",
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
    /// The configuration cannot be used (a signing key or keys directory, say).
    #[error("{0}")]
    Config(String),
    /// A connection pool could not lend a connection (its words and causes, then what to
    /// check).
    #[error("cannot get a PostgreSQL connection from the pool: {0}")]
    Pool(String),
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
pub(crate) fn with_causes(e: &(dyn std::error::Error + 'static)) -> String {
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
    /// Sends a CDC publisher claimed from rows the database log named (not found by a scan).
    pub from_log: AtomicU64,
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
            error_backoff_ms: self.error_backoff_ms,
            error_backoff_max_ms: self.error_backoff_max_ms,
            submit_tries_max: self.submit_tries_max,
            rescan_every_ms: self.rescan_every_ms,
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
            error_backoff_max_ms: self.error_backoff_max_ms.max(self.reconcile_every_ms),
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
/// when to claim, the deadline of every send, how each broker answer counts, when a failed
/// transaction is retried and how long it backs off while the database is away; this loop
/// only performs its actions (claim, send through `broker`, submit), takes a connection from
/// `db` when it has none, and sleeps until the machine's next timeout or `shutdown`.
pub async fn dispatcher<B: Broker>(
    cfg: Config,
    db: Arc<dyn PgSource>,
    broker: Arc<B>,
    shutdown: CancellationToken,
    counters: Arc<Counters>,
) -> Result<(), RunError> {
    dispatch_loop(cfg, db, broker, shutdown, counters, None).await
}

/// [`dispatcher`], its claims taken from the CDC publisher's log window when `log` is set
/// ([`crate::cdc::LogScope::claim`]), from the claim index's scan otherwise.
pub(crate) async fn dispatch_loop<B: Broker>(
    cfg: Config,
    db: Arc<dyn PgSource>,
    broker: Arc<B>,
    shutdown: CancellationToken,
    counters: Arc<Counters>,
    log: Option<Arc<crate::cdc::LogScope>>,
) -> Result<(), RunError> {
    let cfg = cfg.with_keys()?;
    let signer = cfg.keys.signer.clone();
    match &signer {
        Some(s) => tracing::info!(key_id = s.key_id(), "dispatcher signs every message"),
        None => tracing::warn!(
            "dispatcher sends unsigned messages: anyone who may publish to the destination can forge an event; set signing_key_file (docs/operations.md, \"Signed envelopes\")"
        ),
    }
    cfg.dispatcher_config()
        .fits(&broker.capabilities())
        .map_err(|e| RunError::Config(format!("cluster `{}`: {e}", broker.cluster())))?;
    let implementation = cfg
        .implementation()
        .map_err(|e| RunError::Config(e.to_string()))?;
    let mut pg = Some(db.connect().await?);
    let owner = owner_id();
    let cluster = broker.cluster().to_string();
    let epoch = Instant::now();
    let mut m = DispatcherMachine::new(cfg.dispatcher_config(), 0);
    let role = match &log {
        Some(_) => store::Role::Cdc,
        None => store::Role::Dispatcher,
    };
    if let Some(client) = pg.as_ref() {
        store::announce(&**client, owner, &implementation, role, &cluster).await?;
    }
    let mut announced = Instant::now();
    tracing::info!(owner, %cluster, implementation = %implementation.id, "dispatcher started");
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
        if !stopping && shutdown.is_cancelled() {
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
        if stopping && pg.is_none() && on_wire.is_none() && done.is_none() {
            // Stopped while the database is away: what it holds is left to the leases.
            stopped_while_down("dispatcher");
            break;
        }
        let Some(action) = next.pop_front().or_else(|| m.poll_action(ms_since(epoch))) else {
            let wake = m
                .poll_timeout()
                .unwrap_or(ms_since(epoch) + cfg.idle_poll_ms);
            let wait = Duration::from_millis(wake.saturating_sub(ms_since(epoch)));
            let cancelled = shutdown.cancelled();
            let log_ready = async {
                match &log {
                    Some(log) => log.ready.notified().await,
                    None => std::future::pending().await,
                }
            };
            tokio::pin!(log_ready);
            match on_wire.as_mut() {
                // Wake for the broker's answer, the machine's timeout or the shutdown,
                // whichever is first.
                Some(h) => tokio::select! {
                    joined = h => {
                        on_wire = None;
                        done = Some(joined);
                    }
                    _ = tokio::time::sleep(wait) => {}
                    _ = cancelled, if !stopping => {}
                    _ = &mut log_ready => m.handle_notify(ms_since(epoch)),
                },
                None => tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = cancelled, if !stopping => {}
                    _ = &mut log_ready => m.handle_notify(ms_since(epoch)),
                },
            }
            continue;
        };
        match action {
            DispatchAction::Claim {
                batch_size_max,
                from_position,
            } => {
                let fresh = pg.is_none();
                let Some(client) = connected(&mut pg, &*db, "dispatcher").await else {
                    m.handle_claim_failed(ms_since(epoch));
                    continue;
                };
                if fresh {
                    // A new connection has none of the old one's prepared statements.
                    held.forget_statements();
                }
                if announced.elapsed() >= Duration::from_millis(ANNOUNCE_EVERY_MS) {
                    // Still here: `rollout status` and a switch's warnings count the
                    // dispatchers seen lately.
                    announced = Instant::now();
                    if let Err(e) =
                        store::announce(&*client, owner, &implementation, role, &cluster).await
                    {
                        tracing::warn!(error = %e, "could not renew the implementation announcement");
                    }
                }
                let started = ms_since(epoch);
                let scan = store::ClaimRequest::new(owner, batch_size_max, cfg.lease_ms)
                    .implementation(&implementation)
                    .cluster(Some(&cluster))
                    .from_position(from_position);
                let claimed = match &log {
                    None => store::claim(client, &scan, Some(&mut held)).await,
                    Some(log) => log.claim(client, &scan, &mut held).await,
                };
                match claimed {
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
                        tracing::warn!(error = %e, "claim failed; the machine retries after its backoff");
                        after_store_error(&e, &mut pg);
                        m.handle_claim_failed(ms_since(epoch));
                    }
                }
            }
            DispatchAction::Send { batch, deadline_ms } => {
                debug_assert!(on_wire.is_none(), "the machine keeps one batch on the wire");
                on_wire_len = batch.len();
                let deadline = epoch + Duration::from_millis(deadline_ms);
                let broker = broker.clone();
                #[cfg(feature = "drills")]
                let pause = cfg.drill_pause_after_publish_ms;
                let signer = signer.clone();
                on_wire = Some(tokio::spawn(async move {
                    // Signing costs tens of microseconds a message: a whole batch is signed
                    // on the blocking pool, not on the runtime's worker threads.
                    let batch = match signer {
                        Some(signer) => tokio::task::spawn_blocking(move || {
                            let mut batch = batch;
                            for r in &mut batch {
                                signer.sign_request(r);
                            }
                            batch
                        })
                        .await
                        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic())),
                        None => batch,
                    };
                    let t_send = Instant::now();
                    let n = batch.len();
                    let results = broker.send_batch(batch, deadline).await;
                    tracing::debug!(
                        rows = n,
                        send_ms = t_send.elapsed().as_millis() as u64,
                        "sent"
                    );
                    #[cfg(feature = "drills")]
                    if pause > 0 {
                        tracing::warn!(ms = pause, "drill: pausing between publish and receipt");
                        tokio::time::sleep(Duration::from_millis(pause)).await;
                    }
                    results
                }));
            }
            DispatchAction::Submit(sub) => {
                let fresh = pg.is_none();
                let Some(client) = connected(&mut pg, &*db, "dispatcher").await else {
                    m.handle_submit_unreachable(ms_since(epoch));
                    continue;
                };
                if fresh {
                    // A new connection has none of the old one's prepared statements.
                    held.forget_statements();
                }
                let t_submit = ms_since(epoch);
                let result = store::submit_held(client, &sub, cfg.rejection_limit, &mut held).await;
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
                match result {
                    Ok(done) => {
                        counters.count(&done, &sub);
                        observe::record_submitted(&done, &sub);
                        for (event_id, n, why) in &done.stuck {
                            tracing::error!(%event_id, never_sent = n, why, "ALERT: event cannot leave (retrying with backoff); check the destination");
                        }
                        m.handle_submitted(ms_since(epoch), true);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "receipt transaction failed; the machine retries it");
                        // A connection that broke during the transaction is dropped; whether
                        // the commit reached the database is not known, so it counts as a try
                        // (the acceptance point makes a repeat harmless).
                        after_store_error(&e, &mut pg);
                        m.handle_submitted(ms_since(epoch), false);
                    }
                }
            }
        }
    }
    let c = m.counts();
    tracing::info!(
        owner,
        batches = c.batches,
        full_scans = c.full_scans,
        deadline_passed = c.deadline_passed,
        "dispatcher stopped"
    );
    Ok(())
}

/// The loop's connection: the one it holds, or a new one from `db` (`None` if the database
/// cannot be reached now; the machine decides when to try again).
async fn connected<'a>(
    pg: &'a mut Option<PgConn>,
    db: &dyn PgSource,
    role: &str,
) -> Option<&'a mut tokio_postgres::Client> {
    if pg.is_none() {
        match db.connect().await {
            Ok(c) => {
                tracing::info!(role, source = %db.describe(), "PostgreSQL reachable again");
                *pg = Some(c);
            }
            Err(e) => {
                tracing::warn!(role, error = %e, "PostgreSQL unreachable; the machine tries again after its backoff");
                return None;
            }
        }
    }
    pg.as_deref_mut()
}

/// What a loop does after a store call failed, by the error's [`store::ErrorKind`] (the
/// machine retries the step either way):
/// * the connection is lost: drop it, the next transaction takes a new one;
/// * a retryable conflict or a time limit: nothing more (the caller logged a warning);
/// * a missing privilege, a broken invariant, a schema problem: an `ALERT` line that says an
///   operator must act, since retrying alone will not help.
fn after_store_error(e: &store::StoreError, pg: &mut Option<PgConn>) {
    let kind = e.kind();
    if kind == store::ErrorKind::ConnectionLost || pg.as_ref().is_some_and(|c| c.is_closed()) {
        *pg = None;
    }
    if !kind.is_transient() && kind != store::ErrorKind::Other {
        tracing::error!(?kind, error = %e, "ALERT: a store transaction keeps failing until an operator acts (grant the privilege, migrate the schema, or report the invariant); the loop retries with backoff");
    }
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

/// Logs that a loop stopped while PostgreSQL was unreachable: what it held is left to the
/// leases (the reconciler resolves a row whose send's outcome was not recorded).
fn stopped_while_down(role: &str) {
    tracing::warn!(
        role,
        "stopped while PostgreSQL is unreachable; the rows it held are left to their leases and the reconciler"
    );
}

/// One reconciler: the core's [`ReconcilerMachine`] driven under tokio (R13–R14, R31).
/// Lookups run concurrently up to the machine's bound; verdicts, age checks and the
/// verification pass go through the store one at a time, on a connection from `db` (taken
/// again when it breaks, when the machine's next claim is due).
pub async fn reconciler<B: Broker>(
    cfg: Config,
    db: Arc<dyn PgSource>,
    broker: Arc<B>,
    shutdown: CancellationToken,
    counters: Arc<Counters>,
) -> Result<(), RunError> {
    let cfg = cfg.with_keys()?;
    let keyring = cfg.keys.keyring.clone();
    let implementation = cfg
        .implementation()
        .map_err(|e| RunError::Config(e.to_string()))?;
    let mut pg = Some(db.connect().await?);
    let owner = owner_id();
    if let Some(client) = pg.as_ref() {
        store::announce(
            &**client,
            owner,
            &implementation,
            store::Role::Reconciler,
            broker.cluster(),
        )
        .await?;
    }
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
        if stop_deadline.is_none() && shutdown.is_cancelled() {
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
                    let Some(client) = connected(&mut pg, &*db, "reconciler").await else {
                        m.handle_claim_failed(ms_since(epoch));
                        continue;
                    };
                    match store::claim_unknown(client, owner, max, cfg.lease_ms).await {
                        Ok(items) => m.handle_claimed(ms_since(epoch), items),
                        Err(e) => {
                            tracing::warn!(error = %e, "reconcile claim failed; the machine retries after its backoff");
                            after_store_error(&e, &mut pg);
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
                ReconcileAction::LookupMany(group) => {
                    let b = broker.clone();
                    lookups.push(Box::pin(async move {
                        let destination = group[0].destination.clone();
                        let events: Vec<_> = group.iter().map(|i| (i.event_id, i.member)).collect();
                        let l = b.lookup_many(&destination, &events).await;
                        Answer::Many(group, l)
                    }));
                }
                ReconcileAction::Finish(item, lookup) => {
                    let Some(client) = connected(&mut pg, &*db, "reconciler").await else {
                        // The row's reconciler lease runs out and a later scan takes it.
                        m.handle_finished(ms_since(epoch));
                        continue;
                    };
                    match store::finish_reconcile_published(client, &item, &lookup, policy).await {
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
                            after_store_error(&e, &mut pg);
                        }
                    }
                    m.handle_finished(ms_since(epoch));
                }
                ReconcileAction::CheckUnknownAge => {
                    let Some(client) = connected(&mut pg, &*db, "reconciler").await else {
                        m.handle_unknown_age(ms_since(epoch), 0, 0);
                        continue;
                    };
                    let (n, oldest_ms) = match store::unknown_age(client).await {
                        Ok((n, s)) => (n.max(0) as u64, (s * 1000.0) as u64),
                        Err(e) => {
                            tracing::warn!(error = %e, "unknown-age check failed");
                            after_store_error(&e, &mut pg);
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
                    let items = match connected(&mut pg, &*db, "reconciler").await {
                        None => Vec::new(),
                        Some(client) => match store::published_after_cursor(client, max).await {
                            Ok(v) => v,
                            Err(e) => {
                                tracing::warn!(error = %e, "verification batch failed");
                                after_store_error(&e, &mut pg);
                                Vec::new()
                            }
                        },
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
                    match connected(&mut pg, &*db, "reconciler").await {
                        Some(client) => {
                            if let Err(e) = store::record_missing(client, &item).await {
                                tracing::warn!(error = %e, "could not record the finding");
                                after_store_error(&e, &mut pg);
                            }
                        }
                        None => {
                            tracing::warn!(event_id = %item.event_id, "could not record the finding: PostgreSQL unreachable (the log line above is the record)")
                        }
                    }
                }
            }
        }
        let wake = m
            .poll_timeout()
            .unwrap_or(ms_since(epoch) + cfg.reconcile_every_ms);
        let wait = wake.saturating_sub(ms_since(epoch));
        if stop_deadline.is_some() && pg.is_none() {
            // Stopped while the database is away: what it holds is left to the leases.
            stopped_while_down("reconciler");
            break;
        }
        let stopping = stop_deadline.is_some();
        tokio::select! {
            _ = shutdown.cancelled(), if !stopping => {}
            // A copy a lookup found is judged by its seal before the machine sees it.
            Some(answer) = lookups.next(), if !lookups.is_empty() => match answer.judged(&keyring) {
                Answer::Unknown(item, l) => {
                    observe::record_lookup("unknown", &l);
                    m.handle_lookup(item, l)
                }
                Answer::Verify(item, l) => {
                    observe::record_lookup("verify", &l);
                    m.handle_verify_lookup(ms_since(epoch), item, &l)
                }
                Answer::Many(group, ls) => {
                    for l in &ls {
                        observe::record_lookup("unknown", l);
                    }
                    m.handle_lookups(group, ls)
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
    /// One scan's answers, one per row of the group.
    Many(Vec<ReconcileItem>, Vec<Lookup>),
}

impl Answer {
    /// Every copy found, its seal judged by `keyring` (`sealpost_core::signature::judge_copy`).
    fn judged(self, keyring: &Keyring) -> Answer {
        match self {
            Answer::Unknown(i, l) => Answer::Unknown(i, keyring.judge(l)),
            Answer::Verify(i, l) => Answer::Verify(i, keyring.judge(l)),
            Answer::Many(g, ls) => {
                Answer::Many(g, ls.into_iter().map(|l| keyring.judge(l)).collect())
            }
        }
    }
}

/// How often a dispatcher renews its announcement (`sealpost.implementation.seen_at_ms`).
pub const ANNOUNCE_EVERY_MS: u64 = 30_000;

/// How often a candidate's shadow reads what the incumbent published (R25).
pub const SHADOW_EVERY_MS: u64 = 1_000;

/// How long one shadow round looks messages up before it records what it compared (the
/// rest of its page is read in the next round).
pub const SHADOW_ROUND_MAX_MS: u64 = 2_000;

/// The shadow reader of a dispatcher process (R25, `sealpost rollout shadow`): while this
/// process's implementation is a route's candidate in shadow or takeover on this broker's
/// cluster, it walks the messages the incumbent published there, reads each back from the
/// broker, computes what this build would have sent for the same row
/// ([`sealpost_core::rollout::shadow_compare`]: destination digest, payload digest,
/// envelope generation, headers, ordering wait) and records matches and divergences
/// (`rollout status`, the page). It claims nothing and sends nothing. Idle (one read of
/// the aliases per [`SHADOW_EVERY_MS`]) when this implementation is nobody's candidate.
pub async fn shadow<B: Broker>(
    cfg: Config,
    db: Arc<dyn PgSource>,
    broker: Arc<B>,
    shutdown: CancellationToken,
) -> Result<(), RunError> {
    let implementation = cfg
        .implementation()
        .map_err(|e| RunError::Config(e.to_string()))?;
    let cluster = broker.cluster().to_string();
    let mut pg: Option<PgConn> = None;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = tokio::time::sleep(Duration::from_millis(SHADOW_EVERY_MS)) => {}
        }
        let Some(client) = connected(&mut pg, &*db, "shadow").await else {
            continue;
        };
        if let Err(e) = shadow_round(client, &*broker, &implementation.id, &cluster).await {
            tracing::warn!(error = %e, "shadow read failed; it tries again");
            after_store_error(&e, &mut pg);
        }
    }
}

/// One read of every route where `me` is the candidate in shadow or takeover.
async fn shadow_round<B: Broker>(
    client: &mut tokio_postgres::Client,
    broker: &B,
    me: &str,
    cluster: &str,
) -> Result<(), StoreError> {
    use sealpost_core::reconcile::Lookup;
    use sealpost_core::rollout::{shadow_compare, Observed, SeenHeaders, Stage};
    for a in store::aliases(&*client).await? {
        let a = a.alias;
        let shadowing = a.candidate.as_deref() == Some(me)
            && matches!(a.stage, Stage::Shadow | Stage::Takeover)
            && a.cluster == cluster;
        if !shadowing {
            continue;
        }
        let cursor = store::shadow_cursor(&*client, &a.route, me).await?;
        let page = store::shadow_page(&*client, &a, me, cursor).await?;
        let mut compared = Vec::with_capacity(page.rows.len());
        // The page's lookups end after SHADOW_ROUND_MAX_MS (a slow broker answers a page
        // of 200 in minutes): what was compared is recorded, the rest read next round.
        let started = std::time::Instant::now();
        let mut read_to = page.read_to;
        let mut handled = cursor;
        for r in &page.rows {
            if started.elapsed() > Duration::from_millis(SHADOW_ROUND_MAX_MS) {
                read_to = handled;
                break;
            }
            let looked = broker
                .lookup(&r.row.destination, r.row.event_id, r.row.member)
                .await;
            let (receipt, headers) = match looked {
                Lookup::Copies(copies) => {
                    let c = copies
                        .iter()
                        .find(|c| Some(c.receipt.attempt_id) == r.primary_attempt_id)
                        .unwrap_or(&copies[0])
                        .clone();
                    (c.receipt, Some(c.seal.claim.map(|x| x.envelope)))
                }
                // An adapter that reads no headers back: the digests are compared.
                Lookup::Found(receipt) | Lookup::Unsealed { receipt, .. } => (receipt, None),
                // Not at the broker any more (a retention limit), or not askable: nothing
                // to compare; the reconciler reports a missing message.
                Lookup::Absent | Lookup::Unqueryable => {
                    handled = r.key;
                    continue;
                }
                // Nothing learned: the rest of the page is read again next time.
                Lookup::Unavailable => {
                    read_to = handled;
                    break;
                }
            };
            let ds = shadow_compare(
                &r.row,
                &r.envelope,
                Observed {
                    receipt: &receipt,
                    headers: match &headers {
                        Some(Some(h)) => SeenHeaders::Read(h),
                        Some(None) => SeenHeaders::Missing,
                        None => SeenHeaders::NotRead,
                    },
                    earlier_stored_later: r.earlier_stored_later,
                },
            );
            if !ds.is_empty() {
                tracing::warn!(route = %a.route, event_id = %r.row.event_id, divergences = ds.len(), "shadow: the candidate would have sent this event differently");
            }
            compared.push((r.row.event_id, r.row.member, ds));
            handled = r.key;
        }
        if read_to != cursor {
            store::record_shadow(client, &a.route, me, &compared, cursor, read_to).await?;
        }
    }
    Ok(())
}

/// Spawns `dispatchers` dispatcher tasks with one [`shadow`] reader beside them and, if
/// asked, one reconciler, each
/// with its own connection from `db`, all stopping when `shutdown` is cancelled. The demo,
/// the bench and `sealpost dispatch` run the same fleet.
pub fn spawn_fleet<B: Broker>(
    cfg: &Config,
    db: &Arc<dyn PgSource>,
    broker: &Arc<B>,
    dispatchers: usize,
    with_reconciler: bool,
    shutdown: &CancellationToken,
    counters: &Arc<Counters>,
) -> Vec<tokio::task::JoinHandle<Result<(), RunError>>> {
    let mut tasks: Vec<_> = (0..dispatchers)
        .map(|_| {
            tokio::spawn(dispatcher(
                cfg.clone(),
                db.clone(),
                broker.clone(),
                shutdown.clone(),
                counters.clone(),
            ))
        })
        .collect();
    if dispatchers > 0 {
        // One shadow reader per fleet: idle unless this implementation is a candidate.
        tasks.push(tokio::spawn(shadow(
            cfg.clone(),
            db.clone(),
            broker.clone(),
            shutdown.clone(),
        )));
    }
    if with_reconciler {
        tasks.push(tokio::spawn(reconciler(
            cfg.clone(),
            db.clone(),
            broker.clone(),
            shutdown.clone(),
            counters.clone(),
        )));
    }
    tasks
}
