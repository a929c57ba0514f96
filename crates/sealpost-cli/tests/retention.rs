//! Retention and restore against the real PostgreSQL and NATS JetStream: an early purge
//! attempt is refused with its reason (F10), and a database restored from a `pg_dump` taken
//! mid-run republishes under the same event ids with zero second effects (F11, R21).

use std::collections::BTreeSet;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

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

async fn wait_for(what: &str, limit: Duration, mut f: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn early_purge_is_refused_with_its_reason_and_nothing_needed_is_lost() {
    let _g = LOCK.lock().await;
    let cfg = Config::from_env().unwrap();
    let mut pg = runtime::pg_connect(&cfg.database_url).await.unwrap();
    store::migrate(&pg).await.unwrap();
    sealpost_cli::demo::prepare(&pg).await.unwrap();
    let topic = format!("R{}", runtime::owner_id() % 1_000_000);
    let route = format!("r-{topic}");
    store::set_route(&pg, &route, &cfg.nats_cluster, &topic)
        .await
        .unwrap();
    let nats = Nats::connect(&cfg.nats_url, &cfg.nats_cluster, Duration::from_secs(5))
        .await
        .unwrap();
    nats.ensure_stream(&topic).await.unwrap();
    let n = 30;
    let ids = enqueue(&mut pg, &route, n).await;
    let mut receipts = Vec::new();
    while receipts.len() < n {
        receipts.extend(
            publish_all(&mut pg, &nats, 1000)
                .await
                .into_iter()
                .filter(|r| ids.contains(&r.event_id)),
        );
    }
    // Consumer A takes everything; consumer B nothing yet.
    let a = format!("a-{topic}");
    let b = format!("b-{topic}");
    let stop = Arc::new(AtomicBool::new(false));
    let ca = tokio::spawn(sealpost_cli::consumer::run(
        cfg.clone(),
        nats.clone(),
        a.clone(),
        topic.clone(),
        stop.clone(),
        Arc::new(AtomicU64::new(0)),
    ));
    wait_for("consumer A", Duration::from_secs(30), async || {
        effects(&pg, &a).await.0 == n as i64
    })
    .await;
    let required = vec![a.clone(), b.clone()];
    // F10: an early purge (B has not consumed) is refused, with the reason, and writes nothing.
    let r = ops::purge(&mut pg, &required, Some(&topic), 0, 100, None, false)
        .await
        .unwrap();
    assert_eq!(r.purged, 0);
    assert_eq!(
        r.kept.get("a required consumer has not consumed it"),
        Some(&(n as u64))
    );
    assert!(
        r.examples[0]
            .1
            .contains(&format!("required consumer `{b}` has not consumed")),
        "{:?}",
        r.examples[0]
    );
    let one = ops::purge(
        &mut pg,
        &required,
        Some(&topic),
        0,
        100,
        Some(ids[0]),
        false,
    )
    .await
    .unwrap();
    assert_eq!(
        one.purged, 0,
        "an explicit purge of one event is refused too"
    );
    let left: i64 = pg
        .query_one(
            "SELECT count(*) FROM sealpost.outbox WHERE dest_topic = $1 AND state = 'PUBLISHED'",
            &[&topic],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, n as i64, "nothing needed by a consumer is gone");
    // B catches up. Inside a one-hour replay window rows are only RETAINED.
    let cb = tokio::spawn(sealpost_cli::consumer::run(
        cfg.clone(),
        nats.clone(),
        b.clone(),
        topic.clone(),
        stop.clone(),
        Arc::new(AtomicU64::new(0)),
    ));
    wait_for("consumer B", Duration::from_secs(30), async || {
        effects(&pg, &b).await.0 == n as i64
    })
    .await;
    let dry = ops::purge(&mut pg, &required, Some(&topic), 3_600, 100, None, true)
        .await
        .unwrap();
    assert_eq!((dry.purged, dry.retained), (0, n as u64));
    let ret = ops::purge(&mut pg, &required, Some(&topic), 3_600, 100, None, false)
        .await
        .unwrap();
    assert_eq!((ret.purged, ret.retained), (0, n as u64));
    // Past the window (0 s) and every consumer: purged in small batches.
    let done = ops::purge(&mut pg, &required, Some(&topic), 0, 7, None, false)
        .await
        .unwrap();
    assert_eq!(done.purged, n as u64);
    let purged: i64 = pg
        .query_one(
            "SELECT count(*) FROM sealpost.outbox WHERE dest_topic = $1 AND state = 'PURGED' AND length(payload) = 0",
            &[&topic],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(purged, n as i64);
    // A late duplicate ACK for a purged event is rejected, not resurrected.
    let v = store::accept_receipts(&mut pg, &receipts[..1])
        .await
        .unwrap();
    assert_eq!(
        v,
        vec![Accepted::Verdict(ReceiptVerdict::Reject(
            RejectReason::NotInFlight(sealpost_core::State::Purged)
        ))]
    );
    stop.store(true, Ordering::Relaxed);
    ca.await.unwrap().unwrap();
    cb.await.unwrap().unwrap();
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
    // The outbox lives in its own database, the consumer's inbox in `test`: restoring the
    // outbox does not roll back what consumers already applied.
    let outbox_db = "sealpost_f11";
    psql("test", &format!("DROP DATABASE IF EXISTS {outbox_db}"));
    psql("test", &format!("CREATE DATABASE {outbox_db}"));
    let consumer_cfg = Config::from_env().unwrap();
    let mut cfg = consumer_cfg.clone();
    cfg.database_url = format!("host=127.0.0.1 user=postgres dbname={outbox_db}");
    cfg.lease_ms = 2_000;
    cfg.ack_timeout_ms = 1_000;
    let mut pg = runtime::pg_connect(&cfg.database_url).await.unwrap();
    store::migrate(&pg).await.unwrap();
    let cpg = runtime::pg_connect(&consumer_cfg.database_url)
        .await
        .unwrap();
    store::migrate(&cpg).await.unwrap();
    sealpost_cli::demo::prepare(&cpg).await.unwrap();
    let topic = format!("F{}", runtime::owner_id() % 1_000_000);
    store::set_route(&pg, "orders", &cfg.nats_cluster, &topic)
        .await
        .unwrap();
    let nats = Nats::connect(&cfg.nats_url, &cfg.nats_cluster, Duration::from_secs(5))
        .await
        .unwrap();
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
    let stop = Arc::new(AtomicBool::new(false));
    let counters = Arc::new(Counters::default());
    let mut tasks = vec![
        tokio::spawn(runtime::dispatcher(
            cfg.clone(),
            Arc::new(nats.clone()),
            stop.clone(),
            counters.clone(),
        )),
        tokio::spawn(runtime::reconciler(
            cfg.clone(),
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
    stop.store(true, Ordering::Relaxed);
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
    let stop = Arc::new(AtomicBool::new(false));
    let tasks = vec![
        tokio::spawn(runtime::dispatcher(
            cfg.clone(),
            Arc::new(nats.clone()),
            stop.clone(),
            counters.clone(),
        )),
        tokio::spawn(runtime::reconciler(
            cfg.clone(),
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
    stop.store(true, Ordering::Relaxed);
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
}

#[tokio::test]
async fn reconcile_reports_out_of_band_ids_and_unconsumed_events() {
    let _g = LOCK.lock().await;
    let cfg = Config::from_env().unwrap();
    let mut pg = runtime::pg_connect(&cfg.database_url).await.unwrap();
    store::migrate(&pg).await.unwrap();
    sealpost_cli::demo::prepare(&pg).await.unwrap();
    let topic = format!("O{}", runtime::owner_id() % 1_000_000);
    let route = format!("r-{topic}");
    store::set_route(&pg, &route, &cfg.nats_cluster, &topic)
        .await
        .unwrap();
    let nats = Nats::connect(&cfg.nats_url, &cfg.nats_cluster, Duration::from_secs(5))
        .await
        .unwrap();
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
}
