//! The batch lease of migration 12 ([`sealpost_core::lease`]): a dispatcher's claim records
//! the first sends it authorised in one `sealpost.lease` row per cluster instead of updating
//! each work row, and every load reads such a row through its lease.

use super::*;
use sealpost_core::lease::{self, LeasedSend};

/// [`lease::never_claimed`] in SQL, of the work row `w`: the rows a lease may stand for (and
/// the view `sealpost.leased` of migration 12 says the same).
pub(super) const NEVER_CLAIMED_SQL: &str = "w.state = 'PENDING' AND w.claim_owner IS NULL \
    AND w.claim_generation = 0 AND w.attempt_generation = 0 AND w.attempt_id IS NULL \
    AND w.primary_sequence IS NULL";

/// A lease entry as the store found it: the lease and what it records of one row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Listed {
    pub(super) lease_id: i64,
    pub(super) send: LeasedSend,
}

/// The leases a claim read under its lock: every entry by (cluster, commit position), the
/// positions of live leases (which the pick skips) and the expired leases.
#[derive(Debug, Default)]
pub(super) struct Leases {
    pub(super) by_position: HashMap<(String, u64), Listed>,
    pub(super) live_positions: Vec<i64>,
    pub(super) expired: Vec<i64>,
}

/// Serialises the claims that may lease the same rows: a claim of one cluster takes that
/// cluster's lock (and the shared lock every claim takes), a claim of every cluster the
/// exclusive one. A claim leases rows without writing them, so their row locks end with its
/// transaction and do not keep a second claim from reading them as never claimed: the
/// second claim must read the leases only after the first committed, which this lock
/// (taken before any read of the claim) makes sure of.
pub(super) async fn lock_claims(
    tx: &Transaction<'_>,
    cluster: Option<&str>,
    prepared: Option<&mut Prepared>,
) -> Result<()> {
    counted(1);
    match cluster {
        Some(c) => {
            let s = prepare(
                prepared,
                tx,
                "SELECT pg_advisory_xact_lock_shared(hashtext('sealpost.claim'), 0),
                        pg_advisory_xact_lock(hashtext('sealpost.claim.cluster'), hashtext($1))",
            )
            .await?;
            tx.query(&s, &[&c]).await?;
        }
        None => {
            let s = prepare(
                prepared,
                tx,
                "SELECT pg_advisory_xact_lock(hashtext('sealpost.claim'), 0)",
            )
            .await?;
            tx.query(&s, &[]).await?;
        }
    }
    Ok(())
}

/// The leases of `cluster` (every cluster: `None`), read after [`lock_claims`].
pub(super) async fn load_leases(
    tx: &Transaction<'_>,
    cluster: Option<&str>,
    prepared: Option<&mut Prepared>,
) -> Result<Leases> {
    counted(1);
    let s = prepare(
        prepared,
        tx,
        &format!(
            "SELECT lease_id, dest_cluster, owner, lease_until_ms, started_at_ms, positions,
                    attempt_ids, lease_until_ms > {NOW_MS_SQL}
             FROM sealpost.lease WHERE ($1::text IS NULL OR dest_cluster = $1)"
        ),
    )
    .await?;
    let mut out = Leases::default();
    for r in tx.query(&s, &[&cluster]).await? {
        let lease_id: i64 = r.get(0);
        let cluster: String = r.get(1);
        let positions: Vec<i64> = r.get(5);
        let attempts: Vec<i64> = r.get(6);
        let live: bool = r.get(7);
        if live {
            out.live_positions.extend_from_slice(&positions);
        } else {
            out.expired.push(lease_id);
        }
        for (p, a) in positions.into_iter().zip(attempts) {
            let listed = Listed {
                lease_id,
                send: LeasedSend {
                    owner: r.get::<_, i64>(2) as u64,
                    lease_until_ms: r.get::<_, i64>(3) as u64,
                    attempt_id: a as u64,
                    started_at_ms: r.get::<_, i64>(4) as u64,
                },
            };
            if out
                .by_position
                .insert((cluster.clone(), p as u64), listed)
                .is_some()
            {
                return Err(StoreError::Corrupt(format!(
                    "commit position {p} of cluster {cluster} is listed by two leases"
                )));
            }
        }
    }
    Ok(out)
}

/// Reads the loaded rows that are never claimed in their own columns through the lease
/// that lists them, if one does ([`lease::leased_view`]): from `known` (the claim read every
/// lease under its lock) or from the database. Returns the lease of each row read so.
pub(super) async fn read_through_leases(
    tx: &impl GenericClient,
    rows: &mut [EventRow],
    listed_as: &[(String, u64)],
    known: Option<&Leases>,
) -> Result<Vec<Option<i64>>> {
    let mut out = vec![None; rows.len()];
    let open: Vec<usize> = (0..rows.len())
        .filter(|&i| lease::never_claimed(&rows[i]))
        .collect();
    if open.is_empty() {
        return Ok(out);
    }
    let found: HashMap<(String, u64), Listed> = match known {
        Some(k) => open
            .iter()
            .filter_map(|&i| {
                k.by_position
                    .get(&listed_as[i])
                    .map(|l| (listed_as[i].clone(), *l))
            })
            .collect(),
        None => {
            let clusters: Vec<&str> = open.iter().map(|&i| listed_as[i].0.as_str()).collect();
            let positions: Vec<i64> = open.iter().map(|&i| listed_as[i].1 as i64).collect();
            let lo = positions.iter().copied().min().unwrap_or(0);
            let hi = positions.iter().copied().max().unwrap_or(0);
            counted(1);
            let mut found = HashMap::new();
            for r in tx
                .query(
                    "SELECT l.dest_cluster, k.pos, l.lease_id, l.owner, l.lease_until_ms,
                            l.started_at_ms, k.attempt_id
                     FROM sealpost.lease l
                     CROSS JOIN LATERAL unnest(l.positions, l.attempt_ids) AS k(pos, attempt_id)
                     WHERE l.dest_cluster = ANY($1) AND l.lo_seq <= $3 AND l.hi_seq >= $2
                       AND k.pos = ANY($4)",
                    &[&clusters, &lo, &hi, &positions],
                )
                .await?
            {
                let key: (String, u64) = (r.get(0), r.get::<_, i64>(1) as u64);
                let listed = Listed {
                    lease_id: r.get(2),
                    send: LeasedSend {
                        owner: r.get::<_, i64>(3) as u64,
                        lease_until_ms: r.get::<_, i64>(4) as u64,
                        started_at_ms: r.get::<_, i64>(5) as u64,
                        attempt_id: r.get::<_, i64>(6) as u64,
                    },
                };
                if found.insert(key.clone(), listed).is_some() {
                    return Err(StoreError::Corrupt(format!(
                        "commit position {} of cluster {} is listed by two leases",
                        key.1, key.0
                    )));
                }
            }
            found
        }
    };
    for i in open {
        if let Some(l) = found.get(&listed_as[i]) {
            if let Some(view) = lease::leased_view(&rows[i], &l.send) {
                rows[i] = view;
                out[i] = Some(l.lease_id);
            }
        }
    }
    Ok(out)
}

/// Records the first sends a claim authorised, one lease per cluster: `(cluster, position,
/// entry)` in claim order. Returns the lease id of each send, in order.
pub(super) async fn insert_leases(
    tx: &Transaction<'_>,
    sends: &[(&str, u64, LeasedSend)],
    prepared: Option<&mut Prepared>,
) -> Result<Vec<i64>> {
    let mut out = vec![0; sends.len()];
    if sends.is_empty() {
        return Ok(out);
    }
    let s = prepare(
        prepared,
        tx,
        "INSERT INTO sealpost.lease (dest_cluster, owner, lease_until_ms, started_at_ms, lo_seq,
             hi_seq, positions, attempt_ids)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8) RETURNING lease_id",
    )
    .await?;
    let mut clusters: Vec<&str> = sends.iter().map(|s| s.0).collect();
    clusters.sort_unstable();
    clusters.dedup();
    for cluster in clusters {
        let mut idx: Vec<usize> = (0..sends.len())
            .filter(|&i| sends[i].0 == cluster)
            .collect();
        idx.sort_by_key(|&i| sends[i].1);
        let first = sends[idx[0]].2;
        if idx.iter().any(|&i| {
            let s = sends[i].2;
            (s.owner, s.lease_until_ms, s.started_at_ms)
                != (first.owner, first.lease_until_ms, first.started_at_ms)
        }) {
            return Err(StoreError::Corrupt(
                "a claim's first sends differ in owner, lease or registration time".into(),
            ));
        }
        let positions: Vec<i64> = idx.iter().map(|&i| sends[i].1 as i64).collect();
        let attempts: Vec<i64> = idx.iter().map(|&i| sends[i].2.attempt_id as i64).collect();
        counted(1);
        let id: i64 = tx
            .query_one(
                &s,
                &[
                    &cluster,
                    &(first.owner as i64),
                    &(first.lease_until_ms as i64),
                    &(first.started_at_ms as i64),
                    &positions[0],
                    &positions[positions.len() - 1],
                    &positions,
                    &attempts,
                ],
            )
            .await?
            .get(0);
        for &i in &idx {
            out[i] = id;
        }
    }
    Ok(out)
}

/// The work rows `w` a lease of cluster `cluster` listing `positions` stands for (SQL
/// expressions for both): its rows that are still never claimed, found by position, one
/// probe of the claim index each (a plan that walks the cluster's claimable rows instead, as
/// the planner chose for a join to the unnested positions, took seconds per lease).
pub(super) fn stood_for_sql(cluster: &str, positions: &str) -> String {
    format!(
        "w.dest_cluster = {cluster} AND w.committed_seq = ANY ({positions})
         AND w.phase = {DISPATCHABLE} AND {NEVER_CLAIMED_SQL}"
    )
}

/// Drops the leases `l` that `filter` selects and that no longer stand for any row (every
/// row they list was written since, or is gone): [`lease::may_drop`], decided in the
/// statement that deletes unless `rows_proven` (the caller's own writes proved every row of
/// them written: a written row is never again never claimed, so the rows are not read). A
/// lease another transaction is dropping at the same time is skipped, not waited for: a
/// claim (under its claim lock), a dispatcher's acceptance and the reconciler (under
/// neither) may drop the same expired leases in different orders, and waiting could
/// deadlock; the lease is gone when that one commits, or a later drop takes it. Returns how
/// many it dropped.
async fn drop_where(
    client: &impl GenericClient,
    filter: &str,
    rows_proven: bool,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<u64> {
    let stands_for_nothing = if rows_proven {
        String::new()
    } else {
        format!(
            "AND NOT EXISTS (SELECT 1 FROM sealpost.work w WHERE {})",
            stood_for_sql("l.dest_cluster", "l.positions")
        )
    };
    counted(1);
    Ok(client
        .execute(
            &format!(
                "DELETE FROM sealpost.lease WHERE lease_id IN (
                   SELECT l.lease_id FROM sealpost.lease l
                   WHERE {filter} {stands_for_nothing}
                   ORDER BY l.lease_id FOR UPDATE SKIP LOCKED)"
            ),
            params,
        )
        .await?)
}

/// Drops those of `lease_ids` that no longer stand for any row ([`drop_where`]); with
/// `rows_proven`, the caller's own guarded writes returned every row of them.
pub(super) async fn drop_listed(
    client: &impl GenericClient,
    lease_ids: &[i64],
    rows_proven: bool,
) -> Result<u64> {
    if lease_ids.is_empty() {
        return Ok(0);
    }
    drop_where(client, "l.lease_id = ANY($1)", rows_proven, &[&lease_ids]).await
}

/// Drops every expired lease that no longer stands for any row (the reconciler's sweep, after
/// it moved the rows of expired leases to `DISPATCH_UNKNOWN`; [`drop_where`]).
pub(super) async fn drop_settled_expired(client: &impl GenericClient, now_ms: u64) -> Result<u64> {
    drop_where(client, "l.lease_until_ms <= $1", false, &[&(now_ms as i64)]).await
}

/// A work row on which the statements of the lease rule disagree ([`check_lease_rule`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseRuleDisagreement {
    pub event_id: EventId,
    pub member: u16,
    /// [`lease::never_claimed`] of the row as stored.
    pub core: bool,
    /// The store's SQL of the same rule (the claim's and the lease drop's).
    pub sql: bool,
    /// A lease lists the row's commit position.
    pub listed: bool,
    /// The row is in the view `sealpost.leased` (migration 12).
    pub in_view: bool,
    /// A lease stands for the row as the lease drop reads it ([`stood_for_sql`]).
    pub stood_for: bool,
}

/// Reads every work row and checks, row by row, that the lease rule says the same in each
/// place it is stated: the core's [`lease::never_claimed`] of the row as loaded, the store's
/// SQL predicate (the claim's pick and the lease drop), the view `sealpost.leased` of
/// migration 12 (a row is in it exactly when a lease lists it and the core calls it never
/// claimed) and the lease drop's "the lease stands for this row". The view lives in a
/// migration and cannot be generated from the core; this is what keeps the three from
/// drifting. Returns the rows on which they disagree (none, on a sound store).
///
/// # Transactions and locks
/// One statement that reads the whole `work` table with its envelopes, no row locks: a check
/// for tests and operators, not for the hot path.
pub async fn check_lease_rule(client: &impl GenericClient) -> Result<Vec<LeaseRuleDisagreement>> {
    let base = ROW_COLS_LEN;
    let q = locked_rows_sql(
        "FROM sealpost.work w",
        &format!(
            ", ({NEVER_CLAIMED_SQL}),
             EXISTS (SELECT 1 FROM sealpost.lease l
                     WHERE l.dest_cluster = w.dest_cluster AND w.committed_seq = ANY (l.positions)),
             EXISTS (SELECT 1 FROM sealpost.leased x
                     WHERE x.event_id = w.event_id AND x.member = w.member),
             EXISTS (SELECT 1 FROM sealpost.lease l WHERE {})",
            stood_for_sql("l.dest_cluster", "l.positions")
        ),
        "w.event_id, w.member",
    );
    counted(1);
    let mut out = Vec::new();
    for r in client.query(q.as_str(), &[]).await? {
        let row = parse_row(&r)?.row;
        let core = lease::never_claimed(&row);
        let (sql, listed, in_view, stood_for): (bool, bool, bool, bool) = (
            r.get(base),
            r.get(base + 1),
            r.get(base + 2),
            r.get(base + 3),
        );
        if sql != core || in_view != (listed && core) || stood_for != in_view {
            out.push(LeaseRuleDisagreement {
                event_id: row.event_id,
                member: row.member,
                core,
                sql,
                listed,
                in_view,
                stood_for,
            });
        }
    }
    Ok(out)
}
