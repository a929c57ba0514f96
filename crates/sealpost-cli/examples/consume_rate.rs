//! Measures the example consumer's rate on its own: a fresh database and stream, `EVENTS`
//! demo orders published through the real dispatch path, then one consumer timed until it
//! has applied them all (`sealpost_cli::consume_bench::measure`).
//!
//! ```text
//! cargo run --release -p sealpost-cli --example consume_rate -- [EVENTS] [ROUNDS]
//! ```
//!
//! Uses the server of `DATABASE_URL` (key=value form) (a database `sealpost_consume_rate`, dropped afterwards) and
//! `NATS_URL`; prints one JSON line per round.

use std::time::Duration;

use sealpost::runtime::{self, Config};
use sealpost_cli::consume_bench;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let events: u64 = args.next().map_or(Ok(20_000), |a| a.parse())?;
    let rounds: u32 = args.next().map_or(Ok(3), |a| a.parse())?;
    let base = Config::from_env()?;
    let admin = runtime::pg_connect(&base.database_url).await?;
    let db = "sealpost_consume_rate";
    admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .await?;
    admin
        .batch_execute(&format!("CREATE DATABASE {db}"))
        .await?;
    let mut cfg = base.clone();
    // A later key wins in a key=value connection string.
    cfg.database_url = format!("{} dbname={db}", base.database_url);
    let nats = sealpost_nats::NatsConfig::from_env()
        .connect(Duration::from_millis(cfg.ack_timeout_ms))
        .await?;
    let topic = format!("CRATE{}", runtime::owner_id() % 1_000_000);
    eprintln!("publishing {events} events to {topic} ...");
    consume_bench::prefill(&cfg, &nats, &format!("r-{topic}"), &topic, events).await?;
    for round in 1..=rounds {
        let rate = consume_bench::measure(&cfg, &nats, &topic, events).await?;
        println!(r#"{{"round":{round},"events":{events},"consume_events_per_s":{rate:.1}}}"#);
    }
    let _ = nats.js.delete_stream(&topic).await;
    admin
        .batch_execute(&format!("DROP DATABASE {db} WITH (FORCE)"))
        .await?;
    Ok(())
}
