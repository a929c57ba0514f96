//! Delivery sets (R16) against the real PostgreSQL, NATS and RabbitMQ: one event delivered to
//! a NATS stream and a RabbitMQ exchange as one set, each member published by the dispatcher
//! fleet of its own broker, the completion rule (`all`, `any`) decided by the core's
//! `set_status` as the members settle, a member refused for good (quarantined) blocking an
//! `all` set, and `status`, `trace` and the reconciliation report showing it; and sets that
//! are not sets refused whole, with nothing written and the caller's transaction still open
//! (and a member not migrated onto another member's destination).
//! Each test has its own database, stream and exchange.

use std::sync::Arc;
use std::time::Duration;

use crate::common;
use crate::teardown_nats;
use crate::teardown_rabbitmq;

use sealpost::ops::{self, NoScan, ReconcileOptions};
use sealpost::runtime::{self, CancellationToken, Counters};
use sealpost::store::{self, ErrorKind, StoreError};
use sealpost_core::delivery_set::{CompletionRule, SetError};
use sealpost_core::envelope::{EventId, NewEvent};
use sealpost_core::reconcile::Lookup;
use sealpost_nats::async_nats::jetstream;
use sealpost_nats::Nats;
use sealpost_rabbitmq::Rabbit;

fn order(id: &str, payload: &'static [u8]) -> NewEvent<'static> {
    NewEvent {
        aggregate_id: Box::leak(id.to_string().into_boxed_str()),
        ..sealpost_cli::demo::order_created("", payload)
    }
}

async fn state_of(pg: &tokio_postgres::Client, id: EventId, member: i16) -> String {
    pg.query_one(
        "SELECT state FROM sealpost.outbox WHERE event_id = $1 AND member = $2",
        &[&uuid::Uuid::from_bytes(id.0), &member],
    )
    .await
    .unwrap()
    .get(0)
}

async fn set_status_of(pg: &tokio_postgres::Client, id: EventId) -> String {
    store::delivery_set(pg, id).await.unwrap().unwrap().status
}

fn report_opts(pending_age_s: u64) -> ReconcileOptions {
    ReconcileOptions {
        pending_age_s,
        unconsumed_age_s: 3_600,
        unknown_age_s: 3_600,
        consumers: Vec::new(),
        streams: Vec::new(),
        scan_max: 0,
    }
}

/// The `set_incomplete` finding of the report: (count, event ids).
async fn set_findings(pg: &tokio_postgres::Client, pending_age_s: u64) -> (i64, Vec<String>) {
    let r = ops::reconcile(pg, None::<&NoScan>, &report_opts(pending_age_s))
        .await
        .unwrap();
    r.findings
        .iter()
        .find(|f| f.kind == "set_incomplete")
        .map_or((0, Vec::new()), |f| (f.count, f.event_ids.clone()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_set_across_nats_and_rabbitmq_completes_by_its_rule_member_by_member() {
    let tag = runtime::owner_id() % 1_000_000;
    let db = common::fresh_database(&format!("sealpost_sets_{tag}")).await;
    let mut cfg = db.config();
    // A refused member is quarantined at its second refusal (the default waits for five).
    cfg.rejection_limit = 2;
    let mut pg = runtime::pg_connect(&cfg.database_url).await.unwrap();
    store::migrate(&pg).await.unwrap();
    pg.batch_execute("CREATE TABLE orders_t (order_id text PRIMARY KEY)")
        .await
        .unwrap();

    // `orders` goes to a JetStream stream that refuses messages over 1 KiB; `audit` to a
    // RabbitMQ exchange with one bound queue.
    let stream = format!("SETS{tag}");
    let exchange = format!("sp-sets-{tag}");
    let nats = Nats::connect(
        &common::nats_url(),
        common::NATS_CLUSTER,
        Duration::from_millis(cfg.ack_timeout_ms),
    )
    .await
    .expect("NATS must be running");
    nats.js
        .create_stream(jetstream::stream::Config {
            name: stream.clone(),
            subjects: vec![format!("sp.{stream}.>")],
            max_message_size: 1_024,
            ..Default::default()
        })
        .await
        .expect("create the test stream");
    let _stream = teardown_nats::stream(&common::nats_url(), &stream);
    let rabbit = Rabbit::connect(
        &common::rabbitmq_url(),
        common::RABBITMQ_CLUSTER,
        Duration::from_millis(cfg.ack_timeout_ms),
        &format!("sealpost-sets-{tag}"),
    )
    .await
    .expect("RabbitMQ must be running at 127.0.0.1:5672 (guest/guest)");
    let readers = vec!["audit-reader".to_string()];
    let _exchange = teardown_rabbitmq::destination(&common::rabbitmq_url(), &exchange, &readers);
    rabbit
        .ensure_destination(&exchange, &readers)
        .await
        .unwrap();
    store::set_route(&pg, "orders", common::NATS_CLUSTER, &stream)
        .await
        .unwrap();
    store::set_route(&pg, "audit", common::RABBITMQ_CLUSTER, &exchange)
        .await
        .unwrap();

    // Three sets and their business rows in one transaction (R4): `all`, `any`, and an
    // `all` set whose payload the stream will refuse (over its 1 KiB limit).
    let big: &'static [u8] = Box::leak(vec![b'x'; 4_096].into_boxed_slice());
    let small: &'static [u8] = br#"{"total":1}"#;
    let (all, any, blocked) = (
        sealpost_cli::demo::mint_event_id(),
        sealpost_cli::demo::mint_event_id(),
        sealpost_cli::demo::mint_event_id(),
    );
    let tx = pg.transaction().await.unwrap();
    for (id, rule, key, payload) in [
        (all, CompletionRule::All, "o-all", small),
        (any, CompletionRule::Any, "o-any", small),
        (blocked, CompletionRule::All, "o-blocked", big),
    ] {
        tx.execute("INSERT INTO orders_t VALUES ($1)", &[&key])
            .await
            .unwrap();
        let envs = store::enqueue_set(
            &tx,
            &["orders", "audit"],
            rule,
            id,
            &order(key, payload),
            key,
        )
        .await
        .unwrap();
        assert_eq!(envs.len(), 2);
        assert_eq!(envs[0].destination.cluster, common::NATS_CLUSTER);
        assert_eq!(envs[1].destination.cluster, common::RABBITMQ_CLUSTER);
        assert!(envs.iter().all(|e| e.event_id == id));
        assert_ne!(envs[0].destination_digest, envs[1].destination_digest);
    }
    tx.commit().await.unwrap();
    assert_eq!(
        common::count(&pg, "SELECT count(*) FROM sealpost.work").await,
        6
    );

    // Nothing sent yet: every set in progress, none stuck within the threshold.
    let v = store::delivery_set(&pg, all).await.unwrap().unwrap();
    assert_eq!(
        (v.rule.as_str(), v.status.as_str(), v.published, v.needed),
        ("all", "in_progress", 0, 2)
    );
    assert_eq!(
        v.members
            .iter()
            .map(|m| (m.member, m.route.as_str(), m.state.as_deref()))
            .collect::<Vec<_>>(),
        vec![
            (0, "orders", Some("PENDING")),
            (1, "audit", Some("PENDING"))
        ]
    );
    assert_eq!(
        v.members[0].destination,
        format!("{}/{stream}", common::NATS_CLUSTER)
    );
    let s = store::status(&pg).await.unwrap().sets;
    assert_eq!(
        (s.total, s.complete, s.in_progress, s.blocked),
        (3, 0, 3, 0)
    );
    assert_eq!(set_findings(&pg, 3_600).await.0, 0);

    // Only NATS's dispatchers run: the `orders` members settle, the `audit` ones wait.
    let counters = Arc::new(Counters::default());
    let stop_nats = CancellationToken::new();
    let nats_fleet = runtime::spawn_fleet(
        &cfg,
        &common::pg_source(&cfg),
        &Arc::new(nats.clone()),
        1,
        false,
        &stop_nats,
        &counters,
    );
    common::wait_for(
        "the NATS members to publish and the oversized one to be quarantined",
        Duration::from_secs(60),
        async || {
            state_of(&pg, all, 0).await == "PUBLISHED"
                && state_of(&pg, any, 0).await == "PUBLISHED"
                && state_of(&pg, blocked, 0).await == "QUARANTINED"
        },
    )
    .await;
    assert_eq!(state_of(&pg, all, 1).await, "PENDING");
    // `any` is complete with one member; `all` needs the other; the quarantined member
    // blocks its `all` set.
    assert_eq!(set_status_of(&pg, any).await, "complete");
    assert_eq!(set_status_of(&pg, all).await, "in_progress");
    assert_eq!(set_status_of(&pg, blocked).await, "blocked");
    let s = store::status(&pg).await.unwrap().sets;
    assert_eq!(
        (s.total, s.complete, s.in_progress, s.blocked),
        (3, 1, 1, 1)
    );
    assert_eq!(
        s.open
            .iter()
            .map(|v| v.event_id.clone())
            .collect::<Vec<_>>(),
        vec![all.to_string(), blocked.to_string()]
    );
    // The report: a blocked set is stuck at once; one in progress only past the threshold.
    assert_eq!(
        set_findings(&pg, 3_600).await,
        (1, vec![blocked.to_string()])
    );
    let (n, ids) = set_findings(&pg, 0).await;
    assert_eq!(n, 2);
    assert!(ids.contains(&all.to_string()) && ids.contains(&blocked.to_string()));
    // The trace shows the set with its members.
    let t = ops::trace(&pg, &all.to_string()).await.unwrap();
    assert_eq!(t["events"].as_array().unwrap().len(), 2, "{t}");
    assert_eq!(t["sets"][0]["status"], "in_progress", "{t}");
    assert_eq!(t["sets"][0]["members"][1]["route"], "audit", "{t}");
    // Each member went to its own destination only: member 0 is on the stream, member 1
    // is not (the subject names the member).
    assert!(matches!(
        nats.lookup_topic(&stream, all, 0).await,
        Lookup::Found(_) | Lookup::Copies(_)
    ));
    assert!(matches!(
        nats.lookup_topic(&stream, all, 1).await,
        Lookup::Absent
    ));

    // RabbitMQ's dispatchers: the `audit` members settle, `all` completes.
    let stop_rabbit = CancellationToken::new();
    let rabbit_fleet = runtime::spawn_fleet(
        &cfg,
        &common::pg_source(&cfg),
        &Arc::new(rabbit),
        1,
        false,
        &stop_rabbit,
        &counters,
    );
    common::wait_for(
        "the RabbitMQ members to publish",
        Duration::from_secs(60),
        async || {
            state_of(&pg, all, 1).await == "PUBLISHED"
                && state_of(&pg, any, 1).await == "PUBLISHED"
                && state_of(&pg, blocked, 1).await == "PUBLISHED"
        },
    )
    .await;
    stop_nats.cancel();
    stop_rabbit.cancel();
    for t in nats_fleet.into_iter().chain(rabbit_fleet) {
        t.await.unwrap().unwrap();
    }
    assert_eq!(set_status_of(&pg, all).await, "complete");
    assert_eq!(set_status_of(&pg, any).await, "complete");
    // Published elsewhere does not complete an `all` set whose member is quarantined.
    assert_eq!(set_status_of(&pg, blocked).await, "blocked");
    let s = store::status(&pg).await.unwrap().sets;
    assert_eq!(
        (s.total, s.complete, s.in_progress, s.blocked),
        (3, 2, 0, 1)
    );
    assert_eq!(set_findings(&pg, 0).await, (1, vec![blocked.to_string()]));
    assert_eq!(common::count(&pg, "SELECT count(*) FROM orders_t").await, 3);
    // Every member was sent to its own destination once (one attempt each; the refused
    // member twice, to its rejection limit).
    let attempts: Vec<(String, i16, i64)> = pg
        .query(
            "SELECT w.state, w.member, count(a.*) FROM sealpost.outbox w
             LEFT JOIN sealpost.attempts a ON a.event_id = w.event_id AND a.member = w.member
             GROUP BY w.event_id, w.member, w.state ORDER BY w.state, w.member",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    for (state, _, n) in &attempts {
        let want = if state == "QUARANTINED" { 2 } else { 1 };
        assert_eq!(*n, want, "{attempts:?}");
    }
}

#[tokio::test]
async fn a_set_that_is_not_a_set_is_refused_whole_and_writes_nothing() {
    let tag = runtime::owner_id() % 1_000_000;
    let db = common::fresh_database(&format!("sealpost_sets_refused_{tag}")).await;
    let mut pg = runtime::pg_connect(&db.config().database_url)
        .await
        .unwrap();
    store::migrate(&pg).await.unwrap();
    let (t1, t2) = (format!("REFUSED{tag}A"), format!("REFUSED{tag}B"));
    store::set_route(&pg, "a", common::NATS_CLUSTER, &t1)
        .await
        .unwrap();
    store::set_route(&pg, "b", common::NATS_CLUSTER, &t2)
        .await
        .unwrap();
    // Another route to `a`'s stream: a second copy for one destination.
    store::set_route(&pg, "a-again", common::NATS_CLUSTER, &t1)
        .await
        .unwrap();
    // A route that checks contracts, with none registered for the event's type.
    store::set_route(
        &pg,
        "checked",
        common::NATS_CLUSTER,
        &format!("REFUSED{tag}C"),
    )
    .await
    .unwrap();
    sealpost::contract::set_route_contracts(&pg, "checked", true)
        .await
        .unwrap();
    let many: Vec<String> = (0..17).map(|i| format!("r{i}")).collect();
    for (i, r) in many.iter().enumerate() {
        store::set_route(&pg, r, common::NATS_CLUSTER, &format!("REFUSED{tag}M{i}"))
            .await
            .unwrap();
    }
    let many: Vec<&str> = many.iter().map(|s| s.as_str()).collect();

    let ev = order("o-1", br#"{"total":1}"#);
    let tx = pg.transaction().await.unwrap();
    let cases: Vec<(&[&str], &str)> = vec![
        (&[], "at least two routes, got 0"),
        (&["a"], "at least two routes, got 1; use enqueue"),
        (&["a", "a"], "routes `a` and `a` both deliver to topic"),
        (
            &["a", "b", "a-again"],
            "routes `a` and `a-again` both deliver to topic",
        ),
        (&many, "at most 16 routes, got 17"),
        (&["a", "nowhere"], "nowhere"),
        (&["a", "checked"], "order.created.v1"),
    ];
    for (routes, says) in cases {
        let e = store::enqueue_set(
            &tx,
            routes,
            CompletionRule::All,
            sealpost_cli::demo::mint_event_id(),
            &ev,
            "o-1",
        )
        .await
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Input, "{routes:?}: {e}");
        assert!(e.to_string().contains(says), "{routes:?}: {e}");
        if routes.len() < 2 {
            assert!(
                matches!(e, StoreError::DeliverySet(SetError::TooFew(_))),
                "{e}"
            );
        }
        for table in ["envelope", "work", "delivery_set"] {
            let n: i64 = tx
                .query_one(&format!("SELECT count(*) FROM sealpost.{table}"), &[])
                .await
                .unwrap()
                .get(0);
            assert_eq!(n, 0, "{routes:?} wrote to {table}");
        }
    }
    // The transaction is still the caller's: a good set in it commits.
    let id = sealpost_cli::demo::mint_event_id();
    store::enqueue_set(&tx, &["a", "b"], CompletionRule::Any, id, &ev, "o-1")
        .await
        .unwrap();
    tx.commit().await.unwrap();
    // And a set in a transaction rolled back leaves nothing (R4).
    let tx = pg.transaction().await.unwrap();
    store::enqueue_set(
        &tx,
        &["a", "b"],
        CompletionRule::All,
        sealpost_cli::demo::mint_event_id(),
        &ev,
        "o-2",
    )
    .await
    .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(
        common::count(&pg, "SELECT count(*) FROM sealpost.work").await,
        2
    );
    let v = store::delivery_set(&pg, id).await.unwrap().unwrap();
    assert_eq!((v.rule.as_str(), v.needed), ("any", 1));
    // A member is not migrated (R15) onto another member's destination.
    store::set_route(&pg, "b-again", common::NATS_CLUSTER, &t2)
        .await
        .unwrap();
    let e = store::migrate_event(&mut pg, id, 0, "b-again")
        .await
        .unwrap_err();
    assert!(
        matches!(e, StoreError::DeliverySet(SetError::SameDestination { .. })),
        "{e}"
    );
    assert!(
        e.to_string()
            .contains("routes `b-again` and `b` both deliver to topic"),
        "{e}"
    );
    assert_eq!(
        common::count(&pg, "SELECT count(*) FROM sealpost.migration").await,
        0
    );
    // An ordinary event is no set.
    let single = sealpost_cli::demo::mint_event_id();
    let tx = pg.transaction().await.unwrap();
    store::enqueue(&tx, "a", single, &ev, "o-1").await.unwrap();
    tx.commit().await.unwrap();
    assert!(store::delivery_set(&pg, single).await.unwrap().is_none());
    let t = ops::trace(&pg, &single.to_string()).await.unwrap();
    assert_eq!(t["sets"], serde_json::json!([]));
}
