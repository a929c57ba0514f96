//! The deterministic simulator (G1–G4). Each trace is a seeded world whose every protocol
//! decision is a call into `sealpost-core`; virtual time jumps to the next wake-up; every
//! run is bounded. Checkers run after every step. [`run`] spreads traces over threads and
//! merges their counts; [`replay`] re-runs one trace with a step-by-step log.

pub mod protocol;
pub mod stats;
mod world;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

pub use protocol::{Mutant, Protocol};
pub use stats::{
    CdcCounts, ContractCounts, Fault, LateCommitCounts, RolloutCounts, TraceStats, Violation,
};

/// The seed of trace `index` of a run seeded with `seed` (SplitMix64 of both).
pub fn trace_seed(seed: u64, index: u64) -> u64 {
    let mut z = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(index)
        .wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Runs one trace and returns its counts.
pub fn run_trace(trace_seed: u64, proto: Protocol) -> TraceStats {
    let (mut stats, _) = world::World::new(trace_seed, proto, false).run();
    stats.traces = 1;
    stats
}

/// Re-runs one trace with its step-by-step log.
pub fn replay(trace_seed: u64, proto: Protocol) -> (TraceStats, Vec<String>) {
    let (mut stats, log) = world::World::new(trace_seed, proto, true).run();
    stats.traces = 1;
    (stats, log)
}

/// Options of a run.
#[derive(Clone, Copy, Debug)]
pub struct RunOptions {
    /// Number of traces.
    pub traces: u64,
    /// Run seed.
    pub seed: u64,
    /// Worker threads (0: all cores).
    pub threads: usize,
    /// Protocol (mutant or not).
    pub proto: Protocol,
    /// Stop at the first failing trace.
    pub stop_at_first_failure: bool,
}

/// Result of a run.
#[derive(Clone, Debug)]
pub struct RunReport {
    /// Merged counts.
    pub stats: TraceStats,
    /// Seeds of the first failing traces (at most 10), lowest index first.
    pub failing: Vec<(u64, u64)>,
}

/// Runs `opts.traces` traces over threads. `progress` is called now and then with the number
/// of traces done.
pub fn run(opts: RunOptions, progress: &(dyn Fn(u64) + Sync)) -> RunReport {
    let threads = if opts.threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        opts.threads
    };
    let next = AtomicU64::new(0);
    let done = AtomicU64::new(0);
    let stop = AtomicU64::new(u64::MAX);
    let failing = Mutex::new(Vec::new());
    const CHUNK: u64 = 256;
    let merged = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut acc = TraceStats::default();
                    loop {
                        let start = next.fetch_add(CHUNK, Ordering::Relaxed);
                        if start >= opts.traces || start >= stop.load(Ordering::Relaxed) {
                            break;
                        }
                        let end = (start + CHUNK).min(opts.traces);
                        for i in start..end {
                            let ts = trace_seed(opts.seed, i);
                            let s = run_trace(ts, opts.proto);
                            if s.failed() {
                                let mut f = failing.lock().expect("no panics while held");
                                f.push((i, ts));
                                if opts.stop_at_first_failure {
                                    stop.fetch_min(i, Ordering::Relaxed);
                                }
                            }
                            acc.merge(&s);
                        }
                        let d = done.fetch_add(end - start, Ordering::Relaxed) + (end - start);
                        progress(d);
                    }
                    acc
                })
            })
            .collect();
        let mut total = TraceStats::default();
        for h in handles {
            total.merge(&h.join().expect("simulator thread panicked"));
        }
        total
    });
    let mut failing = failing.into_inner().expect("no panics while held");
    failing.sort_unstable();
    failing.truncate(10);
    RunReport {
        stats: merged,
        failing,
    }
}
