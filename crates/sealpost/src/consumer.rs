//! The consumer: a service's own code ([`Handler`]) applied exactly once per event, over any
//! broker subscription ([`sealpost_core::subscription::Subscription`]: `sealpost-nats`,
//! `sealpost-kafka`, `sealpost-rabbitmq`). [`run`] owns everything between the broker and
//! the handler: fetching batches bounded in messages and bytes, reading the Sealpost
//! headers, the batched inbox ([`crate::inbox`]: the handler's writes and the inbox row in
//! one transaction, a failing message rolled back alone), the settlement of every message
//! (the core's `decide_settlement`: ack, send back with a growing delay, or dead-letter at
//! the redelivery limit with its record committed first), the contiguous watermark reported
//! to the outbox database (`sealpost purge` waits for it), reconnects with the core's
//! backoff, and the consumer metrics ([`crate::observe`]).
//!
//! It decides nothing itself: every settlement is `decide_settlement`, every reconnect
//! delay `reconnect_backoff_ms`, every inbox verdict `decide_inbox`. The broker is reached
//! only through the subscription port: this crate has no broker client.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use sealpost_core::encoding::Digest;
use sealpost_core::envelope::{EventId, PAYLOAD_DOMAIN};
use sealpost_core::inbox::{Failure, RedeliveryPolicy};
use sealpost_core::port::WireEnvelope;
use sealpost_core::subscription::{
    decide_settlement, reconnect_backoff_ms, FetchLimits, Processed, Received, Settlement,
    Subscription,
};
use tokio_postgres::Transaction;
pub use tokio_util::sync::CancellationToken;

use crate::inbox::{self, BatchOutcome, DeadLetter, DeadLetterKind};
use crate::payload_key::{self, KeyState, Opened, Subject};
use crate::pg::{PgConn, PgConnector, PgSource};
use crate::runtime::{Config, RunError};
use crate::signing::Keyring;
use crate::store::StoreError;
use sealpost_core::signature::SignaturePolicy;

/// A handler's failure: any error (its words are logged and, at the delivery limit,
/// recorded in the dead letter).
pub type HandlerError = Box<dyn std::error::Error + Send + Sync>;

/// One delivered event, as the handler sees it.
#[derive(Clone, Debug)]
pub struct Delivery {
    /// The event's id (R3).
    pub event_id: EventId,
    /// Delivery-set member (0 for a plain event).
    pub member: u16,
    /// The envelope's description (R30: type, aggregate type, id and version, occurred-at,
    /// tenant, schema digest), when the headers carry it.
    pub envelope: Option<WireEnvelope>,
    /// The payload as the producer wrote it: as sealed (its digest was checked against the
    /// headers by the inbox), opened with its data subject's key when the route encrypts
    /// (`docs/data-lifecycle.md`). Empty when [`Delivery::payload_erased`].
    pub payload: Vec<u8>,
    /// The payload was encrypted for a data subject whose key `sealpost erase` destroyed: it
    /// can never be read again, and `payload` is empty. The envelope's description is
    /// intact; what the handler does with an erased event is the service's choice (most
    /// acknowledge it and do nothing).
    pub payload_erased: bool,
    /// Why the encrypted payload cannot be opened (no key in the database, or altered): the
    /// handler is not run, and the message is retried, then dead-lettered with this reason.
    unreadable: Option<String>,
    /// The key of this consumer's external call for this event (R18):
    /// `sealpost_core::inbox::idempotency_key(event id, consumer, options.effect)`. Every
    /// redelivery derives the same key.
    pub idempotency_key: String,
    /// The broker position's stream (NATS stream, Kafka `<topic>/<partition>`, RabbitMQ
    /// exchange) and sequence.
    pub stream: String,
    /// The position in the stream.
    pub sequence: u64,
    /// The broker subject or routing key.
    pub subject: String,
    /// How many times the broker delivered it, this delivery included.
    pub delivered: u64,
    consumer_id: Arc<str>,
}

impl Delivery {
    /// The idempotency key of another named effect of this handler (R18).
    pub fn idempotency_key_for(&self, effect: &str) -> String {
        sealpost_core::inbox::idempotency_key(self.event_id, &self.consumer_id, effect)
    }
}

/// The service's code, run inside the inbox transaction: every write goes through `tx`, so it
/// commits with the inbox row or not at all. Returning an error rolls back this message's
/// writes alone; the message is sent back and retried with the core's delay, and
/// dead-lettered at the redelivery limit.
///
/// A closure `|tx, delivery| Box::pin(async move { ... })` passed straight to [`run`] is a
/// handler.
pub trait Handler: Send + Sync + 'static {
    /// Applies one delivery.
    fn handle<'a>(
        &'a self,
        tx: &'a Transaction<'a>,
        delivery: &'a Delivery,
    ) -> BoxFuture<'a, Result<(), HandlerError>>;

    /// Applies several new deliveries of one batch (each a first delivery), in order. It may
    /// be called again on a subset when one of them fails; it must write for exactly the
    /// deliveries it is given. The default calls [`Handler::handle`] for each; override it
    /// to write a batch in one statement.
    fn handle_batch<'a>(
        &'a self,
        tx: &'a Transaction<'a>,
        deliveries: Vec<&'a Delivery>,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            for d in deliveries {
                self.handle(tx, d).await?;
            }
            Ok(())
        })
    }
}

impl<F> Handler for F
where
    F: for<'a> Fn(&'a Transaction<'a>, &'a Delivery) -> BoxFuture<'a, Result<(), HandlerError>>
        + Send
        + Sync
        + 'static,
{
    fn handle<'a>(
        &'a self,
        tx: &'a Transaction<'a>,
        delivery: &'a Delivery,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        self(tx, delivery)
    }
}

/// Where the consumer keeps its inbox, and where it reports its watermark: connection
/// sources ([`PgSource`]) the service injects (its own pool, or a [`PgConnector`] for a
/// connection string).
#[derive(Clone)]
pub struct Databases {
    /// The consumer's own database: inbox rows, dead letters and the handler's writes.
    pub inbox: Arc<dyn PgSource>,
    /// The outbox database `sealpost purge` reads the watermark from (`None`: the same
    /// database as the inbox).
    pub outbox: Option<Arc<dyn PgSource>>,
}

impl Databases {
    /// Inbox and watermark reports in one database, reached through `inbox`.
    pub fn new(inbox: impl PgSource) -> Databases {
        Databases {
            inbox: Arc::new(inbox),
            outbox: None,
        }
    }

    /// The watermark reported to another database (the outbox's), reached through `outbox`.
    pub fn with_outbox(mut self, outbox: impl PgSource) -> Databases {
        self.outbox = Some(Arc::new(outbox));
        self
    }

    /// Connection strings (TLS as each one's `sslmode` says): the inbox's, and the outbox's
    /// if it is another database.
    pub fn from_urls(inbox_url: &str, outbox_url: Option<&str>) -> Databases {
        let d = Databases::new(PgConnector::new(inbox_url));
        match outbox_url {
            Some(u) if u != inbox_url => d.with_outbox(PgConnector::new(u)),
            _ => d,
        }
    }

    /// `database_url` for the inbox, `outbox_database_url` (if set) for the reports.
    pub fn from_config(cfg: &Config) -> Databases {
        Databases::from_urls(&cfg.database_url, Some(cfg.outbox_url()))
    }

    fn outbox(&self) -> Arc<dyn PgSource> {
        self.outbox.clone().unwrap_or_else(|| self.inbox.clone())
    }
}

impl std::fmt::Debug for Databases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Databases")
            .field("inbox", &self.inbox.describe())
            .field("outbox", &self.outbox.as_ref().map(|o| o.describe()))
            .finish()
    }
}

/// The consumer's settings.
#[derive(Clone, Debug)]
pub struct Options {
    /// The consumer id: the inbox key's first part, the durable consumer, group or queue.
    pub consumer_id: String,
    /// The name of the handler's external effect in [`Delivery::idempotency_key`] (R18).
    pub effect: String,
    /// What one fetch may return.
    pub fetch: FetchLimits,
    /// Deliveries before a failing message is dead-lettered, and the delay between them.
    pub redelivery: RedeliveryPolicy,
    /// Time limit of one try of the handler (and `statement_timeout` of its transaction).
    pub effect_timeout_ms: u64,
    /// How often the watermark is reported to the outbox database.
    pub progress_every_ms: u64,
    /// Drills only (cargo feature `drills`): commit, then never settle what committed (a
    /// lost ack).
    #[cfg(feature = "drills")]
    pub drill_skip_ack: bool,
    /// Messages applied so far (committed with the inbox row), readable while it runs.
    pub applied: Arc<AtomicU64>,
    /// The signatures this consumer trusts ([`Keyring`]): a message whose seal its policy
    /// refuses is quarantined with the reason and never reaches the handler. Default: none
    /// checked ([`Keyring::off`]); [`Options::with_keyring`] or [`Config::keyring`].
    pub keyring: Arc<Keyring>,
}

impl Options {
    /// The defaults for `consumer_id`: batches of 500 messages or 8 MiB, 10 deliveries, 5 s
    /// per try of the handler, a report every second.
    pub fn new(consumer_id: impl Into<String>) -> Options {
        let d = Config::default();
        Options {
            consumer_id: consumer_id.into(),
            effect: "effect".to_string(),
            fetch: FetchLimits::default(),
            redelivery: RedeliveryPolicy {
                max_deliveries: d.consumer_max_deliveries,
                ..RedeliveryPolicy::default()
            },
            effect_timeout_ms: d.consumer_effect_timeout_ms,
            progress_every_ms: d.consumer_progress_every_ms,
            #[cfg(feature = "drills")]
            drill_skip_ack: false,
            applied: Arc::new(AtomicU64::new(0)),
            keyring: Arc::new(Keyring::off()),
        }
    }

    /// The same options, checking signatures with `keyring`.
    pub fn with_keyring(self, keyring: Arc<Keyring>) -> Options {
        Options { keyring, ..self }
    }

    /// The settings the runtime `Config` holds (`consumer_*`, `drill_skip_consumer_ack`, the
    /// keyring of [`Config::load_keys`]).
    pub fn from_config(cfg: &Config, consumer_id: impl Into<String>) -> Options {
        Options {
            redelivery: RedeliveryPolicy {
                max_deliveries: cfg.consumer_max_deliveries,
                ..RedeliveryPolicy::default()
            },
            effect_timeout_ms: cfg.consumer_effect_timeout_ms,
            progress_every_ms: cfg.consumer_progress_every_ms,
            #[cfg(feature = "drills")]
            drill_skip_ack: cfg.drill_skip_consumer_ack,
            // The keyring `Config::load_keys` read (none checked if it was not called).
            keyring: cfg.keys.keyring.clone(),
            ..Options::new(consumer_id)
        }
    }
}

/// How often the consumer reads its lag from the broker.
const LAG_EVERY: Duration = Duration::from_secs(5);

/// Runs the consumer until `shutdown` is cancelled: fetch a batch, apply it through the
/// inbox with `handler`, settle every message as the core decides, report the watermark.
/// A broker or database that goes away is reconnected with the core's backoff (100 ms
/// doubling to 30 s), never given up on; only an unusable TLS setting ends it with an error.
/// On shutdown it finishes the batch in hand and reports the watermark once more.
pub async fn run<S, H>(
    mut subscription: S,
    databases: Databases,
    options: Options,
    handler: H,
    shutdown: CancellationToken,
) -> Result<(), RunError>
where
    S: Subscription,
    H: Handler,
{
    let handler = Arc::new(handler);
    match options.keyring.policy() {
        SignaturePolicy::Require => {}
        policy => tracing::warn!(
            consumer = %options.consumer_id,
            signatures = policy.name(),
            "consumer trusts messages without a verified signature: anyone who may publish to the stream can forge an event; set verify_keys_dir (docs/operations.md, \"Signed envelopes\")"
        ),
    }
    let consumer_id: Arc<str> = Arc::from(options.consumer_id.as_str());
    let label = crate::observe::consumers().label(&options.consumer_id);
    let mut progress = Progress {
        db: databases.outbox(),
        consumer_id: options.consumer_id.clone(),
        every: Duration::from_millis(options.progress_every_ms),
        last: None,
        outbox: None,
    };
    let mut keys = PayloadKeys {
        outbox: databases.outbox.clone(),
        conn: None,
    };
    let mut pg: Option<PgConn> = None;
    let mut db_failures = 0u32;
    let mut broker_failures = 0u32;
    let mut broken = false;
    let mut lag_read_at: Option<Instant> = None;
    while !shutdown.is_cancelled() {
        if pg.as_ref().is_none_or(|c| c.is_closed()) {
            match databases.inbox.connect().await {
                Ok(c) => {
                    pg = Some(c);
                    db_failures = 0;
                }
                Err(RunError::Tls(e)) => return Err(RunError::Tls(e)),
                Err(e) => {
                    db_failures = db_failures.saturating_add(1);
                    let delay_ms = reconnect_backoff_ms(db_failures);
                    tracing::warn!(error = %e, delay_ms, "cannot reach the consumer's database; trying again after the delay");
                    pause(&shutdown, delay_ms).await;
                    continue;
                }
            }
        }
        if broken {
            broker_failures = broker_failures.saturating_add(1);
            let delay_ms = reconnect_backoff_ms(broker_failures);
            pause(&shutdown, delay_ms).await;
            if shutdown.is_cancelled() {
                break;
            }
            match subscription.reconnect().await {
                Ok(()) => {
                    tracing::info!(consumer = %consumer_id, "subscription reopened; what was unsettled comes back and the inbox absorbs it");
                    broken = false;
                    broker_failures = 0;
                }
                Err(e) => {
                    tracing::warn!(error = %e, failures = broker_failures, "cannot reopen the subscription yet");
                    continue;
                }
            }
        }
        progress.maybe_report(&mut subscription).await;
        if lag_read_at.is_none_or(|t| t.elapsed() >= LAG_EVERY) {
            lag_read_at = Some(Instant::now());
            if let Some(lag) = subscription.lag().await {
                metrics::gauge!(crate::observe::CONSUMER_LAG, "consumer" => label.clone())
                    .set(lag as f64);
            }
        }
        let messages = match subscription.fetch(options.fetch).await {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "fetch failed; reopening the subscription");
                broken = true;
                continue;
            }
        };
        if messages.is_empty() {
            continue;
        }
        let Some(client) = pg.as_deref_mut() else {
            continue;
        };
        let received: Vec<Received<'_>> = messages.iter().map(|m| subscription.read(m)).collect();
        let settled = apply_batch(
            client,
            received,
            &options,
            &handler,
            &consumer_id,
            &label,
            &mut keys,
        )
        .await;
        if client.is_closed() {
            pg = None;
        }
        #[cfg(feature = "drills")]
        let batch: Vec<(S::Message, Settlement)> = messages
            .into_iter()
            .zip(settled)
            .filter(|(_, s)| !(options.drill_skip_ack && *s == Settlement::Ack))
            .collect();
        #[cfg(not(feature = "drills"))]
        let batch: Vec<(S::Message, Settlement)> = messages.into_iter().zip(settled).collect();
        if let Err(e) = subscription.settle(batch).await {
            tracing::warn!(error = %e, "settling the batch failed; what was not settled comes back and the inbox absorbs it");
            broken = true;
        }
    }
    progress.report(&mut subscription).await;
    Ok(())
}

/// Sleeps `delay_ms`, or less if `shutdown` is cancelled.
async fn pause(shutdown: &CancellationToken, delay_ms: u64) {
    tokio::select! {
        _ = shutdown.cancelled() => {}
        _ = tokio::time::sleep(Duration::from_millis(delay_ms)) => {}
    }
}

/// A handler error in its own words; a database error with the server's message, SQLSTATE
/// and detail (tokio-postgres alone prints only "db error").
fn handler_words(e: &(dyn std::error::Error + Send + Sync + 'static)) -> String {
    match e.downcast_ref::<tokio_postgres::Error>() {
        Some(db) => crate::store::db_message(db),
        None => e.to_string(),
    }
}

/// One message's dead letter, before it is recorded.
fn dead_letter_of(r: &Received<'_>, kind: DeadLetterKind, reason: String) -> DeadLetter {
    DeadLetter {
        kind,
        event: r.headers.as_ref().ok().map(|h| (h.event_id, h.member)),
        stream: r.stream.clone(),
        sequence: r.sequence,
        subject: r.subject.clone(),
        delivered: r.delivered,
        reason,
        payload: r.payload.to_vec(),
    }
}

/// Where the consumer reads the data subjects' keys of encrypted payloads
/// (`sealpost.subject_keys`): the outbox database, on a connection opened the first time an
/// encrypted payload arrives (the inbox's own when they are one database).
struct PayloadKeys {
    outbox: Option<Arc<dyn PgSource>>,
    conn: Option<PgConn>,
}

impl PayloadKeys {
    async fn fetch(
        &mut self,
        inbox: &mut tokio_postgres::Client,
        subjects: &[Subject],
    ) -> Result<HashMap<Subject, KeyState>, String> {
        if subjects.is_empty() {
            return Ok(HashMap::new());
        }
        let Some(source) = &self.outbox else {
            return payload_key::keys_of(&*inbox, subjects)
                .await
                .map_err(|e| crate::store::db_message(&e));
        };
        if self.conn.as_ref().is_none_or(|c| c.is_closed()) {
            self.conn = Some(source.connect().await.map_err(|e| e.to_string())?);
        }
        let conn = self.conn.as_deref().expect("connected above");
        payload_key::keys_of(conn, subjects)
            .await
            .map_err(|e| crate::store::db_message(&e))
    }
}

/// Applies one fetched batch through the inbox and decides each message's settlement, in
/// fetch order. Dead letters are committed before their `Terminate` is returned; a dead
/// letter that cannot be written turns into a retry.
async fn apply_batch<H: Handler>(
    pg: &mut tokio_postgres::Client,
    received: Vec<Received<'_>>,
    options: &Options,
    handler: &Arc<H>,
    consumer_id: &Arc<str>,
    label: &str,
    keys: &mut PayloadKeys,
) -> Vec<Settlement> {
    let policy = options.redelivery;
    let mut settled: Vec<Option<Settlement>> = vec![None; received.len()];
    let subjects = payload_key::subjects_of(
        received
            .iter()
            .filter(|r| r.headers.is_ok())
            .map(|r| r.payload),
    );
    let keys = keys.fetch(pg, &subjects).await;
    if let Err(e) = &keys {
        tracing::warn!(error = %e, "cannot read the keys of encrypted payloads; those messages come back after a delay");
    }
    let mut letters: Vec<(usize, DeadLetter)> = Vec::new();
    let mut index = Vec::new();
    let mut inbox_ds = Vec::new();
    let mut user_ds = Vec::new();
    for (i, r) in received.iter().enumerate() {
        match &r.headers {
            Err(why) => match decide_settlement(Processed::Unreadable, r.delivered, policy) {
                Settlement::Terminate => letters.push((
                    i,
                    dead_letter_of(r, DeadLetterKind::Unreadable, why.clone()),
                )),
                other => settled[i] = Some(other),
            },
            Ok(h) => {
                let opened = match &keys {
                    Ok(keys) => payload_key::open_with(r.payload, keys),
                    Err(_) if payload_key::frame(r.payload).is_none() => Opened::Plain,
                    Err(_) => {
                        // Not the message's fault: never dead-lettered for it.
                        settled[i] = Some(decide_settlement(
                            Processed::Failed(Failure::Transaction),
                            r.delivered,
                            policy,
                        ));
                        continue;
                    }
                };
                let (payload, payload_erased, unreadable) = match opened {
                    Opened::Plain => (r.payload.to_vec(), false, None),
                    Opened::Opened(p) => (p, false, None),
                    Opened::Erased(_) => (Vec::new(), true, None),
                    Opened::Unreadable(why) => (Vec::new(), false, Some(why)),
                };
                let payload_digest = Digest::of_bytes(PAYLOAD_DOMAIN, r.payload);
                inbox_ds.push(inbox::Delivery {
                    event_id: h.event_id,
                    member: h.member,
                    claimed_digest: h.claimed_digest,
                    payload_digest,
                    signatures: options.keyring.policy(),
                    presented: options.keyring.presented(h, payload_digest),
                    stream: r.stream.clone(),
                    sequence: r.sequence,
                });
                user_ds.push(Delivery {
                    event_id: h.event_id,
                    member: h.member,
                    envelope: h.envelope.clone(),
                    payload,
                    payload_erased,
                    unreadable,
                    idempotency_key: sealpost_core::inbox::idempotency_key(
                        h.event_id,
                        consumer_id,
                        &options.effect,
                    ),
                    stream: r.stream.clone(),
                    sequence: r.sequence,
                    subject: r.subject.clone(),
                    delivered: r.delivered,
                    consumer_id: consumer_id.clone(),
                });
                index.push(i);
            }
        }
    }
    if !index.is_empty() {
        let user_ds = Arc::new(user_ds);
        let effect: inbox::AnyEffect<'_> = {
            let handler = handler.clone();
            let ds = user_ds.clone();
            Box::new(move |tx, apply| {
                let handler = handler.clone();
                let ds = ds.clone();
                Box::pin(async move {
                    let chosen: Vec<&Delivery> = apply.iter().map(|&i| &ds[i]).collect();
                    if let Some(why) = chosen.iter().find_map(|d| d.unreadable.as_deref()) {
                        return Err(StoreError::Effect(format!(
                            "the encrypted payload cannot be opened: {why}"
                        )));
                    }
                    handler
                        .handle_batch(tx, chosen)
                        .await
                        .map_err(|e| StoreError::Effect(handler_words(&*e)))
                })
            })
        };
        let timeout = Some(Duration::from_millis(options.effect_timeout_ms.max(1)));
        match inbox::process_batch_any(pg, &options.consumer_id, &inbox_ds, effect, timeout).await {
            Ok(outcomes) => {
                for ((&i, d), outcome) in index.iter().zip(user_ds.iter()).zip(outcomes) {
                    metrics::counter!(crate::observe::CONSUMER_MESSAGES,
                        "consumer" => label.to_string(), "outcome" => outcome.name())
                    .increment(1);
                    let processed = match &outcome {
                        BatchOutcome::Applied { .. } => {
                            options.applied.fetch_add(1, Ordering::Relaxed);
                            Processed::Applied
                        }
                        BatchOutcome::Duplicate { .. } => Processed::Duplicate,
                        BatchOutcome::Quarantined => Processed::Quarantined,
                        BatchOutcome::Failed { .. } => Processed::Failed(Failure::Message),
                    };
                    let s = decide_settlement(processed, d.delivered, policy);
                    if let BatchOutcome::Failed { error } = outcome {
                        match s {
                            Settlement::Terminate => {
                                letters.push((
                                    i,
                                    dead_letter_of(
                                        &received[i],
                                        DeadLetterKind::EffectFailed,
                                        error,
                                    ),
                                ));
                                continue;
                            }
                            Settlement::RetryAfter { delay_ms } => {
                                tracing::warn!(subject = %d.subject, stream = %d.stream, sequence = d.sequence,
                                    delivered = d.delivered, delay_ms, %error,
                                    "the handler failed and was rolled back; the message comes back after the delay");
                            }
                            Settlement::Ack => {}
                        }
                    }
                    settled[i] = Some(s);
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, messages = index.len(),
                    "inbox transaction failed; the batch comes back after a delay");
                for (&i, d) in index.iter().zip(user_ds.iter()) {
                    // Not the messages' fault: never dead-lettered for it.
                    settled[i] = Some(decide_settlement(
                        Processed::Failed(Failure::Transaction),
                        d.delivered,
                        policy,
                    ));
                }
            }
        }
    }
    if !letters.is_empty() {
        let rows: Vec<DeadLetter> = letters.iter().map(|(_, l)| l.clone()).collect();
        match inbox::dead_letter(pg, &options.consumer_id, &rows).await {
            Ok(()) => {
                for (i, l) in &letters {
                    tracing::error!(subject = %l.subject, stream = %l.stream, sequence = l.sequence,
                        delivered = l.delivered, reason = %l.reason,
                        "message dead-lettered: recorded in sealpost.inbox_quarantine, the broker will not deliver it again");
                    settled[*i] = Some(Settlement::Terminate);
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, messages = letters.len(),
                    "cannot record dead letters; the messages come back after a delay");
                for (i, l) in &letters {
                    settled[*i] = Some(decide_settlement(
                        Processed::Failed(Failure::Transaction),
                        l.delivered,
                        policy,
                    ));
                }
            }
        }
    }
    settled
        .into_iter()
        .map(|s| s.expect("every fetched message is settled"))
        .collect()
}

/// The consumer's reports of its contiguous watermark to the outbox database.
struct Progress {
    db: Arc<dyn PgSource>,
    consumer_id: String,
    every: Duration,
    last: Option<Instant>,
    outbox: Option<PgConn>,
}

impl Progress {
    /// Reports when the interval has passed since the last report.
    async fn maybe_report<S: Subscription>(&mut self, sub: &mut S) {
        if self.last.is_none_or(|t| t.elapsed() >= self.every) {
            self.report(sub).await;
        }
    }

    /// Reports the subscription's watermarks. A failure is logged with its cause and retried
    /// at the next report; it never stops consumption (purge just waits longer).
    async fn report<S: Subscription>(&mut self, sub: &mut S) {
        self.last = Some(Instant::now());
        let marks = match sub.watermarks().await {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the consumer's watermark; progress not reported");
                return;
            }
        };
        if marks.is_empty() {
            return;
        }
        if self.outbox.as_ref().is_none_or(|c| c.is_closed()) {
            match self.db.connect().await {
                Ok(c) => self.outbox = Some(c),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot reach the outbox database; progress not reported");
                    return;
                }
            }
        }
        let Some(outbox) = &self.outbox else { return };
        for (stream, watermark) in marks {
            if let Err(e) =
                inbox::report_progress(outbox, &self.consumer_id, &stream, watermark).await
            {
                tracing::warn!(error = %e, %stream, "progress not reported to the outbox database (is it migrated, and may this consumer write sealpost.consumer_progress?)");
            }
        }
    }
}
