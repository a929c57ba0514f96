//! The rolling verification pass (R31): the published rows to ask the broker about, and the
//! finding recorded when the broker holds no copy.

use super::*;

/// The next published rows of the rolling verification pass (R31): the `PUBLISHED` rows
/// among the next [`verify_window_rows`]`(max)` rows after the pass's cursor in primary-key
/// order (UUIDv7 event ids: roughly commit order), at most `max`; the cursor moves past the
/// last row returned when `max` were found, else past the window. An empty window means the
/// pass wrapped around (the cursor starts again at the beginning); an empty answer also comes
/// from a window with no published row (a backlog being drained), and the pass moves on from
/// after it at its next turn.
///
/// # Transactions and locks
/// One short transaction; two ordered scans of the primary key from the cursor, each stopped
/// after the window (forced, as the claim's is: with statistics taken while every row was
/// `PENDING` the planner chose a parallel sequential scan of the whole table, measured at 0.5 s
/// and 410,000 blocks per batch on a 3 GB `work` heap), and an update of the one cursor row.
/// No row lock on the envelopes.
pub async fn published_after_cursor(
    client: &mut tokio_postgres::Client,
    max: usize,
) -> Result<Vec<VerifyItem>> {
    let window = verify_window_rows(max) as i64;
    let tx = client.transaction().await?;
    tx.batch_execute("SET LOCAL enable_bitmapscan = off; SET LOCAL enable_seqscan = off")
        .await?;
    let after: (Uuid, i16) = tx
        .query_opt(
            "SELECT after_event_id, after_member FROM sealpost.verify_cursor
             WHERE name = 'published' FOR UPDATE",
            &[],
        )
        .await?
        .map_or((Uuid::nil(), -1), |r| (r.get(0), r.get(1)));
    let q = locked_rows_sql(
        "FROM (SELECT x.*, x.xmin FROM sealpost.work x WHERE (x.event_id, x.member) > ($1, $2)
               ORDER BY x.event_id, x.member LIMIT $3) w
         WHERE w.state = 'PUBLISHED' ORDER BY w.event_id, w.member LIMIT $4",
        "",
        "w.event_id, w.member",
    );
    let rows = tx
        .query(q.as_str(), &[&after.0, &after.1, &window, &(max as i64)])
        .await?;
    let mut items = Vec::with_capacity(rows.len());
    let mut last = (Uuid::nil(), -1i16);
    for r in &rows {
        let row = parse_row(r)?.row;
        last = (uuid_of(row.event_id), row.member as i16);
        if let Some(p) = &row.primary {
            items.push(VerifyItem {
                event_id: row.event_id,
                member: row.member,
                destination: row.destination.clone(),
                sequence: p.sequence,
            });
        }
    }
    if rows.len() < max {
        // Fewer than `max` published rows in the window: the cursor moves past all of it
        // (to the start if it was empty: the pass wrapped around).
        last = tx
            .query_opt(
                "SELECT event_id, member FROM (
                   SELECT event_id, member FROM sealpost.work WHERE (event_id, member) > ($1, $2)
                   ORDER BY event_id, member LIMIT $3) x
                 ORDER BY event_id DESC, member DESC LIMIT 1",
                &[&after.0, &after.1, &window],
            )
            .await?
            .map_or((Uuid::nil(), -1), |r| (r.get(0), r.get(1)));
    }
    tx.execute(
        "INSERT INTO sealpost.verify_cursor (name, after_event_id, after_member)
         VALUES ('published', $1, $2)
         ON CONFLICT (name) DO UPDATE SET after_event_id = EXCLUDED.after_event_id,
             after_member = EXCLUDED.after_member",
        &[&last.0, &last.1],
    )
    .await?;
    tx.commit().await?;
    Ok(items)
}

/// Records the finding "published but missing at the broker" (R31) once per event member:
/// the slot says `PUBLISHED`, the broker answered that it holds no copy. `reconcile` reports
/// it; nothing is retried automatically (the message was acknowledged once; resending it is
/// an operator's decision).
pub async fn record_missing(client: &impl GenericClient, item: &VerifyItem) -> Result<bool> {
    let n = client
        .execute(
            "INSERT INTO sealpost.finding (event_id, member, kind, detail, at_ms)
             VALUES ($1, $2, 'published_missing_at_broker', $3,
                     (extract(epoch from clock_timestamp()) * 1000)::bigint)
             ON CONFLICT (event_id, member, kind) DO NOTHING",
            &[
                &uuid_of(item.event_id),
                &(item.member as i16),
                &format!(
                    "primary receipt {}/{}#{} but the broker holds no copy",
                    item.destination.cluster, item.destination.topic, item.sequence
                ),
            ],
        )
        .await?;
    Ok(n == 1)
}
