//! Dispatchers and a reconciler inside a service, over the broker named on the command line
//! (`nats`, the default, `rabbitmq` or `kafka`), until Ctrl-C. The service depends on
//! `sealpost` (the store and the loops, no broker client) and on its broker's adapter crate.
//! Settings come from the environment (`DATABASE_URL`, `NATS_URL`, `RABBITMQ_URL`,
//! `KAFKA_BROKERS`, ...; docs/operations.md).
//!
//! ```text
//! cargo run -p sealpost-cli --example dispatch -- nats
//! ```

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sealpost::runtime::{self, Config, Counters};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let broker = std::env::args().nth(1).unwrap_or_else(|| "nats".into());
    // README:start dispatch
    let cfg = Config::from_env()?; // defaults, then the environment; `validate()` ran
    let stop = Arc::new(AtomicBool::new(false));
    let counters = Arc::new(Counters::default());
    let ack_timeout = Duration::from_millis(cfg.ack_timeout_ms);
    let tasks = match broker.as_str() {
        "nats" => {
            let nats = sealpost_nats::Nats::connect(&cfg.nats_url, &cfg.nats_cluster, ack_timeout);
            runtime::spawn_fleet(&cfg, &Arc::new(nats.await?), 2, true, &stop, &counters)
        }
        "rabbitmq" => {
            let (url, cluster) = (&cfg.rabbitmq_url, &cfg.rabbitmq_cluster);
            let rabbit =
                sealpost_rabbitmq::Rabbit::connect(url, cluster, ack_timeout, "orders-svc");
            runtime::spawn_fleet(&cfg, &Arc::new(rabbit.await?), 2, true, &stop, &counters)
        }
        "kafka" => {
            let k = sealpost_kafka::KafkaConfig::new(
                &cfg.kafka_brokers,
                &cfg.kafka_cluster,
                ack_timeout,
            );
            let kafka = sealpost_kafka::Kafka::connect(k).await?;
            runtime::spawn_fleet(&cfg, &Arc::new(kafka), 2, true, &stop, &counters)
        }
        other => return Err(format!("unknown broker `{other}`: nats, rabbitmq or kafka").into()),
    };
    tokio::signal::ctrl_c().await?;
    stop.store(true, Ordering::Relaxed); // the loops finish the batches in flight, then return
    for t in tasks {
        t.await??;
    }
    // README:end dispatch
    println!("published {}", counters.published.load(Ordering::Relaxed));
    Ok(())
}
