//! What the one-write layout saves (issue 21, item 3), measured: the dispatcher's database
//! work per event of the two claim layouts this build runs, on the same schema, the same
//! rows and the same server, without a broker, through the store's own code (`store::claim`
//! with a `Held` of 1,000 rows, then `store::submit_held`, the guarded acceptance).
//!
//! * `v2` — rows written under protocol 1 (before migration 12): the claim registers each
//!   attempt in its row (a row lock and a HOT update of each work row) and the acceptance
//!   updates each row a second time.
//! * `v3` — rows written under protocol 2: the claim records the batch's first sends in one
//!   `sealpost.lease` row and leaves the work rows alone; the acceptance writes each row
//!   once (all of it) and drops the lease.
//!
//! Both run this build's claim (its lock and its read of the leases included). Per variant:
//! wall time of claim and acceptance, CPU of the PostgreSQL backend (`/proc`), WAL bytes
//! (`pg_current_wal_lsn()` around the drain, so run it on a server nothing else writes to),
//! the statements sent, and the rows inserted, updated (HOT or not) and deleted
//! (`pg_stat_user_tables`). Rounds alternate the variants; each gets a fresh database.
//!
//! ```text
//! cargo run --release -p sealpost-cli --example layout_probe -- 100000 3
//! ```
//!
//! A third argument puts that many `PUBLISHED` rows in each database first
//! (`sealpost bench --retained`'s fill).
//!
//! `DATABASE_ADMIN_URL` (default `host=127.0.0.1 user=postgres dbname=test`) names a
//! database to create `sealpost_layout` from.

use std::time::Instant;

use sealpost::runtime;
use sealpost::store;
use sealpost_cli::cpu::process_cpu_s;
use sealpost_core::dispatcher::Submission;
use tokio_postgres::Client;

#[path = "support/cycle.rs"]
mod cycle;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const DB: &str = "sealpost_layout";
const BATCH: i64 = 1_000;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Variant {
    V2,
    V3,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::V2 => "v2",
            Variant::V3 => "v3",
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
    let retained: u64 = match args.next() {
        Some(s) => s
            .parse()
            .map_err(|e| format!("retained rows must be a number ({s:?}: {e})"))?,
        None => 0,
    };
    if n == 0 || rounds == 0 {
        return Err("events and rounds must each be at least 1".into());
    }
    let admin_url = std::env::var("DATABASE_ADMIN_URL")
        .unwrap_or_else(|_| "host=127.0.0.1 user=postgres dbname=test".to_string());
    let admin = runtime::pg_connect(&admin_url).await?;
    let url = format!("{admin_url} dbname={DB}");
    println!(
        "{n} events per variant, batches of {BATCH}, {rounds} rounds, {retained} retained rows"
    );
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
        for variant in [Variant::V2, Variant::V3] {
            cycle::fresh_database(&admin, DB).await?;
            let mut pg = runtime::pg_connect(&url).await?;
            store::migrate(&pg).await?;
            store::set_route(&pg, "orders", "layout", "LAYOUT").await?;
            // Published rows already in the outbox, as a system that ran for a while has
            // them (`sealpost bench --retained`'s fill).
            sealpost_cli::bench::fill_retained(&mut pg, "orders", retained, b"{}", &|_| {}).await?;
            cycle::fill(&mut pg, n).await?;
            if variant == Variant::V2 {
                // Rows as a database upgraded from migration 11 holds them.
                pg.batch_execute("UPDATE sealpost.work SET protocol = 1")
                    .await?;
            }
            pg.batch_execute("VACUUM (ANALYZE) sealpost.work, sealpost.envelope")
                .await?;
            pg.batch_execute("CHECKPOINT").await?;
            let f = drain(&mut pg).await?;
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
            "{:<14} backend CPU {:.2}x of v2's",
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

/// The store's own claim and guarded acceptance, until nothing is left to claim.
async fn drain(pg: &mut Client) -> Result<Figures, Box<dyn std::error::Error>> {
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
