//! The v2 -> v3 upgrade in place (issue 21, item 3: one row write per event): a database at
//! schema version 11, whose work rows a dispatcher of the per-row claims left in every state
//! (pending, pending again after a send that never left, sending under a live claim and
//! under an expired one with its copy at the broker, unknown, reconciling under an expired
//! reconciler claim, retry-claimed, published, retained, quarantined), is taken by
//! `store::migrate` to migration 12 without a work row or a view row changing; then the
//! dispatchers and the reconciler of this build carry on over those rows and new ones against
//! the real PostgreSQL and NATS: every row that can be published is, each exactly once at the
//! broker, the new rows' first sends went through batch leases, and no lease is left once
//! everything is answered. The database and the stream are this test's own.

use crate::common;
use crate::teardown_nats;

use std::sync::Arc;
use std::time::{Duration, Instant};

use sealpost::runtime::CancellationToken;
use sealpost::runtime::{self, Counters};
use sealpost::store;
use sealpost_core::envelope::{EventId, SealedEnvelope};
use sealpost_core::port::{Broker, SendRequest, SendResult};
use sealpost_core::row::AttemptStatus;
use sealpost_core::state::State;
use sealpost_nats::Nats;
use uuid::Uuid;

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

/// What a dispatcher or reconciler of the per-row claims wrote into a work row: the state,
/// the claim, the latest attempt inline, and the rest the state needs (`sets`, SQL).
async fn set_v2(
    pg: &tokio_postgres::Client,
    env: &SealedEnvelope,
    state: State,
    claim: Option<(i64, i64)>,
    attempt: (i64, &str),
    sets: &str,
) {
    let (owner, lease) = claim.unzip();
    let sql = format!(
        "UPDATE sealpost.work SET state = $2, phase = $3, claim_owner = $4, lease_until_ms = $5,
            claim_generation = 1, attempt_generation = 1, attempt_id = $6, attempt_agen = 1,
            attempt_claim_generation = 1, attempt_owner = 77, attempt_envelope_generation = 1,
            attempt_status = $7, attempt_started_ms = {now} - 60000, attempts_archived = 0 {sets}
         WHERE event_id = $1 AND member = 0",
        now = store::NOW_MS_SQL
    );
    let n = pg
        .execute(
            &sql,
            &[
                &Uuid::from_bytes(env.event_id.0),
                &state.as_str(),
                &state.phase().code(),
                &owner,
                &lease,
                &attempt.0,
                &attempt.1,
            ],
        )
        .await
        .unwrap();
    assert_eq!(n, 1);
}

async fn dump(pg: &tokio_postgres::Client, sql: &str) -> Vec<String> {
    pg.query(sql, &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_v2_database_with_rows_in_every_state_upgrades_in_place_and_the_leases_carry_on() {
    let tag = runtime::owner_id() % 1_000_000;
    let db = format!("sealpost_upgrade_lease_{tag}");
    let topic = format!("UPGRADELEASE{tag}");
    let mut cfg = common::fresh_database(&db).await;
    // Short leases, so the rows the old dispatcher holds are taken over within the test.
    cfg.lease_ms = 3_000;
    cfg.ack_timeout_ms = 1_000;
    cfg.idle_poll_ms = 20;
    let mut pg = runtime::pg_connect(&cfg.database_url).await.unwrap();

    // The database as the per-row claims left it: migrations 1 to 11, applied and
    // recorded as `store::migrate` does.
    pg.batch_execute(
        "CREATE SCHEMA IF NOT EXISTS sealpost;
         CREATE TABLE IF NOT EXISTS sealpost.schema_version (
             version int PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())",
    )
    .await
    .unwrap();
    for (v, sql) in store::MIGRATIONS.iter().filter(|(v, _)| *v <= 11) {
        pg.batch_execute(sql)
            .await
            .unwrap_or_else(|e| panic!("migration {v}: {e}"));
        pg.execute(
            "INSERT INTO sealpost.schema_version (version) VALUES ($1) ON CONFLICT DO NOTHING",
            &[v],
        )
        .await
        .unwrap();
    }
    assert_eq!(store::schema_version(&pg).await.unwrap(), 11);
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
    let payload = br#"{"order":"upgrade"}"#.to_vec();
    let keys: Vec<String> = (0..14).map(|i| format!("v2-{tag}-{i}")).collect();
    let tx = pg.transaction().await.unwrap();
    let envs = store::enqueue_many(
        &tx,
        "orders",
        &sealpost_cli::demo::order_batch(&keys, &payload),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let now: i64 = store::db_now_ms(&pg).await.unwrap() as i64;
    let publish = |env: &SealedEnvelope, attempt: u64| {
        let nats = nats.clone();
        let req = request(env, attempt, &payload);
        async move {
            let sent = nats
                .send_batch(vec![req], Instant::now() + Duration::from_secs(5))
                .await;
            match sent.into_iter().next() {
                Some(SendResult::Receipt(r)) => r,
                other => panic!("publish a copy the old dispatcher left: {other:?}"),
            }
        }
    };
    // Rows 0-3 stay as committed: PENDING, never claimed.
    let mut expect: Vec<(&str, State, Vec<AttemptStatus>)> =
        vec![("pending", State::Pending, vec![]); 4];
    // 4: sent once, never left, backing off: PENDING with a failed attempt.
    set_v2(
        &pg,
        &envs[4],
        State::Pending,
        None,
        (9004, "FAILED"),
        &format!(", never_sent = 1, not_before_ms = {}", now + 500),
    )
    .await;
    expect.push(("pending again", State::Pending, vec![AttemptStatus::Failed]));
    // 5: SENDING under a live claim of a dispatcher that is gone; nothing left.
    set_v2(
        &pg,
        &envs[5],
        State::Sending,
        Some((77, now + 4_000)),
        (9005, "SENDING"),
        "",
    )
    .await;
    expect.push((
        "sending, live",
        State::Sending,
        vec![AttemptStatus::Sending],
    ));
    // 6: SENDING under an expired claim; its copy is at the broker.
    publish(&envs[6], 9006).await;
    set_v2(
        &pg,
        &envs[6],
        State::Sending,
        Some((77, now - 60_000)),
        (9006, "SENDING"),
        "",
    )
    .await;
    expect.push((
        "sending, expired",
        State::Sending,
        vec![AttemptStatus::Sending],
    ));
    // 7: DISPATCH_UNKNOWN, nothing at the broker.
    set_v2(
        &pg,
        &envs[7],
        State::DispatchUnknown,
        None,
        (9007, "UNKNOWN"),
        &format!(", unknown_since_ms = {}", now - 30_000),
    )
    .await;
    expect.push((
        "unknown",
        State::DispatchUnknown,
        vec![AttemptStatus::Unknown],
    ));
    // 8: RECONCILING under an expired reconciler claim; its copy is at the broker.
    publish(&envs[8], 9008).await;
    set_v2(
        &pg,
        &envs[8],
        State::Reconciling,
        Some((78, now - 60_000)),
        (9008, "UNKNOWN"),
        &format!(", unknown_since_ms = {}", now - 30_000),
    )
    .await;
    expect.push((
        "reconciling",
        State::Reconciling,
        vec![AttemptStatus::Unknown],
    ));
    // 9: RETRY_CLAIMED: a lookup proved the first attempt absent.
    set_v2(
        &pg,
        &envs[9],
        State::RetryClaimed,
        None,
        (9009, "FAILED"),
        "",
    )
    .await;
    expect.push((
        "retry claimed",
        State::RetryClaimed,
        vec![AttemptStatus::Failed],
    ));
    // 10 and 11: PUBLISHED and RETAINED, their copies at the broker.
    for (i, state) in [(10, State::Published), (11, State::Retained)] {
        let r = publish(&envs[i], 9000 + i as u64).await;
        set_v2(
            &pg,
            &envs[i],
            state,
            None,
            (9000 + i as i64, "ACKED"),
            &format!(
                ", published_at_ms = {now}, primary_attempt_id = {}, primary_cluster = '{}',
                   primary_stream = '{}', primary_sequence = {}",
                9000 + i,
                common::NATS_CLUSTER,
                r.stream,
                r.sequence
            ),
        )
        .await;
        expect.push(("settled", state, vec![AttemptStatus::Acked]));
    }
    // 12: QUARANTINED poison.
    set_v2(
        &pg,
        &envs[12],
        State::Quarantined,
        None,
        (9012, "FAILED"),
        ", rejections = 5",
    )
    .await;
    expect.push((
        "quarantined",
        State::Quarantined,
        vec![AttemptStatus::Failed],
    ));
    // 13 stays PENDING as well.
    expect.push(("pending", State::Pending, vec![]));

    let work_sql = "SELECT w::text FROM sealpost.work w ORDER BY event_id, member";
    let outbox_sql = "SELECT o::text FROM sealpost.outbox o ORDER BY event_id, member";
    let attempts_sql = "SELECT a::text FROM sealpost.attempts a ORDER BY attempt_id";
    let (work_v2, outbox_v2, attempts_v2) = (
        dump(&pg, work_sql).await,
        dump(&pg, outbox_sql).await,
        dump(&pg, attempts_sql).await,
    );

    // The upgrade, twice: the second run finds nothing to do.
    store::migrate(&pg)
        .await
        .expect("upgrade v2 -> v3 in place");
    store::migrate(&pg).await.expect("migrate again is a no-op");
    assert_eq!(
        store::schema_version(&pg).await.unwrap(),
        store::MIGRATIONS.last().unwrap().0
    );
    assert_eq!(dump(&pg, work_sql).await, work_v2, "no work row changed");
    assert_eq!(
        dump(&pg, outbox_sql).await,
        outbox_v2,
        "the outbox view reads the same"
    );
    assert_eq!(
        dump(&pg, attempts_sql).await,
        attempts_v2,
        "the attempts view reads the same"
    );
    // This build reads every old row as it was.
    let ids: Vec<(EventId, u16)> = envs.iter().map(|e| (e.event_id, 0)).collect();
    let rows = store::snapshot(&mut pg, &ids).await.unwrap();
    for ((what, state, statuses), row) in expect.iter().zip(&rows) {
        assert_eq!(row.state, *state, "{what}");
        let got: Vec<AttemptStatus> = row.attempts.iter().map(|a| a.status).collect();
        assert_eq!(&got, statuses, "{what}: attempts");
    }
    assert_eq!(
        store::check_lease_rule(&pg).await.unwrap(),
        vec![],
        "the lease rule reads the old rows the same in the core, the SQL and the view"
    );

    // New events after the upgrade; then this build's dispatchers and reconciler.
    let new_keys: Vec<String> = (0..6).map(|i| format!("v3-{tag}-{i}")).collect();
    let tx = pg.transaction().await.unwrap();
    store::enqueue_many(
        &tx,
        "orders",
        &sealpost_cli::demo::order_batch(&new_keys, &payload),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let count = |sql: &'static str| {
        let pg = &pg;
        async move { pg.query_one(sql, &[]).await.unwrap().get::<_, i64>(0) }
    };
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
            "SELECT count(*) FROM sealpost.outbox
             WHERE state NOT IN ('PUBLISHED', 'RETAINED', 'QUARANTINED')",
        )
        .await;
        if open == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{open} rows still unpublished after 90 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.cancel();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(
        count("SELECT count(*) FROM sealpost.work WHERE state IN ('PUBLISHED', 'RETAINED')").await,
        19,
        "every old row but the poison, and the six new ones"
    );
    let mut stream = nats.js.get_stream(&topic).await.unwrap();
    assert_eq!(
        stream.info().await.unwrap().state.messages,
        19,
        "one copy at the broker per published event: the copies the old claims left were adopted"
    );
    assert!(
        count("SELECT count(*) FROM sealpost.lease").await == 0,
        "every lease is dropped once its rows are answered"
    );
    let leases_taken = count(
        "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM sealpost.lease_lease_id_seq",
    )
    .await;
    assert!(
        leases_taken > 0,
        "the first sends of this build went through batch leases"
    );
    // Every first send recorded in a lease ended up in its row: one attempt per new row.
    assert_eq!(
        count(
            "SELECT count(*) FROM sealpost.attempts a JOIN sealpost.envelope e USING (event_id, member)
             WHERE e.aggregate_id LIKE 'v3-%'"
        )
        .await,
        6
    );
    assert_eq!(store::check_lease_rule(&pg).await.unwrap(), vec![]);
    let _ = nats.js.delete_stream(&topic).await;
}
