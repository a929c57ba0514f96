//! The upgrade drill (R25, issue 24 item 5), on NATS JetStream and on RabbitMQ, against the
//! real PostgreSQL and brokers: two implementations of the dispatcher ("v1", the incumbent,
//! and "v2", the candidate: the same build under two implementation ids) run side by side
//! over one outbox, each as a fleet of two dispatchers, a reconciler and a shadow reader,
//! while a library consumer applies every event into its inbox.
//!
//! 1. **Shadow.** v2 claims nothing; its shadow reads back every message v1 publishes and
//!    finds it identical to what v2 would send.
//! 2. **5% takeover** of `order.created`: v2 claims the events of that type whose aggregate
//!    falls in the first 5% of share buckets, v1 the rest. v2's fleet is killed (its tasks
//!    aborted, as a process dies) right after the batch commits and started again.
//! 3. **Rollback** while the next batch is on its way, and v1's fleet killed and started
//!    again in the middle of it: whatever v2 claimed before the switch converges into its
//!    slot; nothing after it is v2's.
//! 4. **Promote** (shadow, takeover, promote): v2 claims every row; v1's fleet is killed.
//!
//! Proven: every event is `PUBLISHED`, by the implementation the alias named when it was
//! claimed; nothing is unknown at the end and the reconciliation report has no finding;
//! the consumer applied each event exactly once; and where the broker refuses a second
//! copy (NATS, a subject per event) it holds exactly one per event. RabbitMQ cannot refuse
//! one: a kill between publish and receipt may leave a second copy there, which the inbox
//! absorbs (counted and printed).
//!
//! Each run has its own databases and its own stream or exchange.

use std::sync::Arc;
use std::time::Duration;

use crate::common;
use crate::rollout_support as support;
use crate::teardown_nats;
use crate::teardown_rabbitmq;

use common::{count, wait_for};
use futures::future::BoxFuture;
use sealpost::consumer::{self, Databases, Delivery, HandlerError, Options};
use sealpost::ops::{self, NoScan, ReconcileOptions};
use sealpost::runtime::{self, CancellationToken, Config, Counters, RunError};
use sealpost::store::{self, RolloutCommand};
use sealpost_core::port::Broker;
use sealpost_core::rollout::{self, Alias, Stage};
use sealpost_core::subscription::Subscription;
use sealpost_nats::async_nats::jetstream;
use sealpost_nats::Nats;
use support::{CREATED, PAID};

const ROUTE: &str = "orders";

/// A fleet of one implementation: two dispatchers, the shadow reader and a reconciler.
struct Fleet {
    stop: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<Result<(), RunError>>>,
}

impl Fleet {
    fn start<B: Broker>(cfg: &Config, implementation: &str, broker: &Arc<B>) -> Fleet {
        let cfg = Config {
            implementation: implementation.to_string(),
            ..cfg.clone()
        };
        let stop = CancellationToken::new();
        let tasks = runtime::spawn_fleet(
            &cfg,
            &common::pg_source(&cfg),
            broker,
            2,
            true,
            &stop,
            &Arc::new(Counters::default()),
        );
        Fleet { stop, tasks }
    }

    /// Killed: every task dropped where it stands (a claim committed, a message on the
    /// wire, a receipt not yet accepted), as when the process dies.
    async fn kill(self) {
        for t in &self.tasks {
            t.abort();
        }
        for t in self.tasks {
            let _ = t.await;
        }
    }

    async fn stop(self) {
        self.stop.cancel();
        for t in self.tasks {
            t.await.unwrap().unwrap();
        }
    }
}

/// Kills `fleet` as soon as `implementation` has a row `SENDING` (its claim committed, the
/// message about to leave or on the wire), or after 10 s; returns how many it had.
async fn kill_while_sending(
    pg: &tokio_postgres::Client,
    fleet: Fleet,
    implementation: &str,
) -> i64 {
    // The rows of its claims not yet answered: those its leases list (a claim's first sends;
    // a lease goes once its rows are answered) and those whose own claim is `SENDING`. Read
    // from the tables, not the views: the poll must be quick, or the batch it sees is
    // answered before the kill lands.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut sending = 0;
    while std::time::Instant::now() < deadline {
        sending = pg
            .query_one(
                "SELECT (SELECT coalesce(sum(cardinality(l.positions)), 0)::int8
                           FROM sealpost.lease l JOIN sealpost.implementation i ON i.owner = l.owner
                          WHERE i.implementation = $1)
                      + (SELECT count(*) FROM sealpost.work w JOIN sealpost.implementation i
                           ON i.owner = w.claim_owner
                          WHERE w.state = 'SENDING' AND i.implementation = $1)",
                &[&implementation],
            )
            .await
            .unwrap()
            .get(0);
        if sending > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    fleet.kill().await;
    sending
}

async fn enqueue(pg: &mut tokio_postgres::Client, prefix: &str, n: usize) {
    support::enqueue(pg, ROUTE, prefix, n).await;
}

async fn wait_published(pg: &tokio_postgres::Client, prefix: &'static str) {
    wait_for(prefix, Duration::from_secs(120), async || {
        support::published(pg, prefix).await
    })
    .await;
}

async fn switch(pg: &mut tokio_postgres::Client, cmd: RolloutCommand) -> Alias {
    support::switch(pg, ROUTE, cmd).await.0
}

async fn compared(pg: &tokio_postgres::Client) -> (u64, u64, u64) {
    store::rollout_status(pg)
        .await
        .unwrap()
        .shadows
        .first()
        .map_or((0, 0, 0), |s| (s.compared, s.matched, s.unexplained))
}

/// Every event of `prefix` published by the implementation `allowed` accepts.
async fn sent_by(
    pg: &tokio_postgres::Client,
    prefix: &str,
    allowed: impl Fn(&str, &str, &str) -> bool,
) -> (usize, usize) {
    let (mut v1, mut v2) = (0, 0);
    for e in support::senders(pg, prefix).await {
        let (ty, agg) = (&e.event_type, &e.aggregate_id);
        assert_eq!(e.state, "PUBLISHED", "{agg}");
        let who = e
            .accepted_from
            .unwrap_or_else(|| panic!("{agg}: no announced sender"));
        assert!(allowed(ty, agg, &who), "{agg} ({ty}) sent by {who}");
        if who == "v1" {
            v1 += 1;
        } else {
            v2 += 1;
        }
    }
    (v1, v2)
}

fn handler() -> impl for<'a> Fn(
    &'a tokio_postgres::Transaction<'a>,
    &'a Delivery,
) -> BoxFuture<'a, Result<(), HandlerError>>
       + Send
       + Sync
       + 'static {
    |tx, d| {
        Box::pin(async move {
            tx.execute(
                "INSERT INTO applied VALUES ($1)",
                &[&uuid::Uuid::from_bytes(d.event_id.0)],
            )
            .await?;
            Ok(())
        })
    }
}

/// The drill over `broker`, consuming through `subscription`; `copies` counts what the
/// broker holds for the route, `refuses_second_copy` says whether it must be exactly one
/// per event.
async fn drill<B, S>(
    name: &str,
    cluster: &str,
    topic: &str,
    broker: B,
    subscription: S,
    mut copies: impl AsyncFnMut() -> u64,
    refuses_second_copy: bool,
) where
    B: Broker,
    S: Subscription + 'static,
    S::Error: Send,
{
    let n = runtime::owner_id() % 1_000_000;
    let outbox = common::fresh_database(&format!("sealpost_upgrade_{name}_{n}")).await;
    let inbox = common::fresh_database(&format!("sealpost_upgrade_{name}_{n}_inbox")).await;
    let cfg = Config {
        database_url: outbox.database_url.clone(),
        lease_ms: 3_000,
        ack_timeout_ms: 1_000,
        reconcile_every_ms: 200,
        ..Config::default()
    };
    let mut pg = runtime::pg_connect(&outbox.database_url).await.unwrap();
    store::migrate(&pg).await.unwrap();
    store::set_route(&pg, ROUTE, cluster, topic).await.unwrap();
    let ipg = runtime::pg_connect(&inbox.database_url).await.unwrap();
    store::migrate(&ipg).await.unwrap();
    ipg.batch_execute("CREATE TABLE applied (event_id uuid NOT NULL)")
        .await
        .unwrap();
    let broker = Arc::new(broker);
    let stop_consumer = CancellationToken::new();
    let consumer = tokio::spawn(consumer::run(
        subscription,
        Databases::from_urls(&inbox.database_url, None),
        Options::new("c1"),
        handler(),
        stop_consumer.clone(),
    ));

    // The incumbent runs and announces itself; the shadow names it.
    let v1 = Fleet::start(&cfg, "v1", &broker);
    wait_for("v1 to announce", Duration::from_secs(30), async || {
        count(
            &pg,
            "SELECT count(*) FROM sealpost.implementation WHERE implementation = 'v1' AND role = 'dispatcher'",
        )
        .await
            == 2
    })
    .await;

    // 1. Shadow.
    switch(
        &mut pg,
        RolloutCommand::Shadow {
            candidate: "v2".into(),
            incumbent: None,
        },
    )
    .await;
    let v2 = Fleet::start(&cfg, "v2", &broker);
    wait_for(
        "v2's shadow to start",
        Duration::from_secs(30),
        async || count(&pg, "SELECT count(*) FROM sealpost.shadow_tally").await == 1,
    )
    .await;
    enqueue(&mut pg, "a", 60).await;
    wait_published(&pg, "a").await;
    wait_for(
        "the shadow to compare batch a",
        Duration::from_secs(180),
        async || compared(&pg).await.0 >= 60,
    )
    .await;
    assert_eq!(
        compared(&pg).await,
        (60, 60, 0),
        "v2 would send what v1 sent"
    );
    assert_eq!(sent_by(&pg, "a", |_, _, who| who == "v1").await, (60, 0));

    // 2. A 5% takeover of order.created; v2 is killed right after the batch commits and
    // started again.
    let takeover = switch(
        &mut pg,
        RolloutCommand::Takeover {
            candidate: "v2".into(),
            types: vec![CREATED.into()],
            share: 5,
        },
    )
    .await;
    let v2s =
        |ty: &str, agg: &str| takeover.claimant(ty, rollout::share_bucket("order", agg)) == "v2";
    enqueue(&mut pg, "b", 800).await;
    kill_while_sending(&pg, v2, "v2").await;
    let v2 = Fleet::start(&cfg, "v2", &broker);
    wait_published(&pg, "b").await;
    let (b1, b2) = sent_by(&pg, "b", |ty, agg, who| (who == "v2") == v2s(ty, agg)).await;
    assert!(b2 > 0, "v2's 5% of 400 created: {b2}");
    eprintln!("{name} upgrade drill: takeover batch: v1 sent {b1}, v2 {b2}");

    // 3. Rollback while a batch is on its way; v1 is killed in the middle of it.
    enqueue(&mut pg, "c", 800).await;
    let back = switch(&mut pg, RolloutCommand::Rollback).await;
    assert_eq!(back.stage, Stage::Incumbent);
    let caught = kill_while_sending(&pg, v1, "v1").await;
    assert!(caught > 0, "v1 was killed with sends on the wire");
    let v1 = Fleet::start(&cfg, "v1", &broker);
    wait_published(&pg, "c").await;
    let (c1, c2) = sent_by(&pg, "c", |ty, agg, who| who == "v1" || v2s(ty, agg)).await;
    eprintln!(
        "{name} upgrade drill: rollback batch: v1 sent {c1}, v2 {c2} (claimed before the switch)"
    );
    enqueue(&mut pg, "d", 60).await;
    wait_published(&pg, "d").await;
    assert_eq!(sent_by(&pg, "d", |_, _, who| who == "v1").await, (60, 0));

    // 4. Shadow (a new tally), takeover once it compared what v1 published meanwhile,
    // promote; v1 is killed; v2 claims everything.
    switch(
        &mut pg,
        RolloutCommand::Shadow {
            candidate: "v2".into(),
            incumbent: None,
        },
    )
    .await;
    // v2 is killed and started again: a shadow reader in the middle of a page (up to 200
    // lookups; on RabbitMQ each reads the lookup stream, and a page took over 30 s in CI)
    // would only see the new tally after it; a fresh one starts it at once.
    v2.kill().await;
    let v2 = Fleet::start(&cfg, "v2", &broker);
    wait_for(
        "the new shadow to start",
        Duration::from_secs(180),
        async || count(&pg, "SELECT count(*) FROM sealpost.shadow_tally").await == 1,
    )
    .await;
    enqueue(&mut pg, "g", 40).await;
    wait_published(&pg, "g").await;
    wait_for(
        "the new shadow to compare batch g",
        Duration::from_secs(180),
        async || compared(&pg).await.0 >= 40,
    )
    .await;
    assert_eq!(compared(&pg).await, (40, 40, 0));
    switch(
        &mut pg,
        RolloutCommand::Takeover {
            candidate: "v2".into(),
            types: vec![CREATED.into(), PAID.into()],
            share: 5,
        },
    )
    .await;
    let (seen, matched, unexplained) = compared(&pg).await;
    assert_eq!((seen, unexplained), (matched, 0), "no divergence");
    assert_eq!(
        switch(&mut pg, RolloutCommand::Promote).await.stage,
        Stage::Promoted
    );
    v1.kill().await;
    enqueue(&mut pg, "e", 100).await;
    wait_published(&pg, "e").await;
    assert_eq!(sent_by(&pg, "e", |_, _, who| who == "v2").await, (0, 100));
    v2.stop().await;

    // Nothing lost, nothing unknown, every event reconciled and applied once.
    let total = 60 + 800 + 800 + 60 + 40 + 100;
    // The kills left sends whose receipt never reached the store: the reconciler found
    // them at the broker (a primary receipt from a lookup) or, proven absent, had them sent
    // again.
    let looked_up = count(
        &pg,
        "SELECT count(*) FROM sealpost.receipts WHERE kind = 'primary' AND source = 'lookup'",
    )
    .await;
    assert!(looked_up > 0, "the kills left outcomes for the reconciler");
    assert_eq!(
        count(
            &pg,
            "SELECT count(*) FROM sealpost.work WHERE state = 'PUBLISHED'"
        )
        .await,
        total
    );
    let report = ops::reconcile(
        &pg,
        None::<&NoScan>,
        &ReconcileOptions {
            pending_age_s: 0,
            unconsumed_age_s: 3_600,
            unknown_age_s: 0,
            consumers: Vec::new(),
            streams: Vec::new(),
            scan_max: 0,
        },
    )
    .await
    .unwrap();
    assert_eq!((report.committed, report.published), (total, total));
    assert!(report.findings.is_empty(), "{:?}", report.findings);
    wait_for(
        "every event applied",
        Duration::from_secs(120),
        async || count(&ipg, "SELECT count(DISTINCT event_id) FROM applied").await == total,
    )
    .await;
    let held = copies().await;
    stop_consumer.cancel();
    consumer.await.unwrap().unwrap();
    let effects = count(&ipg, "SELECT count(*) FROM applied").await;
    eprintln!(
        "{name} upgrade drill: {total} events, {held} copies at the broker, {effects} effects, {looked_up} outcomes left unknown by a kill and resolved by a lookup, {} resent after an unknown outcome",
        report.resent_after_unknown
    );
    assert_eq!(
        effects, total,
        "each event applied once: zero second effects"
    );
    if refuses_second_copy {
        assert_eq!(
            held, total as u64,
            "one copy per event where the broker refuses a second"
        );
    } else {
        assert!(held >= total as u64, "{held}");
    }
    let log: Vec<String> = store::rollout_status(&pg)
        .await
        .unwrap()
        .log
        .iter()
        .rev()
        .map(|l| l.command.clone())
        .collect();
    assert_eq!(
        log,
        ["shadow", "takeover", "rollback", "shadow", "takeover", "promote"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn upgrade_drill_on_nats() {
    let stream = format!("UPGRADE{}", runtime::owner_id() % 1_000_000);
    let nats = Nats::connect(
        &common::nats_url(),
        common::NATS_CLUSTER,
        Duration::from_secs(1),
    )
    .await
    .expect("NATS must be running");
    nats.js
        .create_stream(jetstream::stream::Config {
            name: stream.clone(),
            subjects: vec![format!("sp.{stream}.>")],
            ..Default::default()
        })
        .await
        .expect("create the test stream");
    let _stream = teardown_nats::stream(&common::nats_url(), &stream);
    let subscription =
        sealpost_nats::NatsSubscription::subscribe(&nats, &stream, "c1", Duration::from_secs(10))
            .await
            .unwrap();
    let js = nats.js.clone();
    let s2 = stream.clone();
    drill(
        "nats",
        common::NATS_CLUSTER,
        &stream,
        nats,
        subscription,
        async || {
            js.get_stream(&s2)
                .await
                .unwrap()
                .info()
                .await
                .unwrap()
                .state
                .messages
        },
        true,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn upgrade_drill_on_rabbitmq() {
    use sealpost_rabbitmq::lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
    use sealpost_rabbitmq::lapin::types::FieldTable;
    let topic = format!("sp-upgrade-{}", runtime::owner_id() % 1_000_000);
    let consumers = vec!["c1".to_string(), "audit".to_string()];
    let rabbit = sealpost_rabbitmq::Rabbit::connect(
        &common::rabbitmq_url(),
        common::RABBITMQ_CLUSTER,
        Duration::from_secs(1),
        "sealpost-test-upgrade",
    )
    .await
    .expect("RabbitMQ must be running at 127.0.0.1:5672 (guest/guest)")
    .with_lookup_stream(sealpost_rabbitmq::LookupStream {
        enabled: true,
        clock_margin_ms: 0,
        ..Default::default()
    });
    let _destination = teardown_rabbitmq::destination(&common::rabbitmq_url(), &topic, &consumers);
    let lookup = sealpost_rabbitmq::lookup_stream_name(&topic);
    let _lookup = {
        let lookup = lookup.clone();
        teardown_rabbitmq::Teardown::new(format!("queue {lookup}"), move || async move {
            let c = sealpost_rabbitmq::lapin::Connection::connect(
                teardown_rabbitmq::RABBITMQ_URL,
                Default::default(),
            )
            .await
            .map_err(|e| e.to_string())?;
            let ch = c.create_channel().await.map_err(|e| e.to_string())?;
            ch.queue_delete(lookup.as_str().into(), QueueDeleteOptions::default())
                .await
                .map_err(|e| e.to_string())?;
            Ok(())
        })
    };
    rabbit.ensure_destination(&topic, &consumers).await.unwrap();
    let admin =
        sealpost_rabbitmq::lapin::Connection::connect(&common::rabbitmq_url(), Default::default())
            .await
            .unwrap();
    let subscription = sealpost_rabbitmq::RabbitSubscription::subscribe(
        &common::rabbitmq_url(),
        &Default::default(),
        &topic,
        "c1",
        1_000,
    )
    .await
    .unwrap();
    // The audit queue is never read: it holds every copy the exchange routed.
    let audit = sealpost_rabbitmq::queue_name(&topic, "audit");
    drill(
        "rabbitmq",
        common::RABBITMQ_CLUSTER,
        &topic,
        rabbit,
        subscription,
        async || {
            let ch = admin.create_channel().await.unwrap();
            let q = ch
                .queue_declare(
                    audit.as_str().into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
                .unwrap();
            let _ = ch.close(200, "done".into()).await;
            q.message_count() as u64
        },
        false,
    )
    .await;
}
