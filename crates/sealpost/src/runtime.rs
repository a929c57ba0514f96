//! The dispatcher and reconciler loops: claim in one short transaction, send with no
//! transaction open, accept receipts (or report outcomes) in one more. Configuration comes
//! from a TOML file and the environment.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sealpost_core::claim::SendOutcome;
use sealpost_core::receipt::Receipt;
use tokio_postgres::NoTls;

use crate::nats::{Nats, PublishResult};
use crate::store::{self, OutcomeReport, StoreError};

/// Runtime configuration. Every field has a default; `DATABASE_URL` and `NATS_URL` override
/// the file.
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
    /// Unreadable file.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// Path.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
    /// Malformed TOML or a bad key.
    #[error("config file {path}: {message}")]
    Parse {
        /// Path.
        path: String,
        /// Parser message (names the key).
        message: String,
    },
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
    /// Loads defaults, then the file (if given), then `DATABASE_URL` / `NATS_URL`.
    pub fn load(path: Option<&str>) -> Result<Config, ConfigError> {
        let mut c = match path {
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|source| ConfigError::Read {
                    path: p.to_string(),
                    source,
                })?;
                toml::from_str::<Config>(&text).map_err(|e| ConfigError::Parse {
                    path: p.to_string(),
                    message: e.to_string(),
                })?
            }
            None => Config::default(),
        };
        if let Ok(v) = std::env::var("DATABASE_URL") {
            c.database_url = v;
        }
        if let Ok(v) = std::env::var("NATS_URL") {
            c.nats_url = v;
        }
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
    /// Broker connection failure.
    #[error(transparent)]
    Nats(#[from] crate::nats::NatsError),
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

/// One dispatcher: claims, publishes, accepts, until `stop` is set.
pub async fn dispatcher(
    cfg: Config,
    nats: Nats,
    stop: Arc<AtomicBool>,
    counters: Arc<Counters>,
) -> Result<(), RunError> {
    let mut pg = pg_connect(&cfg.database_url).await?;
    let owner = owner_id();
    tracing::info!(owner, "dispatcher started");
    while !stop.load(Ordering::Relaxed) {
        let t_claim = std::time::Instant::now();
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
        let t_pub = std::time::Instant::now();
        let results = nats.publish_batch(&batch.outgoing).await;
        let publish_ms = t_pub.elapsed().as_millis();
        if cfg.drill_pause_after_publish_ms > 0 {
            tracing::warn!(
                ms = cfg.drill_pause_after_publish_ms,
                "drill: pausing between publish and receipt"
            );
            tokio::time::sleep(Duration::from_millis(cfg.drill_pause_after_publish_ms)).await;
        }
        let mut receipts: Vec<Receipt> = Vec::new();
        let mut reports = Vec::new();
        for (o, r) in batch.outgoing.iter().zip(results) {
            match r {
                PublishResult::Ack(rec) if rec.sequence != 0 => receipts.push(rec),
                // A duplicate ack with sequence 0 proves nothing: treat as unknown.
                PublishResult::Ack(_) | PublishResult::Timeout => reports.push(OutcomeReport {
                    event_id: o.event_id,
                    member: o.member,
                    token: o.token,
                    attempt_id: o.attempt_id,
                    outcome: SendOutcome::AckTimeout,
                }),
                PublishResult::NeverSent(why) => {
                    tracing::warn!(event_id = %o.event_id, why, "publish refused before sending");
                    reports.push(OutcomeReport {
                        event_id: o.event_id,
                        member: o.member,
                        token: o.token,
                        attempt_id: o.attempt_id,
                        outcome: SendOutcome::NeverSent,
                    })
                }
            }
        }
        let t_acc = std::time::Instant::now();
        submit(&cfg, &mut pg, &receipts, &reports, &counters).await?;
        tracing::debug!(
            rows = batch.outgoing.len(),
            claim_ms,
            publish_ms,
            accept_ms = t_acc.elapsed().as_millis() as u64,
            "dispatch batch"
        );
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

/// The reconciler loop (R13–R14).
pub async fn reconciler(
    cfg: Config,
    nats: Nats,
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
            let lookup = if it.destination.cluster == nats.cluster {
                nats.lookup(&it.destination.topic, it.event_id, it.member)
                    .await
            } else {
                sealpost_core::reconcile::Lookup::Unavailable
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

/// The example fulfilment consumer (`sealpost consume`): a durable JetStream pull consumer
/// whose effect is a row in `demo_fulfilment`, applied through the inbox. The broker message
/// is acked only after the inbox transaction commits.
pub async fn consumer(
    cfg: Config,
    nats: Nats,
    consumer_id: String,
    topic: String,
    stop: Arc<AtomicBool>,
    consumed: Arc<AtomicU64>,
) -> Result<(), RunError> {
    use async_nats::jetstream::consumer::{pull, AckPolicy};
    use futures::StreamExt;
    let mut pg = pg_connect(&cfg.database_url).await?;
    crate::demo::prepare(&pg).await?;
    let stream = nats
        .js
        .get_stream(&topic)
        .await
        .map_err(|e| crate::nats::NatsError::Stream {
            stream: topic.clone(),
            detail: e.to_string(),
        })?;
    let jc = stream
        .get_or_create_consumer(
            &consumer_id,
            pull::Config {
                durable_name: Some(consumer_id.clone()),
                filter_subject: format!("sp.{topic}.>"),
                ack_policy: AckPolicy::Explicit,
                ack_wait: Duration::from_millis(cfg.consumer_ack_wait_ms),
                max_ack_pending: 20_000,
                ..Default::default()
            },
        )
        .await
        .map_err(|e| crate::nats::NatsError::Stream {
            stream: topic.clone(),
            detail: e.to_string(),
        })?;
    while !stop.load(Ordering::Relaxed) {
        let batch = jc
            .fetch()
            .max_messages(500)
            .expires(Duration::from_millis(300))
            .messages()
            .await;
        let mut batch = match batch {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, "fetch failed; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        while let Some(msg) = batch.next().await {
            let Ok(msg) = msg else { break };
            let Some(d) = delivery_of(&msg) else {
                tracing::error!(subject = %msg.subject, "message without Sealpost headers; terminating it");
                let _ = msg.ack_with(async_nats::jetstream::AckKind::Term).await;
                continue;
            };
            let order_id = serde_json::from_slice::<serde_json::Value>(&msg.payload)
                .ok()
                .and_then(|v| {
                    v.get("order_id")
                        .and_then(|o| o.as_str())
                        .map(str::to_string)
                })
                .unwrap_or_default();
            let key = sealpost_core::inbox::idempotency_key(d.event_id, &consumer_id, "fulfil");
            let cid = consumer_id.clone();
            let eid = uuid::Uuid::from_bytes(d.event_id.0);
            let effect: crate::inbox::Effect<'_> = Box::new(move |tx| {
                Box::pin(async move {
                    tx.execute(
                        "INSERT INTO demo_fulfilment (consumer_id, event_id, order_id, idempotency_key)
                         VALUES ($1, $2, $3, $4)",
                        &[&cid, &eid, &order_id, &key],
                    )
                    .await
                    .map(|_| ())
                })
            });
            match crate::inbox::process(&mut pg, &consumer_id, &d, effect).await {
                Ok(outcome) => {
                    if matches!(outcome, crate::inbox::InboxOutcome::Applied { .. }) {
                        consumed.fetch_add(1, Ordering::Relaxed);
                    }
                    if cfg.drill_skip_consumer_ack {
                        continue; // drill: committed, then the ack is "lost"
                    }
                    if let Err(e) = msg.ack().await {
                        tracing::warn!(error = %e, "ack lost; the broker will redeliver and the inbox absorbs it");
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "inbox transaction failed; leaving the message for redelivery");
                    if pg.is_closed() {
                        pg = pg_connect(&cfg.database_url).await?;
                    }
                }
            }
        }
    }
    Ok(())
}

/// Reads the Sealpost headers of a delivered message and digests its payload.
pub fn delivery_of(msg: &async_nats::jetstream::Message) -> Option<crate::inbox::Delivery> {
    use crate::nats::{H_EVENT_ID, H_MEMBER, H_PAYLOAD_DIGEST};
    let h = msg.headers.as_ref()?;
    let get = |n: &str| h.get(n).map(|v| v.as_str().to_string());
    let info = msg.info().ok()?;
    Some(crate::inbox::Delivery {
        event_id: sealpost_core::envelope::EventId::parse(&get(H_EVENT_ID)?)?,
        member: get(H_MEMBER)?.parse().ok()?,
        claimed_digest: sealpost_core::Digest::from_hex(&get(H_PAYLOAD_DIGEST)?)?,
        payload_digest: sealpost_core::Digest::of_bytes(
            sealpost_core::envelope::PAYLOAD_DOMAIN,
            &msg.payload,
        ),
        stream: info.stream.to_string(),
        sequence: info.stream_sequence,
    })
}

/// Spawns `dispatchers` dispatcher tasks and, if asked, one reconciler beside them, all
/// stopping on `stop`. The demo, the bench and `sealpost dispatch` run the same fleet.
pub fn spawn_fleet(
    cfg: &Config,
    nats: &Nats,
    dispatchers: usize,
    with_reconciler: bool,
    stop: &Arc<AtomicBool>,
    counters: &Arc<Counters>,
) -> Vec<tokio::task::JoinHandle<Result<(), RunError>>> {
    let mut tasks: Vec<_> = (0..dispatchers)
        .map(|_| {
            tokio::spawn(dispatcher(
                cfg.clone(),
                nats.clone(),
                stop.clone(),
                counters.clone(),
            ))
        })
        .collect();
    if with_reconciler {
        tasks.push(tokio::spawn(reconciler(
            cfg.clone(),
            nats.clone(),
            stop.clone(),
            counters.clone(),
        )));
    }
    tasks
}
