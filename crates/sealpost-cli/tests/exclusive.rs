//! The drills that stop a service every other test shares, in a test binary of their own:
//! `cargo test` runs one test binary after another, so these never run beside another test
//! (the tests of `cli.rs` run two at a time). One so far: the machine's NATS stopped and
//! restarted under two dispatcher processes (the harness is `support/process_drill.rs`).

#[path = "../../sealpost/tests/common/mod.rs"]
mod common;
#[path = "support/process_drill.rs"]
mod process_drill;
#[path = "../../sealpost/tests/common/teardown_nats.rs"]
mod teardown_nats;

use std::process::Command;
use std::time::{Duration, Instant};

use process_drill::{drill, NATS_START};

#[tokio::test]
async fn nats_stopped_and_restarted_mid_run() {
    let n = 20_000;
    let mut d = drill("restart", n).await;
    let cfg = "lease_ms = 3000\nack_timeout_ms = 1000\nbatch_size_max = 200\n";
    d.spawn(cfg, &[]);
    d.spawn(cfg, &["--no-reconciler"]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while d.stream_messages().await < 2_000 {
        assert!(
            Instant::now() < deadline,
            "dispatchers never started publishing"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Stop NATS (gracefully: JetStream flushes its file store), keep it down, restart it.
    let stopped = Command::new("start-stop-daemon")
        .args([
            "--stop",
            "--oknodo",
            "--retry",
            "TERM/10/KILL/5",
            "--exec",
            "/usr/sbin/nats-server",
        ])
        .status()
        .expect("start-stop-daemon");
    assert!(stopped.success());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let published_while_down = d
        .count("SELECT count(*) FROM sealpost.outbox WHERE state = 'PUBLISHED'")
        .await;
    assert!(
        published_while_down < n as i64,
        "the outage must hit the run"
    );
    assert!(Command::new("start-stop-daemon")
        .args(NATS_START)
        .status()
        .unwrap()
        .success());
    d.wait_published(n as i64, Duration::from_secs(180)).await;
    d.assert_exactly_once(n as i64).await;
}
