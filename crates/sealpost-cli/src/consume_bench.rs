//! The consumer side's throughput: one example consumer ([`crate::consumer::run`], a fresh
//! durable consumer) over a topic that already holds published Sealpost messages, timed until
//! it has applied them all. `sealpost bench` reports the figure as `consume_events_per_s`;
//! [`prefill`] fills a topic through the real dispatch path for a stand-alone measurement.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sealpost::runtime::CancellationToken;
use sealpost::runtime::Config;
use sealpost::runtime::{self, Counters, RunError};
use sealpost::store::{self, StoreError};
use sealpost_nats::Nats;

/// How long the consumer may apply nothing before [`measure`] gives up.
const STALL: Duration = Duration::from_secs(60);

fn db(e: tokio_postgres::Error) -> RunError {
    RunError::Store(StoreError::Db(e))
}

/// Runs one example consumer with a fresh consumer id over `topic`, which must already hold
/// at least `events` published Sealpost messages this consumer has never seen, and returns
/// the events it applied per second (each one an inbox row and a `demo_fulfilment` row,
/// committed before the ack). The clock starts before the consumer connects and stops when
/// the `events`-th effect has committed. Afterwards the durable consumer and the consumer's
/// inbox, watermark and effect rows are removed, so a retention run never waits for it.
///
/// The schema must be applied (`sealpost migrate`); `measure` does not migrate, so it may
/// run beside dispatchers without taking the migration's locks.
///
/// Fails if the consumer stops with an error, or applies nothing for 60 s before reaching
/// `events` (the topic holds fewer messages).
pub async fn measure(cfg: &Config, nats: &Nats, topic: &str, events: u64) -> Result<f64, RunError> {
    let admin = runtime::pg_connect(&cfg.database_url).await?;
    crate::demo::prepare(&admin).await?;
    let consumer_id = format!("consume-bench-{}", runtime::owner_id());
    let stop = CancellationToken::new();
    let applied = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut task = tokio::spawn(crate::consumer::run(
        cfg.clone(),
        nats.clone(),
        consumer_id.clone(),
        topic.to_string(),
        stop.clone(),
        applied.clone(),
    ));
    let mut progress = (0, Instant::now());
    let timed = loop {
        tokio::time::sleep(Duration::from_millis(10)).await;
        let n = applied.load(Ordering::Relaxed);
        if n >= events {
            break Ok(started.elapsed().as_secs_f64());
        }
        if task.is_finished() {
            break match (&mut task).await.expect("consumer task panicked") {
                Err(e) => Err(e),
                Ok(()) => Err(stalled(n, events, topic)),
            };
        }
        if n != progress.0 {
            progress = (n, Instant::now());
        } else if progress.1.elapsed() > STALL {
            break Err(stalled(n, events, topic));
        }
    };
    stop.cancel();
    if !task.is_finished() {
        task.await.expect("consumer task panicked")?;
    }
    if let Err(e) = forget(&admin, nats, topic, &consumer_id).await {
        tracing::warn!(error = %e, consumer = %consumer_id, "could not remove the bench consumer");
    }
    let secs = timed?;
    Ok(events as f64 / secs)
}

fn stalled(applied: u64, events: u64, topic: &str) -> RunError {
    RunError::broker(std::io::Error::other(format!(
        "the consumer applied {applied} of {events} events and then nothing for {} s; \
         does stream {topic} hold {events} Sealpost messages?",
        STALL.as_secs()
    )))
}

/// Removes a bench consumer: its durable JetStream consumer and its rows.
async fn forget(
    admin: &tokio_postgres::Client,
    nats: &Nats,
    topic: &str,
    consumer_id: &str,
) -> Result<(), RunError> {
    let stream = nats.js.get_stream(topic).await.map_err(RunError::broker)?;
    stream
        .delete_consumer(consumer_id)
        .await
        .map_err(RunError::broker)?;
    for table in [
        "sealpost.inbox",
        "sealpost.consumer_watermark",
        "sealpost.inbox_quarantine",
        "demo_fulfilment",
    ] {
        admin
            .execute(
                &format!("DELETE FROM {table} WHERE consumer_id = $1"),
                &[&consumer_id],
            )
            .await
            .map_err(db)?;
    }
    Ok(())
}

/// Publishes `events` demo orders to `topic` through the real path: enqueued in batches
/// under a route `route` to the topic, then dispatched by a dispatcher fleet until none is
/// left unpublished. The stream is created if missing. Use a database of its own: the fleet
/// dispatches every pending row it finds.
pub async fn prefill(
    cfg: &Config,
    nats: &Nats,
    route: &str,
    topic: &str,
    events: u64,
) -> Result<(), RunError> {
    let mut pg = runtime::pg_connect(&cfg.database_url).await?;
    store::migrate(&pg).await?;
    store::set_route(
        &pg,
        route,
        sealpost_core::port::Broker::cluster(nats),
        topic,
    )
    .await?;
    nats.ensure_stream(topic).await.map_err(RunError::broker)?;
    let mut i = 0;
    while i < events {
        let m = (events - i).min(2_000);
        let keys: Vec<String> = (i..i + m).map(|k| format!("o-{k}")).collect();
        let payloads: Vec<String> = keys
            .iter()
            .map(|k| format!(r#"{{"order_id":"{k}","total_cents":1000,"currency":"EUR"}}"#))
            .collect();
        let batch: Vec<_> = keys
            .iter()
            .zip(&payloads)
            .map(|(k, p)| {
                (
                    crate::demo::mint_event_id(),
                    crate::demo::order_created(k, p.as_bytes()),
                    k.clone(),
                )
            })
            .collect();
        let tx = pg.transaction().await.map_err(db)?;
        store::enqueue_many(&tx, route, &batch).await?;
        tx.commit().await.map_err(db)?;
        i += m;
    }
    let stop = CancellationToken::new();
    let counters = Arc::new(Counters::default());
    let broker = Arc::new(nats.clone());
    let mut fleet_cfg = cfg.clone();
    fleet_cfg.idle_poll_ms = 2;
    let tasks = runtime::spawn_fleet(
        &fleet_cfg,
        &crate::config::pg_source(&fleet_cfg),
        &broker,
        2,
        true,
        &stop,
        &counters,
    );
    loop {
        let left: i64 = pg
            .query_one(
                "SELECT count(*) FROM sealpost.outbox WHERE dest_topic = $1
                   AND state IN ('PENDING', 'CLAIMED', 'SENDING', 'RETRY_CLAIMED',
                                 'DISPATCH_UNKNOWN', 'RECONCILING')",
                &[&topic],
            )
            .await
            .map_err(db)?
            .get(0);
        if left == 0 || tasks.iter().any(|t| t.is_finished()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.cancel();
    for t in tasks {
        t.await.expect("dispatcher task panicked")?;
    }
    Ok(())
}
