//! The reconciler's transactions: claiming unknown rows ([`step::step_claim_unknown`]) and
//! writing a lookup's answer ([`step::step_finish_reconcile`]).

use super::*;

/// A row the reconciler now holds in `RECONCILING` (the reconciler machine's item).
pub use sealpost_core::reconciler::ReconcileItem as Reconciling;

/// Claims up to `batch_size_max` unknown rows for the reconciler (and moves expired
/// `SENDING` rows to `DISPATCH_UNKNOWN`).
///
/// # Transactions and locks
/// One short transaction with `FOR UPDATE SKIP LOCKED` over the unknown index; commits
/// before any broker lookup. Unknown rows whose next lookup is not due yet
/// (`next_lookup_at_ms`, skipped by the core's `decide_reconcile_claim`) are not selected, so
/// they cannot crowd due rows out of the batch.
pub async fn claim_unknown(
    client: &mut tokio_postgres::Client,
    owner: u64,
    batch_size_max: usize,
    lease_ms: u64,
) -> Result<Vec<Reconciling>> {
    let tx = client.transaction().await?;
    let now_ms = db_now_ms(&tx).await?;
    // Due unknown rows in the order they fell due: a range scan of `work_unknown_due` that
    // stops at `now`, never walking rows that are not due.
    let q = locked_rows_sql(
        &format!(
            "FROM sealpost.work w
         WHERE w.phase = {UNKNOWN} AND w.next_lookup_at_ms <= $1
           AND (w.lease_until_ms IS NULL OR w.lease_until_ms <= $1)
         ORDER BY w.next_lookup_at_ms LIMIT $2 FOR UPDATE OF w SKIP LOCKED"
        ),
        "",
        "w.next_lookup_at_ms",
    );
    counted(4);
    let mut found = tx
        .query(q.as_str(), &[&(now_ms as i64), &(batch_size_max as i64)])
        .await?;
    // `SENDING` rows whose lease ran out. The lease is not indexed (a claim must change no
    // indexed column, so that it stays a HOT update), so this looks only at the front of the
    // claim index: the oldest dispatchable rows, where a dispatcher that died mid-send left
    // them (claims go in commit order). Every dispatcher's claim scan moves any expired
    // `SENDING` row it passes to `DISPATCH_UNKNOWN` as well.
    let q = locked_rows_sql(
        &format!(
            "FROM sealpost.work w
         JOIN (SELECT event_id, member FROM sealpost.work WHERE phase = {DISPATCHABLE}
               ORDER BY dest_cluster, committed_seq LIMIT $3) f
           ON f.event_id = w.event_id AND f.member = w.member
         WHERE w.state = 'SENDING' AND w.lease_until_ms <= $1
         LIMIT $2 FOR UPDATE OF w SKIP LOCKED"
        ),
        "",
        "w.committed_seq",
    );
    found.extend(
        tx.query(
            q.as_str(),
            &[
                &(now_ms as i64),
                &(batch_size_max as i64),
                &((batch_size_max * step::EXPIRY_FRONT_PER_BATCH) as i64),
            ],
        )
        .await?,
    );
    // Rows a lease stands for whose lease ran out (its dispatcher died mid-send, or never
    // answered): read through the lease they are expired `SENDING` rows, as above. The
    // expired leases are read first (usually there are none, and then no work row is read);
    // their rows are then probed by position in the claim index, per cluster.
    counted(1);
    let expired = tx
        .query(
            "SELECT dest_cluster, positions FROM sealpost.lease WHERE lease_until_ms <= $1
             ORDER BY lease_id LIMIT $2",
            &[&(now_ms as i64), &(batch_size_max as i64)],
        )
        .await?;
    let mut by_cluster: Vec<(String, Vec<i64>)> = Vec::new();
    for r in &expired {
        let cluster: String = r.get(0);
        let positions: Vec<i64> = r.get(1);
        match by_cluster.iter_mut().find(|(c, _)| *c == cluster) {
            Some((_, p)) => p.extend(positions),
            None => by_cluster.push((cluster, positions)),
        }
    }
    if !by_cluster.is_empty() {
        let q = locked_rows_sql(
            &format!(
                "FROM sealpost.work w WHERE {}
             LIMIT $3 FOR UPDATE OF w SKIP LOCKED",
                super::lease::stood_for_sql("$1", "$2::int8[]")
            ),
            "",
            "w.committed_seq",
        );
        for (cluster, positions) in &by_cluster {
            counted(1);
            found.extend(
                tx.query(q.as_str(), &[cluster, positions, &(batch_size_max as i64)])
                    .await?,
            );
        }
    }
    let before = finish_load(&tx, &found).await?;
    let mut after = before.clone();
    let mut out = Vec::new();
    let picked = step::step_claim_unknown(&mut after, owner, now_ms, lease_ms)?;
    for (row, p) in after.iter().zip(picked) {
        if let step::UnknownPick::Claimed { token, .. } = p {
            out.push(Reconciling {
                event_id: row.event_id,
                member: row.member,
                token,
                destination: row.destination.clone(),
            });
        }
    }
    persist(&tx, &before, &after).await?;
    if !expired.is_empty() {
        super::lease::drop_settled_expired(&tx, now_ms).await?;
    }
    tx.commit().await?;
    Ok(out)
}

/// Applies the reconciler's verdict for one row after its lookup (R13–R14); a found message
/// goes through the acceptance point in the same transaction.
///
/// # Transactions and locks
/// One transaction locking the row; `decide_reconcile` checks the reconciler's claim, so an
/// ACK accepted meanwhile makes this a harmless no-op (`Fenced`).
pub async fn finish_reconcile(
    client: &mut tokio_postgres::Client,
    item: &Reconciling,
    lookup: &Lookup,
) -> Result<ReconcileDecision> {
    finish_reconcile_with(client, item, lookup, ReconcilePolicy::default()).await
}

/// [`finish_reconcile`] under the policy for the broker's capabilities
/// ([`ReconcilePolicy::for_capabilities`]): at a create-if-absent broker a conflicting copy
/// parks the row in `QUARANTINED` (with the reason in `sealpost.quarantine`) instead of
/// retrying forever.
///
/// # Transactions and locks
/// As [`finish_reconcile`].
pub async fn finish_reconcile_with(
    client: &mut tokio_postgres::Client,
    item: &Reconciling,
    lookup: &Lookup,
    policy: ReconcilePolicy,
) -> Result<ReconcileDecision> {
    Ok(finish_reconcile_published(client, item, lookup, policy)
        .await?
        .0)
}

/// [`finish_reconcile_with`], also saying whether the lookup's receipt made the row
/// `PUBLISHED` (and the commit -> `PUBLISHED` latency).
///
/// # Transactions and locks
/// As [`finish_reconcile`].
pub async fn finish_reconcile_published(
    client: &mut tokio_postgres::Client,
    item: &Reconciling,
    lookup: &Lookup,
    policy: ReconcilePolicy,
) -> Result<(ReconcileDecision, Option<Published>)> {
    let mut published = None;
    let tx = client.transaction().await?;
    let now_ms = db_now_ms(&tx).await?;
    let (before, created) = lock_rows_created(&tx, &[(item.event_id, item.member)]).await?;
    if before.is_empty() {
        tx.commit().await?;
        return Ok((decide_reconcile_missing(), None));
    }
    let mut after = before.clone();
    let finished = step::step_finish_reconcile(
        &mut after[0],
        item.token,
        lookup,
        policy,
        now_ms,
        &mut CoreRules,
    )?;
    let d = finished.decision;
    match &d {
        ReconcileDecision::Accept(r) => {
            let judged = finished.accepted.into_iter().collect();
            published = write_acceptance(
                &tx,
                &before,
                &after,
                &created,
                std::slice::from_ref(r),
                judged,
                now_ms,
            )
            .await?
            .1
            .pop();
        }
        ReconcileDecision::Conflict(q) => {
            persist(&tx, &before, &after).await?;
            let detail = match lookup {
                Lookup::Found(r) => format!(
                    "conflict: the destination holds a copy ({}#{}) with {q:?} and refuses a second one; migrate the event or remove the copy, then `sealpost release {}`",
                    r.stream, r.sequence, item.event_id
                ),
                Lookup::Unsealed { receipt: r, refusal } => format!(
                    "conflict: the destination holds a copy ({}#{}) that Sealpost did not sign ({q:?}: {refusal}) and refuses a second one; a forger may publish there: check the broker's publish rights, remove the copy, then `sealpost release {}`",
                    r.stream, r.sequence, item.event_id
                ),
                _ => format!("conflict: {q:?}"),
            };
            tx.execute(
                "INSERT INTO sealpost.quarantine (event_id, member, attempt_id, reason, detail, at_ms)
                 VALUES ($1, $2, NULL, 'Conflict', $3, $4)",
                &[&uuid_of(item.event_id), &(item.member as i16), &detail, &(now_ms as i64)],
            )
            .await?;
            tx.execute(
                "UPDATE sealpost.work SET last_error = $3 WHERE event_id = $1 AND member = $2",
                &[&uuid_of(item.event_id), &(item.member as i16), &detail],
            )
            .await?;
        }
        ReconcileDecision::RetrySameDestination { .. } | ReconcileDecision::StayUnknown => {
            persist(&tx, &before, &after).await?;
        }
        ReconcileDecision::Fenced(_) => {}
    }
    tx.commit().await?;
    Ok((d, published))
}
