//! Read-only views: `sealpost status` figures and row snapshots for operators and tests.

use super::*;

/// `sealpost status` figures.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Status {
    /// Row count per state name.
    pub states: std::collections::BTreeMap<String, i64>,
    /// Age of the oldest `PENDING` row, seconds.
    pub oldest_pending_s: f64,
    /// Rows in `DISPATCH_UNKNOWN` or `RECONCILING`.
    pub unknown: i64,
    /// Age of the oldest unknown, seconds.
    pub oldest_unknown_s: f64,
    /// Quarantine entries (receipts and poison rows).
    pub quarantined: i64,
    /// Rows in `QUARANTINED` (poison) waiting for `sealpost release`, oldest first (at most
    /// 20), with the last refusal.
    pub quarantined_rows: Vec<(String, String)>,
    /// Pending rows that could not leave at least `NEVER_SENT_ALERT_COUNT` times (a deleted
    /// stream, a cluster nobody serves), with the count and the last reason (at most 20).
    pub stuck_rows: Vec<(String, i32, String)>,
    /// Open "published but missing at the broker" findings of the verification pass (R31).
    pub missing_at_broker: i64,
    /// The CDC publishers' slots (R32): one entry per slot `sealpost.cdc_progress` records
    /// (empty without CDC, or for a login that may not read that table).
    pub cdc: Vec<CdcSlotStatus>,
    /// Delivery sets (R16): how many are complete, in progress or blocked, and the oldest
    /// open ones with their members.
    pub sets: SetSummary,
    /// Rollouts (R25): every route's alias, the shadows' comparisons with their latest
    /// divergences, the announced implementations and the latest switches.
    pub rollout: RolloutStatus,
}

/// One CDC publisher's slot, as the server and its progress row tell.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct CdcSlotStatus {
    /// Slot name.
    pub slot: String,
    /// Destination cluster it publishes.
    pub cluster: String,
    /// The slot exists on the server (false: dropped or lost; the publisher scans instead and
    /// recreates it on its next start).
    pub exists: bool,
    /// A publisher is streaming from it now.
    pub active: bool,
    /// The server's `wal_status` of the slot (`reserved`, `extended`, `unreserved`, `lost`).
    pub wal_status: String,
    /// Log bytes after the slot's confirmed position (what a restart would read again).
    pub unconfirmed_bytes: i64,
    /// Log bytes the server keeps for the slot (from its restart position).
    pub retained_bytes: i64,
    /// Seconds since the confirmed position last moved.
    pub confirmed_age_s: f64,
    /// Rows the publisher holds unsettled (its last report).
    pub window_rows: i64,
    /// Seconds since its last report.
    pub reported_age_s: f64,
}

impl CdcSlotStatus {
    /// What an operator must look at, if anything: a slot gone or lost, or unconfirmed log
    /// older than `stale_s`.
    pub fn problem(&self, stale_s: f64) -> Option<String> {
        if !self.exists {
            return Some(format!(
                "slot {} is gone: the publisher scans instead; start it again to recreate the slot, or `sealpost cdc --drop --cluster {}` if CDC is retired",
                self.slot, self.cluster
            ));
        }
        if self.wal_status == "lost" {
            return Some(format!(
                "slot {} was invalidated by the server (max_slot_wal_keep_size): `sealpost cdc --drop --cluster {}`, then start the publisher again",
                self.slot, self.cluster
            ));
        }
        if self.unconfirmed_bytes > 0 && self.confirmed_age_s > stale_s {
            return Some(format!(
                "slot {} has not confirmed for {:.0} s ({} bytes of log held{}): is `sealpost cdc` running?",
                self.slot,
                self.confirmed_age_s,
                self.retained_bytes,
                if self.active { "" } else { ", no publisher connected" }
            ));
        }
        None
    }
}

/// The CDC slots' status (empty where `sealpost.cdc_progress` is absent or not readable).
pub async fn cdc_status(client: &impl GenericClient) -> Result<Vec<CdcSlotStatus>> {
    let readable: bool = client
        .query_one(
            "SELECT to_regclass('sealpost.cdc_progress') IS NOT NULL
                    AND has_table_privilege('sealpost.cdc_progress', 'SELECT')",
            &[],
        )
        .await?
        .get(0);
    if !readable {
        return Ok(Vec::new());
    }
    let rows = client
        .query(
            &format!(
                "SELECT p.slot_name, p.cluster, s.slot_name IS NOT NULL, coalesce(s.active, false),
                        coalesce(s.wal_status, ''),
                        coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn), 0)::bigint,
                        coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn), 0)::bigint,
                        {NOW_MS_SQL} - coalesce(p.confirmed_at_ms, p.created_at_ms),
                        p.window_rows, {NOW_MS_SQL} - p.updated_at_ms
                 FROM sealpost.cdc_progress p
                 LEFT JOIN pg_replication_slots s ON s.slot_name = p.slot_name
                 ORDER BY p.slot_name"
            ),
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| CdcSlotStatus {
            slot: r.get(0),
            cluster: r.get(1),
            exists: r.get(2),
            active: r.get(3),
            wal_status: r.get(4),
            unconfirmed_bytes: r.get(5),
            retained_bytes: r.get(6),
            confirmed_age_s: r.get::<_, i64>(7).max(0) as f64 / 1000.0,
            window_rows: r.get(8),
            reported_age_s: r.get::<_, i64>(9).max(0) as f64 / 1000.0,
        })
        .collect())
}

/// Unknown rows and the age of the oldest, in seconds (reads only the unknown index).
pub async fn unknown_age(client: &impl GenericClient) -> Result<(i64, f64)> {
    let now_ms = db_now_ms(client).await? as i64;
    let r = client
        .query_one(
            &format!(
                "SELECT count(*), min(unknown_since_ms) FROM sealpost.work WHERE phase = {UNKNOWN}"
            ),
            &[],
        )
        .await?;
    let oldest = r
        .get::<_, Option<i64>>(1)
        .map_or(0.0, |t| (now_ms - t).max(0) as f64 / 1000.0);
    Ok((r.get(0), oldest))
}

/// Reads the status figures.
pub async fn status(client: &impl GenericClient) -> Result<Status> {
    let exists: bool = client
        .query_one("SELECT to_regclass('sealpost.work') IS NOT NULL", &[])
        .await?
        .get(0);
    if !exists {
        return Err(StoreError::NotMigrated);
    }
    let now_ms = db_now_ms(client).await? as i64;
    let mut s = Status::default();
    for st in State::ALL {
        s.states.insert(st.as_str().to_string(), 0);
    }
    for r in client
        .query(
            "SELECT state, count(*) FROM sealpost.work GROUP BY state",
            &[],
        )
        .await?
    {
        s.states.insert(r.get(0), r.get(1));
    }
    // A row a lease stands for is `SENDING`, though its own columns still say `PENDING`.
    let leased: i64 = client
        .query_one("SELECT count(*) FROM sealpost.leased", &[])
        .await?
        .get(0);
    if leased > 0 {
        *s.states
            .entry(State::Pending.as_str().to_string())
            .or_default() -= leased;
        *s.states
            .entry(State::Sending.as_str().to_string())
            .or_default() += leased;
    }
    let r = client
        .query_one(
            &format!("SELECT (SELECT min(created_at_ms) FROM sealpost.work w WHERE phase = {DISPATCHABLE} AND state = 'PENDING'
                      AND NOT EXISTS (SELECT 1 FROM sealpost.leased x WHERE x.event_id = w.event_id AND x.member = w.member)),
                    (SELECT min(unknown_since_ms) FROM sealpost.work WHERE phase = {UNKNOWN}),
                    (SELECT count(*) FROM sealpost.work WHERE phase = {UNKNOWN}),
                    (SELECT count(*) FROM sealpost.quarantine)
                      + (SELECT count(*) FROM sealpost.work WHERE state = 'QUARANTINED')"),
            &[],
        )
        .await?;
    s.oldest_pending_s = r
        .get::<_, Option<i64>>(0)
        .map_or(0.0, |t| (now_ms - t).max(0) as f64 / 1000.0);
    s.oldest_unknown_s = r
        .get::<_, Option<i64>>(1)
        .map_or(0.0, |t| (now_ms - t).max(0) as f64 / 1000.0);
    s.unknown = r.get(2);
    s.quarantined = r.get(3);
    for r in client
        .query(
            "SELECT event_id::text, coalesce(last_error, '') FROM sealpost.work
             WHERE state = 'QUARANTINED' ORDER BY committed_seq LIMIT 20",
            &[],
        )
        .await?
    {
        s.quarantined_rows.push((r.get(0), r.get(1)));
    }
    for r in client
        .query(
            &format!("SELECT event_id::text, never_sent, coalesce(last_error, '') FROM sealpost.work
             WHERE phase = {DISPATCHABLE} AND state = 'PENDING' AND never_sent >= $1 ORDER BY committed_seq LIMIT 20"),
            &[&(NEVER_SENT_ALERT_COUNT as i32)],
        )
        .await?
    {
        s.stuck_rows.push((r.get(0), r.get(1), r.get(2)));
    }
    s.missing_at_broker = client
        .query_one(
            "SELECT count(*) FROM sealpost.finding WHERE kind = 'published_missing_at_broker'",
            &[],
        )
        .await?
        .get(0);
    s.cdc = cdc_status(client).await?;
    s.sets = set_summary(client).await?;
    s.rollout = rollout_status(client).await?;
    Ok(s)
}

/// Reads the current snapshots of `keys`, attempts included (row locks are held only for the
/// read and released by a rollback): what the decisions
/// would see. For operators' tools and for tests that compare the store with the core.
pub async fn snapshot(
    client: &mut tokio_postgres::Client,
    keys: &[(EventId, u16)],
) -> Result<Vec<EventRow>> {
    let tx = client.transaction().await?;
    let rows = lock_rows(&tx, keys).await?;
    tx.rollback().await?;
    Ok(rows)
}
