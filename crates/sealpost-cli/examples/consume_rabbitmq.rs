//! A service's consumer over RabbitMQ with the library's consumer API: connect,
//! subscribe (its own quorum queue `<exchange>.<consumer>`), a handler that writes a row in the caller's
//! transaction (committed with the inbox row, so once per event), run until Ctrl-C.
//!
//! `cargo run --release -p sealpost-cli --example consume_rabbitmq -- [EXCHANGE] [CONSUMER]`
//! (`DATABASE_URL`, `RABBITMQ_URL`; the exchange and queue are declared if missing).

use futures::future::BoxFuture;
use sealpost::consumer::{self, CancellationToken, Databases, Delivery, HandlerError, Options};
use sealpost::pg::PgConnector;
use sealpost_rabbitmq::RabbitSubscription;

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
    let exchange = args.next().unwrap_or_else(|| "ORDERS".into());
    let consumer_id = args.next().unwrap_or_else(|| "shipping".into());
    let db = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "host=127.0.0.1 user=postgres dbname=test".into());
    let url = std::env::var("RABBITMQ_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let pg = sealpost::runtime::pg_connect(&db).await?;
    sealpost::store::migrate(&pg).await?; // the inbox tables
    pg.batch_execute("CREATE TABLE IF NOT EXISTS shipments (event_id uuid, event_type text, idempotency_key text)")
        .await?;
    // A message reaches the queue within the dispatchers' lease and confirm timeout (10 s + 5 s
    // by default) after its attempt id is allocated: the watermark waits that long.
    let sub =
        RabbitSubscription::subscribe(&url, &Default::default(), &exchange, &consumer_id, 15_000)
            .await?;
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
