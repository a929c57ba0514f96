//! Dispatchers and a reconciler inside a service, over the broker named on the command line
//! (`nats`, the default, `rabbitmq` or `kafka`), until Ctrl-C. The service depends on
//! `sealpost` (the store and the loops, no broker client) and on its broker's adapter crate;
//! it hands the loops its own connection pool (here deadpool-postgres, `sealpost` feature
//! `deadpool`). Settings come from the environment: `DATABASE_URL` for the pool, and each
//! adapter's own (`NATS_URL`, `RABBITMQ_URL`, `KAFKA_BROKERS`, ...; docs/operations.md).
//!
//! ```text
//! cargo run -p sealpost-cli --example dispatch -- nats
//! ```

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use sealpost::pg::PgSource;
use sealpost::runtime::{self, CancellationToken, Config, Counters};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let broker = std::env::args().nth(1).unwrap_or_else(|| "nats".into());
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "host=127.0.0.1 user=postgres dbname=test".into());
    // README:start dispatch
    // Store and loop limits (leases, batch sizes, backoffs); brokers configure themselves.
    let cfg = Config::default();
    // The service's own pool (any TLS connector); each loop holds one connection of it.
    let mut pool = deadpool_postgres::Config::new();
    pool.url = Some(url);
    let pool = pool.create_pool(None, tokio_postgres::NoTls)?;
    let db: Arc<dyn PgSource> = Arc::new(pool);
    let shutdown = CancellationToken::new();
    let counters = Arc::new(Counters::default());
    let ack_timeout = Duration::from_millis(cfg.ack_timeout_ms);
    let tasks = match broker.as_str() {
        "nats" => {
            let nats = sealpost_nats::NatsConfig::from_env()
                .connect(ack_timeout)
                .await?;
            runtime::spawn_fleet(&cfg, &db, &Arc::new(nats), 2, true, &shutdown, &counters)
        }
        "rabbitmq" => {
            let rabbit = sealpost_rabbitmq::RabbitConfig::from_env();
            let rabbit = rabbit.connect(ack_timeout, "orders-svc").await?;
            runtime::spawn_fleet(&cfg, &db, &Arc::new(rabbit), 2, true, &shutdown, &counters)
        }
        "kafka" => {
            let mut k = sealpost_kafka::KafkaConfig::from_env()?;
            k.ack_timeout = ack_timeout;
            let kafka = sealpost_kafka::Kafka::connect(k).await?;
            runtime::spawn_fleet(&cfg, &db, &Arc::new(kafka), 2, true, &shutdown, &counters)
        }
        other => return Err(format!("unknown broker `{other}`: nats, rabbitmq or kafka").into()),
    };
    tokio::signal::ctrl_c().await?;
    shutdown.cancel(); // the loops finish the batches in flight, then return
    for t in tasks {
        t.await??;
    }
    // README:end dispatch
    println!("published {}", counters.published.load(Ordering::Relaxed));
    Ok(())
}
