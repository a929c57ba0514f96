//! The PostgreSQL store: schema, the producer's `enqueue`, and every state change of the
//! protocol as a short transaction that loads row snapshots, calls `sealpost-core` and
//! persists the difference. No transaction is ever held across a network send.

use std::collections::HashMap;

use sealpost_core::claim::apply_release_quarantine;
use sealpost_core::claim::NEVER_SENT_ALERT_COUNT;
use sealpost_core::claim::{ClaimToken, SendOutcomeDecision};
use sealpost_core::dispatcher::{Claimed, ClaimedSend, Submission};
use sealpost_core::encoding::Digest;
use sealpost_core::envelope::{
    ordering_key, Destination, EventId, EventOrdering, NewEvent, PartitionAlgorithm, RoutePolicy,
    SealedEnvelope,
};
use sealpost_core::port::{SendRequest, WireEnvelope};
use sealpost_core::receipt::{decide_receipt, Receipt, ReceiptSource, ReceiptVerdict};
use sealpost_core::reconcile::{
    decide_reconcile_missing, Lookup, ReconcileDecision, ReconcilePolicy,
};
use sealpost_core::reconciler::{verify_window_rows, VerifyItem};
use sealpost_core::row::{Attempt, AttemptStatus, Claim, EventRow, Pacing, Superseded};
use sealpost_core::state::{Phase, State};
use sealpost_core::step::{self, Acceptance, ClaimInput, CoreRules, Pick, Served, StepError};
use tokio_postgres::{GenericClient, Transaction};

use crate::payload_key::{self, KeyError, Keying, Subject};
use uuid::Uuid;

/// The embedded schema migrations, in order.
pub const MIGRATIONS: &[(i32, &str)] = &[
    (1, include_str!("../migrations/0001_outbox.sql")),
    (2, include_str!("../migrations/0002_pacing.sql")),
    (3, include_str!("../migrations/0003_split.sql")),
    (
        4,
        include_str!("../migrations/0004_consumers_retention.sql"),
    ),
    (5, include_str!("../migrations/0005_ordering.sql")),
    (6, include_str!("../migrations/0006_roles.sql")),
    (7, include_str!("../migrations/0007_lifecycle.sql")),
];

/// Statements the store has sent to PostgreSQL in this process (each query, `BEGIN` and
/// `COMMIT` counts one): `sealpost bench` divides it by the events drained.
static STATEMENTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Statements sent by the store in this process so far.
pub fn statements_issued() -> u64 {
    STATEMENTS.load(std::sync::atomic::Ordering::Relaxed)
}

fn counted(n: u64) {
    STATEMENTS.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
}

/// Largest payload accepted by `enqueue` (NATS' default max_payload is 1 MiB; headers need room).
pub const PAYLOAD_BYTES_MAX: usize = 900 * 1024;

/// Store errors.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database refused or failed a statement.
    #[error("database error: {}", db_message(.0))]
    Db(tokio_postgres::Error),
    /// The database refused a statement for want of a privilege (SQLSTATE 42501): the login
    /// is not mapped to the Sealpost role whose grant this needs
    /// ([`crate::roles::explain`] names both).
    #[error("permission denied (SQLSTATE 42501): {} lacks {needed}; map the login to the role that holds it with `sealpost migrate --grant KIND=LOGIN` (docs/operations.md, \"Roles and logins\")", role.as_deref().unwrap_or("this login"))]
    Permission {
        /// The refused login (`current_user`) and the Sealpost roles it holds, once known.
        role: Option<String>,
        /// What it lacks, in the server's words, then (once explained) the privilege and the
        /// Sealpost roles that hold it.
        needed: String,
        /// The server's error.
        source: tokio_postgres::Error,
    },
    /// No route policy with that name; create one with `sealpost route set`.
    #[error("no route policy named `{0}`; add one to sealpost.route_policy (sealpost migrate --route NAME=CLUSTER/TOPIC)")]
    NoRoutePolicy(String),
    /// The payload is larger than the broker accepts.
    #[error("payload is {len} bytes, more than the {max}-byte limit; store large blobs elsewhere and send a reference")]
    PayloadTooLarge {
        /// Payload length.
        len: usize,
        /// Limit.
        max: usize,
    },
    /// A producer string no broker could carry (a control character, too long, empty, a
    /// wildcard in a routing key); nothing was written.
    #[error("event {index} refused at enqueue: {source}; nothing was written (the caller's transaction is still open)")]
    InvalidInput {
        /// Position of the event in the call (0 for `enqueue`).
        index: usize,
        /// The field and the rule it broke.
        source: sealpost_core::wire::FieldError,
    },
    /// The route encrypts payloads per data subject and this event's could not be
    /// (`payload_key.rs`); nothing was written.
    #[error("event {index} refused at enqueue: {source}; nothing was written (the caller's transaction is still open)")]
    PayloadKey {
        /// Position of the event in the call (0 for `enqueue`).
        index: usize,
        /// Why.
        source: crate::payload_key::KeyError,
    },
    /// A core step refused its inputs or broke its own postcondition: a bug in the store's
    /// query or in the core, never bad data from a user. The transaction was rolled back.
    #[error("internal invariant broken, nothing was written: {0}; please report it with `sealpost trace` of the event")]
    Invariant(#[from] StepError),
    /// A stored row does not parse (corrupted or written by a newer version).
    #[error("stored row is invalid: {0}; was it written by a newer Sealpost?")]
    Corrupt(String),
    /// No envelope has this event id.
    #[error(
        "no event {0} in the outbox; check the id (`sealpost trace` searches by aggregate too)"
    )]
    UnknownEvent(String),
    /// An operator release of an event that is not quarantined.
    #[error("event {event_id} is not quarantined (state {states}); only QUARANTINED rows can be released")]
    NotQuarantined {
        /// Event id.
        event_id: String,
        /// States of its rows.
        states: String,
    },
    /// A schema migration failed; the database stays at its previous version.
    #[error("schema migration {0} failed and was rolled back: {1}")]
    Migration(i32, String),
    /// The schema has not been applied.
    #[error("the sealpost schema is missing; run `sealpost migrate` first")]
    NotMigrated,
    /// A consumer's effect ran past its time limit; it was rolled back.
    #[error("the effect did not finish within {0} ms and was rolled back (a hanging downstream?); the message is retried later, or raise consumer_effect_timeout_ms")]
    EffectTimeout(u64),
    /// A consumer's handler returned an error; its writes were rolled back.
    #[error(
        "the handler failed: {0}; its writes were rolled back and the message is retried later"
    )]
    Effect(String),
}

impl From<tokio_postgres::Error> for StoreError {
    fn from(e: tokio_postgres::Error) -> Self {
        match e.as_db_error() {
            Some(d) if *d.code() == tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE => {
                StoreError::Permission {
                    role: None,
                    needed: format!("the right to do this: \"{}\"", d.message()),
                    source: e,
                }
            }
            _ => StoreError::Db(e),
        }
    }
}

/// The database's own words: message, SQLSTATE, detail and hint when the server sent them,
/// else the client error and its cause (tokio-postgres alone prints only "db error").
pub fn db_message(e: &tokio_postgres::Error) -> String {
    if let Some(d) = e.as_db_error() {
        let mut m = format!("{} (SQLSTATE {})", d.message(), d.code().code());
        if let Some(detail) = d.detail() {
            m.push_str(&format!("; {detail}"));
        }
        if let Some(hint) = d.hint() {
            m.push_str(&format!("; hint: {hint}"));
        }
        return m;
    }
    match std::error::Error::source(e) {
        Some(cause) => format!("{e}: {cause}"),
        None => e.to_string(),
    }
}

/// Result alias.
pub type Result<T> = std::result::Result<T, StoreError>;

fn uuid_of(e: EventId) -> Uuid {
    Uuid::from_bytes(e.0)
}

fn event_of(u: Uuid) -> EventId {
    EventId(*u.as_bytes())
}

fn digest_of(b: &[u8]) -> Result<Digest> {
    let arr: [u8; 32] = b
        .try_into()
        .map_err(|_| StoreError::Corrupt(format!("digest of {} bytes", b.len())))?;
    Ok(Digest(arr))
}

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

/// The database clock in milliseconds (R7: leases use it, never a worker's clock).
pub async fn db_now_ms(client: &impl GenericClient) -> Result<u64> {
    counted(1);
    let row = client
        .query_one(
            "SELECT (extract(epoch from clock_timestamp()) * 1000)::bigint",
            &[],
        )
        .await?;
    Ok(row.get::<_, i64>(0) as u64)
}

/// Inserts the sealed `PENDING` envelope inside the caller's transaction (R2–R4): resolves the
/// route policy `route` in that transaction, freezes the destination and digests, and
/// returns the envelope. Commit or roll back the caller's transaction as usual: both the
/// business change and the envelope go, or neither.
pub async fn enqueue(
    tx: &Transaction<'_>,
    route: &str,
    event_id: EventId,
    ev: &NewEvent<'_>,
    routing_key: &str,
) -> Result<SealedEnvelope> {
    check_input(0, ev, routing_key)?;
    let (policy, txid, keying) = load_policy(tx, route).await?;
    let sealed = keyed_payload(tx, keying, 0, ev, &mut HashMap::new()).await?;
    let ev = NewEvent {
        creating_txid: txid,
        payload: sealed.as_deref().unwrap_or(ev.payload),
        ..ev.clone()
    };
    let env = SealedEnvelope::seal(event_id, &ev, &policy, routing_key);
    insert_envelope(tx, &env, 0, ev.payload).await?;
    Ok(env)
}

/// The subject a keyed route encrypts `ev`'s payload for, or `None` on a route that does not
/// encrypt (whose payload must not look like a frame). Shared with the sqlx flavour.
pub(crate) fn payload_subject(
    keying: Keying,
    index: usize,
    ev: &NewEvent<'_>,
) -> Result<Option<Subject>> {
    let fail = |source| StoreError::PayloadKey { index, source };
    if keying == Keying::None && ev.payload.starts_with(payload_key::MAGIC) {
        return Err(fail(KeyError::LooksFramed));
    }
    Subject::of(keying, ev).map_err(fail)
}

/// `ev`'s payload encrypted under its subject's key when the route is keyed (the key made
/// in the caller's transaction if the subject has none; `keys` remembers the call's keys).
async fn keyed_payload(
    tx: &impl GenericClient,
    keying: Keying,
    index: usize,
    ev: &NewEvent<'_>,
    keys: &mut HashMap<Subject, payload_key::Key>,
) -> Result<Option<Vec<u8>>> {
    let Some(subject) = payload_subject(keying, index, ev)? else {
        return Ok(None);
    };
    let key = match keys.get(&subject) {
        Some(k) => *k,
        None => {
            counted(1);
            let k = payload_key::key_for_enqueue(tx, &subject)
                .await?
                .map_err(|source| StoreError::PayloadKey { index, source })?;
            keys.insert(subject.clone(), k);
            k
        }
    };
    Ok(Some(payload_key::seal(&subject, &key, ev.payload)))
}

/// What `enqueue` refuses before it writes anything: a payload over [`PAYLOAD_BYTES_MAX`]
/// and producer strings no broker could carry ([`sealpost_core::wire::check_new_event`]).
/// Shared with the sqlx flavour.
pub(crate) fn check_input(index: usize, ev: &NewEvent<'_>, routing_key: &str) -> Result<()> {
    if ev.payload.len() > PAYLOAD_BYTES_MAX {
        return Err(StoreError::PayloadTooLarge {
            len: ev.payload.len(),
            max: PAYLOAD_BYTES_MAX,
        });
    }
    sealpost_core::wire::check_new_event(ev, routing_key)
        .map_err(|source| StoreError::InvalidInput { index, source })
}

/// Seals and inserts many events in the caller's transaction with one statement: the same
/// sealing as [`enqueue`] (route policy read in the transaction), for batch producers.
pub async fn enqueue_many(
    tx: &Transaction<'_>,
    route: &str,
    events: &[(EventId, NewEvent<'_>, String)],
) -> Result<Vec<SealedEnvelope>> {
    if events.is_empty() {
        return Ok(Vec::new());
    }
    for (index, (_, ev, key)) in events.iter().enumerate() {
        check_input(index, ev, key)?;
    }
    let (policy, txid, keying) = load_policy(tx, route).await?;
    let mut keys = HashMap::new();
    let mut payloads: Vec<Vec<u8>> = Vec::with_capacity(events.len());
    for (index, (_, ev, _)) in events.iter().enumerate() {
        payloads.push(
            match keyed_payload(tx, keying, index, ev, &mut keys).await? {
                Some(sealed) => sealed,
                None => ev.payload.to_vec(),
            },
        );
    }
    let envs: Vec<SealedEnvelope> = events
        .iter()
        .zip(&payloads)
        .map(|((id, ev, key), payload)| {
            let ev = NewEvent {
                creating_txid: txid,
                payload,
                ..ev.clone()
            };
            SealedEnvelope::seal(*id, &ev, &policy, key)
        })
        .collect();
    let col = |f: &dyn Fn(&SealedEnvelope) -> String| envs.iter().map(f).collect::<Vec<String>>();
    let bytes =
        |f: &dyn Fn(&SealedEnvelope) -> Vec<u8>| envs.iter().map(f).collect::<Vec<Vec<u8>>>();
    let ints = |f: &dyn Fn(&SealedEnvelope) -> i64| envs.iter().map(f).collect::<Vec<i64>>();
    let ids: Vec<Uuid> = envs.iter().map(|e| uuid_of(e.event_id)).collect();
    // The work rows are inserted in the caller's order (`ORDER BY` the input's ordinality), so
    // their commit positions follow it: without it the join's plan decided the order, and it
    // changed once the tables' statistics had seen a large backlog.
    counted(1);
    tx.execute(
        "WITH e AS (INSERT INTO sealpost.envelope (event_id, member, envelope_generation, aggregate_type, aggregate_id,
            aggregate_version, event_type, payload_schema_digest, payload_digest, tenant, occurred_at_ms,
            creating_txid, dest_cluster, dest_topic, dest_routing_key, dest_partition_alg,
            dest_policy_generation, dest_serializer, dest_durability, dest_required_ack,
            destination_digest, envelope_digest, payload, dest_ordering)
         SELECT u.id, 0, 1, u.at, u.ai, u.av, u.et, u.sd, u.pd, u.tn, u.oc, $20, u.dc, u.dt, u.dk, u.da,
                u.dg, u.ds, u.dd, u.dr, u.dgst, u.edg, u.payload, $22
         FROM unnest($1::uuid[], $2::text[], $3::text[], $4::int8[], $5::text[], $6::bytea[], $7::bytea[],
                     $8::text[], $9::int8[], $10::text[], $11::text[], $12::text[], $13::text[], $14::int8[],
                     $15::text[], $16::text[], $17::text[], $18::bytea[], $19::bytea[], $21::bytea[],
                     $23::text[])
              AS u(id, at, ai, av, et, sd, pd, tn, oc, dc, dt, dk, da, dg, ds, dd, dr, dgst, edg, payload, ok)
         RETURNING event_id, member, envelope_generation, dest_cluster, created_at_ms, aggregate_version)
         INSERT INTO sealpost.work (event_id, member, envelope_generation, dest_cluster, created_at_ms, phase, state,
                                    ordering_key, aggregate_version)
         SELECT e.event_id, e.member, e.envelope_generation, e.dest_cluster, e.created_at_ms, 0, 'PENDING', v.ok,
                e.aggregate_version
         FROM unnest($1::uuid[], $23::text[]) WITH ORDINALITY AS v(id, ok, n)
         JOIN e ON v.id = e.event_id
         ORDER BY v.n",
        &[
            &ids,
            &col(&|e| e.aggregate_type.clone()),
            &col(&|e| e.aggregate_id.clone()),
            &ints(&|e| e.aggregate_version as i64),
            &col(&|e| e.event_type.clone()),
            &bytes(&|e| e.payload_schema_digest.0.to_vec()),
            &bytes(&|e| e.payload_digest.0.to_vec()),
            &col(&|e| e.tenant.clone()),
            &ints(&|e| e.occurred_at_ms as i64),
            &col(&|e| e.destination.cluster.clone()),
            &col(&|e| e.destination.topic.clone()),
            &col(&|e| e.destination.routing_key.clone()),
            &col(&|e| e.destination.partition_algorithm.name()),
            &ints(&|e| e.destination.route_policy_generation as i64),
            &col(&|e| e.destination.serializer.clone()),
            &col(&|e| e.destination.durability.clone()),
            &col(&|e| e.destination.required_ack.clone()),
            &bytes(&|e| e.destination_digest.0.to_vec()),
            &bytes(&|e| e.digest().0.to_vec()),
            &(txid as i64),
            &payloads,
            &policy.ordering.name(),
            &envs
                .iter()
                .map(|e| {
                    ordering_key(e.destination.ordering, &e.aggregate_type, &e.aggregate_id)
                })
                .collect::<Vec<Option<String>>>(),
        ],
    )
    .await?;
    Ok(envs)
}

/// Reads a route policy and the current transaction id, locking the policy row against a
/// concurrent revision until the caller's transaction ends (shared with the sqlx flavour).
pub(crate) const POLICY_SQL: &str =
    "SELECT generation, cluster, topic, partition_algorithm, serializer, durability, required_ack,
            txid_current(), ordering, payload_key
     FROM sealpost.route_for_enqueue($1)";

/// Inserts one sealed envelope and its `PENDING` work row in one statement (shared with the
/// sqlx flavour).
pub(crate) const INSERT_ENVELOPE_SQL: &str =
    "WITH e AS (INSERT INTO sealpost.envelope (event_id, member, envelope_generation, aggregate_type, aggregate_id,
        aggregate_version, event_type, payload_schema_digest, payload_digest, tenant, occurred_at_ms,
        creating_txid, dest_cluster, dest_topic, dest_routing_key, dest_partition_alg,
        dest_policy_generation, dest_serializer, dest_durability, dest_required_ack,
        destination_digest, envelope_digest, payload, dest_ordering)
     VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11,$12,$13,$14,$15,$16,$17,$18,$19,$20,$21,$22,$23,$24)
     RETURNING event_id, member, envelope_generation, dest_cluster, created_at_ms, aggregate_version)
     INSERT INTO sealpost.work (event_id, member, envelope_generation, dest_cluster, created_at_ms, phase, state,
                                ordering_key, aggregate_version)
     SELECT event_id, member, envelope_generation, dest_cluster, created_at_ms, 0, 'PENDING', $25::text,
            aggregate_version FROM e";

/// Builds a policy from the columns of [`POLICY_SQL`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn policy_from_parts(
    generation: i64,
    cluster: String,
    topic: String,
    alg: &str,
    serializer: String,
    durability: String,
    required_ack: String,
    ordering: &str,
) -> Result<RoutePolicy> {
    Ok(RoutePolicy {
        generation: generation as u64,
        cluster,
        topic,
        partition_algorithm: PartitionAlgorithm::parse(alg)
            .ok_or_else(|| StoreError::Corrupt(format!("partition algorithm `{alg}`")))?,
        serializer,
        durability,
        required_ack,
        ordering: EventOrdering::parse(ordering)
            .ok_or_else(|| StoreError::Corrupt(format!("route ordering `{ordering}`")))?,
    })
}

/// The route's payload keying, from the column of [`POLICY_SQL`].
pub(crate) fn keying_of(name: &str) -> Result<Keying> {
    Keying::parse(name).ok_or_else(|| StoreError::Corrupt(format!("route payload_key `{name}`")))
}

async fn load_policy(tx: &Transaction<'_>, route: &str) -> Result<(RoutePolicy, u64, Keying)> {
    let p = tx
        .query_opt(POLICY_SQL, &[&route])
        .await?
        .ok_or_else(|| StoreError::NoRoutePolicy(route.to_string()))?;
    let alg: String = p.get(3);
    let policy = policy_from_parts(
        p.get(0),
        p.get(1),
        p.get(2),
        &alg,
        p.get(4),
        p.get(5),
        p.get(6),
        p.get::<_, &str>(8),
    )?;
    Ok((policy, p.get::<_, i64>(7) as u64, keying_of(p.get(9))?))
}

async fn insert_envelope(
    tx: &impl GenericClient,
    env: &SealedEnvelope,
    member: i16,
    payload: &[u8],
) -> Result<()> {
    let d = &env.destination;
    tx.execute(
        INSERT_ENVELOPE_SQL,
        &[
            &uuid_of(env.event_id),
            &member,
            &(env.envelope_generation as i32),
            &env.aggregate_type,
            &env.aggregate_id,
            &(env.aggregate_version as i64),
            &env.event_type,
            &env.payload_schema_digest.0.as_slice(),
            &env.payload_digest.0.as_slice(),
            &env.tenant,
            &(env.occurred_at_ms as i64),
            &(env.creating_txid as i64),
            &d.cluster,
            &d.topic,
            &d.routing_key,
            &d.partition_algorithm.name(),
            &(d.route_policy_generation as i64),
            &d.serializer,
            &d.durability,
            &d.required_ack,
            &env.destination_digest.0.as_slice(),
            &env.digest().0.as_slice(),
            &payload,
            &d.ordering.name(),
            &ordering_key(d.ordering, &env.aggregate_type, &env.aggregate_id),
        ],
    )
    .await?;
    Ok(())
}

/// The work row's `phase` codes ([`Phase::code`]): the SQL below is generated from them.
const DISPATCHABLE: i16 = Phase::Dispatchable.code();
const UNKNOWN: i16 = Phase::Unknown.code();
const SETTLED: i16 = Phase::Settled.code();

/// The columns every decision reads: the work row and its current sealed generation.
const ROW_COLS: &str =
    "w.event_id, w.member, w.envelope_generation, e.payload_digest, e.dest_cluster, e.dest_topic,
    e.dest_routing_key, e.dest_partition_alg, e.dest_policy_generation, e.dest_serializer,
    e.dest_durability, e.dest_required_ack, e.destination_digest, w.state, w.claim_owner,
    w.claim_generation, w.lease_until_ms, w.attempt_generation, w.rejections, w.unknown_since_ms,
    w.published_at_ms, w.primary_attempt_id, w.primary_cluster, w.primary_stream,
    w.primary_partition, w.primary_sequence, w.superseded_generations, w.superseded_digests,
    w.not_before_ms, w.never_sent, w.next_lookup_at_ms, w.lookups, w.attempt_id, w.attempt_agen,
    w.attempt_claim_generation, w.attempt_owner, w.attempt_envelope_generation, w.attempt_status,
    w.attempt_started_ms, w.attempts_archived, e.dest_ordering";

/// Number of columns in [`ROW_COLS`]; extra selected columns start here.
const ROW_COLS_LEN: usize = 41;

/// Selects (and locks, if `pick` says `FOR UPDATE`) work rows with `pick` (a
/// `FROM sealpost.work w ...` clause with its own order and limit), then joins their sealed envelopes: the rows are chosen
/// and locked by an ordered scan of the work row's index alone (the planner cannot misjudge
/// the join and sort the whole backlog), and only the locked rows are joined. An empty
/// `order` leaves the result unordered: the caller sorts it (the claim does, in memory:
/// sorting a thousand wide rows with their payloads was a sixth of its statement's time).
fn locked_rows_sql(pick: &str, extra_cols: &str, order: &str) -> String {
    let order_by = if order.is_empty() {
        String::new()
    } else {
        format!(" ORDER BY {order}")
    };
    format!(
        "WITH w AS (SELECT w.* {pick})
         SELECT {ROW_COLS}{extra_cols} FROM w JOIN sealpost.envelope e
           ON e.event_id = w.event_id AND e.member = w.member
          AND e.envelope_generation = w.envelope_generation{order_by}"
    )
}

/// The fact the claim decision takes for a per-aggregate-ordered row (R29): "an earlier
/// version of this aggregate is unresolved". It reads every earlier version of the key in
/// the unresolved phases (0 dispatchable, 1 unknown, 3 quarantined; the `work_ordering_open`
/// index), *whoever holds or locks it*: `SKIP LOCKED` hides a row from the pick, not from
/// this probe. It is evaluated in the claim's own statement, on the statement's snapshot:
///
/// * a version that is unresolved in the snapshot counts, even if it is being published by
///   a transaction that has not committed: the fact errs towards "wait";
/// * a version resolved (phase 2) in the snapshot was published by a committed transaction
///   and never becomes unresolved again (only a database restore undoes it, and it undoes
///   the later versions' sends with it);
/// * so two dispatchers that lock v1 and v2 at the same moment cannot both send: the one
///   holding v2 sees v1 unresolved and waits, and v2 is only sent by a claim that starts
///   after the receipt of v1 committed.
///
/// The producer's side of the bargain: version v + 1 of an aggregate commits after version v
/// (it is written after reading v under the aggregate's lock, as an optimistic version check
/// does). An earlier version committed *later* is not seen by a claim that ran before it.
///
/// This is [`step::holds_back`] in SQL: `ordering_key` is set exactly for rows bound for a
/// per-aggregate-ordered destination, and the phase is the core's [`Phase`].
fn earlier_unresolved_sql() -> String {
    format!(
        "(w.ordering_key IS NOT NULL AND EXISTS (
        SELECT 1 FROM sealpost.work p
        WHERE p.ordering_key = w.ordering_key AND p.aggregate_version < w.aggregate_version
          AND p.ordering_key IS NOT NULL AND p.phase <> {SETTLED}))"
    )
}

/// The sealed envelope's description of the event, read by the claim for the wire headers
/// ([`WireEnvelope`]); [`wire_envelope`] parses them from the given column on.
const WIRE_ENVELOPE_COLS: &str = "e.event_type, e.aggregate_type, e.aggregate_id,
    e.aggregate_version, e.occurred_at_ms, e.tenant, e.payload_schema_digest";

fn wire_envelope(r: &tokio_postgres::Row, from: usize) -> Result<WireEnvelope> {
    Ok(WireEnvelope {
        event_type: r.get(from),
        aggregate_type: r.get(from + 1),
        aggregate_id: r.get(from + 2),
        aggregate_version: r.get::<_, i64>(from + 3) as u64,
        occurred_at_ms: r.get::<_, i64>(from + 4) as u64,
        tenant: r.get(from + 5),
        payload_schema_digest: digest_of(r.get(from + 6))?,
    })
}

/// The database clock in milliseconds at the start of the statement, as SQL: a scalar
/// subquery, so the planner evaluates it once per statement (an init plan), not once per row
/// and condition (`numeric` arithmetic, three times per claimed row).
const NOW_MS_SQL: &str = "(SELECT (extract(epoch from statement_timestamp()) * 1000)::bigint)";

/// A loaded row and the number of its earlier attempts kept in `sealpost.attempt`.
struct Loaded {
    row: EventRow,
    archived: i32,
}

fn parse_row(r: &tokio_postgres::Row) -> Result<Loaded> {
    let alg: String = r.get(7);
    let destination = Destination {
        cluster: r.get(4),
        topic: r.get(5),
        routing_key: r.get(6),
        partition_algorithm: PartitionAlgorithm::parse(&alg)
            .ok_or_else(|| StoreError::Corrupt(format!("partition algorithm `{alg}`")))?,
        route_policy_generation: r.get::<_, i64>(8) as u64,
        serializer: r.get(9),
        durability: r.get(10),
        required_ack: r.get(11),
        ordering: {
            let o: &str = r.get(40);
            EventOrdering::parse(o)
                .ok_or_else(|| StoreError::Corrupt(format!("destination ordering `{o}`")))?
        },
    };
    let state_s: String = r.get(13);
    let state =
        State::parse(&state_s).ok_or_else(|| StoreError::Corrupt(format!("state `{state_s}`")))?;
    let event_id = event_of(r.get(0));
    let member = r.get::<_, i16>(1) as u16;
    let payload_digest = digest_of(r.get(3))?;
    let destination_digest = digest_of(r.get(12))?;
    let envelope_generation = r.get::<_, i32>(2) as u32;
    let claim = match (r.get::<_, Option<i64>>(14), r.get::<_, Option<i64>>(16)) {
        (Some(owner), Some(lease)) => Some(Claim {
            owner: owner as u64,
            generation: r.get::<_, i64>(15) as u64,
            lease_until_ms: lease as u64,
        }),
        _ => None,
    };
    let primary = r.get::<_, Option<i64>>(25).map(|seq| Receipt {
        event_id,
        member,
        envelope_generation,
        attempt_id: r.get::<_, Option<i64>>(21).unwrap_or(0) as u64,
        payload_digest,
        destination_digest,
        cluster: r.get::<_, Option<String>>(22).unwrap_or_default(),
        stream: r.get::<_, Option<String>>(23).unwrap_or_default(),
        partition: r.get::<_, Option<i32>>(24).map(|p| p as u32),
        sequence: seq as u64,
        broker_duplicate: false,
        source: ReceiptSource::Ack,
    });
    let gens: Vec<i32> = r.get::<_, Option<Vec<i32>>>(26).unwrap_or_default();
    let digs: Vec<Vec<u8>> = r.get::<_, Option<Vec<Vec<u8>>>>(27).unwrap_or_default();
    let superseded = gens
        .iter()
        .zip(&digs)
        .map(|(g, d)| {
            Ok(Superseded {
                envelope_generation: *g as u32,
                destination_digest: digest_of(d)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let mut attempts = Vec::new();
    if let Some(id) = r.get::<_, Option<i64>>(32) {
        // The inline attempt's destination is the one of its envelope generation: the
        // current one, or a superseded one (R15).
        let egen = r.get::<_, i32>(36) as u32;
        let destination_digest = if egen == envelope_generation {
            destination_digest
        } else {
            superseded
                .iter()
                .find(|s| s.envelope_generation == egen)
                .map(|s| s.destination_digest)
                .ok_or_else(|| {
                    StoreError::Corrupt(format!(
                        "attempt {id} of event {event_id} names envelope generation {egen}, which the row does not know"
                    ))
                })?
        };
        let status: String = r.get(37);
        attempts.push(Attempt {
            id: id as u64,
            attempt_generation: r.get::<_, i32>(33) as u32,
            claim_generation: r.get::<_, i64>(34) as u64,
            owner: r.get::<_, i64>(35) as u64,
            envelope_generation: egen,
            destination_digest,
            status: parse_status(&status)?,
            started_at_ms: r.get::<_, i64>(38) as u64,
        });
    }
    Ok(Loaded {
        row: EventRow {
            event_id,
            member,
            envelope_generation,
            payload_digest,
            destination,
            destination_digest,
            state,
            claim,
            claim_generation: r.get::<_, i64>(15) as u64,
            attempt_generation: r.get::<_, i32>(17) as u32,
            attempts,
            primary,
            rejections: r.get::<_, i32>(18) as u32,
            unknown_since_ms: r.get::<_, Option<i64>>(19).map(|v| v as u64),
            published_at_ms: r.get::<_, Option<i64>>(20).map(|v| v as u64),
            superseded,
            pacing: Pacing {
                not_before_ms: r.get::<_, i64>(28) as u64,
                never_sent: r.get::<_, i32>(29) as u32,
                next_lookup_at_ms: r.get::<_, i64>(30) as u64,
                lookups: r.get::<_, i32>(31) as u32,
            },
        },
        archived: r.get(39),
    })
}

fn status_str(s: AttemptStatus) -> &'static str {
    match s {
        AttemptStatus::Sending => "SENDING",
        AttemptStatus::Unknown => "UNKNOWN",
        AttemptStatus::Acked => "ACKED",
        AttemptStatus::Failed => "FAILED",
    }
}

fn parse_status(s: &str) -> Result<AttemptStatus> {
    Ok(match s {
        "SENDING" => AttemptStatus::Sending,
        "UNKNOWN" => AttemptStatus::Unknown,
        "ACKED" => AttemptStatus::Acked,
        "FAILED" => AttemptStatus::Failed,
        other => return Err(StoreError::Corrupt(format!("attempt status `{other}`"))),
    })
}

/// Parses loaded rows and puts the earlier attempts (kept in `sealpost.attempt` only for rows
/// that have any) before the inline one, in registration order.
async fn finish_load(
    tx: &impl GenericClient,
    found: &[tokio_postgres::Row],
) -> Result<Vec<EventRow>> {
    let loaded = found.iter().map(parse_row).collect::<Result<Vec<_>>>()?;
    let ids: Vec<Uuid> = loaded
        .iter()
        .filter(|l| l.archived > 0)
        .map(|l| uuid_of(l.row.event_id))
        .collect();
    let mut rows: Vec<EventRow> = loaded.into_iter().map(|l| l.row).collect();
    if ids.is_empty() {
        return Ok(rows);
    }
    counted(1);
    let found = tx
        .query(
            "SELECT attempt_id, event_id, member, attempt_generation, claim_generation, owner,
                    envelope_generation, destination_digest, status, started_at_ms
             FROM sealpost.attempt WHERE event_id = ANY($1) ORDER BY attempt_id",
            &[&ids],
        )
        .await?;
    let mut index: HashMap<(EventId, u16), usize> = HashMap::with_capacity(rows.len());
    for (i, r) in rows.iter().enumerate() {
        index.insert((r.event_id, r.member), i);
    }
    let mut history: HashMap<usize, Vec<Attempt>> = HashMap::new();
    for a in found {
        let key = (event_of(a.get(1)), a.get::<_, i16>(2) as u16);
        if let Some(&i) = index.get(&key) {
            let status: String = a.get(8);
            history.entry(i).or_default().push(Attempt {
                id: a.get::<_, i64>(0) as u64,
                attempt_generation: a.get::<_, i32>(3) as u32,
                claim_generation: a.get::<_, i64>(4) as u64,
                owner: a.get::<_, i64>(5) as u64,
                envelope_generation: a.get::<_, i32>(6) as u32,
                destination_digest: digest_of(a.get(7))?,
                status: parse_status(&status)?,
                started_at_ms: a.get::<_, i64>(9) as u64,
            });
        }
    }
    for (i, mut h) in history {
        h.append(&mut rows[i].attempts);
        rows[i].attempts = h;
    }
    Ok(rows)
}

/// Locks and loads the rows for `keys` (in key order, so concurrent batches cannot deadlock).
async fn lock_rows(tx: &impl GenericClient, keys: &[(EventId, u16)]) -> Result<Vec<EventRow>> {
    Ok(lock_rows_created(tx, keys).await?.0)
}

/// [`lock_rows`], with each row's commit time (`created_at_ms`, database clock) beside it:
/// the acceptance point measures commit -> `PUBLISHED` with it.
async fn lock_rows_created(
    tx: &impl GenericClient,
    keys: &[(EventId, u16)],
) -> Result<(Vec<EventRow>, Vec<u64>)> {
    let mut sorted: Vec<(EventId, u16)> = keys.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let ids: Vec<Uuid> = sorted.iter().map(|k| uuid_of(k.0)).collect();
    let members: Vec<i16> = sorted.iter().map(|k| k.1 as i16).collect();
    let q = locked_rows_sql(
        "FROM sealpost.work w
         JOIN unnest($1::uuid[], $2::int2[]) AS k(id, m) ON w.event_id = k.id AND w.member = k.m
         ORDER BY w.event_id, w.member FOR UPDATE OF w",
        ", w.created_at_ms",
        "w.event_id, w.member",
    );
    counted(1);
    let found = tx.query(q.as_str(), &[&ids, &members]).await?;
    let created = found
        .iter()
        .map(|r| r.get::<_, i64>(ROW_COLS_LEN).max(0) as u64)
        .collect();
    Ok((finish_load(tx, &found).await?, created))
}

/// Writes every difference between `before` and `after` (same order, same keys): the work
/// row's columns the core may change (the latest attempt inline among them), and the earlier
/// attempts in `sealpost.attempt` (new ones inserted, status changes updated).
async fn persist(tx: &impl GenericClient, before: &[EventRow], after: &[EventRow]) -> Result<()> {
    persist_guarded(tx, before, after, None, None)
        .await
        .map(|_| ())
}

/// A column of a batched write: one value per row, or the one value every row gets. A batch
/// of claims or acceptances mostly writes the same state, owner, lease, cluster and stream
/// to every row: those go as one parameter, not an array of a thousand copies to unnest.
#[derive(Clone, Copy)]
enum Bind<'a> {
    Each(&'a (dyn tokio_postgres::types::ToSql + Sync)),
    Same(&'a (dyn tokio_postgres::types::ToSql + Sync)),
}

impl<'a> Bind<'a> {
    fn value(&self) -> &'a (dyn tokio_postgres::types::ToSql + Sync) {
        match self {
            Bind::Each(v) | Bind::Same(v) => *v,
        }
    }
}

// A `Vec`, not a slice: the array parameter is the `Vec` itself (`[T]` is unsized).
#[allow(clippy::ptr_arg)]
fn bind<T>(values: &Vec<T>) -> Bind<'_>
where
    T: tokio_postgres::types::ToSql + Sync + PartialEq,
{
    match values.split_first() {
        Some((first, rest)) if rest.iter().all(|x| x == first) => Bind::Same(first),
        _ => Bind::Each(values),
    }
}

/// The batched `UPDATE` of work rows: `$1`/`$2` are the keys, then one parameter per column
/// of `cols` in order (an array to unnest, or one value for every row), then the guard's
/// `xmin`s if any.
fn update_sql(cols: &[(&str, &str, Bind<'_>)], guard: Option<Bind<'_>>) -> String {
    let mut set = Vec::new();
    let mut arrays = vec!["$1::uuid[]".to_string(), "$2::int2[]".to_string()];
    let mut names = vec!["id", "m"];
    for (i, (c, t, b)) in cols.iter().enumerate() {
        let n = i + 3;
        match b {
            Bind::Each(_) => {
                set.push(format!("{c} = u.{c}"));
                arrays.push(format!("${n}::{t}[]"));
                names.push(c);
            }
            Bind::Same(_) => set.push(format!("{c} = ${n}::{t}")),
        }
    }
    // The guard: `xmin` is the id of the transaction that wrote the row version, so it
    // equals the caller's only if no one has written the row since.
    let n = cols.len() + 3;
    let (cas, returning) = match guard {
        None => (String::new(), ""),
        Some(Bind::Each(_)) => {
            arrays.push(format!("${n}::int8[]"));
            names.push("xmin_then");
            (
                " AND w.xmin = u.xmin_then::text::xid".to_string(),
                " RETURNING w.event_id, w.member",
            )
        }
        Some(Bind::Same(_)) => (
            format!(" AND w.xmin = ${n}::int8::text::xid"),
            " RETURNING w.event_id, w.member",
        ),
    };
    format!(
        "UPDATE sealpost.work w SET {}
         FROM unnest({}) AS u({})
         WHERE w.event_id = u.id AND w.member = u.m{cas}{returning}",
        set.join(", "),
        arrays.join(", "),
        names.join(", ")
    )
}

/// What identifies the inline (latest) attempt, its status aside.
fn inline_identity(r: &EventRow) -> Option<(u64, u32, u64, u64, u32, u64)> {
    r.attempts.last().map(|x| {
        (
            x.id,
            x.attempt_generation,
            x.claim_generation,
            x.owner,
            x.envelope_generation,
            x.started_at_ms,
        )
    })
}

/// Statements kept per connection at most (see [`Prepared`]).
const PREPARED_MAX: usize = 64;

/// Prepared statements of one connection, by SQL text: the dispatcher's claim and acceptance
/// statements are parsed once per connection, not once per batch (a round trip and the
/// server's parse and analysis each time). Statements belong to the connection that prepared
/// them: [`Held::forget_statements`] drops them when it is replaced.
#[derive(Default)]
struct Prepared {
    by_sql: HashMap<String, tokio_postgres::Statement>,
}

impl std::fmt::Debug for Prepared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prepared")
            .field("statements", &self.by_sql.len())
            .finish()
    }
}

/// `sql` prepared on `client`, from `cache` if the caller keeps one.
async fn prepare(
    cache: Option<&mut Prepared>,
    client: &impl GenericClient,
    sql: &str,
) -> Result<tokio_postgres::Statement> {
    match cache {
        Some(c) => c.get(client, sql).await,
        None => Ok(client.prepare(sql).await?),
    }
}

impl Prepared {
    async fn get(
        &mut self,
        client: &impl GenericClient,
        sql: &str,
    ) -> Result<tokio_postgres::Statement> {
        if let Some(s) = self.by_sql.get(sql) {
            return Ok(s.clone());
        }
        let s = client.prepare(sql).await?;
        // A dispatcher uses a handful of shapes (which columns a batch shares); the bound
        // only keeps an unusual mix of batches from holding statements without end.
        if self.by_sql.len() >= PREPARED_MAX {
            self.by_sql.clear();
        }
        self.by_sql.insert(sql.to_string(), s.clone());
        Ok(s)
    }
}

/// [`persist`], and with `guard` (each row's `xmin` as the caller last wrote it, parallel to
/// `before`) a compare-and-set: a row is written only if no one has written it since, and
/// the keys of the rows written are returned. A guarded write changes the work row only
/// (the caller ensures `after` adds no attempt history).
async fn persist_guarded(
    tx: &impl GenericClient,
    before: &[EventRow],
    after: &[EventRow],
    guard: Option<&[i64]>,
    prepared: Option<&mut Prepared>,
) -> Result<Vec<(EventId, u16)>> {
    let mut u_xmin: Vec<i64> = Vec::new();
    let mut u_id = Vec::new();
    let mut u_member = Vec::new();
    let mut u_state = Vec::new();
    let mut u_phase: Vec<i16> = Vec::new();
    let mut u_owner: Vec<Option<i64>> = Vec::new();
    let mut u_cgen = Vec::new();
    let mut u_lease: Vec<Option<i64>> = Vec::new();
    let mut u_agen = Vec::new();
    let mut u_rej = Vec::new();
    let mut u_unknown: Vec<Option<i64>> = Vec::new();
    let mut u_pub: Vec<Option<i64>> = Vec::new();
    let mut u_pattempt: Vec<Option<i64>> = Vec::new();
    let mut u_pcluster: Vec<Option<String>> = Vec::new();
    let mut u_pstream: Vec<Option<String>> = Vec::new();
    let mut u_ppart: Vec<Option<i32>> = Vec::new();
    let mut u_pseq: Vec<Option<i64>> = Vec::new();
    let mut u_nb: Vec<i64> = Vec::new();
    let mut u_ns: Vec<i32> = Vec::new();
    let mut u_nl: Vec<i64> = Vec::new();
    let mut u_lk: Vec<i32> = Vec::new();
    let mut i_id: Vec<Option<i64>> = Vec::new();
    let mut i_agen: Vec<Option<i32>> = Vec::new();
    let mut i_cgen: Vec<Option<i64>> = Vec::new();
    let mut i_owner: Vec<Option<i64>> = Vec::new();
    let mut i_egen: Vec<Option<i32>> = Vec::new();
    let mut i_status: Vec<Option<String>> = Vec::new();
    let mut i_started: Vec<Option<i64>> = Vec::new();
    let mut i_archived: Vec<i32> = Vec::new();
    let mut a_id = Vec::new();
    let mut a_event = Vec::new();
    let mut a_member = Vec::new();
    let mut a_agen = Vec::new();
    let mut a_cgen = Vec::new();
    let mut a_owner = Vec::new();
    let mut a_egen = Vec::new();
    let mut a_dest: Vec<Vec<u8>> = Vec::new();
    let mut a_status = Vec::new();
    let mut a_started = Vec::new();
    let mut s_id = Vec::new();
    let mut s_status = Vec::new();
    for (k, (b, a)) in before.iter().zip(after).enumerate() {
        debug_assert_eq!((b.event_id, b.member), (a.event_id, a.member));
        let inline_b = b.attempts.last();
        let inline_a = a.attempts.last();
        let row_changed = b.state != a.state
            || b.claim != a.claim
            || b.claim_generation != a.claim_generation
            || b.attempt_generation != a.attempt_generation
            || b.rejections != a.rejections
            || b.unknown_since_ms != a.unknown_since_ms
            || b.published_at_ms != a.published_at_ms
            || b.primary != a.primary
            || b.pacing != a.pacing
            || inline_b != inline_a
            || b.attempts.len() != a.attempts.len();
        if row_changed {
            if let Some(g) = guard {
                u_xmin.push(g[k]);
            }
            u_id.push(uuid_of(a.event_id));
            u_member.push(a.member as i16);
            u_state.push(a.state.as_str().to_string());
            u_phase.push(a.state.phase().code());
            u_owner.push(a.claim.as_ref().map(|c| c.owner as i64));
            u_cgen.push(a.claim_generation as i64);
            u_lease.push(a.claim.as_ref().map(|c| c.lease_until_ms as i64));
            u_agen.push(a.attempt_generation as i32);
            u_rej.push(a.rejections as i32);
            u_unknown.push(a.unknown_since_ms.map(|v| v as i64));
            u_pub.push(a.published_at_ms.map(|v| v as i64));
            u_pattempt.push(a.primary.as_ref().map(|p| p.attempt_id as i64));
            u_pcluster.push(a.primary.as_ref().map(|p| p.cluster.clone()));
            u_pstream.push(a.primary.as_ref().map(|p| p.stream.clone()));
            u_ppart.push(
                a.primary
                    .as_ref()
                    .and_then(|p| p.partition.map(|x| x as i32)),
            );
            u_pseq.push(a.primary.as_ref().map(|p| p.sequence as i64));
            u_nb.push(a.pacing.not_before_ms as i64);
            u_ns.push(a.pacing.never_sent as i32);
            u_nl.push(a.pacing.next_lookup_at_ms as i64);
            u_lk.push(a.pacing.lookups as i32);
            i_id.push(inline_a.map(|x| x.id as i64));
            i_agen.push(inline_a.map(|x| x.attempt_generation as i32));
            i_cgen.push(inline_a.map(|x| x.claim_generation as i64));
            i_owner.push(inline_a.map(|x| x.owner as i64));
            i_egen.push(inline_a.map(|x| x.envelope_generation as i32));
            i_status.push(inline_a.map(|x| status_str(x.status).to_string()));
            i_started.push(inline_a.map(|x| x.started_at_ms as i64));
            i_archived.push(a.attempts.len().saturating_sub(1) as i32);
        }
        // Every attempt but the latest is history, kept in sealpost.attempt.
        let hist_b = &b.attempts[..b.attempts.len().saturating_sub(1)];
        let hist_a = &a.attempts[..a.attempts.len().saturating_sub(1)];
        for at in hist_a {
            match hist_b.iter().find(|x| x.id == at.id) {
                None => {
                    a_id.push(at.id as i64);
                    a_event.push(uuid_of(a.event_id));
                    a_member.push(a.member as i16);
                    a_agen.push(at.attempt_generation as i32);
                    a_cgen.push(at.claim_generation as i64);
                    a_owner.push(at.owner as i64);
                    a_egen.push(at.envelope_generation as i32);
                    a_dest.push(at.destination_digest.0.to_vec());
                    a_status.push(status_str(at.status).to_string());
                    a_started.push(at.started_at_ms as i64);
                }
                Some(old) if old.status != at.status => {
                    s_id.push(at.id as i64);
                    s_status.push(status_str(at.status).to_string());
                }
                Some(_) => {}
            }
        }
    }
    let mut written = Vec::new();
    if !u_id.is_empty() {
        // Only the column groups some row of this batch changed are sent and written: a
        // claim writes the state, the claim and the inline attempt; an acceptance the state,
        // the slot and the attempt's status.
        let changed = |f: &dyn Fn(&EventRow, &EventRow) -> bool| {
            before.iter().zip(after).any(|(b, a)| f(b, a))
        };
        let mut cols: Vec<(&'static str, &'static str, Bind<'_>)> = vec![
            ("state", "text", bind(&u_state)),
            ("phase", "int2", bind(&u_phase)),
        ];
        if changed(&|b, a| b.claim != a.claim || b.claim_generation != a.claim_generation) {
            cols.push(("claim_owner", "int8", bind(&u_owner)));
            cols.push(("claim_generation", "int8", bind(&u_cgen)));
            cols.push(("lease_until_ms", "int8", bind(&u_lease)));
        }
        if changed(&|b, a| b.attempt_generation != a.attempt_generation) {
            cols.push(("attempt_generation", "int4", bind(&u_agen)));
        }
        if changed(&|b, a| b.rejections != a.rejections) {
            cols.push(("rejections", "int4", bind(&u_rej)));
        }
        if changed(&|b, a| b.unknown_since_ms != a.unknown_since_ms) {
            cols.push(("unknown_since_ms", "int8", bind(&u_unknown)));
        }
        if changed(&|b, a| b.published_at_ms != a.published_at_ms) {
            cols.push(("published_at_ms", "int8", bind(&u_pub)));
        }
        if changed(&|b, a| b.primary != a.primary) {
            cols.push(("primary_attempt_id", "int8", bind(&u_pattempt)));
            cols.push(("primary_cluster", "text", bind(&u_pcluster)));
            cols.push(("primary_stream", "text", bind(&u_pstream)));
            cols.push(("primary_partition", "int4", bind(&u_ppart)));
            cols.push(("primary_sequence", "int8", bind(&u_pseq)));
        }
        if changed(&|b, a| b.pacing != a.pacing) {
            cols.push(("not_before_ms", "int8", bind(&u_nb)));
            cols.push(("never_sent", "int4", bind(&u_ns)));
            cols.push(("next_lookup_at_ms", "int8", bind(&u_nl)));
            cols.push(("lookups", "int4", bind(&u_lk)));
        }
        // The inline attempt: an acceptance changes its status only, a claim all of it.
        if changed(&|b, a| {
            inline_identity(b) != inline_identity(a) || b.attempts.len() != a.attempts.len()
        }) {
            cols.push(("attempt_id", "int8", bind(&i_id)));
            cols.push(("attempt_agen", "int4", bind(&i_agen)));
            cols.push(("attempt_claim_generation", "int8", bind(&i_cgen)));
            cols.push(("attempt_owner", "int8", bind(&i_owner)));
            cols.push(("attempt_envelope_generation", "int4", bind(&i_egen)));
            cols.push(("attempt_started_ms", "int8", bind(&i_started)));
            cols.push(("attempts_archived", "int4", bind(&i_archived)));
        }
        if changed(&|b, a| b.attempts.last() != a.attempts.last()) {
            cols.push(("attempt_status", "text", bind(&i_status)));
        }
        let xmin_then = guard.map(|_| bind(&u_xmin));
        let q = update_sql(&cols, xmin_then);
        let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = vec![&u_id, &u_member];
        params.extend(cols.iter().map(|(_, _, b)| b.value()));
        params.extend(xmin_then.map(|b| b.value()));
        counted(1);
        let statement = prepare(prepared, tx, &q).await?;
        if guard.is_some() {
            written = tx
                .query(&statement, &params)
                .await?
                .iter()
                .map(|r| (event_of(r.get(0)), r.get::<_, i16>(1) as u16))
                .collect();
        } else {
            tx.execute(&statement, &params).await?;
        }
    }
    debug_assert!(
        guard.is_none() || (a_id.is_empty() && s_id.is_empty()),
        "a guarded write changes the work row only"
    );
    if !a_id.is_empty() {
        counted(1);
        tx.execute(
            "INSERT INTO sealpost.attempt (attempt_id, event_id, member, attempt_generation, claim_generation,
                owner, envelope_generation, destination_digest, status, started_at_ms)
             SELECT * FROM unnest($1::int8[], $2::uuid[], $3::int2[], $4::int4[], $5::int8[], $6::int8[],
                                  $7::int4[], $8::bytea[], $9::text[], $10::int8[])",
            &[&a_id, &a_event, &a_member, &a_agen, &a_cgen, &a_owner, &a_egen, &a_dest, &a_status, &a_started],
        )
        .await?;
    }
    if !s_id.is_empty() {
        counted(1);
        tx.execute(
            "UPDATE sealpost.attempt a SET status = u.status
             FROM unnest($1::int8[], $2::text[]) AS u(id, status) WHERE a.attempt_id = u.id",
            &[&s_id, &s_status],
        )
        .await?;
    }
    Ok(written)
}

/// A send this dispatcher is now authorised to make.
#[derive(Clone, Debug)]
pub struct Outgoing {
    /// The row as it is after registration.
    pub event_id: EventId,
    /// Member.
    pub member: u16,
    /// Envelope generation.
    pub envelope_generation: u32,
    /// The registered attempt.
    pub attempt_id: u64,
    /// The claim to present with every later write.
    pub token: ClaimToken,
    /// Payload digest (header).
    pub payload_digest: Digest,
    /// Frozen destination.
    pub destination: Destination,
    /// Its digest (header).
    pub destination_digest: Digest,
    /// Payload bytes as sealed.
    pub payload: Vec<u8>,
    /// Lease end of the claim (database clock).
    pub lease_until_ms: u64,
    /// The envelope's description of the event (wire headers).
    pub envelope: WireEnvelope,
}

impl Outgoing {
    /// [`Outgoing::send_request`] without copying the payload.
    pub fn into_send_request(self) -> SendRequest {
        SendRequest {
            event_id: self.event_id,
            member: self.member,
            envelope_generation: self.envelope_generation,
            attempt_id: self.attempt_id,
            payload_digest: self.payload_digest,
            destination: self.destination,
            destination_digest: self.destination_digest,
            payload: self.payload,
            envelope: self.envelope,
            signature: None,
        }
    }

    /// The message the broker adapter sends for this authorised attempt (the adapter sees
    /// the broker port's [`SendRequest`], never the store's row or claim token).
    pub fn send_request(&self) -> SendRequest {
        self.clone().into_send_request()
    }
}

/// What one claim scan did.
#[derive(Clone, Debug, Default)]
pub struct ClaimBatch {
    /// The database clock inside the claim transaction.
    pub db_now_ms: u64,
    /// Sends authorised (attempts registered, rows `SENDING`).
    pub outgoing: Vec<Outgoing>,
    /// `SENDING` rows whose lease had expired, moved to `DISPATCH_UNKNOWN`.
    pub expired_to_unknown: usize,
    /// The highest commit position among the rows the scan locked.
    pub last_position: Option<u64>,
    /// The lowest commit position among the sends bound for an ordered destination.
    pub ordered_from: Option<u64>,
    /// Rows the scan locked that wait for an earlier event of their aggregate (R29).
    pub ordering_waits: usize,
}

impl ClaimBatch {
    /// The claim as the dispatcher machine takes it; `claim_started_ms` is the shell's clock
    /// read just before the claim transaction started.
    pub fn claimed(self, claim_started_ms: u64) -> Claimed {
        let db_now_ms = self.db_now_ms;
        Claimed {
            last_position: self.last_position,
            ordered_from: self.ordered_from,
            claim_started_ms,
            db_now_ms,
            sends: self
                .outgoing
                .into_iter()
                .map(|o| ClaimedSend {
                    token: o.token,
                    db_lease_until_ms: o.lease_until_ms,
                    request: o.into_send_request(),
                })
                .collect(),
        }
    }
}

/// Claims up to `batch_size_max` rows and registers one attempt for each, in one short
/// transaction (R7–R9).
///
/// # Transactions and locks
/// One transaction: `SELECT ... FOR UPDATE SKIP LOCKED` over the partial claim index in
/// commit order, so parallel dispatchers take disjoint rows and no one waits; rows of a
/// transaction that committed late are still `PENDING` and are found by the next scan (the
/// scan has no cursor to skip past them). `PENDING` rows still waiting out a never-sent
/// backoff (`not_before_ms`, the core's `decide_dispatch_claim` skips them) are not selected,
/// so they take no place in the batch. The lease end comes from the database clock. The
/// transaction commits before anything is sent.
pub async fn claim_batch(
    client: &mut tokio_postgres::Client,
    owner: u64,
    batch_size_max: usize,
    lease_ms: u64,
) -> Result<ClaimBatch> {
    claim_batch_for(client, owner, None, batch_size_max, lease_ms).await
}

/// [`claim_batch`] for a dispatcher that serves only `cluster` (`None`: every cluster). A
/// dispatcher never claims a row it cannot send; those rows wait for a dispatcher of their
/// cluster instead of cycling through "never sent".
///
/// # Transactions and locks
/// As [`claim_batch`]; the scan runs over the claim index `(dest_cluster, committed_seq)`, so
/// rows of other clusters are neither read, locked nor counted against the batch, and the
/// scan stops after one batch however many rows wait.
pub async fn claim_batch_for(
    client: &mut tokio_postgres::Client,
    owner: u64,
    cluster: Option<&str>,
    batch_size_max: usize,
    lease_ms: u64,
) -> Result<ClaimBatch> {
    claim_batch_from(client, owner, cluster, 0, batch_size_max, lease_ms).await
}

/// [`claim_batch_for`] over the rows at or after commit position `from_position` only (the
/// dispatcher machine's scan position: it skips the head of the queue that earlier batches
/// claimed, whose index entries are dead until vacuum, and scans from 0 at least every
/// `rescan_every_ms`). [`ClaimBatch::last_position`] is where the next scan may start.
///
/// # Transactions and locks
/// As [`claim_batch`].
pub async fn claim_batch_from(
    client: &mut tokio_postgres::Client,
    owner: u64,
    cluster: Option<&str>,
    from_position: u64,
    batch_size_max: usize,
    lease_ms: u64,
) -> Result<ClaimBatch> {
    claim_in(
        client,
        owner,
        cluster,
        from_position,
        batch_size_max,
        lease_ms,
        None,
    )
    .await
}

/// The rows a dispatcher's claims wrote and it still holds (sent, or on their way), as it
/// wrote them: [`submit_held`] accepts an ordinary receipt for such a row with one guarded
/// write instead of locking and reading it again.
///
/// The decision is the core's either way: `decide_receipt` and `apply_receipt` run on the
/// row as the claim left it, and the write only lands if the row is still exactly that (its
/// `xmin`, the id of the transaction that wrote the row version, is still the claim's).
/// A row someone else wrote since (a reconciler, another dispatcher after the lease, an
/// operator) takes the locked path, as does every receipt that is not an ordinary first
/// ACK.
#[derive(Debug, Default)]
pub struct Held {
    rows: HashMap<(EventId, u16), HeldRow>,
    /// The database clock at the last claim and the local clock then.
    clock: Option<(u64, std::time::Instant)>,
    /// The claim's and the guarded acceptance's statements, prepared on the connection.
    statements: Prepared,
}

#[derive(Debug)]
struct HeldRow {
    row: EventRow,
    xmin: i64,
    /// The commit time of the row (database clock), for the commit -> `PUBLISHED` latency.
    created_at_ms: u64,
    /// Set once a guarded write accepted this receipt, so a submission retried after a later
    /// failure returns the same verdict instead of accepting twice.
    accepted: Option<(Accepted, Published)>,
}

impl Held {
    /// Rows held now.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether no row is held.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Drops the prepared statements: call it when the connection is replaced (they belong
    /// to the old one). A failed claim or submission drops them too.
    pub fn forget_statements(&mut self) {
        self.statements = Prepared::default();
    }

    /// The database clock now, as far as the last claim tells (its reading plus the local
    /// time since): the time `apply_receipt` stamps on a guarded acceptance.
    fn db_now_ms(&self) -> Option<u64> {
        self.clock
            .map(|(db, at)| db + at.elapsed().as_millis() as u64)
    }
}

/// [`claim_batch_from`] for a dispatcher that keeps what it claimed in `held` (see
/// [`Held`] and [`submit_held`]).
pub async fn claim_batch_held(
    client: &mut tokio_postgres::Client,
    owner: u64,
    cluster: Option<&str>,
    from_position: u64,
    batch_size_max: usize,
    lease_ms: u64,
    held: &mut Held,
) -> Result<ClaimBatch> {
    let r = claim_in(
        client,
        owner,
        cluster,
        from_position,
        batch_size_max,
        lease_ms,
        Some(&mut *held),
    )
    .await;
    if r.is_err() {
        held.forget_statements();
    }
    r
}

/// How long a held row is kept after its lease ended (its answer may still come late).
const HELD_AFTER_LEASE_MS: u64 = 60_000;

async fn claim_in(
    client: &mut tokio_postgres::Client,
    owner: u64,
    cluster: Option<&str>,
    from_position: u64,
    batch_size_max: usize,
    lease_ms: u64,
    mut held: Option<&mut Held>,
) -> Result<ClaimBatch> {
    let claim_local_start = std::time::Instant::now();
    let tx = client.transaction().await?;
    // The claim must walk the claim index in commit order and stop after one batch. With
    // statistics that have not seen the current backlog (a new cluster, positions past the
    // histogram, autovacuum behind) the planner estimates a few hundred rows and prefers a
    // bitmap scan of every claimable row and a sort: measured 100-180 ms instead of 3 ms per
    // 1,000-row claim on a 50,000-row backlog, half of all claims. The claim's statements
    // are prepared once per connection, but planned for their parameters every time (a
    // generic plan could not use the cluster and position as index bounds). These settings
    // end with the transaction.
    counted(1);
    tx.batch_execute(
        "SET LOCAL enable_bitmapscan = off; SET LOCAL enable_seqscan = off;
         SET LOCAL plan_cache_mode = force_custom_plan",
    )
    .await?;
    // One statement reads the clock, picks and locks the batch, joins the sealed envelope
    // (destination, digests, payload) and draws an attempt id per row.
    // The pick is `step::picks` in SQL (the step checks every picked row against it).
    let q = locked_rows_sql(
        &format!(
            "FROM sealpost.work w
             WHERE w.phase = {DISPATCHABLE} AND ($2::text IS NULL OR w.dest_cluster = $2)
               AND w.committed_seq >= $3
               AND (w.state = 'PENDING' OR w.lease_until_ms IS NULL OR w.lease_until_ms <= {NOW_MS_SQL})
               AND (w.state <> 'PENDING' OR w.not_before_ms <= {NOW_MS_SQL})
             ORDER BY w.dest_cluster, w.committed_seq LIMIT $1 FOR UPDATE OF w SKIP LOCKED"
        ),
        &format!(
            ", e.payload, nextval('sealpost.attempt_id_seq'), {NOW_MS_SQL}, w.committed_seq,
               (SELECT pg_current_xact_id()::xid::text::bigint), w.created_at_ms,
               {}, {WIRE_ENVELOPE_COLS}",
            earlier_unresolved_sql()
        ),
        "",
    );
    counted(3);
    let statement = prepare(held.as_deref_mut().map(|h| &mut h.statements), &tx, &q).await?;
    let found = tx
        .query(
            &statement,
            &[&(batch_size_max as i64), &cluster, &(from_position as i64)],
        )
        .await?;
    // The batch in claim order: the order of the pick (cluster, then commit position).
    let mut found = found;
    found.sort_by(|a, b| {
        (a.get::<_, &str>(4), a.get::<_, i64>(ROW_COLS_LEN + 3))
            .cmp(&(b.get::<_, &str>(4), b.get::<_, i64>(ROW_COLS_LEN + 3)))
    });
    let now_ms = match found.first() {
        Some(r) => r.get::<_, i64>(ROW_COLS_LEN + 2) as u64,
        None => db_now_ms(&tx).await?,
    };
    let served: Vec<String> = cluster.map(str::to_string).into_iter().collect();
    let mut payloads = Vec::with_capacity(found.len());
    let mut picked = Vec::with_capacity(found.len());
    for r in &found {
        payloads.push(r.get::<_, Vec<u8>>(ROW_COLS_LEN));
        picked.push(Pick {
            position: r.get::<_, i64>(ROW_COLS_LEN + 3) as u64,
            earlier_unresolved: r.get::<_, bool>(ROW_COLS_LEN + 6),
            attempt_id: r.get::<_, i64>(ROW_COLS_LEN + 1) as u64,
        });
    }
    let before = finish_load(&tx, &found).await?;
    let mut after = before.clone();
    let input = ClaimInput {
        owner,
        served: match cluster {
            Some(_) => Served::Only(&served),
            None => Served::Every,
        },
        now_ms,
        lease_ms,
        batch_max: batch_size_max,
    };
    let step = step::step_claim(&mut after, &picked, &input, &mut CoreRules)?;
    let mut batch = ClaimBatch {
        db_now_ms: now_ms,
        last_position: step.last_position,
        ordered_from: step.ordered_from,
        expired_to_unknown: step.expired_to_unknown,
        ordering_waits: step.ordering_waits,
        ..ClaimBatch::default()
    };
    for (i, sent) in step.sends() {
        let row = &after[i];
        batch.outgoing.push(Outgoing {
            event_id: sent.begin.event_id,
            member: row.member,
            envelope_generation: sent.begin.envelope_generation,
            attempt_id: sent.attempt_id,
            token: sent.token,
            payload_digest: row.payload_digest,
            destination: row.destination.clone(),
            destination_digest: sent.begin.destination_digest,
            payload: std::mem::take(&mut payloads[i]),
            lease_until_ms: sent.lease_until_ms,
            envelope: wire_envelope(&found[i], ROW_COLS_LEN + 7)?,
        });
    }
    persist_guarded(
        &tx,
        &before,
        &after,
        None,
        held.as_deref_mut().map(|h| &mut h.statements),
    )
    .await?;
    tx.commit().await?;
    if let Some(held) = held {
        // The rows this claim wrote now carry its transaction id as their `xmin`.
        let xid = found
            .first()
            .map_or(0, |r| r.get::<_, i64>(ROW_COLS_LEN + 4));
        held.clock = Some((now_ms, claim_local_start));
        held.rows.retain(|_, h| {
            h.row
                .claim
                .as_ref()
                .is_some_and(|c| c.lease_until_ms + HELD_AFTER_LEASE_MS > now_ms)
        });
        let sent: std::collections::HashSet<(EventId, u16)> = batch
            .outgoing
            .iter()
            .map(|o| (o.event_id, o.member))
            .collect();
        for (row, r) in after.into_iter().zip(&found) {
            if sent.contains(&(row.event_id, row.member)) {
                held.rows.insert(
                    (row.event_id, row.member),
                    HeldRow {
                        row,
                        xmin: xid,
                        created_at_ms: r.get::<_, i64>(ROW_COLS_LEN + 5).max(0) as u64,
                        accepted: None,
                    },
                );
            }
        }
    }
    Ok(batch)
}

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
async fn write_acceptance(
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

/// [`submit`] for a dispatcher that claims with [`claim_batch_held`]: an ordinary first ACK
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
    let mut seen: HashMap<(EventId, u16), usize> = HashMap::new();
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
            before.push(h.row.clone());
            after.push(a);
            xmins.push(h.xmin);
        }
    }
    if !fast.is_empty() {
        let written: std::collections::HashSet<(EventId, u16)> = persist_guarded(
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
                if let Some(h) = held.rows.get_mut(&key) {
                    let p = Published {
                        topic: h.row.destination.topic.clone(),
                        latency_ms: guarded_now_ms.saturating_sub(h.created_at_ms),
                    };
                    published.push(p.clone());
                    h.accepted = Some((a, p));
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
    for r in receipts {
        held.rows.remove(&(r.event_id, r.member));
    }
    for r in &submission.reports {
        held.rows.remove(&(r.event_id, r.member));
    }
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
        "FROM (SELECT * FROM sealpost.work x WHERE (x.event_id, x.member) > ($1, $2)
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
    let (policy, _, _) = load_policy(&tx, route).await?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_column_every_row_shares_is_one_parameter_and_the_rest_are_unnested() {
        let state = vec!["PUBLISHED".to_string(); 3];
        let seq: Vec<i64> = vec![7, 8, 9];
        let part: Vec<Option<i32>> = vec![None, None, None];
        let cols = vec![
            ("state", "text", bind(&state)),
            ("primary_sequence", "int8", bind(&seq)),
            ("primary_partition", "int4", bind(&part)),
        ];
        assert!(matches!(cols[0].2, Bind::Same(_)));
        assert!(matches!(cols[1].2, Bind::Each(_)));
        assert!(
            matches!(cols[2].2, Bind::Same(_)),
            "NULL for every row is one NULL"
        );
        let q = update_sql(&cols, None);
        assert!(q.contains("state = $3::text"), "{q}");
        assert!(q.contains("primary_sequence = u.primary_sequence"), "{q}");
        assert!(q.contains("primary_partition = $5::int4"), "{q}");
        assert!(
            q.contains("unnest($1::uuid[], $2::int2[], $4::int8[]) AS u(id, m, primary_sequence)"),
            "{q}"
        );
        assert!(!q.contains("RETURNING"), "{q}");
    }

    #[test]
    fn the_guard_compares_xmin_as_one_value_or_per_row() {
        let state = vec!["PUBLISHED".to_string(), "PUBLISHED".to_string()];
        let cols = vec![("state", "text", bind(&state))];
        let one: Vec<i64> = vec![41, 41];
        let q = update_sql(&cols, Some(bind(&one)));
        assert!(q.contains("AND w.xmin = $4::int8::text::xid"), "{q}");
        assert!(q.ends_with("RETURNING w.event_id, w.member"), "{q}");
        let two: Vec<i64> = vec![41, 42];
        let q = update_sql(&cols, Some(bind(&two)));
        assert!(q.contains("$4::int8[]) AS u(id, m, xmin_then)"), "{q}");
        assert!(q.contains("AND w.xmin = u.xmin_then::text::xid"), "{q}");
    }

    #[test]
    fn an_empty_batch_has_no_shared_value() {
        let none: Vec<i64> = Vec::new();
        assert!(matches!(bind(&none), Bind::Each(_)));
    }
}
