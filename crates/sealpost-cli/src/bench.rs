//! `sealpost bench`: four phases in one run (and a consumer's), every figure printed, none
//! asserted.
//!
//! * **A, drain.** Optionally `--retained N` rows that are already `PUBLISHED` are put in the
//!   outbox first (the table of a system that has run for a while). Then a backlog of
//!   `--events` is committed and Sealpost's dispatchers (and a reconciler, as in production)
//!   start on it with no producer running: `sealpost_events_per_s`, with the WAL bytes and
//!   the store's statements per event of that drain.
//! * **B, latency under load.** A second backlog (`--load-backlog`, default a quarter of
//!   `--events`) is committed, then a fresh fleet starts on it while producers commit at the
//!   offered `--rate` for `--latency-s` seconds: the net drain rate of the backlog with
//!   production still flowing, and commit -> `PUBLISHED` latency of the producers' events.
//! * **Naive relay.** The same `--events` drained by the careful relay users write by hand
//!   ([`naive_relay`]), as many relays as Sealpost has dispatchers, in its own table and
//!   stream, with the same WAL and statement figures.
//! * **Naive relay, Sealpost's message.** The same relay once more, sending what a
//!   dispatcher sends ([`RelayWire::Sealpost`]): the message's cost, apart from the store's.
//!
//! Every drain reports its CPU per event by process group ([`crate::cpu`]) and the
//! PostgreSQL checkpoints started during it.
//!
//! `--per-broker` runs none of these: it drains the same backlog through NATS, RabbitMQ and
//! Kafka in turn ([`per_broker`]), one line per broker with its ratio to NATS.
//!
//! The bench's tables and streams are named after the run (`BENCH<tag>`, `NAIVE<tag>`,
//! `NAIVEW<tag>`, `sealpost_bench_naive_<tag>`, `sealpost_bench_naive_wire_<tag>`), so
//! concurrent runs never see each other's rows; the relays' tables, every event the run put
//! in the outbox (drained, produced or retained), its route and the three streams are removed
//! at the end.
//!
//! **Schema-dependent SQL.** Every statement that reads or writes the Sealpost schema
//! (`sealpost.envelope` and friends) directly, rather than through `sealpost::store`, is in
//! the functions of the section marked `SCHEMA-DEPENDENT` below ([`count_left`],
//! [`fill_retained`], [`drop_run`], [`published_until_ms`], [`latencies`]); a schema
//! change ports those and nothing else here.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::Settings;
use async_nats::jetstream::message::PublishMessage;
use sealpost::runtime::CancellationToken;
use sealpost::runtime::{self, Counters, RunError};
use sealpost::store::{self, StoreError};
use sealpost_core::envelope::{
    Destination, EventId, EventOrdering, PartitionAlgorithm, RoutePolicy, PAYLOAD_DOMAIN,
    SCHEMA_DOMAIN,
};
use sealpost_core::port::{Broker, SendRequest, SendResult, WireEnvelope};
use sealpost_core::Digest;
use sealpost_nats::Nats;
use tokio::task::JoinHandle;

use crate::cpu::{self, PerEvent};

/// Bench parameters.
#[derive(Clone, Copy, Debug)]
pub struct BenchArgs {
    /// Backlog size of the drain phase (and of the naive relay's drain).
    pub events: u64,
    /// Payload bytes.
    pub payload_bytes: usize,
    /// Dispatcher tasks (and naive relays).
    pub dispatchers: usize,
    /// Offered rate of the producers in the load phase.
    pub rate_per_s: u64,
    /// Duration of the producers in the load phase (at least; see [`BenchReport::load_s`]).
    pub latency_s: u64,
    /// Backlog committed before the load phase starts.
    pub load_backlog: u64,
    /// `PUBLISHED` rows put in the outbox before the drain phase.
    pub retained: u64,
}

/// Bench results. Rates are events per second; `NaN` figures (nothing to measure) are
/// `null` in JSON.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BenchReport {
    /// The NATS server's version, as it announced itself: the figures differ between
    /// versions (`.ci/run` runs the bench on 2.9 and on 2.15).
    pub nats_server_version: String,
    /// Backlog size of the drain phase (and of the naive relay's drain).
    pub events: u64,
    /// `PUBLISHED` rows already in the outbox during both Sealpost phases (`--retained`).
    pub retained: u64,
    /// Payload size of every event, bytes (`--payload-bytes`).
    pub payload_bytes: usize,
    /// Sealpost dispatchers, and naive relays.
    pub dispatchers: usize,
    /// Sealpost drain rate of the prefilled backlog, no producers running: events divided
    /// by the time from starting the fleet to the last of them `PUBLISHED` (database clock).
    pub sealpost_events_per_s: f64,
    /// Naive relay drain rate of a backlog of the same size.
    pub naive_events_per_s: f64,
    /// sealpost / naive.
    pub ratio: f64,
    /// The naive relay publishes every message with `Nats-Msg-Id` = its event id (always
    /// true: says which relay the ratio is against).
    pub naive_msg_id: bool,
    /// Publishes or acknowledgements of the naive relay that failed (each failure rolled its
    /// batch back and the batch was sent again).
    pub naive_publish_failures: u64,
    /// WAL the server wrote during Sealpost's drain, per event (`pg_wal_lsn_diff` of
    /// `pg_current_wal_lsn()` before and after). Server-wide: other sessions on the same
    /// server during the drain are counted too.
    pub wal_bytes_per_event: f64,
    /// The same for the naive relay's drain.
    pub naive_wal_bytes_per_event: f64,
    /// WAL the server wrote while the drain's backlog was enqueued (`enqueue_many` in
    /// batches of 2,000, envelope and work row and their index entries), per event.
    /// Server-wide, like `wal_bytes_per_event`.
    pub enqueue_wal_bytes_per_event: f64,
    /// Growth of the outbox tables' heap (`sealpost.envelope` and `sealpost.work`,
    /// `pg_relation_size` plus TOAST) while the backlog was enqueued, per event.
    pub heap_bytes_per_event: f64,
    /// Growth of their indexes (`pg_indexes_size`) over the same enqueue, per event.
    pub index_bytes_per_event: f64,
    /// Statements the store issued during Sealpost's drain per event
    /// ([`store::statements_issued`], dispatchers and reconciler). `null` while the store
    /// does not count its statements (the counter did not move).
    pub statements_per_event: f64,
    /// Statements the naive relays sent during their drain per event: every statement,
    /// `BEGIN`, `COMMIT` and `ROLLBACK` and the idle check included, each prepared statement
    /// counted once when prepared and once per execution.
    pub naive_statements_per_event: f64,
    /// Backlog committed before the load phase started.
    pub load_backlog: u64,
    /// Offered rate of the producers during the load phase.
    pub rate_per_s: u64,
    /// Rate the producers achieved (events committed / `load_s`).
    pub produced_events_per_s: f64,
    /// How long the producers ran: until the backlog was gone, then `--latency-s` more.
    pub load_s: f64,
    /// Net drain rate under load (R27): the rate at which the load-phase backlog shrinks with
    /// production still flowing, i.e. `load_backlog` divided by the seconds from the start
    /// of the load phase (fleet started, producers starting) until no row committed before
    /// that start is unpublished (the last of them `PUBLISHED`, database clock).
    pub net_drain_events_per_s: f64,
    /// Producers' events in the steady-state latency sample: committed more than
    /// `SETTLE_MS` after the backlog drained, while producers still commit at the offered rate.
    pub latency_events: u64,
    /// Commit -> `PUBLISHED` latency of those events, median (producers running).
    pub latency_ms_p50: f64,
    /// The same, 99th percentile.
    pub latency_ms_p99: f64,
    /// Producers' events committed while the backlog drained (they queue behind it: the
    /// dispatchers claim in commit order).
    pub latency_events_during_backlog: u64,
    /// 99th percentile latency of those events.
    pub latency_ms_p99_during_backlog: f64,
    /// The producers' transactions (one per 10 ms tick) once the backlog was gone.
    pub producer_commits: u64,
    /// How long their `COMMIT` took, 99th percentile (ms): the server's WAL flush. Each
    /// event's latency counts from its insert, so a slow flush adds to it twice: in the
    /// producer's commit and in the acceptance's. A commit of a few events taking tens of
    /// milliseconds is the machine's storage, not the outbox.
    pub producer_commit_ms_p99: f64,
    /// The slowest of them (ms).
    pub producer_commit_ms_max: f64,
    /// Of them, those that took more than 25 ms.
    pub producer_commits_over_25_ms: u64,
    /// PostgreSQL checkpoints started during the load phase (`pg_stat_bgwriter`): a
    /// checkpoint's writes and the full-page images after it are the usual cause of a
    /// latency tail there.
    pub checkpoints_during_load: Option<i64>,
    /// One `sealpost consume` consumer applying the topic's events through the batched inbox
    /// (one transaction and one effect statement per fetched batch, acks after the commit).
    pub consume_events_per_s: f64,
    /// Where the drain's CPU went, per event: PostgreSQL's processes, the NATS servers and
    /// this process (the dispatchers and the reconciler), from the fleet's start until the
    /// bench saw the backlog gone (it looks every 100 ms, so up to that much idle polling
    /// is included; the rate ends at the last `published_at_ms`) ([`crate::cpu`]; a group
    /// not on this machine is `null`). On a machine the servers share, total CPU per event
    /// is what bounds the drain rate.
    pub cpu_per_event: PerEvent,
    /// The same for the careful relay's drain.
    pub naive_cpu_per_event: PerEvent,
    /// PostgreSQL checkpoints started during Sealpost's drain (their writes, and the
    /// full-page images after them, are part of `cpu_per_event.postgres_us`).
    pub checkpoints_during_drain: Option<i64>,
    /// The same during the careful relay's drain.
    pub naive_checkpoints_during_drain: Option<i64>,
    /// The same during the drain of the relay sending Sealpost's message.
    pub wire_relay_checkpoints_during_drain: Option<i64>,
    /// The careful relay again, over a backlog of the same size, but sending Sealpost's
    /// message through the adapter a dispatcher uses: a subject per event published
    /// create-if-absent (what lets the reconciler ask the broker, R13) and the envelope's
    /// headers (R30) with Sealpost's digests. `naive_events_per_s` minus this is what the
    /// message costs; this minus `sealpost_events_per_s` is what the store's fencing costs.
    pub wire_relay_events_per_s: f64,
    /// `sealpost_events_per_s / wire_relay_events_per_s`.
    pub ratio_to_wire_relay: f64,
    /// `wire_relay_events_per_s / naive_events_per_s`: what Sealpost's message leaves of the
    /// careful relay's rate.
    pub wire_relay_ratio_to_naive: f64,
    /// Publishes of that relay that failed (each rolled back and sent again).
    pub wire_relay_publish_failures: u64,
    /// Where that relay's drain CPU went, per event.
    pub wire_relay_cpu_per_event: PerEvent,
    /// The CDC publisher in the same run, on the same route and broker.
    pub cdc: CdcFigures,
}

/// The CDC publisher's figures (`sealpost cdc`, [`sealpost::cdc::publisher`]) in the same
/// run as the polling drain and the relays. `NaN` figures are `null` in JSON; `skipped`
/// says why there are none.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CdcFigures {
    /// Why the CDC phase did not run (the database's `wal_level` is not `logical`).
    pub skipped: Option<String>,
    /// Drain of a prefilled backlog of `events` by one publisher (with the reconciler
    /// beside it, as `sealpost cdc` runs): from its start to the last of them `PUBLISHED`,
    /// database clock. The backlog was committed after the slot was made, so the log names
    /// it; a publisher that starts catches up by scanning the claim index while scans find
    /// work (the core's `ClaimSource`), then follows the log.
    pub drain_events_per_s: f64,
    /// `drain_events_per_s / sealpost_events_per_s` (the polling fleet's drain).
    pub drain_ratio_to_polling: f64,
    /// Seconds from the drain's end until the slot confirmed the log up to it (the
    /// publisher reads through the backlog's inserts, already published); the producers
    /// start then.
    pub log_caught_up_s: f64,
    /// How long the producers ran with the publisher following the log.
    pub load_s: f64,
    /// Rate the producers achieved (offered: `rate_per_s`).
    pub produced_events_per_s: f64,
    /// The producers' events: commit -> `PUBLISHED` latency, median.
    pub latency_ms_p50: f64,
    /// The same, 99th percentile.
    pub latency_ms_p99: f64,
    /// Events in the latency sample.
    pub latency_events: u64,
    /// Of those, the ones the publisher claimed because the log named them (the others a
    /// periodic scan found first).
    pub claimed_from_log: u64,
    /// WAL the slot held the server to (`pg_current_wal_lsn()` less the slot's
    /// `confirmed_flush_lsn`), sampled every 100 ms while the producers ran: the most.
    pub wal_retained_bytes_max: f64,
    /// The same, the median of the samples.
    pub wal_retained_bytes_p50: f64,
}

impl CdcFigures {
    fn skipped(why: String) -> CdcFigures {
        CdcFigures {
            skipped: Some(why),
            drain_events_per_s: f64::NAN,
            drain_ratio_to_polling: f64::NAN,
            log_caught_up_s: f64::NAN,
            load_s: f64::NAN,
            produced_events_per_s: f64::NAN,
            latency_ms_p50: f64::NAN,
            latency_ms_p99: f64::NAN,
            latency_events: 0,
            claimed_from_log: 0,
            wal_retained_bytes_max: f64::NAN,
            wal_retained_bytes_p50: f64::NAN,
        }
    }
}

fn db(e: tokio_postgres::Error) -> RunError {
    RunError::Store(StoreError::Db(e))
}

fn round(x: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (x * f).round() / f
}

/// The `p` quantile of sorted values (nearest rank); `NaN` when there are none.
fn quantile(sorted: &[i64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1] as f64
}

/// Commits `n` events on `route` in transactions of 2,000 (keys `<prefix>-<k>`).
async fn prefill(
    pg: &mut tokio_postgres::Client,
    route: &str,
    prefix: &str,
    n: u64,
    payload: &[u8],
) -> Result<(), RunError> {
    let mut i = 0;
    while i < n {
        let m = (n - i).min(2_000);
        let keys: Vec<String> = (i..i + m).map(|k| format!("{prefix}-{k}")).collect();
        let events = crate::demo::order_batch(&keys, payload);
        let tx = pg.transaction().await.map_err(db)?;
        store::enqueue_many(&tx, route, &events).await?;
        tx.commit().await.map_err(db)?;
        i += m;
    }
    Ok(())
}

/// The server's current WAL position.
async fn wal_lsn(pg: &tokio_postgres::Client) -> Result<String, RunError> {
    Ok(pg
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .map_err(db)?
        .get(0))
}

/// WAL bytes the server wrote since `lsn`.
async fn wal_bytes_since(pg: &tokio_postgres::Client, lsn: &str) -> Result<f64, RunError> {
    Ok(pg
        .query_one(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::text::pg_lsn)::float8",
            &[&lsn],
        )
        .await
        .map_err(db)?
        .get(0))
}

/// Checkpoints PostgreSQL has started so far (timed and requested): `pg_stat_bgwriter` up to
/// PostgreSQL 16, `pg_stat_checkpointer` from 17; `None` where neither can be read.
async fn checkpoints(pg: &tokio_postgres::Client) -> Option<i64> {
    for sql in [
        "SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter",
        "SELECT num_timed + num_requested FROM pg_stat_checkpointer",
    ] {
        if let Ok(r) = pg.query_one(sql, &[]).await {
            return r.try_get(0).ok();
        }
    }
    None
}

/// Checkpoints started since `before` was read.
async fn checkpoints_since(pg: &tokio_postgres::Client, before: Option<i64>) -> Option<i64> {
    Some(checkpoints(pg).await? - before?)
}

// ---------------------------------------------------------------------------------------
// SCHEMA-DEPENDENT: the only SQL in this file that names Sealpost's tables. Port these when
// the schema changes (v2 layout); everything else goes through `sealpost::store`.
// ---------------------------------------------------------------------------------------

/// Heap (with TOAST) and index bytes of the outbox tables (`sealpost.envelope`,
/// `sealpost.work`).
async fn outbox_sizes(pg: &tokio_postgres::Client) -> Result<(i64, i64), RunError> {
    let r = pg
        .query_one(
            "SELECT sum(pg_table_size(t))::int8, sum(pg_indexes_size(t))::int8
             FROM unnest(ARRAY['sealpost.envelope'::regclass, 'sealpost.work'::regclass]) AS t",
            &[],
        )
        .await
        .map_err(db)?;
    Ok((r.get(0), r.get(1)))
}

/// Marks the rows [`fill_retained`] writes (their `aggregate_type`), so they can be told from
/// the drained events.
const RETAINED_AGGREGATE: &str = "bench.retained";

/// 1 while a row of the bench's own `cluster` (a name no other run uses) created at or before `created_before_ms` (`i64::MAX`: all) is not
/// yet published, else 0. Stops at the first such row (the dispatchable and unknown rows come
/// first in their partial indexes), so polling it costs the drain nothing measurable; a
/// `count(*)` joined with the envelopes here took a core of its own. Each probe is a scalar
/// subquery ordered as its index is: as `EXISTS`, with statistics saying every row is this
/// cluster's and dispatchable (taken right after the prefill), PostgreSQL chose a sequential
/// scan, which after a `--retained` run's cleanup read the 400,000 empty pages before the
/// live rows (0.66 s per probe, every 100 ms, inside the drain's window).
async fn count_left(
    pg: &tokio_postgres::Client,
    cluster: &str,
    created_before_ms: i64,
) -> Result<i64, RunError> {
    Ok(pg
        .query_one(
            "SELECT ((SELECT 1 FROM sealpost.work
                      WHERE phase = 0 AND dest_cluster = $1 AND created_at_ms <= $2
                      ORDER BY dest_cluster, committed_seq LIMIT 1) IS NOT NULL
                     OR (SELECT 1 FROM sealpost.work
                         WHERE phase = 1 AND dest_cluster = $1 AND created_at_ms <= $2
                         ORDER BY next_lookup_at_ms LIMIT 1) IS NOT NULL)::int::int8",
            &[&cluster, &created_before_ms],
        )
        .await
        .map_err(db)?
        .get(0))
}

/// Puts `n` rows that are already `PUBLISHED` (primary receipt in the work row, never sent)
/// on `route`, in statements of 500,000 rows: one event is enqueued as a template, its
/// sealed envelope and work row are copied by `INSERT ... SELECT ... FROM generate_series`
/// with fresh UUIDv7-shaped event ids dated before now (ascending, as a system that ran for
/// a while has them), then the template is deleted. Ends with `VACUUM ANALYZE` so the drain
/// sees the steady state of old rows rather than a vacuum of the fill.
pub async fn fill_retained(
    pg: &mut tokio_postgres::Client,
    route: &str,
    n: u64,
    payload: &[u8],
    say: &dyn Fn(String),
) -> Result<(), RunError> {
    if n == 0 {
        return Ok(());
    }
    let keys = vec!["retained-template".to_string()];
    let events = crate::demo::order_batch(&keys, payload);
    let tx = pg.transaction().await.map_err(db)?;
    let env = store::enqueue_many(&tx, route, &events).await?;
    tx.commit().await.map_err(db)?;
    let template = uuid::Uuid::from_bytes(env[0].event_id.0);
    let now_ms = store::db_now_ms(&*pg).await? as i64;
    // One id per millisecond, the last one `now_ms`.
    let first_ms = now_ms - n as i64;
    let chunk = 500_000u64;
    let mut done = 0u64;
    while done < n {
        let m = (n - done).min(chunk) as i64;
        pg.execute(
            "WITH e AS (
               INSERT INTO sealpost.envelope (event_id, member, envelope_generation, aggregate_type,
                   aggregate_id, aggregate_version, event_type, payload_schema_digest, payload_digest,
                   tenant, occurred_at_ms, creating_txid, dest_cluster, dest_topic, dest_routing_key,
                   dest_partition_alg, dest_policy_generation, dest_serializer, dest_durability,
                   dest_required_ack, destination_digest, envelope_digest, payload, created_at_ms)
               SELECT (lpad(to_hex($3::int8 + g), 12, '0') || '7'
                          || substr(replace(gen_random_uuid()::text, '-', ''), 14, 19))::uuid,
                      0, t.envelope_generation, $4, 'r-' || ($3::int8 + g), t.aggregate_version,
                      t.event_type, t.payload_schema_digest, t.payload_digest, t.tenant,
                      $3::int8 + g, t.creating_txid, t.dest_cluster, t.dest_topic,
                      t.dest_routing_key, t.dest_partition_alg, t.dest_policy_generation,
                      t.dest_serializer, t.dest_durability, t.dest_required_ack,
                      t.destination_digest, t.envelope_digest, t.payload, $3::int8 + g
               FROM sealpost.envelope t, generate_series($2::int8 + 1, $2::int8 + $5::int8) g
               WHERE t.event_id = $1 AND t.member = 0
               RETURNING event_id, member, envelope_generation, dest_cluster, dest_topic, created_at_ms)
             INSERT INTO sealpost.work (event_id, member, envelope_generation, dest_cluster,
                 created_at_ms, phase, state, attempt_generation, published_at_ms,
                 primary_attempt_id, primary_cluster, primary_stream, primary_sequence)
             SELECT event_id, member, envelope_generation, dest_cluster, created_at_ms, 2,
                    'PUBLISHED', 1, created_at_ms + 5, 0, dest_cluster, dest_topic,
                    created_at_ms - $3::int8
             FROM e",
            &[
                &template,
                &(done as i64),
                &first_ms,
                &RETAINED_AGGREGATE,
                &m,
            ],
        )
        .await
        .map_err(db)?;
        done += m as u64;
        say(format!("retained rows: {done} / {n}"));
    }
    pg.batch_execute(&format!(
        "DELETE FROM sealpost.work WHERE event_id = '{template}';
         DELETE FROM sealpost.envelope WHERE event_id = '{template}';"
    ))
    .await
    .map_err(db)?;
    say("vacuum analyze sealpost.envelope, sealpost.work ...".to_string());
    pg.batch_execute("VACUUM (ANALYZE) sealpost.envelope, sealpost.work")
        .await
        .map_err(db)?;
    Ok(())
}

/// Deletes everything the run put in the outbox: every event on the run's own `topic` (the
/// drained backlogs, the producers' events and the rows [`fill_retained`] put there) with its
/// history rows and the verification pass's findings (it looks the retained rows up at the
/// broker and finds nothing: they were never sent), then the run's `route`. A user's outbox
/// is not left holding a benchmark's quarter of a million `PUBLISHED` rows per run; the dead
/// rows are left to (auto)vacuum. Returns the number of events removed.
async fn drop_run(pg: &tokio_postgres::Client, topic: &str, route: &str) -> Result<u64, RunError> {
    for history in [
        "audit",
        "attempt",
        "receipt",
        "quarantine",
        "finding",
        "migration",
        "work",
    ] {
        pg.execute(
            &format!(
                "DELETE FROM sealpost.{history} h USING sealpost.envelope e
                 WHERE h.event_id = e.event_id AND h.member = e.member AND e.dest_topic = $1"
            ),
            &[&topic],
        )
        .await
        .map_err(db)?;
    }
    let events = pg
        .execute(
            "DELETE FROM sealpost.envelope WHERE dest_topic = $1",
            &[&topic],
        )
        .await
        .map_err(db)?;
    pg.execute(
        "DELETE FROM sealpost.route_policy WHERE name = $1",
        &[&route],
    )
    .await
    .map_err(db)?;
    Ok(events)
}

/// When the last row of `topic` created in `[from_ms, to_ms]` was `PUBLISHED` (database
/// clock, ms); `None` if none was.
async fn published_until_ms(
    pg: &tokio_postgres::Client,
    topic: &str,
    from_ms: i64,
    to_ms: i64,
) -> Result<Option<i64>, RunError> {
    Ok(pg
        .query_one(
            "SELECT max(published_at_ms) FROM sealpost.outbox
             WHERE dest_topic = $1 AND created_at_ms BETWEEN $2 AND $3",
            &[&topic, &from_ms, &to_ms],
        )
        .await
        .map_err(db)?
        .get(0))
}

/// `(created_at_ms, commit -> PUBLISHED ms)` of the rows of `topic` created after
/// `after_ms`, by latency.
async fn latencies(
    pg: &tokio_postgres::Client,
    topic: &str,
    after_ms: i64,
) -> Result<Vec<(i64, i64)>, RunError> {
    Ok(pg
        .query(
            "SELECT created_at_ms, published_at_ms - created_at_ms FROM sealpost.outbox
             WHERE dest_topic = $1 AND created_at_ms > $2 AND published_at_ms IS NOT NULL
             ORDER BY 2",
            &[&topic, &after_ms],
        )
        .await
        .map_err(db)?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect())
}

// ------------------------------------------------------------------ end SCHEMA-DEPENDENT

/// A running fleet of dispatchers and a reconciler.
struct Fleet {
    stop: CancellationToken,
    tasks: Vec<JoinHandle<Result<(), RunError>>>,
}

impl Fleet {
    fn start(cfg: &Settings, nats: &Nats, dispatchers: usize) -> Fleet {
        Fleet::start_on(cfg, &Arc::new(nats.clone()), dispatchers)
    }

    fn start_on<B: Broker>(cfg: &Settings, broker: &Arc<B>, dispatchers: usize) -> Fleet {
        let stop = CancellationToken::new();
        let counters = Arc::new(Counters::default());
        // As in production, a reconciler runs beside the dispatchers.
        let tasks = runtime::spawn_fleet(
            cfg,
            &crate::config::pg_source(cfg),
            broker,
            dispatchers,
            true,
            &stop,
            &counters,
        );
        Fleet { stop, tasks }
    }

    /// One CDC publisher and a reconciler, as `sealpost cdc` runs them; its counters
    /// (`from_log`: claims the log named).
    fn start_cdc(cfg: &Settings, nats: &Nats) -> (Fleet, Arc<Counters>) {
        let stop = CancellationToken::new();
        let counters = Arc::new(Counters::default());
        let db = crate::config::pg_source(cfg);
        let broker = Arc::new(nats.clone());
        let tasks = vec![
            tokio::spawn(sealpost::cdc::publisher(
                cfg.run.clone(),
                db.clone(),
                broker.clone(),
                stop.clone(),
                counters.clone(),
            )),
            tokio::spawn(runtime::reconciler(
                cfg.run.clone(),
                db,
                broker,
                stop.clone(),
                counters.clone(),
            )),
        ];
        (Fleet { stop, tasks }, counters)
    }

    /// A task ended before it was told to stop (it failed).
    fn broken(&self) -> bool {
        self.tasks.iter().any(|t| t.is_finished())
    }

    async fn stop(self) -> Result<(), RunError> {
        self.stop.cancel();
        for t in self.tasks {
            t.await.expect("dispatcher panicked")?;
        }
        Ok(())
    }
}

/// Waits until no row of the bench's `cluster` created at or before `created_before_ms` is unpublished;
/// false if the fleet broke meanwhile.
async fn wait_drained(
    pg: &tokio_postgres::Client,
    cluster: &str,
    created_before_ms: i64,
    fleet: &Fleet,
) -> Result<bool, RunError> {
    while count_left(pg, cluster, created_before_ms).await? > 0 {
        if fleet.broken() {
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(true)
}

/// Stops a broken fleet and returns its error.
async fn fleet_error(fleet: Fleet) -> RunError {
    match fleet.stop().await {
        Err(e) => e,
        Ok(()) => RunError::broker(std::io::Error::other(
            "a dispatcher or the reconciler stopped before the bench told it to",
        )),
    }
}

/// Producers of the load phase: on their own connection, one transaction of
/// `rate_per_s / 100` events every 10 ms tick, for `min_s` seconds and at least until
/// `backlog_gone`. Returns (events committed, seconds run).
/// After the load phase's backlog drained, the producers' events committed within this
/// window were still queued behind it; the steady-state latency starts after it.
const SETTLE_MS: i64 = 2_000;

async fn produce(
    cfg: Settings,
    route: String,
    payload: Vec<u8>,
    rate_per_s: u64,
    min_s: u64,
    backlog_gone: Arc<AtomicBool>,
) -> Result<Produced, RunError> {
    let mut pg = runtime::pg_connect(&cfg.database_url).await?;
    let tick_ms = 10u64;
    let per_tick = (rate_per_s * tick_ms / 1000).max(1);
    let steady = Duration::from_secs(min_s);
    let t0 = Instant::now();
    let mut gone_at: Option<Instant> = None;
    let mut produced = 0u64;
    let mut commit_us = Vec::new();
    let mut t = 0u64;
    // Until the backlog is gone, then `min_s` seconds more: the steady state under load.
    while gone_at.is_none_or(|g| g.elapsed() < steady) {
        if gone_at.is_none() && backlog_gone.load(Ordering::Relaxed) {
            gone_at = Some(Instant::now());
        }
        tokio::time::sleep_until((t0 + Duration::from_millis(t * tick_ms)).into()).await;
        let keys: Vec<String> = (0..per_tick).map(|k| format!("l-{t}-{k}")).collect();
        let events = crate::demo::order_batch(&keys, &payload);
        let tx = pg.transaction().await.map_err(db)?;
        store::enqueue_many(&tx, &route, &events).await?;
        let committing = Instant::now();
        tx.commit().await.map_err(db)?;
        if gone_at.is_some() {
            commit_us.push(committing.elapsed().as_micros() as i64);
        }
        produced += per_tick;
        t += 1;
    }
    commit_us.sort_unstable();
    Ok(Produced {
        events: produced,
        secs: t0.elapsed().as_secs_f64(),
        commit_us,
    })
}

/// What the producers did in a load phase.
struct Produced {
    events: u64,
    secs: f64,
    /// How long each of their `COMMIT`s took once the backlog was gone (sorted, µs): the
    /// server's WAL flush, which every commit waits for, the acceptance's included.
    commit_us: Vec<i64>,
}

/// Counters shared by the naive relays.
#[derive(Default)]
struct NaiveStats {
    statements: AtomicU64,
    failures: AtomicU64,
}

/// What a drain's start left to compare its end with: the CPU sample and PostgreSQL's
/// checkpoint count.
struct DrainWindow {
    cpu: cpu::Sample,
    checkpoints: Option<i64>,
}

impl DrainWindow {
    async fn open(pg: &tokio_postgres::Client) -> DrainWindow {
        DrainWindow {
            cpu: cpu::sample(),
            checkpoints: checkpoints(pg).await,
        }
    }

    /// CPU per event over `events`, and the checkpoints started, since [`DrainWindow::open`].
    async fn close(self, pg: &tokio_postgres::Client, events: u64) -> (PerEvent, Option<i64>) {
        let cpu = self.cpu.per_event_until(&cpu::sample(), events);
        (cpu, checkpoints_since(pg, self.checkpoints).await)
    }
}

/// Sealpost's message for the bench's event ([`crate::demo::order_created`], what the
/// prefill enqueues) on one NATS topic, as a dispatcher hands it to [`Broker::send_batch`]:
/// what the Sealpost-wire relay and `examples/nats_cost` send. What a dispatcher reads from
/// the sealed envelope rather than computes, and what is the same for every event here (the
/// frozen destination and its digest, the envelope's description and schema digest, the
/// digest of the one payload every event carries), is computed once.
pub struct OrderMessages {
    destination: Destination,
    destination_digest: Digest,
    payload_digest: Digest,
    /// Every field but the aggregate id, which is each event's own.
    envelope: WireEnvelope,
}

impl OrderMessages {
    /// Messages to `topic` on `cluster`, every one carrying `payload`.
    pub fn new(cluster: &str, topic: &str, payload: &[u8]) -> OrderMessages {
        let destination = RoutePolicy {
            generation: 1,
            cluster: cluster.to_string(),
            topic: topic.to_string(),
            partition_algorithm: PartitionAlgorithm::None,
            serializer: "json.v1".into(),
            durability: "file".into(),
            required_ack: "stream".into(),
            ordering: EventOrdering::Unordered,
        }
        .resolve("");
        let ev = crate::demo::order_created("", payload);
        OrderMessages {
            destination_digest: destination.digest(),
            destination,
            payload_digest: Digest::of_bytes(PAYLOAD_DOMAIN, ev.payload),
            envelope: WireEnvelope {
                event_type: ev.event_type.into(),
                aggregate_type: ev.aggregate_type.into(),
                aggregate_id: String::new(),
                aggregate_version: ev.aggregate_version,
                occurred_at_ms: ev.occurred_at_ms,
                tenant: ev.tenant.into(),
                payload_schema_digest: Digest::of_bytes(
                    SCHEMA_DOMAIN,
                    ev.payload_schema.as_bytes(),
                ),
            },
        }
    }

    /// One event's message (member 0, envelope generation 1); `payload` is the payload
    /// given to [`OrderMessages::new`].
    pub fn request(
        &self,
        event_id: EventId,
        attempt_id: u64,
        aggregate_id: String,
        payload: Vec<u8>,
    ) -> SendRequest {
        SendRequest {
            event_id,
            member: 0,
            envelope_generation: 1,
            attempt_id,
            payload_digest: self.payload_digest,
            destination: self.destination.clone(),
            destination_digest: self.destination_digest,
            payload,
            envelope: WireEnvelope {
                aggregate_id,
                ..self.envelope.clone()
            },
            signature: None,
        }
    }
}

/// What a naive relay's messages look like on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RelayWire {
    /// The careful relay's: one subject per stream, `Nats-Msg-Id` only.
    MsgId,
    /// Sealpost's, sent through the same adapter call a dispatcher makes
    /// ([`Broker::send_batch`]): a subject per event published create-if-absent, and the
    /// R30 envelope and Sealpost's digests as headers. Everything else is the careful
    /// relay's (its claim, its transaction held across the send, its marking), so the
    /// difference between the two relays is what Sealpost's message costs.
    Sealpost,
}

/// Consecutive failed batches after which a naive relay gives up.
const NAIVE_FAILED_BATCHES_MAX: u32 = 50;

/// The careful relay users write by hand: a `sent` flag with a partial index on unsent rows
/// serving the claim; `SELECT ... ORDER BY id LIMIT 1000 FOR UPDATE SKIP LOCKED`; every
/// message published with `Nats-Msg-Id` = its event id; all publishes sent, then all
/// acknowledgements awaited together; the rows marked sent (`UPDATE ... WHERE id = ANY`) in
/// the same transaction, held open across the sends. A failed publish or acknowledgement
/// rolls the batch back and it is sent again (the broker's duplicate window absorbs the
/// copies already stored); it is counted, never ignored. Ends when no row is unsent.
async fn naive_relay(
    cfg: Settings,
    nats: Nats,
    table: String,
    topic: String,
    wire: RelayWire,
    payload: Vec<u8>,
    stats: Arc<NaiveStats>,
) -> Result<(), RunError> {
    let subject = format!("sp.{topic}.naive");
    let messages = OrderMessages::new(&nats.cluster, &topic, &payload);
    let mut pg = runtime::pg_connect(&cfg.database_url).await?;
    let count = |n: u64| stats.statements.fetch_add(n, Ordering::Relaxed);
    let claim = pg
        .prepare(&format!(
            "SELECT id, event_id, payload FROM {table} WHERE NOT sent ORDER BY id
             LIMIT 1000 FOR UPDATE SKIP LOCKED"
        ))
        .await
        .map_err(db)?;
    let mark = pg
        .prepare(&format!(
            "UPDATE {table} SET sent = true WHERE id = ANY($1)"
        ))
        .await
        .map_err(db)?;
    let any_left = pg
        .prepare(&format!(
            "SELECT id FROM {table} WHERE NOT sent ORDER BY id LIMIT 1"
        ))
        .await
        .map_err(db)?;
    count(3);
    let mut failed_batches = 0u32;
    loop {
        let tx = pg.transaction().await.map_err(db)?;
        let rows = tx.query(&claim, &[]).await.map_err(db)?;
        count(2);
        if rows.is_empty() {
            tx.commit().await.map_err(db)?;
            let left = pg.query_opt(&any_left, &[]).await.map_err(db)?;
            count(2);
            if left.is_none() {
                return Ok(());
            }
            // Every unsent row is locked by another relay.
            tokio::time::sleep(Duration::from_millis(cfg.idle_poll_ms)).await;
            continue;
        }
        // The transaction stays open across the sends: what hand-written relays do.
        let mut failed = 0u64;
        match wire {
            RelayWire::MsgId => {
                let mut acks = Vec::with_capacity(rows.len());
                for r in &rows {
                    let event_id: uuid::Uuid = r.get(1);
                    let payload: Vec<u8> = r.get(2);
                    let msg = PublishMessage::build()
                        .payload(payload.into())
                        .message_id(event_id.to_string());
                    match nats.js.send_publish(subject.clone(), msg).await {
                        Ok(ack) => acks.push(async move { ack.await }),
                        Err(_) => failed += 1,
                    }
                }
                failed += futures::future::join_all(acks)
                    .await
                    .iter()
                    .filter(|a| a.is_err())
                    .count() as u64;
            }
            RelayWire::Sealpost => {
                let batch: Vec<SendRequest> = rows
                    .iter()
                    .map(|r| {
                        let id: i64 = r.get(0);
                        let event_id: uuid::Uuid = r.get(1);
                        messages.request(
                            EventId(event_id.into_bytes()),
                            1,
                            format!("o-{id}"),
                            r.get(2),
                        )
                    })
                    .collect();
                let deadline = Instant::now() + Duration::from_millis(cfg.lease_ms);
                failed += nats
                    .send_batch(batch, deadline)
                    .await
                    .iter()
                    // A copy a rolled-back batch left behind is stored: that is sent.
                    .filter(|r| !matches!(r, SendResult::Receipt(_) | SendResult::AlreadyStored))
                    .count() as u64;
            }
        }
        if failed > 0 {
            stats.failures.fetch_add(failed, Ordering::Relaxed);
            tx.rollback().await.map_err(db)?;
            count(1);
            failed_batches += 1;
            if failed_batches >= NAIVE_FAILED_BATCHES_MAX {
                return Err(RunError::broker(std::io::Error::other(format!(
                    "naive relay: {failed_batches} batches in a row had failed publishes"
                ))));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        failed_batches = 0;
        let ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
        tx.execute(&mark, &[&ids]).await.map_err(db)?;
        tx.commit().await.map_err(db)?;
        count(2);
    }
}

/// Naive relay results.
struct NaiveRun {
    events_per_s: f64,
    wal_bytes_per_event: f64,
    statements_per_event: f64,
    failures: u64,
    cpu: PerEvent,
    checkpoints: Option<i64>,
}

/// One naive relay's table, stream and wire.
struct Relay {
    table: String,
    topic: String,
    wire: RelayWire,
}

/// Fills the naive relay's table with `events` rows (a fresh UUID each) and drains it with
/// `relays` relays into its own stream.
async fn naive_phase(
    pg: &tokio_postgres::Client,
    cfg: &Settings,
    nats: &Nats,
    relay: &Relay,
    events: u64,
    relays: usize,
    payload: &[u8],
) -> Result<NaiveRun, RunError> {
    let table = relay.table.as_str();
    pg.batch_execute(&format!(
        "CREATE TABLE {table} (id bigserial PRIMARY KEY, event_id uuid NOT NULL,
             payload bytea NOT NULL, sent boolean NOT NULL DEFAULT false);
         CREATE INDEX {table}_unsent ON {table} (id) WHERE NOT sent;"
    ))
    .await
    .map_err(db)?;
    pg.execute(
        &format!(
            "INSERT INTO {table} (event_id, payload)
             SELECT gen_random_uuid(), $1::bytea FROM generate_series(1, $2::int8)"
        ),
        &[&payload, &(events as i64)],
    )
    .await
    .map_err(db)?;
    pg.batch_execute(&format!("ANALYZE {table}"))
        .await
        .map_err(db)?;
    let stats = Arc::new(NaiveStats::default());
    let lsn = wal_lsn(pg).await?;
    let window = DrainWindow::open(pg).await;
    let started = Instant::now();
    let tasks: Vec<_> = (0..relays)
        .map(|_| {
            tokio::spawn(naive_relay(
                cfg.clone(),
                nats.clone(),
                table.to_string(),
                relay.topic.clone(),
                relay.wire,
                payload.to_vec(),
                stats.clone(),
            ))
        })
        .collect();
    for t in tasks {
        t.await.expect("relay panicked")?;
    }
    let secs = started.elapsed().as_secs_f64();
    let (cpu, checkpoints) = window.close(pg, events).await;
    let wal = wal_bytes_since(pg, &lsn).await?;
    Ok(NaiveRun {
        cpu,
        checkpoints,
        events_per_s: events as f64 / secs,
        wal_bytes_per_event: wal / events as f64,
        statements_per_event: stats.statements.load(Ordering::Relaxed) as f64 / events as f64,
        failures: stats.failures.load(Ordering::Relaxed),
    })
}

/// Runs the benchmark, then removes what it created (also when a phase failed).
pub async fn run(mut cfg: Settings, args: BenchArgs, json: bool) -> Result<BenchReport, RunError> {
    cfg.idle_poll_ms = 2;
    let mut pg = runtime::pg_connect(&cfg.database_url).await?;
    store::migrate(&pg).await?;
    let tag = runtime::owner_id() % 1_000_000;
    let names = Names {
        topic: format!("BENCH{tag}"),
        naive: Relay {
            table: format!("sealpost_bench_naive_{tag}"),
            topic: format!("NAIVE{tag}"),
            wire: RelayWire::MsgId,
        },
        wire_relay: Relay {
            table: format!("sealpost_bench_naive_wire_{tag}"),
            topic: format!("NAIVEW{tag}"),
            wire: RelayWire::Sealpost,
        },
        route: format!("bench-{tag}"),
    };
    // A cluster name of its own: the dispatchers claim only this run's rows, and "is the
    // backlog gone" is one probe of the claim index.
    cfg.nats.cluster = format!("bench{tag}");
    store::set_route(&pg, &names.route, &cfg.nats.cluster, &names.topic).await?;
    let nats = Nats::connect_with(
        &cfg.nats.url,
        &cfg.nats.cluster,
        Duration::from_millis(cfg.ack_timeout_ms),
        &cfg.nats.security,
    )
    .await
    .map_err(RunError::broker)?;
    let r = phases(&mut pg, &cfg, &nats, &names, args, json).await;
    // Clean up whatever the phases got to create.
    if !json {
        eprintln!("cleaning up ...");
    }
    for relay in [&names.naive, &names.wire_relay] {
        let _ = pg
            .batch_execute(&format!("DROP TABLE IF EXISTS {}", relay.table))
            .await;
        let _ = nats.js.delete_stream(&relay.topic).await;
    }
    if !json {
        eprintln!("removing the run's events from the outbox ...");
    }
    if let Err(e) = drop_run(&pg, &names.topic, &names.route).await {
        eprintln!(
            "could not remove the bench's events (topic {}, route {}) from the outbox: {e}; \
             they are PUBLISHED rows and the retention cleanup will remove them",
            names.topic, names.route
        );
    }
    let _ = nats.js.delete_stream(&names.topic).await;
    if matches!(log_streamable(&pg).await, Ok(Ok(()))) {
        drop_cdc_slot(&mut pg, &cfg.cdc.names(&cfg.nats.cluster)).await;
    }
    r
}

/// Drops the CDC phase's slot and publication (a slot left behind would hold the server's
/// WAL for good). The publisher's connection may take a moment to leave the slot, so an
/// active slot is tried again for up to 10 s; a failure is printed with what to run.
async fn drop_cdc_slot(pg: &mut tokio_postgres::Client, names: &sealpost::cdc::CdcNames) {
    let mut last = String::new();
    for _ in 0..50 {
        match sealpost::cdc::drop_slot(pg, names).await {
            Ok(()) => return,
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!(
        "could not drop the bench's replication slot {}: {last}; it holds the server's WAL \
         until dropped: SELECT pg_drop_replication_slot('{}'); DROP PUBLICATION {};",
        names.slot, names.slot, names.publication
    );
}

/// The run's names.
struct Names {
    topic: String,
    naive: Relay,
    wire_relay: Relay,
    route: String,
}

async fn phases(
    pg: &mut tokio_postgres::Client,
    cfg: &Settings,
    nats: &Nats,
    names: &Names,
    args: BenchArgs,
    json: bool,
) -> Result<BenchReport, RunError> {
    let topic = names.topic.as_str();
    nats.ensure_stream(topic).await.map_err(RunError::broker)?;
    for relay in [&names.naive, &names.wire_relay] {
        nats.ensure_stream(&relay.topic)
            .await
            .map_err(RunError::broker)?;
    }
    let payload = vec![b'x'; args.payload_bytes];
    let say = |s: String| {
        if !json {
            eprintln!("{s}");
        }
    };

    // A. Sealpost drains a prefilled backlog, beside the retained rows; no producers.
    if args.retained > 0 {
        say(format!(
            "putting {} PUBLISHED rows in the outbox ...",
            args.retained
        ));
        fill_retained(pg, &names.route, args.retained, &payload, &say).await?;
    }
    say(format!("prefilling {} events ...", args.events));
    let a_from_ms = store::db_now_ms(&*pg).await? as i64;
    let fill_lsn = wal_lsn(pg).await?;
    let sizes0 = outbox_sizes(pg).await?;
    prefill(pg, &names.route, "o", args.events, &payload).await?;
    let enqueue_wal = wal_bytes_since(pg, &fill_lsn).await?;
    let sizes1 = outbox_sizes(pg).await?;
    // The relay's table is created fresh for its drain; the outbox tables may carry the dead
    // rows of earlier runs (this machine's PostgreSQL runs with autovacuum off), so they
    // start from the same clean state: vacuumed and analyzed, as autovacuum leaves them.
    pg.batch_execute("VACUUM (ANALYZE) sealpost.work, sealpost.envelope")
        .await
        .map_err(db)?;
    let statements0 = store::statements_issued();
    let lsn = wal_lsn(pg).await?;
    let a_start_ms = store::db_now_ms(&*pg).await? as i64;
    let window = DrainWindow::open(pg).await;
    let fleet = Fleet::start(cfg, nats, args.dispatchers);
    if !wait_drained(pg, &cfg.nats.cluster, i64::MAX, &fleet).await? {
        return Err(fleet_error(fleet).await);
    }
    let (cpu, checkpoints_during_drain) = window.close(pg, args.events).await;
    let wal = wal_bytes_since(pg, &lsn).await?;
    let statements = store::statements_issued() - statements0;
    fleet.stop().await?;
    let a_end_ms = published_until_ms(pg, topic, a_from_ms, a_start_ms)
        .await?
        .unwrap_or(a_start_ms);
    let sealpost_s = (a_end_ms - a_start_ms).max(1) as f64 / 1000.0;
    let sealpost_rate = args.events as f64 / sealpost_s;
    let per_event = |x: f64| x / args.events.max(1) as f64;
    let statements_per_event = if statements == 0 {
        f64::NAN
    } else {
        per_event(statements as f64)
    };
    say(format!(
        "sealpost: {} events in {sealpost_s:.2} s = {sealpost_rate:.0} events/s \
         ({} retained rows); {:.0} WAL bytes/event, {} statements/event",
        args.events,
        args.retained,
        per_event(wal),
        if statements == 0 {
            "? (store does not count yet)".to_string()
        } else {
            format!("{statements_per_event:.2}")
        }
    ));
    say(format!("sealpost: {cpu}"));

    // B. A second backlog drains while producers commit at the offered rate.
    say(format!(
        "load phase: prefilling {} events, then {} events/s offered for {} s ...",
        args.load_backlog, args.rate_per_s, args.latency_s
    ));
    let b_from_ms = store::db_now_ms(&*pg).await? as i64;
    prefill(pg, &names.route, "b", args.load_backlog, &payload).await?;
    // Vacuumed as before the drain: the drain left `--events` dead row versions and as many
    // dead entries at the head of the claim index, which migration 3's per-table autovacuum
    // settings would have removed on a server that runs autovacuum (this machine's does not).
    // Left there, every full scan (`rescan_every_ms`) walks them: about 15 ms each at the
    // defaults, once a second per dispatcher, a tail of its own in the latency below.
    pg.batch_execute("VACUUM (ANALYZE) sealpost.work, sealpost.envelope")
        .await
        .map_err(db)?;
    let b_start_ms = store::db_now_ms(&*pg).await? as i64;
    let checkpoints0 = checkpoints(pg).await;
    // Every producer row is created after `b_start_ms`, every backlog row at or before it.
    tokio::time::sleep(Duration::from_millis(2)).await;
    let fleet = Fleet::start(cfg, nats, args.dispatchers);
    let backlog_gone = Arc::new(AtomicBool::new(false));
    let producers = tokio::spawn(produce(
        cfg.clone(),
        names.route.clone(),
        payload.clone(),
        args.rate_per_s,
        args.latency_s,
        backlog_gone.clone(),
    ));
    if !wait_drained(pg, &cfg.nats.cluster, b_start_ms, &fleet).await? {
        producers.abort();
        return Err(fleet_error(fleet).await);
    }
    backlog_gone.store(true, Ordering::Relaxed);
    say("load phase: backlog gone; producers continue".to_string());
    let Produced {
        events: produced,
        secs: load_s,
        commit_us,
    } = producers.await.expect("producers panicked")?;
    let (commit_ms_p99, commit_ms_max) = (
        quantile(&commit_us, 0.99) / 1000.0,
        commit_us.last().map_or(f64::NAN, |&m| m as f64 / 1000.0),
    );
    let slow_commits = commit_us.iter().filter(|&&us| us > 25_000).count();
    if !wait_drained(pg, &cfg.nats.cluster, i64::MAX, &fleet).await? {
        return Err(fleet_error(fleet).await);
    }
    fleet.stop().await?;
    let checkpoints_during_load = checkpoints_since(pg, checkpoints0).await;
    let drained_at_ms = if args.load_backlog == 0 {
        b_start_ms
    } else {
        published_until_ms(pg, topic, b_from_ms, b_start_ms)
            .await?
            .unwrap_or(b_start_ms)
    };
    let net_drain = if args.load_backlog == 0 {
        f64::NAN
    } else {
        args.load_backlog as f64 / ((drained_at_ms - b_start_ms).max(1) as f64 / 1000.0)
    };
    let lat = latencies(pg, topic, b_start_ms).await?;
    // Latency under load: the producers' events committed once the backlog (and the
    // producers' own events queued behind it) had drained, while producers still commit at
    // the offered rate: the steady state a service sees. The producers' events committed
    // while the backlog drained wait behind it in commit order; they are reported apart.
    let during: Vec<i64> = lat
        .iter()
        .filter(|&&(c, _)| c <= drained_at_ms + SETTLE_MS)
        .map(|&(_, l)| l)
        .collect();
    let after: Vec<i64> = lat
        .iter()
        .filter(|&&(c, _)| c > drained_at_ms + SETTLE_MS)
        .map(|&(_, l)| l)
        .collect();
    let (p50, p99, p99_during) = (
        quantile(&after, 0.50),
        quantile(&after, 0.99),
        quantile(&during, 0.99),
    );
    let produced_rate = produced as f64 / load_s;
    say(format!(
        "load phase: backlog of {} gone in {:.2} s = net drain {net_drain:.0} events/s while \
         producers committed {produced_rate:.0} events/s (offered {}) for {load_s:.1} s",
        args.load_backlog,
        (drained_at_ms - b_start_ms) as f64 / 1000.0,
        args.rate_per_s
    ));
    say(format!(
        "latency at {} events/s offered, producers running: p50 {p50} ms, p99 {p99} ms ({} events); \
         events committed while the backlog drained: p99 {p99_during} ms ({} events); \
         {} PostgreSQL checkpoint(s) started meanwhile; the producers' own commits once the \
         backlog was gone: p99 {commit_ms_p99:.1} ms, slowest {commit_ms_max:.1} ms, {slow_commits} \
         of {} over 25 ms",
        args.rate_per_s,
        after.len(),
        during.len(),
        checkpoints_during_load.map_or("?".to_string(), |n| n.to_string()),
        commit_us.len()
    ));

    // One consumer applies everything the topic holds (phase A, the load phase's backlog and
    // the producers' events) through the batched inbox, effect and all.
    let on_topic = args.events + args.load_backlog + produced;
    say(format!("consumer: applying {on_topic} events ..."));
    let consume_rate = crate::consume_bench::measure(cfg, nats, topic, on_topic).await?;
    say(format!("consumer: {consume_rate:.0} events/s"));

    // The naive relay over a backlog of the same size.
    say(format!("naive relay: {} events ...", args.events));
    let naive = naive_phase(
        pg,
        cfg,
        nats,
        &names.naive,
        args.events,
        args.dispatchers,
        &payload,
    )
    .await?;
    say(format!(
        "naive relay: {:.0} events/s; {:.0} WAL bytes/event, {:.2} statements/event, \
         {} failed publishes",
        naive.events_per_s, naive.wal_bytes_per_event, naive.statements_per_event, naive.failures
    ));
    say(format!("naive relay: {}", naive.cpu));
    say(format!(
        "naive relay with Sealpost's message (a subject per event, create-if-absent, the \
         envelope's headers): {} events ...",
        args.events
    ));
    let wire = naive_phase(
        pg,
        cfg,
        nats,
        &names.wire_relay,
        args.events,
        args.dispatchers,
        &payload,
    )
    .await?;
    say(format!(
        "naive relay with Sealpost's message: {:.0} events/s, {} failed publishes; {}",
        wire.events_per_s, wire.failures, wire.cpu
    ));

    // C. The CDC publisher: the same route and broker, its claims named by the log.
    let cdc = cdc_phase(pg, cfg, nats, names, args, &payload, sealpost_rate, &say).await?;

    Ok(BenchReport {
        nats_server_version: nats.client.server_info().version,
        events: args.events,
        retained: args.retained,
        payload_bytes: args.payload_bytes,
        dispatchers: args.dispatchers,
        sealpost_events_per_s: round(sealpost_rate, 1),
        naive_events_per_s: round(naive.events_per_s, 1),
        ratio: round(sealpost_rate / naive.events_per_s, 3),
        naive_msg_id: true,
        naive_publish_failures: naive.failures,
        wal_bytes_per_event: round(per_event(wal), 1),
        naive_wal_bytes_per_event: round(naive.wal_bytes_per_event, 1),
        enqueue_wal_bytes_per_event: round(per_event(enqueue_wal), 1),
        heap_bytes_per_event: round(per_event((sizes1.0 - sizes0.0) as f64), 1),
        index_bytes_per_event: round(per_event((sizes1.1 - sizes0.1) as f64), 1),
        statements_per_event: round(statements_per_event, 3),
        naive_statements_per_event: round(naive.statements_per_event, 3),
        load_backlog: args.load_backlog,
        rate_per_s: args.rate_per_s,
        produced_events_per_s: round(produced_rate, 1),
        load_s: round(load_s, 2),
        net_drain_events_per_s: round(net_drain, 1),
        latency_events: after.len() as u64,
        latency_ms_p50: p50,
        latency_ms_p99: p99,
        latency_events_during_backlog: during.len() as u64,
        latency_ms_p99_during_backlog: p99_during,
        producer_commits: commit_us.len() as u64,
        producer_commit_ms_p99: round(commit_ms_p99, 2),
        producer_commit_ms_max: round(commit_ms_max, 2),
        producer_commits_over_25_ms: slow_commits as u64,
        checkpoints_during_load,
        consume_events_per_s: round(consume_rate, 1),
        cpu_per_event: cpu,
        naive_cpu_per_event: naive.cpu,
        checkpoints_during_drain,
        naive_checkpoints_during_drain: naive.checkpoints,
        wire_relay_checkpoints_during_drain: wire.checkpoints,
        wire_relay_events_per_s: round(wire.events_per_s, 1),
        wire_relay_ratio_to_naive: round(wire.events_per_s / naive.events_per_s, 3),
        ratio_to_wire_relay: round(sealpost_rate / wire.events_per_s, 3),
        wire_relay_publish_failures: wire.failures,
        wire_relay_cpu_per_event: wire.cpu,
        cdc,
    })
}

/// Whether the database can stream its log (`wal_level = logical`); why not otherwise.
async fn log_streamable(pg: &tokio_postgres::Client) -> Result<Result<(), String>, RunError> {
    let level: String = pg
        .query_one("SHOW wal_level", &[])
        .await
        .map_err(db)?
        .get(0);
    Ok(if level == "logical" {
        Ok(())
    } else {
        Err(format!(
            "the database's wal_level is `{level}`: the CDC line needs `logical` \
             (run the bench on a server started with -c wal_level=logical, as .ci/run does)"
        ))
    })
}

/// WAL the CDC slot `slot` holds the server to, bytes; `None` without the slot or before
/// its first confirmation.
async fn slot_retained(pg: &tokio_postgres::Client, slot: &str) -> Option<f64> {
    pg.query_opt(
        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::float8
           FROM pg_replication_slots WHERE slot_name = $1",
        &[&slot],
    )
    .await
    .ok()
    .flatten()
    .and_then(|r| r.get::<_, Option<f64>>(0))
}

/// C. The CDC publisher (issue 22) on the run's route and broker: its slot is made, a
/// backlog of `events` committed and drained by one publisher and the reconciler; then
/// producers commit at the offered rate for `latency_s` while it follows the log. The slot is
/// dropped by [`run`]'s cleanup, also when this fails.
#[allow(clippy::too_many_arguments)]
async fn cdc_phase(
    pg: &mut tokio_postgres::Client,
    cfg: &Settings,
    nats: &Nats,
    names: &Names,
    args: BenchArgs,
    payload: &[u8],
    polling_rate: f64,
    say: &impl Fn(String),
) -> Result<CdcFigures, RunError> {
    if let Err(why) = log_streamable(pg).await? {
        say(format!("cdc: skipped: {why}"));
        return Ok(CdcFigures::skipped(why));
    }
    let topic = names.topic.as_str();
    let cluster = cfg.nats.cluster.as_str();
    let slot = cfg.cdc.names(cluster);
    sealpost::cdc::setup(pg, &slot, cluster)
        .await
        .map_err(|e| RunError::Config(e.to_string()))?;
    say(format!(
        "cdc: slot {} made; prefilling {} events ...",
        slot.slot, args.events
    ));
    let from_ms = store::db_now_ms(&*pg).await? as i64;
    prefill(pg, &names.route, "c", args.events, payload).await?;
    pg.batch_execute("VACUUM (ANALYZE) sealpost.work, sealpost.envelope")
        .await
        .map_err(db)?;
    let start_ms = store::db_now_ms(&*pg).await? as i64;
    let (fleet, counters) = Fleet::start_cdc(cfg, nats);
    if !wait_drained(pg, cluster, i64::MAX, &fleet).await? {
        return Err(fleet_error(fleet).await);
    }
    let end_ms = published_until_ms(pg, topic, from_ms, start_ms)
        .await?
        .unwrap_or(start_ms);
    let drain_rate = args.events as f64 / ((end_ms - start_ms).max(1) as f64 / 1000.0);
    say(format!(
        "cdc: {} events drained in {:.2} s = {drain_rate:.0} events/s ({:.3} of the polling \
         fleet's drain); producers at {} events/s for {} s ...",
        args.events,
        (end_ms - start_ms) as f64 / 1000.0,
        drain_rate / polling_rate,
        args.rate_per_s,
        args.latency_s
    ));

    // The log still names the drained backlog (published by the catch-up scans): the
    // publisher reads through it and confirms it before the producers start, so the latency
    // sample is the steady state, as the polling sample starts after its backlog.
    let drained_lsn = wal_lsn(pg).await?;
    let caught_up = Instant::now();
    loop {
        let confirmed: bool = pg
            .query_one(
                "SELECT coalesce((SELECT confirmed_flush_lsn >= $1::text::pg_lsn
                   FROM pg_replication_slots WHERE slot_name = $2), false)",
                &[&drained_lsn, &slot.slot],
            )
            .await
            .map_err(db)?
            .get(0);
        if confirmed || caught_up.elapsed() > Duration::from_secs(60) {
            break;
        }
        if fleet.broken() {
            return Err(fleet_error(fleet).await);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let caught_up_s = caught_up.elapsed().as_secs_f64();
    say(format!(
        "cdc: the slot confirmed the backlog's log {caught_up_s:.2} s after the drain"
    ));
    let load_from_ms = store::db_now_ms(&*pg).await? as i64;
    let from_log0 = counters.from_log.load(Ordering::Relaxed);
    let producers = tokio::spawn(produce(
        cfg.clone(),
        names.route.clone(),
        payload.to_vec(),
        args.rate_per_s,
        args.latency_s,
        Arc::new(AtomicBool::new(true)),
    ));
    let mut retained: Vec<f64> = Vec::new();
    while !producers.is_finished() {
        if fleet.broken() {
            producers.abort();
            return Err(fleet_error(fleet).await);
        }
        if let Some(b) = slot_retained(pg, &slot.slot).await {
            retained.push(b);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let Produced {
        events: produced,
        secs: load_s,
        ..
    } = producers.await.expect("producers panicked")?;
    if !wait_drained(pg, cluster, i64::MAX, &fleet).await? {
        return Err(fleet_error(fleet).await);
    }
    let from_log = counters.from_log.load(Ordering::Relaxed) - from_log0;
    fleet.stop().await?;
    let lat: Vec<i64> = latencies(pg, topic, load_from_ms)
        .await?
        .into_iter()
        .map(|(_, l)| l)
        .collect();
    retained.sort_by(f64::total_cmp);
    let (p50, p99) = (quantile(&lat, 0.50), quantile(&lat, 0.99));
    let figures = CdcFigures {
        skipped: None,
        drain_events_per_s: round(drain_rate, 1),
        drain_ratio_to_polling: round(drain_rate / polling_rate, 3),
        log_caught_up_s: round(caught_up_s, 2),
        load_s: round(load_s, 2),
        produced_events_per_s: round(produced as f64 / load_s, 1),
        latency_ms_p50: p50,
        latency_ms_p99: p99,
        latency_events: lat.len() as u64,
        claimed_from_log: from_log,
        wal_retained_bytes_max: retained.last().copied().unwrap_or(f64::NAN),
        wal_retained_bytes_p50: retained
            .get(retained.len() / 2)
            .copied()
            .unwrap_or(f64::NAN),
    };
    say(format!(
        "cdc: latency at {} events/s offered: p50 {p50} ms, p99 {p99} ms ({} events, {from_log} \
         claimed from the log); WAL the slot held: p50 {:.0} bytes, most {:.0}",
        args.rate_per_s,
        lat.len(),
        figures.wal_retained_bytes_p50,
        figures.wal_retained_bytes_max
    ));
    Ok(figures)
}

/// One broker's line of `sealpost bench --per-broker`.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BrokerDrain {
    /// `nats`, `rabbitmq` or `kafka`.
    pub broker: String,
    /// Events drained.
    pub events: u64,
    /// Drain rate of a prefilled backlog (fleet start to the last `PUBLISHED`, database
    /// clock), no producers running; `null` when the broker was not reachable.
    pub events_per_s: f64,
    /// This broker's rate / NATS's rate in the same run.
    pub ratio_to_nats: f64,
    /// Why there is no figure, if there is none.
    pub skipped: Option<String>,
}

/// Drains a prefilled backlog of `events` on `broker` (a route of its own on a cluster name of
/// its own, so the fleet claims only these rows); events/s.
#[allow(clippy::too_many_arguments)]
async fn drain_on<B: Broker>(
    pg: &mut tokio_postgres::Client,
    cfg: &Settings,
    broker: &Arc<B>,
    route: &str,
    topic: &str,
    events: u64,
    payload: &[u8],
    dispatchers: usize,
) -> Result<f64, RunError> {
    let from_ms = store::db_now_ms(&*pg).await? as i64;
    prefill(pg, route, "pb", events, payload).await?;
    pg.batch_execute("VACUUM (ANALYZE) sealpost.work, sealpost.envelope")
        .await
        .map_err(db)?;
    let start_ms = store::db_now_ms(&*pg).await? as i64;
    let fleet = Fleet::start_on(cfg, broker, dispatchers);
    if !wait_drained(pg, broker.cluster(), i64::MAX, &fleet).await? {
        return Err(fleet_error(fleet).await);
    }
    fleet.stop().await?;
    let end_ms = published_until_ms(pg, topic, from_ms, start_ms)
        .await?
        .unwrap_or(start_ms);
    Ok(events as f64 / ((end_ms - start_ms).max(1) as f64 / 1000.0))
}

/// `sealpost bench --per-broker`: the same backlog drained through NATS, RabbitMQ and Kafka in
/// turn, one line per broker with its ratio to NATS in the same run. Measures Sealpost's drain
/// per broker only (the careful relay of the main bench is NATS-only). A broker that cannot be
/// reached is reported as skipped, with the reason.
pub async fn per_broker(
    mut cfg: Settings,
    events: u64,
    payload_bytes: usize,
    dispatchers: usize,
    json: bool,
) -> Result<Vec<BrokerDrain>, RunError> {
    cfg.idle_poll_ms = 2;
    let mut pg = runtime::pg_connect(&cfg.database_url).await?;
    store::migrate(&pg).await?;
    let tag = runtime::owner_id() % 1_000_000;
    let payload = vec![b'x'; payload_bytes];
    let say = |s: String| {
        if !json {
            eprintln!("{s}");
        }
    };
    let mut out: Vec<BrokerDrain> = Vec::new();
    for name in ["nats", "rabbitmq", "kafka"] {
        let topic = format!("PB{tag}{}", name.to_uppercase());
        let route = format!("bench-{name}-{tag}");
        let cluster = format!("bench{tag}{name}");
        say(format!(
            "{name}: prefilling {events} events and draining them ..."
        ));
        let r: Result<f64, RunError> = match name {
            "nats" => {
                cfg.nats.cluster = cluster.clone();
                match crate::brokers::connect_nats(&cfg).await {
                    Err(e) => Err(e),
                    Ok(nats) => {
                        store::set_route(&pg, &route, &cluster, &topic).await?;
                        nats.ensure_stream(&topic).await.map_err(RunError::broker)?;
                        let r = drain_on(
                            &mut pg,
                            &cfg,
                            &Arc::new(nats.clone()),
                            &route,
                            &topic,
                            events,
                            &payload,
                            dispatchers,
                        )
                        .await;
                        let _ = nats.js.delete_stream(&topic).await;
                        r
                    }
                }
            }
            "rabbitmq" => {
                cfg.rabbitmq.cluster = cluster.clone();
                match crate::brokers::connect_rabbitmq(&cfg, "bench").await {
                    Err(e) => Err(e),
                    Ok(rabbit) => {
                        store::set_route(&pg, &route, &cluster, &topic).await?;
                        let q = vec!["bench".to_string()];
                        rabbit
                            .ensure_destination(&topic, &q)
                            .await
                            .map_err(RunError::broker)?;
                        let r = drain_on(
                            &mut pg,
                            &cfg,
                            &Arc::new(rabbit.clone()),
                            &route,
                            &topic,
                            events,
                            &payload,
                            dispatchers,
                        )
                        .await;
                        let _ = rabbit.delete_destination(&topic, &q).await;
                        r
                    }
                }
            }
            _ => {
                cfg.kafka.cluster = cluster.clone();
                match crate::brokers::connect_kafka(&cfg, "bench").await {
                    Err(e) => Err(e),
                    Ok(kafka) => {
                        store::set_route(&pg, &route, &cluster, &topic).await?;
                        let n = kafka
                            .ensure_topic(&topic, cfg.kafka.partitions)
                            .await
                            .map_err(RunError::broker)?;
                        store::set_route_partitions(
                            &pg,
                            &route,
                            sealpost_core::envelope::PartitionAlgorithm::KafkaMurmur2 {
                                partitions: n,
                            },
                        )
                        .await?;
                        let r = drain_on(
                            &mut pg,
                            &cfg,
                            &Arc::new(kafka.clone()),
                            &route,
                            &topic,
                            events,
                            &payload,
                            dispatchers,
                        )
                        .await;
                        let _ = kafka.delete_topic(&topic).await;
                        r
                    }
                }
            }
        };
        let (rate, skipped) = match r {
            Ok(x) => (x, None),
            Err(e) => (f64::NAN, Some(e.to_string())),
        };
        let nats_rate = out.first().map_or(rate, |n| n.events_per_s);
        say(match &skipped {
            None => format!("{name}: {rate:.0} events/s ({:.2}x NATS)", rate / nats_rate),
            Some(why) => format!("{name}: skipped: {why}"),
        });
        out.push(BrokerDrain {
            broker: name.to_string(),
            events,
            events_per_s: round(rate, 0),
            ratio_to_nats: round(rate / nats_rate, 3),
            skipped,
        });
    }
    Ok(out)
}
