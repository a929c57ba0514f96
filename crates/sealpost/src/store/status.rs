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
    let r = client
        .query_one(
            &format!("SELECT (SELECT min(created_at_ms) FROM sealpost.work WHERE phase = {DISPATCHABLE} AND state = 'PENDING'),
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
