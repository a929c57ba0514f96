//! Retention and restore against the real PostgreSQL and NATS JetStream: an early purge
//! attempt is refused with its reason (F10) while purge waits for the watermarks consumers
//! report from their own databases, the restore point and the audit retention, and removes
//! tombstones a replay window after their purge; a purge naming no consumer is refused; and
//! a database restored from a `pg_dump` taken mid-run republishes under the same event ids
//! with zero second effects (F11, R21). Every test has its own databases and stream.

use crate::common;
use crate::teardown_nats;

use common::wait_for;
use std::collections::BTreeSet;
use std::process::Command;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use sealpost::runtime::CancellationToken;
use sealpost::runtime::{self, Config, Counters};
use sealpost::store::{self, Accepted};
use sealpost_cli::ops;
use sealpost_core::envelope::EventId;
use sealpost_core::port::{Broker, SendResult};
use sealpost_core::{ReceiptVerdict, RejectReason};
use sealpost_nats::Nats;

static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Sends through the broker port as a dispatcher does, with a deadline far enough away that
/// the test decides when a send happens (a "delayed request" is one sent late).
async fn send(nats: &Nats, outgoing: &[store::Outgoing]) -> Vec<SendResult> {
    let batch = outgoing.iter().map(store::Outgoing::send_request).collect();
    nats.send_batch(batch, std::time::Instant::now() + Duration::from_secs(60))
        .await
}

async fn enqueue(pg: &mut tokio_postgres::Client, route: &str, n: usize) -> Vec<EventId> {
    let keys: Vec<String> = (0..n).map(|i| format!("o-{i}")).collect();
    let events = sealpost_cli::demo::order_batch(&keys, br#"{"order_id":"r"}"#);
    let tx = pg.transaction().await.unwrap();
    store::enqueue_many(&tx, route, &events).await.unwrap();
    tx.commit().await.unwrap();
    events.iter().map(|e| e.0).collect()
}

async fn publish_all(
    pg: &mut tokio_postgres::Client,
    nats: &Nats,
    max: usize,
) -> Vec<sealpost_core::Receipt> {
    let b = store::claim_batch(pg, 77, max, 10_000).await.unwrap();
    let receipts: Vec<_> = send(nats, &b.outgoing)
        .await
        .into_iter()
        .map(|r| match r {
            SendResult::Receipt(r) => r,
            other => panic!("{other:?}"),
        })
        .collect();
    let v = store::accept_receipts(pg, &receipts).await.unwrap();
    assert!(v
        .iter()
        .all(|a| *a == Accepted::Verdict(ReceiptVerdict::Primary)));
    receipts
}

async fn effects(pg: &tokio_postgres::Client, consumer: &str) -> (i64, i64) {
    let r = pg
        .query_one(
            "SELECT count(*), count(DISTINCT event_id) FROM demo_fulfilment WHERE consumer_id = $1",
            &[&consumer],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1))
}

/// A fresh database `sealpost_ret_<tag>` with the schema and the demo tables: its URL, a
/// client, and the guard that drops it when the test ends (pass or fail).
async fn fresh_db(tag: &str) -> (String, tokio_postgres::Client, common::TestDb) {
    let db = common::fresh_database(&format!("sealpost_ret_{tag}")).await;
    let url = db.database_url.clone();
    let pg = runtime::pg_connect(&url).await.unwrap();
    store::migrate(&pg).await.expect("migrate");
    sealpost_cli::demo::prepare(&pg).await.unwrap();
    (url, pg, db)
}

async fn watermark(outbox: &tokio_postgres::Client, consumer: &str, stream: &str) -> Option<i64> {
    outbox
        .query_opt(
            "SELECT watermark FROM sealpost.consumer_progress WHERE consumer_id = $1 AND stream = $2",
            &[&consumer, &stream],
        )
        .await
        .unwrap()
        .map(|r| r.get(0))
}

/// The normal layout: the outbox in one database, each consumer's inbox in its own; the
/// consumers report their watermark to the outbox's `sealpost.consumer_progress`. An early
/// purge is refused with its reason (F10), a purge naming no consumer is refused unless the
/// operator says `--no-consumers`, rows newer than the restore point are only retained,
/// tombstones go a replay window after their purge, and audit evidence of live events stays.
#[tokio::test]
async fn purge_waits_for_reported_consumers_the_restore_point_and_the_audit_retention() {
    let tag = runtime::owner_id() % 1_000_000;
    let (outbox_url, mut pg, _outbox_db) = fresh_db(&format!("{tag}_outbox")).await;
    let (consumer_url, cpg, _consumer_db) = fresh_db(&format!("{tag}_consumer")).await;
    let mut cfg = Config::from_env().unwrap();
    cfg.database_url = consumer_url.clone();
    cfg.outbox_database_url = outbox_url.clone();
    cfg.consumer_progress_every_ms = 200;
    let topic = format!("RET{tag}");
    let route = format!("r-{topic}");
    store::set_route(&pg, &route, common::NATS_CLUSTER, &topic)
        .await
        .unwrap();
    let nats = Nats::connect(
        &common::nats_url(),
        common::NATS_CLUSTER,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    let _stream = teardown_nats::stream(&common::nats_url(), &topic);
    nats.ensure_stream(&topic).await.unwrap();
    let n = 30;
    let ids = enqueue(&mut pg, &route, n).await;
    // Two publications 50 ms apart, so a restore point can fall between them.
    let mut receipts = publish_all(&mut pg, &nats, n / 2).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    receipts.extend(publish_all(&mut pg, &nats, n).await);
    assert_eq!(receipts.len(), n);
    let last_seq = receipts.iter().map(|r| r.sequence).max().unwrap() as i64;
    // Consumer A takes everything; consumer B nothing yet.
    let a = format!("a-{topic}");
    let b = format!("b-{topic}");
    let stop = CancellationToken::new();
    let spawn = |c: &str| {
        tokio::spawn(sealpost_cli::consumer::run(
            cfg.clone(),
            nats.clone(),
            c.to_string(),
            topic.clone(),
            stop.clone(),
            Arc::new(AtomicU64::new(0)),
        ))
    };
    let ca = spawn(&a);
    wait_for("consumer A's report", Duration::from_secs(30), async || {
        watermark(&pg, &a, &topic).await == Some(last_seq)
    })
    .await;
    assert_eq!(effects(&cpg, &a).await, (n as i64, n as i64));
    // No consumer named: refused, with what to set.
    let mut o = ops::PurgeOptions::new(&[], 0);
    o.stream = Some(topic.clone());
    let e = ops::purge(&mut pg, &o).await.unwrap_err().to_string();
    for needle in ["--consumer", "required_consumers", "--no-consumers"] {
        assert!(e.contains(needle), "{e}");
    }
    let mut both = ops::PurgeOptions::new(std::slice::from_ref(&a), 0);
    both.no_consumers = true;
    assert!(matches!(
        ops::purge(&mut pg, &both).await,
        Err(ops::PurgeError::Contradiction(_))
    ));
    // F10: an early purge (B has not consumed) is refused, with the reason, and writes nothing.
    let required = vec![a.clone(), b.clone()];
    let mut o = ops::PurgeOptions::new(&required, 0);
    o.stream = Some(topic.clone());
    o.batch_size_max = 7;
    let r = ops::purge(&mut pg, &o).await.unwrap();
    assert_eq!((r.purged, r.retained), (0, 0));
    assert_eq!(
        r.kept.get("a required consumer has not consumed it"),
        Some(&(n as u64))
    );
    assert!(
        r.examples[0].1.contains(&format!(
            "required consumer `{b}` has not consumed position"
        )),
        "{:?}",
        r.examples[0]
    );
    let mut one = o.clone();
    one.only = Some(ids[0]);
    assert_eq!(ops::purge(&mut pg, &one).await.unwrap().purged, 0);
    let published =
        "SELECT count(*) FROM sealpost.outbox WHERE state = 'PUBLISHED' AND length(payload) > 0";
    assert_eq!(
        pg.query_one(published, &[]).await.unwrap().get::<_, i64>(0),
        n as i64,
        "nothing needed by a consumer is gone"
    );
    // B catches up and reports.
    let cb = spawn(&b);
    wait_for("consumer B's report", Duration::from_secs(30), async || {
        watermark(&pg, &b, &topic).await == Some(last_seq)
    })
    .await;
    // Audit evidence: of a live event (a pending one), of no event, of a purged-to-be event.
    let pending = enqueue(&mut pg, &route, 1).await[0];
    for (event, at) in [
        (Some(pending), 0i64),
        (None, 0),
        (Some(ids[0]), i64::MAX / 2),
        (Some(ids[1]), 0),
    ] {
        pg.execute(
            "INSERT INTO sealpost.audit (event_id, member, what, detail, at_ms) VALUES ($1, 0, 'test', 'evidence', $2)",
            &[&event.map(|e| uuid::Uuid::from_bytes(e.0)), &at],
        )
        .await
        .unwrap();
    }
    // The restore point falls between the two publications: the second half is only retained.
    let first_half_at: i64 = pg
        .query_one(
            "SELECT max(published_at_ms) FROM sealpost.work WHERE event_id = ANY($1)",
            &[&receipts[..n / 2]
                .iter()
                .map(|r| uuid::Uuid::from_bytes(r.event_id.0))
                .collect::<Vec<_>>()],
        )
        .await
        .unwrap()
        .get(0);
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let mut o = ops::PurgeOptions::new(&required, 1);
    o.stream = Some(topic.clone());
    o.restore_point_ms = Some(first_half_at as u64 + 1);
    o.audit_retention_days = 0;
    let dry = ops::purge(
        &mut pg,
        &ops::PurgeOptions {
            dry_run: true,
            ..o.clone()
        },
    )
    .await
    .unwrap();
    let r = ops::purge(&mut pg, &o).await.unwrap();
    assert_eq!((dry.purged, dry.retained), (r.purged, r.retained));
    assert_eq!((r.purged, r.retained), (n as u64 / 2, n as u64 / 2));
    assert_eq!(
        r.kept.get("newer than the restore point"),
        Some(&(n as u64 / 2))
    );
    assert_eq!(
        r.tombstones_removed, 0,
        "a fresh tombstone stays a replay window"
    );
    // Evidence of the live event and the young row stay; the rest is gone.
    let audit_left: Vec<(Option<uuid::Uuid>, i64)> = pg
        .query(
            "SELECT event_id, at_ms FROM sealpost.audit WHERE what = 'test' ORDER BY at_ms",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let expected_left = vec![
        (Some(uuid::Uuid::from_bytes(pending.0)), 0),
        (Some(uuid::Uuid::from_bytes(ids[0].0)), i64::MAX / 2),
    ];
    assert!(
        receipts[..n / 2].iter().any(|r| r.event_id == ids[1]),
        "claims go in commit order: the second event was in the first publication"
    );
    assert_eq!(audit_left, expected_left);
    assert_eq!(r.evidence_removed.get("audit"), Some(&2));
    // A late duplicate ACK for a purged event meets its tombstone and is rejected.
    let purged_receipt = receipts[0].clone();
    assert_eq!(
        store::accept_receipts(&mut pg, std::slice::from_ref(&purged_receipt))
            .await
            .unwrap(),
        vec![Accepted::Verdict(ReceiptVerdict::Reject(
            RejectReason::NotInFlight(sealpost_core::State::Purged)
        ))]
    );
    // A replay window later (no restore point any more): the rest goes, the first
    // tombstones are deleted, and a late ACK finds no event at all.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    o.restore_point_ms = None;
    let r = ops::purge(&mut pg, &o).await.unwrap();
    assert_eq!(r.purged, n as u64 / 2);
    assert_eq!(r.tombstones_removed, n as u64 / 2);
    let left: i64 = pg
        .query_one(
            "SELECT count(*) FROM sealpost.outbox WHERE dest_topic = $1",
            &[&topic],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        left,
        n as i64 / 2 + 1,
        "the young tombstones and the pending row"
    );
    assert_eq!(
        store::accept_receipts(&mut pg, std::slice::from_ref(&purged_receipt))
            .await
            .unwrap(),
        vec![Accepted::UnknownEvent],
        "never resurrected"
    );
    stop.cancel();
    ca.await.unwrap().unwrap();
    cb.await.unwrap().unwrap();
    let _ = nats.js.delete_stream(&topic).await;
}

#[test]
fn the_binary_refuses_a_purge_that_names_no_consumer_and_says_what_to_set() {
    let out = Command::new(env!("CARGO_BIN_EXE_sealpost"))
        .args(["purge", "--dry-run"])
        .output()
        .expect("run sealpost");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    for needle in [
        "refusing to purge",
        "--consumer",
        "required_consumers",
        "--no-consumers",
    ] {
        assert!(err.contains(needle), "{err}");
    }
}

fn psql(db: &str, sql: &str) {
    let ok = Command::new("psql")
        .args([
            "-h",
            "127.0.0.1",
            "-U",
            "postgres",
            "-d",
            db,
            "-v",
            "ON_ERROR_STOP=1",
            "-qc",
            sql,
        ])
        .status()
        .expect("psql");
    assert!(ok.success(), "psql failed: {sql}");
}

#[tokio::test]
async fn restore_from_a_dump_taken_mid_run_keeps_event_ids_and_has_no_second_effects() {
    let _g = LOCK.lock().await;
    // The outbox lives in its own database, the consumer's inbox in another: restoring the
    // outbox does not roll back what consumers already applied.
    let outbox_db = "sealpost_f11";
    psql("test", &format!("DROP DATABASE IF EXISTS {outbox_db}"));
    psql("test", &format!("CREATE DATABASE {outbox_db}"));
    let _outbox_db = common::drop_database_guard(outbox_db);
    let (consumer_url, cpg, _consumer_db) =
        fresh_db(&format!("{}_f11c", runtime::owner_id() % 1_000_000)).await;
    let mut consumer_cfg = Config::from_env().unwrap();
    consumer_cfg.database_url = consumer_url.clone();
    let mut cfg = consumer_cfg.clone();
    cfg.database_url = format!("host=127.0.0.1 user=postgres dbname={outbox_db}");
    cfg.lease_ms = 2_000;
    cfg.ack_timeout_ms = 1_000;
    let mut pg = runtime::pg_connect(&cfg.database_url).await.unwrap();
    store::migrate(&pg).await.unwrap();
    let topic = format!("F{}", runtime::owner_id() % 1_000_000);
    store::set_route(&pg, "orders", common::NATS_CLUSTER, &topic)
        .await
        .unwrap();
    let nats = Nats::connect(
        &common::nats_url(),
        common::NATS_CLUSTER,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    let _stream = teardown_nats::stream(&common::nats_url(), &topic);
    nats.ensure_stream(&topic).await.unwrap();
    let n = 200;
    let ids = enqueue(&mut pg, "orders", n).await;
    publish_all(&mut pg, &nats, 100).await;
    // Mid-run: 100 published, 100 pending.
    let dump = std::env::temp_dir().join(format!("sealpost-f11-{}.dump", std::process::id()));
    let ok = Command::new("pg_dump")
        .args([
            "-h",
            "127.0.0.1",
            "-U",
            "postgres",
            "-d",
            outbox_db,
            "-Fc",
            "-f",
        ])
        .arg(&dump)
        .status()
        .unwrap();
    assert!(ok.success(), "pg_dump failed");
    // Everything is published and consumed.
    let consumer = format!("f11-{topic}");
    let stop = CancellationToken::new();
    let counters = Arc::new(Counters::default());
    let mut tasks = vec![
        tokio::spawn(runtime::dispatcher(
            cfg.clone(),
            common::pg_source(&cfg),
            Arc::new(nats.clone()),
            stop.clone(),
            counters.clone(),
        )),
        tokio::spawn(runtime::reconciler(
            cfg.clone(),
            common::pg_source(&cfg),
            Arc::new(nats.clone()),
            stop.clone(),
            counters.clone(),
        )),
    ];
    let ctask = tokio::spawn(sealpost_cli::consumer::run(
        consumer_cfg.clone(),
        nats.clone(),
        consumer.clone(),
        topic.clone(),
        stop.clone(),
        Arc::new(AtomicU64::new(0)),
    ));
    wait_for("first consumption", Duration::from_secs(60), async || {
        effects(&cpg, &consumer).await.0 == n as i64
    })
    .await;
    stop.cancel();
    for t in tasks.drain(..) {
        t.await.unwrap().unwrap();
    }
    drop(pg);
    // F11: the outbox database is restored from the mid-run dump.
    psql(
        "test",
        &format!(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{outbox_db}'"
        ),
    );
    psql("test", &format!("DROP DATABASE {outbox_db}"));
    psql("test", &format!("CREATE DATABASE {outbox_db}"));
    let ok = Command::new("pg_restore")
        .args(["-h", "127.0.0.1", "-U", "postgres", "-d", outbox_db])
        .arg(&dump)
        .status()
        .unwrap();
    assert!(ok.success(), "pg_restore failed");
    let pg = runtime::pg_connect(&cfg.database_url).await.unwrap();
    let pending: i64 = pg
        .query_one(
            "SELECT count(*) FROM sealpost.outbox WHERE state = 'PENDING'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(pending, 100, "the restored rows are back to PENDING");
    // Dispatchers and the reconciler run again; the consumer keeps running.
    let stop = CancellationToken::new();
    let tasks = vec![
        tokio::spawn(runtime::dispatcher(
            cfg.clone(),
            common::pg_source(&cfg),
            Arc::new(nats.clone()),
            stop.clone(),
            counters.clone(),
        )),
        tokio::spawn(runtime::reconciler(
            cfg.clone(),
            common::pg_source(&cfg),
            Arc::new(nats.clone()),
            stop.clone(),
            counters.clone(),
        )),
    ];
    wait_for("republication", Duration::from_secs(60), async || {
        pg.query_one(
            "SELECT count(*) FROM sealpost.outbox WHERE state <> 'PUBLISHED'",
            &[],
        )
        .await
        .unwrap()
        .get::<_, i64>(0)
            == 0
    })
    .await;
    // Let the consumer see anything redelivered.
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.cancel();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    ctask.await.unwrap().unwrap();
    let restored: BTreeSet<String> = pg
        .query("SELECT event_id::text FROM sealpost.outbox", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let original: BTreeSet<String> = ids
        .iter()
        .map(|i| uuid::Uuid::from_bytes(i.0).to_string())
        .collect();
    assert_eq!(restored, original, "the same event ids, none minted anew");
    assert_eq!(
        effects(&cpg, &consumer).await,
        (n as i64, n as i64),
        "zero second effects"
    );
    let info = nats
        .js
        .get_stream(&topic)
        .await
        .unwrap()
        .get_info()
        .await
        .unwrap();
    assert_eq!(
        info.state.messages, n as u64,
        "the broker deduplicated the republished ids"
    );
    let _ = std::fs::remove_file(&dump);
    drop(pg);
    psql(
        "test",
        &format!(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{outbox_db}'"
        ),
    );
    psql("test", &format!("DROP DATABASE IF EXISTS {outbox_db}"));
    drop(cpg);
}

#[tokio::test]
async fn reconcile_reports_out_of_band_ids_and_unconsumed_events() {
    let _g = LOCK.lock().await;
    let (url, mut pg, _db) = fresh_db(&format!("{}_rec", runtime::owner_id() % 1_000_000)).await;
    let mut cfg = Config::from_env().unwrap();
    cfg.database_url = url.clone();
    let topic = format!("O{}", runtime::owner_id() % 1_000_000);
    let route = format!("r-{topic}");
    store::set_route(&pg, &route, common::NATS_CLUSTER, &topic)
        .await
        .unwrap();
    let nats = Nats::connect(
        &common::nats_url(),
        common::NATS_CLUSTER,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    let _stream = teardown_nats::stream(&common::nats_url(), &topic);
    nats.ensure_stream(&topic).await.unwrap();
    let ids = enqueue(&mut pg, &route, 5).await;
    let mut published = 0;
    while published < ids.len() {
        published += publish_all(&mut pg, &nats, 1000)
            .await
            .iter()
            .filter(|r| ids.contains(&r.event_id))
            .count();
    }
    // An out-of-band publisher writes an event id the outbox never committed.
    let forged = EventId(*uuid::Uuid::now_v7().as_bytes());
    let mut h = async_nats::HeaderMap::new();
    h.insert(sealpost_nats::H_EVENT_ID, forged.to_string().as_str());
    nats.js
        .publish_with_headers(sealpost_nats::subject(&topic, forged, 0), h, "rogue".into())
        .await
        .unwrap()
        .await
        .unwrap();
    // A critical consumer that consumed one event and then stopped.
    let c = format!("lag-{topic}");
    pg.execute(
        "INSERT INTO sealpost.consumer_watermark (consumer_id, stream, high_water, updated_at_ms) VALUES ($1, $2, 1, 0)",
        &[&c, &topic],
    )
    .await
    .unwrap();
    pg.execute(
        "INSERT INTO sealpost.inbox (consumer_id, event_id, member, payload_digest, stream, sequence)
         VALUES ($1, $2, 0, '\\x00', $3, 1)",
        &[&c, &uuid::Uuid::from_bytes(ids[0].0), &topic],
    )
    .await
    .unwrap();
    let opts = ops::ReconcileOptions {
        pending_age_s: 3_600,
        unconsumed_age_s: 0,
        unknown_age_s: 900,
        consumers: vec![c.clone()],
        streams: vec![topic.clone()],
        scan_max: 10_000,
    };
    let r = ops::reconcile(&pg, Some(&nats), &opts).await.unwrap();
    assert_eq!(r.stream_messages_scanned, 6);
    let oob: Vec<_> = r
        .findings
        .iter()
        .filter(|f| f.kind == "out_of_band")
        .collect();
    assert_eq!(oob.len(), 1);
    assert_eq!(
        oob[0].event_ids,
        vec![uuid::Uuid::from_bytes(forged.0).to_string()]
    );
    let lag: Vec<_> = r
        .findings
        .iter()
        .filter(|f| f.kind == "published_unconsumed")
        .collect();
    assert_eq!(lag.len(), 1);
    assert_eq!(
        lag[0].count, 4,
        "four published events without the consumer's receipt"
    );
    assert_eq!(r.consumed.get(&c), Some(&1));
    assert!(!r
        .findings
        .iter()
        .any(|f| f.kind == "pending_over_age" || f.kind == "unknown_over_age"));
    let _ = nats.js.delete_stream(&topic).await;
}
