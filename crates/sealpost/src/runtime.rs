//! The dispatcher and reconciler loops: claim in one short transaction, send with no
//! transaction open, accept receipts (or report outcomes) in one more. The loops are generic
//! over the broker port ([`Broker`]); they never see a broker's wire format. The
//! configuration is a plain struct: the `sealpost` command loads it from a TOML file, and
//! [`Config::apply_env`] applies `DATABASE_URL` / `NATS_URL`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sealpost_core::claim::SendOutcome;
use sealpost_core::port::{Broker, NeverSentReason, SendRequest, SendResult};
use sealpost_core::receipt::Receipt;
use sealpost_core::reconcile::Lookup;
use tokio_postgres::NoTls;

use crate::store::{self, OutcomeReport, Outgoing, StoreError};

/// Runtime configuration. Every field has a default; `DATABASE_URL` and `NATS_URL` override
/// the file ([`Config::apply_env`]).
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// PostgreSQL connection string.
    pub database_url: String,
    /// NATS URL.
    pub nats_url: String,
    /// Cluster identity of the NATS connection (frozen into destinations).
    pub nats_cluster: String,
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
    /// Reconciler scan interval.
    pub reconcile_every_ms: u64,
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
}

impl Default for Config {
    fn default() -> Self {
        Config {
            database_url: "host=127.0.0.1 user=postgres dbname=test".to_string(),
            nats_url: "nats://127.0.0.1:4222".to_string(),
            nats_cluster: "nats-local".to_string(),
            lease_ms: 10_000,
            batch_size_max: 500,
            ack_timeout_ms: 5_000,
            idle_poll_ms: 50,
            rejection_limit: 5,
            reconcile_batch_max: 200,
            reconcile_every_ms: 1_000,
            unknown_alert_s: 900,
            drill_pause_after_publish_ms: 0,
            consumer_ack_wait_ms: 10_000,
            drill_skip_consumer_ack: false,
        }
    }
}

/// Configuration errors name the offending key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
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
    /// Applies `DATABASE_URL` and `NATS_URL` from the environment, when set, over whatever
    /// the configuration says.
    pub fn apply_env(&mut self) {
        if let Ok(v) = std::env::var("DATABASE_URL") {
            self.database_url = v;
        }
        if let Ok(v) = std::env::var("NATS_URL") {
            self.nats_url = v;
        }
    }

    /// The defaults, then the environment ([`Config::apply_env`]), validated.
    pub fn from_env() -> Result<Config, ConfigError> {
        let mut c = Config::default();
        c.apply_env();
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
        if self.rejection_limit == 0 {
            return Err(ConfigError::Invalid {
                key: "rejection_limit",
                message: "must be at least 1".into(),
            });
        }
        Ok(())
    }
}

/// Errors of a running loop.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Store failure.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Broker adapter failure (connecting, managing a destination).
    #[error(transparent)]
    Broker(Box<dyn std::error::Error + Send + Sync>),
    /// Cannot connect to Postgres.
    #[error(
        "cannot connect to PostgreSQL ({url}): {source}; is it running, and is DATABASE_URL right?"
    )]
    Connect {
        /// URL.
        url: String,
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

/// Opens a Postgres connection and drives it on a task.
pub async fn pg_connect(url: &str) -> Result<tokio_postgres::Client, RunError> {
    let (client, conn) = tokio_postgres::connect(url, NoTls)
        .await
        .map_err(|source| RunError::Connect {
            url: url.to_string(),
            source,
        })?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::warn!(error = %e, "postgres connection closed");
        }
    });
    Ok(client)
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
}

/// A random owner id for this process/task.
pub fn owner_id() -> u64 {
    let u = uuid::Uuid::now_v7();
    let b = u.as_bytes();
    u64::from_be_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]])
        & 0x7fff_ffff_ffff_ffff
}

/// The instant after which no message of a claim may leave: the lease runs from the claim on
/// the database clock, so a local deadline taken from just before the claim transaction
/// started, less the acknowledgement timeout, ends no later than the lease (R9).
pub fn send_deadline(claim_started: Instant, cfg: &Config) -> Instant {
    claim_started + Duration::from_millis(cfg.lease_ms.saturating_sub(cfg.ack_timeout_ms))
}

/// One dispatcher: claims, sends through `broker`, accepts, until `stop` is set.
pub async fn dispatcher<B: Broker>(
    cfg: Config,
    broker: Arc<B>,
    stop: Arc<AtomicBool>,
    counters: Arc<Counters>,
) -> Result<(), RunError> {
    let mut pg = pg_connect(&cfg.database_url).await?;
    let owner = owner_id();
    tracing::info!(owner, "dispatcher started");
    while !stop.load(Ordering::Relaxed) {
        let t_claim = Instant::now();
        let batch = match store::claim_batch(&mut pg, owner, cfg.batch_size_max, cfg.lease_ms).await
        {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, "claim failed; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
                if pg.is_closed() {
                    pg = pg_connect(&cfg.database_url).await?;
                }
                continue;
            }
        };
        if batch.outgoing.is_empty() {
            tokio::time::sleep(Duration::from_millis(cfg.idle_poll_ms)).await;
            continue;
        }
        // No transaction is open here: the claim committed.
        let claim_ms = t_claim.elapsed().as_millis();
        let t_pub = Instant::now();
        let requests: Vec<SendRequest> =
            batch.outgoing.iter().map(Outgoing::send_request).collect();
        let results = broker
            .send_batch(requests, send_deadline(t_claim, &cfg))
            .await;
        let publish_ms = t_pub.elapsed().as_millis();
        if results.len() != batch.outgoing.len() {
            tracing::error!(
                sent = batch.outgoing.len(),
                results = results.len(),
                "broker adapter answered a different number of results; missing ones are unknown"
            );
        }
        if cfg.drill_pause_after_publish_ms > 0 {
            tracing::warn!(
                ms = cfg.drill_pause_after_publish_ms,
                "drill: pausing between publish and receipt"
            );
            tokio::time::sleep(Duration::from_millis(cfg.drill_pause_after_publish_ms)).await;
        }
        let mut receipts: Vec<Receipt> = Vec::new();
        let mut reports = Vec::new();
        // No connection to the broker: pause before the next claim instead of cycling the
        // backlog through "never sent" (a row's own backoff covers row-level causes).
        let mut pause = false;
        let results = results
            .into_iter()
            .chain(std::iter::repeat(SendResult::NoAnswer));
        for (o, r) in batch.outgoing.iter().zip(results) {
            let report = |outcome| OutcomeReport {
                event_id: o.event_id,
                member: o.member,
                token: o.token,
                attempt_id: o.attempt_id,
                outcome,
            };
            match r {
                SendResult::Receipt(rec) if rec.sequence != 0 => receipts.push(rec),
                // A receipt with sequence 0 proves nothing: treat as unknown.
                SendResult::Receipt(_) | SendResult::NoAnswer => {
                    reports.push(report(SendOutcome::AckTimeout));
                }
                // The broker holds a copy already (create-if-absent): the reconciler's lookup
                // finds it and accepts it through the acceptance point.
                SendResult::AlreadyStored => {
                    tracing::debug!(event_id = %o.event_id, "already stored at the broker; left to the reconciler");
                    reports.push(report(SendOutcome::AckTimeout));
                }
                SendResult::NeverSent(why) => {
                    tracing::warn!(event_id = %o.event_id, why = ?why, "never sent");
                    pause |= matches!(why, NeverSentReason::NotConnected(_));
                    reports.push(report(SendOutcome::NeverSent));
                }
                SendResult::Refused { kind, detail } => {
                    tracing::warn!(event_id = %o.event_id, kind = ?kind, detail, "refused by the broker");
                    reports.push(report(SendOutcome::Rejected));
                }
            }
        }
        let t_acc = Instant::now();
        submit(&cfg, &mut pg, &receipts, &reports, &counters).await?;
        tracing::debug!(
            rows = batch.outgoing.len(),
            claim_ms,
            publish_ms,
            accept_ms = t_acc.elapsed().as_millis() as u64,
            "dispatch batch"
        );
        if pause {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    tracing::info!(owner, "dispatcher stopped");
    Ok(())
}

/// Submits receipts and reports, retrying the transaction a bounded number of times; a
/// receipt that cannot be accepted now is left to the reconciler (the row stays
/// `SENDING`/unknown and its lookup fills the slot later).
async fn submit(
    cfg: &Config,
    pg: &mut tokio_postgres::Client,
    receipts: &[Receipt],
    reports: &[OutcomeReport],
    counters: &Counters,
) -> Result<(), RunError> {
    const TRIES_MAX: u32 = 5;
    for attempt in 1..=TRIES_MAX {
        let r = async {
            let accepted = if receipts.is_empty() {
                Vec::new()
            } else {
                store::accept_receipts(pg, receipts).await?
            };
            if !reports.is_empty() {
                store::report_outcomes(pg, reports, cfg.rejection_limit).await?;
            }
            Ok::<_, StoreError>(accepted)
        }
        .await;
        match r {
            Ok(accepted) => {
                for a in accepted {
                    match a {
                        store::Accepted::Verdict(sealpost_core::ReceiptVerdict::Primary) => {
                            counters.published.fetch_add(1, Ordering::Relaxed);
                        }
                        store::Accepted::Verdict(sealpost_core::ReceiptVerdict::Duplicate(_)) => {
                            counters.duplicates.fetch_add(1, Ordering::Relaxed);
                        }
                        _ => {}
                    }
                }
                counters
                    .unknown
                    .fetch_add(reports.len() as u64, Ordering::Relaxed);
                return Ok(());
            }
            Err(e) if attempt < TRIES_MAX => {
                tracing::warn!(error = %e, attempt, "receipt transaction failed; retrying");
                tokio::time::sleep(Duration::from_millis(100 * u64::from(attempt))).await;
                if pg.is_closed() {
                    *pg = pg_connect(&cfg.database_url).await?;
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "receipt transaction failed; the reconciler will look these up");
                return Ok(());
            }
        }
    }
    Ok(())
}

/// The reconciler loop (R13–R14): asks `broker` about each unknown outcome.
pub async fn reconciler<B: Broker>(
    cfg: Config,
    broker: Arc<B>,
    stop: Arc<AtomicBool>,
    counters: Arc<Counters>,
) -> Result<(), RunError> {
    let mut pg = pg_connect(&cfg.database_url).await?;
    let owner = owner_id();
    while !stop.load(Ordering::Relaxed) {
        let items =
            match store::claim_unknown(&mut pg, owner, cfg.reconcile_batch_max, cfg.lease_ms).await
            {
                Ok(i) => i,
                Err(e) => {
                    tracing::warn!(error = %e, "reconcile claim failed");
                    tokio::time::sleep(Duration::from_millis(cfg.reconcile_every_ms)).await;
                    continue;
                }
            };
        for it in &items {
            // Another cluster's destination cannot be asked here: nothing is learned.
            let lookup = if it.destination.cluster == broker.cluster() {
                broker.lookup(&it.destination, it.event_id, it.member).await
            } else {
                Lookup::Unavailable
            };
            match store::finish_reconcile(&mut pg, it, &lookup).await {
                Ok(d) => {
                    tracing::info!(event_id = %it.event_id, decision = ?d, "reconciled");
                    counters.reconciled.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => tracing::warn!(event_id = %it.event_id, error = %e, "reconcile failed"),
            }
        }
        if items.is_empty() {
            if let Ok((unknown, oldest_unknown_s)) = store::unknown_age(&pg).await {
                if oldest_unknown_s > cfg.unknown_alert_s as f64 {
                    tracing::error!(
                        unknown,
                        oldest_unknown_s,
                        threshold_s = cfg.unknown_alert_s,
                        "ALERT: unknown outcomes older than the threshold"
                    );
                }
            }
            tokio::time::sleep(Duration::from_millis(cfg.reconcile_every_ms)).await;
        }
    }
    Ok(())
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
