//! A service's consumer over Kafka with the library's consumer API: connect,
//! subscribe (a consumer group named after the consumer; offsets committed after the inbox), a handler that writes a row in the caller's
//! transaction (committed with the inbox row, so once per event), run until Ctrl-C.
//!
//! `cargo run --release -p sealpost-cli --example consume_kafka -- [TOPIC] [CONSUMER]`
//! (`DATABASE_URL`, `KAFKA_BROKERS`).

use std::time::Duration;

use futures::future::BoxFuture;
use sealpost::consumer::{self, CancellationToken, Databases, Delivery, HandlerError, Options};
use sealpost::pg::PgConnector;
use sealpost_kafka::{KafkaConfig, KafkaSubscription};

/// The handler: every write goes through `tx`, the inbox transaction.
fn ship<'a>(
    tx: &'a tokio_postgres::Transaction<'a>,
    d: &'a Delivery,
) -> BoxFuture<'a, Result<(), HandlerError>> {
    Box::pin(async move {
        let event_type = d.envelope.as_ref().map(|e| e.event_type.clone());
        tx.execute(
            "INSERT INTO shipments (event_id, event_type, idempotency_key) VALUES ($1, $2, $3)",
            &[
                &uuid::Uuid::from_bytes(d.event_id.0),
                &event_type,
                &d.idempotency_key,
            ],
        )
        .await?;
        Ok(())
    })
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let mut args = std::env::args().skip(1);
    let topic = args.next().unwrap_or_else(|| "ORDERS".into());
    let consumer_id = args.next().unwrap_or_else(|| "shipping".into());
    let db = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "host=127.0.0.1 user=postgres dbname=test".into());
    let url = std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let pg = sealpost::runtime::pg_connect(&db).await?;
    sealpost::store::migrate(&pg).await?; // the inbox tables
    pg.batch_execute("CREATE TABLE IF NOT EXISTS shipments (event_id uuid, event_type text, idempotency_key text)")
        .await?;
    let kafka = KafkaConfig::new(&url, "kafka-local", Duration::from_secs(5));
    let sub = KafkaSubscription::subscribe(&kafka, &topic, &consumer_id)?;
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        stop.cancel();
    });
    let databases = Databases::new(PgConnector::new(db)); // or the service's own pool
    consumer::run(sub, databases, Options::new(consumer_id), ship, shutdown).await?;
    Ok(())
}
