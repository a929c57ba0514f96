//! Per-aggregate ordering (R29) against the real PostgreSQL and NATS JetStream: two
//! dispatchers over an ordered route store every aggregate's versions in order and a
//! consumer reading the stream applies them in order; an earlier event that failed and then
//! became unknown holds its successor back until the reconciler resolves it. Each test has
//! its own database and stream.

use crate::common;
use crate::teardown_nats;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sealpost::runtime::CancellationToken;
use sealpost::runtime::{self, Config, Counters};
use sealpost::store;
use sealpost_core::envelope::{EventId, EventOrdering, NewEvent};
use sealpost_core::inbox::{decide_apply_order, ApplyOrder};
use sealpost_core::SendOutcome;
use sealpost_nats::{Nats, H_EVENT_ID};

/// A fresh database `sealpost_ordering_<tag>_<random>` with the schema, dropped when the
/// guard drops.
async fn fresh(tag: &str) -> (common::TestDb, tokio_postgres::Client) {
    let db = format!(
        "sealpost_ordering_{tag}_{}",
        runtime::owner_id() % 1_000_000
    );
    let cfg = common::fresh_database(&db).await;
    let pg = runtime::pg_connect(&cfg.database_url).await.unwrap();
    store::migrate(&pg).await.expect("migrate");
    (cfg, pg)
}

/// Version `version` of aggregates `0..aggregates`, one transaction per round (the producer
/// writes version v + 1 only after version v committed).
async fn enqueue_round(
    pg: &mut tokio_postgres::Client,
    route: &str,
    aggregates: usize,
    version: u64,
) -> Vec<EventId> {
    let tx = pg.transaction().await.unwrap();
    let mut ids = Vec::new();
    for a in 0..aggregates {
        let id = EventId(*uuid::Uuid::now_v7().as_bytes());
        let agg = format!("o-{a}");
        let payload = format!(r#"{{"order":"{agg}","version":{version}}}"#);
        let ev = NewEvent {
            aggregate_type: "order",
            aggregate_id: &agg,
            aggregate_version: version,
            event_type: "order.changed.v1",
            payload_schema: "order.changed.v1",
            payload: payload.as_bytes(),
            tenant: "t",
            occurred_at_ms: 1,
            creating_txid: 0,
        };
        store::enqueue(&tx, route, id, &ev, &agg).await.unwrap();
        ids.push(id);
    }
    tx.commit().await.unwrap();
    ids
}

async fn state_of(pg: &tokio_postgres::Client, id: EventId) -> String {
    pg.query_one(
        "SELECT state FROM sealpost.outbox WHERE event_id = $1",
        &[&uuid::Uuid::from_bytes(id.0)],
    )
    .await
    .unwrap()
    .get(0)
}

async fn wait_published(pg: &tokio_postgres::Client, n: i64, limit: Duration) {
    let start = Instant::now();
    loop {
        let published: i64 = pg
            .query_one(
                "SELECT count(*) FROM sealpost.work WHERE state = 'PUBLISHED'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if published == n {
            return;
        }
        assert!(
            start.elapsed() < limit,
            "{published} of {n} published after {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn fleet(
    cfg: &Config,
    n: &Nats,
    dispatchers: usize,
    reconciler: bool,
) -> (
    CancellationToken,
    Vec<tokio::task::JoinHandle<Result<(), runtime::RunError>>>,
) {
    let stop = CancellationToken::new();
    let counters = Arc::new(Counters::default());
    let tasks = runtime::spawn_fleet(
        cfg,
        &common::pg_source(cfg),
        &Arc::new(n.clone()),
        dispatchers,
        reconciler,
        &stop,
        &counters,
    );
    (stop, tasks)
}

async fn stop(
    f: (
        CancellationToken,
        Vec<tokio::task::JoinHandle<Result<(), runtime::RunError>>>,
    ),
) {
    f.0.cancel();
    for t in f.1 {
        t.await.unwrap().unwrap();
    }
}

/// The consumer: reads the stream in stream order, maps each message's event id to its
/// aggregate and version (from the outbox), and applies it through the core's gap rule.
/// Returns, per aggregate, the versions in the order they were applied, and how many
/// deliveries the gap rule held back.
async fn consume_in_order(
    n: &Nats,
    topic: &str,
    pg: &tokio_postgres::Client,
) -> (HashMap<String, Vec<u64>>, usize) {
    let stream = n.js.get_stream(topic).await.expect("stream");
    let total = stream.get_info().await.expect("info").state.last_sequence;
    let mut applied: HashMap<String, Vec<u64>> = HashMap::new();
    let mut held = 0;
    let mut seen = std::collections::HashSet::new();
    for seq in 1..=total {
        let m = stream.get_raw_message(seq).await.expect("message");
        let id = m
            .headers
            .get(H_EVENT_ID)
            .and_then(|v| EventId::parse(v.as_str()))
            .expect("a Sealpost event id header");
        if !seen.insert(id) {
            continue; // a second copy: the inbox settles it
        }
        let r = pg
            .query_one(
                "SELECT aggregate_id, aggregate_version FROM sealpost.outbox WHERE event_id = $1",
                &[&uuid::Uuid::from_bytes(id.0)],
            )
            .await
            .unwrap();
        let (agg, version): (String, i64) = (r.get(0), r.get(1));
        let versions = applied.entry(agg).or_default();
        match decide_apply_order(versions.last().copied(), version as u64) {
            ApplyOrder::Apply => versions.push(version as u64),
            ApplyOrder::Hold => held += 1,
        }
    }
    (applied, held)
}

/// Two dispatchers, twelve aggregates of five versions each, committed round by round: every
/// aggregate's versions are stored in version order and the consumer applies all of them
/// without a single gap. The claims waited (a later version was found while an earlier one
/// was in flight) and still nothing overtook.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_dispatchers_keep_every_aggregate_in_order() {
    let (mut cfg, mut pg) = fresh("two").await;
    cfg.batch_size_max = 8;
    let n = Nats::connect(
        &common::nats_url(),
        common::NATS_CLUSTER,
        Duration::from_millis(cfg.ack_timeout_ms),
    )
    .await
    .expect("NATS must be running");
    let topic = format!("ORDTWO{}", runtime::owner_id() % 1_000_000);
    let _stream = teardown_nats::stream(&common::nats_url(), &topic);
    n.ensure_stream(&topic).await.unwrap();
    store::set_route_ordering(
        &pg,
        "orders",
        common::NATS_CLUSTER,
        &topic,
        EventOrdering::PerAggregate,
    )
    .await
    .unwrap();
    let (aggregates, versions) = (12usize, 5u64);
    let f = fleet(&cfg, &n, 2, true);
    for v in 1..=versions {
        enqueue_round(&mut pg, "orders", aggregates, v).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    wait_published(
        &pg,
        (aggregates as u64 * versions) as i64,
        Duration::from_secs(60),
    )
    .await;
    stop(f).await;

    let (applied, held) = consume_in_order(&n, &topic, &pg).await;
    assert_eq!(applied.len(), aggregates);
    for (agg, vs) in &applied {
        assert_eq!(
            vs,
            &(1..=versions).collect::<Vec<u64>>(),
            "aggregate {agg}: versions applied in stream order"
        );
    }
    assert_eq!(held, 0, "the stream holds every aggregate in version order");
    n.js.delete_stream(&topic).await.unwrap();
}

/// Version 1 fails ("never sent"), then its retry's answer is lost (unknown): version 2
/// waits through both, whoever claims, and leaves only after the reconciler resolved
/// version 1; the stream has 1 before 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_then_unknown_earlier_event_holds_back_the_later_one() {
    let (cfg, mut pg) = fresh("unknown").await;
    let n = Nats::connect(
        &common::nats_url(),
        common::NATS_CLUSTER,
        Duration::from_millis(cfg.ack_timeout_ms),
    )
    .await
    .expect("NATS must be running");
    let topic = format!("ORDUNK{}", runtime::owner_id() % 1_000_000);
    let _stream = teardown_nats::stream(&common::nats_url(), &topic);
    n.ensure_stream(&topic).await.unwrap();
    store::set_route_ordering(
        &pg,
        "orders",
        common::NATS_CLUSTER,
        &topic,
        EventOrdering::PerAggregate,
    )
    .await
    .unwrap();
    let v1 = enqueue_round(&mut pg, "orders", 1, 1).await[0];
    let v2 = enqueue_round(&mut pg, "orders", 1, 2).await[0];
    let cluster = Some(common::NATS_CLUSTER);

    let report = |o: &store::Outgoing, outcome: SendOutcome| store::OutcomeReport {
        event_id: o.event_id,
        member: 0,
        token: o.token,
        attempt_id: o.attempt_id,
        outcome,
        detail: "test".into(),
    };
    // First claim: version 1 only; version 2 waits.
    let b = store::claim(
        &mut pg,
        &store::ClaimRequest::new(1, 10, 10_000).cluster(cluster),
        None,
    )
    .await
    .unwrap();
    assert_eq!(b.outgoing.len(), 1);
    assert_eq!(b.outgoing[0].event_id, v1);
    assert_eq!(b.ordering_waits, 1);
    // It fails: never sent. Another dispatcher's claim still does not send version 2.
    store::report_outcomes(
        &mut pg,
        &[report(&b.outgoing[0], SendOutcome::NeverSent)],
        5,
    )
    .await
    .unwrap();
    assert_eq!(state_of(&pg, v1).await, "PENDING");
    let b2 = store::claim(
        &mut pg,
        &store::ClaimRequest::new(2, 10, 10_000).cluster(cluster),
        None,
    )
    .await
    .unwrap();
    assert!(b2.outgoing.is_empty(), "version 2 must not overtake");
    assert_eq!(b2.ordering_waits, 1);
    // After the backoff version 1 is claimed again; its answer is lost: unknown.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let b3 = store::claim(
        &mut pg,
        &store::ClaimRequest::new(2, 10, 10_000).cluster(cluster),
        None,
    )
    .await
    .unwrap();
    assert_eq!(b3.outgoing.len(), 1);
    assert_eq!(b3.outgoing[0].event_id, v1);
    store::report_outcomes(
        &mut pg,
        &[report(&b3.outgoing[0], SendOutcome::AckTimeout)],
        5,
    )
    .await
    .unwrap();
    assert_eq!(state_of(&pg, v1).await, "DISPATCH_UNKNOWN");
    let b4 = store::claim(
        &mut pg,
        &store::ClaimRequest::new(1, 10, 10_000).cluster(cluster),
        None,
    )
    .await
    .unwrap();
    assert!(
        b4.outgoing.is_empty(),
        "an unknown earlier event holds back the later one"
    );
    assert_eq!(state_of(&pg, v2).await, "PENDING");

    // The reconciler finds version 1 absent and grants a retry; then version 2 leaves.
    let f = fleet(&cfg, &n, 1, true);
    wait_published(&pg, 2, Duration::from_secs(60)).await;
    stop(f).await;
    let (applied, held) = consume_in_order(&n, &topic, &pg).await;
    assert_eq!(applied.get("o-0"), Some(&vec![1, 2]));
    assert_eq!(held, 0);
    n.js.delete_stream(&topic).await.unwrap();
}
