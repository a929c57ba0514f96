//! What `store_cycle` and `layout_probe` share: a database of their own, a backlog of
//! pending events enqueued through the store, and the ACK receipts a broker would give for a
//! claim's sends.

use sealpost::store;
use sealpost_core::envelope::{EventId, NewEvent};
use sealpost_core::receipt::{Receipt, ReceiptSource};

/// Drops `db` if it exists (closing its connections) and creates it empty.
pub async fn fresh_database(
    admin: &tokio_postgres::Client,
    db: &str,
) -> Result<(), tokio_postgres::Error> {
    admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .await?;
    admin.batch_execute(&format!("CREATE DATABASE {db}")).await
}

/// Drops `db` if it exists, closing its connections.
pub async fn drop_database(
    admin: &tokio_postgres::Client,
    db: &str,
) -> Result<(), tokio_postgres::Error> {
    admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .await
}

/// An `order.created.v1` event of aggregate `key` (version 1), as the examples enqueue it.
pub fn order_event<'a>(key: &'a str, payload: &'a [u8]) -> NewEvent<'a> {
    NewEvent {
        aggregate_type: "order",
        aggregate_id: key,
        aggregate_version: 1,
        event_type: "order.created.v1",
        payload_schema: "order.created.v1",
        payload,
        tenant: "t",
        occurred_at_ms: 1,
        creating_txid: 0,
    }
}

/// `n` pending events of the route `orders` (200-byte payloads, one aggregate each),
/// through the store's own enqueue, 2,000 per transaction.
pub async fn fill(
    pg: &mut tokio_postgres::Client,
    n: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    let payload = vec![b'x'; 200];
    let mut filled = 0;
    while filled < n {
        let keys: Vec<String> = (filled..(filled + 2_000).min(n))
            .map(|k| format!("o-{k}"))
            .collect();
        let events: Vec<_> = keys
            .iter()
            .map(|k| {
                let event = order_event(k, &payload);
                (EventId(*uuid::Uuid::now_v7().as_bytes()), event, k.clone())
            })
            .collect();
        let tx = pg.transaction().await?;
        store::enqueue_many(&tx, "orders", &events).await?;
        tx.commit().await?;
        filled += keys.len();
    }
    Ok(())
}

/// The ACK a broker would give each send of a claim, made as the broker would make it
/// (stream sequences counted on from `sequence`).
pub fn ack_receipts(outgoing: &[store::Outgoing], sequence: &mut u64) -> Vec<Receipt> {
    outgoing
        .iter()
        .map(|o| {
            *sequence += 1;
            Receipt {
                event_id: o.event_id,
                member: o.member,
                envelope_generation: o.envelope_generation,
                attempt_id: o.attempt_id,
                payload_digest: o.payload_digest,
                destination_digest: o.destination_digest,
                cluster: o.destination.cluster.clone(),
                stream: o.destination.topic.clone(),
                partition: None,
                sequence: *sequence,
                broker_duplicate: false,
                source: ReceiptSource::Ack,
            }
        })
        .collect()
}
