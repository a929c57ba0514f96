//! The CDC publisher (R32, `sealpost::cdc`) against a private PostgreSQL cluster with
//! `wal_level = logical` (the machine's shared server is not reconfigured) and the machine's
//! NATS JetStream: events committed before and while it runs are published once, through the
//! log; the slot's confirmed position never passes an unsettled row, also while the broker
//! refuses everything and the window is full; a publisher stopped without a word (its task
//! aborted mid-stream) restarts from the slot and loses nothing; a dropped slot hands the
//! work to scans of the claim index, and the next start creates the slot again; CDC and a
//! polling dispatcher together store each event once.

use crate::cluster;
use crate::common;
use crate::teardown_nats;

use std::sync::Arc;
use std::time::Duration;

use cluster::Cluster;
use common::{count, wait_for};
use sealpost::runtime::{self, CancellationToken, Config, Counters, RunError};
use sealpost::store;
use sealpost_core::cdc::parse_lsn;
use sealpost_core::envelope::{EventId, NewEvent};
use sealpost_nats::Nats;

/// A private cluster that writes a logical log, with the outbox schema in `postgres`.
async fn logical_cluster(tag: &str) -> Option<(Cluster, Config, tokio_postgres::Client)> {
    let c = Cluster::start(
        &format!("cdc-{tag}"),
        "wal_level = logical\nmax_replication_slots = 8\nmax_wal_senders = 8\nwal_sender_timeout = 10s\n",
        &[],
    )?;
    let cfg = Config {
        database_url: c.url("postgres"),
        lease_ms: 5_000,
        ack_timeout_ms: 2_000,
        error_backoff_ms: 100,
        error_backoff_max_ms: 1_000,
        ..Config::default()
    };
    let pg = runtime::pg_connect(&cfg.database_url).await.unwrap();
    store::migrate(&pg).await.expect("migrate");
    Some((c, cfg, pg))
}

fn topic(tag: &str) -> String {
    format!(
        "CDC{}{}",
        tag.to_uppercase(),
        runtime::owner_id() % 1_000_000
    )
}

async fn nats(cfg: &Config) -> Nats {
    Nats::connect(
        &common::nats_url(),
        common::NATS_CLUSTER,
        Duration::from_millis(cfg.ack_timeout_ms),
    )
    .await
    .expect("NATS must be running")
}

/// `txns` transactions of `per` events each on `route`.
async fn enqueue(
    pg: &mut tokio_postgres::Client,
    route: &str,
    txns: usize,
    per: usize,
) -> Vec<EventId> {
    let mut ids = Vec::new();
    for t in 0..txns {
        let tx = pg.transaction().await.unwrap();
        for i in 0..per {
            let id = EventId(*uuid::Uuid::now_v7().as_bytes());
            let agg = format!("o-{t}-{i}-{}", runtime::owner_id());
            let ev = NewEvent {
                aggregate_type: "order",
                aggregate_id: &agg,
                aggregate_version: 1,
                event_type: "order.created.v1",
                payload_schema: "order.created.v1",
                payload: b"{}",
                tenant: "t",
                occurred_at_ms: 1,
                creating_txid: 0,
            };
            store::enqueue(&tx, route, id, &ev, &agg).await.unwrap();
            ids.push(id);
        }
        tx.commit().await.unwrap();
    }
    ids
}

async fn published(pg: &tokio_postgres::Client) -> i64 {
    count(
        pg,
        "SELECT count(*) FROM sealpost.work WHERE state = 'PUBLISHED'",
    )
    .await
}

async fn stream_messages(n: &Nats, topic: &str) -> u64 {
    let mut s = n.js.get_stream(topic).await.expect("stream");
    s.info().await.expect("info").state.messages
}

/// The slot's confirmed position and the server's current log position.
async fn slot_position(pg: &tokio_postgres::Client, slot: &str) -> (u64, u64) {
    let r = pg
        .query_one(
            "SELECT coalesce(confirmed_flush_lsn::text, '0/0'), pg_current_wal_lsn()::text
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap();
    (
        parse_lsn(r.get::<_, &str>(0)).unwrap(),
        parse_lsn(r.get::<_, &str>(1)).unwrap(),
    )
}

struct Running {
    stop: CancellationToken,
    counters: Arc<Counters>,
    tasks: Vec<tokio::task::JoinHandle<Result<(), RunError>>>,
}

impl Running {
    async fn stop(self) {
        self.stop.cancel();
        for t in self.tasks {
            t.await.unwrap().unwrap();
        }
    }

    /// Stops without a word: the tasks are dropped where they are (rows in flight stay
    /// `SENDING` until their lease runs out), as a killed process leaves them.
    async fn abort(self) {
        for t in &self.tasks {
            t.abort();
        }
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

/// A CDC publisher and a reconciler, and `polling` polling dispatchers beside them.
fn run(cfg: &Config, n: &Nats, polling: usize) -> Running {
    let stop = CancellationToken::new();
    let counters = Arc::new(Counters::default());
    let db = common::pg_source(cfg);
    let broker = Arc::new(n.clone());
    let mut tasks = runtime::spawn_fleet(cfg, &db, &broker, polling, true, &stop, &counters);
    tasks.push(tokio::spawn(sealpost::cdc::publisher(
        cfg.clone(),
        db,
        broker,
        stop.clone(),
        counters.clone(),
    )));
    Running {
        stop,
        counters,
        tasks,
    }
}

fn slot_name() -> String {
    Config::default().cdc.names(common::NATS_CLUSTER).slot
}

/// How every drill ends (issue 22): two `sealpost consume` consumers read the topic `t` on
/// the machine's NATS from its start, each applies every one of the `n` events once (the
/// demo's effect table), and `sealpost reconcile` finds nothing (exit 0).
async fn consumed_once_and_reconciled(
    pg: &tokio_postgres::Client,
    dir: &std::path::Path,
    database_url: &str,
    t: &str,
    n: i64,
) {
    sealpost_cli::demo::prepare(pg).await.unwrap();
    let config = dir.join(format!("end-{t}.toml"));
    std::fs::write(
        &config,
        format!(
            "database_url = \"{database_url}\"\n[nats]\nurl = \"{}\"\ncluster = \"{}\"\n",
            common::nats_url(),
            common::NATS_CLUSTER
        ),
    )
    .unwrap();
    let mut consumers = Vec::new();
    for cid in ["c1", "c2"] {
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_sealpost"))
            .arg("--config")
            .arg(&config)
            .args(["consume", "--consumer", cid, "--topic", t])
            .env("RUST_LOG", "error")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn sealpost consume");
        consumers.push(KillOnDrop(child));
    }
    for cid in ["c1", "c2"] {
        applied_once(pg, cid, n, Duration::from_secs(60)).await;
    }
    drop(consumers);
    reconcile_clean(&config, t);
}

/// Waits until consumer `cid` applied `n` events (the demo's effect table), then asserts it
/// applied each once.
async fn applied_once(pg: &tokio_postgres::Client, cid: &str, n: i64, limit: Duration) {
    wait_for(&format!("consumer {cid}"), limit, async || {
        count(
            pg,
            &format!(
                "SELECT count(DISTINCT event_id) FROM demo_fulfilment WHERE consumer_id = '{cid}'"
            ),
        )
        .await
            == n
    })
    .await;
    assert_eq!(
        count(
            pg,
            &format!("SELECT count(*) FROM demo_fulfilment WHERE consumer_id = '{cid}'")
        )
        .await,
        n,
        "consumer {cid} applied each event once"
    );
}

/// `sealpost reconcile` with the config file at `config`, scanning the drill's stream `t`
/// (not the default `ORDERS`, which other runs on the shared NATS fill), exits 0: nothing
/// found.
fn reconcile_clean(config: &std::path::Path, t: &str) {
    let reconcile = std::process::Command::new(env!("CARGO_BIN_EXE_sealpost"))
        .arg("--config")
        .arg(config)
        .args(["reconcile", "--stream", t])
        .output()
        .unwrap();
    assert!(
        reconcile.status.success(),
        "sealpost reconcile found something: {}{}",
        String::from_utf8_lossy(&reconcile.stdout),
        String::from_utf8_lossy(&reconcile.stderr)
    );
}

/// A child process killed when dropped (also when the test fails).
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_committed_before_and_during_cdc_are_published_once_and_the_slot_advances() {
    let Some((c, mut cfg, mut pg)) = logical_cluster("once").await else {
        return;
    };
    // Scans at the start (the events committed before the slot existed), then the log, and
    // a scan every three seconds (a send that went unknown and is handed back by the
    // reconciler after the slot confirmed it is found by a scan: on a loaded machine that
    // happens).
    cfg.cdc.sweep_every_ms = 3_000;
    let n = nats(&cfg).await;
    let t = topic("once");
    let _stream = teardown_nats::stream(&common::nats_url(), &t);
    n.ensure_stream(&t).await.unwrap();
    store::set_route(&pg, "orders", common::NATS_CLUSTER, &t)
        .await
        .unwrap();
    let before = enqueue(&mut pg, "orders", 5, 40).await;
    let r = run(&cfg, &n, 0);
    wait_for("the backlog", Duration::from_secs(30), async || {
        published(&pg).await == before.len() as i64
    })
    .await;
    let during = enqueue(&mut pg, "orders", 60, 10).await;
    let total = (before.len() + during.len()) as i64;
    wait_for(
        "the events committed while running",
        Duration::from_secs(30),
        async || published(&pg).await == total,
    )
    .await;
    assert_eq!(stream_messages(&n, &t).await, total as u64);
    // With nothing left, the slot catches up with the server's log (keepalives confirm
    // behind an empty window), and the progress row says so.
    let slot = slot_name();
    wait_for(
        "the slot to confirm everything",
        Duration::from_secs(30),
        async || {
            let (confirmed, _) = slot_position(&pg, &slot).await;
            let last_commit: i64 = count(
                &pg,
                "SELECT count(*) FROM sealpost.cdc_progress WHERE window_rows = 0",
            )
            .await;
            // Every envelope row's commit is behind the confirmed position once the window is
            // empty; the log may move on with other records meanwhile.
            confirmed > 0 && last_commit == 1
        },
    )
    .await;
    let from_log = r
        .counters
        .from_log
        .load(std::sync::atomic::Ordering::Relaxed);
    r.stop().await;
    // The events committed while it ran were named by the log; a scan in between may take
    // a few, most come from the log (usually all of them).
    assert!(
        from_log * 2 >= during.len() as u64,
        "only {from_log} of {} sends came from the log",
        during.len()
    );
    eprintln!(
        "{from_log} of {} events committed while running were sent from the log",
        during.len()
    );
    // Each event was sent once: one attempt per row, no second copy at the broker.
    assert_eq!(
        count(&pg, "SELECT count(*) FROM sealpost.attempts").await,
        total,
        "one attempt per event"
    );
    // Status shows the slot, healthy.
    let slots = store::cdc_status(&pg).await.unwrap();
    assert_eq!(slots.len(), 1);
    assert!(slots[0].exists && slots[0].window_rows == 0, "{slots:?}");
    assert_eq!(slots[0].problem(300.0), None);
    consumed_once_and_reconciled(&pg, &c.dir, &cfg.database_url, &t, total).await;
    // Cleanup never runs ahead of the slot (R20): with no replay window and no consumer to
    // wait for, every row is still kept while the publisher's hold covers it (the margin for
    // long transactions is an hour)...
    let mut o = sealpost::ops::PurgeOptions::new(&[], 0);
    o.no_consumers = true;
    o.dry_run = true;
    let kept = sealpost::ops::purge(&mut pg, &o).await.unwrap();
    assert_eq!(kept.purged, 0);
    assert_eq!(
        kept.kept.get("its CDC slot has not confirmed it").copied(),
        Some(total as u64),
        "{:?}",
        kept.kept
    );
    // ...and once CDC is retired (`sealpost cdc --drop`), the same purge may take them.
    sealpost::cdc::drop_slot(&mut pg, &Config::default().cdc.names(common::NATS_CLUSTER))
        .await
        .unwrap();
    let free = sealpost::ops::purge(&mut pg, &o).await.unwrap();
    assert_eq!(free.purged, total as u64, "{:?}", free.kept);
    assert_eq!(
        count(&pg, "SELECT count(*) FROM pg_replication_slots").await,
        0,
        "--drop removes the slot"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_the_broker_refuses_the_window_fills_and_the_slot_waits() {
    let Some((c, mut cfg, mut pg)) = logical_cluster("full").await else {
        return;
    };
    // Room for a few transactions only.
    cfg.cdc.window_bytes_max =
        4 * (sealpost_core::cdc::TXN_BYTES + 5 * sealpost_core::cdc::ROW_BYTES);
    cfg.cdc.sweep_every_ms = 600_000;
    let n = nats(&cfg).await;
    let t = topic("full");
    let _stream = teardown_nats::stream(&common::nats_url(), &t);
    store::set_route(&pg, "orders", common::NATS_CLUSTER, &t)
        .await
        .unwrap();
    let r = run(&cfg, &n, 0);
    let slot = slot_name();
    wait_for("the slot", Duration::from_secs(20), async || {
        count(&pg, "SELECT count(*) FROM pg_replication_slots").await == 1
    })
    .await;
    // No stream yet: every send is refused ("never sent"), every row stays PENDING. `after_first`
    // is a log position at or past the first transaction's end: the slot must stay before it.
    let mut ids = enqueue(&mut pg, "orders", 1, 5).await;
    let after_first = parse_lsn(
        &pg.query_one("SELECT pg_current_wal_lsn()::text", &[])
            .await
            .unwrap()
            .get::<_, String>(0),
    )
    .unwrap();
    ids.extend(enqueue(&mut pg, "orders", 29, 5).await);
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(published(&pg).await, 0);
    let (held, current) = slot_position(&pg, &slot).await;
    assert!(
        held < after_first,
        "the slot confirmed past unsettled rows: {held:X} >= {after_first:X} (log at {current:X})"
    );
    let window: i64 = count(
        &pg,
        "SELECT coalesce(max(window_rows), 0) FROM sealpost.cdc_progress",
    )
    .await;
    assert!(
        window > 0 && window <= 25,
        "the window holds a bounded number of rows: {window}"
    );
    // The destination appears: everything drains, and the slot moves on.
    n.ensure_stream(&t).await.unwrap();
    wait_for(
        "the backlog after the refusals",
        Duration::from_secs(60),
        async || published(&pg).await == ids.len() as i64,
    )
    .await;
    wait_for("the slot to move", Duration::from_secs(20), async || {
        slot_position(&pg, &slot).await.0 > after_first
    })
    .await;
    r.stop().await;
    assert_eq!(stream_messages(&n, &t).await, ids.len() as u64);
    consumed_once_and_reconciled(&pg, &c.dir, &cfg.database_url, &t, ids.len() as i64).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_stopped_mid_stream_restarts_from_the_slot_and_loses_nothing() {
    let Some((c, mut cfg, pg)) = logical_cluster("abort").await else {
        return;
    };
    // A row the dead publisher had in flight goes unknown when its lease ends; if the lookup
    // finds no copy, the reconciler hands it back after the slot confirmed it, and only a scan
    // finds it again: scans every two seconds here (ten by default).
    cfg.cdc.sweep_every_ms = 2_000;
    let n = nats(&cfg).await;
    let t = topic("abort");
    let _stream = teardown_nats::stream(&common::nats_url(), &t);
    n.ensure_stream(&t).await.unwrap();
    store::set_route(&pg, "orders", common::NATS_CLUSTER, &t)
        .await
        .unwrap();
    let mut total = 0usize;
    for round in 0..3 {
        let r = run(&cfg, &n, 0);
        // Events keep committing while the publisher dies mid-stream.
        let writer = {
            let url = cfg.database_url.clone();
            tokio::spawn(async move {
                let mut pg = runtime::pg_connect(&url).await.unwrap();
                enqueue(&mut pg, "orders", 100, 5).await.len()
            })
        };
        tokio::time::sleep(Duration::from_millis(300 + 200 * round)).await;
        r.abort().await;
        total += writer.await.unwrap();
    }
    let r = run(&cfg, &n, 0);
    wait_for(
        "every event after three aborts",
        Duration::from_secs(60),
        async || published(&pg).await == total as i64,
    )
    .await;
    r.stop().await;
    assert_eq!(
        stream_messages(&n, &t).await,
        total as u64,
        "once each at the broker"
    );
    consumed_once_and_reconciled(&pg, &c.dir, &cfg.database_url, &t, total as i64).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_slot_hands_the_work_to_scans_and_cdc_beside_polling_stores_each_once() {
    let Some((c, mut cfg, mut pg)) = logical_cluster("drop").await else {
        return;
    };
    cfg.cdc.sweep_every_ms = 1_000;
    let n = nats(&cfg).await;
    let t = topic("drop");
    let _stream = teardown_nats::stream(&common::nats_url(), &t);
    n.ensure_stream(&t).await.unwrap();
    store::set_route(&pg, "orders", common::NATS_CLUSTER, &t)
        .await
        .unwrap();
    // CDC and a polling dispatcher together.
    let r = run(&cfg, &n, 1);
    let first = enqueue(&mut pg, "orders", 50, 10).await;
    wait_for("the first events", Duration::from_secs(30), async || {
        published(&pg).await == first.len() as i64
    })
    .await;
    // The slot goes away under the publisher (its session ended, the slot dropped).
    let slot = slot_name();
    wait_for(
        "the slot to be dropped",
        Duration::from_secs(20),
        async || {
            let _ = pg
                .execute(
                    "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots
                 WHERE slot_name = $1 AND active_pid IS NOT NULL",
                    &[&slot],
                )
                .await;
            pg.execute("SELECT pg_drop_replication_slot($1)", &[&slot])
                .await
                .is_ok()
        },
    )
    .await;
    let gone = store::cdc_status(&pg).await.unwrap();
    assert!(
        !gone[0].exists
            && gone[0]
                .problem(300.0)
                .is_some_and(|p| p.contains("is gone")),
        "{gone:?}"
    );
    let second = enqueue(&mut pg, "orders", 50, 10).await;
    let total = (first.len() + second.len()) as i64;
    wait_for(
        "the events after the slot was dropped",
        Duration::from_secs(30),
        async || published(&pg).await == total,
    )
    .await;
    r.stop().await;
    // The next start creates the slot again, and everything after it goes through.
    let r = run(&cfg, &n, 0);
    let third = enqueue(&mut pg, "orders", 20, 10).await;
    let total = total + third.len() as i64;
    wait_for(
        "the events after the slot came back",
        Duration::from_secs(30),
        async || published(&pg).await == total,
    )
    .await;
    r.stop().await;
    assert_eq!(
        count(&pg, "SELECT count(*) FROM pg_replication_slots").await,
        1,
        "the slot was created again"
    );
    assert_eq!(
        stream_messages(&n, &t).await,
        total as u64,
        "once each at the broker"
    );
    consumed_once_and_reconciled(&pg, &c.dir, &cfg.database_url, &t, total).await;
}

/// A `sealpost cdc` process.
fn spawn_cdc(
    dir: &std::path::Path,
    n: usize,
    database_url: &str,
    config: &str,
) -> std::process::Child {
    let path = dir.join(format!("cdc{n}.toml"));
    std::fs::write(
        &path,
        format!("database_url = \"{database_url}\"\n{config}"),
    )
    .unwrap();
    std::process::Command::new(env!("CARGO_BIN_EXE_sealpost"))
        .arg("--config")
        .arg(&path)
        .arg("cdc")
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn sealpost cdc")
}

/// The drill of issue 22: `sealpost cdc` killed with SIGKILL between its publish and its
/// receipt transaction, while events keep committing; the next process restarts from the
/// slot, the reconciler resolves what the dead one had in flight, and every event is
/// published once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sealpost_cdc_killed_between_send_and_receipt_loses_nothing() {
    let Some((c, cfg, mut pg)) = logical_cluster("kill9").await else {
        return;
    };
    let n = nats(&cfg).await;
    let t = topic("kill9");
    let _stream = teardown_nats::stream(&common::nats_url(), &t);
    n.ensure_stream(&t).await.unwrap();
    store::set_route(&pg, "orders", common::NATS_CLUSTER, &t)
        .await
        .unwrap();
    // The first process publishes, then sits between the publish and its receipt.
    let mut first = spawn_cdc(
        &c.dir,
        0,
        &cfg.database_url,
        "lease_ms = 2000\nack_timeout_ms = 1000\ndrill_pause_after_publish_ms = 600000\n[cdc]\nsweep_every_ms = 600000\n",
    );
    let mut ids = enqueue(&mut pg, "orders", 20, 10).await;
    wait_for("the first publishes", Duration::from_secs(30), async || {
        stream_messages(&n, &t).await > 0
    })
    .await;
    first.kill().unwrap();
    first.wait().unwrap();
    let sent_before_kill = stream_messages(&n, &t).await;
    assert_eq!(
        published(&pg).await,
        0,
        "no receipt was accepted before the kill"
    );
    ids.extend(enqueue(&mut pg, "orders", 20, 10).await);
    // The next process (with its reconciler) restarts from the slot.
    let mut second = spawn_cdc(
        &c.dir,
        1,
        &cfg.database_url,
        "lease_ms = 2000\nack_timeout_ms = 1000\n",
    );
    wait_for(
        "every event after the kill",
        Duration::from_secs(60),
        async || published(&pg).await == ids.len() as i64,
    )
    .await;
    second.kill().unwrap();
    second.wait().unwrap();
    assert_eq!(
        stream_messages(&n, &t).await,
        ids.len() as u64,
        "once each at the broker"
    );
    assert!(sent_before_kill > 0);
    assert_eq!(
        count(
            &pg,
            "SELECT count(*) FROM sealpost.receipts WHERE kind = 'primary' AND source = 'lookup'"
        )
        .await,
        sent_before_kill as i64,
        "what the killed process sent was adopted by the reconciler's lookup, not sent again"
    );
    consumed_once_and_reconciled(&pg, &c.dir, &cfg.database_url, &t, ids.len() as i64).await;
}

/// Trust boundaries (issue 23 on the CDC tables): the schema owner makes the publication and
/// the slot once (`sealpost cdc --setup`); from then on the publisher runs as a login that
/// holds only the dispatcher and reconciler roles and the REPLICATION attribute. It
/// publishes every event, through the log, and records its progress; it may not delete the
/// progress rows (the operator's `--drop`) nor make a publication (the owner's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_login_with_the_dispatcher_roles_and_replication_runs_the_publisher() {
    use sealpost::roles::{self, Grant, Kind};
    let Some((c, cfg, mut pg)) = logical_cluster("login").await else {
        return;
    };
    let n = nats(&cfg).await;
    let t = topic("login");
    let _stream = teardown_nats::stream(&common::nats_url(), &t);
    n.ensure_stream(&t).await.unwrap();
    store::set_route(&pg, "orders", common::NATS_CLUSTER, &t)
        .await
        .unwrap();
    let names = cfg.cdc.names(common::NATS_CLUSTER);
    let made = sealpost::cdc::setup(&mut pg, &names, common::NATS_CLUSTER)
        .await
        .expect("the owner's setup");
    pg.batch_execute("CREATE ROLE cdc_publisher LOGIN REPLICATION")
        .await
        .unwrap();
    for kind in [Kind::Dispatcher, Kind::Reconciler] {
        roles::grant(
            &pg,
            &Grant {
                kind,
                login: "cdc_publisher".into(),
                consumer_id: None,
            },
        )
        .await
        .unwrap();
    }
    let login_cfg = Config {
        database_url: c
            .url("postgres")
            .replace("user=postgres", "user=cdc_publisher"),
        ..cfg.clone()
    };
    let ids = enqueue(&mut pg, "orders", 4, 50).await;
    let r = run(&login_cfg, &n, 0);
    wait_for(
        "every event, as the publisher login",
        Duration::from_secs(30),
        async || published(&pg).await == ids.len() as i64,
    )
    .await;
    let more = enqueue(&mut pg, "orders", 4, 50).await;
    wait_for(
        "the events committed while it runs",
        Duration::from_secs(30),
        async || published(&pg).await == (ids.len() + more.len()) as i64,
    )
    .await;
    let from_log = r
        .counters
        .from_log
        .load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        from_log > 0,
        "the log named the events committed while it ran"
    );
    wait_for(
        "its progress recorded, as the publisher login",
        Duration::from_secs(10),
        async || {
            let recorded: Option<String> = pg
                .query_one(
                    "SELECT confirmed_lsn::text FROM sealpost.cdc_progress WHERE slot_name = $1",
                    &[&names.slot],
                )
                .await
                .unwrap()
                .get(0);
            recorded.as_deref().and_then(parse_lsn) > Some(made.confirmed_lsn)
                && slot_position(&pg, &names.slot).await.0 > made.confirmed_lsn
        },
    )
    .await;
    r.stop().await;
    assert_eq!(
        stream_messages(&n, &t).await,
        (ids.len() + more.len()) as u64
    );

    let login = runtime::pg_connect(&login_cfg.database_url).await.unwrap();
    for (what, sql) in [
        (
            "delete the progress rows",
            "DELETE FROM sealpost.cdc_progress".to_string(),
        ),
        (
            "make a publication",
            "CREATE PUBLICATION sealpost_other FOR TABLE sealpost.envelope".to_string(),
        ),
    ] {
        let e = login
            .batch_execute(&sql)
            .await
            .expect_err(&format!("the publisher login may not {what}"));
        assert_eq!(
            e.code(),
            Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE),
            "{what}: {e:?}"
        );
    }
}

/// A private NATS server (2.15.1, which `.ci/run` caches; `NATS215_BIN` overrides the path)
/// with JetStream writing every message to disk before it acknowledges it (`sync_interval:
/// always`), so a SIGKILL loses nothing it acknowledged. Killed on drop.
struct PrivateNats {
    child: Option<std::process::Child>,
    conf: std::path::PathBuf,
    port: u16,
}

impl PrivateNats {
    fn bin() -> std::path::PathBuf {
        std::env::var_os("NATS215_BIN")
            .map(Into::into)
            .unwrap_or_else(|| "/var/cache/sealpost/nats-2.15.1/bin/nats-server".into())
    }

    fn start(dir: &std::path::Path) -> Option<PrivateNats> {
        if !Self::bin().exists() {
            assert!(
                std::env::var_os("CI").is_none(),
                "no NATS 2.15.1 at {}: .ci/run installs it",
                Self::bin().display()
            );
            eprintln!("skipped: no {}", Self::bin().display());
            return None;
        }
        let port = std::net::TcpListener::bind(("127.0.0.1", 0))
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let conf = dir.join("nats.conf");
        std::fs::write(
            &conf,
            format!(
                "listen: 127.0.0.1:{port}\njetstream {{ store_dir: \"{}\", sync_interval: always }}\n",
                dir.join("js").display()
            ),
        )
        .unwrap();
        let mut n = PrivateNats {
            child: None,
            conf,
            port,
        };
        n.run();
        Some(n)
    }

    /// Starts the server (again, on the same store).
    fn run(&mut self) {
        let child = std::process::Command::new(Self::bin())
            .arg("-c")
            .arg(&self.conf)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start nats-server");
        self.child = Some(child);
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(std::time::Instant::now() < deadline, "NATS never listened");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn signal(&self, sig: &str) {
        if let Some(c) = &self.child {
            let _ = std::process::Command::new("kill")
                .args([sig, &c.id().to_string()])
                .status();
        }
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for PrivateNats {
    fn drop(&mut self) {
        self.signal("-CONT");
        self.kill();
    }
}

/// The drill of issue 22 with the broker failing: `sealpost cdc` (with its reconciler) and
/// two `sealpost consume` consumers on a private NATS, while producers commit: the broker is
/// frozen with SIGSTOP for 5 s (past the ack timeout and the lease), then killed with SIGKILL
/// and started again on its store 3 s later. Afterwards every event is `PUBLISHED`, stored
/// once at the broker, applied once by each consumer, and `sealpost reconcile` finds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_frozen_then_killed_under_cdc_loses_nothing_and_reconciles_clean() {
    let Some((c, cfg, mut pg)) = logical_cluster("broker").await else {
        return;
    };
    let Some(mut broker) = PrivateNats::start(&c.dir) else {
        return;
    };
    sealpost_cli::demo::prepare(&pg).await.unwrap();
    let cluster = "cdc-drill";
    let t = topic("broker");
    let n = Nats::connect(&broker.url(), cluster, Duration::from_secs(2))
        .await
        .unwrap();
    n.ensure_stream(&t).await.unwrap();
    store::set_route(&pg, "orders", cluster, &t).await.unwrap();
    let write = |name: &str| {
        let path = c.dir.join(name);
        std::fs::write(
            &path,
            format!(
                "database_url = \"{}\"\nlease_ms = 3000\nack_timeout_ms = 1000\n\
                 reconcile_every_ms = 500\nerror_backoff_max_ms = 1000\n\
                 [nats]\nurl = \"{}\"\ncluster = \"{cluster}\"\n[cdc]\nsweep_every_ms = 2000\n",
                cfg.database_url,
                broker.url()
            ),
        )
        .unwrap();
        path
    };
    let config = write("drill.toml");
    let spawn = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_sealpost"))
            .arg("--config")
            .arg(&config)
            .args(args)
            .env("RUST_LOG", "error")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn sealpost")
    };
    let consumers = ["c1", "c2"];
    let mut procs = vec![KillOnDrop(spawn(&["cdc"]))];
    for cid in consumers {
        procs.push(KillOnDrop(spawn(&[
            "consume",
            "--consumer",
            cid,
            "--topic",
            &t,
        ])));
    }
    let mut ids = enqueue(&mut pg, "orders", 10, 50).await;
    wait_for("the first events", Duration::from_secs(30), async || {
        published(&pg).await > 0
    })
    .await;
    broker.signal("-STOP");
    for _ in 0..10 {
        ids.extend(enqueue(&mut pg, "orders", 1, 50).await);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    broker.signal("-CONT");
    ids.extend(enqueue(&mut pg, "orders", 4, 50).await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    broker.kill();
    for _ in 0..6 {
        ids.extend(enqueue(&mut pg, "orders", 1, 50).await);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    broker.run();
    ids.extend(enqueue(&mut pg, "orders", 4, 50).await);
    let all = ids.len() as i64;
    wait_for(
        "every event, after the broker came back",
        Duration::from_secs(120),
        async || published(&pg).await == all,
    )
    .await;
    for cid in consumers {
        applied_once(&pg, cid, all, Duration::from_secs(120)).await;
    }
    drop(procs);
    let n = Nats::connect(&broker.url(), cluster, Duration::from_secs(2))
        .await
        .unwrap();
    assert_eq!(
        stream_messages(&n, &t).await,
        all as u64,
        "once each at the broker"
    );
    reconcile_clean(&config, &t);
}
