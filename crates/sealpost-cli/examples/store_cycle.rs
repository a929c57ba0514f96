//! Where the dispatcher's database time goes, without a broker: fills a fresh database
//! (`sealpost_cycle`, dropped and recreated) with N pending events, then drains it on one
//! connection as a dispatcher does (`claim` with a `Held` of 1,000, then `submit_held` of one
//! ACK receipt per row, made as the broker would make it) and prints wall time per event of
//! the claim and the acceptance, and the CPU time per event of the PostgreSQL backend and of
//! this process (read from `/proc`, so on Linux with the server on this machine).
//!
//! ```text
//! cargo run --release -p sealpost-cli --example store_cycle -- 50000
//! ```
//!
//! `DATABASE_ADMIN_URL` (default `host=127.0.0.1 user=postgres dbname=test`) names a
//! database to create `sealpost_cycle` from.

use std::time::Instant;

use sealpost::runtime;
use sealpost::store;
use sealpost_cli::cpu::process_cpu_s;
use sealpost_core::dispatcher::Submission;

#[path = "support/cycle.rs"]
mod cycle;

/// The `sealpost` binary's allocator, so that the process CPU is what a dispatcher spends.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const DB: &str = "sealpost_cycle";

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: usize = match std::env::args().nth(1) {
        Some(s) => s
            .parse()
            .map_err(|e| format!("events must be a number ({s:?}: {e})"))?,
        None => 50_000,
    };
    let admin_url = std::env::var("DATABASE_ADMIN_URL")
        .unwrap_or_else(|_| "host=127.0.0.1 user=postgres dbname=test".to_string());
    let admin = runtime::pg_connect(&admin_url).await?;
    cycle::fresh_database(&admin, DB).await?;
    let url = format!("{admin_url} dbname={DB}");
    let mut pg = runtime::pg_connect(&url).await?;
    store::migrate(&pg).await?;
    store::set_route(&pg, "orders", "cycle", "CYCLE").await?;
    cycle::fill(&mut pg, n).await?;
    pg.batch_execute("VACUUM (ANALYZE) sealpost.work, sealpost.envelope")
        .await?;
    let backend: i32 = pg.query_one("SELECT pg_backend_pid()", &[]).await?.get(0);
    let backend = backend.to_string();
    let cpu0 = (process_cpu_s(&backend), process_cpu_s("self"));
    let mut held = store::Held::default();
    let (mut claim_s, mut accept_s, mut events, mut sequence) = (0f64, 0f64, 0usize, 0u64);
    loop {
        let t = Instant::now();
        let batch = store::claim(
            &mut pg,
            &store::ClaimRequest::new(1, 1_000, 60_000).cluster(Some("cycle")),
            Some(&mut held),
        )
        .await?;
        claim_s += t.elapsed().as_secs_f64();
        if batch.outgoing.is_empty() {
            break;
        }
        let receipts = cycle::ack_receipts(&batch.outgoing, &mut sequence);
        events += receipts.len();
        let submission = Submission {
            receipts,
            reports: vec![],
        };
        let t = Instant::now();
        let done = store::submit_held(&mut pg, &submission, 5, &mut held).await?;
        accept_s += t.elapsed().as_secs_f64();
        if done.guarded != submission.receipts.len() {
            return Err(format!(
                "{} of {} receipts took the locked path: is another dispatcher draining {DB}?",
                submission.receipts.len() - done.guarded,
                submission.receipts.len()
            )
            .into());
        }
    }
    let per_event = |s: f64| s * 1e6 / events.max(1) as f64;
    println!(
        "{events} events: claim {:.1} us/event, acceptance {:.1} us/event (wall)",
        per_event(claim_s),
        per_event(accept_s)
    );
    if let ((Some(b0), Some(s0)), Some(b1), Some(s1)) =
        (cpu0, process_cpu_s(&backend), process_cpu_s("self"))
    {
        println!(
            "cpu: postgres backend {:.1} us/event, this process {:.1} us/event",
            per_event(b1 - b0),
            per_event(s1 - s0)
        );
    }
    drop(pg);
    cycle::drop_database(&admin, DB).await?;
    Ok(())
}
