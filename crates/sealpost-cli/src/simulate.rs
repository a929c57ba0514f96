//! `sealpost simulate`: runs the deterministic simulator, shows progress on a terminal and
//! prints a table (or one JSON object), exiting non-zero on any violation.

use std::io::IsTerminal;
use std::time::Instant;

use sealpost_sim::{Fault, Mutant, Protocol, RunOptions, TraceStats, Violation};

/// Arguments of `sealpost simulate`.
#[derive(clap::Args, Debug)]
pub struct SimulateArgs {
    /// Number of traces.
    #[arg(long, default_value_t = 100_000)]
    pub traces: u64,
    /// Run seed; trace i uses a seed derived from (seed, i).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Switch on one deliberate protocol bug (see --list-mutants).
    #[arg(long)]
    pub mutant: Option<String>,
    /// Print the mutant names, one per line.
    #[arg(long)]
    pub list_mutants: bool,
    /// Replay one trace seed alone with a step-by-step log.
    #[arg(long)]
    pub replay: Option<u64>,
    /// Worker threads (default: all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
}

/// Runs the subcommand; returns the process exit code.
pub fn run(args: SimulateArgs) -> anyhow_lite::Result<i32> {
    if args.list_mutants {
        for m in Mutant::ALL {
            println!("{}", m.name());
        }
        return Ok(0);
    }
    let mutant = match &args.mutant {
        None => None,
        Some(name) => Some(Mutant::parse(name).ok_or_else(|| {
            anyhow_lite::Error(format!(
                "unknown mutant `{name}`; `sealpost simulate --list-mutants` prints the names"
            ))
        })?),
    };
    let proto = Protocol { mutant };
    if let Some(ts) = args.replay {
        let (stats, log) = sealpost_sim::replay(ts, proto);
        for line in log {
            println!("{line}");
        }
        print_table(&stats, 0.0);
        return Ok(i32::from(stats.failed()));
    }
    let started = Instant::now();
    let tty = std::io::stderr().is_terminal() && !args.json;
    let bar = if tty {
        let b = indicatif::ProgressBar::new(args.traces);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {wide_bar} {pos}/{len} traces ({per_sec}, eta {eta})",
            )
            .expect("static template"),
        );
        Some(b)
    } else {
        None
    };
    let progress = |done: u64| {
        if let Some(b) = &bar {
            b.set_position(done);
        }
    };
    let report = sealpost_sim::run(
        RunOptions {
            traces: args.traces,
            seed: args.seed,
            threads: args.threads,
            proto,
            stop_at_first_failure: false,
        },
        &progress,
    );
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    let elapsed_s = started.elapsed().as_secs_f64();
    let s = &report.stats;
    if args.json {
        println!("{}", json(s, elapsed_s));
    } else {
        print_table(s, elapsed_s);
    }
    if s.failed() {
        eprintln!(
            "FAILED: {} trace(s) broke a gate. Replay one alone with its step log:",
            report.failing.len()
        );
        for (i, ts) in &report.failing {
            let m = args
                .mutant
                .as_deref()
                .map(|m| format!(" --mutant {m}"))
                .unwrap_or_default();
            eprintln!("  trace #{i} (seed {ts}): sealpost simulate --replay {ts}{m}");
        }
        return Ok(1);
    }
    Ok(0)
}

fn finite_or_null(x: f64) -> serde_json::Value {
    if x.is_finite() {
        serde_json::json!(x)
    } else {
        serde_json::Value::Null
    }
}

/// The `--json` object, with exactly the keys the issue fixes.
pub fn json(s: &TraceStats, elapsed_s: f64) -> serde_json::Value {
    let mut v = serde_json::Map::new();
    for c in Violation::ALL {
        v.insert(c.key().to_string(), serde_json::json!(s.violations.get(c)));
    }
    serde_json::json!({
        "traces": s.traces,
        "steps": s.steps,
        "violations": v,
        "late_acks": s.late_acks,
        "late_acks_converged": s.late_acks_converged,
        "unknown_resolved": s.unknown.resolved(),
        "unknown_resolve_s_p50": finite_or_null(s.unknown.quantile_s(0.50)),
        "unknown_resolve_s_p99": finite_or_null(s.unknown.quantile_s(0.99)),
        "unknown_unresolved": s.unknown.unresolved,
        "elapsed_s": (elapsed_s * 1000.0).round() / 1000.0,
    })
}

fn print_table(s: &TraceStats, elapsed_s: f64) {
    println!("traces                      {:>14}", s.traces);
    println!("steps                       {:>14}", s.steps);
    if elapsed_s > 0.0 {
        println!("elapsed                     {:>12.2} s", elapsed_s);
        println!(
            "traces/s                    {:>14.0}",
            s.traces as f64 / elapsed_s
        );
    }
    println!();
    println!("violation class             {:>14}", "count");
    for c in Violation::ALL {
        println!("  {:<26}{:>14}", c.key(), s.violations.get(c));
    }
    println!();
    println!("late ACKs (G2)              {:>14}", s.late_acks);
    println!("  converged into the slot   {:>14}", s.late_acks_converged);
    println!("UNKNOWN episodes resolved   {:>14}", s.unknown.resolved());
    println!(
        "  p50 / p99 (s)             {:>6} / {:>5}",
        s.unknown.quantile_s(0.5),
        s.unknown.quantile_s(0.99)
    );
    println!("  unresolved                {:>14}", s.unknown.unresolved);
    println!();
    println!("evidence                    {:>14}", "count");
    let rows = [
        ("duplicate transport receipts", s.duplicate_receipts),
        ("receipts quarantined", s.quarantined_receipts),
        ("receipts rejected (audited)", s.rejected_receipts),
        ("stale writes fenced", s.fenced_writes),
        ("second broker copies", s.second_copies),
        ("inbox duplicates absorbed", s.inbox_duplicates),
        ("migrations granted / refused", s.migrations_granted),
        ("", s.migrations_refused),
        ("rows purged", s.purged),
        ("early purges refused", s.purges_refused),
        ("poison released by operator", s.quarantine_released),
        ("ordered claims that waited", s.ordering_waits),
        (
            "receipts accepted by the guarded fast path",
            s.guarded_accepts,
        ),
        (
            "batch leases taken (one row write per event)",
            s.leases_taken,
        ),
        ("  first sends they stood for", s.leased_sends),
        ("  dropped once their rows were written", s.leases_dropped),
        ("ordered deliveries held", s.ordering_holds),
        ("ordered gaps a restore left", s.ordering_gaps_parked),
        ("delivery sets run", s.sets),
        ("  complete at the end", s.sets_complete),
        ("  blocked at the end", s.sets_blocked),
        ("traces with contracts (R26)", s.contracts.traces),
        ("  versions registered", s.contracts.registered),
        ("  breaking versions refused", s.contracts.refused),
        ("  enqueues refused", s.contracts.enqueue_refused),
        ("  payloads read", s.contracts.reads),
        ("    across versions", s.contracts.reads_across_versions),
        ("traces with late commits", s.late.traces),
        ("  transactions committed late", s.late.commits),
        ("  rows behind a scan", s.late.behind_scan),
        (
            "    found by a scan from behind",
            s.late.found_by_scan_from_behind,
        ),
        ("    found by a full scan", s.late.found_by_full_scan),
        ("    found in the CDC log", s.late.found_by_log),
    ];
    for (k, v) in rows {
        println!("  {k:<30}{v:>10}");
    }
    println!();
    println!("faults injected             {:>14}", "count");
    for f in Fault::ALL {
        println!("  {:<42}{:>10}", f.label(), s.faults.get(f));
    }
    let verdict = if s.failed() { "FAIL" } else { "PASS" };
    println!();
    println!("gate: {verdict}");
}

/// Minimal error plumbing for the CLI.
pub mod anyhow_lite {
    /// A CLI error: a message that says what to do next.
    #[derive(Debug)]
    pub struct Error(pub String);
    impl std::fmt::Display for Error {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(&self.0)
        }
    }
    impl std::error::Error for Error {}
    /// Result alias.
    pub type Result<T> = std::result::Result<T, Error>;
}
