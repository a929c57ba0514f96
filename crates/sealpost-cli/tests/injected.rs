//! Connections injected by the service (issue "A service can adopt it", item 4), against the
//! machine's PostgreSQL and NATS:
//! - the dispatchers, the reconciler and the library consumer all run on the service's own
//!   deadpool-postgres pool (`sealpost::pg::PgSource`), publish and apply a backlog once,
//!   stop when one `CancellationToken` is cancelled, and give every connection back;
//! - a source that cannot lend a connection for a while (the database "down", every open
//!   connection killed) is asked again only when the dispatcher machine's backoff says so
//!   (growing, capped: no hammering), and every event still leaves exactly once after it
//!   comes back.
//!
//! Each test has its own database and stream.

use common::wait_for;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common;
use crate::teardown_nats;

use futures::future::BoxFuture;
use sealpost::consumer::{self, Databases, Delivery, HandlerError, Options};
use sealpost::pg::{PgConn, PgConnector, PgSource};
use sealpost::runtime::{self, CancellationToken, Config, Counters, RunError};
use sealpost::store;
use sealpost_nats::{Nats, NatsSubscription};

/// A fresh database with the schema and the handler's table; the route `orders` to `topic`.
async fn setup(tag: &str, topic: &str) -> (common::TestDb, tokio_postgres::Client) {
    let db = common::fresh_database(&format!("sealpost_inj_{tag}")).await;
    let pg = runtime::pg_connect(&db.database_url).await.unwrap();
    store::migrate(&pg).await.unwrap();
    pg.batch_execute("CREATE TABLE inj_applied (event_id uuid PRIMARY KEY)")
        .await
        .unwrap();
    store::set_route(&pg, "orders", common::NATS_CLUSTER, topic)
        .await
        .unwrap();
    (db, pg)
}

async fn enqueue(pg: &mut tokio_postgres::Client, from: usize, n: usize) {
    let keys: Vec<String> = (from..from + n).map(|i| format!("o-{i}")).collect();
    let events = sealpost_cli::demo::order_batch(&keys, br#"{"order_id":"inj"}"#);
    let tx = pg.transaction().await.unwrap();
    store::enqueue_many(&tx, "orders", &events).await.unwrap();
    tx.commit().await.unwrap();
}

async fn published(pg: &tokio_postgres::Client) -> i64 {
    let s = store::status(pg).await.unwrap();
    s.states.get("PUBLISHED").copied().unwrap_or(0)
}

fn record<'a>(
    tx: &'a tokio_postgres::Transaction<'a>,
    d: &'a Delivery,
) -> BoxFuture<'a, Result<(), HandlerError>> {
    Box::pin(async move {
        tx.execute(
            "INSERT INTO inj_applied (event_id) VALUES ($1)",
            &[&uuid::Uuid::from_bytes(d.event_id.0)],
        )
        .await?;
        Ok(())
    })
}

async fn nats_for(topic: &str) -> Nats {
    let nats = Nats::connect(
        &common::nats_url(),
        common::NATS_CLUSTER,
        Duration::from_secs(5),
    )
    .await
    .expect("NATS must be running");
    nats.ensure_stream(topic).await.unwrap();
    nats
}

async fn stream_messages(nats: &Nats, topic: &str) -> u64 {
    let mut s = nats.js.get_stream(topic).await.unwrap();
    s.info().await.unwrap().state.messages
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_and_the_consumer_run_on_the_service_pool_and_stop_on_one_token() {
    let n = 300;
    let topic = format!("INJPOOL{}", runtime::owner_id() % 1_000_000);
    let _stream = teardown_nats::stream(&common::nats_url(), &topic);
    let (db, mut pg) = setup("pool", &topic).await;
    let nats = nats_for(&topic).await;
    enqueue(&mut pg, 0, n).await;

    let mut pool = deadpool_postgres::Config::new();
    pool.url = Some(db.database_url.clone());
    pool.pool = Some(deadpool_postgres::PoolConfig::new(8));
    let pool = pool
        .create_pool(None, tokio_postgres::NoTls)
        .expect("a pool");
    let source: Arc<dyn PgSource> = Arc::new(pool.clone());
    let shutdown = CancellationToken::new();
    let counters = Arc::new(Counters::default());
    let mut tasks = runtime::spawn_fleet(
        &db.config(),
        &source,
        &Arc::new(nats.clone()),
        2,
        true,
        &shutdown,
        &counters,
    );
    let sub = NatsSubscription::subscribe(&nats, &topic, "shipping", Duration::from_secs(10))
        .await
        .unwrap();
    let mut options = Options::new("shipping");
    options.progress_every_ms = 200;
    let applied = options.applied.clone();
    tasks.push(tokio::spawn(consumer::run(
        sub,
        Databases::new(pool.clone()),
        options,
        record,
        shutdown.clone(),
    )));

    wait_for(
        "every event published and applied",
        Duration::from_secs(60),
        async || published(&pg).await == n as i64 && applied.load(Ordering::Relaxed) == n as u64,
    )
    .await;
    let in_use = pool.status();
    println!("pool while running: {in_use:?}");
    assert!(
        in_use.size >= 4 && in_use.size <= 8,
        "two dispatchers, the reconciler and the consumer borrowed from the pool: {in_use:?}"
    );

    shutdown.cancel();
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(30), t)
            .await
            .expect("every loop stops after the token is cancelled")
            .unwrap()
            .unwrap();
    }
    let after = pool.status();
    assert_eq!(
        after.available, after.size,
        "every connection given back: {after:?}"
    );
    let rows: i64 = pg
        .query_one("SELECT count(DISTINCT event_id) FROM inj_applied", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, n as i64, "each event applied once");
    assert_eq!(
        stream_messages(&nats, &topic).await,
        n as u64,
        "each event sent once"
    );
    pool.close();
}

/// A source that can be switched "down": it then refuses every connection, as a database
/// that is unreachable would. It counts every request.
struct Flaky {
    inner: PgConnector,
    down: AtomicBool,
    asked: AtomicU64,
}

impl PgSource for Flaky {
    fn connect(&self) -> BoxFuture<'_, Result<PgConn, RunError>> {
        Box::pin(async move {
            self.asked.fetch_add(1, Ordering::Relaxed);
            if self.down.load(Ordering::Relaxed) {
                return Err(RunError::Pool("test: the database is down".into()));
            }
            self.inner.connect().await
        })
    }

    fn describe(&self) -> String {
        format!("flaky {}", self.inner.describe())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_that_goes_away_is_asked_again_on_the_machines_backoff_and_nothing_is_lost() {
    let topic = format!("INJDOWN{}", runtime::owner_id() % 1_000_000);
    let _stream = teardown_nats::stream(&common::nats_url(), &topic);
    let (db, mut pg) = setup("down", &topic).await;
    let nats = nats_for(&topic).await;
    let cfg = Config {
        lease_ms: 3_000,
        ack_timeout_ms: 1_000,
        error_backoff_ms: 100,
        error_backoff_max_ms: 800,
        reconcile_every_ms: 200,
        ..db.config()
    };
    let flaky = Arc::new(Flaky {
        inner: PgConnector::from_config(&cfg),
        down: AtomicBool::new(false),
        asked: AtomicU64::new(0),
    });
    let source: Arc<dyn PgSource> = flaky.clone();
    let shutdown = CancellationToken::new();
    let counters = Arc::new(Counters::default());
    let tasks = runtime::spawn_fleet(
        &cfg,
        &source,
        &Arc::new(nats.clone()),
        2,
        true,
        &shutdown,
        &counters,
    );
    enqueue(&mut pg, 0, 200).await;
    wait_for(
        "the first backlog published",
        Duration::from_secs(60),
        async || published(&pg).await == 200,
    )
    .await;

    // The database goes away: no new connection, and every open one of the loops is killed.
    flaky.down.store(true, Ordering::Relaxed);
    let asked_before = flaky.asked.load(Ordering::Relaxed);
    pg.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
        &[],
    )
    .await
    .unwrap();
    // Written meanwhile by the service (its own connection is not the loops' source).
    enqueue(&mut pg, 200, 200).await;
    let down_for = Duration::from_secs(4);
    tokio::time::sleep(down_for).await;
    let asked_down = flaky.asked.load(Ordering::Relaxed) - asked_before;
    println!("connection requests while down for {down_for:?}: {asked_down}");
    // Three loops (two dispatchers, the reconciler) each ask on their machine's backoff:
    // 100, 200, 400, then 800 ms between tries. A loop that slept its own fixed pause or
    // spun would ask far more often; one that never asked would not come back.
    assert!(asked_down >= 3, "the loops kept trying: {asked_down}");
    assert!(
        asked_down <= 3 * 12,
        "the loops back off instead of hammering the database: {asked_down}"
    );
    assert_eq!(
        published(&pg).await,
        200,
        "nothing accepted while it is away"
    );

    flaky.down.store(false, Ordering::Relaxed);
    wait_for(
        "every event published after the database came back",
        Duration::from_secs(90),
        async || published(&pg).await == 400,
    )
    .await;
    shutdown.cancel();
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(30), t)
            .await
            .expect("every loop stops after the token is cancelled")
            .unwrap()
            .unwrap();
    }
    assert_eq!(
        stream_messages(&nats, &topic).await,
        400,
        "each event stored once at the broker"
    );
}
