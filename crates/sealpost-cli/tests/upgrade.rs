//! The v1 -> v2 layout upgrade in place (issue "throughput", item 2): a database at schema
//! version 2 (one wide `sealpost.envelope` row per event) holding rows in every state —
//! pending, sending with an expired lease, unknown with and without a copy at the broker,
//! published, quarantined, migrated — is taken by `store::migrate` to the split layout with
//! nothing lost, and then the protocol carries on against the real PostgreSQL and NATS:
//! every row that can be published is, each exactly once at the broker, and the quarantined
//! row waits for its operator. The database and the stream are this test's own.

use crate::common;
use crate::teardown_nats;

use std::sync::Arc;
use std::time::{Duration, Instant};

use sealpost::runtime::CancellationToken;
use sealpost::runtime::{self, Counters};
use sealpost::store;
use sealpost_core::envelope::{
    Destination, EventId, NewEvent, PartitionAlgorithm, RoutePolicy, SealedEnvelope,
};
use sealpost_core::port::{Broker, SendRequest, SendResult};
use sealpost_core::row::AttemptStatus;
use sealpost_core::state::State;
use sealpost_nats::Nats;
use uuid::Uuid;

/// The v1 column layout of one envelope row, as the version-2 code wrote it.
const V1_INSERT: &str = "INSERT INTO sealpost.envelope (event_id, member, envelope_generation,
    aggregate_type, aggregate_id, aggregate_version, event_type, payload_schema_digest,
    payload_digest, tenant, occurred_at_ms, creating_txid, dest_cluster, dest_topic,
    dest_routing_key, dest_partition_alg, dest_policy_generation, dest_serializer,
    dest_durability, dest_required_ack, destination_digest, envelope_digest, payload, state,
    claim_owner, claim_generation, lease_until_ms, attempt_generation, rejections,
    unknown_since_ms, published_at_ms, primary_attempt_id, primary_cluster, primary_stream,
    primary_sequence, superseded_generations, superseded_digests, last_error)
  VALUES ($1, 0, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18,
    $19, $20, $21, $22, $23, $24, $25, $26, $27, $28, $29, $30, $31, $32, $33, $34, $35, $36, $37)";

struct V1Row<'a> {
    env: &'a SealedEnvelope,
    state: State,
    claim: Option<(i64, i64)>,
    claim_generation: i64,
    attempt_generation: i32,
    rejections: i32,
    unknown_since_ms: Option<i64>,
    published: Option<(i64, i64, String, i64)>,
    superseded: (Vec<i32>, Vec<Vec<u8>>),
    last_error: Option<String>,
}

impl<'a> V1Row<'a> {
    /// A row of `env` in `state` that was claimed and attempted once (the other fields as a
    /// fresh v1 row had them); the callers override what their state needs.
    fn new(env: &'a SealedEnvelope, state: State) -> V1Row<'a> {
        V1Row {
            env,
            state,
            claim: None,
            claim_generation: 1,
            attempt_generation: 1,
            rejections: 0,
            unknown_since_ms: None,
            published: None,
            superseded: (Vec::new(), Vec::new()),
            last_error: None,
        }
    }
}

async fn insert_v1(pg: &tokio_postgres::Client, r: V1Row<'_>, payload: &[u8]) {
    let e = r.env;
    let d = &e.destination;
    pg.execute(
        V1_INSERT,
        &[
            &Uuid::from_bytes(e.event_id.0),
            &(e.envelope_generation as i32),
            &e.aggregate_type,
            &e.aggregate_id,
            &(e.aggregate_version as i64),
            &e.event_type,
            &e.payload_schema_digest.0.as_slice(),
            &e.payload_digest.0.as_slice(),
            &e.tenant,
            &(e.occurred_at_ms as i64),
            &(e.creating_txid as i64),
            &d.cluster,
            &d.topic,
            &d.routing_key,
            &d.partition_algorithm.name(),
            &(d.route_policy_generation as i64),
            &d.serializer,
            &d.durability,
            &d.required_ack,
            &e.destination_digest.0.as_slice(),
            &e.digest().0.as_slice(),
            &payload,
            &r.state.as_str(),
            &r.claim.map(|c| c.0),
            &r.claim_generation,
            &r.claim.map(|c| c.1),
            &r.attempt_generation,
            &r.rejections,
            &r.unknown_since_ms,
            &r.published.as_ref().map(|p| p.0),
            &r.published.as_ref().map(|p| p.1),
            &r.published.as_ref().map(|_| d.cluster.clone()),
            &r.published.as_ref().map(|p| p.2.clone()),
            &r.published.as_ref().map(|p| p.3),
            &r.superseded.0,
            &r.superseded.1,
            &r.last_error,
        ],
    )
    .await
    .expect("insert a v1 envelope row");
}

async fn insert_attempt(
    pg: &tokio_postgres::Client,
    id: i64,
    env: &SealedEnvelope,
    generation: i32,
    digest: &[u8],
    status: &str,
) {
    pg.execute(
        "INSERT INTO sealpost.attempt (attempt_id, event_id, member, attempt_generation,
             claim_generation, owner, envelope_generation, destination_digest, status, started_at_ms)
         VALUES ($1, $2, 0, 1, 1, 1, $3, $4, $5, 1)",
        &[
            &id,
            &Uuid::from_bytes(env.event_id.0),
            &generation,
            &digest,
            &status,
        ],
    )
    .await
    .expect("insert a v1 attempt");
}

fn seal(i: usize, policy: &RoutePolicy, payload: &[u8]) -> SealedEnvelope {
    let id = EventId(*Uuid::now_v7().as_bytes());
    let agg = format!("o-upgrade-{i}");
    let ev = NewEvent {
        aggregate_type: "order",
        aggregate_id: &agg,
        aggregate_version: 1,
        event_type: "order.created.v1",
        payload_schema: "order.created.v1",
        payload,
        tenant: "t",
        occurred_at_ms: 1,
        creating_txid: 7,
    };
    SealedEnvelope::seal(id, &ev, policy, &agg)
}

fn request(env: &SealedEnvelope, attempt_id: u64, payload: &[u8]) -> SendRequest {
    SendRequest {
        event_id: env.event_id,
        member: 0,
        envelope_generation: env.envelope_generation,
        attempt_id,
        payload_digest: env.payload_digest,
        destination: env.destination.clone(),
        destination_digest: env.destination_digest,
        payload: payload.to_vec(),
        envelope: Default::default(),
        signature: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_v1_database_with_rows_in_every_state_upgrades_in_place_and_the_protocol_carries_on() {
    let tag = runtime::owner_id() % 1_000_000;
    let db = format!("sealpost_upgrade_{tag}");
    let topic = format!("UPGRADE{tag}");
    // Both dropped when the test ends, pass or fail.
    let mut cfg = common::fresh_database(&db).await;
    // Short leases, so the expired SENDING row is taken over within the test (the ACK
    // timeout, which is also the send margin, must stay below the lease).
    cfg.lease_ms = 3_000;
    cfg.ack_timeout_ms = 1_000;
    cfg.idle_poll_ms = 20;
    let mut pg = runtime::pg_connect(&cfg.database_url).await.unwrap();

    // The database as the version-2 code left it: migrations 1 and 2 only.
    for (v, sql) in &store::MIGRATIONS[..2] {
        assert!(*v <= 2);
        pg.batch_execute(sql).await.expect("a v1 migration");
    }
    assert_eq!(store::schema_version(&pg).await.unwrap(), 2);
    let nats = Nats::connect(
        &common::nats_url(),
        common::NATS_CLUSTER,
        Duration::from_millis(cfg.ack_timeout_ms),
    )
    .await
    .expect("NATS must be running");
    let _stream = teardown_nats::stream(&common::nats_url(), &topic);
    nats.ensure_stream(&topic).await.unwrap();
    store::set_route(&pg, "orders", common::NATS_CLUSTER, &topic)
        .await
        .unwrap();
    let policy = RoutePolicy {
        generation: 1,
        cluster: common::NATS_CLUSTER.to_string(),
        topic: topic.clone(),
        partition_algorithm: PartitionAlgorithm::None,
        serializer: "json.v1".into(),
        durability: "file".into(),
        required_ack: "stream".into(),
        ordering: sealpost_core::envelope::EventOrdering::Unordered,
    };
    let payload = br#"{"order":"upgrade"}"#.to_vec();
    let now: i64 = store::db_now_ms(&pg).await.unwrap() as i64;
    let expired = Some((1i64, now - 60_000));
    let mut envs = Vec::new();

    // Five pending rows.
    for i in 0..5 {
        let env = seal(i, &policy, &payload);
        insert_v1(
            &pg,
            V1Row {
                claim_generation: 0,
                attempt_generation: 0,
                ..V1Row::new(&env, State::Pending)
            },
            &payload,
        )
        .await;
        envs.push(("pending", env));
    }
    // SENDING with a lease that ran out; the send never left.
    let env = seal(10, &policy, &payload);
    insert_v1(
        &pg,
        V1Row {
            claim: expired,
            ..V1Row::new(&env, State::Sending)
        },
        &payload,
    )
    .await;
    insert_attempt(&pg, 101, &env, 1, &env.destination_digest.0, "SENDING").await;
    envs.push(("sending", env));
    // Unknown, and the broker does hold the copy (its ACK was lost).
    let env = seal(11, &policy, &payload);
    let sent = nats
        .send_batch(
            vec![request(&env, 102, &payload)],
            Instant::now() + Duration::from_secs(5),
        )
        .await;
    assert!(matches!(sent[0], SendResult::Receipt(_)), "{sent:?}");
    insert_v1(
        &pg,
        V1Row {
            unknown_since_ms: Some(now - 30_000),
            ..V1Row::new(&env, State::DispatchUnknown)
        },
        &payload,
    )
    .await;
    insert_attempt(&pg, 102, &env, 1, &env.destination_digest.0, "UNKNOWN").await;
    envs.push(("unknown, stored", env));
    // Unknown, and nothing reached the broker.
    let env = seal(12, &policy, &payload);
    insert_v1(
        &pg,
        V1Row {
            unknown_since_ms: Some(now - 30_000),
            ..V1Row::new(&env, State::DispatchUnknown)
        },
        &payload,
    )
    .await;
    insert_attempt(&pg, 103, &env, 1, &env.destination_digest.0, "UNKNOWN").await;
    envs.push(("unknown, absent", env));
    // Published: at the broker, primary receipt in the row and in the receipt table.
    let env = seal(13, &policy, &payload);
    let sent = nats
        .send_batch(
            vec![request(&env, 104, &payload)],
            Instant::now() + Duration::from_secs(5),
        )
        .await;
    let SendResult::Receipt(receipt) = &sent[0] else {
        panic!("publish the published row's copy: {sent:?}");
    };
    let published_seq = receipt.sequence as i64;
    insert_v1(
        &pg,
        V1Row {
            published: Some((now - 5_000, 104, receipt.stream.clone(), published_seq)),
            ..V1Row::new(&env, State::Published)
        },
        &payload,
    )
    .await;
    insert_attempt(&pg, 104, &env, 1, &env.destination_digest.0, "ACKED").await;
    pg.execute(
        "INSERT INTO sealpost.receipt (event_id, member, attempt_id, kind, source, cluster, stream,
             sequence, broker_duplicate, accepted_at_ms)
         VALUES ($1, 0, 104, 'primary', 'ack', $2, $3, $4, false, $5)",
        &[
            &Uuid::from_bytes(env.event_id.0),
            &common::NATS_CLUSTER,
            &receipt.stream,
            &published_seq,
            &(now - 5_000),
        ],
    )
    .await
    .unwrap();
    envs.push(("published", env));
    // Quarantined poison, waiting for its operator.
    let env = seal(14, &policy, &payload);
    insert_v1(
        &pg,
        V1Row {
            claim_generation: 5,
            rejections: 5,
            last_error: Some("Rejected: refused by the broker".into()),
            ..V1Row::new(&env, State::Quarantined)
        },
        &payload,
    )
    .await;
    insert_attempt(&pg, 105, &env, 1, &env.destination_digest.0, "FAILED").await;
    pg.execute(
        "INSERT INTO sealpost.quarantine (event_id, member, attempt_id, reason, detail, at_ms)
         VALUES ($1, 0, 105, 'Poison', 'refused 5 time(s)', $2)",
        &[&Uuid::from_bytes(env.event_id.0), &now],
    )
    .await
    .unwrap();
    envs.push(("quarantined", env));
    // Migrated (R15): generation 1 went to a deleted topic and failed; v1 rewrote the row to
    // generation 2, which points at the live topic.
    let old_policy = RoutePolicy {
        topic: format!("GONE{tag}"),
        ..policy.clone()
    };
    let gen1 = seal(15, &old_policy, &payload);
    let to: Destination = policy.resolve(&gen1.destination.routing_key);
    let env = SealedEnvelope {
        envelope_generation: 2,
        destination_digest: to.digest(),
        destination: to,
        ..gen1.clone()
    };
    insert_v1(
        &pg,
        V1Row {
            superseded: (vec![1], vec![gen1.destination_digest.0.to_vec()]),
            ..V1Row::new(&env, State::Pending)
        },
        &payload,
    )
    .await;
    insert_attempt(&pg, 106, &env, 1, &gen1.destination_digest.0, "FAILED").await;
    envs.push(("migrated", env));
    let v1_envelope_digests: Vec<(Uuid, Vec<u8>)> = pg
        .query(
            "SELECT event_id, envelope_digest FROM sealpost.envelope ORDER BY event_id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();

    // The upgrade, twice: the second run finds nothing to do.
    store::migrate(&pg)
        .await
        .expect("upgrade v1 -> v2 in place");
    store::migrate(&pg).await.expect("migrate again is a no-op");
    assert_eq!(
        store::schema_version(&pg).await.unwrap(),
        store::MIGRATIONS.last().unwrap().0
    );

    // Nothing lost: every row, its state, its attempts, its receipt, its sealed envelope.
    let keys: Vec<(EventId, u16)> = envs.iter().map(|(_, e)| (e.event_id, 0)).collect();
    let rows = store::snapshot(&mut pg, &keys).await.unwrap();
    assert_eq!(rows.len(), envs.len(), "every v1 row has a work row");
    for (what, env) in &envs {
        let row = rows.iter().find(|r| r.event_id == env.event_id).unwrap();
        assert_eq!(row.envelope_generation, env.envelope_generation, "{what}");
        assert_eq!(row.destination_digest, env.destination_digest, "{what}");
        assert_eq!(row.payload_digest, env.payload_digest, "{what}");
        let (state, statuses): (State, Vec<AttemptStatus>) = match *what {
            "pending" => (State::Pending, vec![]),
            "sending" => (State::Sending, vec![AttemptStatus::Sending]),
            "unknown, stored" | "unknown, absent" => {
                (State::DispatchUnknown, vec![AttemptStatus::Unknown])
            }
            "published" => (State::Published, vec![AttemptStatus::Acked]),
            "quarantined" => (State::Quarantined, vec![AttemptStatus::Failed]),
            "migrated" => (State::Pending, vec![AttemptStatus::Failed]),
            other => unreachable!("{other}"),
        };
        assert_eq!(row.state, state, "{what}");
        let got: Vec<AttemptStatus> = row.attempts.iter().map(|a| a.status).collect();
        assert_eq!(got, statuses, "{what}: attempts");
        if *what == "migrated" {
            assert_eq!(row.superseded.len(), 1);
            assert_eq!(
                row.attempts[0].destination_digest, gen1.destination_digest,
                "the failed attempt keeps generation 1's destination"
            );
        }
        if *what == "published" {
            let p = row.primary.as_ref().expect("the primary receipt survives");
            assert_eq!(p.sequence as i64, published_seq);
        }
    }
    let after: Vec<(Uuid, Vec<u8>)> = pg
        .query(
            "SELECT event_id, envelope_digest FROM sealpost.envelope ORDER BY event_id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        after, v1_envelope_digests,
        "the sealed envelopes are untouched"
    );
    let count = |sql: &'static str| {
        let pg = &pg;
        async move { pg.query_one(sql, &[]).await.unwrap().get::<_, i64>(0) }
    };
    assert_eq!(count("SELECT count(*) FROM sealpost.attempts").await, 6);
    assert_eq!(
        count("SELECT count(*) FROM sealpost.attempt").await,
        0,
        "every v1 attempt was the latest of its row: all inline now"
    );
    assert_eq!(count("SELECT count(*) FROM sealpost.quarantine").await, 1);

    // The protocol carries on: dispatchers and a reconciler over the upgraded rows.
    let stop = CancellationToken::new();
    let counters = Arc::new(Counters::default());
    let broker = Arc::new(nats.clone());
    let tasks = runtime::spawn_fleet(
        &cfg,
        &common::pg_source(&cfg),
        &broker,
        2,
        true,
        &stop,
        &counters,
    );
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let open = count(
            "SELECT count(*) FROM sealpost.work WHERE state NOT IN ('PUBLISHED', 'QUARANTINED')",
        )
        .await;
        if open == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{open} upgraded rows still unpublished after 90 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.cancel();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(
        count("SELECT count(*) FROM sealpost.work WHERE state = 'PUBLISHED'").await,
        10,
        "five pending, sending, both unknowns, published, migrated"
    );
    assert_eq!(
        count("SELECT count(*) FROM sealpost.work WHERE state = 'QUARANTINED'").await,
        1,
        "poison waits for `sealpost release`"
    );
    let mut stream = nats.js.get_stream(&topic).await.unwrap();
    assert_eq!(
        stream.info().await.unwrap().state.messages,
        10,
        "one copy at the broker per published event: the stored unknown was adopted, not resent"
    );
    let stored = envs
        .iter()
        .find(|(w, _)| *w == "unknown, stored")
        .map(|(_, e)| e.event_id)
        .unwrap();
    let row = store::snapshot(&mut pg, &[(stored, 0)]).await.unwrap();
    assert_eq!(
        row[0].primary.as_ref().map(|p| p.attempt_id),
        Some(102),
        "the copy the v1 attempt left at the broker fills the slot"
    );
    let _ = nats.js.delete_stream(&topic).await;
}
