//! A service's consumer over NATS JetStream with the library's consumer API: connect,
//! subscribe (a durable pull consumer), a handler that writes a row in the caller's
//! transaction (committed with the inbox row, so once per event), run until Ctrl-C.
//!
//! `cargo run --release -p sealpost-cli --example consume_nats -- [STREAM] [CONSUMER]`
//! (`DATABASE_URL`, `NATS_URL`; the stream must exist, e.g. from `sealpost demo`).

use std::time::Duration;

use futures::future::BoxFuture;
use sealpost::consumer::{self, CancellationToken, Databases, Delivery, HandlerError, Options};
use sealpost::pg::PgConnector;
use sealpost_nats::{Nats, NatsSubscription};

// README:start consume-handler
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
// README:end consume-handler

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let mut args = std::env::args().skip(1);
    let stream = args.next().unwrap_or_else(|| "ORDERS".into());
    let consumer_id = args.next().unwrap_or_else(|| "shipping".into());
    let db = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "host=127.0.0.1 user=postgres dbname=test".into());
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let pg = sealpost::runtime::pg_connect(&db).await?;
    sealpost::store::migrate(&pg).await?; // the inbox tables
    pg.batch_execute("CREATE TABLE IF NOT EXISTS shipments (event_id uuid, event_type text, idempotency_key text)")
        .await?;
    // README:start consume-run
    let nats = Nats::connect(&url, "nats-local", Duration::from_secs(5)).await?;
    let sub =
        NatsSubscription::subscribe(&nats, &stream, &consumer_id, Duration::from_secs(10)).await?;
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        stop.cancel();
    });
    let databases = Databases::new(PgConnector::new(db)); // or the service's own pool
    consumer::run(sub, databases, Options::new(consumer_id), ship, shutdown).await?;
    // README:end consume-run
    Ok(())
}
