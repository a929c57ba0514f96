//! How long an event waits when its transaction commits *after* a later-positioned one was
//! already claimed: the case concurrent producers make all the time, and the bench (one
//! producer connection) never does.
//!
//! A polling dispatcher scans the claim index from the position after its previous batch and
//! from the start only every `rescan_every_ms` (1 s, `DispatcherConfig`). A transaction that
//! took its commit position first and commits last lands *behind* that scan position. Each
//! trial, with the dispatchers (one unless a second argument says more) and a reconciler
//! running over NATS:
//!
//! 1. connection A begins and enqueues one event (the lower position), and holds;
//! 2. connection B enqueues one event and commits; the fleet publishes it (**in order**);
//! 3. after a pause that moves through the rescan period from trial to trial, A commits
//!    (**late**).
//!
//! It prints commit -> `PUBLISHED` (database clock) of both kinds, per trial and summed up,
//! with the default `rescan_every_ms` and then with 200 ms.
//!
//! ```text
//! NATS_URL=nats://127.0.0.1:4222 cargo run --release -p sealpost-cli --example late_commit -- 20 1
//! ```
//!
//! `DATABASE_ADMIN_URL` (default `host=127.0.0.1 user=postgres dbname=test`) names a
//! database to create `sealpost_late` from; the stream is `late<pid>` and is deleted at the
//! end.

use std::sync::Arc;
use std::time::Duration;

use sealpost::pg::{PgConnector, PgSource};
use sealpost::runtime::{self, CancellationToken, Config, Counters};
use sealpost::store;
use sealpost_core::envelope::EventId;

#[allow(dead_code)] // the backlog fill and receipts are the other examples'
#[path = "support/cycle.rs"]
mod cycle;

const DB: &str = "sealpost_late";

/// Enqueues one event in `tx` and returns its id.
async fn enqueue_one(
    tx: &tokio_postgres::Transaction<'_>,
    key: &str,
) -> Result<EventId, Box<dyn std::error::Error>> {
    let payload = vec![b'x'; 200];
    let id = EventId(*uuid::Uuid::now_v7().as_bytes());
    let event = cycle::order_event(key, &payload);
    store::enqueue_many(tx, "orders", &[(id, event, key.to_string())]).await?;
    Ok(id)
}

/// The event's `published_at_ms` once it is published (polled every 2 ms, for 30 s at most).
async fn published_at(
    pg: &tokio_postgres::Client,
    id: EventId,
) -> Result<u64, Box<dyn std::error::Error>> {
    let uuid = uuid::Uuid::from_bytes(id.0);
    for _ in 0..15_000 {
        let row = pg
            .query_opt(
                "SELECT published_at_ms FROM sealpost.work
                  WHERE event_id = $1 AND published_at_ms IS NOT NULL",
                &[&uuid],
            )
            .await?;
        if let Some(r) = row {
            return Ok(r.get::<_, i64>(0) as u64);
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    Err(format!("event {uuid} was not published within 30 s: is the fleet running?").into())
}

fn summary(name: &str, v: &mut [u64]) {
    v.sort_unstable();
    let mean = v.iter().sum::<u64>() as f64 / v.len().max(1) as f64;
    println!(
        "{name}: {} events, commit -> PUBLISHED min {} ms, median {} ms, mean {mean:.0} ms, max {} ms",
        v.len(),
        v.first().copied().unwrap_or(0),
        v.get(v.len() / 2).copied().unwrap_or(0),
        v.last().copied().unwrap_or(0),
    );
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let trials: usize = match std::env::args().nth(1) {
        Some(s) => s
            .parse()
            .map_err(|e| format!("trials must be a number ({s:?}: {e})"))?,
        None => 20,
    };
    let dispatchers: usize = match std::env::args().nth(2) {
        Some(s) => s
            .parse()
            .map_err(|e| format!("dispatchers must be a number ({s:?}: {e})"))?,
        None => 1,
    };
    if trials == 0 || dispatchers == 0 {
        return Err("trials and dispatchers must be at least 1".into());
    }
    let admin_url = std::env::var("DATABASE_ADMIN_URL")
        .unwrap_or_else(|_| "host=127.0.0.1 user=postgres dbname=test".to_string());
    let admin = runtime::pg_connect(&admin_url).await?;
    cycle::fresh_database(&admin, DB).await?;
    let url = format!("{admin_url} dbname={DB}");
    let pg = runtime::pg_connect(&url).await?;
    store::migrate(&pg).await?;
    let cfg = Config::default();
    let nats = sealpost_nats::NatsConfig::from_env()
        .connect(Duration::from_millis(cfg.ack_timeout_ms))
        .await?;
    let topic = format!("late{}", std::process::id());
    nats.ensure_stream(&topic).await?;
    store::set_route(&pg, "orders", &nats.cluster, &topic).await?;
    let js = nats.js.clone();

    let db: Arc<dyn PgSource> = Arc::new(PgConnector::new(url.clone()));
    let nats = Arc::new(nats);
    let mut a = runtime::pg_connect(&url).await?;
    let mut b = runtime::pg_connect(&url).await?;
    // The default full-scan period, then a shorter one, in the same process.
    for rescan_every_ms in [cfg.rescan_every_ms, 200] {
        let cfg = Config {
            rescan_every_ms,
            ..cfg.clone()
        };
        println!("{dispatchers} dispatcher(s), rescan_every_ms = {rescan_every_ms}:");
        let shutdown = CancellationToken::new();
        let counters = Arc::new(Counters::default());
        let fleet = runtime::spawn_fleet(&cfg, &db, &nats, dispatchers, true, &shutdown, &counters);
        let (mut in_order, mut late) = (Vec::new(), Vec::new());
        for trial in 0..trials {
            let ta = a.transaction().await?;
            let late_id = enqueue_one(&ta, &format!("late-{rescan_every_ms}-{trial}")).await?;
            let tb = b.transaction().await?;
            let early_id = enqueue_one(&tb, &format!("early-{rescan_every_ms}-{trial}")).await?;
            tb.commit().await?;
            let early_commit = store::db_now_ms(&b).await?;
            let early_published = published_at(&pg, early_id).await?;
            // A pause that walks through the rescan period, so the late commits fall at
            // every point of it rather than at one.
            let pause = (trial as u64 * 173) % rescan_every_ms.max(1);
            tokio::time::sleep(Duration::from_millis(pause)).await;
            ta.commit().await?;
            let late_commit = store::db_now_ms(&a).await?;
            let late_published = published_at(&pg, late_id).await?;
            let (e, l) = (
                early_published.saturating_sub(early_commit),
                late_published.saturating_sub(late_commit),
            );
            println!("  trial {trial}: in order {e} ms, late {l} ms");
            in_order.push(e);
            late.push(l);
        }
        summary("  in order", &mut in_order);
        summary("  late", &mut late);
        shutdown.cancel();
        for t in fleet {
            t.await??;
        }
    }
    js.delete_stream(&topic).await?;
    drop((pg, a, b));
    cycle::drop_database(&admin, DB).await?;
    Ok(())
}
