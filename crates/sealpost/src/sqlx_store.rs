//! The producer API for sqlx users: the same `enqueue` and `enqueue_set` as
//! [`crate::store::enqueue`] and [`crate::store::enqueue_set`], on a sqlx connection or
//! transaction. Enabled by the `sqlx` feature.
//!
//! ```ignore
//! let mut tx = pool.begin().await?;
//! sqlx::query("INSERT INTO orders (id) VALUES ($1)").bind(&order_id).execute(&mut *tx).await?;
//! sealpost::sqlx_store::enqueue(&mut tx, "orders", event_id, &new_event, &routing_key).await?;
//! tx.commit().await?;
//! ```

use sealpost_core::delivery_set::{check_members, CompletionRule};
use sealpost_core::envelope::{EventId, NewEvent, SealedEnvelope};
use sqlx::Row;

use crate::payload_key;
use crate::store::{
    check_input, keying_of, payload_subject, policy_from_parts, StoreError, INSERT_ENVELOPE_SQL,
    INSERT_SET_SQL, POLICY_SQL,
};

/// Errors of the sqlx flavour.
#[derive(Debug, thiserror::Error)]
pub enum SqlxStoreError {
    /// The database refused or failed a statement.
    #[error("database error: {0}")]
    Db(#[from] sqlx::Error),
    /// Same validation errors as the tokio-postgres store.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Inserts the sealed `PENDING` envelope inside the caller's sqlx transaction (R2–R4).
pub async fn enqueue(
    conn: &mut sqlx::PgConnection,
    route: &str,
    event_id: EventId,
    ev: &NewEvent<'_>,
    routing_key: &str,
) -> Result<SealedEnvelope, SqlxStoreError> {
    check_input(0, ev, routing_key)?;
    let (env, payload) = seal_for_route(conn, route, event_id, ev, routing_key).await?;
    insert_envelope(conn, &env, 0, &payload).await?;
    Ok(env)
}

/// [`crate::store::enqueue_set`] on a sqlx connection: `ev` as a delivery set (R16), one
/// member per route in that order, and the set row with its completion `rule`, in the
/// caller's transaction; refused whole, writing nothing, when the routes do not make a set.
pub async fn enqueue_set(
    conn: &mut sqlx::PgConnection,
    routes: &[&str],
    rule: CompletionRule,
    event_id: EventId,
    ev: &NewEvent<'_>,
    routing_key: &str,
) -> Result<Vec<SealedEnvelope>, SqlxStoreError> {
    check_input(0, ev, routing_key)?;
    let mut sealed = Vec::with_capacity(routes.len());
    for route in routes {
        sealed.push(seal_for_route(conn, route, event_id, ev, routing_key).await?);
    }
    let named: Vec<(&str, &sealpost_core::envelope::Destination)> = routes
        .iter()
        .zip(&sealed)
        .map(|(r, (env, _))| (*r, &env.destination))
        .collect();
    check_members(&named).map_err(StoreError::from)?;
    sqlx::query(INSERT_SET_SQL)
        .bind(uuid::Uuid::from_bytes(event_id.0))
        .bind(rule.name())
        .bind(routes)
        .execute(&mut *conn)
        .await?;
    for (member, (env, payload)) in sealed.iter().enumerate() {
        insert_envelope(conn, env, member as i16, payload).await?;
    }
    Ok(sealed.into_iter().map(|(env, _)| env).collect())
}

/// Reads `route` in the caller's transaction, checks `ev` against it (contracts) and seals
/// it: the envelope and the payload as stored (encrypted on a keyed route).
async fn seal_for_route(
    conn: &mut sqlx::PgConnection,
    route: &str,
    event_id: EventId,
    ev: &NewEvent<'_>,
    routing_key: &str,
) -> Result<(SealedEnvelope, Vec<u8>), SqlxStoreError> {
    let p = sqlx::query(POLICY_SQL)
        .bind(route)
        .fetch_optional(&mut *conn)
        .await?
        .ok_or_else(|| StoreError::NoRoutePolicy(route.to_string()))?;
    let alg: String = p.try_get(3)?;
    let policy = policy_from_parts(
        p.try_get(0)?,
        p.try_get(1)?,
        p.try_get(2)?,
        &alg,
        p.try_get(4)?,
        p.try_get(5)?,
        p.try_get(6)?,
        &p.try_get::<String, _>(8)?,
    )?;
    let txid: i64 = p.try_get(7)?;
    let keying = keying_of(&p.try_get::<String, _>(9)?)?;
    if p.try_get::<bool, _>(10)? {
        let text: Option<String> = match crate::contract::schema_to_fetch(ev) {
            Some((ty, v)) => {
                sqlx::query_scalar(crate::contract::SCHEMA_FOR_ENQUEUE_SQL)
                    .bind(ty)
                    .bind(v)
                    .fetch_optional(&mut *conn)
                    .await?
            }
            None => None,
        };
        crate::contract::check_payload(
            ev.event_type,
            ev.payload_schema,
            text.as_deref(),
            ev.payload,
        )
        .map_err(|e| StoreError::Contract {
            index: 0,
            reason: e.to_string(),
        })?;
    }
    let sealed = match payload_subject(keying, 0, ev)? {
        None => None,
        Some(subject) => {
            let (scope, ty, id) = subject.columns();
            let key: Option<Vec<u8>> = sqlx::query_scalar(payload_key::KEY_FOR_ENQUEUE_SQL)
                .bind(scope)
                .bind(ty)
                .bind(id)
                .bind(payload_key::fresh_key().as_slice())
                .fetch_one(&mut *conn)
                .await?;
            let key = payload_key::key_of_bytes(&subject, key)
                .map_err(|source| StoreError::PayloadKey { index: 0, source })?;
            Some(payload_key::seal(&subject, &key, ev.payload))
        }
    };
    let ev = NewEvent {
        creating_txid: txid as u64,
        payload: sealed.as_deref().unwrap_or(ev.payload),
        ..ev.clone()
    };
    let env = SealedEnvelope::seal(event_id, &ev, &policy, routing_key);
    Ok((env, ev.payload.to_vec()))
}

/// Inserts one sealed member and its `PENDING` work row.
async fn insert_envelope(
    conn: &mut sqlx::PgConnection,
    env: &SealedEnvelope,
    member: i16,
    payload: &[u8],
) -> Result<(), SqlxStoreError> {
    let d = &env.destination;
    sqlx::query(INSERT_ENVELOPE_SQL)
        .bind(uuid::Uuid::from_bytes(env.event_id.0))
        .bind(member)
        .bind(env.envelope_generation as i32)
        .bind(&env.aggregate_type)
        .bind(&env.aggregate_id)
        .bind(env.aggregate_version as i64)
        .bind(&env.event_type)
        .bind(env.payload_schema_digest.0.as_slice())
        .bind(env.payload_digest.0.as_slice())
        .bind(&env.tenant)
        .bind(env.occurred_at_ms as i64)
        .bind(env.creating_txid as i64)
        .bind(&d.cluster)
        .bind(&d.topic)
        .bind(&d.routing_key)
        .bind(d.partition_algorithm.name())
        .bind(d.route_policy_generation as i64)
        .bind(&d.serializer)
        .bind(&d.durability)
        .bind(&d.required_ack)
        .bind(env.destination_digest.0.as_slice())
        .bind(env.digest().0.as_slice())
        .bind(payload)
        .bind(d.ordering.name())
        .bind(sealpost_core::envelope::ordering_key(
            d.ordering,
            &env.aggregate_type,
            &env.aggregate_id,
        ))
        .execute(&mut *conn)
        .await?;
    Ok(())
}
