//! The sole acceptance point and the outcome reports: receipts become `PUBLISHED` here
//! ([`step::step_accept`], [`step::step_guarded`]) and refusals, timeouts and unknowns are
//! recorded ([`step::step_report`]).

use super::*;

/// How a receipt fared at the acceptance point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accepted {
    /// The verdict of `decide_receipt`.
    Verdict(ReceiptVerdict),
    /// No envelope row has this id (unknown event id, or purged).
    UnknownEvent,
}

/// `acceptDispatchReceipt` (R10–R12) for a batch of receipts: the sole acceptance point.
///
/// # Transactions and locks
/// One transaction locks every named row (`FOR UPDATE`, key order), loads its attempts,
/// applies `decide_receipt` to each receipt in turn and writes the slot, the receipt rows,
/// quarantine and audit entries. It does not look at claims: a late ACK from an expired
/// attempt competes for the slot like any other (R11). If it rolls back, nothing changed
/// and the same receipts can be submitted again.
pub async fn accept_receipts(
    client: &mut tokio_postgres::Client,
    receipts: &[Receipt],
) -> Result<Vec<Accepted>> {
    let tx = client.transaction().await?;
    let now_ms = db_now_ms(&tx).await?;
    let (out, _) = accept_in(&tx, receipts, now_ms).await?;
    tx.commit().await?;
    Ok(out)
}

/// A receipt the acceptance point made primary: the row is now `PUBLISHED`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Published {
    /// The frozen destination's topic (stream).
    pub topic: String,
    /// Commit -> `PUBLISHED`, milliseconds of the database clock (the envelope's
    /// `created_at_ms` to the acceptance transaction's clock).
    pub latency_ms: u64,
}

async fn accept_in(
    tx: &Transaction<'_>,
    receipts: &[Receipt],
    now_ms: u64,
) -> Result<(Vec<Accepted>, Vec<Published>)> {
    let keys: Vec<(EventId, u16)> = receipts.iter().map(|r| (r.event_id, r.member)).collect();
    let (before, created) = lock_rows_created(tx, &keys).await?;
    let mut after = before.clone();
    let judged = step::step_accept(&mut after, receipts, now_ms, &mut CoreRules)?;
    write_acceptance(tx, &before, &after, &created, receipts, judged, now_ms).await
}

/// Persists what [`step::step_accept`] decided over the locked rows `before` (now `after`):
/// the rows, the evidence receipts, quarantine and audit entries.
pub(super) async fn write_acceptance(
    tx: &Transaction<'_>,
    before: &[EventRow],
    after: &[EventRow],
    created: &[u64],
    receipts: &[Receipt],
    judged: Vec<Acceptance>,
    now_ms: u64,
) -> Result<(Vec<Accepted>, Vec<Published>)> {
    let mut published = Vec::new();
    let mut out = Vec::with_capacity(receipts.len());
    let mut rec_rows: Vec<(usize, &'static str)> = Vec::new();
    let mut quarantine: Vec<(usize, String)> = Vec::new();
    let mut audit: Vec<(usize, String)> = Vec::new();
    for (k, j) in judged.into_iter().enumerate() {
        let (i, v, evidence) = match j {
            Acceptance::UnknownEvent => {
                out.push(Accepted::UnknownEvent);
                audit.push((k, "receipt for an unknown event id".to_string()));
                continue;
            }
            Acceptance::Judged {
                row,
                verdict,
                evidence,
            } => (row, verdict, evidence),
        };
        if v == ReceiptVerdict::Primary {
            published.push(Published {
                topic: after[i].destination.topic.clone(),
                latency_ms: now_ms.saturating_sub(created[i]),
            });
        }
        if let Some(e) = evidence {
            rec_rows.push((k, e.kind()));
        }
        match v {
            ReceiptVerdict::Quarantine(q) => quarantine.push((k, format!("{q:?}"))),
            ReceiptVerdict::Reject(why) => audit.push((k, format!("receipt rejected: {why:?}"))),
            ReceiptVerdict::Primary | ReceiptVerdict::Duplicate(_) => {}
        }
        out.push(Accepted::Verdict(v));
    }
    persist(tx, before, after).await?;
    if !rec_rows.is_empty() {
        let mut ids = Vec::new();
        let mut members = Vec::new();
        let mut attempts = Vec::new();
        let mut kinds = Vec::new();
        let mut sources = Vec::new();
        let mut clusters = Vec::new();
        let mut streams = Vec::new();
        let mut parts: Vec<Option<i32>> = Vec::new();
        let mut seqs = Vec::new();
        let mut dups = Vec::new();
        for (k, kind) in &rec_rows {
            let r = &receipts[*k];
            ids.push(uuid_of(r.event_id));
            members.push(r.member as i16);
            attempts.push(r.attempt_id as i64);
            kinds.push(kind.to_string());
            sources.push(match r.source {
                ReceiptSource::Ack => "ack".to_string(),
                ReceiptSource::Lookup => "lookup".to_string(),
            });
            clusters.push(r.cluster.clone());
            streams.push(r.stream.clone());
            parts.push(r.partition.map(|p| p as i32));
            seqs.push(r.sequence as i64);
            dups.push(r.broker_duplicate);
        }
        counted(1);
        tx.execute(
            "INSERT INTO sealpost.receipt (event_id, member, attempt_id, kind, source, cluster, stream, partition,
                sequence, broker_duplicate, accepted_at_ms)
             SELECT u.*, $11 FROM unnest($1::uuid[], $2::int2[], $3::int8[], $4::text[], $5::text[], $6::text[],
                                    $7::text[], $8::int4[], $9::int8[], $10::bool[]) AS u",
            &[&ids, &members, &attempts, &kinds, &sources, &clusters, &streams, &parts, &seqs, &dups, &(now_ms as i64)],
        )
        .await?;
    }
    for (k, reason) in quarantine {
        let r = &receipts[k];
        tx.execute(
            "INSERT INTO sealpost.quarantine (event_id, member, attempt_id, reason, detail, at_ms)
             VALUES ($1, $2, $3, $4, $5, $6)",
            &[
                &uuid_of(r.event_id),
                &(r.member as i16),
                &(r.attempt_id as i64),
                &reason,
                &format!(
                    "receipt {}#{} payload {} destination {}",
                    r.stream, r.sequence, r.payload_digest, r.destination_digest
                ),
                &(now_ms as i64),
            ],
        )
        .await?;
    }
    for (k, what) in audit {
        let r = &receipts[k];
        tx.execute(
            "INSERT INTO sealpost.audit (event_id, member, attempt_id, what, detail, at_ms)
             VALUES ($1, $2, $3, $4, $5, $6)",
            &[
                &uuid_of(r.event_id),
                &(r.member as i16),
                &(r.attempt_id as i64),
                &what,
                &format!(
                    "{}#{} duplicate={}",
                    r.stream, r.sequence, r.broker_duplicate
                ),
                &(now_ms as i64),
            ],
        )
        .await?;
    }
    Ok((out, published))
}

pub use sealpost_core::dispatcher::OutcomeReport;

/// What one submission did.
#[derive(Clone, Debug, Default)]
pub struct Submitted {
    /// The acceptance point's verdict per receipt, in order.
    pub accepted: Vec<Accepted>,
    /// The verdict per outcome report, in order.
    pub reported: Vec<SendOutcomeDecision>,
    /// Rows that could not leave at least `NEVER_SENT_ALERT_COUNT` times in a row, with the
    /// count and the last reason: an operator alert (a deleted stream, a cluster nobody
    /// serves), never a hot loop.
    pub stuck: Vec<(EventId, u32, String)>,
    /// Receipts accepted by [`submit_held`]'s guarded write (this call, or an earlier try of
    /// the same submission) rather than the locked transaction.
    pub guarded: usize,
    /// The receipts that made their row `PUBLISHED`, with the commit -> `PUBLISHED` latency.
    pub published: Vec<Published>,
    /// The destination topic of each outcome report, in order (empty for a row that is gone).
    pub report_topics: Vec<String>,
}

/// Commits a dispatcher's receipts and outcome reports in **one** transaction: either all of
/// it counts or none of it, so a retry after a failure never records the same ACK twice.
///
/// # Transactions and locks
/// One transaction; the acceptance point locks the receipts' rows, then the reports' rows
/// (each set in key order). A report and a receipt for the same row see each other's
/// writes in that order.
pub async fn submit(
    client: &mut tokio_postgres::Client,
    submission: &Submission,
    rejection_limit: u32,
) -> Result<Submitted> {
    counted(2);
    let tx = client.transaction().await?;
    // One read of the database clock for the whole transaction.
    let now_ms = db_now_ms(&tx).await?;
    let (accepted, published) = if submission.receipts.is_empty() {
        (Vec::new(), Vec::new())
    } else {
        accept_in(&tx, &submission.receipts, now_ms).await?
    };
    let (reported, stuck, report_topics) = if submission.reports.is_empty() {
        (Vec::new(), Vec::new(), Vec::new())
    } else {
        report_in(&tx, &submission.reports, rejection_limit, now_ms).await?
    };
    tx.commit().await?;
    Ok(Submitted {
        accepted,
        reported,
        stuck,
        guarded: 0,
        published,
        report_topics,
    })
}

/// [`submit`] for a dispatcher that claims with [`claim` with a `Held`]: an ordinary first ACK
/// for a row the dispatcher still holds exactly as its claim wrote it is accepted by one
/// guarded `UPDATE` (the core's `decide_receipt` and `apply_receipt` run on the held row; see
/// [`Held`]); everything else (receipts for rows written since, lookups, broker duplicates,
/// outcome reports) goes through [`submit`]'s locked transaction.
///
/// # Transactions and locks
/// The guarded write is one statement in its own transaction, taking only the row locks
/// of the rows it writes; the rest is one transaction as in [`submit`]. If that second
/// transaction fails, the error is returned and the receipts the guarded write accepted stay
/// recorded in `held`: the same submission, retried, reports them with the same verdict and
/// never accepts them twice.
pub async fn submit_held(
    client: &mut tokio_postgres::Client,
    submission: &Submission,
    rejection_limit: u32,
    held: &mut Held,
) -> Result<Submitted> {
    let r = submit_held_in(client, submission, rejection_limit, held).await;
    if r.is_err() {
        held.forget_statements();
    }
    r
}

async fn submit_held_in(
    client: &mut tokio_postgres::Client,
    submission: &Submission,
    rejection_limit: u32,
    held: &mut Held,
) -> Result<Submitted> {
    let receipts = &submission.receipts;
    let mut accepted: Vec<Option<Accepted>> = vec![None; receipts.len()];
    let mut seen: foldhash::HashMap<(EventId, u16), usize> =
        foldhash::HashMap::with_capacity_and_hasher(receipts.len(), Default::default());
    for r in receipts {
        *seen.entry((r.event_id, r.member)).or_default() += 1;
    }
    let mut guarded = 0;
    let mut published = Vec::new();
    let mut fast = Vec::new();
    let mut before = Vec::new();
    let mut after = Vec::new();
    let mut xmins = Vec::new();
    // One reading of the clock for the whole guarded write: the time `apply_receipt` stamps
    // is the one the latency is measured to.
    let guarded_now = held.db_now_ms();
    let guarded_now_ms = guarded_now.unwrap_or(0);
    if let Some(now_ms) = guarded_now {
        for (k, r) in receipts.iter().enumerate() {
            let key = (r.event_id, r.member);
            let Some(h) = held.rows.get(&key) else {
                continue;
            };
            if let Some((a, p)) = &h.accepted {
                accepted[k] = Some(*a);
                published.push(p.clone());
                guarded += 1;
                continue;
            }
            // The core's guarded step on the row as the claim left it; the write below lands
            // only if the row is still that version (its `xmin`).
            let Some(a) = step::step_guarded(&h.row, r, seen[&key], now_ms, decide_receipt)? else {
                continue;
            };
            fast.push(k);
            before.push(&h.row);
            after.push(a);
            xmins.push(h.xmin);
        }
    }
    if !fast.is_empty() {
        let written: foldhash::HashSet<(EventId, u16)> = persist_guarded(
            &*client,
            &before,
            &after,
            Some(&xmins),
            Some(&mut held.statements),
        )
        .await?
        .into_iter()
        .collect();
        for k in fast {
            let key = (receipts[k].event_id, receipts[k].member);
            if written.contains(&key) {
                guarded += 1;
                let a = Accepted::Verdict(ReceiptVerdict::Primary);
                accepted[k] = Some(a);
                let mut proven = None;
                if let Some(h) = held.rows.get_mut(&key) {
                    let p = Published {
                        topic: h.row.destination.topic.clone(),
                        latency_ms: guarded_now_ms.saturating_sub(h.created_at_ms),
                    };
                    published.push(p.clone());
                    h.accepted = Some((a, p));
                    proven = h.lease;
                }
                if let Some(l) = proven {
                    held.proven_written(l);
                }
            }
        }
    }
    let rest: Vec<usize> = (0..receipts.len())
        .filter(|&k| accepted[k].is_none())
        .collect();
    let mut reported = Vec::new();
    let mut stuck = Vec::new();
    let mut report_topics = Vec::new();
    if !rest.is_empty() || !submission.reports.is_empty() {
        counted(2);
        let tx = client.transaction().await?;
        let now_ms = db_now_ms(&tx).await?;
        if !rest.is_empty() {
            let rest_receipts: Vec<Receipt> = rest.iter().map(|&k| receipts[k].clone()).collect();
            let (out, p) = accept_in(&tx, &rest_receipts, now_ms).await?;
            published.extend(p);
            for (&k, a) in rest.iter().zip(out) {
                accepted[k] = Some(a);
            }
        }
        if !submission.reports.is_empty() {
            (reported, stuck, report_topics) =
                report_in(&tx, &submission.reports, rejection_limit, now_ms).await?;
        }
        tx.commit().await?;
    }
    // Answered: these rows are no longer held (a later receipt for one of them, a copy or a
    // late ACK, takes the locked path).
    let mut settled = Vec::new();
    let mut proven = Vec::new();
    let answered = receipts
        .iter()
        .map(|r| (r.event_id, r.member))
        .chain(submission.reports.iter().map(|r| (r.event_id, r.member)));
    for key in answered {
        if let Some(l) = held.rows.remove(&key).and_then(|h| h.lease) {
            if let Some(h) = held.unhold_lease(l) {
                if sealpost_core::lease::may_drop(h.unproven) {
                    proven.push(l);
                } else {
                    settled.push(l);
                }
            }
        }
    }
    // A lease all of whose rows were answered stands for nothing once they were written;
    // one whose row an answer left unwritten (a rejected receipt) stays until it expires.
    // Where this dispatcher's guarded writes proved every row written, the rows are not
    // read again.
    super::lease::drop_listed(&*client, &settled, false).await?;
    super::lease::drop_listed(&*client, &proven, true).await?;
    Ok(Submitted {
        accepted: accepted
            .into_iter()
            .map(|a| a.expect("every receipt has a verdict"))
            .collect(),
        reported,
        stuck,
        guarded,
        published,
        report_topics,
    })
}

/// Applies senders' outcome reports (ACK timeout, never sent, refused). A report whose claim
/// is no longer current is kept as audit only (R9).
///
/// # Transactions and locks
/// One transaction locking the named rows in key order; each write is a compare-and-set on
/// the claim generation through `decide_send_outcome`.
pub async fn report_outcomes(
    client: &mut tokio_postgres::Client,
    reports: &[OutcomeReport],
    rejection_limit: u32,
) -> Result<Vec<SendOutcomeDecision>> {
    let tx = client.transaction().await?;
    let now_ms = db_now_ms(&tx).await?;
    let (out, _, _) = report_in(&tx, reports, rejection_limit, now_ms).await?;
    tx.commit().await?;
    Ok(out)
}

type Stuck = Vec<(EventId, u32, String)>;

async fn report_in(
    tx: &Transaction<'_>,
    reports: &[OutcomeReport],
    rejection_limit: u32,
    now_ms: u64,
) -> Result<(Vec<SendOutcomeDecision>, Stuck, Vec<String>)> {
    let keys: Vec<(EventId, u16)> = reports.iter().map(|r| (r.event_id, r.member)).collect();
    let mut topics = Vec::with_capacity(reports.len());
    let before = lock_rows(tx, &keys).await?;
    let mut after = before.clone();
    let reported = step::step_report(&mut after, reports, rejection_limit, now_ms, &mut CoreRules)?;
    let mut out = Vec::with_capacity(reports.len());
    let mut stuck = Vec::new();
    let mut e_id = Vec::new();
    let mut e_member = Vec::new();
    let mut e_text = Vec::new();
    let mut q_rows = Vec::new();
    for (rep, r) in reports.iter().zip(reported) {
        topics.push(
            r.row
                .map_or_else(String::new, |i| after[i].destination.topic.clone()),
        );
        if r.records_error {
            // Evidence of why the row could not leave, shown by `status` and `trace`.
            e_id.push(uuid_of(rep.event_id));
            e_member.push(rep.member as i16);
            e_text.push(format!("{:?}: {}", rep.outcome, rep.detail));
        }
        if let Some(n) = r.stuck {
            stuck.push((rep.event_id, n, rep.detail.clone()));
        }
        if let Some(rejections) = r.quarantined_after {
            q_rows.push((rep, rejections));
        }
        if let (SendOutcomeDecision::Audit(f), Some(_)) = (r.decision, r.row) {
            tx.execute(
                "INSERT INTO sealpost.audit (event_id, member, attempt_id, owner, what, detail, at_ms)
                 VALUES ($1, $2, $3, $4, 'fenced outcome report', $5, $6)",
                &[
                    &uuid_of(rep.event_id),
                    &(rep.member as i16),
                    &(rep.attempt_id as i64),
                    &(rep.token.owner as i64),
                    &format!("{:?} ({}): {f:?}", rep.outcome, rep.detail),
                    &(now_ms as i64),
                ],
            )
            .await?;
        }
        out.push(r.decision);
    }
    persist(tx, &before, &after).await?;
    if !e_id.is_empty() {
        tx.execute(
            "UPDATE sealpost.work w SET last_error = u.t
             FROM unnest($1::uuid[], $2::int2[], $3::text[]) AS u(id, m, t)
             WHERE w.event_id = u.id AND w.member = u.m",
            &[&e_id, &e_member, &e_text],
        )
        .await?;
    }
    for (rep, rejections) in q_rows {
        tx.execute(
            "INSERT INTO sealpost.quarantine (event_id, member, attempt_id, reason, detail, at_ms)
             VALUES ($1, $2, $3, 'Poison', $4, $5)",
            &[
                &uuid_of(rep.event_id),
                &(rep.member as i16),
                &(rep.attempt_id as i64),
                &format!(
                    "refused {rejections} time(s), the limit; last: {}. Fix the cause, then `sealpost release {}`",
                    rep.detail, rep.event_id
                ),
                &(now_ms as i64),
            ],
        )
        .await?;
    }
    Ok((out, stuck, topics))
}
