//! The dispatcher-process drills' harness (`processes.rs`, and `exclusive.rs` for the drill
//! that stops the shared NATS): a database of the drill's own, a stream, and real `sealpost
//! dispatch` processes pointed at them.
#![allow(dead_code)]

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common;
use crate::teardown_nats;

use sealpost::runtime;
use sealpost::store;
use sealpost_core::envelope::EventId;
use sealpost_core::reconcile::Lookup;
use sealpost_nats::Nats;

pub(crate) const NATS_START: &[&str] = &[
    "--start",
    "--oknodo",
    "--background",
    "--exec",
    "/usr/sbin/nats-server",
    "--",
    "-a",
    "127.0.0.1",
    "-p",
    "4222",
    "-js",
    "-sd",
    "/var/lib/nats-server",
    "-l",
    "/var/log/nats-server.log",
];

pub(crate) struct Drill {
    pg: tokio_postgres::Client,
    /// The drill's own database, written into every dispatcher process's config.
    database_url: String,
    nats: Nats,
    topic: String,
    dir: std::path::PathBuf,
    pub(crate) children: Vec<Child>,
    // Dropped after `Drop::drop` has stopped the processes and restarted NATS.
    _stream: teardown_nats::Teardown,
    _db: common::TestDb,
}

impl Drop for Drill {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        // Whatever happened, leave NATS running for the next test.
        let _ = Command::new("start-stop-daemon").args(NATS_START).status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A drill on a database of its own (`sealpost_drill_<tag>`, made afresh), which the
/// dispatcher processes are pointed at too: the machine's shared `test` database is never
/// touched (it used to be truncated here).
pub(crate) async fn drill(tag: &str, n: usize) -> Drill {
    let cfg = common::fresh_database(&format!("sealpost_drill_{tag}")).await;
    let mut pg = runtime::pg_connect(&cfg.database_url)
        .await
        .expect("PostgreSQL must be running");
    store::migrate(&pg).await.expect("migrate");
    let topic = format!("P{}{}", tag.to_uppercase(), runtime::owner_id() % 1_000_000);
    store::set_route(&pg, "orders", common::NATS_CLUSTER, &topic)
        .await
        .expect("route");
    let nats = Nats::connect(
        &common::nats_url(),
        common::NATS_CLUSTER,
        Duration::from_secs(5),
    )
    .await
    .expect("NATS");
    let stream = teardown_nats::stream(&common::nats_url(), &topic);
    nats.ensure_stream(&topic).await.expect("stream");
    let payload = vec![b'p'; 200];
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
    let dir = std::env::temp_dir().join(format!("sealpost-drill-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    Drill {
        pg,
        database_url: cfg.database_url.clone(),
        nats,
        topic,
        dir,
        children: Vec::new(),
        _stream: stream,
        _db: cfg,
    }
}

impl Drill {
    pub(crate) fn spawn(&mut self, config: &str, args: &[&str]) -> usize {
        let path = self.dir.join(format!("c{}.toml", self.children.len()));
        std::fs::write(
            &path,
            format!("database_url = \"{}\"\n{config}", self.database_url),
        )
        .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_sealpost"))
            .arg("--config")
            .arg(&path)
            .arg("dispatch")
            .args(args)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn sealpost dispatch");
        self.children.push(child);
        self.children.len() - 1
    }

    pub(crate) async fn stream_messages(&self) -> u64 {
        match self.nats.js.get_stream(&self.topic).await {
            Ok(s) => s.get_info().await.map_or(0, |i| i.state.messages),
            Err(_) => 0,
        }
    }

    pub(crate) async fn count(&self, sql: &str) -> i64 {
        self.pg.query_one(sql, &[]).await.unwrap().get(0)
    }

    pub(crate) async fn wait_published(&self, n: i64, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            let done = self
                .count("SELECT count(*) FROM sealpost.outbox WHERE state = 'PUBLISHED'")
                .await;
            if done == n {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "only {done} of {n} published before the deadline"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Every event PUBLISHED, one primary each, the stream holding each exactly once.
    pub(crate) async fn assert_exactly_once(&self, n: i64) {
        assert_eq!(
            self.count("SELECT count(*) FROM sealpost.outbox WHERE state <> 'PUBLISHED'")
                .await,
            0
        );
        assert_eq!(
            self.count("SELECT count(*) FROM sealpost.receipts WHERE kind = 'primary'")
                .await,
            n
        );
        assert_eq!(
            self.count("SELECT count(DISTINCT (event_id, member)) FROM sealpost.receipts WHERE kind = 'primary'").await,
            n
        );
        assert_eq!(
            self.count(
                "SELECT count(*) FROM sealpost.outbox e JOIN sealpost.receipts r
                   ON r.event_id = e.event_id AND r.kind = 'primary' AND r.sequence = e.primary_sequence"
            )
            .await,
            n,
            "the slot and the primary receipt row agree"
        );
        assert_eq!(
            self.stream_messages().await,
            n as u64,
            "the stream holds each event exactly once"
        );
        let sample = self
            .pg
            .query(
                "SELECT event_id FROM sealpost.outbox ORDER BY random() LIMIT 20",
                &[],
            )
            .await
            .unwrap();
        for r in sample {
            let id = EventId(*r.get::<_, uuid::Uuid>(0).as_bytes());
            assert!(
                matches!(
                    self.nats.lookup_topic(&self.topic, id, 0).await,
                    Lookup::Copies(_)
                ),
                "{id} not in the stream"
            );
        }
    }
}
