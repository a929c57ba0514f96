//! `sealpost bench` end to end on a small backlog against the real PostgreSQL and NATS
//! JetStream: every phase runs, both naive relays publish every event (none failed), and the
//! figures the JSON reports are the ones its ratios are made of, and the run leaves none of
//! its events (drained, produced or retained) in the outbox. No figure is compared with
//! a speed: this checks that the bench measures, not how fast this machine is.

use crate::common;

use sealpost::runtime;
use sealpost_cli::bench::{self, BenchArgs};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_bench_runs_every_phase_and_both_relays_publish_everything() {
    let db = format!("sealpost_bench_{}", runtime::owner_id() % 1_000_000);
    // Dropped when the test ends, pass or fail. The bench removes its own streams and
    // tables, also when it returns an error.
    let cfg = common::fresh_database(&db).await;
    let args = BenchArgs {
        events: 3_000,
        payload_bytes: 200,
        dispatchers: 2,
        rate_per_s: 500,
        latency_s: 3,
        load_backlog: 500,
        retained: 1_000,
    };
    let r = bench::run(
        sealpost_cli::config::Settings::from_run(cfg.clone()).unwrap(),
        args,
        true,
    )
    .await;
    // What the run leaves in the outbox (the test database is the bench's alone).
    let left = async {
        let pg = runtime::pg_connect(&cfg.database_url).await.ok()?;
        let n = pg
            .query_one(
                "SELECT (SELECT count(*) FROM sealpost.envelope)
                      + (SELECT count(*) FROM sealpost.work)
                      + (SELECT count(*) FROM sealpost.route_policy WHERE name LIKE 'bench-%')",
                &[],
            )
            .await
            .ok()?;
        Some(n.get::<_, i64>(0))
    }
    .await;
    let r = r.expect("bench runs");
    // Every event it drained, produced or retained, and its route, are gone.
    assert_eq!(left, Some(0), "{r:?}");

    assert_eq!(r.events, 3_000);
    assert!(r.sealpost_events_per_s > 0.0, "{r:?}");
    assert!(r.naive_events_per_s > 0.0, "{r:?}");
    assert!(r.wire_relay_events_per_s > 0.0, "{r:?}");
    assert_eq!(r.naive_publish_failures, 0, "{r:?}");
    assert_eq!(r.wire_relay_publish_failures, 0, "{r:?}");
    let close = |a: f64, b: f64| (a - b).abs() <= 0.0015;
    assert!(
        close(r.ratio, r.sealpost_events_per_s / r.naive_events_per_s),
        "{r:?}"
    );
    assert!(
        close(
            r.ratio_to_wire_relay,
            r.sealpost_events_per_s / r.wire_relay_events_per_s
        ),
        "{r:?}"
    );
    assert!(r.latency_events > 0, "{r:?}");
    assert!(
        close(
            r.wire_relay_ratio_to_naive,
            r.wire_relay_events_per_s / r.naive_events_per_s
        ),
        "{r:?}"
    );
    // Every drain's CPU was read (Linux, with PostgreSQL and NATS on this machine): the
    // dispatchers and relays ran in this process, and the relays' PostgreSQL backends,
    // closed before the drain's end, are counted through the postmaster. `/proc` counts CPU
    // in 10 ms ticks and a relay drains these 3,000 events in about 50 ms, so one group of
    // one drain may honestly read zero (seen: the wire relay's PostgreSQL); what cannot be
    // zero is each group over the three drains together.
    let drains = [
        ("sealpost", r.cpu_per_event),
        ("naive", r.naive_cpu_per_event),
        ("wire relay", r.wire_relay_cpu_per_event),
    ];
    type Group = fn(&sealpost_cli::cpu::PerEvent) -> Option<f64>;
    let groups: [(&str, Group); 3] = [
        ("process", |c| c.process_us),
        ("postgres", |c| c.postgres_us),
        ("nats", |c| c.nats_us),
    ];
    for (group, read) in groups {
        let mut sum = 0.0;
        for (name, cpu) in &drains {
            let us = read(cpu);
            assert!(us.is_some_and(|us| us >= 0.0), "{name} {group}: {r:?}");
            sum += us.unwrap_or(0.0);
        }
        assert!(sum > 0.0, "{group} over all drains: {r:?}");
    }
    // PostgreSQL 15 here: the checkpoint counters are readable.
    for c in [
        r.checkpoints_during_drain,
        r.naive_checkpoints_during_drain,
        r.wire_relay_checkpoints_during_drain,
        r.checkpoints_during_load,
    ] {
        assert!(c.is_some_and(|c| c >= 0), "{r:?}");
    }
    assert!(r.wal_bytes_per_event > 0.0, "{r:?}");
    let json = serde_json::to_value(&r).unwrap();
    for key in [
        "ratio",
        "wal_bytes_per_event",
        "statements_per_event",
        "net_drain_events_per_s",
        "consume_events_per_s",
        "ratio_to_wire_relay",
        "wire_relay_ratio_to_naive",
        "checkpoints_during_load",
        "checkpoints_during_drain",
    ] {
        assert!(json[key].is_number(), "{key} is not a number in {json}");
    }
    assert!(json["cpu_per_event"]["total_us"].is_number(), "{json}");
    // The machine's server writes a replica log: the CDC line says why it did not run
    // (.ci/run's bench runs it on a private server with wal_level = logical).
    assert!(
        r.cdc
            .skipped
            .as_deref()
            .is_some_and(|w| w.contains("wal_level")),
        "{:?}",
        r.cdc
    );
    assert!(json["cdc"]["drain_events_per_s"].is_null(), "{json}");
    assert_eq!(json["naive_msg_id"], true, "{json}");
}
