//! The CDC publisher (R32): the database log names the committed envelope rows, the same
//! claim, send and acceptance point publish them.
//!
//! A polling dispatcher finds work by scanning the claim index; the CDC publisher reads it
//! from a logical replication slot instead (`pgoutput`, over a publication of the sealed
//! envelope table's inserts for one destination cluster: the envelope table is insert-only,
//! so the log carries each event once, in commit order). What it decodes are keys only
//! (event, member, generation); the rows' state stays in the work table, and each key goes
//! through the dispatcher machine's claim (fenced, leased, with the ordering rule of R29),
//! send and receipt transaction like a polled row. Nothing about acceptance changes: the
//! receipt transaction stays the sole acceptance point, so a CDC publisher and polling
//! dispatchers running side by side never accept an event twice.
//!
//! The slot's confirmed position is the publisher's promise: it advances past a transaction
//! only once every row it inserted is *settled* — published, quarantined, parked, or unknown
//! and handed to the reconciler ([`sealpost_core::cdc::LogWindow`] holds that rule, and the
//! simulator runs the same type). A publisher killed at any point restarts from the slot,
//! reads the unconfirmed transactions again, and finds their rows settled or claimable: no
//! event is lost, a repeat is absorbed by the claim and the acceptance point.
//!
//! Faults it is built for:
//! * **A full window** (broker down, a slow database): the reader stops reading; the server
//!   keeps the log in the slot. Memory is bounded by [`CdcConfig::window_bytes_max`].
//! * **Idle outbox, busy database**: keepalives and row-less transactions confirm the
//!   position behind an empty window, so the slot does not hold the server's log.
//! * **A dropped or invalidated slot**: an `ALERT`, and the publisher claims by scanning the
//!   claim index from then on, as a polling dispatcher does; the next start creates the slot
//!   again and catches up by scanning first. Never a silent gap: a scan of the claim index
//!   runs every [`CdcConfig::sweep_every_ms`] whatever the window holds
//!   ([`sealpost_core::cdc::ClaimSource`]), so a row the log never named (committed before
//!   the slot existed) or no longer names (sent back by the reconciler, released by an
//!   operator) is published all the same.
//! * **A schema change of the envelope table**: the reader maps columns by name from each
//!   relation message, so added columns change nothing; a missing key column is an error.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pg_walstream::{LogicalReplicationMessage, LogicalReplicationParser};
use pgwire_replication::{Lsn, ReplicationClient, ReplicationConfig, ReplicationEvent};
use sealpost_core::cdc::{
    check_of, lsn_text, parse_lsn, ClaimFrom, ClaimSource, LogWindow, RowCheck, RowKey, Seen,
    WindowFigures,
};
use sealpost_core::port::Broker;
use sealpost_core::EventId;
use tokio::sync::Notify;

use crate::observe;
use crate::pg::PgSource;
use crate::runtime::{dispatch_loop, CancellationToken, Config, Counters, RunError};
use crate::secret;
use crate::store::{self, ClaimBatch, ClaimRequest, Held, StoreError};

/// The CDC publisher's settings (the `[cdc]` table of the configuration file).
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CdcConfig {
    /// Replication slot name (empty: `sealpost_cdc_<cluster>`, the cluster's name in lower
    /// case with every other character than `a-z`, `0-9` as `_`).
    pub slot: String,
    /// Publication name (empty: the slot's name).
    pub publication: String,
    /// Bytes of decoded, unconfirmed keys the publisher holds at most; while the window is
    /// full it reads no further and the server keeps the log.
    pub window_bytes_max: usize,
    /// How often the state of offered rows is checked (and the position confirmed).
    pub check_every_ms: u64,
    /// A scan of the claim index runs this often whatever the log names (and, at start and
    /// while the slot is gone, whenever the last one found work), so rows the log never named
    /// or no longer names are published too.
    pub sweep_every_ms: u64,
    /// How often the confirmed position is reported to the server at most.
    pub status_interval_ms: u64,
    /// Cleanup keeps rows created up to this long before the oldest unconfirmed transaction
    /// (the longest transaction that enqueues events: its rows are created before it
    /// commits).
    pub hold_margin_ms: u64,
}

impl Default for CdcConfig {
    fn default() -> Self {
        CdcConfig {
            slot: String::new(),
            publication: String::new(),
            window_bytes_max: 8 << 20,
            check_every_ms: 20,
            sweep_every_ms: 10_000,
            status_interval_ms: 1_000,
            hold_margin_ms: 3_600_000,
        }
    }
}

/// Slot and publication of one cluster's CDC publisher.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CdcNames {
    /// Replication slot.
    pub slot: String,
    /// Publication.
    pub publication: String,
}

impl CdcConfig {
    /// The names this configuration gives `cluster`'s publisher.
    pub fn names(&self, cluster: &str) -> CdcNames {
        let slot = if self.slot.is_empty() {
            let mut s = String::from("sealpost_cdc_");
            s.extend(cluster.chars().map(|c| match c.to_ascii_lowercase() {
                c @ ('a'..='z' | '0'..='9') => c,
                _ => '_',
            }));
            s.truncate(63);
            s
        } else {
            self.slot.clone()
        };
        let publication = if self.publication.is_empty() {
            slot.clone()
        } else {
            self.publication.clone()
        };
        CdcNames { slot, publication }
    }
}

/// Why the CDC publisher cannot run.
#[derive(Debug, thiserror::Error)]
pub enum CdcError {
    /// The server does not write a logical log.
    #[error("the server's wal_level is `{0}`; CDC needs wal_level = logical (set it in postgresql.conf and restart the server), or run polling dispatchers (`sealpost dispatch`) instead")]
    WalLevel(String),
    /// A name is not usable as a slot or publication name.
    #[error(
        "`{0}` is not a usable slot or publication name: use 1 to 63 characters of a-z, 0-9 and _"
    )]
    Name(String),
    /// The database refused a setup step.
    #[error("cannot {step}: {detail}; the CDC publisher's login needs the REPLICATION attribute, and the publication must be created by the owner of sealpost.envelope (or run `sealpost cdc --setup` as it once)")]
    Setup {
        /// What was being done.
        step: &'static str,
        /// The server's words.
        detail: String,
    },
    /// The slot the publisher used is gone or invalidated.
    #[error("replication slot `{slot}` {what}; the publisher claims by scanning the claim index instead (no event is lost); start it again to create a new slot")]
    SlotLost {
        /// The slot.
        slot: String,
        /// What happened to it.
        what: String,
    },
    /// The replication stream failed.
    #[error("replication stream: {0}")]
    Stream(String),
    /// A store step failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<tokio_postgres::Error> for CdcError {
    fn from(e: tokio_postgres::Error) -> Self {
        CdcError::Store(StoreError::from(e))
    }
}

fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 63
        && n.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

/// What [`setup`] found or made.
#[derive(Clone, Debug)]
pub struct SlotStart {
    /// The slot's confirmed position: where reading resumes.
    pub confirmed_lsn: u64,
    /// The slot was created now (first start, or after it was lost).
    pub created: bool,
    /// The slot had been lost before (its progress row outlived it).
    pub was_lost: bool,
}

/// Checks the server writes a logical log, creates the publication (the envelope table's
/// inserts for `cluster`, key columns only) and the slot if they are missing, and records
/// the slot in `sealpost.cdc_progress`. Safe to run again.
pub async fn setup(
    client: &mut tokio_postgres::Client,
    names: &CdcNames,
    cluster: &str,
) -> Result<SlotStart, CdcError> {
    for n in [&names.slot, &names.publication] {
        if !valid_name(n) {
            return Err(CdcError::Name(n.clone()));
        }
    }
    let level: String = client.query_one("SHOW wal_level", &[]).await?.get(0);
    if level != "logical" {
        return Err(CdcError::WalLevel(level));
    }
    let setup_err = |step: &'static str| {
        move |e: tokio_postgres::Error| CdcError::Setup {
            step,
            detail: e
                .as_db_error()
                .map_or_else(|| e.to_string(), |d| d.message().to_string()),
        }
    };
    let has_pub = client
        .query_opt(
            "SELECT 1 FROM pg_publication WHERE pubname = $1",
            &[&names.publication],
        )
        .await?
        .is_some();
    if !has_pub {
        // Keys only (the payload stays in the table), inserts only (the envelope is never
        // updated; retention's payload erasure is no event), this cluster's rows only.
        let cluster_lit = cluster.replace('\'', "''");
        client
            .batch_execute(&format!(
                "CREATE PUBLICATION {} FOR TABLE sealpost.envelope
                   (event_id, member, envelope_generation, dest_cluster)
                   WHERE (dest_cluster = '{cluster_lit}') WITH (publish = 'insert')",
                names.publication
            ))
            .await
            .map_err(setup_err("create the publication"))?;
        tracing::info!(publication = %names.publication, %cluster, "CDC publication created");
    }
    let recorded = client
        .query_opt(
            "SELECT confirmed_lsn::text FROM sealpost.cdc_progress WHERE slot_name = $1",
            &[&names.slot],
        )
        .await?
        .is_some();
    let slot = client
        .query_opt(
            "SELECT confirmed_flush_lsn::text, coalesce(wal_status, '') FROM pg_replication_slots
             WHERE slot_name = $1",
            &[&names.slot],
        )
        .await?;
    let (confirmed, created) = match slot {
        Some(r) => {
            let status: String = r.get(1);
            if status == "lost" {
                return Err(CdcError::SlotLost {
                    slot: names.slot.clone(),
                    what: "was invalidated by the server (max_slot_wal_keep_size); drop it (`sealpost cdc --drop`) so the next start creates it again".into(),
                });
            }
            let lsn: Option<String> = r.get(0);
            (lsn.as_deref().and_then(parse_lsn).unwrap_or(0), false)
        }
        None => {
            let r = client
                .query_one(
                    "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')",
                    &[&names.slot],
                )
                .await
                .map_err(setup_err("create the replication slot"))?;
            let lsn: String = r.get(0);
            (parse_lsn(&lsn).unwrap_or(0), true)
        }
    };
    if created && recorded {
        tracing::error!(slot = %names.slot, "ALERT: the CDC slot was gone (dropped, or lost with a restored database) and was created again; the events committed meanwhile are published by the catch-up scan, not by the log");
    }
    client
        .execute(
            "INSERT INTO sealpost.cdc_progress
               (slot_name, cluster, publication, created_at_ms, confirmed_lsn, confirmed_at_ms, updated_at_ms)
             VALUES ($1, $2, $3, (extract(epoch from clock_timestamp()) * 1000)::bigint, $4::text::pg_lsn,
                     (extract(epoch from clock_timestamp()) * 1000)::bigint,
                     (extract(epoch from clock_timestamp()) * 1000)::bigint)
             ON CONFLICT (slot_name) DO UPDATE SET cluster = EXCLUDED.cluster,
               publication = EXCLUDED.publication, updated_at_ms = EXCLUDED.updated_at_ms,
               created_at_ms = CASE WHEN $5 THEN EXCLUDED.created_at_ms ELSE sealpost.cdc_progress.created_at_ms END",
            &[&names.slot, &cluster, &names.publication, &lsn_text(confirmed), &created],
        )
        .await?;
    Ok(SlotStart {
        confirmed_lsn: confirmed,
        created,
        was_lost: created && recorded,
    })
}

/// Drops the slot, the publication and the progress row of `names` (the operator's
/// `sealpost cdc --drop`: a publisher that will not run again must not hold the server's log
/// or cleanup). Rows it had not published stay `PENDING` for the polling dispatchers.
pub async fn drop_slot(
    client: &mut tokio_postgres::Client,
    names: &CdcNames,
) -> Result<(), CdcError> {
    client
        .execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1",
            &[&names.slot],
        )
        .await?;
    if valid_name(&names.publication) {
        client
            .batch_execute(&format!("DROP PUBLICATION IF EXISTS {}", names.publication))
            .await?;
    }
    client
        .execute(
            "DELETE FROM sealpost.cdc_progress WHERE slot_name = $1",
            &[&names.slot],
        )
        .await?;
    Ok(())
}

/// What the dispatcher loop and the log reader share: the window, and the choice between the
/// log and a scan ([`ClaimSource`], the core's rule, which the simulator runs too).
pub struct LogScope {
    window: Mutex<LogWindow>,
    source: Mutex<ClaimSource>,
    epoch: Instant,
    counters: Arc<Counters>,
    /// New rows to offer: wakes the dispatcher machine.
    pub(crate) ready: Notify,
    /// Rows left the window: wakes a reader that stopped on a full window.
    room: Notify,
}

impl LogScope {
    fn new(confirmed_lsn: u64, cfg: &CdcConfig, counters: Arc<Counters>) -> LogScope {
        LogScope {
            window: Mutex::new(LogWindow::new(confirmed_lsn, cfg.window_bytes_max)),
            // The first claims scan: whatever committed before the slot's position (a new
            // slot, a slot recreated after a loss, rows released by an operator) is found.
            source: Mutex::new(ClaimSource::new(cfg.sweep_every_ms)),
            epoch: Instant::now(),
            counters,
            ready: Notify::new(),
            room: Notify::new(),
        }
    }

    fn window(&self) -> std::sync::MutexGuard<'_, LogWindow> {
        self.window.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn source(&self) -> std::sync::MutexGuard<'_, ClaimSource> {
        self.source.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// The window's figures now.
    pub fn figures(&self) -> WindowFigures {
        self.window().figures()
    }

    fn lose_log(&self) {
        self.source().lose_log();
        self.ready.notify_one();
    }

    /// The dispatcher machine's claim, from where [`ClaimSource::choose`] says: the rows the
    /// log named, a scan of the claim index (`scan`, the machine's own request), or nothing.
    pub(crate) async fn claim(
        &self,
        client: &mut tokio_postgres::Client,
        scan: &ClaimRequest<'_>,
        held: &mut Held,
    ) -> Result<ClaimBatch, StoreError> {
        let from = {
            let source = self.source();
            let mut window = self.window();
            source.choose(self.now_ms(), &mut window, scan.batch_size_max)
        };
        match from {
            ClaimFrom::Log(offered) => {
                let req = ClaimRequest {
                    from_position: 0,
                    ..*scan
                }
                .only(&offered);
                let mut batch = store::claim(client, &req, Some(held)).await?;
                // A claim of named rows says nothing about the scan position.
                batch.last_position = None;
                batch.ordered_from = None;
                observe::record_cdc_claim(offered.len(), batch.outgoing.len());
                self.counters.from_log.fetch_add(
                    batch.outgoing.len() as u64,
                    std::sync::atomic::Ordering::Relaxed,
                );
                Ok(batch)
            }
            ClaimFrom::Nothing => Ok(ClaimBatch {
                db_now_ms: held.db_now_ms().unwrap_or(0),
                ..ClaimBatch::default()
            }),
            ClaimFrom::Scan => {
                let batch = store::claim(client, scan, Some(held)).await?;
                let found = !batch.outgoing.is_empty() || batch.last_position.is_some();
                self.source().scanned(self.now_ms(), found);
                Ok(batch)
            }
        }
    }
}

/// The CDC publisher for `broker`'s cluster: sets up the slot ([`setup`]), then runs the log
/// reader and a dispatcher loop over the window until `shutdown`. Rows in hand are sent and
/// submitted before it returns; the slot keeps what was not confirmed.
pub async fn publisher<B: Broker>(
    cfg: Config,
    db: Arc<dyn PgSource>,
    broker: Arc<B>,
    shutdown: CancellationToken,
    counters: Arc<Counters>,
) -> Result<(), RunError> {
    let cluster = broker.cluster().to_string();
    let names = cfg.cdc.names(&cluster);
    let mut pg = db.connect().await?;
    let start = setup(&mut pg, &names, &cluster)
        .await
        .map_err(|e| RunError::Config(e.to_string()))?;
    drop(pg);
    tracing::info!(slot = %names.slot, publication = %names.publication, %cluster,
        confirmed = %lsn_text(start.confirmed_lsn), created = start.created, "CDC publisher started");
    let scope = Arc::new(LogScope::new(
        start.confirmed_lsn,
        &cfg.cdc,
        counters.clone(),
    ));
    let reader = tokio::spawn(read_log(
        cfg.clone(),
        db.clone(),
        names.clone(),
        scope.clone(),
        shutdown.clone(),
    ));
    let dispatched = dispatch_loop(cfg, db, broker, shutdown.clone(), counters, Some(scope)).await;
    shutdown.cancel();
    match reader.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "CDC log reader ended with an error"),
        Err(e) => tracing::error!(error = %e, "CDC log reader failed"),
    }
    dispatched
}

/// The replication connection's settings from the connection string (host, port, user,
/// password, database). The replication connection speaks plaintext only: `sslmode=require`
/// and stricter are refused with what to do, `prefer` is logged as plaintext.
fn replication_config(
    url: &str,
    names: &CdcNames,
    start: u64,
    cfg: &CdcConfig,
) -> Result<ReplicationConfig, CdcError> {
    let tls = crate::tls::pg_tls(url).map_err(|e| CdcError::Stream(e.to_string()))?;
    let c = &tls.config;
    let host = match c.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        #[cfg(unix)]
        Some(tokio_postgres::config::Host::Unix(p)) => p.display().to_string(),
        None => "localhost".to_string(),
    };
    let port = c.get_ports().first().copied().unwrap_or(5432);
    let user = c.get_user().unwrap_or("postgres").to_string();
    let password = c
        .get_password()
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .unwrap_or_default();
    let database = c.get_dbname().unwrap_or(&user).to_string();
    use crate::tls::SslMode as M;
    match tls.mode {
        M::Disable => {}
        M::Prefer => tracing::warn!(
            "the CDC replication connection does not use TLS (sslmode=prefer: plaintext); it carries event keys and positions only, no payloads"
        ),
        M::Require | M::VerifyCa | M::VerifyFull => {
            return Err(CdcError::Stream(format!(
                "sslmode={} is not supported on the CDC publisher's replication connection yet (it speaks plaintext only); run the publisher where sslmode=disable or prefer is acceptable (the database host, a private network), or use polling dispatchers",
                tls.mode.as_str()
            )))
        }
    }
    Ok(ReplicationConfig::new(
        host,
        user,
        password,
        database,
        names.slot.clone(),
        names.publication.clone(),
    )
    .with_port(port)
    .with_start_lsn(Lsn::from_u64(start))
    .with_status_interval(Duration::from_millis(cfg.status_interval_ms))
    .with_wakeup_interval(Duration::from_secs(5))
    .with_buffer_size(1024)
    .with_application_name("sealpost-cdc"))
}

/// Which columns of a relation carry the key, if it is the envelope table.
#[derive(Clone, Copy, Debug)]
struct KeyColumns {
    event_id: usize,
    member: usize,
}

/// Reads the log into the window and confirms what settled, until `shutdown`; reconnects
/// (with backoff) when the stream or the database breaks; on a lost slot, hands everything
/// to the scans and ends.
async fn read_log(
    cfg: Config,
    db: Arc<dyn PgSource>,
    names: CdcNames,
    scope: Arc<LogScope>,
    shutdown: CancellationToken,
) -> Result<(), CdcError> {
    let mut backoff = Duration::from_millis(cfg.error_backoff_ms.max(10));
    loop {
        if shutdown.is_cancelled() {
            return Ok(());
        }
        match stream_once(&cfg, &*db, &names, &scope, &shutdown).await {
            Ok(()) => return Ok(()),
            Err(e @ CdcError::SlotLost { .. }) => {
                tracing::error!(error = %e, "ALERT: CDC slot lost");
                scope.lose_log();
                return Err(e);
            }
            Err(e) => {
                tracing::warn!(error = %e, wait_ms = backoff.as_millis() as u64, "CDC log reader failed; reconnecting from the slot's confirmed position");
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = shutdown.cancelled() => return Ok(()),
                }
                backoff =
                    (backoff * 2).min(Duration::from_millis(cfg.error_backoff_max_ms.max(10)));
            }
        }
    }
}

/// Whether a failure says the slot is gone for good.
fn slot_gone(detail: &str) -> Option<String> {
    if detail.contains("does not exist") && detail.contains("slot") {
        Some("does not exist (dropped)".into())
    } else if detail.contains("can no longer get changes") || detail.contains("invalidated") {
        Some("was invalidated by the server (it removed log the slot still needed)".into())
    } else {
        None
    }
}

async fn stream_once(
    cfg: &Config,
    db: &dyn PgSource,
    names: &CdcNames,
    scope: &LogScope,
    shutdown: &CancellationToken,
) -> Result<(), CdcError> {
    let mut pg = db
        .connect()
        .await
        .map_err(|e| CdcError::Stream(e.to_string()))?;
    let confirmed = scope.window().confirmed_lsn();
    let rc = replication_config(&cfg.database_url, names, confirmed, &cfg.cdc)?;
    let lost = |e: &dyn std::fmt::Display| {
        let detail = secret::scrub(&e.to_string(), &[&rc.password]);
        match slot_gone(&detail) {
            Some(what) => CdcError::SlotLost {
                slot: names.slot.clone(),
                what,
            },
            None => CdcError::Stream(detail),
        }
    };
    let mut client = ReplicationClient::connect(rc.clone())
        .await
        .map_err(|e| lost(&e))?;
    client.wait_started().await.map_err(|e| lost(&e))?;
    tracing::info!(slot = %names.slot, from = %lsn_text(confirmed), "CDC log stream started");
    let mut parser = LogicalReplicationParser::with_protocol_version(1);
    let mut relations: HashMap<u32, Option<KeyColumns>> = HashMap::new();
    let mut txn: Option<(u64, Vec<RowKey>)> = None;
    let mut check = tokio::time::interval(Duration::from_millis(cfg.cdc.check_every_ms.max(1)));
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut reported = confirmed;
    let mut last_record = Instant::now();
    loop {
        let has_room = scope.window().has_room();
        tokio::select! {
            _ = shutdown.cancelled() => {
                let _ = client.shutdown().await;
                return Ok(());
            }
            ev = client.recv(), if has_room => {
                let ev = ev.map_err(|e| lost(&e))?;
                let Some(ev) = ev else { return Err(CdcError::Stream("the server ended the stream".into())) };
                match ev {
                    ReplicationEvent::Begin { commit_time_micros, .. } => {
                        txn = Some((pg_time_ms(commit_time_micros), Vec::new()));
                    }
                    ReplicationEvent::XLogData { data, .. } => {
                        let msg = parser
                            .parse_wal_message(&data)
                            .map_err(|e| CdcError::Stream(format!("undecodable pgoutput message: {e}")))?;
                        match msg.message {
                            LogicalReplicationMessage::Relation { relation_id, namespace, relation_name, columns, .. } => {
                                let key = if &*namespace == "sealpost" && &*relation_name == "envelope" {
                                    let at = |n: &str| columns.iter().position(|c| &*c.name == n);
                                    match (at("event_id"), at("member")) {
                                        (Some(event_id), Some(member)) => Some(KeyColumns { event_id, member }),
                                        _ => return Err(CdcError::Stream(format!(
                                            "publication {} no longer carries sealpost.envelope's event_id and member; recreate it (`sealpost cdc --drop`, then start again)",
                                            names.publication))),
                                    }
                                } else {
                                    None
                                };
                                relations.insert(relation_id, key);
                            }
                            LogicalReplicationMessage::Insert { relation_id, tuple } => {
                                let Some(Some(k)) = relations.get(&relation_id).copied() else { continue };
                                let col = |i: usize| tuple.columns.get(i).and_then(|c| c.as_str()).map(|s| s.to_string());
                                let event = col(k.event_id).and_then(|s| uuid::Uuid::parse_str(&s).ok());
                                let member = col(k.member).and_then(|s| s.parse::<u16>().ok());
                                match (event, member, txn.as_mut()) {
                                    (Some(e), Some(m), Some((_, rows))) => rows.push((EventId(*e.as_bytes()), m)),
                                    _ => return Err(CdcError::Stream("an envelope insert without a readable key, or outside a transaction".into())),
                                }
                            }
                            _ => {}
                        }
                    }
                    ReplicationEvent::Commit { end_lsn, .. } => {
                        let (commit_ms, rows) = txn.take().unwrap_or_default();
                        let named = !rows.is_empty();
                        scope.window().push(end_lsn.as_u64(), commit_ms, rows);
                        if named {
                            scope.ready.notify_one();
                        }
                    }
                    ReplicationEvent::KeepAlive { wal_end, .. } => {
                        scope.window().idle_up_to(wal_end.as_u64());
                    }
                    ReplicationEvent::Message { .. } => {}
                    ReplicationEvent::StoppedAt { .. } => return Ok(()),
                }
            }
            _ = scope.room.notified(), if !has_room => {}
            _ = check.tick() => {
                let offered = scope.window().offered(1_000);
                if !offered.is_empty() {
                    let found = check_rows(&mut pg, &offered).await?;
                    let reopened = found.iter().any(|(_, c)| *c == RowCheck::Waiting);
                    scope.window().checked(&found);
                    if reopened {
                        scope.ready.notify_one();
                    }
                }
                let moved = scope.window().confirm();
                if let Some(lsn) = moved {
                    client.update_applied_lsn(Lsn::from_u64(lsn));
                    scope.room.notify_one();
                }
                let f = scope.figures();
                observe::record_cdc_window(&f);
                if f.confirmed_lsn != reported || last_record.elapsed() >= Duration::from_millis(cfg.cdc.status_interval_ms) {
                    record_progress(&mut pg, &names.slot, &f, cfg.cdc.hold_margin_ms).await?;
                    reported = f.confirmed_lsn;
                    last_record = Instant::now();
                }
            }
        }
    }
}

/// PostgreSQL's commit timestamps count microseconds from 2000-01-01.
fn pg_time_ms(micros: i64) -> u64 {
    const PG_EPOCH_MS: i64 = 946_684_800_000;
    (micros / 1_000 + PG_EPOCH_MS).max(0) as u64
}

/// The state of offered rows, as the window needs it.
async fn check_rows(
    pg: &mut tokio_postgres::Client,
    rows: &[RowKey],
) -> Result<Vec<(RowKey, RowCheck)>, CdcError> {
    let ids: Vec<uuid::Uuid> = rows
        .iter()
        .map(|r| uuid::Uuid::from_bytes(r.0 .0))
        .collect();
    let members: Vec<i16> = rows.iter().map(|r| r.1 as i16).collect();
    let found = pg
        .query(
            &format!(
                "SELECT w.event_id, w.member, w.phase,
                        CASE WHEN x.lease_id IS NULL THEN w.state ELSE 'SENDING' END,
                        coalesce(x.lease_until_ms, w.lease_until_ms), {}
                 FROM sealpost.work w
                 JOIN unnest($1::uuid[], $2::int2[]) AS k(event_id, member)
                   ON w.event_id = k.event_id AND w.member = k.member
                 LEFT JOIN sealpost.leased x ON x.event_id = w.event_id AND x.member = w.member",
                store::NOW_MS_SQL
            ),
            &[&ids, &members],
        )
        .await?;
    let mut seen: HashMap<RowKey, (i16, String, Option<u64>)> = HashMap::with_capacity(found.len());
    let mut now_ms = 0;
    for r in &found {
        let id: uuid::Uuid = r.get(0);
        let member: i16 = r.get(1);
        let lease: Option<i64> = r.get(4);
        now_ms = r.get::<_, i64>(5) as u64;
        seen.insert(
            (EventId(*id.as_bytes()), member as u16),
            (r.get(2), r.get(3), lease.map(|l| l as u64)),
        );
    }
    // The core judges each row; one that is not there has nothing to send.
    Ok(rows
        .iter()
        .map(|k| {
            let s = seen.get(k).map(|(phase, state, lease)| Seen {
                phase: *phase,
                state,
                lease_until_ms: *lease,
            });
            (*k, check_of(s, now_ms))
        })
        .collect())
}

/// Writes the publisher's position and cleanup hold to `sealpost.cdc_progress`.
async fn record_progress(
    pg: &mut tokio_postgres::Client,
    slot: &str,
    f: &WindowFigures,
    hold_margin_ms: u64,
) -> Result<(), CdcError> {
    pg.execute(
        &format!(
            "UPDATE sealpost.cdc_progress SET confirmed_lsn = $2::text::pg_lsn,
                confirmed_at_ms = CASE WHEN confirmed_lsn IS DISTINCT FROM $2::text::pg_lsn
                                       THEN {now} ELSE confirmed_at_ms END,
                hold_from_ms = coalesce($3, {now}) - $4, window_rows = $5, updated_at_ms = {now}
             WHERE slot_name = $1",
            now = store::NOW_MS_SQL
        ),
        &[
            &slot,
            &lsn_text(f.confirmed_lsn),
            &f.oldest_commit_ms.map(|m| m as i64),
            &(hold_margin_ms as i64),
            &(f.unsettled as i64),
        ],
    )
    .await?;
    Ok(())
}
