//! The sqlx flavour of `enqueue` against the real PostgreSQL (127.0.0.1:5432, a database of
//! its own, `sealpost_sqlx`): it commits and rolls back with the caller's transaction and seals exactly what
//! the tokio-postgres flavour seals. Needs no broker.
#![cfg(feature = "sqlx")]

mod common;

use sealpost::runtime;
use sealpost::store;
use sealpost_core::envelope::{EventId, NewEvent};
use sqlx::Connection;

fn new_event<'a>(id: &'a str, payload: &'a [u8]) -> NewEvent<'a> {
    NewEvent {
        aggregate_type: "order",
        aggregate_id: id,
        aggregate_version: 1,
        event_type: "order.created.v1",
        payload_schema: "order.created.v1",
        payload,
        tenant: "t",
        occurred_at_ms: 1,
        creating_txid: 0,
    }
}

#[tokio::test]
async fn sqlx_enqueue_commits_with_the_callers_transaction() {
    let cfg = common::fresh_database("sealpost_sqlx").await;
    let pg = runtime::pg_connect(&cfg.database_url)
        .await
        .expect("PostgreSQL must be running");
    store::migrate(&pg).await.expect("migrate");
    store::set_route(&pg, "orders", common::NATS_CLUSTER, "TSQLX")
        .await
        .expect("route");
    let mut conn = sqlx::PgConnection::connect("postgres://postgres@127.0.0.1:5432/sealpost_sqlx")
        .await
        .unwrap();
    let id = EventId(*uuid::Uuid::now_v7().as_bytes());
    let mut tx = conn.begin().await.unwrap();
    sealpost::sqlx_store::enqueue(&mut tx, "orders", id, &new_event("o-s", b"{}"), "k")
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    let n: i64 = pg
        .query_one("SELECT count(*) FROM sealpost.outbox", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 0, "rolled back with the caller");
    let mut tx = conn.begin().await.unwrap();
    let env = sealpost::sqlx_store::enqueue(&mut tx, "orders", id, &new_event("o-s", b"{}"), "k")
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let row = pg
        .query_one(
            "SELECT envelope_digest, state FROM sealpost.outbox WHERE event_id = $1",
            &[&uuid::Uuid::from_bytes(id.0)],
        )
        .await
        .unwrap();
    let stored: Vec<u8> = row.get(0);
    assert_eq!(stored, env.digest().0.to_vec());
    assert_eq!(row.get::<_, String>(1), "PENDING");
    let err = sealpost::sqlx_store::enqueue(&mut conn, "nope", id, &new_event("o-s", b"{}"), "k")
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("no route policy named `nope`"),
        "{err}"
    );
}

/// The same producer-string rules as the tokio-postgres flavour, with the same error; nothing
/// is written (`crates/sealpost-cli/tests/hostile.rs` has the full set of hostile strings).
#[tokio::test]
async fn sqlx_enqueue_refuses_hostile_strings_naming_the_field() {
    let cfg = common::fresh_database("sealpost_sqlx_hostile").await;
    let pg = runtime::pg_connect(&cfg.database_url)
        .await
        .expect("PostgreSQL must be running");
    store::migrate(&pg).await.expect("migrate");
    store::set_route(&pg, "orders", common::NATS_CLUSTER, "TSQLX")
        .await
        .expect("route");
    let mut conn =
        sqlx::PgConnection::connect("postgres://postgres@127.0.0.1:5432/sealpost_sqlx_hostile")
            .await
            .unwrap();
    let cases: [(&str, &str, &str); 4] = [
        ("o-1\r\n", "k", "aggregate_id"),
        ("", "k", "aggregate_id"),
        ("o-1", "a b", "routing_key"),
        ("o-\0", "k", "aggregate_id"),
    ];
    for (aggregate_id, key, field) in cases {
        let id = EventId(*uuid::Uuid::now_v7().as_bytes());
        match sealpost::sqlx_store::enqueue(
            &mut conn,
            "orders",
            id,
            &new_event(aggregate_id, b"{}"),
            key,
        )
        .await
        {
            Err(sealpost::sqlx_store::SqlxStoreError::Store(store::StoreError::InvalidInput {
                source,
                ..
            })) => assert_eq!(source.field, field),
            other => panic!("{aggregate_id:?}: expected InvalidInput, got {other:?}"),
        }
    }
    let n: i64 = pg
        .query_one("SELECT count(*) FROM sealpost.envelope", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 0, "nothing written");
}

/// The contract check (R26) of the tokio-postgres flavour, on a sqlx transaction: a route
/// that requires contracts refuses a payload that is not a datum of its registered version,
/// and takes one that is.
#[tokio::test]
async fn sqlx_enqueue_checks_contracts_like_the_tokio_postgres_flavour() {
    let cfg = common::fresh_database("sealpost_sqlx_contract").await;
    let mut pg = runtime::pg_connect(&cfg.database_url)
        .await
        .expect("PostgreSQL must be running");
    store::migrate(&pg).await.expect("migrate");
    store::set_route(&pg, "orders", common::NATS_CLUSTER, "TSQLXC")
        .await
        .expect("route");
    sealpost::contract::set_route_contracts(&pg, "orders", true)
        .await
        .unwrap();
    let (v1, _) = sealpost::contract::register(
        &mut pg,
        "order.created",
        r#"{"type": "record", "name": "O", "fields": [{"name": "total", "type": "long"}]}"#,
    )
    .await
    .unwrap();
    let good = v1
        .encode(sealpost::contract::apache_avro::types::Value::Record(vec![
            (
                "total".into(),
                sealpost::contract::apache_avro::types::Value::Long(12),
            ),
        ]))
        .unwrap();
    let mut conn =
        sqlx::PgConnection::connect("postgres://postgres@127.0.0.1:5432/sealpost_sqlx_contract")
            .await
            .unwrap();
    let event = |schema: &'static str, payload: &'static [u8]| NewEvent {
        event_type: "order.created",
        payload_schema: schema,
        ..new_event("o-c", payload)
    };
    let id = EventId(*uuid::Uuid::now_v7().as_bytes());
    for (schema, payload, says) in [
        (
            "order.created@1",
            &b"{}"[..],
            "does not match `order.created@1`",
        ),
        (
            "order.created@2",
            &b""[..],
            "no version 2 of `order.created`",
        ),
        ("order.created.v1", &b""[..], "is not `EVENT_TYPE@VERSION`"),
    ] {
        let err =
            sealpost::sqlx_store::enqueue(&mut conn, "orders", id, &event(schema, payload), "k")
                .await
                .unwrap_err();
        assert!(err.to_string().contains(says), "{schema}: {err}");
    }
    let good: &'static [u8] = Box::leak(good.into_boxed_slice());
    sealpost::sqlx_store::enqueue(
        &mut conn,
        "orders",
        id,
        &event("order.created@1", good),
        "k",
    )
    .await
    .unwrap();
    let n: i64 = pg
        .query_one("SELECT count(*) FROM sealpost.outbox", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 1, "only the matching payload was written");
}

#[tokio::test]
async fn sqlx_enqueue_set_writes_what_the_tokio_postgres_flavour_writes() {
    let cfg = common::fresh_database("sealpost_sqlx_set").await;
    let mut pg = runtime::pg_connect(&cfg.database_url)
        .await
        .expect("PostgreSQL must be running");
    store::migrate(&pg).await.expect("migrate");
    for (route, topic) in [("a", "TSQLXSA"), ("b", "TSQLXSB"), ("a2", "TSQLXSA")] {
        store::set_route(&pg, route, common::NATS_CLUSTER, topic)
            .await
            .expect("route");
    }
    use sealpost_core::delivery_set::CompletionRule;
    let mut conn =
        sqlx::PgConnection::connect("postgres://postgres@127.0.0.1:5432/sealpost_sqlx_set")
            .await
            .unwrap();
    let ev = new_event("o-s", b"{}");
    // Refused whole, as the tokio-postgres flavour refuses it.
    let id = EventId(*uuid::Uuid::now_v7().as_bytes());
    for (routes, says) in [
        (&["a"][..], "at least two routes, got 1"),
        (
            &["a", "a2"][..],
            "routes `a` and `a2` both deliver to topic `TSQLXSA`",
        ),
    ] {
        let err = sealpost::sqlx_store::enqueue_set(
            &mut conn,
            routes,
            CompletionRule::All,
            id,
            &ev,
            "o-s",
        )
        .await
        .unwrap_err();
        assert!(err.to_string().contains(says), "{routes:?}: {err}");
    }
    assert_eq!(
        common::count(&pg, "SELECT count(*) FROM sealpost.work").await,
        0
    );
    // The same set through both flavours seals the same members.
    let mut tx = conn.begin().await.unwrap();
    let by_sqlx = sealpost::sqlx_store::enqueue_set(
        &mut tx,
        &["a", "b"],
        CompletionRule::Any,
        id,
        &ev,
        "o-s",
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let other = EventId(*uuid::Uuid::now_v7().as_bytes());
    let tx = pg.transaction().await.unwrap();
    let by_tokio = store::enqueue_set(&tx, &["a", "b"], CompletionRule::Any, other, &ev, "o-s")
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(by_sqlx.len(), 2);
    for (s, t) in by_sqlx.iter().zip(&by_tokio) {
        assert_eq!(s.destination, t.destination);
        assert_eq!(s.destination_digest, t.destination_digest);
        assert_eq!(s.payload_digest, t.payload_digest);
    }
    for id in [id, other] {
        let v = store::delivery_set(&pg, id).await.unwrap().unwrap();
        assert_eq!(
            (v.rule.as_str(), v.status.as_str(), v.needed),
            ("any", "in_progress", 1)
        );
        assert_eq!(
            v.members
                .iter()
                .map(|m| m.route.as_str())
                .collect::<Vec<_>>(),
            vec!["a", "b"]
        );
    }
}
