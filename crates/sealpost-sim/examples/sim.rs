//! A light runner for the simulator alone (without building the CLI):
//! `cargo run --release -p sealpost-sim --example sim -- TRACES SEED [MUTANT|replay:TRACE_SEED]`.
//! Prints the violations per class, the adversary's counts and the first failing traces.

use sealpost_sim::{run, Fault, Mutant, Protocol, RunOptions, Violation};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let traces: u64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(10_000);
    let seed: u64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(1);
    let third = args.get(3).map(String::as_str);
    if let Some(ts) = third.and_then(|t| t.strip_prefix("replay:")) {
        let ts: u64 = ts.parse().expect("a trace seed");
        let mutant = args.get(4).and_then(|m| Mutant::parse(m));
        let (stats, log) = sealpost_sim::replay(ts, Protocol { mutant });
        for l in log {
            println!("{l}");
        }
        println!("{:?}", stats.violations);
        return;
    }
    let mutant = third.map(|m| Mutant::parse(m).expect("a mutant name"));
    let start = std::time::Instant::now();
    let report = run(
        RunOptions {
            traces,
            seed,
            threads: 0,
            proto: Protocol { mutant },
            stop_at_first_failure: false,
        },
        &|_| {},
    );
    let s = &report.stats;
    println!(
        "{} traces, seed {seed}, mutant {:?}: {:.1} s, {} steps",
        s.traces,
        mutant.map(Mutant::name),
        start.elapsed().as_secs_f64(),
        s.steps
    );
    for c in Violation::ALL {
        println!("  {:<28}{:>10}", c.key(), s.violations.get(c));
    }
    println!(
        "  late acks {}/{} converged, unknown unresolved {}, p99 {} s",
        s.late_acks_converged,
        s.late_acks,
        s.unknown.unresolved,
        s.unknown.quantile_s(0.99)
    );
    for f in [
        Fault::ForgedNewEvent,
        Fault::ForgedCopyFirst,
        Fault::ForgedCopyAtLookup,
        Fault::ReplayedSignature,
    ] {
        println!("  fault {:<52}{:>10}", f.label(), s.faults.get(f));
    }
    let never: Vec<&str> = Fault::ALL
        .iter()
        .filter(|f| s.faults.get(**f) == 0)
        .map(|f| f.label())
        .collect();
    println!("  faults never injected: {never:?}");
    println!(
        "  deliveries unsealed {}, copies unsealed {}, unsealed parked {} (conflicts {}), duplicate acks not this message {}, forgeries reported {}",
        s.deliveries_unsealed,
        s.copies_unsealed,
        s.unsealed_parked,
        s.conflicts_parked,
        s.duplicate_acks_not_this_message,
        s.forgeries_reported
    );
    let c = &s.cdc;
    println!(
        "  cdc: traces {} (alone {}), restarts {}, reconnects {}, repeats {}, slot losses {}, window full {}, stalls {}, claimed from log {}, sweeps {}, confirms {}",
        c.traces,
        c.alone,
        c.restarts,
        c.reconnects,
        c.repeats,
        c.slot_losses,
        c.window_full,
        c.stalls,
        c.claimed_from_log,
        c.sweeps,
        c.confirms
    );
    println!(
        "  delivery sets: {} run, {} complete, {} blocked at the end",
        s.sets, s.sets_complete, s.sets_blocked
    );
    let r = &s.rollout;
    println!(
        "  rollout: traces {}, switches {} (to shadow {}, takeover {}, promoted {}, rollback {}), refused {}, unchanged {}, sends a {} / b {}, rows skipped by the alias {}",
        r.traces,
        r.switches,
        r.to_stage[0],
        r.to_stage[1],
        r.to_stage[2],
        r.to_stage[3],
        r.refused,
        r.unchanged,
        r.sends[0],
        r.sends[1],
        r.skipped
    );
    println!(
        "  shadow: reads {}, rows compared {} (copies not the sealed envelope {}), divergences found {}",
        r.shadow_reads, r.shadow_compared, r.shadow_foreign, r.shadow_divergences
    );
    let k = &s.contracts;
    println!(
        "  contracts: traces {}, versions registered {}, breaking registrations refused {}, enqueues refused {}, payloads read {} (across versions {})",
        k.traces, k.registered, k.refused, k.enqueue_refused, k.reads, k.reads_across_versions
    );
    for (i, ts) in &report.failing {
        println!("  failing trace {i} (trace seed {ts})");
    }
}
