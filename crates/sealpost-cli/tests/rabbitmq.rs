//! Drills with real `sealpost dispatch --broker rabbitmq` and `sealpost consume --broker
//! rabbitmq` processes against the real PostgreSQL and RabbitMQ: a dispatcher killed with
//! SIGKILL between send and receipt (the unknown path: the broker cannot be asked, so every
//! event is sent again to the same exchange and the consumers apply each once), an unroutable
//! message refused until it is quarantined, four dispatcher processes over 50,000 events
//! with the dispatchers' broker connections closed by the broker mid-run, and three
//! dispatchers killed and frozen at random over 20,000 events. Every test has its own
//! database, exchange and queues, removed at the end.

use crate::chaos;
use crate::common;
use crate::teardown_rabbitmq;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sealpost::runtime;
use sealpost::store;
use sealpost_rabbitmq::lapin::options::QueueDeclareOptions;
use sealpost_rabbitmq::lapin::types::FieldTable;
use sealpost_rabbitmq::{queue_name, Rabbit};

struct Drill {
    cfg: common::TestDb,
    pg: tokio_postgres::Client,
    topic: String,
    consumers: Vec<String>,
    dir: std::path::PathBuf,
    children: Vec<Child>,
    /// Destinations have a lookup stream and the processes ask it (`[rabbitmq.lookup]`).
    lookup: bool,
    /// The exchange and queues; like `cfg` (the database), removed after `Drop::drop` has
    /// stopped the processes.
    _destination: teardown_rabbitmq::Teardown,
}

impl Drop for Drill {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        // Then the fields: the exchange and queues, and the database (also when the test
        // failed).
    }
}

/// The lookup stream of the drills that ask it: the scan starts half a second before an
/// event's mint time (one machine, one clock).
const LOOKUP: &str = "[rabbitmq.lookup]\nenabled = true\nclock_margin_ms = 500\n";

async fn drill(tag: &str, n: usize, consumers: &[&str], bind: bool, lookup: bool) -> Drill {
    let r = runtime::owner_id() % 1_000_000_000;
    let db = format!("sealpost_rabbitmq_{tag}_{r}");
    let cfg = common::fresh_database(&db).await;
    let mut pg = runtime::pg_connect(&cfg.database_url).await.unwrap();
    store::migrate(&pg).await.expect("migrate");
    sealpost_cli::demo::prepare(&pg).await.unwrap();
    let topic = format!("sp-drill-{tag}-{r}");
    store::set_route(&pg, "orders", common::RABBITMQ_CLUSTER, &topic)
        .await
        .expect("route");
    let rabbit = Rabbit::connect(
        &common::rabbitmq_url(),
        common::RABBITMQ_CLUSTER,
        Duration::from_secs(5),
        &format!("sealpost-test-{tag}-{r}"),
    )
    .await
    .expect("RabbitMQ must be running at 127.0.0.1:5672 (guest/guest)")
    .with_lookup_stream(sealpost_rabbitmq::LookupStream {
        enabled: lookup,
        ..Default::default()
    });
    let consumers: Vec<String> = consumers.iter().map(|c| c.to_string()).collect();
    let bound = if bind { consumers.clone() } else { Vec::new() };
    // Every consumer's queue: `sealpost consume` declares an unbound one's too.
    let destination = teardown_rabbitmq::destination(&common::rabbitmq_url(), &topic, &consumers);
    rabbit.ensure_destination(&topic, &bound).await.unwrap();
    if lookup {
        // Events minted from now on lie inside the stream's reach with the drill's margin.
        tokio::time::sleep(Duration::from_millis(600)).await;
    }
    let payload = br#"{"order_id":"x","total_cents":1}"#.to_vec();
    let mut i = 0;
    while i < n {
        let m = (n - i).min(2_000);
        let keys: Vec<String> = (i..i + m).map(|k| format!("o-{k}")).collect();
        let events = sealpost_cli::demo::order_batch(&keys, &payload);
        let tx = pg.transaction().await.unwrap();
        store::enqueue_many(&tx, "orders", &events).await.unwrap();
        tx.commit().await.unwrap();
        i += m;
    }
    let dir = std::env::temp_dir().join(format!("sealpost-rabbitmq-{tag}-{r}"));
    std::fs::create_dir_all(&dir).unwrap();
    Drill {
        cfg,
        pg,
        topic,
        consumers,
        dir,
        children: Vec::new(),
        lookup,
        _destination: destination,
    }
}

impl Drill {
    /// Starts `sealpost <args>` with this drill's database, RabbitMQ and `extra` config.
    fn spawn(&mut self, extra: &str, args: &[&str]) -> usize {
        let path = self.dir.join(format!("c{}.toml", self.children.len()));
        let config = format!(
            "database_url = \"{}\"\nbroker = \"rabbitmq\"\n{extra}\n[rabbitmq]\nurl = \"{}\"\n{}",
            self.cfg.database_url,
            common::rabbitmq_url(),
            if self.lookup { LOOKUP } else { "" }
        );
        std::fs::write(&path, config).unwrap();
        let log = match args[0] {
            "consume" => std::fs::File::create(self.dir.join(format!(
                "{}-{}.log",
                args[0],
                self.children.len()
            )))
            .map_or_else(|_| Stdio::null(), Stdio::from),
            _ => Stdio::null(),
        };
        let child = Command::new(env!("CARGO_BIN_EXE_sealpost"))
            .arg("--config")
            .arg(&path)
            .args(args)
            // Consumers log to a file the chaos drill prints when it fails.
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn sealpost");
        self.children.push(child);
        self.children.len() - 1
    }

    fn consume(&mut self) {
        for c in self.consumers.clone() {
            let topic = self.topic.clone();
            self.spawn(
                "",
                &[
                    "consume",
                    "--consumer",
                    &c,
                    "--topic",
                    &topic,
                    "--broker",
                    "rabbitmq",
                ],
            );
        }
    }

    async fn count(&self, sql: &str) -> i64 {
        match self.pg.query_one(sql, &[]).await {
            Ok(r) => r.get(0),
            Err(e) => panic!("{sql}: {e}"),
        }
    }

    /// Messages ready in `consumer`'s queue.
    async fn ready(&self, consumer: &str) -> u32 {
        let conn = sealpost_rabbitmq::lapin::Connection::connect(
            &common::rabbitmq_url(),
            Default::default(),
        )
        .await
        .unwrap();
        let ch = conn.create_channel().await.unwrap();
        let q = ch
            .queue_declare(
                queue_name(&self.topic, consumer).as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        let _ = conn.close(200, "done".into()).await;
        q.message_count()
    }

    async fn wait_for(&self, what: &str, sql: &str, n: i64, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            let got = self.count(sql).await;
            if got == n {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: {got} of {n} before the deadline"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Every event PUBLISHED with one primary; every consumer applied each event once.
    async fn assert_published_and_applied_once(&self, n: i64) {
        self.wait_for(
            "published",
            "SELECT count(*) FROM sealpost.outbox WHERE state = 'PUBLISHED'",
            n,
            Duration::from_secs(300),
        )
        .await;
        assert_eq!(
            self.count("SELECT count(*) FROM sealpost.outbox WHERE state <> 'PUBLISHED'")
                .await,
            0
        );
        for c in &self.consumers {
            self.wait_for(
                &format!("consumer {c} applied"),
                &format!("SELECT count(DISTINCT event_id) FROM demo_fulfilment WHERE consumer_id = '{c}'"),
                n,
                Duration::from_secs(300),
            )
            .await;
            assert_eq!(
                self.count(&format!(
                    "SELECT count(*) FROM demo_fulfilment WHERE consumer_id = '{c}'"
                ))
                .await,
                n,
                "consumer {c} applied every event exactly once"
            );
        }
    }

    /// Stops the processes and removes the exchange, the queues and the database (what
    /// `Drop` does when a test fails before this).
    async fn finish(self) {
        drop(self);
    }
}

#[tokio::test]
async fn dispatcher_killed_between_send_and_receipt_retries_to_the_same_exchange() {
    let n = 300;
    let mut d = drill("kill", n, &["c1", "c2"], true, false).await;
    // Dispatcher A publishes (confirmed), then sits before its receipt transaction.
    let a = d.spawn(
        "lease_ms = 2000\nack_timeout_ms = 1000\ndrill_pause_after_publish_ms = 600000\n",
        &["dispatch", "--no-reconciler", "--broker", "rabbitmq"],
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while d.ready("c1").await < n as u32 {
        assert!(Instant::now() < deadline, "dispatcher A never published");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(d.count("SELECT count(*) FROM sealpost.receipts").await, 0);
    d.children[a].kill().unwrap();
    d.children[a].wait().unwrap();
    // B's reconciler finds the rows unknown once A's lease ends; RabbitMQ cannot be asked,
    // so each is sent again to the same exchange under the same event id. B's own lease is
    // long: under a loaded machine a 2 s lease can run out while B's resend waits for its
    // confirm, and B would then count a third attempt for the same event (seen with four
    // tests at a time on 2 cores).
    d.spawn(
        "lease_ms = 30000\nack_timeout_ms = 5000\n",
        &["dispatch", "--broker", "rabbitmq"],
    );
    d.wait_for(
        "published",
        "SELECT count(*) FROM sealpost.outbox WHERE state = 'PUBLISHED'",
        n as i64,
        Duration::from_secs(120),
    )
    .await;
    assert_eq!(
        d.count("SELECT count(*) FROM sealpost.attempts").await,
        2 * n as i64,
        "one retry per event, nothing more"
    );
    assert_eq!(
        d.ready("c1").await,
        2 * n as u32,
        "the queue (bound only to this test's exchange, the frozen destination) holds both copies of each event"
    );
    // The consumers see both copies and apply each event once.
    d.consume();
    d.assert_published_and_applied_once(n as i64).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while d.ready("c1").await + d.ready("c2").await > 0 {
        assert!(
            Instant::now() < deadline,
            "the second copies were never acked"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        d.count("SELECT count(*) FROM sealpost.inbox").await,
        2 * n as i64,
        "one consumption receipt per event and consumer"
    );
    // The reconciliation report: clean, with the second copies counted as evidence.
    let opts = sealpost_cli::ops::ReconcileOptions {
        pending_age_s: 60,
        unconsumed_age_s: 0,
        unknown_age_s: 900,
        consumers: d.consumers.clone(),
        streams: Vec::new(),
        scan_max: 0,
    };
    let report = sealpost_cli::ops::reconcile(&d.pg, None::<&sealpost::ops::NoScan>, &opts)
        .await
        .unwrap();
    assert!(report.findings.is_empty(), "{:?}", report.findings);
    assert_eq!(report.resent_after_unknown, n as i64);
    assert_eq!(
        report.consumed.values().copied().collect::<Vec<_>>(),
        [n as i64, n as i64]
    );
    d.finish().await;
}

/// The same kill with the lookup stream (issue 25, item 2): the reconciler asks the stream
/// instead of sending again, so each unknown event is found and accepted as it is: one
/// attempt and one copy per event, nothing resent.
#[tokio::test]
async fn dispatcher_killed_between_send_and_receipt_is_resolved_by_the_lookup_stream() {
    let n = 300;
    let mut d = drill("killlookup", n, &["c1", "c2"], true, true).await;
    let a = d.spawn(
        "lease_ms = 2000\nack_timeout_ms = 1000\ndrill_pause_after_publish_ms = 600000\n",
        &["dispatch", "--no-reconciler", "--broker", "rabbitmq"],
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while d.ready("c1").await < n as u32 {
        assert!(Instant::now() < deadline, "dispatcher A never published");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(d.count("SELECT count(*) FROM sealpost.receipts").await, 0);
    d.children[a].kill().unwrap();
    d.children[a].wait().unwrap();
    let killed = Instant::now();
    d.spawn(
        "lease_ms = 2000\nack_timeout_ms = 1000\n",
        &["dispatch", "--broker", "rabbitmq"],
    );
    d.wait_for(
        "published",
        "SELECT count(*) FROM sealpost.outbox WHERE state = 'PUBLISHED'",
        n as i64,
        Duration::from_secs(120),
    )
    .await;
    eprintln!(
        "{n} unknown events found in the lookup stream and published {:.1} s after the kill (the lease is 2 s)",
        killed.elapsed().as_secs_f64()
    );
    assert_eq!(
        d.count("SELECT count(*) FROM sealpost.attempts").await,
        n as i64,
        "every unknown event was found in the stream: no second attempt"
    );
    assert_eq!(
        d.ready("c1").await,
        n as u32,
        "one copy of each event at the broker"
    );
    d.consume();
    d.assert_published_and_applied_once(n as i64).await;
    let opts = sealpost_cli::ops::ReconcileOptions {
        pending_age_s: 60,
        unconsumed_age_s: 0,
        unknown_age_s: 900,
        consumers: d.consumers.clone(),
        streams: Vec::new(),
        scan_max: 0,
    };
    let report = sealpost_cli::ops::reconcile(&d.pg, None::<&sealpost::ops::NoScan>, &opts)
        .await
        .unwrap();
    assert!(report.findings.is_empty(), "{:?}", report.findings);
    assert_eq!(report.resent_after_unknown, 0, "nothing was sent twice");
    d.finish().await;
}

#[tokio::test]
async fn an_unroutable_event_is_refused_until_it_is_quarantined() {
    let n = 5;
    // The exchange exists; no queue is bound to it.
    let mut d = drill("noroute", n, &[], false, false).await;
    d.spawn(
        "rejection_limit = 2\nidle_poll_ms = 20\n",
        &["dispatch", "--broker", "rabbitmq"],
    );
    d.wait_for(
        "quarantined",
        "SELECT count(*) FROM sealpost.outbox WHERE state = 'QUARANTINED'",
        n as i64,
        Duration::from_secs(120),
    )
    .await;
    assert_eq!(
        d.count("SELECT count(*) FROM sealpost.outbox WHERE state = 'PUBLISHED'")
            .await,
        0,
        "a returned message is never a success"
    );
    let s = store::status(&d.pg).await.unwrap();
    assert_eq!(s.quarantined_rows.len(), n);
    assert!(
        s.quarantined_rows
            .iter()
            .all(|(_, why)| why.contains("NO_ROUTE")),
        "the broker's words are kept: {:?}",
        s.quarantined_rows
    );
    d.finish().await;
}

/// Closes, at the broker, every connection whose name starts with `prefix`; returns how many.
fn close_connections(prefix: &str) -> usize {
    let out = Command::new("rabbitmqctl")
        .args(["-q", "list_connections", "pid", "client_properties"])
        .output()
        .expect("rabbitmqctl");
    let text = String::from_utf8_lossy(&out.stdout);
    let mut closed = 0;
    for line in text.lines() {
        if !line.contains(&format!("\"{prefix}")) {
            continue;
        }
        let Some(pid) = line.split_whitespace().next() else {
            continue;
        };
        let ok = Command::new("rabbitmqctl")
            .args(["-q", "close_connection", pid, "sealpost drill"])
            .status()
            .is_ok_and(|s| s.success());
        closed += usize::from(ok);
    }
    closed
}

#[tokio::test]
async fn four_dispatcher_processes_over_50k_events_with_connections_closed_mid_run() {
    let n = 50_000;
    let mut d = drill("four", n, &["c1", "c2"], true, false).await;
    d.consume();
    let cfg = "batch_size_max = 1000\n";
    d.spawn(cfg, &["dispatch", "--broker", "rabbitmq"]);
    for _ in 0..3 {
        d.spawn(
            cfg,
            &["dispatch", "--no-reconciler", "--broker", "rabbitmq"],
        );
    }
    let pids: Vec<u32> = d.children[2..].iter().map(Child::id).collect();
    // Mid-run, the broker closes the dispatchers' connections (only this test's processes).
    let deadline = Instant::now() + Duration::from_secs(120);
    while d
        .count("SELECT count(*) FROM sealpost.outbox WHERE state = 'PUBLISHED'")
        .await
        < (n / 4) as i64
    {
        assert!(Instant::now() < deadline, "no progress");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let closed: usize = pids
        .iter()
        .map(|p| close_connections(&format!("sealpost-dispatch-{p}")))
        .sum();
    assert!(closed >= 1, "no dispatcher connection found to close");
    d.assert_published_and_applied_once(n as i64).await;
    let owners = d
        .count("SELECT count(DISTINCT owner) FROM sealpost.attempts")
        .await;
    assert!(owners >= 2, "the work was shared ({owners} owner(s))");
    println!(
        "closed {closed} connection(s); attempts {} for {n} events; second copies recorded {}",
        d.count("SELECT count(*) FROM sealpost.attempts").await,
        d.count("SELECT count(*) FROM sealpost.receipts WHERE kind = 'second_copy'")
            .await
    );
    d.finish().await;
}

/// Seed 000's chaos (issue 25), as `kafka.rs` runs it on Kafka: one steady dispatcher with the
/// reconciler and three more dispatcher processes that are, at random for 30 s (a fault every
/// 0.2 to 1 s), killed with SIGKILL and started again (two faults in three) or frozen with
/// SIGSTOP for up to 8 s (past their 3 s lease), over 20,000 events with two consumers, while
/// producers commit 100 more at each fault. After the faults stop it converges within
/// 2 minutes: every event `PUBLISHED`, each consumer applied each event once, no unknown
/// left, nothing quarantined. RabbitMQ cannot be asked, so every unknown outcome is sent
/// again to the same exchange (R14); the copies that makes are printed with the figures, and
/// the inboxes apply each event once. The random choices come from a seed printed at the
/// start.
#[tokio::test]
async fn killed_and_frozen_dispatchers_converge_within_two_minutes_after_the_faults() {
    let n = 20_000;
    let mut d = drill("chaos", n, &["c1", "c2"], true, false).await;
    d.consume();
    let cfg = "batch_size_max = 200\nlease_ms = 3000\nack_timeout_ms = 1000\n";
    d.spawn(cfg, &["dispatch", "--broker", "rabbitmq"]);
    let mut victims: Vec<usize> = (0..3)
        .map(|_| {
            d.spawn(
                cfg,
                &["dispatch", "--no-reconciler", "--broker", "rabbitmq"],
            )
        })
        .collect();
    let seed = runtime::owner_id();
    eprintln!("chaos seed {seed}");
    let mut target = ChaosTarget { d: &mut d, cfg };
    let r = chaos::run(&mut target, &mut victims, seed, Duration::from_secs(30)).await;
    let consumers = d.consumers.clone();
    let all =
        chaos::converged_after(&ChaosTarget { d: &mut d, cfg }, &r, n as i64, &consumers).await;
    d.assert_published_and_applied_once(all).await;
    eprintln!(
        "attempts {} for {all} events; second copies recorded {}",
        d.count("SELECT count(*) FROM sealpost.attempts").await,
        d.count("SELECT count(*) FROM sealpost.receipts WHERE kind = 'second_copy'")
            .await
    );
    d.finish().await;
}

/// The RabbitMQ drill's dispatchers under chaos.
struct ChaosTarget<'a> {
    d: &'a mut Drill,
    cfg: &'static str,
}

impl chaos::Target for ChaosTarget<'_> {
    fn child(&mut self, i: usize) -> &mut Child {
        &mut self.d.children[i]
    }

    fn respawn(&mut self) -> usize {
        self.d.spawn(
            self.cfg,
            &["dispatch", "--no-reconciler", "--broker", "rabbitmq"],
        )
    }

    async fn count(&self, sql: &str) -> i64 {
        self.d.count(sql).await
    }

    async fn text(&self, sql: &str) -> String {
        match self.d.pg.query_one(sql, &[]).await {
            Ok(r) => r.get::<_, Option<String>>(0).unwrap_or_default(),
            Err(e) => format!("{sql}: {e}"),
        }
    }

    fn consumer_logs(&self) -> String {
        chaos::tails(&self.d.dir, "consume", 40)
    }

    fn pg(&mut self) -> &mut tokio_postgres::Client {
        &mut self.d.pg
    }
}
