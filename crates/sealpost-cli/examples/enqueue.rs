//! Enqueue in the caller's transaction: an order row and its sealed envelope commit together
//! or not at all. Creates its own `orders` table and an `orders` route to NATS.
//!
//! ```text
//! DATABASE_URL="host=127.0.0.1 user=postgres dbname=test" cargo run -p sealpost-cli --example enqueue
//! ```

use sealpost_core::envelope::{EventId, NewEvent};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "host=127.0.0.1 user=postgres dbname=test".into());
    let mut client = sealpost::runtime::pg_connect(&url).await?; // TLS as `sslmode` says
    sealpost::store::migrate(&client).await?; // the sealpost schema, once per database
    sealpost::store::set_route(&client, "orders", "nats-local", "ORDERS").await?;
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS orders (id text PRIMARY KEY, total_cents bigint)",
        )
        .await?;

    // README:start enqueue
    let order_id = uuid::Uuid::now_v7().to_string();
    let payload = format!(r#"{{"order_id":"{order_id}","total_cents":4200}}"#);
    let event_id = EventId(*uuid::Uuid::now_v7().as_bytes()); // minted once, when the command is accepted
    let tx = client.transaction().await?;
    tx.execute(
        "INSERT INTO orders (id, total_cents) VALUES ($1, $2)",
        &[&order_id, &4200i64],
    )
    .await?;
    let event = NewEvent {
        aggregate_type: "order",
        aggregate_id: &order_id,
        aggregate_version: 1,
        event_type: "order.created.v1",
        payload_schema: "order.created.v1",
        payload: payload.as_bytes(),
        tenant: "t-1",
        occurred_at_ms: 0, // the business time of the fact, ms since the epoch
        creating_txid: 0,  // filled in by enqueue
    };
    let routing_key = format!("t-1.order.{order_id}");
    sealpost::store::enqueue(&tx, "orders", event_id, &event, &routing_key).await?;
    // The order and its sealed envelope commit together, or neither.
    tx.commit().await?;
    // README:end enqueue

    println!("order {order_id} committed with event {event_id}");
    Ok(())
}
