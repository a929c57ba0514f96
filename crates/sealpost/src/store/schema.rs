//! The schema's migrations and the route policies the producer resolves at enqueue.

use super::*;

/// Applies the embedded migrations this database has not seen yet, each once and in order,
/// in one transaction under an advisory lock (concurrent `migrate` calls wait for each other;
/// a failure leaves the database at its previous version). A v1 database is converted in
/// place (migration 3 splits the envelope into the sealed row and the work row).
pub async fn migrate(client: &tokio_postgres::Client) -> Result<()> {
    // Up to date: nothing to do, and nothing that needs the owner's rights (a consumer's
    // login calls this at start).
    if schema_version(client).await? >= MIGRATIONS.last().map_or(0, |m| m.0) {
        return Ok(());
    }
    client
        .batch_execute(
            "CREATE SCHEMA IF NOT EXISTS sealpost;
             CREATE TABLE IF NOT EXISTS sealpost.schema_version (
                 version int PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())",
        )
        .await?;
    client.batch_execute("BEGIN").await?;
    let result = migrate_in(client).await;
    match result {
        Ok(()) => client.batch_execute("COMMIT").await?,
        Err(_) => {
            let _ = client.batch_execute("ROLLBACK").await;
        }
    }
    result
}

async fn migrate_in(client: &tokio_postgres::Client) -> Result<()> {
    client
        .execute("SELECT pg_advisory_xact_lock(7306142521)", &[])
        .await?;
    let applied: Vec<i32> = client
        .query("SELECT version FROM sealpost.schema_version", &[])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    for (v, sql) in MIGRATIONS {
        if applied.contains(v) {
            continue;
        }
        client
            .batch_execute(sql)
            .await
            .map_err(|e| StoreError::Migration(*v, db_message(&e)))?;
        client
            .execute(
                "INSERT INTO sealpost.schema_version (version) VALUES ($1) ON CONFLICT DO NOTHING",
                &[v],
            )
            .await?;
    }
    Ok(())
}

/// The schema version of this database (0: not migrated).
pub async fn schema_version(client: &impl GenericClient) -> Result<i32> {
    let exists: bool = client
        .query_one(
            "SELECT to_regclass('sealpost.schema_version') IS NOT NULL",
            &[],
        )
        .await?
        .get(0);
    if !exists {
        return Ok(0);
    }
    Ok(client
        .query_one(
            "SELECT coalesce(max(version), 0) FROM sealpost.schema_version",
            &[],
        )
        .await?
        .get(0))
}

/// Creates or revises a route policy: a revision bumps the generation; existing envelopes
/// keep their frozen destination (R2).
pub async fn set_route(
    client: &impl GenericClient,
    name: &str,
    cluster: &str,
    topic: &str,
) -> Result<u64> {
    let row = client
        .query_one(
            "INSERT INTO sealpost.route_policy (name, generation, cluster, topic) VALUES ($1, 1, $2, $3)
             ON CONFLICT (name) DO UPDATE SET generation = sealpost.route_policy.generation + 1,
                 cluster = EXCLUDED.cluster, topic = EXCLUDED.topic, updated_at = now()
             RETURNING generation",
            &[&name, &cluster, &topic],
        )
        .await?;
    Ok(row.get::<_, i64>(0) as u64)
}

/// Sets the durability a route policy freezes into new destinations (e.g. `file/r3` for a
/// JetStream stream of three replicas); a change bumps the generation, existing envelopes
/// keep theirs (R2). `None` when there is no such route.
pub async fn set_route_durability(
    client: &impl GenericClient,
    name: &str,
    durability: &str,
) -> Result<Option<u64>> {
    let row = client
        .query_opt(
            "UPDATE sealpost.route_policy
                SET generation = generation + (durability IS DISTINCT FROM $2)::int,
                    durability = $2, updated_at = now()
              WHERE name = $1
             RETURNING generation",
            &[&name, &durability],
        )
        .await?;
    Ok(row.map(|r| r.get::<_, i64>(0) as u64))
}

/// Sets how a route policy maps routing keys to partitions (for Kafka:
/// `kafka-murmur2/<partitions the topic has>`); a change bumps the generation, and events
/// already committed keep the algorithm and count frozen in their destination, so adding
/// partitions to a topic later moves none of them. `None` when there is no such route.
pub async fn set_route_partitions(
    client: &impl GenericClient,
    name: &str,
    algorithm: PartitionAlgorithm,
) -> Result<Option<u64>> {
    let row = client
        .query_opt(
            "UPDATE sealpost.route_policy
                SET generation = generation + (partition_algorithm IS DISTINCT FROM $2)::int,
                    partition_algorithm = $2, updated_at = now()
              WHERE name = $1
             RETURNING generation",
            &[&name, &algorithm.name()],
        )
        .await?;
    Ok(row.map(|r| r.get::<_, i64>(0) as u64))
}

/// [`set_route`] with a per-aggregate ordering choice (R29): a revision that changes it bumps
/// the generation like any other; events already committed keep the ordering frozen in
/// their destination.
pub async fn set_route_ordering(
    client: &impl GenericClient,
    name: &str,
    cluster: &str,
    topic: &str,
    ordering: EventOrdering,
) -> Result<u64> {
    let row = client
        .query_one(
            "INSERT INTO sealpost.route_policy (name, generation, cluster, topic, ordering)
             VALUES ($1, 1, $2, $3, $4)
             ON CONFLICT (name) DO UPDATE SET generation = sealpost.route_policy.generation + 1,
                 cluster = EXCLUDED.cluster, topic = EXCLUDED.topic,
                 ordering = EXCLUDED.ordering, updated_at = now()
             RETURNING generation",
            &[&name, &cluster, &topic, &ordering.name()],
        )
        .await?;
    Ok(row.get::<_, i64>(0) as u64)
}

/// Sets what a route encrypts its payloads by (`payload_key.rs`) and how long its stream or
/// topic keeps messages (`None` leaves a setting as it is; a `max_age_ms` of `Some(None)`
/// clears it). Neither is part of the frozen destination, so the generation stays. `false`
/// when there is no such route.
pub async fn set_route_lifecycle(
    client: &impl GenericClient,
    name: &str,
    keying: Option<Keying>,
    max_age_ms: Option<Option<i64>>,
) -> Result<bool> {
    let n = client
        .execute(
            "UPDATE sealpost.route_policy
                SET payload_key = coalesce($2, payload_key),
                    max_age_ms = CASE WHEN $3 THEN $4 ELSE max_age_ms END,
                    updated_at = now()
              WHERE name = $1",
            &[
                &name,
                &keying.map(Keying::name),
                &max_age_ms.is_some(),
                &max_age_ms.flatten(),
            ],
        )
        .await?;
    Ok(n == 1)
}

/// A route's lifecycle settings: payload keying and retention (ms), if the route exists.
pub async fn route_lifecycle(
    client: &impl GenericClient,
    name: &str,
) -> Result<Option<(Keying, Option<i64>)>> {
    let row = client
        .query_opt(
            "SELECT payload_key, max_age_ms FROM sealpost.route_policy WHERE name = $1",
            &[&name],
        )
        .await?;
    row.map(|r| Ok((keying_of(r.get(0))?, r.get(1))))
        .transpose()
}
