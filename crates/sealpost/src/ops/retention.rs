//! Retention and purge (R20, R34): published rows move to `RETAINED` and `PURGED` once every
//! required consumer has passed them and the replay window and restore point allow; then
//! tombstones and audit evidence go after their own windows. Every decision is the core's.

use sealpost_core::cleanup::{
    apply_retention, decide_evidence_removal, decide_purge, decide_retention,
    decide_tombstone_removal, hold_for_cdc, PurgeRefusal, RetentionDecision, RetentionPolicy,
    Watermark,
};
use sealpost_core::envelope::EventId;
use sealpost_core::state::State;
use serde::Serialize;
use uuid::Uuid;

use crate::store::{self, Result};

/// What `sealpost purge` is asked to do.
#[derive(Clone, Debug)]
pub struct PurgeOptions {
    /// Consumers that must have passed an event (their reported watermark, in
    /// `sealpost.consumer_progress`, at or past its stream position) before it goes.
    pub required: Vec<String>,
    /// The operator's explicit statement that no consumer needs the outbox rows: purge
    /// without waiting for any (refused when `required` is not empty).
    pub no_consumers: bool,
    /// Only rows of this stream.
    pub stream: Option<String>,
    /// Replay window after publication; also how long a tombstone outlives its purge.
    pub replay_window_s: u64,
    /// Time of the oldest backup one may restore from (database clock, ms since the epoch):
    /// rows published at or after it are kept.
    pub restore_point_ms: Option<u64>,
    /// How long audit evidence (earlier attempts, duplicate receipts, quarantine, audit,
    /// finding and migration rows, consumers' dead letters) outlives its purged event.
    pub audit_retention_days: u64,
    /// Rows per transaction.
    pub batch_size_max: i64,
    /// Only this event (an explicit purge request); tombstones and evidence are left alone.
    pub only: Option<EventId>,
    /// Decide and report without writing.
    pub dry_run: bool,
}

impl PurgeOptions {
    /// Refuses a purge that names no required consumer without `no_consumers`, or both.
    pub fn check(&self) -> std::result::Result<(), PurgeError> {
        if self.no_consumers && !self.required.is_empty() {
            return Err(PurgeError::Contradiction(self.required.clone()));
        }
        if !self.no_consumers && self.required.is_empty() {
            return Err(PurgeError::NoConsumers);
        }
        Ok(())
    }

    /// Options for a purge that waits for `required`, with a replay window and the default
    /// audit retention (90 days), no restore point, batches of 500.
    pub fn new(required: &[String], replay_window_s: u64) -> PurgeOptions {
        PurgeOptions {
            required: required.to_vec(),
            no_consumers: false,
            stream: None,
            replay_window_s,
            restore_point_ms: None,
            audit_retention_days: 90,
            batch_size_max: 500,
            only: None,
            dry_run: false,
        }
    }
}

/// Why `sealpost purge` did not run.
#[derive(Debug, thiserror::Error)]
pub enum PurgeError {
    /// No required consumer and no explicit `--no-consumers`.
    #[error("refusing to purge: no required consumer is named, so nothing would wait for a consumer that has not read an event yet. Name each consumer that reads these streams with `--consumer ID` (repeatable) or the config key `required_consumers = [\"ID\", ...]`; if no consumer needs the outbox rows, say so with `--no-consumers`")]
    NoConsumers,
    /// `--no-consumers` together with required consumers.
    #[error("`--no-consumers` contradicts the required consumers {0:?} (from --consumer or the config key `required_consumers`); drop one or the other")]
    Contradiction(Vec<String>),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] store::StoreError),
}

impl From<tokio_postgres::Error> for PurgeError {
    fn from(e: tokio_postgres::Error) -> Self {
        PurgeError::Store(e.into())
    }
}

/// Counts of a purge pass.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PurgeReport {
    /// Rows purged (or that would be, with `--dry-run`).
    pub purged: u64,
    /// Rows moved to RETAINED (consumed by all, inside the replay window or newer than the
    /// restore point).
    pub retained: u64,
    /// Rows kept, per reason.
    pub kept: std::collections::BTreeMap<String, u64>,
    /// A few kept event ids with their reason.
    pub examples: Vec<(String, String)>,
    /// Tombstones (purged rows) deleted a replay window after their purge.
    pub tombstones_removed: u64,
    /// Audit evidence rows deleted, per table.
    pub evidence_removed: std::collections::BTreeMap<String, u64>,
}

/// The `kept` key of a purge refusal (the reasons a row stays).
pub fn reason_key(r: &PurgeRefusal) -> String {
    match r {
        PurgeRefusal::NotPublished(_) => "not published".into(),
        PurgeRefusal::ReplayWindow { .. } => "inside the replay window".into(),
        PurgeRefusal::RestorePoint { .. } => "newer than the restore point".into(),
        PurgeRefusal::ConsumerBehind { .. } => "a required consumer has not consumed it".into(),
        PurgeRefusal::CdcPosition { .. } => "its CDC slot has not confirmed it".into(),
    }
}

/// Retention (R20, R34), in three passes, each in batches of `batch_size_max` (one short
/// transaction each):
/// 1. published rows move to `RETAINED` once every required consumer's reported watermark
///    (`sealpost.consumer_progress`) has passed their stream position, and are `PURGED`
///    (payload erased; a tombstone with the id, digests and primary position stays) once
///    the replay window has passed and they are older than the restore point;
/// 2. tombstones are deleted a replay window after their purge;
/// 3. audit evidence older than the audit retention whose event is purged or gone is
///    deleted.
///
/// Each decision is the core's (`decide_retention`, `decide_tombstone_removal`,
/// `decide_evidence_removal`). `only` restricts it to pass 1 for one event; `dry_run`
/// decides without writing. Refuses to run without required consumers unless
/// `no_consumers` says so.
///
/// # Transactions and locks
/// Each batch locks its rows with `FOR UPDATE SKIP LOCKED`, so it never waits on
/// dispatchers, and commits before the next batch.
pub async fn purge(
    pg: &mut tokio_postgres::Client,
    o: &PurgeOptions,
) -> std::result::Result<PurgeReport, PurgeError> {
    o.check()?;
    let policy = RetentionPolicy {
        replay_window_ms: o.replay_window_s * 1000,
        restore_point_ms: o.restore_point_ms,
    };
    let mut report = PurgeReport::default();
    retire_rows(pg, o, policy, &mut report).await?;
    if o.only.is_none() {
        remove_tombstones(pg, o, policy, &mut report).await?;
        remove_evidence(pg, o, &mut report).await?;
    }
    Ok(report)
}

/// Pass 1: `PUBLISHED -> RETAINED -> PURGED`.
async fn retire_rows(
    pg: &mut tokio_postgres::Client,
    o: &PurgeOptions,
    policy: RetentionPolicy,
    report: &mut PurgeReport,
) -> Result<()> {
    let required = &o.required;
    let mut after_seq: i64 = -1;
    loop {
        let tx = pg.transaction().await?;
        let now_ms = store::db_now_ms(&tx).await?;
        // A dry run (also the metrics' purge backlog) decides without writing, so it locks
        // nothing: a late ACK or a real purge never waits on it.
        let lock = if o.dry_run {
            ""
        } else {
            "FOR UPDATE OF w SKIP LOCKED"
        };
        let q = format!(
                "SELECT w.event_id, w.member, w.state, w.primary_sequence, w.published_at_ms, w.committed_seq,
                        w.primary_stream, w.primary_partition, w.created_at_ms
                 FROM sealpost.work w JOIN sealpost.envelope e
                   ON e.event_id = w.event_id AND e.member = w.member
                  AND e.envelope_generation = w.envelope_generation
                 WHERE w.committed_seq > $1 AND ($3::uuid IS NULL OR w.event_id = $3)
                   AND ($4::text IS NULL OR e.dest_topic = $4)
                   AND ($3::uuid IS NOT NULL OR w.state IN ('PUBLISHED', 'RETAINED'))
                 ORDER BY w.committed_seq LIMIT $2 {lock}"
        );
        let rows = tx
            .query(
                q.as_str(),
                &[
                    &after_seq,
                    &o.batch_size_max,
                    &o.only.map(|e| Uuid::from_bytes(e.0)),
                    &o.stream,
                ],
            )
            .await?;
        if rows.is_empty() {
            tx.commit().await?;
            break;
        }
        // The CDC publishers' hold (R20, R32): rows their slots have not confirmed stay.
        let cdc_hold: Option<u64> = tx
            .query_one("SELECT min(hold_from_ms) FROM sealpost.cdc_progress", &[])
            .await?
            .get::<_, Option<i64>>(0)
            .map(|m| m.max(0) as u64);
        // Every required consumer's reported watermark per stream (a small table).
        let progress: std::collections::HashMap<(String, String), u64> = tx
            .query(
                "SELECT consumer_id, stream, watermark FROM sealpost.consumer_progress
                 WHERE consumer_id = ANY($1)",
                &[required],
            )
            .await?
            .iter()
            .map(|r| ((r.get(0), r.get(1)), r.get::<_, i64>(2) as u64))
            .collect();
        let mut purge_keys: (Vec<Uuid>, Vec<i16>, Vec<String>) = Default::default();
        let mut retain_keys: (Vec<Uuid>, Vec<i16>, Vec<String>) = Default::default();
        for r in &rows {
            after_seq = r.get(5);
            let id: Uuid = r.get(0);
            let member: i16 = r.get(1);
            let state_s: String = r.get(2);
            let state = State::parse(&state_s).unwrap_or(State::Pending);
            let seq: Option<i64> = r.get(3);
            // The watermark's stream: a partitioned position (Kafka) is watermarked per
            // partition, `<topic>/<partition>`, as its consumer reports it.
            let stream: Option<String> =
                r.get::<_, Option<String>>(6)
                    .map(|s| match r.get::<_, Option<i32>>(7) {
                        Some(p) => format!("{s}/{p}"),
                        None => s,
                    });
            // The snapshot the decision needs: state, slot and publication time.
            let mut row = sealpost_core::row::EventRow::new_pending(
                EventId(*id.as_bytes()),
                member as u16,
                sealpost_core::Digest::default(),
                sealpost_core::envelope::Destination {
                    cluster: String::new(),
                    topic: String::new(),
                    routing_key: String::new(),
                    partition_algorithm: sealpost_core::envelope::PartitionAlgorithm::None,
                    route_policy_generation: 0,
                    serializer: String::new(),
                    durability: String::new(),
                    required_ack: String::new(),
                    ordering: sealpost_core::envelope::EventOrdering::Unordered,
                },
            );
            row.state = state;
            row.published_at_ms = r.get::<_, Option<i64>>(4).map(|v| v as u64);
            row.primary = seq.map(|s| sealpost_core::Receipt {
                event_id: row.event_id,
                member: row.member,
                envelope_generation: 1,
                attempt_id: 0,
                payload_digest: row.payload_digest,
                destination_digest: row.destination_digest,
                cluster: String::new(),
                stream: String::new(),
                partition: None,
                sequence: s as u64,
                broker_duplicate: false,
                source: sealpost_core::receipt::ReceiptSource::Ack,
            });
            let marks: Vec<Watermark> = required
                .iter()
                .enumerate()
                .map(|(i, c)| Watermark {
                    consumer: i as u32,
                    watermark: stream
                        .as_ref()
                        .and_then(|s| progress.get(&(c.clone(), s.clone())).copied()),
                })
                .collect();
            let decision = hold_for_cdc(
                decide_retention(&row, now_ms, policy, &marks),
                r.get::<_, i64>(8).max(0) as u64,
                cdc_hold,
            );
            // Every state change goes through the core's state table.
            apply_retention(&mut row, decision)
                .map_err(|e| store::StoreError::Corrupt(e.to_string()))?;
            match decision {
                RetentionDecision::Purge => {
                    report.purged += 1;
                    purge_keys.0.push(id);
                    purge_keys.1.push(member);
                    purge_keys.2.push(state.as_str().to_string());
                }
                RetentionDecision::Retain => {
                    report.retained += 1;
                    retain_keys.0.push(id);
                    retain_keys.1.push(member);
                    retain_keys.2.push(state.as_str().to_string());
                    let why = match decide_purge(&row, now_ms, policy, &marks) {
                        Err(r) => reason_key(&r),
                        Ok(()) => reason_key(&PurgeRefusal::ReplayWindow { remaining_ms: 0 }),
                    };
                    *report.kept.entry(why).or_default() += 1;
                }
                RetentionDecision::Keep(refusal) => {
                    let key = reason_key(&refusal);
                    let refusal = match refusal {
                        PurgeRefusal::ConsumerBehind { consumer, position, watermark } => format!(
                            "required consumer `{}` has not consumed position {position} of stream {} (its reported watermark: {}; it reports to sealpost.consumer_progress while `sealpost consume` runs)",
                            required[consumer as usize],
                            stream.as_deref().unwrap_or("?"),
                            watermark.map_or("none".to_string(), |w| w.to_string()),
                        ),
                        other => other.to_string(),
                    };
                    *report.kept.entry(key).or_default() += 1;
                    if report.examples.len() < 20 {
                        report.examples.push((id.to_string(), refusal));
                    }
                }
            }
        }
        if !o.dry_run {
            if !retain_keys.0.is_empty() {
                // The row lock is held since the scan; the state guard is the CAS.
                tx.execute(
                    "UPDATE sealpost.work w SET state = $4 FROM unnest($1::uuid[], $2::int2[], $3::text[]) AS k(id, m, s)
                     WHERE w.event_id = k.id AND w.member = k.m AND w.state = k.s",
                    &[&retain_keys.0, &retain_keys.1, &retain_keys.2, &State::Retained.as_str()],
                )
                .await?;
            }
            if !purge_keys.0.is_empty() {
                tx.execute(
                    "UPDATE sealpost.work w SET state = $4, purged_at_ms = $5
                     FROM unnest($1::uuid[], $2::int2[], $3::text[]) AS k(id, m, s)
                     WHERE w.event_id = k.id AND w.member = k.m AND w.state = k.s",
                    &[
                        &purge_keys.0,
                        &purge_keys.1,
                        &purge_keys.2,
                        &State::Purged.as_str(),
                        &(now_ms as i64),
                    ],
                )
                .await?;
                // Retention's one write to the sealed envelope: the payload bytes of a purged
                // event are erased (every generation); identity and digests stay as sealed.
                // No role may update an envelope: the audited function (migration 6) does it,
                // for PURGED rows only, and records the call in `sealpost.erasure`.
                // Attempts and duplicate receipts stay as audit evidence (pass 3).
                tx.execute(
                    "SELECT sealpost.erase_payloads($1::uuid[], $2::int2[])",
                    &[&purge_keys.0, &purge_keys.1],
                )
                .await?;
            }
        }
        tx.commit().await?;
        if o.only.is_some() {
            break;
        }
    }
    Ok(())
}

/// Pass 2: tombstones a replay window after their purge are deleted (the work row, every
/// envelope generation and a primary receipt row). A late ACK then finds no event and is
/// rejected as unknown; it never resurrects a row.
async fn remove_tombstones(
    pg: &mut tokio_postgres::Client,
    o: &PurgeOptions,
    policy: RetentionPolicy,
    report: &mut PurgeReport,
) -> Result<()> {
    let mut after_seq: i64 = -1;
    loop {
        let tx = pg.transaction().await?;
        let now_ms = store::db_now_ms(&tx).await?;
        let rows = tx
            .query(
                "SELECT w.event_id, w.member, w.state, w.purged_at_ms, w.committed_seq
                 FROM sealpost.work w
                 WHERE w.state = 'PURGED' AND w.committed_seq > $1
                   AND ($3::text IS NULL OR w.primary_stream = $3)
                 ORDER BY w.committed_seq LIMIT $2 FOR UPDATE OF w SKIP LOCKED",
                &[&after_seq, &o.batch_size_max, &o.stream],
            )
            .await?;
        if rows.is_empty() {
            tx.commit().await?;
            break;
        }
        let (mut ids, mut members) = (Vec::new(), Vec::new());
        for r in &rows {
            after_seq = r.get(4);
            let state = State::parse(&r.get::<_, String>(2)).unwrap_or(State::Pending);
            let purged_at = r.get::<_, Option<i64>>(3).map_or(now_ms, |v| v as u64);
            if decide_tombstone_removal(state, purged_at, now_ms, policy).is_ok() {
                ids.push(r.get::<_, Uuid>(0));
                members.push(r.get::<_, i16>(1));
            }
        }
        report.tombstones_removed += ids.len() as u64;
        if !o.dry_run && !ids.is_empty() {
            for sql in [
                "DELETE FROM sealpost.receipt t USING unnest($1::uuid[], $2::int2[]) AS k(id, m)
                 WHERE t.event_id = k.id AND t.member = k.m AND t.kind = 'primary'",
                // (No role may delete an envelope: the audited function does, PURGED only.)
                "SELECT sealpost.remove_envelopes($1::uuid[], $2::int2[])",
                "DELETE FROM sealpost.work t USING unnest($1::uuid[], $2::int2[]) AS k(id, m)
                 WHERE t.event_id = k.id AND t.member = k.m AND t.state = 'PURGED'",
            ] {
                tx.execute(sql, &[&ids, &members]).await?;
            }
        }
        tx.commit().await?;
    }
    Ok(())
}

/// The tables of audit evidence: (table, id column, time column, rows that are evidence).
const EVIDENCE: &[(&str, &str, &str, &str)] = &[
    ("attempt", "attempt_id", "started_at_ms", "true"),
    (
        "receipt",
        "receipt_id",
        "accepted_at_ms",
        "t.kind <> 'primary'",
    ),
    ("quarantine", "quarantine_id", "at_ms", "true"),
    ("audit", "audit_id", "at_ms", "true"),
    ("finding", "finding_id", "at_ms", "true"),
    ("migration", "migration_id", "at_ms", "true"),
    ("inbox_quarantine", "quarantine_id", "at_ms", "true"),
];

/// Pass 3: audit evidence older than the audit retention whose event is purged or gone.
/// The scan reads only rows older than the retention (its bound, by the time index); the
/// core decides each.
async fn remove_evidence(
    pg: &mut tokio_postgres::Client,
    o: &PurgeOptions,
    report: &mut PurgeReport,
) -> Result<()> {
    let retention_ms = o.audit_retention_days.saturating_mul(86_400_000);
    for (table, id_col, at_col, filter) in EVIDENCE {
        // inbox_quarantine lives in a consumer's database: its dead letters expire by age.
        let join = if *table == "inbox_quarantine" {
            "LEFT JOIN sealpost.work w ON false"
        } else {
            "LEFT JOIN sealpost.work w ON w.event_id = t.event_id AND w.member = t.member"
        };
        let select = format!(
            "SELECT t.{id_col}, t.{at_col}, w.state FROM sealpost.{table} t {join}
             WHERE t.{at_col} < $1 AND t.{id_col} > $2 AND {filter}
             ORDER BY t.{id_col} LIMIT $3 FOR UPDATE OF t SKIP LOCKED"
        );
        let delete = format!("DELETE FROM sealpost.{table} WHERE {id_col} = ANY($1)");
        let mut after: i64 = -1;
        loop {
            let tx = pg.transaction().await?;
            let now_ms = store::db_now_ms(&tx).await?;
            let cutoff = now_ms.saturating_sub(retention_ms) as i64;
            let rows = tx
                .query(&select, &[&cutoff, &after, &o.batch_size_max])
                .await?;
            if rows.is_empty() {
                tx.commit().await?;
                break;
            }
            let mut gone = Vec::new();
            for r in &rows {
                let id: i64 = r.get(0);
                after = id;
                let at: i64 = r.get(1);
                let state = r
                    .get::<_, Option<String>>(2)
                    .map(|s| State::parse(&s).unwrap_or(State::Pending));
                if decide_evidence_removal(state, at.max(0) as u64, now_ms, retention_ms).is_ok() {
                    gone.push(id);
                }
            }
            *report
                .evidence_removed
                .entry(table.to_string())
                .or_default() += gone.len() as u64;
            if !o.dry_run && !gone.is_empty() {
                tx.execute(&delete, &[&gone]).await?;
            }
            tx.commit().await?;
        }
    }
    Ok(())
}
