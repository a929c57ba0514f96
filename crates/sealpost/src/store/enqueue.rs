//! The producer's side: `enqueue` and `enqueue_many` write the sealed envelope and its work
//! row inside the caller's transaction (R2-R4).

use super::*;

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
    let LoadedPolicy {
        policy,
        txid,
        keying,
        ..
    } = load_policy_checking(tx, route, std::slice::from_ref(ev).iter()).await?;
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
pub(super) async fn keyed_payload(
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
    let LoadedPolicy {
        policy,
        txid,
        keying,
        ..
    } = load_policy_checking(tx, route, events.iter().map(|(_, ev, _)| ev)).await?;
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

/// What `enqueue` reads of a route in the caller's transaction.
pub(super) struct LoadedPolicy {
    pub(super) policy: RoutePolicy,
    pub(super) txid: u64,
    pub(super) keying: Keying,
    /// Payloads must match a registered contract (R26, [`crate::contract`]).
    pub(super) contracts: bool,
}

/// [`load_policy`], then, on a route that requires contracts, the payload check of each of
/// `events` (R26, [`crate::contract`]), before anything is written.
pub(super) async fn load_policy_checking<'e, 'a: 'e>(
    tx: &Transaction<'_>,
    route: &str,
    events: impl Iterator<Item = &'e NewEvent<'a>>,
) -> Result<LoadedPolicy> {
    let loaded = load_policy(tx, route).await?;
    if loaded.contracts {
        crate::contract::check_payloads(tx, events).await?;
    }
    Ok(loaded)
}

/// Reads a route policy and the current transaction id, locking the policy row against a
/// concurrent revision until the caller's transaction ends (shared with the sqlx flavour).
pub(crate) const POLICY_SQL: &str =
    "SELECT generation, cluster, topic, partition_algorithm, serializer, durability, required_ack,
            txid_current(), ordering, payload_key, contracts
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

pub(super) async fn load_policy(tx: &Transaction<'_>, route: &str) -> Result<LoadedPolicy> {
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
    Ok(LoadedPolicy {
        policy,
        txid: p.get::<_, i64>(7) as u64,
        keying: keying_of(p.get(9))?,
        contracts: p.get(10),
    })
}

pub(super) async fn insert_envelope(
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
