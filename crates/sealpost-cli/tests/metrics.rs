//! `--metrics-addr` against the real services: a `sealpost dispatch` process publishes a
//! batch of events (one of them poison, one left unknown, one for a cluster nobody serves)
//! into a database and stream of this test's own; `/metrics` is scraped over HTTP and
//! compared with `sealpost status --json` and `sealpost purge --dry-run --json` for the same
//! database, and the latency histogram's count with the events the process published. Then
//! a `sealpost consume` process applies them and its scrape shows what its inbox holds.

use crate::common;
use crate::teardown_nats;

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sealpost::runtime;
use sealpost::store;
use sealpost_core::envelope::{EventId, NewEvent};
use sealpost_nats::async_nats::jetstream;
use sealpost_nats::Nats;

/// One scraped sample: metric name, its labels, value.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// Parses the Prometheus text format (the lines that are samples).
fn parse(text: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').expect("sample line: series value");
        let (name, labels) = match series.split_once('{') {
            Some((n, rest)) => {
                let body = rest.strip_suffix('}').expect("labels end with }");
                let mut labels = BTreeMap::new();
                for kv in body.split("\",").filter(|s| !s.is_empty()) {
                    let (k, v) = kv.split_once("=\"").expect("label k=\"v\"");
                    labels.insert(k.to_string(), v.trim_end_matches('"').to_string());
                }
                (n.to_string(), labels)
            }
            None => (series.to_string(), BTreeMap::new()),
        };
        out.push(Sample {
            name,
            labels,
            value: value.parse().expect("sample value"),
        });
    }
    out
}

/// The sum of every series of `name` whose labels include `want`.
fn sum(samples: &[Sample], name: &str, want: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|s| s.name == name)
        .filter(|s| {
            want.iter()
                .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
        .sum()
}

/// Scrapes `http://addr/metrics`; waits up to 30 s for the process to start serving.
async fn scrape(addr: String) -> Vec<Sample> {
    let start = Instant::now();
    loop {
        let a = addr.clone();
        let got = tokio::task::spawn_blocking(move || {
            ureq::get(format!("http://{a}/metrics"))
                .call()
                .and_then(|mut r| r.body_mut().read_to_string())
        })
        .await
        .unwrap();
        match got {
            Ok(text) => return parse(&text),
            Err(e) => assert!(
                start.elapsed() < Duration::from_secs(30),
                "the exporter does not answer /metrics on {addr}: {e}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A loopback address with a port nobody listens on right now.
fn free_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

/// Kills the child process when dropped (a failing assertion leaves no process behind).
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn enqueue(pg: &mut tokio_postgres::Client, route: &str, payload: &[u8], n: usize) {
    let tx = pg.transaction().await.unwrap();
    for i in 0..n {
        let id = EventId(*uuid::Uuid::now_v7().as_bytes());
        let agg = format!("o-{route}-{i}-{}", runtime::owner_id());
        let ev = NewEvent {
            aggregate_type: "order",
            aggregate_id: &agg,
            aggregate_version: 1,
            event_type: "order.created.v1",
            payload_schema: "order.created.v1",
            payload,
            tenant: "t",
            occurred_at_ms: 1,
            creating_txid: 0,
        };
        store::enqueue(&tx, route, id, &ev, &agg).await.unwrap();
    }
    tx.commit().await.unwrap();
}

async fn wait_for<F: AsyncFn() -> bool>(what: &str, limit: Duration, f: F) {
    let start = Instant::now();
    while !f().await {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Runs the binary to completion and returns its standard output as JSON.
fn run_json(db_url: &str, config: &str, args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_sealpost"))
        .args(["--config", config])
        .args(args)
        .env("DATABASE_URL", db_url)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "sealpost {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatch_metrics_match_status_and_the_published_events() {
    let tag = runtime::owner_id() % 1_000_000;
    let db = format!("sealpost_metrics_{tag}");
    let cluster = format!("metrics-{tag}");
    let topic = format!("METRICS{tag}");
    // The database and the stream are dropped when the test ends, pass or fail (after the
    // processes, which are declared later).
    let test_db = common::fresh_database(&db).await;
    let db_url = test_db.database_url.clone();
    let _stream = teardown_nats::shared_stream(&topic);
    let config = std::env::temp_dir().join(format!("sealpost-metrics-{tag}.toml"));
    std::fs::write(
        &config,
        format!(
            "rejection_limit = 1\nlease_ms = 3000\nack_timeout_ms = 1000\n[nats]\ncluster = \"{cluster}\"\n"
        ),
    )
    .unwrap();
    let config = config.to_str().unwrap().to_string();

    let mut pg = runtime::pg_connect(&db_url).await.unwrap();
    store::migrate(&pg).await.unwrap();
    let nats = Nats::connect("nats://127.0.0.1:4222", &cluster, Duration::from_secs(1))
        .await
        .expect("NATS must be running");
    // A size limit, so a large payload is refused by the broker (poison).
    nats.js
        .create_stream(jetstream::stream::Config {
            name: topic.clone(),
            subjects: vec![format!("sp.{topic}.>")],
            storage: jetstream::stream::StorageType::File,
            max_message_size: 1_024,
            ..Default::default()
        })
        .await
        .expect("create stream");
    store::set_route(&pg, "orders", &cluster, &topic)
        .await
        .unwrap();
    store::set_route(&pg, "elsewhere", &format!("nobody-{tag}"), &topic)
        .await
        .unwrap();

    // One row claimed with a 1 s lease and never sent: the dispatcher's scan finds it
    // expired in SENDING and moves it to DISPATCH_UNKNOWN, where it stays (no reconciler).
    enqueue(&mut pg, "orders", b"{}", 1).await;
    let claimed = store::claim(
        &mut pg,
        &store::ClaimRequest::new(1, 1, 1_000).cluster(Some(&cluster)),
        None,
    )
    .await
    .unwrap();
    assert_eq!(claimed.outgoing.len(), 1);
    let published_n = 300usize;
    enqueue(&mut pg, "orders", b"{\"order_id\":\"o\"}", published_n).await;
    enqueue(&mut pg, "orders", &[b'x'; 4_096], 1).await; // poison
    enqueue(&mut pg, "elsewhere", b"{}", 1).await; // a cluster nobody serves: stays PENDING

    // A rollout on a route of its own whose shadow found one divergence in two messages.
    store::set_route(&pg, "rolled", &format!("nobody-{tag}"), "ROLLED")
        .await
        .unwrap();
    store::rollout(
        &mut pg,
        "rolled",
        &store::RolloutCommand::Shadow {
            candidate: "v2".into(),
            incumbent: Some("v1".into()),
        },
    )
    .await
    .unwrap();
    let cursor = store::shadow_cursor(&pg, "rolled", "v2").await.unwrap();
    let diverged = sealpost_core::rollout::Divergence {
        kind: sealpost_core::rollout::DivergenceKind::Headers,
        incumbent: "Sealpost-Tenant: a".into(),
        candidate: "Sealpost-Tenant: b".into(),
    };
    let some = claimed.outgoing[0].event_id;
    store::record_shadow(
        &mut pg,
        "rolled",
        "v2",
        &[(some, 0, Vec::new()), (some, 0, vec![diverged])],
        cursor,
        cursor,
    )
    .await
    .unwrap();

    let addr = free_addr();
    let _dispatch = Proc(
        Command::new(env!("CARGO_BIN_EXE_sealpost"))
            .args(["--config", &config, "dispatch", "--dispatchers", "2"])
            .args(["--no-reconciler", "--metrics-addr", &addr])
            .args(["--metrics-every-s", "0.5", "--metrics-purge-every-s", "0.5"])
            .args(["--metrics-replay-window-s", "0"])
            .env("DATABASE_URL", &db_url)
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for("the rows to settle", Duration::from_secs(60), async || {
        let s = store::status(&pg).await.unwrap();
        s.states["PUBLISHED"] == published_n as i64
            && s.states["QUARANTINED"] == 1
            && s.states["DISPATCH_UNKNOWN"] == 1
    })
    .await;
    // Two more status samples: the gauges now describe the settled table.
    let ok = |s: &[Sample]| sum(s, "sealpost_status_samples_total", &[("result", "ok")]);
    let settled = ok(&scrape(addr.clone()).await);
    wait_for("two more samples", Duration::from_secs(30), async || {
        ok(&scrape(addr.clone()).await) >= settled + 2.0
    })
    .await;
    let m = scrape(addr.clone()).await;
    let status = run_json(&db_url, &config, &["status", "--json"]);

    // Counts by state, unknown, quarantined: the same figures as `status --json`.
    let states = status["states"].as_object().unwrap();
    assert_eq!(states.len(), 10, "every state is listed: {states:?}");
    for (state, n) in states {
        let scraped = sum(&m, "sealpost_rows", &[("state", state)]);
        assert_eq!(scraped, n.as_f64().unwrap(), "rows in {state}");
    }
    assert_eq!(states["PUBLISHED"], published_n as i64);
    assert_eq!(states["PENDING"], 1);
    assert_eq!(
        sum(&m, "sealpost_unknown_rows", &[]),
        status["unknown"].as_f64().unwrap()
    );
    assert_eq!(status["unknown"], 1);
    assert_eq!(
        sum(&m, "sealpost_quarantined", &[]),
        status["quarantined"].as_f64().unwrap()
    );
    assert!(status["quarantined"].as_i64().unwrap() >= 1);
    assert_eq!(
        sum(&m, "sealpost_missing_at_broker", &[]),
        status["missing_at_broker"].as_f64().unwrap()
    );
    for s in ["complete", "in_progress", "blocked"] {
        assert_eq!(
            sum(&m, "sealpost_delivery_sets", &[("status", s)]),
            status["sets"][s].as_f64().unwrap(),
            "delivery sets {s}"
        );
    }
    // The shadow's figures.
    let sh = &status["rollout"]["shadows"][0];
    let labels = [("route", "rolled"), ("candidate", "v2")];
    assert_eq!(
        sum(&m, "sealpost_shadow_unexplained_divergences", &labels),
        sh["unexplained"].as_f64().unwrap()
    );
    assert_eq!(sh["unexplained"], 1);
    for result in ["matched", "diverged"] {
        let mut l = labels.to_vec();
        l.push(("result", result));
        assert_eq!(
            sum(&m, "sealpost_shadow_compared", &l),
            sh[result].as_f64().unwrap(),
            "shadow {result}"
        );
    }
    // Ages: the sample was taken before `status` ran, so it is not older than status says,
    // and it is not zero (both rows have been waiting since before the dispatcher started).
    for (gauge, field) in [
        ("sealpost_oldest_pending_age_seconds", "oldest_pending_s"),
        ("sealpost_oldest_unknown_age_seconds", "oldest_unknown_s"),
    ] {
        let scraped = sum(&m, gauge, &[]);
        let now = status[field].as_f64().unwrap();
        assert!(scraped > 0.0, "{gauge} = {scraped}");
        assert!(scraped <= now + 0.01, "{gauge} {scraped} vs status {now}");
    }

    // The latency histogram counts exactly the events this process published, all under
    // the route's destination label.
    let latency_count = sum(&m, "sealpost_publish_latency_seconds_count", &[]);
    assert_eq!(latency_count, published_n as f64);
    assert_eq!(
        sum(
            &m,
            "sealpost_publish_latency_seconds_count",
            &[("destination", &topic)]
        ),
        published_n as f64
    );
    let inf = sum(
        &m,
        "sealpost_publish_latency_seconds_bucket",
        &[("le", "+Inf")],
    );
    assert_eq!(
        inf, published_n as f64,
        "+Inf bucket holds every observation"
    );
    // The poison row: one refusal, quarantined at the limit of 1; the stalled claim: one row
    // moved to unknown; no duplicate receipts in this run.
    assert_eq!(
        sum(
            &m,
            "sealpost_send_outcomes_total",
            &[("outcome", "refused"), ("destination", &topic)]
        ),
        1.0
    );
    assert_eq!(sum(&m, "sealpost_poison_quarantined_total", &[]), 1.0);
    assert_eq!(sum(&m, "sealpost_expired_to_unknown_total", &[]), 1.0);
    assert_eq!(sum(&m, "sealpost_duplicate_receipts_total", &[]), 0.0);
    assert!(sum(&m, "sealpost_claim_batch_rows_count", &[]) >= 1.0);
    assert!(
        sum(
            &m,
            "sealpost_accept_duration_seconds_count",
            &[("result", "ok")]
        ) >= 1.0
    );

    // The purge backlog is what `purge --dry-run` decides for the same database.
    let purge = run_json(
        &db_url,
        &config,
        &[
            "purge",
            "--dry-run",
            "--json",
            "--replay-window-s",
            "0",
            "--no-consumers",
        ],
    );
    assert_eq!(purge["purged"], published_n as i64);
    assert_eq!(
        sum(&m, "sealpost_purge_eligible_rows", &[]),
        purge["purged"].as_f64().unwrap()
    );
    assert_eq!(sum(&m, "sealpost_purge_held_rows", &[]), 0.0);

    // A consumer process: what it reports applied is what its inbox holds, and its lag
    // reaches 0 once it has acked everything.
    let consumer = format!("metrics-c-{tag}");
    let caddr = free_addr();
    let _consume = Proc(
        Command::new(env!("CARGO_BIN_EXE_sealpost"))
            .args(["--config", &config, "consume", "--consumer", &consumer])
            .args(["--topic", &topic, "--metrics-addr", &caddr])
            .env("DATABASE_URL", &db_url)
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for(
        "the consumer's lag to reach 0",
        Duration::from_secs(60),
        async || {
            let m = scrape(caddr.clone()).await;
            let applied = sum(
                &m,
                "sealpost_consumer_messages_total",
                &[("consumer", &consumer), ("outcome", "applied")],
            );
            let lag = m
                .iter()
                .find(|s| s.name == "sealpost_consumer_lag_messages")
                .map(|s| s.value);
            applied == published_n as f64 && lag == Some(0.0)
        },
    )
    .await;
    let inbox: i64 = pg
        .query_one(
            "SELECT count(*) FROM sealpost.inbox WHERE consumer_id = $1",
            &[&consumer],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(inbox, published_n as i64);

    drop(_consume);
    drop(_dispatch);
    let _ = nats.js.delete_stream(&topic).await;
    drop(pg);
    let _ = std::fs::remove_file(&config);
}
