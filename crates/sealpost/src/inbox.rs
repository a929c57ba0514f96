//! The consumer inbox (R17–R18) for services that embed Sealpost on the consuming side:
//! `(consumer_id, event_id)` and the handler's own state change commit in one transaction;
//! the caller acks the broker only after that commit. A duplicate returns the original
//! consumption receipt and runs nothing; a different payload under a known event id is
//! quarantined and never applied. The decision is `sealpost_core::inbox::decide_inbox`.

use futures::future::BoxFuture;
use sealpost_core::encoding::Digest;
use sealpost_core::envelope::EventId;
use sealpost_core::inbox::{decide_delivery, decide_inbox, InboxDecision, InboxRecord};
use tokio_postgres::Transaction;
use uuid::Uuid;

use crate::store::{Result, StoreError};

/// One delivered message, as the consumer saw it.
#[derive(Clone, Debug)]
pub struct Delivery {
    /// Event id from the headers.
    pub event_id: EventId,
    /// Delivery-set member from the headers.
    pub member: u16,
    /// Payload digest claimed by the headers.
    pub claimed_digest: Digest,
    /// Digest of the payload bytes actually received.
    pub payload_digest: Digest,
    /// Stream.
    pub stream: String,
    /// Stream sequence.
    pub sequence: u64,
}

/// What processing a delivery did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InboxOutcome {
    /// First delivery: the effect ran and committed with the inbox row.
    Applied {
        /// The consumption receipt.
        receipt_id: i64,
    },
    /// Seen before: nothing ran; the original receipt.
    Duplicate {
        /// The original consumption receipt.
        receipt_id: i64,
    },
    /// Refused and recorded: never applied.
    Quarantined,
}

/// The effect: runs inside the inbox transaction and must do all its writes through it.
pub type Effect<'c> = Box<
    dyn for<'a> FnOnce(
            &'a Transaction<'a>,
        ) -> BoxFuture<'a, std::result::Result<(), tokio_postgres::Error>>
        + Send
        + 'c,
>;

/// Processes one delivery for `consumer_id` in one transaction. Ack the broker message only
/// after this returns `Ok`.
///
/// # Transactions and locks
/// One transaction: `INSERT ... ON CONFLICT DO NOTHING` on the inbox key takes the slot (a
/// concurrent duplicate waits for it and then sees the conflict), the effect runs, the
/// watermark moves, commit. A failure rolls everything back and the broker redelivers.
pub async fn process(
    client: &mut tokio_postgres::Client,
    consumer_id: &str,
    d: &Delivery,
    effect: Effect<'_>,
) -> Result<InboxOutcome> {
    let tx = client.transaction().await?;
    let id = Uuid::from_bytes(d.event_id.0);
    let member = d.member as i16;
    if let Err(refusal) = decide_delivery(d.claimed_digest, d.payload_digest) {
        quarantine(&tx, consumer_id, d, &refusal.to_string()).await?;
        tx.commit().await?;
        return Ok(InboxOutcome::Quarantined);
    }
    let inserted = tx
        .query_opt(
            "INSERT INTO sealpost.inbox (consumer_id, event_id, member, payload_digest, stream, sequence)
             VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING RETURNING receipt_id",
            &[&consumer_id, &id, &member, &d.payload_digest.0.as_slice(), &d.stream, &(d.sequence as i64)],
        )
        .await?;
    let existing = match &inserted {
        Some(_) => None,
        None => {
            let r = tx
                .query_one(
                    "SELECT payload_digest, receipt_id FROM sealpost.inbox
                     WHERE consumer_id = $1 AND event_id = $2 AND member = $3",
                    &[&consumer_id, &id, &member],
                )
                .await?;
            let dg: Vec<u8> = r.get(0);
            let dg: [u8; 32] = dg
                .try_into()
                .map_err(|_| StoreError::Corrupt("inbox digest".into()))?;
            Some(InboxRecord {
                payload_digest: Digest(dg),
                receipt_id: r.get::<_, i64>(1) as u64,
            })
        }
    };
    let outcome = match decide_inbox(existing, d.payload_digest) {
        InboxDecision::Apply => {
            effect(&tx).await?;
            tx.execute(
                "INSERT INTO sealpost.consumer_watermark (consumer_id, stream, high_water, updated_at_ms)
                 VALUES ($1, $2, $3, (extract(epoch from clock_timestamp()) * 1000)::bigint)
                 ON CONFLICT (consumer_id, stream) DO UPDATE
                 SET high_water = greatest(sealpost.consumer_watermark.high_water, EXCLUDED.high_water),
                     updated_at_ms = EXCLUDED.updated_at_ms",
                &[&consumer_id, &d.stream, &(d.sequence as i64)],
            )
            .await?;
            let receipt_id = inserted.map_or(0, |r| r.get::<_, i64>(0));
            InboxOutcome::Applied { receipt_id }
        }
        InboxDecision::Duplicate { receipt_id } => InboxOutcome::Duplicate {
            receipt_id: receipt_id as i64,
        },
        InboxDecision::Quarantine => {
            quarantine(
                &tx,
                consumer_id,
                d,
                "a different payload under an event id already consumed",
            )
            .await?;
            InboxOutcome::Quarantined
        }
    };
    tx.commit().await?;
    Ok(outcome)
}

async fn quarantine(
    tx: &Transaction<'_>,
    consumer_id: &str,
    d: &Delivery,
    reason: &str,
) -> Result<()> {
    tx.execute(
        "INSERT INTO sealpost.inbox_quarantine (consumer_id, event_id, member, stream, sequence, reason, at_ms)
         VALUES ($1, $2, $3, $4, $5, $6, (extract(epoch from clock_timestamp()) * 1000)::bigint)",
        &[&consumer_id, &Uuid::from_bytes(d.event_id.0), &(d.member as i16), &d.stream, &(d.sequence as i64), &reason],
    )
    .await?;
    Ok(())
}
