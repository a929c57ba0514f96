//! What a one-write layout would save, measured before it is built (issue 21, item 3): the
//! dispatcher's database work per event of today's layout against two candidate layouts, on
//! the same schema, the same rows and the same server, without a broker.
//!
//! * `v2` — today's store, run through its own code: `store::claim` with a `Held` of 1,000
//!   (pick, lock, join the sealed envelope, register the attempt: a HOT update of each work
//!   row) and `store::submit_held` (the guarded acceptance: a second update of each row).
//! * `lease+update` — the claim writes one **lease row per batch** instead of one update per
//!   row: it locks its cluster's cursor, reads the next rows in commit order up to the
//!   `pg_snapshot_xmin` horizon (a transaction still open cannot commit a row into a range
//!   already leased), and records the range, owner, claim generation, lease end and first
//!   attempt id in the lease row. The acceptance updates each work row once (state, the
//!   attempt, the primary receipt) in a statement that deletes the lease row and lands only
//!   if that row is still the claim's version (its `xmin`): the fence the `v2` guarded path
//!   takes from each work row's `xmin`.
//! * `lease+receipt` — the same claim; the acceptance **inserts** one receipt row per event
//!   under the publish slot `(event, member, envelope generation)` as its primary key and
//!   leaves the work row alone (in that layout the state is derived from the envelope, the
//!   lease and the receipt, and the work row would not exist on the happy path).
//!
//! The candidates are probes, not a store: they measure the statements a layout would run on
//! the happy path. Per variant: wall time of claim and acceptance, CPU of the PostgreSQL
//! backend (`/proc`), WAL bytes (`pg_current_wal_lsn()` around the drain, so run it on a
//! server nothing else writes to), and the rows inserted, updated (HOT or not) and deleted
//! (`pg_stat_user_tables`). Rounds alternate the variants; each gets a fresh database.
//!
//! ```text
//! cargo run --release -p sealpost-cli --example layout_probe -- 50000 3
//! ```
//!
//! `DATABASE_ADMIN_URL` (default `host=127.0.0.1 user=postgres dbname=test`) names a
//! database to create `sealpost_layout` from.

use std::time::Instant;

use sealpost::runtime;
use sealpost::store;
use sealpost_cli::cpu::process_cpu_s;
use sealpost_core::dispatcher::Submission;
use tokio_postgres::Client;
use uuid::Uuid;

#[path = "support/cycle.rs"]
mod cycle;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const DB: &str = "sealpost_layout";
const BATCH: i64 = 1_000;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Variant {
    V2,
    LeaseUpdate,
    LeaseReceipt,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::V2 => "v2",
            Variant::LeaseUpdate => "lease+update",
            Variant::LeaseReceipt => "lease+receipt",
        }
    }
}

#[derive(Debug, Default)]
struct Figures {
    events: usize,
    claim_s: f64,
    accept_s: f64,
    backend_cpu_s: f64,
    wal_bytes: f64,
    statements: usize,
    inserted: i64,
    updated: i64,
    hot: i64,
    deleted: i64,
}

/// The candidates' tables: a commit transaction id on each work row (the horizon's key),
/// the claim index in `(transaction, position)` order in place of `work_claimable`, the
/// cursor per cluster, the lease rows and the receipt rows.
const CANDIDATE_DDL: &str = "
ALTER TABLE sealpost.work ADD COLUMN commit_xid xid8 NOT NULL DEFAULT pg_current_xact_id();
DROP INDEX sealpost.work_claimable;
CREATE INDEX work_claim_order ON sealpost.work (dest_cluster, commit_xid, committed_seq)
  WHERE phase = 0;
CREATE TABLE sealpost.claim_cursor (dest_cluster text PRIMARY KEY, xid xid8 NOT NULL,
  seq bigint NOT NULL);
CREATE TABLE sealpost.claim_lease (id bigserial PRIMARY KEY, dest_cluster text NOT NULL,
  owner bigint NOT NULL, claim_generation bigint NOT NULL, lo_xid xid8 NOT NULL,
  lo_seq bigint NOT NULL, hi_xid xid8 NOT NULL, hi_seq bigint NOT NULL,
  lease_until_ms bigint NOT NULL, first_attempt_id bigint NOT NULL, sends int NOT NULL);
CREATE TABLE sealpost.receipt_slot (event_id uuid NOT NULL, member smallint NOT NULL,
  envelope_generation int NOT NULL, attempt_id bigint NOT NULL, cluster text NOT NULL,
  stream text NOT NULL, partition int, sequence bigint NOT NULL, accepted_at_ms bigint NOT NULL,
  PRIMARY KEY (event_id, member, envelope_generation));
INSERT INTO sealpost.claim_cursor VALUES ('layout', '0', 0);
";

const NOW_MS: &str = "(extract(epoch FROM clock_timestamp()) * 1000)::bigint";

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let n: usize = match args.next() {
        Some(s) => s
            .parse()
            .map_err(|e| format!("events must be a number ({s:?}: {e})"))?,
        None => 50_000,
    };
    let rounds: usize = match args.next() {
        Some(s) => s
            .parse()
            .map_err(|e| format!("rounds must be a number ({s:?}: {e})"))?,
        None => 3,
    };
    if n == 0 || rounds == 0 {
        return Err("events and rounds must each be at least 1".into());
    }
    let admin_url = std::env::var("DATABASE_ADMIN_URL")
        .unwrap_or_else(|_| "host=127.0.0.1 user=postgres dbname=test".to_string());
    let admin = runtime::pg_connect(&admin_url).await?;
    let url = format!("{admin_url} dbname={DB}");
    println!("{n} events per variant, batches of {BATCH}, {rounds} rounds");
    println!(
        "{:<14} {:>6} {:>9} {:>9} {:>9} {:>8} {:>7} {:>7} {:>7} {:>7} {:>7}",
        "variant",
        "round",
        "claim",
        "accept",
        "backend",
        "WAL",
        "stmts",
        "ins",
        "upd",
        "hot",
        "del"
    );
    println!(
        "{:<14} {:>6} {:>9} {:>9} {:>9} {:>8} {:>7} {:>7} {:>7} {:>7} {:>7}",
        "",
        "",
        "us/event",
        "us/event",
        "us/event",
        "B/event",
        "/event",
        "/event",
        "/event",
        "/event",
        "/event"
    );
    let mut totals: Vec<(Variant, Figures)> = Vec::new();
    for round in 1..=rounds {
        for variant in [Variant::V2, Variant::LeaseUpdate, Variant::LeaseReceipt] {
            cycle::fresh_database(&admin, DB).await?;
            let mut pg = runtime::pg_connect(&url).await?;
            store::migrate(&pg).await?;
            store::set_route(&pg, "orders", "layout", "LAYOUT").await?;
            if variant != Variant::V2 {
                pg.batch_execute(CANDIDATE_DDL).await?;
            }
            cycle::fill(&mut pg, n).await?;
            pg.batch_execute("VACUUM (ANALYZE) sealpost.work, sealpost.envelope")
                .await?;
            pg.batch_execute("CHECKPOINT").await?;
            let f = match variant {
                Variant::V2 => drain_v2(&mut pg).await?,
                v => drain_lease(&mut pg, v).await?,
            };
            if f.events != n {
                return Err(
                    format!("{}: drained {} of {n} events", variant.name(), f.events).into(),
                );
            }
            print_row(variant.name(), &round.to_string(), &f);
            match totals.iter_mut().find(|(v, _)| *v == variant) {
                Some((_, t)) => add(t, &f),
                None => totals.push((variant, f)),
            }
            drop(pg);
        }
    }
    println!("sums over all rounds, per event:");
    let base = totals[0].1.backend_cpu_s / totals[0].1.events as f64;
    for (v, t) in &totals {
        print_row(v.name(), "all", t);
        println!(
            "{:<14} backend CPU {:.2}x of v2",
            "",
            t.backend_cpu_s / t.events as f64 / base
        );
    }
    cycle::drop_database(&admin, DB).await?;
    Ok(())
}

fn add(t: &mut Figures, f: &Figures) {
    t.events += f.events;
    t.claim_s += f.claim_s;
    t.accept_s += f.accept_s;
    t.backend_cpu_s += f.backend_cpu_s;
    t.wal_bytes += f.wal_bytes;
    t.statements += f.statements;
    t.inserted += f.inserted;
    t.updated += f.updated;
    t.hot += f.hot;
    t.deleted += f.deleted;
}

fn print_row(name: &str, round: &str, f: &Figures) {
    let e = f.events.max(1) as f64;
    println!(
        "{:<14} {:>6} {:>9.1} {:>9.1} {:>9.1} {:>8.0} {:>7.3} {:>7.3} {:>7.3} {:>7.3} {:>7.3}",
        name,
        round,
        f.claim_s * 1e6 / e,
        f.accept_s * 1e6 / e,
        f.backend_cpu_s * 1e6 / e,
        f.wal_bytes / e,
        f.statements as f64 / e,
        f.inserted as f64 / e,
        f.updated as f64 / e,
        f.hot as f64 / e,
        f.deleted as f64 / e,
    );
}

/// The table counters of the `sealpost` schema: inserted, updated, HOT-updated, deleted.
async fn counters(pg: &Client) -> Result<[i64; 4], tokio_postgres::Error> {
    // This backend's counters reach the shared statistics at its next flush; force it.
    pg.batch_execute("SELECT pg_stat_force_next_flush()")
        .await?;
    pg.batch_execute("SELECT 1").await?;
    pg.batch_execute("SELECT pg_stat_clear_snapshot()").await?;
    let r = pg
        .query_one(
            "SELECT coalesce(sum(n_tup_ins), 0)::bigint, coalesce(sum(n_tup_upd), 0)::bigint,
                    coalesce(sum(n_tup_hot_upd), 0)::bigint, coalesce(sum(n_tup_del), 0)::bigint
             FROM pg_stat_user_tables WHERE schemaname = 'sealpost'",
            &[],
        )
        .await?;
    Ok([r.get(0), r.get(1), r.get(2), r.get(3)])
}

struct Window {
    backend: String,
    cpu: f64,
    lsn: String,
    counters: [i64; 4],
}

async fn open_window(pg: &Client) -> Result<Window, Box<dyn std::error::Error>> {
    let backend: i32 = pg.query_one("SELECT pg_backend_pid()", &[]).await?.get(0);
    let backend = backend.to_string();
    let counters = counters(pg).await?;
    let lsn: String = pg
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await?
        .get(0);
    let cpu = process_cpu_s(&backend).ok_or("no /proc: run on the server's machine (Linux)")?;
    Ok(Window {
        backend,
        cpu,
        lsn,
        counters,
    })
}

async fn close_window(
    pg: &Client,
    w: Window,
    f: &mut Figures,
) -> Result<(), Box<dyn std::error::Error>> {
    f.backend_cpu_s = process_cpu_s(&w.backend).ok_or("backend gone")? - w.cpu;
    f.wal_bytes = pg
        .query_one(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::text::pg_lsn)::float8",
            &[&w.lsn],
        )
        .await?
        .get(0);
    let c = counters(pg).await?;
    f.inserted = c[0] - w.counters[0];
    f.updated = c[1] - w.counters[1];
    f.hot = c[2] - w.counters[2];
    f.deleted = c[3] - w.counters[3];
    Ok(())
}

/// Today's store, through its own claim and guarded acceptance.
async fn drain_v2(pg: &mut Client) -> Result<Figures, Box<dyn std::error::Error>> {
    let mut f = Figures::default();
    let w = open_window(pg).await?;
    let mut held = store::Held::default();
    let mut sequence = 0u64;
    let statements0 = store::statements_issued() as usize;
    loop {
        let t = Instant::now();
        let batch = store::claim(
            pg,
            &store::ClaimRequest::new(1, BATCH as usize, 60_000).cluster(Some("layout")),
            Some(&mut held),
        )
        .await?;
        f.claim_s += t.elapsed().as_secs_f64();
        if batch.outgoing.is_empty() {
            break;
        }
        let receipts = cycle::ack_receipts(&batch.outgoing, &mut sequence);
        f.events += receipts.len();
        let submission = Submission {
            receipts,
            reports: vec![],
        };
        let t = Instant::now();
        let done = store::submit_held(pg, &submission, 5, &mut held).await?;
        f.accept_s += t.elapsed().as_secs_f64();
        if done.guarded != submission.receipts.len() {
            return Err("a receipt took the locked path: is another dispatcher draining?".into());
        }
    }
    f.statements = store::statements_issued() as usize - statements0;
    close_window(pg, w, &mut f).await?;
    Ok(f)
}

/// The candidates' claim: the cursor's lock, the next rows up to the horizon with the same
/// envelope columns and ordering probe as `v2`'s claim, one lease row, the cursor moved.
const LEASE_CLAIM_SQL: &str = "
WITH w AS (
  SELECT w.* FROM sealpost.work w
  WHERE w.phase = 0 AND w.dest_cluster = $1 AND w.state = 'PENDING'
    AND (w.commit_xid, w.committed_seq) > ($2::text::xid8, $3::int8)
    AND w.commit_xid < (SELECT pg_snapshot_xmin(pg_current_snapshot()))
  ORDER BY w.dest_cluster, w.commit_xid, w.committed_seq LIMIT $4)
SELECT w.event_id, w.member, w.envelope_generation, w.commit_xid::text, w.committed_seq,
       e.payload,
       (w.ordering_key IS NOT NULL AND EXISTS (
         SELECT 1 FROM sealpost.work p
         WHERE p.ordering_key = w.ordering_key AND p.aggregate_version < w.aggregate_version
           AND p.ordering_key IS NOT NULL AND p.phase <> 2)),
       w.*, e.aggregate_type, e.aggregate_id, e.aggregate_version, e.event_type,
       e.payload_schema_digest, e.payload_digest, e.tenant, e.occurred_at_ms, e.creating_txid,
       e.dest_cluster, e.dest_topic, e.dest_routing_key, e.dest_partition_alg,
       e.dest_policy_generation, e.dest_serializer, e.dest_durability, e.dest_required_ack,
       e.dest_ordering, e.destination_digest, e.envelope_digest
FROM w JOIN sealpost.envelope e
  ON e.event_id = w.event_id AND e.member = w.member
 AND e.envelope_generation = w.envelope_generation
ORDER BY w.commit_xid, w.committed_seq";

const LEASE_RECORD_SQL: &str = "
WITH c AS (UPDATE sealpost.claim_cursor SET xid = $5::text::xid8, seq = $6
           WHERE dest_cluster = $1)
INSERT INTO sealpost.claim_lease (dest_cluster, owner, claim_generation, lo_xid, lo_seq,
  hi_xid, hi_seq, lease_until_ms, first_attempt_id, sends)
VALUES ($1, $2, 1, $3::text::xid8, $4, $5::text::xid8, $6, $7::int8 + 60000,
        nextval('sealpost.attempt_id_seq'), $8)
RETURNING id, xmin::text::bigint, first_attempt_id";

const ACCEPT_UPDATE_SQL: &str = "
WITH l AS (DELETE FROM sealpost.claim_lease WHERE id = $1 AND xmin = $2::int8::text::xid
           RETURNING owner, claim_generation)
UPDATE sealpost.work w SET phase = 2, state = 'PUBLISHED', claim_owner = NULL,
  lease_until_ms = NULL, attempt_generation = w.attempt_generation + 1, attempt_id = u.a,
  attempt_agen = w.attempt_generation + 1, attempt_claim_generation = l.claim_generation,
  attempt_owner = l.owner, attempt_envelope_generation = w.envelope_generation,
  attempt_status = 'ACKED', attempt_started_ms = $3, published_at_ms = $3,
  primary_attempt_id = u.a, primary_cluster = $4, primary_stream = $5,
  primary_partition = NULL, primary_sequence = u.s
FROM unnest($6::uuid[], $7::int2[], $8::int8[], $9::int8[]) AS u(id, m, a, s), l
WHERE w.event_id = u.id AND w.member = u.m AND w.phase = 0
RETURNING w.event_id";

const ACCEPT_RECEIPT_SQL: &str = "
WITH l AS (DELETE FROM sealpost.claim_lease WHERE id = $1 AND xmin = $2::int8::text::xid
           RETURNING id)
INSERT INTO sealpost.receipt_slot (event_id, member, envelope_generation, attempt_id, cluster,
  stream, partition, sequence, accepted_at_ms)
SELECT u.id, u.m, 1, u.a, $4, $5, NULL, u.s, $3
FROM unnest($6::uuid[], $7::int2[], $8::int8[], $9::int8[]) AS u(id, m, a, s), l
ON CONFLICT DO NOTHING
RETURNING event_id";

async fn drain_lease(
    pg: &mut Client,
    variant: Variant,
) -> Result<Figures, Box<dyn std::error::Error>> {
    let mut f = Figures::default();
    let w = open_window(pg).await?;
    let claim = pg.prepare(LEASE_CLAIM_SQL).await?;
    let record = pg.prepare(LEASE_RECORD_SQL).await?;
    let accept = pg
        .prepare(match variant {
            Variant::LeaseUpdate => ACCEPT_UPDATE_SQL,
            _ => ACCEPT_RECEIPT_SQL,
        })
        .await?;
    let cursor = pg
        .prepare(
            "SELECT xid::text, seq FROM sealpost.claim_cursor WHERE dest_cluster = $1 FOR UPDATE",
        )
        .await?;
    let mut sequence = 0i64;
    loop {
        let t = Instant::now();
        let tx = pg.transaction().await?;
        // The settings v2's claim pins its ordered index scan with (`store::claim`).
        tx.batch_execute(
            "SET LOCAL enable_bitmapscan = off; SET LOCAL enable_seqscan = off;
             SET LOCAL plan_cache_mode = force_custom_plan",
        )
        .await?;
        let c = tx.query_one(&cursor, &[&"layout"]).await?;
        let (from_xid, from_seq): (String, i64) = (c.get(0), c.get(1));
        let rows = tx
            .query(&claim, &[&"layout", &from_xid, &from_seq, &BATCH])
            .await?;
        f.statements += 5;
        let Some(last) = rows.last() else {
            tx.commit().await?;
            f.claim_s += t.elapsed().as_secs_f64();
            break;
        };
        let first = &rows[0];
        let now_ms: i64 = tx.query_one(&format!("SELECT {NOW_MS}"), &[]).await?.get(0);
        let lease = tx
            .query_one(
                &record,
                &[
                    &"layout",
                    &1i64,
                    &first.get::<_, String>(3),
                    &first.get::<_, i64>(4),
                    &last.get::<_, String>(3),
                    &last.get::<_, i64>(4),
                    &now_ms,
                    &(rows.len() as i32),
                ],
            )
            .await?;
        tx.commit().await?;
        f.statements += 2;
        f.claim_s += t.elapsed().as_secs_f64();
        let (lease_id, lease_xmin, first_attempt): (i64, i64, i64) =
            (lease.get(0), lease.get(1), lease.get(2));
        // What the dispatcher hands the broker, read as the v2 claim reads it.
        let mut ids = Vec::with_capacity(rows.len());
        let mut members = Vec::with_capacity(rows.len());
        let mut attempts = Vec::with_capacity(rows.len());
        let mut sequences = Vec::with_capacity(rows.len());
        for (k, r) in rows.iter().enumerate() {
            let _payload: &[u8] = r.get(5);
            ids.push(r.get::<_, Uuid>(0));
            members.push(r.get::<_, i16>(1));
            attempts.push(first_attempt * 1_000_000 + k as i64);
            sequence += 1;
            sequences.push(sequence);
        }
        let t = Instant::now();
        let accepted = pg
            .query(
                &accept,
                &[
                    &lease_id,
                    &lease_xmin,
                    &now_ms,
                    &"layout",
                    &"LAYOUT",
                    &ids,
                    &members,
                    &attempts,
                    &sequences,
                ],
            )
            .await?;
        f.statements += 1;
        f.accept_s += t.elapsed().as_secs_f64();
        if accepted.len() != rows.len() {
            return Err(format!(
                "{}: {} of {} receipts accepted: the lease fence refused a batch",
                variant.name(),
                accepted.len(),
                rows.len()
            )
            .into());
        }
        f.events += rows.len();
    }
    close_window(pg, w, &mut f).await?;
    Ok(f)
}
