//! Rolling out a dispatcher implementation (R25) against the real PostgreSQL and NATS: two
//! dispatcher fleets with two implementation ids over one outbox, the route's alias moved
//! through shadow, a takeover of a share of one event type, rollback and promotion, every
//! event sent by the implementation the alias named when it was claimed and stored once;
//! a rollback while the takeover's sends are in flight; the claim's SQL filter taking
//! exactly the rows the core's rule gives each implementation; a switch waiting for the
//! claims under way; and rows of a protocol an implementation does not speak left alone.
//! Each test has its own database and stream.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crate::common;
use crate::rollout_support as support;
use crate::teardown_nats;

use sealpost::runtime::{self, CancellationToken, Config, Counters};
use sealpost::store::{self, ErrorKind, RolloutCommand};
use sealpost_core::port::Broker;
use sealpost_core::rollout::{self, Alias, Implementation, Stage};
use sealpost_nats::async_nats::jetstream;
use sealpost_nats::Nats;
use support::{enqueue, senders, CREATED, PAID};

async fn all_published(pg: &tokio_postgres::Client, prefix: &str) -> bool {
    support::published(pg, prefix).await
}

async fn alias(pg: &tokio_postgres::Client, route: &str) -> Alias {
    support::alias(pg, route).await
}

async fn shadow_of(pg: &tokio_postgres::Client, candidate: &str) -> store::ShadowView {
    store::rollout_status(pg)
        .await
        .unwrap()
        .shadows
        .into_iter()
        .find(|s| s.candidate == candidate)
        .expect("a shadow tally")
}

async fn switch(pg: &mut tokio_postgres::Client, route: &str, cmd: RolloutCommand) -> Alias {
    let (a, warnings) = support::switch(pg, route, cmd).await;
    assert_eq!(
        warnings,
        Vec::<String>::new(),
        "every claimant has dispatchers"
    );
    a
}

/// Every event of `prefix` is published, by the implementation `expected` names for it.
async fn sent_as(
    pg: &tokio_postgres::Client,
    prefix: &str,
    expected: impl Fn(&str, &str) -> String,
) -> HashMap<String, usize> {
    let mut by = HashMap::new();
    for e in senders(pg, prefix).await {
        let (ty, agg) = (&e.event_type, &e.aggregate_id);
        assert_eq!(e.state, "PUBLISHED", "{agg}");
        let who = e
            .last_attempt_by
            .unwrap_or_else(|| panic!("{agg}: no announced sender"));
        assert_eq!(
            who,
            expected(ty, agg),
            "{agg} ({ty}) sent by the wrong implementation"
        );
        *by.entry(who).or_insert(0) += 1;
    }
    by
}

fn fleet(
    cfg: &Config,
    implementation: &str,
    nats: &Nats,
    stop: &CancellationToken,
) -> Vec<tokio::task::JoinHandle<Result<(), runtime::RunError>>> {
    let cfg = Config {
        implementation: implementation.to_string(),
        ..cfg.clone()
    };
    runtime::spawn_fleet(
        &cfg,
        &common::pg_source(&cfg),
        &Arc::new(nats.clone()),
        2,
        false,
        stop,
        &Arc::new(Counters::default()),
    )
}

async fn stop(
    stop: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<Result<(), runtime::RunError>>>,
) {
    stop.cancel();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_implementations_claim_what_the_alias_names_through_shadow_takeover_rollback_and_promotion(
) {
    let tag = runtime::owner_id() % 1_000_000;
    let db = common::fresh_database(&format!("sealpost_rollout_{tag}")).await;
    let cfg = db.config();
    let mut pg = runtime::pg_connect(&cfg.database_url).await.unwrap();
    store::migrate(&pg).await.unwrap();
    let stream = format!("ROLLOUT{tag}");
    let nats = Nats::connect(
        &common::nats_url(),
        common::NATS_CLUSTER,
        Duration::from_millis(cfg.ack_timeout_ms),
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
    store::set_route(&pg, "orders", common::NATS_CLUSTER, &stream)
        .await
        .unwrap();
    let wait = |what: &'static str| (what, Duration::from_secs(60));

    // The incumbent v1 runs alone and announces itself; a shadow of v2 names it.
    let stop1 = CancellationToken::new();
    let v1 = fleet(&cfg, "v1", &nats, &stop1);
    let (what, limit) = wait("v1 to announce itself");
    common::wait_for(what, limit, async || {
        common::count(
            &pg,
            "SELECT count(*) FROM sealpost.implementation WHERE implementation = 'v1'",
        )
        .await
            == 2
    })
    .await;
    let refused = store::rollout(
        &mut pg,
        "orders",
        &RolloutCommand::Takeover {
            candidate: "v2".into(),
            types: vec![CREATED.into()],
            share: 50,
        },
    )
    .await
    .unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::Input);
    assert!(
        refused.to_string().contains("has not run in shadow"),
        "{refused}"
    );
    let shadow = switch(
        &mut pg,
        "orders",
        RolloutCommand::Shadow {
            candidate: "v2".into(),
            incumbent: None,
        },
    )
    .await;
    assert_eq!(
        (shadow.incumbent.as_str(), shadow.stage, shadow.generation),
        ("v1", Stage::Shadow, 1)
    );

    // Shadow: v2's dispatchers run beside v1's and claim nothing; v2's shadow reader
    // compares every message v1 publishes with what v2 would have sent.
    let stop2 = CancellationToken::new();
    let v2 = fleet(&cfg, "v2", &nats, &stop2);
    let (what, limit) = wait("v2's shadow to start reading");
    common::wait_for(what, limit, async || {
        common::count(&pg, "SELECT count(*) FROM sealpost.shadow_tally").await == 1
    })
    .await;
    enqueue(&mut pg, "orders", "a", 40).await;
    let (what, limit) = wait("the shadow batch to publish and be compared");
    common::wait_for(what, limit, async || {
        all_published(&pg, "a").await && shadow_of(&pg, "v2").await.compared == 40
    })
    .await;
    let by = sent_as(&pg, "a", |_, _| "v1".into()).await;
    assert_eq!(by.get("v1"), Some(&40));
    let sh = shadow_of(&pg, "v2").await;
    assert_eq!((sh.matched, sh.diverged, sh.unexplained), (40, 0, 0));

    // Takeover of half the aggregates of `order.created`: v2 sends exactly those.
    let takeover = switch(
        &mut pg,
        "orders",
        RolloutCommand::Takeover {
            candidate: "v2".into(),
            types: vec![CREATED.into()],
            share: 50,
        },
    )
    .await;
    enqueue(&mut pg, "orders", "b", 200).await;
    let (what, limit) = wait("the takeover batch to publish");
    common::wait_for(what, limit, async || all_published(&pg, "b").await).await;
    let by = sent_as(&pg, "b", |ty, agg| {
        takeover
            .claimant(ty, rollout::share_bucket("order", agg))
            .to_string()
    })
    .await;
    let (n1, n2) = (
        by.get("v1").copied().unwrap_or(0),
        by.get("v2").copied().unwrap_or(0),
    );
    assert!(
        n2 > 20 && n1 > n2,
        "v1 {n1}, v2 {n2}: v2 takes about half of the 100 created"
    );

    // A rollback while a takeover batch is on its way: whatever v2 claimed before the switch
    // converges into its slot; nothing after the switch is v2's.
    enqueue(&mut pg, "orders", "c", 400).await;
    let back = switch(&mut pg, "orders", RolloutCommand::Rollback).await;
    assert_eq!(
        (back.stage, back.candidate.as_deref()),
        (Stage::Incumbent, None)
    );
    let (what, limit) = wait("the batch of the rollback to publish");
    common::wait_for(what, limit, async || all_published(&pg, "c").await).await;
    for e in senders(&pg, "c").await {
        let (ty, agg) = (&e.event_type, &e.aggregate_id);
        let who = e.last_attempt_by.unwrap();
        if who == "v2" {
            assert_eq!(
                takeover.claimant(ty, rollout::share_bucket("order", agg)),
                "v2",
                "{agg}: v2 sent a row the takeover never gave it"
            );
        } else {
            assert_eq!(who, "v1");
        }
    }
    enqueue(&mut pg, "orders", "d", 40).await;
    let (what, limit) = wait("the batch after the rollback to publish");
    common::wait_for(what, limit, async || all_published(&pg, "d").await).await;
    sent_as(&pg, "d", |_, _| "v1".into()).await;

    // Shadow again (a new shadow: its tally starts over), takeover once it has compared
    // what v1 published meanwhile, promote: v2 claims every row, v1 none.
    switch(
        &mut pg,
        "orders",
        RolloutCommand::Shadow {
            candidate: "v2".into(),
            incumbent: None,
        },
    )
    .await;
    let early = store::rollout(
        &mut pg,
        "orders",
        &RolloutCommand::Takeover {
            candidate: "v2".into(),
            types: vec![CREATED.into()],
            share: 5,
        },
    )
    .await
    .unwrap_err();
    assert!(
        early.to_string().contains("has compared no message yet"),
        "{early}"
    );
    let (what, limit) = wait("the new shadow to start reading");
    common::wait_for(what, limit, async || {
        common::count(&pg, "SELECT count(*) FROM sealpost.shadow_tally").await == 1
    })
    .await;
    enqueue(&mut pg, "orders", "g", 20).await;
    let (what, limit) = wait("the new shadow to compare batch g");
    common::wait_for(what, limit, async || {
        all_published(&pg, "g").await && shadow_of(&pg, "v2").await.compared == 20
    })
    .await;
    switch(
        &mut pg,
        "orders",
        RolloutCommand::Takeover {
            candidate: "v2".into(),
            types: vec![CREATED.into(), PAID.into()],
            share: 5,
        },
    )
    .await;
    let promoted = switch(&mut pg, "orders", RolloutCommand::Promote).await;
    assert_eq!(promoted.stage, Stage::Promoted);
    enqueue(&mut pg, "orders", "e", 40).await;
    let (what, limit) = wait("the promoted batch to publish");
    common::wait_for(what, limit, async || all_published(&pg, "e").await).await;
    sent_as(&pg, "e", |_, _| "v2".into()).await;

    // With v2's dispatchers gone, a promoted route waits for them; a rollback alone
    // brings v1 back.
    stop(stop2, v2).await;
    enqueue(&mut pg, "orders", "f", 10).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(senders(&pg, "f")
        .await
        .iter()
        .all(|e| e.state == "PENDING" && e.last_attempt_by.is_none()));
    switch(&mut pg, "orders", RolloutCommand::Rollback).await;
    let (what, limit) = wait("the batch after the second rollback to publish");
    common::wait_for(what, limit, async || all_published(&pg, "f").await).await;
    sent_as(&pg, "f", |_, _| "v1".into()).await;
    stop(stop1, v1).await;

    // Every event is in the stream once (a subject per event, create-if-absent), each with
    // one attempt, and the log holds every switch.
    let info = nats
        .js
        .get_stream(&stream)
        .await
        .unwrap()
        .cached_info()
        .clone();
    let events = common::count(&pg, "SELECT count(*) FROM sealpost.work").await;
    assert_eq!(events, 40 + 200 + 400 + 40 + 20 + 40 + 10);
    assert_eq!(info.state.messages as i64, events);
    assert_eq!(
        common::count(
            &pg,
            "SELECT count(*) FROM sealpost.work WHERE attempt_generation <> 1"
        )
        .await,
        0
    );
    let s = store::rollout_status(&pg).await.unwrap();
    let commands: Vec<&str> = s.log.iter().rev().map(|l| l.command.as_str()).collect();
    assert_eq!(
        commands,
        ["shadow", "takeover", "rollback", "shadow", "takeover", "promote", "rollback"]
    );
    assert_eq!(s.aliases[0].alias.generation, 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_claim_filter_takes_what_the_core_gives_a_switch_waits_for_claims_and_unspoken_protocols_wait(
) {
    let tag = runtime::owner_id() % 1_000_000;
    let db = common::fresh_database(&format!("sealpost_rollout_f_{tag}")).await;
    let cfg = db.config();
    let mut pg = runtime::pg_connect(&cfg.database_url).await.unwrap();
    store::migrate(&pg).await.unwrap();
    store::set_route(&pg, "orders", "c1", "ORDERS")
        .await
        .unwrap();
    store::set_route(&pg, "other", "c1", "OTHER").await.unwrap();
    enqueue(&mut pg, "orders", "o", 300).await;
    enqueue(&mut pg, "other", "x", 10).await;
    let v1 = Implementation::new("v1").unwrap();
    let v2 = Implementation::new("v2").unwrap();
    let takeover = RolloutCommand::Takeover {
        candidate: "v2".into(),
        types: vec![CREATED.into()],
        share: 40,
    };
    let shadow = RolloutCommand::Shadow {
        candidate: "v2".into(),
        incumbent: Some("v1".into()),
    };
    let c = store::rollout(&mut pg, "orders", &shadow).await.unwrap();
    // Nobody runs here: the switch says whose rows will wait.
    assert!(
        c.warnings
            .iter()
            .any(|w| w.contains("no dispatcher of \"v1\" on cluster `c1`")),
        "{:?}",
        c.warnings
    );
    // A takeover needs the shadow to have compared something (its reader records it; here
    // the store call it makes stands in).
    let e = store::rollout(&mut pg, "orders", &takeover)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("has compared no message yet"), "{e}");
    let cursor = store::shadow_cursor(&pg, "orders", "v2").await.unwrap();
    let some = sealpost_cli::demo::mint_event_id();
    let page = [(some, 0, Vec::new())];
    let next = (uuid::Uuid::max(), 0);
    let recorded = store::record_shadow(&mut pg, "orders", "v2", &page, cursor, next)
        .await
        .unwrap();
    assert!(recorded);
    // A second reader that read the same page (from the same cursor) records nothing.
    let again = store::record_shadow(&mut pg, "orders", "v2", &page, cursor, next)
        .await
        .unwrap();
    assert!(!again);
    assert_eq!(
        shadow_of(&pg, "v2").await.compared,
        1,
        "the page counted once"
    );
    {
        let c = store::rollout(&mut pg, "orders", &takeover).await.unwrap();
        assert!(
            c.warnings
                .iter()
                .any(|w| w.contains("no dispatcher of \"v1\" on cluster `c1`")),
            "{:?}",
            c.warnings
        );
    }
    let a = alias(&pg, "orders").await;

    // v2's claim takes exactly the `orders` rows the core gives v2 (and the other route's
    // rows, which no rollout touches); v1's the rest. The SQL filter computes the share
    // bucket itself; the claim step checks every row against the core's.
    let claim_as = |imp: Implementation| {
        let url = cfg.database_url.clone();
        async move {
            let mut c = runtime::pg_connect(&url).await.unwrap();
            let b = store::claim(
                &mut c,
                &store::ClaimRequest::new(1, 10_000, 60_000).implementation(&imp),
                None,
            )
            .await
            .unwrap();
            b.outgoing
                .iter()
                .map(|o| {
                    (
                        o.envelope.event_type.clone(),
                        o.envelope.aggregate_id.clone(),
                    )
                })
                .collect::<Vec<_>>()
        }
    };
    let got2 = claim_as(v2.clone()).await;
    let want2: Vec<(String, String)> = senders(&pg, "o")
        .await
        .into_iter()
        .filter(|e| {
            a.claimant(
                &e.event_type,
                rollout::share_bucket("order", &e.aggregate_id),
            ) == "v2"
        })
        .map(|e| (e.event_type, e.aggregate_id))
        .collect();
    let mut got2_orders: Vec<_> = got2
        .iter()
        .filter(|(_, agg)| agg.starts_with("o-"))
        .cloned()
        .collect();
    got2_orders.sort_by(|x, y| x.1.cmp(&y.1));
    assert!(
        want2.len() > 20,
        "{} of 150 created in a 40% share",
        want2.len()
    );
    assert_eq!(got2_orders, want2);
    assert_eq!(got2.len(), want2.len() + 10, "the other route's rows too");
    let got1 = claim_as(v1.clone()).await;
    assert_eq!(got1.len(), 300 - want2.len());

    // A switch waits for the claims under way: a transaction that read the aliases as a
    // claim does holds the switch back until it ends.
    let mut claimer = runtime::pg_connect(&cfg.database_url).await.unwrap();
    let tx = claimer.transaction().await.unwrap();
    tx.query("SELECT * FROM sealpost.rollout_aliases()", &[])
        .await
        .unwrap();
    let url = cfg.database_url.clone();
    let switching = tokio::spawn(async move {
        let mut c = runtime::pg_connect(&url).await.unwrap();
        store::rollout(&mut c, "orders", &RolloutCommand::Rollback)
            .await
            .unwrap()
    });
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        !switching.is_finished(),
        "the switch must wait for the claim"
    );
    assert_eq!(alias(&pg, "orders").await.generation, 2);
    tx.commit().await.unwrap();
    let c = switching.await.unwrap();
    assert!(c.changed);
    assert_eq!(alias(&pg, "orders").await.generation, 3);

    // A row written under a protocol this build does not speak is never claimed by it; an
    // implementation that speaks it claims it.
    enqueue(&mut pg, "orders", "p", 2).await;
    pg.execute(
        "UPDATE sealpost.work w SET protocol = $1 FROM sealpost.envelope e
          WHERE e.event_id = w.event_id AND e.aggregate_id = 'p-0'",
        &[&((rollout::PROTOCOL_VERSION + 1) as i16)],
    )
    .await
    .unwrap();
    let got = claim_as(v1.clone()).await;
    assert_eq!(got, vec![(PAID.to_string(), "p-1".to_string())]);
    let newer = Implementation {
        protocol_max: rollout::PROTOCOL_VERSION + 1,
        ..v1.clone()
    };
    let got = claim_as(newer).await;
    assert_eq!(got, vec![(CREATED.to_string(), "p-0".to_string())]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_shadow_finds_what_a_divergent_incumbent_sent_and_promotion_waits_for_an_explanation() {
    let tag = runtime::owner_id() % 1_000_000;
    let db = common::fresh_database(&format!("sealpost_rollout_s_{tag}")).await;
    let cfg = db.config();
    let mut pg = runtime::pg_connect(&cfg.database_url).await.unwrap();
    store::migrate(&pg).await.unwrap();
    let stream = format!("SHADOW{tag}");
    let nats = Nats::connect(
        &common::nats_url(),
        common::NATS_CLUSTER,
        Duration::from_millis(cfg.ack_timeout_ms),
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
    store::set_route(&pg, "orders", common::NATS_CLUSTER, &stream)
        .await
        .unwrap();
    store::rollout(
        &mut pg,
        "orders",
        &RolloutCommand::Shadow {
            candidate: "v2".into(),
            incumbent: Some("v1".into()),
        },
    )
    .await
    .unwrap();
    let stop2 = CancellationToken::new();
    let v2 = fleet(&cfg, "v2", &nats, &stop2);
    common::wait_for(
        "v2's shadow to start reading",
        Duration::from_secs(30),
        async || common::count(&pg, "SELECT count(*) FROM sealpost.shadow_tally").await == 1,
    )
    .await;

    // An incumbent v1 that writes a wrong tenant header on two of six messages: its claim,
    // its send, and the store's acceptance (headers are not sealed, so they are accepted).
    let v1 = Implementation::new("v1").unwrap();
    let owner = 4_242;
    store::announce(
        &pg,
        owner,
        &v1,
        store::Role::Dispatcher,
        common::NATS_CLUSTER,
    )
    .await
    .unwrap();
    enqueue(&mut pg, "orders", "s", 6).await;
    let b = store::claim(
        &mut pg,
        &store::ClaimRequest::new(owner, 10, 60_000).implementation(&v1),
        None,
    )
    .await
    .unwrap();
    assert_eq!(b.outgoing.len(), 6);
    let reqs: Vec<_> = b
        .outgoing
        .iter()
        .enumerate()
        .map(|(i, o)| {
            let mut r = o.send_request();
            if i % 3 == 1 {
                r.envelope.tenant = "tenant-9".into();
            }
            r
        })
        .collect();
    let results = nats
        .send_batch(reqs, std::time::Instant::now() + Duration::from_secs(5))
        .await;
    let receipts: Vec<_> = results
        .iter()
        .map(|r| match r {
            sealpost_core::port::SendResult::Receipt(r) => r.clone(),
            other => panic!("{other:?}"),
        })
        .collect();
    store::accept_receipts(&mut pg, &receipts).await.unwrap();
    assert!(all_published(&pg, "s").await);

    common::wait_for(
        "the shadow to compare the six",
        Duration::from_secs(30),
        async || shadow_of(&pg, "v2").await.compared == 6,
    )
    .await;
    let sh = shadow_of(&pg, "v2").await;
    assert_eq!((sh.matched, sh.diverged, sh.unexplained), (4, 2, 2));
    assert!(sh.examples.iter().all(|d| d.kind == "headers"
        && d.incumbent == "Sealpost-Tenant: tenant-9"
        && d.candidate == "Sealpost-Tenant: tenant-1"));

    // Promotion waits until the divergences are explained.
    store::rollout(
        &mut pg,
        "orders",
        &RolloutCommand::Takeover {
            candidate: "v2".into(),
            types: vec![CREATED.into()],
            share: 5,
        },
    )
    .await
    .unwrap();
    let e = store::rollout(&mut pg, "orders", &RolloutCommand::Promote)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Input);
    assert!(e.to_string().contains("2 unexplained divergence(s)"), "{e}");
    assert!(e.to_string().contains("Sealpost-Tenant: tenant-9"), "{e}");
    assert!(
        store::explain_divergences(&pg, "orders", "v2", None, "", "x")
            .await
            .is_err()
    );
    let n = store::explain_divergences(
        &pg,
        "orders",
        "v2",
        Some(rollout::DivergenceKind::Headers),
        "ops",
        "v1's tenant bug, fixed in v2",
    )
    .await
    .unwrap();
    assert_eq!(n, 2);
    assert_eq!(shadow_of(&pg, "v2").await.unexplained, 0);
    let c = store::rollout(&mut pg, "orders", &RolloutCommand::Promote)
        .await
        .unwrap();
    assert!(c.changed);
    stop(stop2, v2).await;
}
