//! A missing broker grant is the deployment's fault, not the event's (issue 23, item 2):
//! against the real PostgreSQL and the shared RabbitMQ, a dispatcher whose user may not write
//! the route's exchange has its publishes refused (`403 ACCESS_REFUSED`, the adapter's
//! `NotPermitted`). With `rejection_limit = 1`, where one poison refusal quarantines a row,
//! the refused events are never quarantined: they wait under the never-sent backoff with the
//! broker's words and what to grant as their last error (or, for a batch that reached the
//! channel the refusal closed, "not connected"), nothing reaches the queue, and once
//! an administrator grants `write` the same running dispatcher publishes every one of them,
//! without `sealpost release`.
//!
//! The test has its own database, vhost and user (removed at the end, also when it fails).
//! It needs `rabbitmqctl` (`.ci/run` runs as root on the RabbitMQ node); elsewhere it prints
//! "skipped" and passes, never under `CI`.

use crate::common;
use crate::teardown_rabbitmq;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sealpost::runtime::{self, CancellationToken, Counters};
use sealpost::store;
use sealpost_core::dispatcher::NOT_PERMITTED;
use sealpost_core::envelope::EventId;
use sealpost_core::envelope::NewEvent;
use sealpost_rabbitmq::{Rabbit, RabbitOptions};

fn rabbitmqctl(args: &[&str]) -> Result<(), String> {
    let out = std::process::Command::new("rabbitmqctl")
        .args(args)
        .output()
        .map_err(|e| format!("rabbitmqctl {args:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "rabbitmqctl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

async fn rows(pg: &tokio_postgres::Client) -> Vec<(String, i32, i32, Option<String>)> {
    pg.query(
        "SELECT state, rejections, never_sent, last_error FROM sealpost.outbox ORDER BY event_id",
        &[],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_publish_grant_quarantines_nothing_and_the_events_leave_once_granted() {
    if std::process::Command::new("rabbitmqctl")
        .arg("help")
        .output()
        .is_err()
    {
        assert!(
            std::env::var("CI").is_err(),
            "this test needs rabbitmqctl (run as root on the RabbitMQ node)"
        );
        eprintln!("skipped: no rabbitmqctl");
        return;
    }
    let n = runtime::owner_id() % 1_000_000_000;
    let cfg = common::fresh_database(&format!("sealpost_grants_{n}")).await;
    let mut pg = runtime::pg_connect(&cfg.database_url).await.unwrap();
    store::migrate(&pg).await.expect("migrate");

    // A vhost of its own, an administrator (guest) and a dispatcher user that may not write.
    let vhost = format!("sealpost-grants-{n}");
    let user = format!("sealpost_grants_{n}");
    let _guard = {
        let (vhost, user) = (vhost.clone(), user.clone());
        teardown_rabbitmq::Teardown::new(
            format!("RabbitMQ vhost {vhost} and user {user}"),
            move || async move {
                let _ = rabbitmqctl(&["delete_user", &user]);
                rabbitmqctl(&["delete_vhost", &vhost])
            },
        )
    };
    rabbitmqctl(&["add_vhost", &vhost]).unwrap();
    rabbitmqctl(&["set_permissions", "-p", &vhost, "guest", ".*", ".*", ".*"]).unwrap();
    let password = format!("pw-{user}");
    rabbitmqctl(&["add_user", &user, &password]).unwrap();
    rabbitmqctl(&["set_permissions", "-p", &vhost, &user, "^$", "^$", "^$"]).unwrap();
    let password_file = std::env::temp_dir().join(format!("{vhost}.password"));
    std::fs::write(&password_file, format!("{password}\n")).unwrap();

    let admin = Rabbit::connect(
        &format!("amqp://guest:guest@127.0.0.1:5672/{vhost}"),
        common::RABBITMQ_CLUSTER,
        Duration::from_secs(5),
        "sealpost-test-grants-admin",
    )
    .await
    .expect("RabbitMQ must be running at 127.0.0.1:5672 (guest/guest)");
    let consumers = vec!["c1".to_string()];
    admin
        .ensure_destination("ORDERS", &consumers)
        .await
        .unwrap();
    let dispatcher = Rabbit::connect_with(
        &format!("amqp://{user}@127.0.0.1:5672/{vhost}"),
        common::RABBITMQ_CLUSTER,
        Duration::from_secs(5),
        "sealpost-test-grants-dispatcher",
        &RabbitOptions {
            password_file: Some(password_file.clone()),
            ..Default::default()
        },
    )
    .await
    .expect("the dispatcher user connects");
    let _ = std::fs::remove_file(&password_file);
    store::set_route(&pg, "orders", common::RABBITMQ_CLUSTER, "ORDERS")
        .await
        .unwrap();

    let mut ids = Vec::new();
    let tx = pg.transaction().await.unwrap();
    for i in 0..3 {
        let id = EventId(*uuid::Uuid::now_v7().as_bytes());
        let agg = format!("o-{i}");
        let ev = NewEvent {
            aggregate_type: "order",
            aggregate_id: &agg,
            aggregate_version: 1,
            event_type: "order.created",
            payload_schema: "order.created.v1",
            payload: br#"{"order_id":"x"}"#,
            tenant: "t",
            occurred_at_ms: 1,
            creating_txid: 0,
        };
        store::enqueue(&tx, "orders", id, &ev, &agg).await.unwrap();
        ids.push(id);
    }
    tx.commit().await.unwrap();

    let mut run_cfg = cfg.config();
    run_cfg.rejection_limit = 1;
    let stop = CancellationToken::new();
    let counters = Arc::new(Counters::default());
    let tasks = runtime::spawn_fleet(
        &run_cfg,
        &common::pg_source(&run_cfg),
        &Arc::new(dispatcher),
        1,
        true,
        &stop,
        &counters,
    );

    // Every row tried and sent back, some three times or more (a limit of 1 would have
    // quarantined a row at its first refusal), none quarantined, the refusal's words on the
    // rows. A refusal closes the RabbitMQ channel: a neighbour outstanding on it may be an
    // unknown outcome (the reconciler retries it to the same destination, R14, and it is
    // refused again just as plainly), and a batch that reaches the closed channel never
    // leaves ("not connected"); the next batch opens a new channel.
    let refused = |e: &str| e.contains(NOT_PERMITTED);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let now = rows(&pg).await;
        assert!(
            now.iter()
                .all(|(state, rejections, ..)| state != "QUARANTINED" && *rejections == 0),
            "a missing grant must not make poison: {now:?}"
        );
        let words =
            |(_, _, _, e): &(String, i32, i32, Option<String>)| e.as_deref().is_some_and(refused);
        if now.iter().all(|(_, _, never_sent, _)| *never_sent >= 1)
            && now.iter().any(|(_, _, never_sent, _)| *never_sent >= 3)
            && now.iter().any(words)
        {
            for (state, _, _, last_error) in &now {
                assert_ne!(state, "PUBLISHED");
                let e = last_error.as_deref().unwrap_or_default();
                assert!(
                    refused(e) || e.contains("the channel closed"),
                    "a refusal or its closed channel: {e}"
                );
                if refused(e) {
                    assert!(e.contains("ACCESS_REFUSED"), "{e}");
                    assert!(e.contains("write permission"), "{e}");
                }
                assert!(!e.contains(&password), "no secret in the error: {e}");
            }
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not refused as expected: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        counters.refused.load(Ordering::Relaxed),
        0,
        "no poison counted"
    );
    assert_eq!(counters.published.load(Ordering::Relaxed), 0);

    // The administrator grants write on the exchange; the same dispatcher sends them all.
    rabbitmqctl(&[
        "set_permissions",
        "-p",
        &vhost,
        &user,
        "^$",
        "^ORDERS$",
        "^$",
    ])
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let now = rows(&pg).await;
        if now.iter().all(|(state, ..)| state == "PUBLISHED") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not published after the grant: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.cancel();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(counters.published.load(Ordering::Relaxed), ids.len() as u64);
    assert_eq!(counters.refused.load(Ordering::Relaxed), 0);
    let quarantined: i64 = pg
        .query_one("SELECT count(*) FROM sealpost.quarantine", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(quarantined, 0, "nothing quarantined");
    let _ = admin.delete_destination("ORDERS", &consumers).await;
}
