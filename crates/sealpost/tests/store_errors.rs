//! `StoreError::kind` on the errors a real PostgreSQL server gives: the loops drop a lost
//! connection, retry a conflict or a timeout, and raise an alert for the rest, by kind.

mod common;

use sealpost::runtime;
use sealpost::store::{self, ErrorKind, StoreError};

#[tokio::test]
async fn a_conflict_a_timeout_and_a_lost_connection_are_told_apart() {
    let db = common::fresh_database("sealpost_store_errors").await;
    let url = db.database_url.clone();
    let mut a = runtime::pg_connect(&url).await.unwrap();
    let b = runtime::pg_connect(&url).await.unwrap();
    a.batch_execute("CREATE TABLE t (id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 0)")
        .await
        .unwrap();

    // A serialization failure (40001): a repeatable-read transaction updates a row another
    // transaction changed after its snapshot.
    let tx = a
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .start()
        .await
        .unwrap();
    tx.query_one("SELECT v FROM t WHERE id = 1", &[])
        .await
        .unwrap();
    b.execute("UPDATE t SET v = v + 1 WHERE id = 1", &[])
        .await
        .unwrap();
    let e = StoreError::from(
        tx.execute("UPDATE t SET v = v + 1 WHERE id = 1", &[])
            .await
            .unwrap_err(),
    );
    assert_eq!(e.kind(), ErrorKind::Retryable, "{e}");
    assert!(e.kind().is_transient());
    drop(tx);

    // A statement timeout (57014); the connection stays usable.
    let e = StoreError::from(
        a.batch_execute("SET statement_timeout = 50; SELECT pg_sleep(5)")
            .await
            .unwrap_err(),
    );
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    a.batch_execute("RESET statement_timeout").await.unwrap();
    store::db_now_ms(&a).await.expect("still connected");

    // The server ends the session (57P01, then a closed connection): lost, whichever the
    // client sees first.
    let pid: i32 = a
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    b.execute("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .unwrap();
    let mut kinds = Vec::new();
    for _ in 0..2 {
        let e = store::db_now_ms(&a).await.unwrap_err();
        kinds.push(e.kind());
    }
    assert!(
        kinds.iter().all(|k| *k == ErrorKind::ConnectionLost),
        "{kinds:?}"
    );

    // Refusals of the caller's input and broken invariants are not retried as they are.
    assert_eq!(
        StoreError::NoRoutePolicy("x".into()).kind(),
        ErrorKind::Input
    );
    assert_eq!(StoreError::NotMigrated.kind(), ErrorKind::Schema);
    assert!(!ErrorKind::Permission.is_transient());
    assert!(!ErrorKind::Invariant.is_transient());
}
