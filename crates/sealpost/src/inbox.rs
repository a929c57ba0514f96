//! The consumer inbox (R17–R18) for services that embed Sealpost on the consuming side:
//! `(consumer_id, event_id)` and the handler's own state change commit in one transaction;
//! the caller acks the broker only after that commit. A duplicate returns the original
//! consumption receipt and runs nothing; a different payload under a known event id is
//! quarantined and never applied. The decision is `sealpost_core::inbox::decide_inbox`.
//! [`process`] applies one delivery per transaction; [`process_batch`] applies a fetched
//! batch in one transaction with the same decisions, isolating a failing message's effect
//! under a savepoint so the rest of the batch commits; [`process_batch_within`] bounds each
//! try of the effect in time. A message that cannot be applied within the consumer's
//! redelivery limit (`sealpost_core::inbox::decide_failed_delivery`) is recorded with
//! [`dead_letter`] before the broker is told to stop redelivering it. A consumer whose inbox
//! lives in its own database tells the outbox how far it got with [`report_progress`].

use std::collections::hash_map::Entry;
use std::collections::HashMap;

use futures::future::BoxFuture;
use sealpost_core::encoding::Digest;
use sealpost_core::envelope::EventId;
use sealpost_core::inbox::{decide_delivery, decide_inbox, InboxDecision, InboxRecord};
use sealpost_core::signature::{Presented, SignaturePolicy};
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
    /// The consumer's signature policy.
    pub signatures: SignaturePolicy,
    /// What the message's signature presents (`sealpost::signing::Keyring::presented`).
    pub presented: Presented,
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

/// The reason recorded for a different payload under an event id the consumer already holds.
const DIFFERENT_PAYLOAD: &str = "a different payload under an event id already consumed";

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
    if let Err(refusal) = decide_delivery(
        d.claimed_digest,
        d.payload_digest,
        d.signatures,
        &d.presented,
    ) {
        quarantine(&tx, consumer_id, &[(d, refusal.to_string())]).await?;
        tx.commit().await?;
        return Ok(InboxOutcome::Quarantined);
    }
    let slot = take_slots(&tx, consumer_id, std::slice::from_ref(d), &[0])
        .await?
        .pop()
        .ok_or_else(|| StoreError::Corrupt("inbox slot".into()))?;
    let outcome = match slot.decision {
        InboxDecision::Apply => {
            effect(&tx).await?;
            advance_watermark(&tx, consumer_id, &[d]).await?;
            InboxOutcome::Applied {
                receipt_id: slot.record.receipt_id as i64,
            }
        }
        InboxDecision::Duplicate { receipt_id } => InboxOutcome::Duplicate {
            receipt_id: receipt_id as i64,
        },
        InboxDecision::Quarantine => {
            quarantine(&tx, consumer_id, &[(d, DIFFERENT_PAYLOAD.to_string())]).await?;
            InboxOutcome::Quarantined
        }
    };
    tx.commit().await?;
    Ok(outcome)
}

/// What processing one message of a batch did ([`process_batch`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BatchOutcome {
    /// First delivery: the effect ran and committed with the inbox row.
    Applied {
        /// The consumption receipt.
        receipt_id: i64,
    },
    /// Seen before (or earlier in the same batch): nothing ran; the original receipt.
    Duplicate {
        /// The original consumption receipt.
        receipt_id: i64,
    },
    /// Refused and recorded in `sealpost.inbox_quarantine`: never applied.
    Quarantined,
    /// The message's inbox row or effect failed; both were rolled back alone (the rest of
    /// the batch committed). Do not ack it: the broker redelivers it.
    Failed {
        /// The database's own words.
        error: String,
    },
}

impl BatchOutcome {
    /// The outcome's name, as the `outcome` label of the consumer metrics.
    pub fn name(&self) -> &'static str {
        match self {
            BatchOutcome::Applied { .. } => "applied",
            BatchOutcome::Duplicate { .. } => "duplicate",
            BatchOutcome::Quarantined => "quarantined",
            BatchOutcome::Failed { .. } => "failed",
        }
    }
}

impl BatchOutcome {
    /// Whether the broker message may be acked (after the commit): everything but `Failed`.
    pub fn ack(&self) -> bool {
        !matches!(self, BatchOutcome::Failed { .. })
    }
}

impl From<InboxOutcome> for BatchOutcome {
    fn from(o: InboxOutcome) -> Self {
        match o {
            InboxOutcome::Applied { receipt_id } => BatchOutcome::Applied { receipt_id },
            InboxOutcome::Duplicate { receipt_id } => BatchOutcome::Duplicate { receipt_id },
            InboxOutcome::Quarantined => BatchOutcome::Quarantined,
        }
    }
}

/// The effect of a batch: applies the messages at the given indices of the batch (each a
/// first delivery) inside the inbox transaction, all writes through it. It may be called
/// more than once per batch, on a subset each time (see [`process_batch`]); each call must
/// write for exactly the messages it is given.
pub type BatchEffect<'c> = Box<
    dyn for<'a> FnMut(
            &'a Transaction<'a>,
            &'a [usize],
        ) -> BoxFuture<'a, std::result::Result<(), tokio_postgres::Error>>
        + Send
        + 'c,
>;

/// Processes a batch of deliveries for `consumer_id` in ONE transaction and returns one
/// outcome per delivery, in order. Each message is decided exactly as [`process`] decides
/// it (the core's `decide_delivery` and `decide_inbox`): a payload not matching its digest
/// header and a different payload under a consumed event id are quarantined with the same
/// reasons, a duplicate returns the original receipt, a first delivery runs the effect and
/// moves the watermark. A later copy of a key earlier in the same batch is decided against
/// that earlier copy (a duplicate, or quarantined), as if the two came one after the other.
///
/// Ack the messages whose outcome [`BatchOutcome::ack`]s only after this returns `Ok`; an
/// `Err` means nothing committed.
///
/// # Transactions, isolation and locks
/// One transaction. The first deliveries take their inbox slots in one `INSERT ... SELECT
/// FROM unnest(...) ON CONFLICT DO NOTHING` (in key order, so two batches never wait on each
/// other in a cycle; a concurrent holder of a key is waited for, then seen as a conflict),
/// the slots that conflicted are read in one statement, and the effect runs once for all
/// the new ones, all under one savepoint. If that fails, the savepoint is rolled back and
/// the set is split in halves, each retried under its own savepoint, down to single
/// messages: a message that fails alone is `Failed` with the database's error, holds no
/// inbox row and no effect, and the others commit. (A later copy of a failed message's key
/// in the batch is `Failed` too.) Then the quarantine rows and the watermark (one row per
/// stream) are written in one statement each, and the transaction commits.
pub async fn process_batch(
    client: &mut tokio_postgres::Client,
    consumer_id: &str,
    deliveries: &[Delivery],
    effect: BatchEffect<'_>,
) -> Result<Vec<BatchOutcome>> {
    process_batch_within(client, consumer_id, deliveries, effect, None).await
}

/// [`process_batch`], with every try of the effect bounded by `effect_timeout`: a try that
/// runs longer is abandoned and rolled back to its savepoint like a failing one (the set is
/// split and retried, down to the message that hangs alone, whose outcome is `Failed` with
/// [`StoreError::EffectTimeout`]'s words). The transaction's `statement_timeout` is set to the
/// same limit, so a statement hanging in the database (a lock wait on a busy downstream row)
/// is cancelled by the server and the connection is free for the rollback.
pub async fn process_batch_within(
    client: &mut tokio_postgres::Client,
    consumer_id: &str,
    deliveries: &[Delivery],
    mut effect: BatchEffect<'_>,
    effect_timeout: Option<std::time::Duration>,
) -> Result<Vec<BatchOutcome>> {
    let effect: AnyEffect<'_> = Box::new(move |tx, apply| {
        let f = effect(tx, apply);
        Box::pin(async move { f.await.map_err(StoreError::Db) })
    });
    process_batch_any(client, consumer_id, deliveries, effect, effect_timeout).await
}

/// A batch effect whose failure is any [`StoreError`] (the library consumer's handler fails
/// with [`StoreError::Effect`]).
pub(crate) type AnyEffect<'c> = Box<
    dyn for<'a> FnMut(&'a Transaction<'a>, &'a [usize]) -> BoxFuture<'a, Result<()>> + Send + 'c,
>;

/// [`process_batch_within`] over an [`AnyEffect`].
pub(crate) async fn process_batch_any(
    client: &mut tokio_postgres::Client,
    consumer_id: &str,
    deliveries: &[Delivery],
    mut effect: AnyEffect<'_>,
    effect_timeout: Option<std::time::Duration>,
) -> Result<Vec<BatchOutcome>> {
    let ds = deliveries;
    let mut outcomes: Vec<Option<BatchOutcome>> = vec![None; ds.len()];
    let mut refused: Vec<(&Delivery, String)> = Vec::new();
    // The first copy of each key in the batch takes the slot; later copies follow it.
    let mut first: HashMap<(EventId, u16), usize> = HashMap::new();
    let mut candidates = Vec::new();
    let mut followers = Vec::new();
    for (i, d) in ds.iter().enumerate() {
        if let Err(refusal) = decide_delivery(
            d.claimed_digest,
            d.payload_digest,
            d.signatures,
            &d.presented,
        ) {
            refused.push((d, refusal.to_string()));
            outcomes[i] = Some(BatchOutcome::Quarantined);
            continue;
        }
        match first.entry((d.event_id, d.member)) {
            Entry::Vacant(v) => {
                v.insert(i);
                candidates.push(i);
            }
            Entry::Occupied(o) => followers.push((i, *o.get())),
        }
    }
    let mut tx = client.transaction().await?;
    if let Some(t) = effect_timeout {
        tx.batch_execute(&format!(
            "SET LOCAL statement_timeout = {}",
            t.as_millis().max(1)
        ))
        .await?;
    }
    let mut records: HashMap<usize, InboxRecord> = HashMap::new();
    let mut groups = Vec::new();
    if !candidates.is_empty() {
        groups.push(candidates);
    }
    while let Some(group) = groups.pop() {
        let sp = tx.savepoint("sealpost_inbox_batch").await?;
        match attempt(&sp, consumer_id, ds, &group, &mut effect, effect_timeout).await {
            Ok(slots) => {
                sp.commit().await?;
                for slot in slots {
                    let outcome = match slot.decision {
                        InboxDecision::Apply => BatchOutcome::Applied {
                            receipt_id: slot.record.receipt_id as i64,
                        },
                        InboxDecision::Duplicate { receipt_id } => BatchOutcome::Duplicate {
                            receipt_id: receipt_id as i64,
                        },
                        InboxDecision::Quarantine => {
                            refused.push((&ds[slot.index], DIFFERENT_PAYLOAD.to_string()));
                            BatchOutcome::Quarantined
                        }
                    };
                    outcomes[slot.index] = Some(outcome);
                    records.insert(slot.index, slot.record);
                }
            }
            Err(e) => {
                sp.rollback().await?;
                if let [only] = group[..] {
                    let error = match &e {
                        StoreError::Db(db) => crate::store::db_message(db),
                        other => other.to_string(),
                    };
                    outcomes[only] = Some(BatchOutcome::Failed { error });
                } else {
                    let (a, b) = group.split_at(group.len() / 2);
                    groups.push(b.to_vec());
                    groups.push(a.to_vec());
                }
            }
        }
    }
    for (i, f) in followers {
        let outcome = match (records.get(&f), &outcomes[f]) {
            (Some(rec), _) => match decide_inbox(Some(*rec), ds[i].payload_digest) {
                InboxDecision::Duplicate { receipt_id } => BatchOutcome::Duplicate {
                    receipt_id: receipt_id as i64,
                },
                InboxDecision::Quarantine => {
                    refused.push((&ds[i], DIFFERENT_PAYLOAD.to_string()));
                    BatchOutcome::Quarantined
                }
                InboxDecision::Apply => unreachable!("decide_inbox applies only a free slot"),
            },
            (None, Some(BatchOutcome::Failed { error })) => BatchOutcome::Failed {
                error: error.clone(),
            },
            (None, _) => unreachable!("the first copy of a key is decided or failed"),
        };
        outcomes[i] = Some(outcome);
    }
    if !refused.is_empty() {
        quarantine(&tx, consumer_id, &refused).await?;
    }
    let applied: Vec<&Delivery> = ds
        .iter()
        .zip(&outcomes)
        .filter(|(_, o)| matches!(o, Some(BatchOutcome::Applied { .. })))
        .map(|(d, _)| d)
        .collect();
    if !applied.is_empty() {
        advance_watermark(&tx, consumer_id, &applied).await?;
    }
    tx.commit().await?;
    Ok(outcomes
        .into_iter()
        .map(|o| o.expect("every delivery has an outcome"))
        .collect())
}

/// One group's try under its savepoint: take the slots, run the effect for the new ones.
async fn attempt(
    tx: &Transaction<'_>,
    consumer_id: &str,
    ds: &[Delivery],
    group: &[usize],
    effect: &mut AnyEffect<'_>,
    effect_timeout: Option<std::time::Duration>,
) -> Result<Vec<Slot>> {
    let slots = take_slots(tx, consumer_id, ds, group).await?;
    let apply: Vec<usize> = slots
        .iter()
        .filter(|s| s.decision == InboxDecision::Apply)
        .map(|s| s.index)
        .collect();
    if !apply.is_empty() {
        match effect_timeout {
            None => effect(tx, &apply).await?,
            Some(t) => tokio::time::timeout(t, effect(tx, &apply))
                .await
                .map_err(|_| StoreError::EffectTimeout(t.as_millis() as u64))??,
        }
    }
    Ok(slots)
}

/// A delivery's inbox slot and the core's decision on it.
struct Slot {
    /// Index into the deliveries.
    index: usize,
    /// `decide_inbox` on what the inbox held.
    decision: InboxDecision,
    /// What the inbox holds for the key now (the new row when `Apply`).
    record: InboxRecord,
}

/// Takes the inbox slots of `items` (indices into `ds`, distinct keys) with one `INSERT ...
/// ON CONFLICT DO NOTHING` in key order, reads the slots that were already taken, and
/// decides each with the core's `decide_inbox`.
async fn take_slots(
    tx: &Transaction<'_>,
    consumer_id: &str,
    ds: &[Delivery],
    items: &[usize],
) -> Result<Vec<Slot>> {
    let mut order = items.to_vec();
    order.sort_by_key(|&i| (ds[i].event_id, ds[i].member));
    let key = |i: usize| (Uuid::from_bytes(ds[i].event_id.0), ds[i].member as i16);
    let ids: Vec<Uuid> = order.iter().map(|&i| key(i).0).collect();
    let members: Vec<i16> = order.iter().map(|&i| key(i).1).collect();
    let digests: Vec<&[u8]> = order
        .iter()
        .map(|&i| ds[i].payload_digest.0.as_slice())
        .collect();
    let streams: Vec<&str> = order.iter().map(|&i| ds[i].stream.as_str()).collect();
    let seqs: Vec<i64> = order.iter().map(|&i| ds[i].sequence as i64).collect();
    let inserted: HashMap<(Uuid, i16), i64> = tx
        .query(
            "INSERT INTO sealpost.inbox (consumer_id, event_id, member, payload_digest, stream, sequence)
             SELECT $1, * FROM unnest($2::uuid[], $3::int2[], $4::bytea[], $5::text[], $6::int8[])
             ON CONFLICT DO NOTHING RETURNING event_id, member, receipt_id",
            &[&consumer_id, &ids, &members, &digests, &streams, &seqs],
        )
        .await?
        .iter()
        .map(|r| ((r.get(0), r.get(1)), r.get(2)))
        .collect();
    let mut existing: HashMap<(Uuid, i16), InboxRecord> = HashMap::new();
    if inserted.len() < order.len() {
        let (ids, members): (Vec<Uuid>, Vec<i16>) = order
            .iter()
            .map(|&i| key(i))
            .filter(|k| !inserted.contains_key(k))
            .unzip();
        for r in tx
            .query(
                "SELECT event_id, member, i.payload_digest, i.receipt_id
                 FROM unnest($2::uuid[], $3::int2[]) AS k(event_id, member)
                 JOIN sealpost.inbox i USING (event_id, member)
                 WHERE i.consumer_id = $1",
                &[&consumer_id, &ids, &members],
            )
            .await?
        {
            let dg: Vec<u8> = r.get(2);
            let dg: [u8; 32] = dg
                .try_into()
                .map_err(|_| StoreError::Corrupt("inbox digest".into()))?;
            existing.insert(
                (r.get(0), r.get(1)),
                InboxRecord {
                    payload_digest: Digest(dg),
                    receipt_id: r.get::<_, i64>(3) as u64,
                },
            );
        }
    }
    items
        .iter()
        .map(|&i| {
            let d = &ds[i];
            let k = key(i);
            let (held, record) = match inserted.get(&k) {
                Some(&receipt_id) => (
                    None,
                    InboxRecord {
                        payload_digest: d.payload_digest,
                        receipt_id: receipt_id as u64,
                    },
                ),
                None => {
                    let rec = *existing.get(&k).ok_or_else(|| {
                        StoreError::Corrupt(format!(
                            "inbox slot of event {} member {} conflicted but is gone",
                            k.0, k.1
                        ))
                    })?;
                    (Some(rec), rec)
                }
            };
            Ok(Slot {
                index: i,
                decision: decide_inbox(held, d.payload_digest),
                record,
            })
        })
        .collect()
}

/// Moves the consumer's high-water position of each stream to the highest applied sequence.
async fn advance_watermark(
    tx: &Transaction<'_>,
    consumer_id: &str,
    applied: &[&Delivery],
) -> Result<()> {
    // One entry per stream (a batch usually comes from one), not one per delivery.
    let mut high: Vec<(&str, i64)> = Vec::new();
    for d in applied {
        let seq = d.sequence as i64;
        match high.iter_mut().find(|(s, _)| *s == d.stream) {
            Some((_, q)) => *q = (*q).max(seq),
            None => high.push((d.stream.as_str(), seq)),
        }
    }
    let (streams, seqs): (Vec<&str>, Vec<i64>) = high.into_iter().unzip();
    tx.execute(
        "INSERT INTO sealpost.consumer_watermark (consumer_id, stream, high_water, updated_at_ms)
         SELECT $1, s, q, (extract(epoch from clock_timestamp()) * 1000)::bigint
         FROM unnest($2::text[], $3::int8[]) AS t(s, q)
         ON CONFLICT (consumer_id, stream) DO UPDATE
         SET high_water = greatest(sealpost.consumer_watermark.high_water, EXCLUDED.high_water),
             updated_at_ms = EXCLUDED.updated_at_ms",
        &[&consumer_id, &streams, &seqs],
    )
    .await?;
    Ok(())
}

/// Records refused deliveries, each with its reason, in one statement.
async fn quarantine(
    tx: &Transaction<'_>,
    consumer_id: &str,
    refused: &[(&Delivery, String)],
) -> Result<()> {
    let ids: Vec<Uuid> = refused
        .iter()
        .map(|(d, _)| Uuid::from_bytes(d.event_id.0))
        .collect();
    let members: Vec<i16> = refused.iter().map(|(d, _)| d.member as i16).collect();
    let streams: Vec<&str> = refused.iter().map(|(d, _)| d.stream.as_str()).collect();
    let seqs: Vec<i64> = refused.iter().map(|(d, _)| d.sequence as i64).collect();
    let reasons: Vec<&str> = refused.iter().map(|(_, r)| r.as_str()).collect();
    tx.execute(
        "INSERT INTO sealpost.inbox_quarantine (consumer_id, event_id, member, stream, sequence, reason, at_ms)
         SELECT $1, e, m, s, q, r, (extract(epoch from clock_timestamp()) * 1000)::bigint
         FROM unnest($2::uuid[], $3::int2[], $4::text[], $5::int8[], $6::text[]) AS t(e, m, s, q, r)",
        &[&consumer_id, &ids, &members, &streams, &seqs, &reasons],
    )
    .await?;
    Ok(())
}

/// A message the consumer gives up on, as recorded in `sealpost.inbox_quarantine`.
#[derive(Clone, Debug)]
pub struct DeadLetter {
    /// `dead_letter` (the effect failed `delivered` times) or `unreadable` (headers).
    pub kind: DeadLetterKind,
    /// Event id and member, when the headers carried them.
    pub event: Option<(EventId, u16)>,
    /// Stream and stream sequence of the message (its position at the broker).
    pub stream: String,
    /// Stream sequence.
    pub sequence: u64,
    /// The broker subject.
    pub subject: String,
    /// Deliveries so far, this one included.
    pub delivered: u64,
    /// Why: the last failure in the database's (or the check's) own words.
    pub reason: String,
    /// The payload as received (expires with the audit retention).
    pub payload: Vec<u8>,
}

/// Why a message is dead-lettered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeadLetterKind {
    /// Its effect failed on every delivery up to the consumer's limit.
    EffectFailed,
    /// Its Sealpost headers are missing or malformed.
    Unreadable,
}

impl DeadLetterKind {
    fn as_str(self) -> &'static str {
        match self {
            DeadLetterKind::EffectFailed => "dead_letter",
            DeadLetterKind::Unreadable => "unreadable",
        }
    }
}

/// The largest payload a dead letter keeps (R34): a larger one is recorded without it (its
/// size in `payload_bytes`); the outbox envelope holds it until purge. Dead letters live for
/// the audit retention, so they are kept small.
pub const DEAD_LETTER_PAYLOAD_BYTES_MAX: usize = 64 * 1024;

/// Records dead letters in `sealpost.inbox_quarantine`, one statement, and commits. A payload
/// over [`DEAD_LETTER_PAYLOAD_BYTES_MAX`] is not kept, only its size. Tell the
/// broker to stop redelivering a message (JetStream: `AckKind::Term`) only after this
/// returns `Ok`; on `Err` nothing is recorded and the message must be sent back instead.
/// A second record of the same position (a redelivery after a lost "terminate") is ignored.
///
/// # Transactions and locks
/// One statement (its own transaction); the unique index on (consumer, stream, sequence) of
/// dead letters is the only lock taken.
pub async fn dead_letter(
    client: &tokio_postgres::Client,
    consumer_id: &str,
    letters: &[DeadLetter],
) -> Result<()> {
    if letters.is_empty() {
        return Ok(());
    }
    let kinds: Vec<&str> = letters.iter().map(|l| l.kind.as_str()).collect();
    let ids: Vec<Option<Uuid>> = letters
        .iter()
        .map(|l| l.event.map(|(e, _)| Uuid::from_bytes(e.0)))
        .collect();
    let members: Vec<Option<i16>> = letters
        .iter()
        .map(|l| l.event.map(|(_, m)| m as i16))
        .collect();
    let streams: Vec<&str> = letters.iter().map(|l| l.stream.as_str()).collect();
    let seqs: Vec<i64> = letters.iter().map(|l| l.sequence as i64).collect();
    let subjects: Vec<&str> = letters.iter().map(|l| l.subject.as_str()).collect();
    let delivered: Vec<i32> = letters
        .iter()
        .map(|l| l.delivered.min(i32::MAX as u64) as i32)
        .collect();
    let reasons: Vec<&str> = letters.iter().map(|l| l.reason.as_str()).collect();
    let payloads: Vec<Option<&[u8]>> = letters
        .iter()
        .map(|l| Some(l.payload.as_slice()).filter(|p| p.len() <= DEAD_LETTER_PAYLOAD_BYTES_MAX))
        .collect();
    let sizes: Vec<i32> = letters
        .iter()
        .map(|l| l.payload.len().min(i32::MAX as usize) as i32)
        .collect();
    client
        .execute(
            "INSERT INTO sealpost.inbox_quarantine
                 (consumer_id, kind, event_id, member, stream, sequence, subject, delivered, reason, payload,
                  payload_bytes, at_ms)
             SELECT $1, k, e, m, s, q, j, d, r, p, b, (extract(epoch from clock_timestamp()) * 1000)::bigint
             FROM unnest($2::text[], $3::uuid[], $4::int2[], $5::text[], $6::int8[], $7::text[],
                         $8::int4[], $9::text[], $10::bytea[], $11::int4[]) AS t(k, e, m, s, q, j, d, r, p, b)
             ON CONFLICT (consumer_id, stream, sequence) WHERE kind <> 'refused' DO NOTHING",
            &[
                &consumer_id,
                &kinds,
                &ids,
                &members,
                &streams,
                &seqs,
                &subjects,
                &delivered,
                &reasons,
                &payloads,
                &sizes,
            ],
        )
        .await?;
    Ok(())
}

/// Reports a consumer's contiguous watermark on `stream` to the **outbox** database (every
/// position up to `watermark` applied, duplicate, refused or dead-lettered), where `sealpost
/// purge` reads it. The consumer's role needs only `INSERT, UPDATE, SELECT` on
/// `sealpost.consumer_progress`. A report never moves a watermark back.
///
/// # Transactions and locks
/// One upsert (its own transaction) on the consumer's one row per stream.
pub async fn report_progress(
    outbox: &tokio_postgres::Client,
    consumer_id: &str,
    stream: &str,
    watermark: u64,
) -> Result<()> {
    outbox
        .execute(
            "INSERT INTO sealpost.consumer_progress (consumer_id, stream, watermark, reported_at_ms)
             VALUES ($1, $2, $3, (extract(epoch from clock_timestamp()) * 1000)::bigint)
             ON CONFLICT (consumer_id, stream) DO UPDATE
             SET watermark = greatest(sealpost.consumer_progress.watermark, EXCLUDED.watermark),
                 reported_at_ms = EXCLUDED.reported_at_ms",
            &[&consumer_id, &stream, &(watermark as i64)],
        )
        .await?;
    Ok(())
}
