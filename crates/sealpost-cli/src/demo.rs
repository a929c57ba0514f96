//! `sealpost demo`: an order service writing orders (business row and envelope in one
//! transaction) while dispatcher tasks, a reconciler and fulfilment consumers run; progress
//! as one updating line on a terminal and as a line every few seconds otherwise; ends by
//! saying which part bounded the run (the writers' commits, the publication or the
//! consumers), then the status and the reconciliation report.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sealpost_core::envelope::{EventId, NewEvent};

use crate::config::Settings;
use sealpost::runtime::CancellationToken;
use sealpost::runtime::{self, Counters, RunError};
use sealpost::store;
use sealpost_nats::Nats;

/// The demo's route policy name; `run` points it at the `ORDERS` stream.
pub const ROUTE: &str = "demo-orders";

/// Creates the demo's business and effect tables. Call once before starting writers or
/// consumers (concurrent `CREATE TABLE IF NOT EXISTS` can race).
pub async fn prepare(pg: &tokio_postgres::Client) -> Result<(), RunError> {
    // Made already: a login without CREATE on the schema (a consumer's) runs the example too.
    let made: bool = pg
        .query_one(
            "SELECT to_regclass('demo_orders') IS NOT NULL AND to_regclass('demo_fulfilment') IS NOT NULL",
            &[],
        )
        .await
        .map_err(store::StoreError::from)?
        .get(0);
    if made {
        return Ok(());
    }
    pg.batch_execute(
        "CREATE TABLE IF NOT EXISTS demo_orders (
             order_id    text PRIMARY KEY,
             customer    text NOT NULL,
             total_cents bigint NOT NULL,
             event_id    uuid NOT NULL,
             created_at  timestamptz NOT NULL DEFAULT now());
         -- The fulfilment consumer's effect. Deliberately no unique key: a second effect
         -- for one event would show up as a second row.
         CREATE TABLE IF NOT EXISTS demo_fulfilment (
             consumer_id     text NOT NULL,
             event_id        uuid NOT NULL,
             order_id        text NOT NULL,
             idempotency_key text NOT NULL,
             at              timestamptz NOT NULL DEFAULT now())",
    )
    .await
    .map_err(store::StoreError::from)?;
    Ok(())
}

/// Mints the event id when the order command is first accepted (R3).
pub fn mint_event_id() -> EventId {
    EventId(*uuid::Uuid::now_v7().as_bytes())
}

/// The demo's `order.created.v1` fact for one order (also used by the bench and the tests).
pub fn order_created<'a>(order_id: &'a str, payload: &'a [u8]) -> NewEvent<'a> {
    NewEvent {
        aggregate_type: "order",
        aggregate_id: order_id,
        aggregate_version: 1,
        event_type: "order.created.v1",
        payload_schema: "order.created.v1",
        payload,
        tenant: "tenant-1",
        occurred_at_ms: 0,
        creating_txid: 0,
    }
}

/// A batch for [`store::enqueue_many`]: one fresh event id per order, routed by order id.
pub fn order_batch<'a>(
    order_ids: &'a [String],
    payload: &'a [u8],
) -> Vec<(EventId, NewEvent<'a>, String)> {
    order_ids
        .iter()
        .map(|k| (mint_event_id(), order_created(k, payload), k.clone()))
        .collect()
}

/// Writes one order and its envelope in one transaction (R4).
pub async fn place_order(
    pg: &mut tokio_postgres::Client,
    order_id: &str,
    total_cents: i64,
) -> Result<EventId, RunError> {
    let event_id = mint_event_id();
    let payload =
        format!(r#"{{"order_id":"{order_id}","total_cents":{total_cents},"currency":"EUR"}}"#);
    let tx = pg.transaction().await.map_err(store::StoreError::from)?;
    tx.execute(
        "INSERT INTO demo_orders (order_id, customer, total_cents, event_id) VALUES ($1, 'c-1', $2, $3)",
        &[&order_id, &total_cents, &uuid::Uuid::from_bytes(event_id.0)],
    )
    .await
    .map_err(store::StoreError::from)?;
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    store::enqueue(
        &tx,
        ROUTE,
        event_id,
        &NewEvent {
            aggregate_type: "order",
            aggregate_id: order_id,
            aggregate_version: 1,
            event_type: "order.created.v1",
            payload_schema: "order.created.v1",
            payload: payload.as_bytes(),
            tenant: "tenant-1",
            occurred_at_ms: now_ms,
            creating_txid: 0,
        },
        &format!("tenant-1.order.{order_id}"),
    )
    .await?;
    tx.commit().await.map_err(store::StoreError::from)?;
    Ok(event_id)
}

/// Distinct events of this run a consumer applied, and its effect rows for them.
async fn applied_this_run(
    admin: &tokio_postgres::Client,
    consumer_id: &str,
    run_id: u64,
) -> Result<(i64, i64), RunError> {
    let r = admin
        .query_one(
            "SELECT count(DISTINCT event_id), count(*) FROM demo_fulfilment
             WHERE consumer_id = $1 AND order_id LIKE $2",
            &[&consumer_id, &format!("o-{run_id}-%")],
        )
        .await
        .map_err(store::StoreError::from)?;
    Ok((r.get(0), r.get(1)))
}

/// Points the demo's route at `topic` with `durability` (before [`run`]).
pub async fn set_durability(cfg: &Settings, topic: &str, durability: &str) -> Result<(), RunError> {
    let admin = runtime::pg_connect(&cfg.database_url).await?;
    store::migrate(&admin).await?;
    store::set_route(&admin, ROUTE, &cfg.nats.cluster, topic).await?;
    store::set_route_durability(&admin, ROUTE, durability).await?;
    Ok(())
}

/// What one demo run does.
#[derive(Clone, Debug)]
pub struct DemoOptions {
    /// Orders to write.
    pub orders: u64,
    /// Writer tasks, each committing one order (business row and envelope) per transaction.
    pub writers: u64,
    /// Dispatcher tasks (a reconciler runs beside them).
    pub dispatchers: usize,
    /// Fulfilment consumers (each applies every event once).
    pub consumers: usize,
    /// Stream, exchange or topic the demo's route points at.
    pub topic: String,
    /// Print the final status as JSON instead of text and progress.
    pub json: bool,
}

/// Seconds between progress lines when stderr is not a terminal.
const PROGRESS_LINE_EVERY_S: f64 = 5.0;

/// When each stage of a run was done, in seconds from the start.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Timeline {
    /// The last order committed.
    pub written_s: Option<f64>,
    /// Every order published (nothing in flight or unknown).
    pub published_s: Option<f64>,
    /// Every consumer applied every order (`None` without consumers).
    pub consumed_s: Option<f64>,
}

/// Which part of the pipeline bounded a run, in a sentence: the stage that finished well
/// after the one before it set the pace; if none did, the writers' commit rate did.
pub fn bounded_by(t: &Timeline, orders: u64, writers: u64) -> String {
    let (Some(w), Some(p)) = (t.written_s, t.published_s) else {
        return "the run did not finish: see the status below".to_string();
    };
    let rate = |s: f64| orders as f64 / s.max(0.001);
    // A stage "kept up" when it finished within a second (the sampling step is 0.5 s) or 5%
    // of the run after the stage before it.
    let slack = (0.05 * w).max(1.0);
    let publish_lag = p - w;
    let consume_lag = t.consumed_s.map(|c| c - p);
    if publish_lag > slack && consume_lag.is_none_or(|l| l <= publish_lag) {
        return format!(
            "bounded by publication: {writers} writer(s) committed {:.0} orders/s, the dispatchers published {:.0}/s and finished {publish_lag:.1} s after the last commit (raise --dispatchers)",
            rate(w),
            rate(p)
        );
    }
    if let Some(l) = consume_lag.filter(|l| *l > slack) {
        return format!(
            "bounded by the consumers: they applied {:.0} events/s each and finished {l:.1} s after the last publication",
            rate(t.consumed_s.unwrap_or(p))
        );
    }
    format!(
        "bounded by the writers: {writers} writer(s) committed {:.0} orders/s, one order per transaction; publication finished {publish_lag:.1} s after the last commit{} (raise --writers to offer more load)",
        rate(w),
        consume_lag.map_or(String::new(), |l| format!(
            ", consumption {l:.1} s after that"
        ))
    )
}

/// Runs the demo; returns true when every event ended `PUBLISHED` and every consumer
/// applied each of this run's events exactly once.
pub async fn run(cfg: Settings, opts: DemoOptions) -> Result<bool, RunError> {
    use std::io::IsTerminal;
    let DemoOptions {
        orders,
        writers: writers_n,
        dispatchers,
        consumers,
        ref topic,
        json,
    } = opts;
    let topic = topic.as_str();
    let writers_n = writers_n.max(1);
    let admin = runtime::pg_connect(&cfg.database_url).await?;
    store::migrate(&admin).await?;
    prepare(&admin).await?;
    let current = admin
        .query_opt(
            "SELECT cluster, topic, durability FROM sealpost.route_policy WHERE name = $1",
            &[&ROUTE],
        )
        .await
        .map_err(store::StoreError::from)?;
    let durability: String = current
        .as_ref()
        .map_or_else(|| "file".to_string(), |r| r.get(2));
    let kind = crate::brokers::BrokerKind::choose(None, &cfg)
        .map_err(|e| RunError::broker(std::io::Error::other(e)))?;
    let cluster = kind.cluster(&cfg).to_string();
    let wanted = (cluster.clone(), topic.to_string());
    if current.map(|r| (r.get::<_, String>(0), r.get::<_, String>(1))) != Some(wanted) {
        store::set_route(&admin, ROUTE, &cluster, topic).await?;
    }
    if kind != crate::brokers::BrokerKind::Kafka {
        // A route that pointed at Kafka before: its destinations have no partitions now.
        store::set_route_partitions(
            &admin,
            ROUTE,
            sealpost_core::envelope::PartitionAlgorithm::None,
        )
        .await?;
    }
    let stop = CancellationToken::new();
    let counters = Arc::new(Counters::default());
    let consumed: Vec<Arc<AtomicU64>> = (0..consumers)
        .map(|_| Arc::new(AtomicU64::new(0)))
        .collect();
    let consumer_ids: Vec<String> = (0..consumers)
        .map(|c| format!("fulfilment-{}", c + 1))
        .collect();
    // The NATS connection, kept for the reconciliation's stream scan (a RabbitMQ queue
    // cannot be scanned without taking its messages).
    let nats_scan: Option<Nats>;
    let tasks = match kind {
        crate::brokers::BrokerKind::Nats => {
            let nats = crate::brokers::connect_nats(&cfg).await?;
            nats.ensure_stream_for(topic, &durability)
                .await
                .map_err(RunError::broker)?;
            let broker = Arc::new(nats.clone());
            let mut tasks = runtime::spawn_fleet(
                &cfg,
                &crate::config::pg_source(&cfg),
                &broker,
                dispatchers,
                true,
                &stop,
                &counters,
            );
            for (c, id) in consumer_ids.iter().enumerate() {
                tasks.push(tokio::spawn(crate::consumer::run(
                    cfg.run.clone(),
                    nats.clone(),
                    id.clone(),
                    topic.to_string(),
                    stop.clone(),
                    consumed[c].clone(),
                )));
            }
            nats_scan = Some(nats);
            tasks
        }
        crate::brokers::BrokerKind::Rabbitmq => {
            let rabbit = crate::brokers::connect_rabbitmq(&cfg, "demo").await?;
            // The consumers' queues exist before the first publish: a message with no bound
            // queue is returned, a refusal.
            rabbit
                .ensure_destination(topic, &consumer_ids)
                .await
                .map_err(RunError::broker)?;
            let mut tasks = runtime::spawn_fleet(
                &cfg,
                &crate::config::pg_source(&cfg),
                &Arc::new(rabbit),
                dispatchers,
                true,
                &stop,
                &counters,
            );
            for (c, id) in consumer_ids.iter().enumerate() {
                tasks.push(tokio::spawn(crate::consumer::run_rabbitmq(
                    cfg.clone(),
                    id.clone(),
                    topic.to_string(),
                    stop.clone(),
                    consumed[c].clone(),
                )));
            }
            nats_scan = None;
            tasks
        }
        crate::brokers::BrokerKind::Kafka => {
            let kafka = crate::brokers::connect_kafka(&cfg, "demo").await?;
            // The route freezes the partition count the topic has (created with
            // `kafka_partitions` if new): Kafka's default partitioner over that count.
            let n = kafka
                .ensure_topic(topic, cfg.kafka.partitions)
                .await
                .map_err(RunError::broker)?;
            store::set_route_partitions(
                &admin,
                ROUTE,
                sealpost_core::envelope::PartitionAlgorithm::KafkaMurmur2 { partitions: n },
            )
            .await?;
            let mut tasks = runtime::spawn_fleet(
                &cfg,
                &crate::config::pg_source(&cfg),
                &Arc::new(kafka),
                dispatchers,
                true,
                &stop,
                &counters,
            );
            for (c, id) in consumer_ids.iter().enumerate() {
                tasks.push(tokio::spawn(crate::consumer::run_kafka(
                    cfg.clone(),
                    id.clone(),
                    topic.to_string(),
                    stop.clone(),
                    consumed[c].clone(),
                )));
            }
            nats_scan = None;
            tasks
        }
    };
    let written = Arc::new(AtomicU64::new(0));
    let run_id = runtime::owner_id() % 1_000_000;
    let mut writers = Vec::new();
    for w in 0..writers_n {
        let cfg = cfg.clone();
        let written = written.clone();
        writers.push(tokio::spawn(async move {
            let mut pg = runtime::pg_connect(&cfg.database_url).await?;
            let mut i = w;
            while i < orders {
                place_order(&mut pg, &format!("o-{run_id}-{i}"), 1000 + i as i64).await?;
                written.fetch_add(1, Ordering::Relaxed);
                i += writers_n;
            }
            Ok::<_, RunError>(())
        }));
    }
    let started = Instant::now();
    let base = store::status(&admin).await?;
    let base_published = base.states.get("PUBLISHED").copied().unwrap_or(0);
    let deadline = started + Duration::from_secs(600);
    let mut ok = false;
    let tty = std::io::stderr().is_terminal();
    let mut line_at: Option<f64> = None;
    let mut timeline = Timeline::default();
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now_s = started.elapsed().as_secs_f64();
        let s = store::status(&admin).await?;
        let published = s.states.get("PUBLISHED").copied().unwrap_or(0) - base_published;
        let pending: i64 = ["PENDING", "CLAIMED", "SENDING", "RETRY_CLAIMED"]
            .iter()
            .map(|k| s.states.get(*k).copied().unwrap_or(0))
            .sum();
        let w = written.load(Ordering::Relaxed);
        let mut applied = Vec::with_capacity(consumers);
        for id in &consumer_ids {
            applied.push(applied_this_run(&admin, id, run_id).await?.0);
        }
        if w == orders && timeline.written_s.is_none() {
            timeline.written_s = Some(now_s);
        }
        if timeline.written_s.is_some()
            && timeline.published_s.is_none()
            && pending == 0
            && s.unknown == 0
        {
            timeline.published_s = Some(now_s);
        }
        let all_applied = applied.iter().all(|a| *a == orders as i64);
        if consumers > 0 && timeline.consumed_s.is_none() && all_applied {
            timeline.consumed_s = Some(now_s);
        }
        if !json {
            let mut line = format!(
                "{now_s:>6.1}s  orders written {w:>7}/{orders}  published {published:>7}  in flight {pending:>6}  unknown {:>4}  quarantined {:>3}",
                s.unknown, s.quarantined
            );
            if consumers > 0 {
                line.push_str(&format!("  consumed {applied:?}"));
            }
            if tty {
                eprint!("\r{line}   ");
            } else if line_at.is_none_or(|t| now_s - t >= PROGRESS_LINE_EVERY_S) {
                eprintln!("{line}");
                line_at = Some(now_s);
            }
        }
        if w == orders && pending == 0 && s.unknown == 0 && all_applied {
            ok = true;
            break;
        }
        if Instant::now() > deadline {
            break;
        }
        if tasks.iter().any(|t| t.is_finished()) {
            // A dispatcher, reconciler or consumer stopped early: report its error below.
            break;
        }
    }
    if !json && tty {
        eprintln!();
    }
    for w in writers {
        w.await.expect("writer task panicked")?;
    }
    stop.cancel();
    for t in tasks {
        t.await.expect("dispatcher task panicked")?;
    }
    let s = store::status(&admin).await?;
    let elapsed = started.elapsed().as_secs_f64();
    // Every consumer applied every order of this run exactly once.
    let mut exactly_once = true;
    for id in &consumer_ids {
        let (distinct, total) = applied_this_run(&admin, id, run_id).await?;
        if !json {
            println!("consumer {id}: {distinct} distinct events applied, {total} effects");
        }
        exactly_once &= distinct == orders as i64 && total == orders as i64;
    }
    if json {
        println!("{}", serde_json::to_string(&s).unwrap_or_default());
    } else {
        println!(
            "demo: {orders} orders, {writers_n} writer(s), {dispatchers} dispatcher(s), {consumers} consumer(s): end to end in {elapsed:.1} s; duplicate receipts {}; reconciled {}",
            counters.duplicates.load(Ordering::Relaxed),
            counters.reconciled.load(Ordering::Relaxed)
        );
        println!("demo: {}", bounded_by(&timeline, orders, writers_n));
        crate::print_status(&s);
    }
    let mut findings_ok = true;
    if consumers > 0 {
        let opts = crate::ops::ReconcileOptions {
            pending_age_s: 60,
            unconsumed_age_s: 60,
            unknown_age_s: cfg.unknown_alert_s,
            consumers: consumer_ids.clone(),
            streams: vec![topic.to_string()],
            scan_max: 10_000_000,
        };
        let r = crate::ops::reconcile(&admin, nats_scan.as_ref(), &opts).await?;
        if !json {
            println!("reconciliation:");
            crate::print_reconcile(&r);
        }
        findings_ok = r.findings.is_empty();
    }
    Ok(ok && s.quarantined == 0 && exactly_once && findings_ok)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stage_that_finished_late_is_named_as_the_bound() {
        let t = |w, p, c| Timeline {
            written_s: Some(w),
            published_s: Some(p),
            consumed_s: c,
        };
        let writers = bounded_by(&t(35.0, 35.5, Some(36.0)), 20_000, 4);
        assert!(
            writers.starts_with("bounded by the writers: 4 writer(s) committed 571 orders/s"),
            "{writers}"
        );
        let publish = bounded_by(&t(10.0, 30.0, Some(30.5)), 20_000, 16);
        assert!(publish.starts_with("bounded by publication"), "{publish}");
        assert!(
            publish.contains("finished 20.0 s after the last commit"),
            "{publish}"
        );
        let consume = bounded_by(&t(10.0, 10.5, Some(40.0)), 20_000, 16);
        assert!(consume.starts_with("bounded by the consumers"), "{consume}");
        let unfinished = Timeline {
            written_s: Some(1.0),
            ..Timeline::default()
        };
        assert!(bounded_by(&unfinished, 1, 1).contains("did not finish"));
        let no_consumers = bounded_by(&t(5.0, 5.2, None), 1_000, 4);
        assert!(
            no_consumers.starts_with("bounded by the writers"),
            "{no_consumers}"
        );
        assert!(!no_consumers.contains("consumption"), "{no_consumers}");
    }
}
