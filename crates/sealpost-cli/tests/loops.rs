//! The real path's loop bugs (issue "the shell joins the proof"), each shown against the real
//! PostgreSQL and NATS JetStream on this machine: a send that stalls past its lease, rows
//! that cannot leave, a reconciler facing a broker it cannot ask, receipts and reports that
//! must commit together, poison and its operator exit, an acknowledged message lost at the
//! broker (R31), and a restore older than the duplicate window. Every test has its own
//! database and its own streams, so they run in parallel with each other and with the
//! other files' tests.

use crate::common;
use crate::teardown_nats;

use std::process::Command;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sealpost::runtime::CancellationToken;
use sealpost::runtime::{self, Config, Counters};
use sealpost::store;
use sealpost_core::dispatcher::{DispatchAction, DispatcherMachine, Submission};
use sealpost_core::envelope::{EventId, NewEvent};
use sealpost_core::port::{Broker, NeverSentReason, SendResult};
use sealpost_core::receipt::Receipt;
use sealpost_core::reconcile::{Lookup, ReconcileDecision};
use sealpost_core::SendOutcome;
use sealpost_nats::async_nats::jetstream;
use sealpost_nats::Nats;

const ADMIN_URL: &str = "host=127.0.0.1 user=postgres dbname=test";

/// A fresh database `sealpost_loops_<tag>` with the schema, and a config pointing at it
/// (the database is dropped when the returned guard drops).
async fn fresh(tag: &str) -> (common::TestDb, tokio_postgres::Client, String) {
    let db = format!("sealpost_loops_{tag}");
    let cfg = common::fresh_database(&db).await;
    let pg = runtime::pg_connect(&cfg.database_url).await.unwrap();
    store::migrate(&pg).await.expect("migrate");
    (cfg, pg, db)
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

fn topic(tag: &str) -> String {
    format!(
        "LOOPS{}{}",
        tag.to_uppercase(),
        runtime::owner_id() % 1_000_000
    )
}

/// A stream like `ensure_stream`'s, with a short duplicate window and an optional message
/// size limit, so a test can outlive the window in seconds.
async fn short_window_stream(n: &Nats, topic: &str, window: Duration, max_msg_size: i32) {
    n.js.create_stream(jetstream::stream::Config {
        name: topic.to_string(),
        subjects: vec![format!("sp.{topic}.>")],
        storage: jetstream::stream::StorageType::File,
        duplicate_window: window,
        max_message_size: max_msg_size,
        ..Default::default()
    })
    .await
    .expect("create stream");
}

async fn stream_messages(n: &Nats, topic: &str) -> u64 {
    let mut s = n.js.get_stream(topic).await.expect("stream");
    s.info().await.expect("info").state.messages
}

async fn enqueue(
    pg: &mut tokio_postgres::Client,
    route: &str,
    payload: &[u8],
    n: usize,
) -> Vec<EventId> {
    let tx = pg.transaction().await.unwrap();
    let mut ids = Vec::new();
    for i in 0..n {
        let id = EventId(*uuid::Uuid::now_v7().as_bytes());
        let agg = format!("o-{route}-{i}");
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
        ids.push(id);
    }
    tx.commit().await.unwrap();
    ids
}

/// Sends a claimed batch; every send must come back with a receipt.
async fn send_for_receipts(n: &Nats, b: &store::ClaimBatch) -> Vec<Receipt> {
    let reqs: Vec<_> = b
        .outgoing
        .iter()
        .map(store::Outgoing::send_request)
        .collect();
    n.send_batch(reqs, Instant::now() + Duration::from_secs(5))
        .await
        .into_iter()
        .map(|r| match r {
            SendResult::Receipt(r) => r,
            other => panic!("{other:?}"),
        })
        .collect()
}

async fn state_of(pg: &tokio_postgres::Client, id: EventId) -> String {
    pg.query_one(
        "SELECT state FROM sealpost.outbox WHERE event_id = $1",
        &[&uuid::Uuid::from_bytes(id.0)],
    )
    .await
    .unwrap()
    .get(0)
}

async fn all_published(pg: &tokio_postgres::Client, ids: &[EventId]) -> bool {
    for id in ids {
        if state_of(pg, *id).await != "PUBLISHED" {
            return false;
        }
    }
    true
}

async fn int(pg: &tokio_postgres::Client, sql: &str, id: EventId) -> i64 {
    pg.query_one(sql, &[&uuid::Uuid::from_bytes(id.0)])
        .await
        .unwrap()
        .get(0)
}

async fn wait_for<F: AsyncFn() -> bool>(what: &str, limit: Duration, f: F) {
    let start = Instant::now();
    while !f().await {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

struct Fleet {
    stop: CancellationToken,
    counters: Arc<Counters>,
    tasks: Vec<tokio::task::JoinHandle<Result<(), runtime::RunError>>>,
}

/// Runs one dispatcher (no reconciler) until every one of `ids` is `PUBLISHED`.
async fn publish(cfg: &Config, n: &Nats, pg: &tokio_postgres::Client, ids: &[EventId]) {
    let f = fleet(cfg, n, 1, false);
    wait_for("publication", Duration::from_secs(20), async || {
        all_published(pg, ids).await
    })
    .await;
    f.stop().await;
}

fn fleet(cfg: &Config, n: &Nats, dispatchers: usize, reconciler: bool) -> Fleet {
    let stop = CancellationToken::new();
    let counters = Arc::new(Counters::default());
    let tasks = runtime::spawn_fleet(
        cfg,
        &common::pg_source(cfg),
        &Arc::new(n.clone()),
        dispatchers,
        reconciler,
        &stop,
        &counters,
    );
    Fleet {
        stop,
        counters,
        tasks,
    }
}

impl Fleet {
    async fn stop(self) -> Arc<Counters> {
        self.stop.cancel();
        for t in self.tasks {
            t.await.unwrap().unwrap();
        }
        self.counters
    }
}

/// A transaction that drew its commit position before another one, and committed after a
/// dispatcher had claimed the other's row, lies behind the dispatcher's scan position: it was
/// found only by the next full scan (up to `rescan_every_ms`, 1 s by default; measured by the
/// `late_commit` example). Now the claims read the database's horizon and scan from behind
/// the positions that were not final, so the next claim after the commit finds it. The full
/// scan is put off for an hour here: without the horizon the event would wait that long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_committing_transaction_is_claimed_without_waiting_for_the_full_scan() {
    let (mut cfg, mut pg, _) = fresh("late").await;
    cfg.rescan_every_ms = 3_600_000;
    let n = nats(&cfg).await;
    let t = topic("late");
    let _stream = teardown_nats::stream(&common::nats_url(), &t);
    n.ensure_stream(&t).await.unwrap();
    store::set_route(&pg, "orders", common::NATS_CLUSTER, &t)
        .await
        .unwrap();
    let f = fleet(&cfg, &n, 1, false);
    // The fleet's first claims find nothing: the scan position and the horizon are set.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut a = runtime::pg_connect(&cfg.database_url).await.unwrap();
    let late_tx = a.transaction().await.unwrap();
    let late = EventId(*uuid::Uuid::now_v7().as_bytes());
    let ev = NewEvent {
        aggregate_type: "order",
        aggregate_id: "late",
        aggregate_version: 1,
        event_type: "order.created.v1",
        payload_schema: "order.created.v1",
        payload: b"{}",
        tenant: "t",
        occurred_at_ms: 1,
        creating_txid: 0,
    };
    store::enqueue(&late_tx, "orders", late, &ev, "late")
        .await
        .unwrap();
    // A later position, committed first and published: the scan position passes the late one.
    let early = enqueue(&mut pg, "orders", b"{}", 1).await;
    wait_for("the early event", Duration::from_secs(20), async || {
        all_published(&pg, &early).await
    })
    .await;
    let position = |id: EventId| {
        let pg = &pg;
        async move {
            int(
                pg,
                "SELECT committed_seq FROM sealpost.work WHERE event_id = $1",
                id,
            )
            .await
        }
    };
    assert!(
        position(early[0]).await > 0,
        "the early event has a commit position"
    );
    // The dispatcher claims on (and finds nothing) past the early event for a while.
    tokio::time::sleep(Duration::from_millis(500)).await;
    late_tx.commit().await.unwrap();
    assert!(
        position(late).await < position(early[0]).await,
        "the late event drew the lower position"
    );
    wait_for("the late event", Duration::from_secs(30), async || {
        all_published(&pg, &[late]).await
    })
    .await;
    f.stop().await;
}

/// Bug: a dispatcher that stalls between its claim and the send woke up after its row had
/// been moved to UNKNOWN, looked up as absent and retried by another, and sent a second copy.
/// Now the send carries the deadline the machine derives from the lease and is refused
/// ("never sent"); and even an adapter that ignored the deadline would be refused by the
/// broker itself (create-if-absent), beyond the duplicate window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_stalled_past_its_lease_never_leaves_and_the_broker_holds_one_copy() {
    let (mut cfg, mut pg, _) = fresh("stall").await;
    cfg.lease_ms = 1_500;
    cfg.ack_timeout_ms = 500;
    let n = nats(&cfg).await;
    let t = topic("stall");
    let _stream = teardown_nats::stream(&common::nats_url(), &t);
    short_window_stream(&n, &t, Duration::from_secs(1), -1).await;
    store::set_route(&pg, "orders", common::NATS_CLUSTER, &t)
        .await
        .unwrap();
    let id = enqueue(&mut pg, "orders", b"{}", 1).await[0];

    // Dispatcher A: the production machine, the production claim.
    let epoch = Instant::now();
    let ms = || epoch.elapsed().as_millis() as u64;
    let mut a = DispatcherMachine::new(cfg.dispatcher_config(), 0);
    assert!(matches!(
        a.poll_action(ms()),
        Some(DispatchAction::Claim { .. })
    ));
    let started = ms();
    let batch = store::claim(
        &mut pg,
        &store::ClaimRequest::new(1, 10, cfg.lease_ms).cluster(Some(common::NATS_CLUSTER)),
        None,
    )
    .await
    .unwrap();
    let Some(DispatchAction::Send {
        batch: a_batch,
        deadline_ms,
    }) = a.handle_claimed(ms(), batch.claimed(started))
    else {
        panic!("expected a send");
    };
    assert!(deadline_ms <= started + cfg.lease_ms - cfg.ack_timeout_ms);

    // A stalls past its lease. The row expires to UNKNOWN, the lookup proves it absent, the
    // reconciler grants a retry and dispatcher B publishes it.
    tokio::time::sleep(Duration::from_millis(cfg.lease_ms + 200)).await;
    store::claim_unknown(&mut pg, 9, 10, 5_000).await.unwrap();
    let items = store::claim_unknown(&mut pg, 9, 10, 5_000).await.unwrap();
    assert_eq!(
        items.len(),
        1,
        "the expired SENDING row is now the reconciler's"
    );
    let lookup = n.lookup(&items[0].destination, id, 0).await;
    assert_eq!(lookup, Lookup::Absent);
    let d = store::finish_reconcile(&mut pg, &items[0], &lookup)
        .await
        .unwrap();
    assert!(
        matches!(d, ReconcileDecision::RetrySameDestination { .. }),
        "{d:?}"
    );
    let b = store::claim_batch(&mut pg, 2, 10, 10_000).await.unwrap();
    let b_req: Vec<_> = b
        .outgoing
        .iter()
        .map(store::Outgoing::send_request)
        .collect();
    let b_res = n
        .send_batch(b_req, Instant::now() + Duration::from_secs(5))
        .await;
    let SendResult::Receipt(r) = &b_res[0] else {
        panic!("{b_res:?}")
    };
    store::accept_receipts(&mut pg, std::slice::from_ref(r))
        .await
        .unwrap();
    assert_eq!(state_of(&pg, id).await, "PUBLISHED");

    // A wakes up: its deadline has passed, so nothing leaves.
    let a_res = n
        .send_batch(a_batch.clone(), epoch + Duration::from_millis(deadline_ms))
        .await;
    assert_eq!(
        a_res,
        vec![SendResult::NeverSent(NeverSentReason::DeadlinePassed)]
    );
    let Some(DispatchAction::Submit(sub)) = a.handle_sent(ms(), a_res) else {
        panic!("expected a submission");
    };
    assert_eq!(sub.reports[0].outcome, SendOutcome::NeverSent);
    let done = store::submit(&mut pg, &sub, cfg.rejection_limit)
        .await
        .unwrap();
    assert!(
        matches!(
            done.reported[0],
            sealpost_core::SendOutcomeDecision::Audit(_)
        ),
        "A's claim is stale: its report is audit only"
    );
    assert_eq!(state_of(&pg, id).await, "PUBLISHED");

    // The second layer: past the 1 s duplicate window, a send that ignored its deadline is
    // refused by the broker itself, and the stream still holds one copy.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let ignored = n
        .send_batch(a_batch, Instant::now() + Duration::from_secs(5))
        .await;
    assert_eq!(ignored, vec![SendResult::AlreadyStored]);
    assert_eq!(
        stream_messages(&n, &t).await,
        1,
        "exactly one copy at the broker"
    );
}

/// Bug: rows of a cluster this process does not serve, or whose stream was deleted, came
/// back "never sent" uncounted and were re-claimed on every poll, inserting an attempt each
/// time and starving newer rows. Now the claim skips other clusters and "never sent" is
/// counted with a backoff, and the rows behind them are published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_that_cannot_leave_back_off_and_do_not_starve_the_rest() {
    let (cfg, mut pg, _) = fresh("neversent").await;
    let n = nats(&cfg).await;
    let good = topic("good");
    let _stream = teardown_nats::stream(&common::nats_url(), &good);
    n.ensure_stream(&good).await.unwrap();
    let missing = topic("missing"); // no stream: "deleted"
    store::set_route(&pg, "lost", common::NATS_CLUSTER, &missing)
        .await
        .unwrap();
    store::set_route(&pg, "far", "nats-far-away", &topic("far"))
        .await
        .unwrap();
    store::set_route(&pg, "orders", common::NATS_CLUSTER, &good)
        .await
        .unwrap();
    // The unsendable rows commit first: a batch in commit order would meet them first.
    let lost = enqueue(&mut pg, "lost", b"{}", 5).await;
    let far = enqueue(&mut pg, "far", b"{}", 5).await;
    let ok = enqueue(&mut pg, "orders", b"{}", 20).await;

    let f = fleet(&cfg, &n, 1, false);
    let t0 = Instant::now();
    wait_for("the sendable rows", Duration::from_secs(20), async || {
        all_published(&pg, &ok).await
    })
    .await;
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    let ran = t0.elapsed();
    let c = f.stop().await;

    for id in &far {
        assert_eq!(state_of(&pg, *id).await, "PENDING");
        let attempts = int(
            &pg,
            "SELECT count(*) FROM sealpost.attempts WHERE event_id = $1",
            *id,
        )
        .await;
        assert_eq!(
            attempts, 0,
            "a row of another cluster is never claimed here"
        );
    }
    // Backoff 1 s, 2 s, 4 s ...: at most about log2(run time) + 1 tries each.
    let tries_max = (ran.as_secs_f64().log2().ceil() as i64) + 2;
    for id in &lost {
        assert_eq!(state_of(&pg, *id).await, "PENDING");
        let never_sent = int(
            &pg,
            "SELECT never_sent::bigint FROM sealpost.outbox WHERE event_id = $1",
            *id,
        )
        .await;
        let attempts = int(
            &pg,
            "SELECT count(*) FROM sealpost.attempts WHERE event_id = $1",
            *id,
        )
        .await;
        assert!(never_sent >= 1, "the failure is counted");
        assert_eq!(attempts, never_sent, "one attempt per try, no hot loop");
        assert!(
            never_sent <= tries_max,
            "{never_sent} tries in {ran:?}: the backoff was not honoured"
        );
        let why: String = pg
            .query_one(
                "SELECT last_error FROM sealpost.outbox WHERE event_id = $1",
                &[&uuid::Uuid::from_bytes(id.0)],
            )
            .await
            .unwrap()
            .get(0);
        assert!(why.contains("destination missing"), "{why}");
    }
    assert!(c.never_sent.load(Ordering::Relaxed) >= 5);
}

/// Bug: with the broker unable to answer, the reconciler released "stay unknown" rows at
/// once and spun on the same oldest rows; newer unknowns were never looked up and the
/// unknown-age alert (checked only when a scan was empty) never fired. Now each row waits
/// out its own backoff, every unknown row gets its lookup, and the alert fires while busy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reconciler_backs_off_reaches_every_unknown_row_and_alerts_while_busy() {
    let (mut cfg, mut pg, _) = fresh("spin").await;
    cfg.reconcile_batch_max = 10;
    cfg.unknown_alert_s = 0;
    cfg.unknown_check_every_ms = 200;
    cfg.verify_every_ms = 0;
    let n = nats(&cfg).await;
    // A stream that does not exist: every lookup answers "unavailable".
    store::set_route(&pg, "orders", common::NATS_CLUSTER, &topic("gone"))
        .await
        .unwrap();
    let ids = enqueue(&mut pg, "orders", b"{}", 30).await;
    let b = store::claim_batch(&mut pg, 1, 100, 10_000).await.unwrap();
    let reports: Vec<_> = b
        .outgoing
        .iter()
        .map(|o| store::OutcomeReport {
            event_id: o.event_id,
            member: 0,
            token: o.token,
            attempt_id: o.attempt_id,
            outcome: SendOutcome::AckTimeout,
            detail: "test: no answer".into(),
        })
        .collect();
    store::report_outcomes(&mut pg, &reports, 5).await.unwrap();

    let f = fleet(&cfg, &n, 0, true);
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    let ran = t0.elapsed();
    let c = f.stop().await;

    let tries_max = (ran.as_secs_f64().log2().ceil() as i64) + 2;
    for id in &ids {
        let lookups = int(
            &pg,
            "SELECT lookups::bigint FROM sealpost.outbox WHERE event_id = $1",
            *id,
        )
        .await;
        assert!(
            lookups >= 1,
            "every unknown row is looked up, not only the oldest batch"
        );
        assert!(
            lookups <= tries_max,
            "{lookups} lookups in {ran:?}: the reconciler spins"
        );
        assert_eq!(state_of(&pg, *id).await, "DISPATCH_UNKNOWN");
    }
    assert!(
        c.alerts.load(Ordering::Relaxed) >= 1,
        "the unknown-age alert fires while the reconciler is busy"
    );
}

/// Bug: receipts and outcome reports committed in two transactions, so a retry after the
/// second failed recorded the same ACKs again as duplicates. Now one transaction: a failure
/// writes nothing, the retry writes everything once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipts_and_reports_commit_together_or_not_at_all() {
    let (cfg, mut pg, _) = fresh("submit").await;
    let n = nats(&cfg).await;
    let t = topic("submit");
    let _stream = teardown_nats::stream(&common::nats_url(), &t);
    n.ensure_stream(&t).await.unwrap();
    store::set_route(&pg, "orders", common::NATS_CLUSTER, &t)
        .await
        .unwrap();
    let ids = enqueue(&mut pg, "orders", b"{}", 2).await;
    let b = store::claim_batch(&mut pg, 1, 10, 10_000).await.unwrap();
    let reqs: Vec<_> = b
        .outgoing
        .iter()
        .map(store::Outgoing::send_request)
        .collect();
    let res = n
        .send_batch(reqs, Instant::now() + Duration::from_secs(5))
        .await;
    let SendResult::Receipt(r0) = res[0].clone() else {
        panic!("{res:?}")
    };
    let o1 = &b.outgoing[1];
    let sub = Submission {
        receipts: vec![r0],
        reports: vec![store::OutcomeReport {
            event_id: o1.event_id,
            member: 0,
            token: o1.token,
            attempt_id: o1.attempt_id,
            outcome: SendOutcome::AckTimeout,
            detail: "test".into(),
        }],
    };
    // Another transaction holds the reported row: the submission fails after its receipt
    // part was written inside the transaction.
    let mut blocker = runtime::pg_connect(&cfg.database_url).await.unwrap();
    let btx = blocker.transaction().await.unwrap();
    btx.execute(
        "SELECT 1 FROM sealpost.work WHERE event_id = $1 FOR UPDATE",
        &[&uuid::Uuid::from_bytes(ids[1].0)],
    )
    .await
    .unwrap();
    pg.batch_execute("SET lock_timeout = '300ms'")
        .await
        .unwrap();
    let err = store::submit(&mut pg, &sub, 5).await.unwrap_err();
    assert!(
        err.to_string().contains("lock timeout") || err.to_string().contains("55P03"),
        "the database's own words: {err}"
    );
    assert_eq!(
        receipt_rows(&pg).await,
        0,
        "nothing of a failed submission stays"
    );
    assert_eq!(state_of(&pg, ids[0]).await, "SENDING");
    btx.rollback().await.unwrap();
    // The machine retries the same submission: everything counts once.
    let done = store::submit(&mut pg, &sub, 5).await.unwrap();
    assert_eq!(
        done.accepted,
        vec![store::Accepted::Verdict(
            sealpost_core::ReceiptVerdict::Primary
        )]
    );
    assert_eq!(
        receipt_rows(&pg).await,
        1,
        "one primary receipt, no duplicate"
    );
    assert_eq!(state_of(&pg, ids[0]).await, "PUBLISHED");
    assert_eq!(state_of(&pg, ids[1]).await, "DISPATCH_UNKNOWN");
}

/// The guarded acceptance (`claim` with a `Held` + `submit_held`): an ordinary ACK for a row
/// the dispatcher holds as its claim wrote it is accepted by one guarded write; a row someone
/// wrote since takes the locked path and gets the verdict that path gives; and when the
/// locked part fails, the retried submission reports the guarded verdicts again without
/// accepting anything twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarded_acceptance_falls_back_when_the_row_changed_and_never_accepts_twice() {
    let (cfg, mut pg, _) = fresh("guarded").await;
    let n = nats(&cfg).await;
    let t = topic("guarded");
    let _stream = teardown_nats::stream(&common::nats_url(), &t);
    n.ensure_stream(&t).await.unwrap();
    store::set_route(&pg, "orders", common::NATS_CLUSTER, &t)
        .await
        .unwrap();
    let ids = enqueue(&mut pg, "orders", b"{}", 3).await;
    let mut held = store::Held::default();
    let b = store::claim(
        &mut pg,
        &store::ClaimRequest::new(1, 10, 10_000).cluster(Some(common::NATS_CLUSTER)),
        Some(&mut held),
    )
    .await
    .unwrap();
    assert_eq!(b.outgoing.len(), 3);
    assert_eq!(held.len(), 3, "every sent row is held");
    let receipts = send_for_receipts(&n, &b).await;
    let pos = |id: EventId| b.outgoing.iter().position(|o| o.event_id == id).unwrap();
    let (i0, i1, i2) = (pos(ids[0]), pos(ids[1]), pos(ids[2]));
    // Row 2: its receipt was accepted meanwhile by the locked path (as a lookup would).
    store::accept_receipts(&mut pg, std::slice::from_ref(&receipts[i2]))
        .await
        .unwrap();
    // Row 1: written by someone else (and now locked by them).
    pg.execute(
        "UPDATE sealpost.work SET last_error = 'touched' WHERE event_id = $1",
        &[&uuid::Uuid::from_bytes(ids[1].0)],
    )
    .await
    .unwrap();
    let mut blocker = runtime::pg_connect(&cfg.database_url).await.unwrap();
    let btx = blocker.transaction().await.unwrap();
    btx.execute(
        "SELECT 1 FROM sealpost.work WHERE event_id = $1 FOR UPDATE",
        &[&uuid::Uuid::from_bytes(ids[1].0)],
    )
    .await
    .unwrap();
    pg.batch_execute("SET lock_timeout = '300ms'")
        .await
        .unwrap();
    let sub = Submission {
        receipts: receipts.clone(),
        reports: vec![],
    };
    let err = store::submit_held(&mut pg, &sub, 5, &mut held)
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("lock timeout") || err.to_string().contains("55P03"),
        "the database's own words: {err}"
    );
    assert_eq!(
        state_of(&pg, ids[0]).await,
        "PUBLISHED",
        "row 0 was accepted by the guarded write before the locked part failed"
    );
    assert_eq!(state_of(&pg, ids[1]).await, "SENDING");
    btx.rollback().await.unwrap();
    let evidence = async |pg: &tokio_postgres::Client| -> i64 {
        // The receipt rows kept as evidence (the primary receipts live in the work rows).
        pg.query_one("SELECT count(*) FROM sealpost.receipt", &[])
            .await
            .unwrap()
            .get(0)
    };
    let evidence_before = evidence(&pg).await;
    // The machine retries the same submission.
    let done = store::submit_held(&mut pg, &sub, 5, &mut held)
        .await
        .unwrap();
    use sealpost_core::{DuplicateKind, ReceiptVerdict};
    let mut expect = vec![store::Accepted::UnknownEvent; 3];
    expect[i0] = store::Accepted::Verdict(ReceiptVerdict::Primary);
    expect[i1] = store::Accepted::Verdict(ReceiptVerdict::Primary);
    expect[i2] = store::Accepted::Verdict(ReceiptVerdict::Duplicate(DuplicateKind::SamePosition));
    assert_eq!(done.accepted, expect);
    assert_eq!(done.guarded, 1, "only row 0 went the guarded way");
    assert!(held.is_empty(), "answered rows are no longer held");
    assert_eq!(
        evidence(&pg).await,
        evidence_before + 1,
        "one piece of evidence, row 2's second receipt; row 0 is not accepted twice"
    );
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(state_of(&pg, *id).await, "PUBLISHED");
        let seq = int(
            &pg,
            "SELECT primary_sequence FROM sealpost.work WHERE event_id = $1",
            *id,
        )
        .await;
        assert_eq!(
            seq as u64,
            receipts[pos(*id)].sequence,
            "row {i}'s primary receipt"
        );
    }
    let published_at = int(
        &pg,
        "SELECT published_at_ms - created_at_ms FROM sealpost.outbox WHERE event_id = $1",
        ids[0],
    )
    .await;
    assert!(
        (0..60_000).contains(&published_at),
        "the guarded write stamps the database clock as the claim read it: {published_at} ms after the commit"
    );
}

/// The dispatcher's claim and guarded-acceptance statements are prepared once per connection
/// and kept in `Held`. They belong to that connection: if it is replaced and `Held` is not
/// told, the next claim fails with the database's own words, claims nothing and drops them,
/// and the one after works; the same holds for a submission, which then accepts every
/// receipt once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_statements_are_dropped_with_their_connection() {
    let (cfg, mut pg, _) = fresh("prepared").await;
    let n = nats(&cfg).await;
    let t = topic("prepared");
    let _stream = teardown_nats::stream(&common::nats_url(), &t);
    n.ensure_stream(&t).await.unwrap();
    store::set_route(&pg, "orders", common::NATS_CLUSTER, &t)
        .await
        .unwrap();
    let ids = enqueue(&mut pg, "orders", b"{}", 4).await;
    let cluster = common::NATS_CLUSTER;
    let mut held = store::Held::default();
    let first = store::claim(
        &mut pg,
        &store::ClaimRequest::new(1, 2, 10_000).cluster(Some(cluster)),
        Some(&mut held),
    )
    .await
    .unwrap();
    assert_eq!(first.outgoing.len(), 2);
    let sending = async |pg: &tokio_postgres::Client| -> i64 {
        pg.query_one(
            "SELECT count(*) FROM sealpost.outbox WHERE state = 'SENDING'",
            &[],
        )
        .await
        .unwrap()
        .get(0)
    };
    // The connection is replaced behind `held`'s back.
    let mut pg = runtime::pg_connect(&cfg.database_url).await.unwrap();
    let err = store::claim(
        &mut pg,
        &store::ClaimRequest::new(1, 2, 10_000).cluster(Some(cluster)),
        Some(&mut held),
    )
    .await
    .unwrap_err();
    assert!(
        err.to_string().contains("prepared statement"),
        "the database's own words: {err}"
    );
    assert_eq!(sending(&pg).await, 2, "the failed claim claimed nothing");
    let second = store::claim(
        &mut pg,
        &store::ClaimRequest::new(1, 2, 10_000).cluster(Some(cluster)),
        Some(&mut held),
    )
    .await
    .unwrap();
    assert_eq!(second.outgoing.len(), 2);
    assert_eq!(sending(&pg).await, 4);
    let submission = async |b: &store::ClaimBatch| -> Submission {
        Submission {
            receipts: send_for_receipts(&n, b).await,
            reports: vec![],
        }
    };
    use sealpost_core::ReceiptVerdict;
    let primary = vec![store::Accepted::Verdict(ReceiptVerdict::Primary); 2];
    // The first batch's acceptance prepares the guarded write on this connection.
    let sub = submission(&first).await;
    let done = store::submit_held(&mut pg, &sub, 5, &mut held)
        .await
        .unwrap();
    assert_eq!((done.accepted, done.guarded), (primary.clone(), 2));
    // Replaced again, before the second batch's acceptance.
    let mut pg = runtime::pg_connect(&cfg.database_url).await.unwrap();
    let sub = submission(&second).await;
    let err = store::submit_held(&mut pg, &sub, 5, &mut held)
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("prepared statement"),
        "the database's own words: {err}"
    );
    assert_eq!(
        sending(&pg).await,
        2,
        "the failed submission accepted nothing"
    );
    let done = store::submit_held(&mut pg, &sub, 5, &mut held)
        .await
        .unwrap();
    assert_eq!(
        (done.accepted, done.guarded),
        (primary, 2),
        "both rows still as their claim wrote them, each accepted once"
    );
    assert!(all_published(&pg, &ids).await);
    assert_eq!(stream_messages(&n, &t).await, 4);
}

/// Bug: the adapter never reported a permanent refusal, so the rejection limit did nothing
/// and a quarantined row could never be released. Now a message over the stream's size limit
/// is refused, counted, quarantined with its reason at the limit, shown by `status`, and
/// released by `sealpost release`, audited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_is_quarantined_with_its_reason_and_released_by_the_operator() {
    let (mut cfg, mut pg, _) = fresh("poison").await;
    cfg.rejection_limit = 2;
    let n = nats(&cfg).await;
    let t = topic("poison");
    let _stream = teardown_nats::stream(&common::nats_url(), &t);
    short_window_stream(&n, &t, Duration::from_secs(120), 1_024).await;
    store::set_route(&pg, "orders", common::NATS_CLUSTER, &t)
        .await
        .unwrap();
    let poison = enqueue(&mut pg, "orders", &[b'x'; 4_096], 1).await[0];
    let fine = enqueue(&mut pg, "orders", b"{}", 1).await[0];

    let f = fleet(&cfg, &n, 1, false);
    wait_for("the quarantine", Duration::from_secs(20), async || {
        state_of(&pg, poison).await == "QUARANTINED"
    })
    .await;
    wait_for("the good row", Duration::from_secs(20), async || {
        state_of(&pg, fine).await == "PUBLISHED"
    })
    .await;
    let c = f.stop().await;
    assert_eq!(c.refused.load(Ordering::Relaxed), 2);

    let s = store::status(&pg).await.unwrap();
    let (qid, why) = &s.quarantined_rows[0];
    assert_eq!(qid, &poison.to_string());
    assert!(
        why.contains("PayloadTooLarge"),
        "the reason is shown: {why}"
    );
    let q = int(
        &pg,
        "SELECT count(*) FROM sealpost.quarantine WHERE event_id = $1 AND reason = 'Poison'",
        poison,
    )
    .await;
    assert_eq!(q, 1);

    // The operator's exit, through the real binary.
    let release = |id: String| {
        Command::new(env!("CARGO_BIN_EXE_sealpost"))
            .args([
                "release",
                &id,
                "--operator",
                "test",
                "--reason",
                "limit raised",
            ])
            .env("DATABASE_URL", &cfg.database_url)
            .output()
            .unwrap()
    };
    let out = release(poison.to_string());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(state_of(&pg, poison).await, "PENDING");
    let audited = int(
        &pg,
        "SELECT count(*) FROM sealpost.audit WHERE event_id = $1 AND what = 'quarantine released' AND detail LIKE 'by test:%'",
        poison,
    )
    .await;
    assert_eq!(audited, 1);
    // Releasing what is not quarantined is refused with the row's state.
    let again = release(poison.to_string());
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("not quarantined (state PENDING)"));
    let unknown = release(EventId([7; 16]).to_string());
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("no event"));
}

/// Bug: published events were never checked again. Now the reconciler's rolling
/// verification pass looks PUBLISHED rows up at the broker; a stream purged behind
/// Sealpost's back shows up as "published but missing at the broker" in `status` and in the
/// `reconcile` report (R31).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acknowledged_message_lost_at_the_broker_is_a_finding() {
    let (mut cfg, mut pg, _) = fresh("verify").await;
    cfg.verify_every_ms = 100;
    let n = nats(&cfg).await;
    let t = topic("verify");
    let _stream = teardown_nats::stream(&common::nats_url(), &t);
    n.ensure_stream(&t).await.unwrap();
    store::set_route(&pg, "orders", common::NATS_CLUSTER, &t)
        .await
        .unwrap();
    let ids = enqueue(&mut pg, "orders", b"{}", 3).await;
    publish(&cfg, &n, &pg, &ids).await;
    // Lost behind Sealpost's back.
    n.js.get_stream(&t).await.unwrap().purge().await.unwrap();

    let f = fleet(&cfg, &n, 0, true);
    wait_for("the findings", Duration::from_secs(20), async || {
        store::status(&pg).await.unwrap().missing_at_broker == 3
    })
    .await;
    let c = f.stop().await;
    assert!(c.missing.load(Ordering::Relaxed) >= 3);
    let report = sealpost_cli::ops::reconcile(
        &pg,
        None::<&sealpost::ops::NoScan>,
        &sealpost_cli::ops::ReconcileOptions {
            pending_age_s: 3_600,
            unconsumed_age_s: 3_600,
            unknown_age_s: 3_600,
            consumers: vec![],
            streams: vec![],
            scan_max: 0,
        },
    )
    .await
    .unwrap();
    let f = report
        .findings
        .iter()
        .find(|f| f.kind == "published_missing_at_broker")
        .expect("the finding is in the reconcile report");
    assert_eq!(f.count, 3);
}

/// Bug: a verification batch read as many rows as it took to find its published ones, and
/// with statistics taken while a backlog was `PENDING` PostgreSQL chose a sequential scan of
/// the whole `work` table for it (0.5 s and 410,000 blocks per batch after a 5M-row cleanup,
/// every few seconds while the backlog drained). Now a batch examines a window of rows after
/// the cursor (`verify_window_rows`): a window of a backlog not yet published answers an
/// empty batch and the cursor moves past it, not back to the start; the published rows
/// behind the backlog are reached a window at a time, then the pass wraps around.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_verification_pass_walks_a_backlog_a_window_at_a_time() {
    let (cfg, mut pg, _) = fresh("verifywindow").await;
    let n = nats(&cfg).await;
    let t = topic("verifywindow");
    let _stream = teardown_nats::stream(&common::nats_url(), &t);
    n.ensure_stream(&t).await.unwrap();
    // A backlog no dispatcher of this fleet serves (another cluster), committed first, so
    // it lies before the published rows in primary-key (UUIDv7) order.
    store::set_route(&pg, "parked", "nobody-serves-this", &t)
        .await
        .unwrap();
    let window = sealpost_core::reconciler::verify_window_rows(100);
    let backlog = enqueue(&mut pg, "parked", b"{}", 2 * window + window / 2).await;
    store::set_route(&pg, "orders", common::NATS_CLUSTER, &t)
        .await
        .unwrap();
    let ids = enqueue(&mut pg, "orders", b"{}", 3).await;
    publish(&cfg, &n, &pg, &ids).await;
    assert_eq!(state_of(&pg, backlog[0]).await, "PENDING");

    let mut batches = Vec::new();
    for _ in 0..5 {
        let items = store::published_after_cursor(&mut pg, 100).await.unwrap();
        batches.push(items.iter().map(|i| i.event_id).collect::<Vec<_>>());
    }
    let sizes: Vec<usize> = batches.iter().map(Vec::len).collect();
    // Two windows of backlog, the last half window with the three published rows, the
    // wrap-around, and the first window of backlog again.
    assert_eq!(sizes, [0, 0, 3, 0, 0], "{batches:?}");
    assert_eq!(batches[2], ids);
}

async fn receipt_rows(pg: &tokio_postgres::Client) -> i64 {
    pg.query_one("SELECT count(*) FROM sealpost.receipts", &[])
        .await
        .unwrap()
        .get(0)
}

fn pg_tool(tool: &str, args: &[&str]) {
    let ok = Command::new(tool)
        .args(["-h", "127.0.0.1", "-U", "postgres"])
        .args(args)
        .status()
        .unwrap();
    assert!(ok.success(), "{tool} {args:?} failed");
}

/// Bug: after a restore older than the duplicate window, a restored SENDING row whose copy
/// was at the broker under an attempt the restored database never saw was retried and stored
/// twice, and restored PENDING rows were republished without a lookup. Now the broker
/// refuses the second copy (create-if-absent), the reconciler looks it up, and a copy whose
/// event id, digests and destination match the sealed envelope fills the slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_older_than_the_duplicate_window_adopts_the_copies_at_the_broker() {
    let (mut cfg, mut pg, db) = fresh("restore").await;
    cfg.lease_ms = 1_000;
    cfg.ack_timeout_ms = 500;
    let n = nats(&cfg).await;
    let t = topic("restore");
    let _stream = teardown_nats::stream(&common::nats_url(), &t);
    short_window_stream(&n, &t, Duration::from_secs(1), -1).await;
    store::set_route(&pg, "orders", common::NATS_CLUSTER, &t)
        .await
        .unwrap();
    let ids = enqueue(&mut pg, "orders", b"{}", 4).await;
    // Two rows are SENDING (attempts registered) when the backup is taken, two PENDING.
    let b = store::claim_batch(&mut pg, 1, 2, cfg.lease_ms)
        .await
        .unwrap();
    assert_eq!(b.outgoing.len(), 2);
    let dump = std::env::temp_dir().join(format!("sealpost-loops-{}.dump", std::process::id()));
    pg_tool("pg_dump", &["-d", &db, "-Fc", "-f", dump.to_str().unwrap()]);

    // Everything is published after the backup.
    let receipts = send_for_receipts(&n, &b).await;
    store::accept_receipts(&mut pg, &receipts).await.unwrap();
    let f = fleet(&cfg, &n, 1, true);
    wait_for("publication", Duration::from_secs(20), async || {
        all_published(&pg, &ids).await
    })
    .await;
    f.stop().await;
    assert_eq!(stream_messages(&n, &t).await, 4);
    let seqs_before: Vec<i64> = {
        let mut v = Vec::new();
        for id in &ids {
            v.push(
                int(
                    &pg,
                    "SELECT primary_sequence FROM sealpost.outbox WHERE event_id = $1",
                    *id,
                )
                .await,
            );
        }
        v
    };
    drop(pg);

    // The restore, older than the 1 s duplicate window.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let admin = runtime::pg_connect(ADMIN_URL).await.unwrap();
    admin
        .batch_execute(&format!("DROP DATABASE {db} WITH (FORCE)"))
        .await
        .unwrap();
    admin
        .batch_execute(&format!("CREATE DATABASE {db}"))
        .await
        .unwrap();
    pg_tool("pg_restore", &["-d", &db, dump.to_str().unwrap()]);
    let _ = std::fs::remove_file(&dump);
    let pg = runtime::pg_connect(&cfg.database_url).await.unwrap();
    assert_eq!(state_of(&pg, ids[0]).await, "SENDING");
    assert_eq!(state_of(&pg, ids[3]).await, "PENDING");

    let f = fleet(&cfg, &n, 1, true);
    wait_for(
        "publication after the restore",
        Duration::from_secs(30),
        async || all_published(&pg, &ids).await,
    )
    .await;
    f.stop().await;
    assert_eq!(
        stream_messages(&n, &t).await,
        4,
        "no second copy: the broker refused them and the lookups found the first"
    );
    for (id, before) in ids.iter().zip(seqs_before) {
        let seq = int(
            &pg,
            "SELECT primary_sequence FROM sealpost.outbox WHERE event_id = $1",
            *id,
        )
        .await;
        assert_eq!(
            seq, before,
            "the slot holds the copy stored before the restore"
        );
    }
}
