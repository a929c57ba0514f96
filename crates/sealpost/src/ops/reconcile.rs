//! The reconciliation report (R19, R31): committed envelopes, accepted receipts, consumers'
//! receipts and what a destination stream holds, compared, with the findings over their
//! thresholds.

use std::collections::HashSet;

use sealpost_core::port::{ScannedMessage, StreamCursor, StreamScan};
use serde::Serialize;
use uuid::Uuid;

use crate::store::{self, Result};

/// One reconciliation finding.
#[derive(Clone, Debug, Serialize)]
pub struct Finding {
    /// `pending_over_age`, `published_unconsumed`, `unknown_over_age`, `out_of_band`,
    /// `published_missing_at_broker` (R31, from the reconciler's verification pass) or
    /// `set_incomplete` (R16: a delivery set blocked, or not complete `pending_age_s` after it
    /// committed).
    pub kind: String,
    /// The consumer, for `published_unconsumed`.
    pub consumer: Option<String>,
    /// How many.
    pub count: i64,
    /// Up to 20 of the event ids.
    pub event_ids: Vec<String>,
    /// Threshold in seconds that made it a finding.
    pub threshold_s: u64,
}

/// Thresholds of the report.
#[derive(Clone, Debug)]
pub struct ReconcileOptions {
    /// PENDING older than this is a finding (a dispatcher missed it), and so is a delivery
    /// set not complete this long after it committed.
    pub pending_age_s: u64,
    /// PUBLISHED without a critical consumer's receipt for longer than this.
    pub unconsumed_age_s: u64,
    /// DISPATCH_UNKNOWN / RECONCILING older than this.
    pub unknown_age_s: u64,
    /// Critical consumers (default: every consumer with a watermark).
    pub consumers: Vec<String>,
    /// Streams to scan for event ids the outbox never committed.
    pub streams: Vec<String>,
    /// Stop scanning a stream after this many messages.
    pub scan_max: u64,
}

/// The reconciliation report (R19).
#[derive(Clone, Debug, Serialize)]
pub struct ReconcileReport {
    /// Envelopes committed.
    pub committed: i64,
    /// Envelopes with an accepted primary receipt (published, retained or purged).
    pub published: i64,
    /// Consumption receipts per critical consumer.
    pub consumed: std::collections::BTreeMap<String, i64>,
    /// Stream messages scanned.
    pub stream_messages_scanned: u64,
    /// Findings over their thresholds.
    pub findings: Vec<Finding>,
    /// Second stored copies the acceptance point recorded (receipt kind `second_copy`):
    /// evidence, not loss; the consumers' inboxes absorb them.
    pub second_copies: i64,
    /// Published events that were sent again after an unknown outcome (an attempt left
    /// `UNKNOWN`): the broker may hold a second copy no receipt names (a broker that cannot
    /// be asked, such as RabbitMQ, is always answered this way). Evidence, not a finding.
    pub resent_after_unknown: i64,
}

fn ids(rows: &[tokio_postgres::Row]) -> Vec<String> {
    rows.iter()
        .map(|r| r.get::<_, Uuid>(0).to_string())
        .collect()
}

/// Builds the report.
///
/// `streams` lists the destinations to read back through `scan` (the adapter's
/// [`StreamScan`]; `None::<&NoScan>` skips the out-of-band check).
pub async fn reconcile<S: StreamScan>(
    pg: &tokio_postgres::Client,
    scan: Option<&S>,
    opts: &ReconcileOptions,
) -> Result<ReconcileReport> {
    let now_ms = store::db_now_ms(pg).await? as i64;
    let r = pg
        .query_one(
            "SELECT count(*), count(*) FILTER (WHERE state IN ('PUBLISHED', 'RETAINED', 'PURGED')) FROM sealpost.work",
            &[],
        )
        .await?;
    let mut report = ReconcileReport {
        committed: r.get(0),
        published: r.get(1),
        consumed: Default::default(),
        stream_messages_scanned: 0,
        findings: Vec::new(),
        second_copies: 0,
        resent_after_unknown: 0,
    };
    report.second_copies = pg
        .query_one(
            "SELECT count(*) FROM sealpost.receipts WHERE kind = 'second_copy'",
            &[],
        )
        .await?
        .get(0);
    report.resent_after_unknown = pg
        .query_one(
            "SELECT count(*) FROM sealpost.outbox e
             WHERE e.state IN ('PUBLISHED', 'RETAINED')
               AND EXISTS (SELECT 1 FROM sealpost.attempts a WHERE a.event_id = e.event_id
                           AND a.member = e.member AND a.status = 'UNKNOWN')",
            &[],
        )
        .await?
        .get(0);
    let mut add = |kind: &str,
                   consumer: Option<String>,
                   count: i64,
                   event_ids: Vec<String>,
                   threshold_s: u64| {
        if count > 0 {
            report_findings_push(
                &mut report.findings,
                kind,
                consumer,
                count,
                event_ids,
                threshold_s,
            );
        }
    };
    for (kind, states, col, threshold_s) in [
        (
            "pending_over_age",
            "('PENDING', 'CLAIMED')",
            "created_at_ms",
            opts.pending_age_s,
        ),
        (
            "unknown_over_age",
            "('DISPATCH_UNKNOWN', 'RECONCILING')",
            "unknown_since_ms",
            opts.unknown_age_s,
        ),
    ] {
        let cutoff = now_ms - (threshold_s as i64) * 1000;
        let q = format!(
            "SELECT event_id, count(*) OVER () FROM sealpost.work WHERE state IN {states} AND {col} < $1
             ORDER BY {col} LIMIT 20"
        );
        let rows = pg.query(q.as_str(), &[&cutoff]).await?;
        let count = rows.first().map_or(0, |r| r.get::<_, i64>(1));
        add(kind, None, count, ids(&rows), threshold_s);
    }
    // Delivery sets stuck incomplete: the core's `set_stuck` over `set_status`.
    let (count, stuck) = store::stuck_sets(pg, opts.pending_age_s.saturating_mul(1000), 20).await?;
    add(
        "set_incomplete",
        None,
        count,
        stuck.into_iter().map(|v| v.event_id).collect(),
        opts.pending_age_s,
    );
    let consumers: Vec<String> = if opts.consumers.is_empty() {
        pg.query(
            "SELECT DISTINCT consumer_id FROM sealpost.consumer_watermark ORDER BY 1",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect()
    } else {
        opts.consumers.clone()
    };
    for c in &consumers {
        let n: i64 = pg
            .query_one(
                "SELECT count(*) FROM sealpost.inbox WHERE consumer_id = $1",
                &[c],
            )
            .await?
            .get(0);
        let cutoff = now_ms - (opts.unconsumed_age_s as i64) * 1000;
        let rows = pg
            .query(
                "SELECT e.event_id, count(*) OVER () FROM sealpost.outbox e
                 WHERE e.state IN ('PUBLISHED', 'RETAINED') AND e.published_at_ms < $2
                   AND e.dest_topic IN (SELECT stream FROM sealpost.consumer_watermark WHERE consumer_id = $1)
                   AND NOT EXISTS (SELECT 1 FROM sealpost.inbox i
                                   WHERE i.consumer_id = $1 AND i.event_id = e.event_id AND i.member = e.member)
                 ORDER BY e.published_at_ms LIMIT 20",
                &[c, &cutoff],
            )
            .await?;
        let count = rows.first().map_or(0, |r| r.get::<_, i64>(1));
        add(
            "published_unconsumed",
            Some(c.clone()),
            count,
            ids(&rows),
            opts.unconsumed_age_s,
        );
        report.consumed.insert(c.clone(), n);
    }
    if let Some(scan) = scan {
        for s in &opts.streams {
            let (scanned, foreign) = scan_stream(pg, scan, s, opts.scan_max).await?;
            report.stream_messages_scanned += scanned;
            let count = foreign.len() as i64;
            add(
                "out_of_band",
                None,
                count,
                foreign.into_iter().take(20).collect(),
                0,
            );
        }
    }
    // R31: published rows the verification pass found missing at the broker.
    let rows = pg
        .query(
            "SELECT event_id FROM sealpost.finding WHERE kind = 'published_missing_at_broker'
             ORDER BY finding_id LIMIT 20",
            &[],
        )
        .await?;
    let count: i64 = pg
        .query_one(
            "SELECT count(*) FROM sealpost.finding WHERE kind = 'published_missing_at_broker'",
            &[],
        )
        .await?
        .get(0);
    add("published_missing_at_broker", None, count, ids(&rows), 0);
    Ok(report)
}

fn report_findings_push(
    findings: &mut Vec<Finding>,
    kind: &str,
    consumer: Option<String>,
    count: i64,
    event_ids: Vec<String>,
    threshold_s: u64,
) {
    findings.push(Finding {
        kind: kind.to_string(),
        consumer,
        count,
        event_ids,
        threshold_s,
    });
}

/// No stream scan: for [`reconcile`] without an adapter that reads streams back.
pub enum NoScan {}

/// The cursor of [`NoScan`] (never made).
pub enum NoCursor {}

impl StreamScan for NoScan {
    type Cursor = NoCursor;
    async fn open_scan(&self, _stream: &str) -> Option<NoCursor> {
        match *self {}
    }
}

impl StreamCursor for NoCursor {
    async fn next_message(&mut self) -> Option<(ScannedMessage, u64)> {
        match *self {}
    }
}

/// Reads a stream from the start (bounded by `scan_max`) and returns the event ids it holds
/// that the outbox never committed, and messages without Sealpost headers: an out-of-band
/// publisher. Checks ids against the store 1,000 at a time.
async fn scan_stream<S: StreamScan>(
    pg: &tokio_postgres::Client,
    scan: &S,
    stream: &str,
    scan_max: u64,
) -> Result<(u64, Vec<String>)> {
    let Some(mut cursor) = scan.open_scan(stream).await else {
        return Ok((0, Vec::new()));
    };
    let mut scanned = 0u64;
    let mut seen: Vec<Uuid> = Vec::new();
    let mut foreign = Vec::new();
    let mut left = u64::MAX;
    while scanned < scan_max && left > 0 {
        let Some((m, after)) = cursor.next_message().await else {
            break;
        };
        scanned += 1;
        left = after;
        match m {
            ScannedMessage::Event(id) => seen.push(Uuid::from_bytes(id.0)),
            ScannedMessage::Foreign(what) => foreign.push(format!("{what} (no Sealpost headers)")),
        }
        if seen.len() >= 1000 || left == 0 {
            foreign.extend(unknown_ids(pg, &std::mem::take(&mut seen)).await?);
        }
    }
    foreign.extend(unknown_ids(pg, &seen).await?);
    Ok((scanned, foreign))
}

async fn unknown_ids(pg: &tokio_postgres::Client, batch: &[Uuid]) -> Result<Vec<String>> {
    if batch.is_empty() {
        return Ok(Vec::new());
    }
    let known: HashSet<Uuid> = pg
        .query(
            "SELECT DISTINCT event_id FROM sealpost.work WHERE event_id = ANY($1)",
            &[&batch],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    Ok(batch
        .iter()
        .filter(|u| !known.contains(u))
        .map(|u| u.to_string())
        .collect())
}
