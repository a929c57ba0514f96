//! The causal trace of one business fact (R22): envelope, attempts, receipts, consumers,
//! quarantine and audit, by event id or by aggregate.

use sealpost_core::envelope::EventId;
use serde_json::{json, Value};
use uuid::Uuid;

use crate::store::{self, Result};

/// The causal chain of one business fact (R22), by event id or `aggregate-type/aggregate-id`.
pub async fn trace(pg: &tokio_postgres::Client, key: &str) -> Result<Value> {
    trace_bounded(pg, key, None).await
}

/// [`trace`], but with at most `max_events` event members (the first committed), and
/// `"truncated": true` in the answer when there were more (`"truncated": false` otherwise);
/// `None` is [`trace`] itself. The status page uses it: an aggregate's events are unbounded.
pub async fn trace_bounded(
    pg: &tokio_postgres::Client,
    key: &str,
    max_events: Option<i64>,
) -> Result<Value> {
    // One more than asked, to tell a full answer from a cut one (`LIMIT NULL` is no limit).
    let fetch = max_events.map(|m| m.max(0).saturating_add(1));
    let mut rows = if let Some(id) = EventId::parse(key) {
        pg.query(
            "SELECT event_id, member FROM sealpost.work WHERE event_id = $1 ORDER BY member
             LIMIT $2",
            &[&Uuid::from_bytes(id.0), &fetch],
        )
        .await?
    } else if let Some((t, a)) = key.split_once('/') {
        pg.query(
            "SELECT event_id, member FROM sealpost.outbox WHERE aggregate_type = $1 AND aggregate_id = $2
             ORDER BY committed_seq, member LIMIT $3",
            &[&t, &a, &fetch],
        )
        .await?
    } else {
        Vec::new()
    };
    let truncated = max_events.is_some_and(|m| rows.len() as i64 > m);
    if let Some(m) = max_events.filter(|_| truncated) {
        rows.truncate(m.max(0) as usize);
    }
    let mut out = Vec::new();
    for r in rows {
        let id: Uuid = r.get(0);
        let member: i16 = r.get(1);
        let e = pg
            .query_one(
                "SELECT state, envelope_generation, aggregate_type, aggregate_id, aggregate_version, event_type,
                        encode(payload_digest, 'hex'), encode(destination_digest, 'hex'),
                        encode(envelope_digest, 'hex'), dest_cluster, dest_topic, dest_policy_generation,
                        creating_txid, created_at_ms, published_at_ms, primary_stream, primary_sequence,
                        primary_attempt_id, attempt_generation
                 FROM sealpost.outbox WHERE event_id = $1 AND member = $2",
                &[&id, &member],
            )
            .await?;
        let q = |sql: &'static str| async move { pg.query(sql, &[&id, &member]).await };
        // `sealpost.attempts`: the evidence rows and the latest attempt, inline in the work row.
        let attempts: Vec<Value> = q("SELECT attempt_id, attempt_generation, claim_generation, owner, status, started_at_ms
                                      FROM sealpost.attempts WHERE event_id = $1 AND member = $2 ORDER BY attempt_id")
        .await?
        .iter()
        .map(|a| {
            json!({"attempt_id": a.get::<_, i64>(0), "attempt_generation": a.get::<_, i32>(1),
                   "claim_generation": a.get::<_, i64>(2), "owner": a.get::<_, i64>(3),
                   "status": a.get::<_, String>(4), "started_at_ms": a.get::<_, i64>(5)})
        })
        .collect();
        // `sealpost.receipts`: the evidence rows, then the happy path's primary from the work row.
        let receipts: Vec<Value> = q("SELECT kind, source, attempt_id, cluster, stream, sequence, broker_duplicate
                                      FROM sealpost.receipts WHERE event_id = $1 AND member = $2
                                      ORDER BY receipt_id NULLS LAST")
        .await?
        .iter()
        .map(|a| {
            json!({"kind": a.get::<_, String>(0), "source": a.get::<_, String>(1), "attempt_id": a.get::<_, i64>(2),
                   "cluster": a.get::<_, String>(3), "stream": a.get::<_, String>(4),
                   "sequence": a.get::<_, i64>(5), "broker_duplicate": a.get::<_, bool>(6)})
        })
        .collect();
        let consumers: Vec<Value> = q("SELECT consumer_id, receipt_id, stream, sequence, consumed_at_ms
                                       FROM sealpost.inbox WHERE event_id = $1 AND member = $2 ORDER BY consumer_id")
        .await?
        .iter()
        .map(|a| {
            json!({"consumer": a.get::<_, String>(0), "receipt_id": a.get::<_, i64>(1),
                   "stream": a.get::<_, String>(2), "sequence": a.get::<_, i64>(3),
                   "consumed_at_ms": a.get::<_, i64>(4)})
        })
        .collect();
        let quarantine: Vec<Value> = q("SELECT reason, detail, at_ms FROM sealpost.quarantine
                                        WHERE event_id = $1 AND member = $2 ORDER BY quarantine_id")
        .await?
        .iter()
        .map(|a| json!({"reason": a.get::<_, String>(0), "detail": a.get::<_, String>(1), "at_ms": a.get::<_, i64>(2)}))
        .collect();
        let audit: Vec<Value> = q("SELECT what, detail, at_ms FROM sealpost.audit
                                   WHERE event_id = $1 AND member = $2 ORDER BY audit_id")
        .await?
        .iter()
        .map(|a| json!({"what": a.get::<_, String>(0), "detail": a.get::<_, String>(1), "at_ms": a.get::<_, i64>(2)}))
        .collect();
        out.push(json!({
            "event_id": id.to_string(),
            "member": member,
            "committed": true,
            "state": e.get::<_, String>(0),
            "envelope": {
                "generation": e.get::<_, i32>(1),
                "aggregate": format!("{}/{}@{}", e.get::<_, String>(2), e.get::<_, String>(3), e.get::<_, i64>(4)),
                "event_type": e.get::<_, String>(5),
                "payload_digest": format!("sha256:{}", e.get::<_, String>(6)),
                "destination_digest": format!("sha256:{}", e.get::<_, String>(7)),
                "envelope_digest": format!("sha256:{}", e.get::<_, String>(8)),
                "destination": format!("{}/{}@route-{}", e.get::<_, String>(9), e.get::<_, String>(10), e.get::<_, i64>(11)),
                "creating_txid": e.get::<_, i64>(12),
                "created_at_ms": e.get::<_, i64>(13),
                "attempt_generation": e.get::<_, i32>(18),
            },
            "attempts": attempts,
            "broker_position": e.get::<_, Option<i64>>(16).map(|s| json!({
                "stream": e.get::<_, Option<String>>(15), "sequence": s,
                "primary_attempt_id": e.get::<_, Option<i64>>(17),
                "published_at_ms": e.get::<_, Option<i64>>(14)})),
            "receipts": receipts,
            "consumers": consumers,
            "quarantine": quarantine,
            "audit": audit,
        }));
    }
    // Delivery sets (R16): each event enqueued as a set, with the core's verdict on it.
    let mut sets = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for e in &out {
        let Some(id) = e["event_id"].as_str().and_then(EventId::parse) else {
            continue;
        };
        if seen.insert(id) {
            if let Some(set) = store::delivery_set(pg, id).await? {
                sets.push(serde_json::to_value(set).unwrap_or(Value::Null));
            }
        }
    }
    let mut answer = json!({ "query": key, "found": !out.is_empty(), "events": out, "sets": sets });
    if max_events.is_some() {
        answer["truncated"] = Value::Bool(truncated);
    }
    Ok(answer)
}
