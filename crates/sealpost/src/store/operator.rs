//! An operator's decisions on one event: releasing quarantine (R6) and migrating to a new
//! destination (R15).

use super::*;

/// The operator's exit for poison (R6): `QUARANTINED -> PENDING` through the core's state
/// table, with the rejection count and backoff reset, and an audit row naming who released
/// it and why. Any other state is refused with the row's state in the error.
///
/// # Transactions and locks
/// One transaction locking the event's rows (`FOR UPDATE`).
pub async fn release_quarantine(
    client: &mut tokio_postgres::Client,
    event_id: EventId,
    operator: &str,
    reason: &str,
) -> Result<usize> {
    let tx = client.transaction().await?;
    let now_ms = db_now_ms(&tx).await?;
    let members: Vec<i16> = tx
        .query(
            "SELECT member FROM sealpost.work WHERE event_id = $1 ORDER BY member",
            &[&uuid_of(event_id)],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    if members.is_empty() {
        return Err(StoreError::UnknownEvent(event_id.to_string()));
    }
    let keys: Vec<(EventId, u16)> = members.iter().map(|m| (event_id, *m as u16)).collect();
    let before = lock_rows(&tx, &keys).await?;
    let mut after = before.clone();
    let mut released = 0;
    for row in &mut after {
        if row.state != State::Quarantined {
            continue;
        }
        apply_release_quarantine(row).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        released += 1;
        tx.execute(
            "INSERT INTO sealpost.audit (event_id, member, what, detail, at_ms)
             VALUES ($1, $2, 'quarantine released', $3, $4)",
            &[
                &uuid_of(row.event_id),
                &(row.member as i16),
                &format!("by {operator}: {reason}"),
                &(now_ms as i64),
            ],
        )
        .await?;
    }
    if released == 0 {
        let states: Vec<String> = before.iter().map(|r| r.state.to_string()).collect();
        return Err(StoreError::NotQuarantined {
            event_id: event_id.to_string(),
            states: states.join(", "),
        });
    }
    persist(&tx, &before, &after).await?;
    tx.commit().await?;
    Ok(released)
}

/// Moves one event to the destination that route policy `route` resolves now (R15): granted
/// only with proof that the old destination did not accept it (every attempt there ended
/// `FAILED`), under a new envelope generation and with a migration receipt. Refused while an
/// attempt at the old destination is unknown.
///
/// # Transactions and locks
/// One transaction: locks the envelope row, reads the route policy (`FOR SHARE`), decides
/// with `decide_migration`, rewrites the destination columns and records the receipt.
pub async fn migrate_event(
    client: &mut tokio_postgres::Client,
    event_id: EventId,
    member: u16,
    route: &str,
) -> Result<
    std::result::Result<
        sealpost_core::migration::MigrationGrant,
        sealpost_core::migration::MigrationRefusal,
    >,
> {
    let tx = client.transaction().await?;
    let now_ms = db_now_ms(&tx).await?;
    let rows = lock_rows(&tx, &[(event_id, member)]).await?;
    let Some(row) = rows.first() else {
        return Err(StoreError::Corrupt(format!(
            "no envelope for event {event_id} member {member}"
        )));
    };
    let policy = load_policy(&tx, route).await?.policy;
    let key: String = tx
        .query_one(
            "SELECT dest_routing_key FROM sealpost.envelope
             WHERE event_id = $1 AND member = $2 AND envelope_generation = $3",
            &[
                &uuid_of(event_id),
                &(member as i16),
                &(row.envelope_generation as i32),
            ],
        )
        .await?
        .get(0);
    let to = policy.resolve(&key);
    // A delivery set's members stay distinct destinations (R16): refused before anything
    // is written when the new one is another member's.
    check_set_migration(&tx, event_id, member, route, &to).await?;
    let grant = match sealpost_core::migration::decide_migration(row, &to) {
        Ok(g) => g,
        Err(refusal) => {
            tx.execute(
                "INSERT INTO sealpost.audit (event_id, member, what, detail, at_ms)
                 VALUES ($1, $2, 'migration refused', $3, $4)",
                &[
                    &uuid_of(event_id),
                    &(member as i16),
                    &refusal.to_string(),
                    &(now_ms as i64),
                ],
            )
            .await?;
            tx.commit().await?;
            return Ok(Err(refusal));
        }
    };
    let mut after = row.clone();
    sealpost_core::migration::apply_migration(&mut after, &grant, to.clone())
        .map_err(|e| StoreError::Corrupt(e.to_string()))?;
    // The first generation stays as it was sealed; the new one is a new envelope row with
    // its own destination and envelope digest, the same payload and identity.
    let sealed = tx
        .query_one(
            "SELECT aggregate_type, aggregate_id, aggregate_version, event_type, payload_schema_digest,
                    payload_digest, tenant, occurred_at_ms, creating_txid
             FROM sealpost.envelope WHERE event_id = $1 AND member = $2 AND envelope_generation = $3",
            &[&uuid_of(event_id), &(member as i16), &(row.envelope_generation as i32)],
        )
        .await?;
    let env = SealedEnvelope {
        event_id,
        envelope_generation: grant.envelope_generation,
        aggregate_type: sealed.get(0),
        aggregate_id: sealed.get(1),
        aggregate_version: sealed.get::<_, i64>(2) as u64,
        event_type: sealed.get(3),
        payload_schema_digest: digest_of(sealed.get(4))?,
        payload_digest: digest_of(sealed.get(5))?,
        tenant: sealed.get(6),
        occurred_at_ms: sealed.get::<_, i64>(7) as u64,
        creating_txid: sealed.get::<_, i64>(8) as u64,
        destination: to.clone(),
        destination_digest: grant.to_digest,
    };
    tx.execute(
        "INSERT INTO sealpost.envelope (event_id, member, envelope_generation, aggregate_type, aggregate_id,
            aggregate_version, event_type, payload_schema_digest, payload_digest, tenant, occurred_at_ms,
            creating_txid, dest_cluster, dest_topic, dest_routing_key, dest_partition_alg,
            dest_policy_generation, dest_serializer, dest_durability, dest_required_ack,
            destination_digest, envelope_digest, payload, created_at_ms, dest_ordering)
         SELECT event_id, member, $4, aggregate_type, aggregate_id, aggregate_version, event_type,
            payload_schema_digest, payload_digest, tenant, occurred_at_ms, creating_txid, $5, $6,
            dest_routing_key, $7, $8, $9, $10, $11, $12, $13, payload, created_at_ms, $14
         FROM sealpost.envelope WHERE event_id = $1 AND member = $2 AND envelope_generation = $3",
        &[
            &uuid_of(event_id),
            &(member as i16),
            &(row.envelope_generation as i32),
            &(grant.envelope_generation as i32),
            &to.cluster,
            &to.topic,
            &to.partition_algorithm.name(),
            &(to.route_policy_generation as i64),
            &to.serializer,
            &to.durability,
            &to.required_ack,
            &grant.to_digest.0.as_slice(),
            &env.digest().0.as_slice(),
            &to.ordering.name(),
        ],
    )
    .await?;
    let gens: Vec<i32> = after
        .superseded
        .iter()
        .map(|s| s.envelope_generation as i32)
        .collect();
    let digs: Vec<Vec<u8>> = after
        .superseded
        .iter()
        .map(|s| s.destination_digest.0.to_vec())
        .collect();
    tx.execute(
        "UPDATE sealpost.work SET envelope_generation = $3, dest_cluster = $4,
            superseded_generations = $5, superseded_digests = $6, ordering_key = $7
         WHERE event_id = $1 AND member = $2",
        &[
            &uuid_of(event_id),
            &(member as i16),
            &(grant.envelope_generation as i32),
            &to.cluster,
            &gens,
            &digs,
            &ordering_key(to.ordering, &env.aggregate_type, &env.aggregate_id),
        ],
    )
    .await?;
    persist(&tx, std::slice::from_ref(row), std::slice::from_ref(&after)).await?;
    tx.execute(
        "INSERT INTO sealpost.migration (event_id, member, from_generation, to_generation, from_digest,
            to_digest, failed_attempts, at_ms) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        &[
            &uuid_of(event_id),
            &(member as i16),
            &(row.envelope_generation as i32),
            &(grant.envelope_generation as i32),
            &grant.from_digest.0.as_slice(),
            &grant.to_digest.0.as_slice(),
            &(grant.failed_attempts as i32),
            &(now_ms as i64),
        ],
    )
    .await?;
    tx.commit().await?;
    Ok(Ok(grant))
}
