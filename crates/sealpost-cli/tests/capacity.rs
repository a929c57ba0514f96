//! `sealpost capacity` through the binary: the JSON keys, the costs' source, a workload file,
//! a saved bench file, and that twice the rate is twice the WAL. No services needed.

use std::process::Command;

fn capacity(args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_sealpost"))
        .arg("capacity")
        .args(args)
        .arg("--json")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "sealpost capacity {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

const WORKLOAD: &[&str] = &[
    "--avg-events-per-s",
    "500",
    "--peak-events-per-s",
    "3000",
    "--payload-bytes-p99",
    "2048",
    "--payload-bytes-avg",
    "400",
    "--retention-days",
    "7",
    "--replicas",
    "3",
    "--retry-amplification",
    "1.05",
    "--backlog",
    "1000000",
];

fn figure(v: &serde_json::Value, k: &str) -> f64 {
    v["figures"][k]["value"]
        .as_f64()
        .unwrap_or_else(|| panic!("figure {k} in {v}"))
}

#[test]
fn capacity_json_names_its_costs_and_each_figure_says_what_it_assumes() {
    let v = capacity(WORKLOAD);
    assert!(v["costs_source"]
        .as_str()
        .unwrap()
        .starts_with("docs/schema.md"));
    for k in [
        "wal_bytes_per_s_avg",
        "wal_bytes_per_s_peak",
        "wal_bytes_per_day",
        "wal_shipped_bytes_per_day",
        "outbox_rows",
        "heap_bytes",
        "index_bytes",
        "database_growth_bytes",
        "stream_bytes",
        "drain_s_at_avg",
        "drain_s_at_peak",
        "peak_utilisation",
    ] {
        let f = &v["figures"][k];
        assert!(f["value"].as_f64().unwrap() > 0.0, "{k}: {f}");
        assert!(!f["assumes"].as_str().unwrap().is_empty(), "{k}: {f}");
        assert!(!f["unit"].as_str().unwrap().is_empty(), "{k}: {f}");
    }
    for k in [
        "wal_bytes_per_event",
        "net_drain_events_per_s",
        "heap_bytes_per_event",
    ] {
        assert!(v["costs"][k].as_f64().unwrap() > 0.0, "cost {k}");
    }
    assert_eq!(v["workload"]["replicas"], 3.0);
    assert_eq!(figure(&v, "outbox_rows"), 500.0 * 86_400.0 * 7.0);
}

#[test]
fn doubling_the_rate_doubles_the_wal_volume() {
    let one = capacity(WORKLOAD);
    let mut doubled: Vec<&str> = WORKLOAD.to_vec();
    doubled[1] = "1000";
    doubled[3] = "6000";
    let two = capacity(&doubled);
    for k in [
        "wal_bytes_per_day",
        "wal_bytes_per_s_peak",
        "wal_shipped_bytes_per_day",
    ] {
        assert_eq!(figure(&two, k), 2.0 * figure(&one, k), "{k}");
    }
    // ... and a backlog drains more slowly, production taking more of the gross rate.
    assert!(figure(&two, "drain_s_at_avg") > figure(&one, "drain_s_at_avg"));
}

#[test]
fn a_workload_file_and_a_saved_bench_give_the_inputs_and_the_costs() {
    let dir = std::env::temp_dir();
    let tag = std::process::id();
    let work = dir.join(format!("sealpost-capacity-{tag}.toml"));
    std::fs::write(
        &work,
        "avg_events_per_s = 500\npeak_events_per_s = 3000\npayload_bytes_p99 = 2048\n\
         retention_days = 7\nreplicas = 3\nbacklog = 1000000\n",
    )
    .unwrap();
    let bench = dir.join(format!("sealpost-capacity-bench-{tag}.json"));
    std::fs::write(
        &bench,
        r#"{"payload_bytes": 200, "wal_bytes_per_event": 700.0, "enqueue_wal_bytes_per_event": 1200.0,
            "heap_bytes_per_event": 1000.0, "index_bytes_per_event": 150.0,
            "net_drain_events_per_s": 10000.0, "produced_events_per_s": 2000.0}"#,
    )
    .unwrap();
    let (w, b) = (work.to_str().unwrap(), bench.to_str().unwrap());
    let v = capacity(&["--file", w, "--from-bench", b]);
    assert_eq!(v["costs_source"], format!("bench {b}"));
    assert_eq!(v["costs_defaulted"].as_array().unwrap().len(), 0);
    assert_eq!(v["costs"]["wal_bytes_per_event"], 700.0);
    assert_eq!(v["workload"]["avg_events_per_s"], 500.0);
    // 1,000,000 / (10,000 + 2,000 - 500)
    assert_eq!(figure(&v, "drain_s_at_avg"), 1_000_000.0 / 11_500.0);
    // A flag overrides the file.
    let v2 = capacity(&["--file", w, "--from-bench", b, "--avg-events-per-s", "1000"]);
    assert_eq!(v2["workload"]["avg_events_per_s"], 1000.0);

    // Missing input: the error names the key and the flag.
    let out = Command::new(env!("CARGO_BIN_EXE_sealpost"))
        .args(["capacity", "--avg-events-per-s", "10"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("peak_events_per_s"), "{err}");
    let _ = std::fs::remove_file(&work);
    let _ = std::fs::remove_file(&bench);
}
