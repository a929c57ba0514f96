//! Failure drills with real `sealpost dispatch` processes against the real PostgreSQL and
//! NATS JetStream: a dispatcher killed with SIGKILL between send and receipt, and four
//! dispatcher processes over 50,000 events. Each drill asserts that every event ends
//! `PUBLISHED` with exactly one primary receipt and that the stream holds each event exactly
//! once. NATS stopped and restarted mid-run is in `exclusive.rs`, a test binary of its own:
//! it stops the NATS server every other test shares.

use std::time::{Duration, Instant};

use crate::process_drill::drill;

static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test]
async fn dispatcher_killed_between_send_and_receipt() {
    let _g = LOCK.lock().await;
    let n = 300;
    let mut d = drill("kill", n).await;
    // Dispatcher A publishes, then sits between the publish and its receipt transaction.
    let a = d.spawn(
        "lease_ms = 2000\nack_timeout_ms = 1000\nbatch_size_max = 1000\ndrill_pause_after_publish_ms = 600000\n",
        &["--no-reconciler"],
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while d.stream_messages().await < n as u64 {
        assert!(Instant::now() < deadline, "dispatcher A never published");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        d.count("SELECT count(*) FROM sealpost.outbox WHERE state = 'SENDING'")
            .await,
        n as i64
    );
    assert_eq!(
        d.count("SELECT count(*) FROM sealpost.receipts").await,
        0,
        "no receipt accepted yet"
    );
    // kill -9 in the window between send and receipt.
    d.children[a].kill().unwrap();
    d.children[a].wait().unwrap();
    // B (with a reconciler) takes over once A's lease ends: SENDING -> DISPATCH_UNKNOWN,
    // never PENDING; the lookup finds each message and accepts it.
    d.spawn("lease_ms = 2000\nack_timeout_ms = 1000\n", &[]);
    d.wait_published(n as i64, Duration::from_secs(60)).await;
    d.assert_exactly_once(n as i64).await;
    assert_eq!(
        d.count(
            "SELECT count(*) FROM sealpost.receipts WHERE kind = 'primary' AND source = 'lookup'"
        )
        .await,
        n as i64,
        "every receipt came from the reconciler's lookup"
    );
    assert_eq!(
        d.count("SELECT count(*) FROM sealpost.attempts").await,
        n as i64,
        "no second send was needed"
    );
}

#[tokio::test]
async fn four_dispatcher_processes_over_50k_events() {
    let _g = LOCK.lock().await;
    let n = 50_000;
    let mut d = drill("four", n).await;
    let cfg = "batch_size_max = 1000\n";
    d.spawn(cfg, &[]);
    for _ in 0..3 {
        d.spawn(cfg, &["--no-reconciler"]);
    }
    d.wait_published(n as i64, Duration::from_secs(300)).await;
    d.assert_exactly_once(n as i64).await;
    let owners = d
        .count("SELECT count(DISTINCT owner) FROM sealpost.attempts")
        .await;
    assert!(
        owners >= 2,
        "the work was shared between processes ({owners} owner(s))"
    );
}
