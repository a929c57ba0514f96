//! `sealpost bench`: drains a prefilled backlog through Sealpost's dispatchers, then the same
//! backlog through a naive hand-written relay in the same run (SKIP LOCKED batch, publish
//! with the transaction held open, mark sent), then measures commit -> `PUBLISHED` latency at
//! a fixed offered rate. Figures are printed, never asserted.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sealpost::runtime::{self, Config, Counters, RunError};
use sealpost::store::{self, StoreError};
use sealpost_nats::Nats;

/// Bench parameters.
#[derive(Clone, Copy, Debug)]
pub struct BenchArgs {
    /// Backlog size.
    pub events: u64,
    /// Payload bytes.
    pub payload_bytes: usize,
    /// Dispatcher tasks (and naive relays).
    pub dispatchers: usize,
    /// Offered rate for the latency phase.
    pub rate_per_s: u64,
    /// Duration of the latency phase.
    pub latency_s: u64,
}

/// Bench results.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BenchReport {
    /// Backlog size.
    pub events: u64,
    /// Sealpost drain rate.
    pub sealpost_events_per_s: f64,
    /// Naive relay drain rate.
    pub naive_events_per_s: f64,
    /// sealpost / naive.
    pub ratio: f64,
    /// Commit -> PUBLISHED latency, median.
    pub latency_ms_p50: f64,
    /// Commit -> PUBLISHED latency, 99th percentile.
    pub latency_ms_p99: f64,
}

fn db(e: tokio_postgres::Error) -> RunError {
    RunError::Store(StoreError::Db(e))
}

async fn prefill(
    pg: &mut tokio_postgres::Client,
    route: &str,
    n: u64,
    payload: &[u8],
) -> Result<(), RunError> {
    let mut i = 0;
    while i < n {
        let m = (n - i).min(2_000);
        let keys: Vec<String> = (i..i + m).map(|k| format!("o-{k}")).collect();
        let events = crate::demo::order_batch(&keys, payload);
        let tx = pg.transaction().await.map_err(db)?;
        store::enqueue_many(&tx, route, &events).await?;
        tx.commit().await.map_err(db)?;
        i += m;
    }
    Ok(())
}

/// Rows of `topic` not yet published. Reads only the two partial indexes (rows that still
/// need work, and unknown rows), so polling it does not scan the retained rows.
async fn count_left(pg: &tokio_postgres::Client, topic: &str) -> Result<i64, RunError> {
    Ok(pg
        .query_one(
            "SELECT count(*) FROM sealpost.work w JOIN sealpost.envelope e
               ON e.event_id = w.event_id AND e.member = w.member AND e.envelope_generation = w.envelope_generation
             WHERE w.phase < 2 AND e.dest_topic = $1",
            &[&topic],
        )
        .await
        .map_err(db)?
        .get(0))
}

/// Runs the benchmark.
pub async fn run(mut cfg: Config, args: BenchArgs, json: bool) -> Result<BenchReport, RunError> {
    cfg.idle_poll_ms = 2;
    let mut pg = runtime::pg_connect(&cfg.database_url).await?;
    store::migrate(&pg).await?;
    let tag = runtime::owner_id() % 1_000_000;
    let topic = format!("BENCH{tag}");
    let naive_topic = format!("NAIVE{tag}");
    let route = format!("bench-{tag}");
    store::set_route(&pg, &route, &cfg.nats_cluster, &topic).await?;
    let nats = Nats::connect(
        &cfg.nats_url,
        &cfg.nats_cluster,
        Duration::from_millis(cfg.ack_timeout_ms),
    )
    .await
    .map_err(RunError::broker)?;
    nats.ensure_stream(&topic).await.map_err(RunError::broker)?;
    nats.ensure_stream(&naive_topic)
        .await
        .map_err(RunError::broker)?;
    let payload = vec![b'x'; args.payload_bytes];
    let say = |s: String| {
        if !json {
            eprintln!("{s}");
        }
    };

    // 1. Sealpost drains a prefilled backlog.
    say(format!("prefilling {} events ...", args.events));
    prefill(&mut pg, &route, args.events, &payload).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let counters = Arc::new(Counters::default());
    let started = Instant::now();
    // As in production, a reconciler runs beside the dispatchers.
    let broker = Arc::new(nats.clone());
    let tasks = runtime::spawn_fleet(&cfg, &broker, args.dispatchers, true, &stop, &counters);
    while count_left(&pg, &topic).await? > 0 {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let sealpost_s = started.elapsed().as_secs_f64();
    let sealpost_rate = args.events as f64 / sealpost_s;
    say(format!(
        "sealpost: {} events in {sealpost_s:.2} s = {sealpost_rate:.0} events/s",
        args.events
    ));

    // 3 (while dispatchers still run). Latency at a fixed offered rate.
    let tick_ms = 10u64;
    let per_tick = (args.rate_per_s * tick_ms / 1000).max(1);
    let ticks = args.latency_s * 1000 / tick_ms;
    let lat_start_ms = store::db_now_ms(&pg).await? as i64;
    let t0 = Instant::now();
    for t in 0..ticks {
        let due = t0 + Duration::from_millis(t * tick_ms);
        tokio::time::sleep_until(due.into()).await;
        let keys: Vec<String> = (0..per_tick).map(|k| format!("l-{t}-{k}")).collect();
        let events = crate::demo::order_batch(&keys, &payload);
        let tx = pg.transaction().await.map_err(db)?;
        store::enqueue_many(&tx, &route, &events).await?;
        tx.commit().await.map_err(db)?;
    }
    while count_left(&pg, &topic).await? > 0 {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.expect("dispatcher panicked")?;
    }
    let lat: Vec<i64> = pg
        .query(
            "SELECT published_at_ms - created_at_ms FROM sealpost.outbox
             WHERE dest_topic = $1 AND created_at_ms >= $2 ORDER BY 1",
            &[&topic, &lat_start_ms],
        )
        .await
        .map_err(db)?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let q = |p: f64| -> f64 {
        if lat.is_empty() {
            return f64::NAN;
        }
        lat[((p * lat.len() as f64).ceil() as usize).clamp(1, lat.len()) - 1] as f64
    };
    let (p50, p99) = (q(0.50), q(0.99));
    say(format!(
        "latency at {} events/s over {} s: p50 {p50} ms, p99 {p99} ms ({} events)",
        args.rate_per_s,
        args.latency_s,
        lat.len()
    ));

    // 2. The naive relay over the same backlog size.
    pg.batch_execute(
        "CREATE TABLE IF NOT EXISTS sealpost_bench_naive (id bigserial PRIMARY KEY, payload bytea NOT NULL,
             sent boolean NOT NULL DEFAULT false);
         TRUNCATE sealpost_bench_naive;",
    )
    .await
    .map_err(db)?;
    pg.execute(
        "INSERT INTO sealpost_bench_naive (payload) SELECT $1::bytea FROM generate_series(1, $2::int8)",
        &[&payload, &(args.events as i64)],
    )
    .await
    .map_err(db)?;
    let started = Instant::now();
    let mut relays = Vec::new();
    for _ in 0..args.dispatchers {
        let cfg = cfg.clone();
        let nats = nats.clone();
        let subject = format!("sp.{naive_topic}.naive");
        relays.push(tokio::spawn(async move {
            let mut pg = runtime::pg_connect(&cfg.database_url).await?;
            loop {
                let tx = pg.transaction().await.map_err(db)?;
                let rows = tx
                    .query(
                        "SELECT id, payload FROM sealpost_bench_naive WHERE NOT sent ORDER BY id
                         LIMIT 1000 FOR UPDATE SKIP LOCKED",
                        &[],
                    )
                    .await
                    .map_err(db)?;
                if rows.is_empty() {
                    tx.commit().await.map_err(db)?;
                    let left: i64 = pg
                        .query_one(
                            "SELECT count(*) FROM sealpost_bench_naive WHERE NOT sent",
                            &[],
                        )
                        .await
                        .map_err(db)?
                        .get(0);
                    if left == 0 {
                        return Ok::<_, RunError>(());
                    }
                    continue;
                }
                // The transaction stays open across the sends: what hand-written relays do.
                let mut acks = Vec::with_capacity(rows.len());
                for r in &rows {
                    let p: Vec<u8> = r.get(1);
                    if let Ok(f) = nats.js.publish(subject.clone(), p.into()).await {
                        acks.push(f);
                    }
                }
                for a in acks {
                    let _ = a.await;
                }
                let ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
                tx.execute(
                    "UPDATE sealpost_bench_naive SET sent = true WHERE id = ANY($1)",
                    &[&ids],
                )
                .await
                .map_err(db)?;
                tx.commit().await.map_err(db)?;
            }
        }));
    }
    for r in relays {
        r.await.expect("relay panicked")?;
    }
    let naive_s = started.elapsed().as_secs_f64();
    let naive_rate = args.events as f64 / naive_s;
    say(format!(
        "naive relay: {} events in {naive_s:.2} s = {naive_rate:.0} events/s",
        args.events
    ));
    let _ = nats.js.delete_stream(&topic).await;
    let _ = nats.js.delete_stream(&naive_topic).await;
    Ok(BenchReport {
        events: args.events,
        sealpost_events_per_s: (sealpost_rate * 10.0).round() / 10.0,
        naive_events_per_s: (naive_rate * 10.0).round() / 10.0,
        ratio: (sealpost_rate / naive_rate * 1000.0).round() / 1000.0,
        latency_ms_p50: p50,
        latency_ms_p99: p99,
    })
}
