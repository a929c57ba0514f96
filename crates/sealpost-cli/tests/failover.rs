//! The broker-failover drill (issue 9, item 5): a three-node NATS JetStream cluster on
//! loopback (three private `nats-server` processes with cluster routes, each with its own
//! store directory, on free ports — never the shared 4222 server), a route whose frozen
//! durability is `file/r3` (a stream of three replicas), two `sealpost dispatch` processes
//! (one with the reconciler) connected to all three servers, and a consumer applying through
//! the inbox. Mid-run the drill freezes the **stream leader** (SIGSTOP) for longer than the
//! publish-ack timeout, so that publishes in flight to it end as unknown outcomes, kills it
//! with SIGKILL, waits for a new leader, and restarts the killed node on its store
//! directory. At the end: every event is
//! `PUBLISHED` with one primary receipt, the stream holds exactly one message per event
//! (counted per subject, the subject being per event), no row is unknown and every unknown
//! that arose was resolved, the consumer applied each event once, and the reconciliation
//! report is clean. It prints what it measured: how long the cluster took to elect a new
//! leader, how long until the dispatchers published again, how many unknowns arose and how
//! long until the last was resolved.
//!
//! The drill uses a database of its own (`sealpost_failover_<tag>`, dropped at the end) and
//! a stream of its own; the servers and their directories are removed even when it fails.

use crate::common;

use common::count;
use std::collections::{HashMap, HashSet};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use sealpost::runtime;
use sealpost::runtime::CancellationToken;
use sealpost::store;
use sealpost_nats::Nats;

const NATS_SERVER: &str = "/usr/sbin/nats-server";
/// The cluster identity frozen into this drill's destinations.
const CLUSTER: &str = "nats-failover";
const ROUTE: &str = "orders";
const NODES: usize = 3;
/// How long the stream leader is frozen before it is killed: past the dispatchers' publish
/// acknowledgement timeout (`ack_timeout_ms = 1000`).
const FROZEN: Duration = Duration::from_millis(2_500);

/// One `nats-server` of the cluster.
struct Node {
    name: String,
    port: u16,
    conf: std::path::PathBuf,
    child: Option<Child>,
}

/// Three `nats-server` processes with cluster routes to each other. Dropping it kills them
/// and removes their directory.
struct NatsCluster {
    dir: std::path::PathBuf,
    nodes: Vec<Node>,
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            if let Some(mut c) = n.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `k` free loopback ports, held open together so that they are distinct.
fn free_ports(k: usize) -> Vec<u16> {
    let held: Vec<std::net::TcpListener> = (0..k)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port"))
        .collect();
    held.iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect()
}

impl NatsCluster {
    fn start(tag: &str) -> NatsCluster {
        assert!(
            std::path::Path::new(NATS_SERVER).exists(),
            "{NATS_SERVER} is missing: install nats-server (apt-get install nats-server)"
        );
        let dir =
            std::env::temp_dir().join(format!("sealpost-failover-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let ports = free_ports(2 * NODES);
        let routes: Vec<String> = (0..NODES)
            .map(|i| format!("\"nats-route://127.0.0.1:{}\"", ports[NODES + i]))
            .collect();
        let mut nodes = Vec::new();
        for i in 0..NODES {
            let name = format!("n{i}");
            let conf = dir.join(format!("{name}.conf"));
            std::fs::write(
                &conf,
                format!(
                    r#"server_name: "{name}"
listen: "127.0.0.1:{port}"
log_file: "{log}"
jetstream {{ store_dir: "{store}" }}
cluster {{
  name: "sealpost-failover"
  listen: "127.0.0.1:{cport}"
  routes: [{routes}]
}}
"#,
                    port = ports[i],
                    cport = ports[NODES + i],
                    log = dir.join(format!("{name}.log")).display(),
                    store = dir.join(&name).display(),
                    routes = routes.join(", "),
                ),
            )
            .unwrap();
            nodes.push(Node {
                name,
                port: ports[i],
                conf,
                child: None,
            });
        }
        let mut c = NatsCluster { dir, nodes };
        for i in 0..NODES {
            c.spawn(i);
        }
        for i in 0..NODES {
            c.wait_listening(i);
        }
        c
    }

    fn spawn(&mut self, i: usize) {
        let n = &mut self.nodes[i];
        assert!(n.child.is_none(), "{} is already running", n.name);
        n.child = Some(
            Command::new(NATS_SERVER)
                .arg("-c")
                .arg(&n.conf)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn nats-server"),
        );
    }

    fn wait_listening(&self, i: usize) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", self.nodes[i].port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "{} never listened on {}; see {}",
                self.nodes[i].name,
                self.nodes[i].port,
                self.dir
                    .join(format!("{}.log", self.nodes[i].name))
                    .display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Sends `kill -SIG` to a running node.
    fn signal(&self, i: usize, sig: &str) {
        let pid = self.nodes[i].child.as_ref().expect("the node runs").id();
        let ok = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(pid.to_string())
            .status()
            .expect("run kill");
        assert!(ok.success(), "kill -{sig} {pid} failed");
    }

    /// SIGKILL (std's `Child::kill` on Unix).
    fn kill(&mut self, i: usize) {
        let mut c = self.nodes[i].child.take().expect("the node runs");
        c.kill().expect("kill -9 the node");
        c.wait().unwrap();
    }

    /// Every server, comma-separated (`nats_url` of a cluster).
    fn url(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("nats://127.0.0.1:{}", n.port))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn index_of(&self, name: &str) -> usize {
        self.nodes
            .iter()
            .position(|n| n.name == name)
            .unwrap_or_else(|| panic!("no node named {name}"))
    }
}

/// The drill's own database, dropped when the guard drops (also when the drill fails).
async fn fresh_database(tag: &str) -> (common::TestDb, tokio_postgres::Client) {
    let name = format!(
        "sealpost_failover_{tag}_{}",
        runtime::owner_id() % 1_000_000
    );
    let cfg = common::fresh_database(&name).await;
    let pg = runtime::pg_connect(&cfg.database_url).await.unwrap();
    store::migrate(&pg).await.expect("migrate");
    // The consumer's table exists from the start: the drill counts its rows while the
    // consumer may still be waiting for the cluster to answer its first subscribe.
    sealpost_cli::demo::prepare(&pg)
        .await
        .expect("the demo's tables");
    (cfg, pg)
}

/// `sealpost dispatch` processes, killed when dropped.
struct Dispatchers(Vec<Child>);

impl Drop for Dispatchers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Now on the database clock (what `published_at_ms` and `attempt_started_ms` use).
async fn db_now_ms(pg: &tokio_postgres::Client) -> i64 {
    store::db_now_ms(pg).await.unwrap() as i64
}

/// What the drill samples while it runs.
#[derive(Default)]
struct Watch {
    /// Rows seen unknown (phase 1: DISPATCH_UNKNOWN or RECONCILING) at any sample.
    unknown_rows: HashSet<uuid::Uuid>,
    /// The most rows unknown at once.
    unknown_max: usize,
    /// When a sample last saw an unknown row.
    last_unknown_at: Option<Instant>,
}

impl Watch {
    async fn sample(&mut self, pg: &tokio_postgres::Client) {
        let rows = pg
            .query("SELECT event_id FROM sealpost.work WHERE phase = 1", &[])
            .await
            .unwrap();
        if !rows.is_empty() {
            self.last_unknown_at = Some(Instant::now());
        }
        self.unknown_max = self.unknown_max.max(rows.len());
        self.unknown_rows
            .extend(rows.iter().map(|r| r.get::<_, uuid::Uuid>(0)));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_leader_killed_mid_run() {
    let n: i64 = 20_000;
    let tag = "leader";
    let mut cluster = NatsCluster::start(tag);
    let url = cluster.url();
    println!("cluster: {url}");
    let (cfg, mut pg) = fresh_database(tag).await;
    let nats = Nats::connect(&url, CLUSTER, Duration::from_secs(5))
        .await
        .expect("connect to the cluster");
    let poll = Nats::connect(&url, CLUSTER, Duration::from_millis(300))
        .await
        .expect("connect to the cluster");
    let topic = format!("FAILOVER{}", runtime::owner_id() % 1_000_000);
    // The route freezes `file/r3` into every destination; the stream is made from it. The
    // cluster elects its JetStream meta leader first: retry for a bounded time.
    store::set_route(&pg, ROUTE, CLUSTER, &topic).await.unwrap();
    store::set_route_durability(&pg, ROUTE, "file/r3")
        .await
        .unwrap()
        .expect("the route exists");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match nats.ensure_stream_for(&topic, "file/r3").await {
            Ok(()) => break,
            Err(e) => {
                assert!(Instant::now() < deadline, "no R3 stream within 60 s: {e}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
    let stream = nats.js.get_stream(&topic).await.unwrap();
    let info = stream.get_info().await.unwrap();
    assert_eq!(info.config.num_replicas, 3, "the stream has three replicas");
    let payload = vec![b'p'; 200];
    let mut i = 0;
    while i < n {
        let m = (n - i).min(2_000);
        let keys: Vec<String> = (i..i + m).map(|k| format!("o-{k}")).collect();
        let events = sealpost_cli::demo::order_batch(&keys, &payload);
        let tx = pg.transaction().await.unwrap();
        let sealed = store::enqueue_many(&tx, ROUTE, &events).await.unwrap();
        if i == 0 {
            assert_eq!(
                sealed[0].destination.durability, "file/r3",
                "the destination freezes the route's durability"
            );
        }
        tx.commit().await.unwrap();
        i += m;
    }
    println!("{n} events committed");

    // Two dispatcher processes (one with the reconciler), connected to all three servers.
    let conf = cluster.dir.join("dispatch.toml");
    std::fs::write(
        &conf,
        format!(
            "database_url = \"{}\"\n\
             lease_ms = 3000\nack_timeout_ms = 1000\nbatch_size_max = 200\nreconcile_every_ms = 500\n\
             [nats]\nurl = \"{url}\"\ncluster = \"{CLUSTER}\"\n",
            cfg.database_url
        ),
    )
    .unwrap();
    let spawn = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_sealpost"))
            .arg("--config")
            .arg(&conf)
            .arg("dispatch")
            .args(args)
            .env_remove("DATABASE_URL")
            .env_remove("NATS_URL")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn sealpost dispatch")
    };
    let dispatchers = Dispatchers(vec![spawn(&[]), spawn(&["--no-reconciler"])]);

    // A consumer applying through the inbox the whole time (restarted if it gives up).
    let stop = CancellationToken::new();
    let consumed = Arc::new(AtomicU64::new(0));
    let consumer = {
        let (cfg, nats, topic, stop, consumed) = (
            cfg.clone(),
            nats.clone(),
            topic.clone(),
            stop.clone(),
            consumed.clone(),
        );
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                let r = sealpost_cli::consumer::run(
                    cfg.clone(),
                    nats.clone(),
                    "failover-1".into(),
                    topic.clone(),
                    stop.clone(),
                    consumed.clone(),
                )
                .await;
                if let Err(e) = r {
                    println!("consumer stopped ({e}); restarting");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        })
    };

    let published = "SELECT count(*) FROM sealpost.work WHERE state = 'PUBLISHED'";
    let mut watch = Watch::default();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let p = count(&pg, published).await;
        if p >= n / 5 {
            println!("{p} published before the kill");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "only {p} of {n} published in 120 s before the kill"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Freeze the stream leader (SIGSTOP) for longer than the publish-ack timeout, so the
    // publishes in flight to it end without an answer (unknown outcomes), then kill it with
    // SIGKILL: a node that hangs and dies, the worst case for what is on the wire.
    let leader = nats
        .stream_leader(&topic)
        .await
        .expect("the R3 stream has a leader");
    let victim = cluster.index_of(&leader);
    let killed_db_ms = db_now_ms(&pg).await;
    let published_at_kill = count(&pg, published).await;
    cluster.signal(victim, "STOP");
    let killed_at = Instant::now();
    println!(
        "froze the stream leader {leader} (kill -STOP) with {published_at_kill} of {n} published"
    );
    assert!(
        published_at_kill < n,
        "the failure must land mid-run ({published_at_kill} of {n} already published)"
    );
    let frozen_until = Instant::now() + FROZEN;
    while Instant::now() < frozen_until {
        watch.sample(&pg).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cluster.kill(victim);
    println!(
        "killed {leader} (kill -9) {:.1} s later",
        FROZEN.as_secs_f64()
    );

    // A new leader, as the cluster reports it (polled with a short request timeout, so a
    // request to the dead node or the leaderless stream costs at most that).
    let deadline = Instant::now() + Duration::from_secs(60);
    let new_leader = loop {
        watch.sample(&pg).await;
        if let Some(l) = poll.stream_leader(&topic).await {
            if l != leader {
                break l;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no new stream leader within 60 s of killing {leader}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let elected_after = killed_at.elapsed();
    println!(
        "new stream leader {new_leader} seen {:.2} s after the freeze",
        elected_after.as_secs_f64()
    );

    // Restart the killed node a few seconds later on its own store: it rejoins as a follower.
    let restart_at = Instant::now() + Duration::from_secs(3);
    while Instant::now() < restart_at {
        watch.sample(&pg).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cluster.spawn(victim);
    cluster.wait_listening(victim);
    println!("restarted {leader}");

    let deadline = Instant::now() + Duration::from_secs(300);
    let mut last_print = Instant::now();
    loop {
        watch.sample(&pg).await;
        let p = count(&pg, published).await;
        if p == n {
            break;
        }
        if last_print.elapsed() > Duration::from_secs(5) {
            last_print = Instant::now();
            println!(
                "{p} of {n} published, {} unknown now, {} consumed",
                count(&pg, "SELECT count(*) FROM sealpost.work WHERE phase = 1").await,
                consumed.load(Ordering::Relaxed)
            );
        }
        assert!(
            Instant::now() < deadline,
            "only {p} of {n} published within 300 s of the restart; node logs in {}",
            cluster.dir.display()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let all_published_after = killed_at.elapsed();

    // The dispatchers' view: the first publication of an attempt started after the kill.
    let resumed_ms: Option<i64> = pg
        .query_one(
            "SELECT min(published_at_ms) - $1 FROM sealpost.work
              WHERE state = 'PUBLISHED' AND attempt_started_ms >= $1",
            &[&killed_db_ms],
        )
        .await
        .unwrap()
        .get(0);

    // Exactly once at the outbox.
    assert_eq!(
        count(
            &pg,
            "SELECT count(*) FROM sealpost.work WHERE state <> 'PUBLISHED'"
        )
        .await,
        0,
        "every event PUBLISHED"
    );
    assert_eq!(
        count(
            &pg,
            "SELECT count(*) FROM sealpost.work WHERE state = 'DISPATCH_UNKNOWN'"
        )
        .await,
        0,
        "no unknown left"
    );
    assert_eq!(
        count(
            &pg,
            "SELECT count(*) FROM sealpost.receipts WHERE kind = 'primary'"
        )
        .await,
        n,
        "one primary receipt per event"
    );
    assert_eq!(
        count(
            &pg,
            "SELECT count(DISTINCT (event_id, member)) FROM sealpost.receipts WHERE kind = 'primary'"
        )
        .await,
        n
    );
    assert_eq!(
        count(
            &pg,
            "SELECT count(*) FROM sealpost.receipts WHERE kind = 'second_copy'"
        )
        .await,
        0,
        "no second copy recorded"
    );

    // Exactly once in the stream: one message per event subject, on the new leader.
    let info = stream
        .get_info()
        .await
        .expect("stream info after the failover");
    assert_eq!(
        info.state.messages, n as u64,
        "the stream holds one message per event"
    );
    let mut per_subject: HashMap<String, usize> = HashMap::new();
    let mut subjects = stream
        .info_with_subjects(format!("sp.{topic}.>"))
        .await
        .expect("stream subjects");
    while let Some(s) = subjects.next().await {
        let (subject, messages) = s.expect("a page of stream subjects");
        per_subject.insert(subject, messages);
    }
    assert_eq!(per_subject.len(), n as usize, "one subject per event");
    let stored_twice: Vec<_> = per_subject.iter().filter(|(_, &c)| c != 1).collect();
    assert!(stored_twice.is_empty(), "stored twice: {stored_twice:?}");
    let ids = pg
        .query("SELECT event_id FROM sealpost.work", &[])
        .await
        .unwrap();
    for r in &ids {
        let id = sealpost_core::envelope::EventId(*r.get::<_, uuid::Uuid>(0).as_bytes());
        assert!(
            per_subject.contains_key(&sealpost_nats::subject(&topic, id, 0)),
            "{id} is not in the stream"
        );
    }

    // The consumer applies every event once.
    let deadline = Instant::now() + Duration::from_secs(180);
    let (applied, distinct) = loop {
        let r = pg
            .query_one(
                "SELECT count(*), count(DISTINCT event_id) FROM demo_fulfilment WHERE consumer_id = 'failover-1'",
                &[],
            )
            .await
            .unwrap();
        let (applied, distinct): (i64, i64) = (r.get(0), r.get(1));
        if distinct == n {
            break (applied, distinct);
        }
        assert!(
            Instant::now() < deadline,
            "the consumer applied {distinct} of {n} events within 180 s"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(10), consumer).await;
    assert_eq!(applied, n, "each event applied once, no twice");
    assert_eq!(distinct, n);

    // The reconciliation report: committed = published = consumed = stream, no finding.
    let report = sealpost_cli::ops::reconcile(
        &pg,
        Some(&nats),
        &sealpost_cli::ops::ReconcileOptions {
            pending_age_s: 60,
            unconsumed_age_s: 300,
            unknown_age_s: 900,
            consumers: vec!["failover-1".into()],
            streams: vec![topic.clone()],
            scan_max: 1_000_000,
        },
    )
    .await
    .expect("reconcile");
    assert_eq!(report.committed, n);
    assert_eq!(report.published, n);
    assert!(
        report.findings.is_empty(),
        "reconcile findings: {:?}",
        report.findings
    );

    // The restarted node caught up: every replica current (bounded wait).
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let info = stream.get_info().await.unwrap();
        let replicas = info.cluster.as_ref().map_or(&[][..], |c| &c.replicas[..]);
        if replicas.len() == NODES - 1 && replicas.iter().all(|r| r.current && !r.offline) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the replicas did not catch up within 60 s: {replicas:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    let found_by_lookup = count(
        &pg,
        "SELECT count(*) FROM sealpost.receipts WHERE kind = 'primary' AND source = 'lookup'",
    )
    .await;
    let sent_again = count(
        &pg,
        "SELECT count(*) FROM (SELECT event_id FROM sealpost.attempts GROUP BY event_id, member HAVING count(*) > 1) x",
    )
    .await;
    // Every unknown ended one of two ways: found by a lookup, or looked up absent and sent
    // again (to the same destination, with the same event id).
    let unknown_ids: Vec<uuid::Uuid> = watch.unknown_rows.iter().copied().collect();
    let unknown_found: i64 = pg
        .query_one(
            "SELECT count(*) FROM sealpost.receipts
              WHERE kind = 'primary' AND source = 'lookup' AND event_id = ANY($1)",
            &[&unknown_ids],
        )
        .await
        .unwrap()
        .get(0);
    let unknown_sent_again: i64 = pg
        .query_one(
            "SELECT count(*) FROM (SELECT event_id FROM sealpost.attempts WHERE event_id = ANY($1)
                GROUP BY event_id, member HAVING count(*) > 1) x",
            &[&unknown_ids],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        unknown_found + unknown_sent_again,
        unknown_ids.len() as i64,
        "each unknown was found by a lookup or sent again after an absent lookup"
    );
    let broker_duplicates = count(
        &pg,
        "SELECT count(*) FROM sealpost.receipts WHERE broker_duplicate",
    )
    .await;
    let resolved_after = watch
        .last_unknown_at
        .map(|t| t.saturating_duration_since(killed_at));
    println!(
        "failover: leader {leader} frozen then killed at {published_at_kill}/{n} published; new leader {new_leader} {:.2} s after the freeze; \
         dispatchers published again {} ms after the freeze; all {n} published {:.1} s after the freeze",
        elected_after.as_secs_f64(),
        resumed_ms.map_or("(none)".to_string(), |m| m.to_string()),
        all_published_after.as_secs_f64(),
    );
    println!(
        "unknowns: {} rows seen unknown (at most {} at once), the last resolved {} after the freeze \
         ({unknown_found} found by lookup, {unknown_sent_again} absent and sent again); \
         {found_by_lookup} primaries found by lookup, {sent_again} rows sent more than once, \
         {broker_duplicates} answered as duplicates by the broker; \
         stream {} messages over {} subjects; consumer applied {applied}",
        watch.unknown_rows.len(),
        watch.unknown_max,
        resolved_after.map_or("(none arose)".to_string(), |d| format!(
            "{:.1} s",
            d.as_secs_f64()
        )),
        info.state.messages,
        per_subject.len(),
    );
    drop(dispatchers);
    drop(nats);
    drop(poll);
    drop(pg);
}
