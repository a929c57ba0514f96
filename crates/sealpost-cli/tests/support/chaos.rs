//! Seed 000's process chaos for the drills of `kafka.rs` and `rabbitmq.rs` (the test
//! binary's `chaos` module): for a while, at random, a dispatcher process is killed with
//! SIGKILL and started again (two faults in three) or frozen with SIGSTOP for 1 to 8 s, a fault every 0.2 to 1 s.
//! Producers keep committing orders all the while (100 at each fault), so the drill also
//! measures the tail after the faults stop, not only a backlog drained during them. The
//! choices come from a seed the caller prints, so a failing run can be replayed.

use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// What a drill lends the chaos: its processes, a way to start another dispatcher, and the
/// count of unknown outcomes.
pub trait Target {
    /// The process at index `i`.
    fn child(&mut self, i: usize) -> &mut Child;
    /// Starts a dispatcher like the ones under chaos; its index.
    fn respawn(&mut self) -> usize;
    /// A count from the drill's database.
    async fn count(&self, sql: &str) -> i64;
    /// One text value from the drill's database (a diagnosis).
    async fn text(&self, sql: &str) -> String;
    /// The last lines the consumer processes logged (a diagnosis).
    fn consumer_logs(&self) -> String;
    /// The drill's database, where the producers commit.
    fn pg(&mut self) -> &mut tokio_postgres::Client;
}

/// Orders committed at each fault while the chaos runs.
pub const PRODUCED_PER_FAULT: usize = 100;

/// Commits `n` orders on route `orders` (aggregates `p-<first>`..), as a service would.
async fn produce(pg: &mut tokio_postgres::Client, first: usize, n: usize) {
    let keys: Vec<String> = (first..first + n).map(|k| format!("p-{k}")).collect();
    let events = sealpost_cli::demo::order_batch(&keys, br#"{"order_id":"p","total_cents":1}"#);
    let tx = pg.transaction().await.unwrap();
    sealpost::store::enqueue_many(&tx, "orders", &events)
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

/// Rows whose outcome is unknown.
pub const UNKNOWN_SQL: &str =
    "SELECT count(*) FROM sealpost.work WHERE state IN ('DISPATCH_UNKNOWN', 'RECONCILING')";

/// Waits until every one of `n` events is `PUBLISHED` and each of `consumers` applied each
/// (the demo's effect table, `demo_fulfilment`); panics with the figures after `limit`.
/// Returns how long it took.
pub async fn converge<T: Target>(t: &T, n: i64, consumers: &[String], limit: Duration) -> Duration {
    let start = Instant::now();
    loop {
        let mut figures = vec![(
            "published".to_string(),
            t.count("SELECT count(*) FROM sealpost.outbox WHERE state = 'PUBLISHED'")
                .await,
        )];
        for c in consumers {
            figures.push((
                format!("applied by {c}"),
                t.count(&format!(
                    "SELECT count(DISTINCT event_id) FROM demo_fulfilment WHERE consumer_id = '{c}'"
                ))
                .await,
            ));
        }
        if figures.iter().all(|(_, got)| *got == n) {
            return start.elapsed();
        }
        if start.elapsed() >= limit {
            for c in consumers {
                eprintln!("{}", t.text(&missing_sql(c)).await);
            }
            eprintln!("{}", t.consumer_logs());
            panic!(
                "not converged {limit:?} after the faults: {figures:?} of {n}, {} unknown",
                t.count(UNKNOWN_SQL).await
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// What consumer `c` has of the published events it did not apply (at most 10): where the
/// event is, its inbox row, its dead letters or refusals, and the consumer's watermarks.
fn missing_sql(c: &str) -> String {
    format!(
        "SELECT format(E'consumer {c}: watermarks %s\\n', (SELECT string_agg(stream || '=' || high_water, ' ' ORDER BY stream)
                 FROM sealpost.consumer_watermark WHERE consumer_id = '{c}'))
             || coalesce(string_agg(format('  not applied: %s at %s/%s seq %s; inbox rows %s; dead letters/refusals %s',
                 m.event_id, m.primary_stream, m.primary_partition, m.primary_sequence,
                 (SELECT count(*) FROM sealpost.inbox i WHERE i.consumer_id = '{c}' AND i.event_id = m.event_id),
                 (SELECT string_agg(q.kind || ': ' || q.reason, '; ') FROM sealpost.inbox_quarantine q
                   WHERE q.consumer_id = '{c}' AND q.event_id = m.event_id)), E'\\n'), '  (none)')
         FROM (SELECT o.event_id, o.primary_stream, o.primary_partition, o.primary_sequence
                 FROM sealpost.outbox o
                WHERE o.state = 'PUBLISHED' AND NOT EXISTS
                      (SELECT 1 FROM demo_fulfilment f WHERE f.consumer_id = '{c}' AND f.event_id = o.event_id)
                LIMIT 10) m"
    )
}

/// The last `lines` lines of each log file in `dir` whose name starts with `prefix`.
pub fn tails(dir: &std::path::Path, prefix: &str, lines: usize) -> String {
    let mut out = String::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    let mut names: Vec<_> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(prefix) && n.ends_with(".log"))
        })
        .collect();
    names.sort();
    for p in names {
        let text = std::fs::read_to_string(&p).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        out.push_str(&format!(
            "--- {} ({} lines), the last {lines}:\n",
            p.display(),
            all.len()
        ));
        for l in &all[all.len().saturating_sub(lines)..] {
            out.push_str(l);
            out.push('\n');
        }
    }
    out
}

/// What the chaos did.
#[derive(Debug, Default)]
pub struct Report {
    pub kills: u32,
    pub freezes: u32,
    /// Orders the producers committed during the chaos.
    pub produced: usize,
    /// The most unknown outcomes seen at once.
    pub peak_unknown: i64,
}

fn signal(sig: &str, pid: u32) {
    let _ = Command::new("kill").args([sig, &pid.to_string()]).status();
}

/// Runs the chaos over the dispatchers at `victims` (indexes into the target's processes,
/// replaced as they are killed and started again) for `duration`, then thaws every frozen one.
pub async fn run<T: Target>(
    t: &mut T,
    victims: &mut [usize],
    seed: u64,
    duration: Duration,
) -> Report {
    let mut state = seed | 1;
    let mut next = move |bound: u64| {
        // xorshift64
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % bound
    };
    let end = Instant::now() + duration;
    let mut frozen: Vec<(usize, Instant)> = Vec::new();
    let mut r = Report::default();
    while Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(200 + next(800))).await;
        produce(t.pg(), r.produced, PRODUCED_PER_FAULT).await;
        r.produced += PRODUCED_PER_FAULT;
        r.peak_unknown = r.peak_unknown.max(t.count(UNKNOWN_SQL).await);
        let now = Instant::now();
        let mut still = Vec::new();
        for (i, until) in frozen {
            if until <= now {
                signal("-CONT", t.child(i).id());
            } else {
                still.push((i, until));
            }
        }
        frozen = still;
        let slot = next(victims.len() as u64) as usize;
        let i = victims[slot];
        if frozen.iter().any(|&(f, _)| f == i) {
            continue;
        }
        if next(3) != 0 {
            let c = t.child(i);
            let _ = c.kill();
            let _ = c.wait();
            victims[slot] = t.respawn();
            r.kills += 1;
        } else {
            signal("-STOP", t.child(i).id());
            frozen.push((i, now + Duration::from_millis(1_000 + next(7_000))));
            r.freezes += 1;
        }
    }
    for (i, _) in frozen {
        signal("-CONT", t.child(i).id());
    }
    r
}

/// After the chaos: prints what it did, waits (at most 2 minutes) until every one of the
/// `n` events committed before it and the ones its producers committed is published and
/// applied by each of `consumers`, and asserts that no unknown is left and nothing was
/// quarantined. Returns the number of events in all.
pub async fn converged_after<T: Target>(t: &T, r: &Report, n: i64, consumers: &[String]) -> i64 {
    let n = n + r.produced as i64;
    eprintln!(
        "faults over: {r:?}; {} of {n} published, {} unknown",
        t.count("SELECT count(*) FROM sealpost.outbox WHERE state = 'PUBLISHED'")
            .await,
        t.count(UNKNOWN_SQL).await
    );
    let took = converge(t, n, consumers, Duration::from_secs(120)).await;
    eprintln!(
        "converged {:.1} s after the faults stopped",
        took.as_secs_f64()
    );
    assert_eq!(
        t.count(
            "SELECT count(*) FROM sealpost.work WHERE state IN ('DISPATCH_UNKNOWN', 'RECONCILING', 'QUARANTINED')"
        )
        .await,
        0,
        "no unknown left, nothing quarantined"
    );
    assert_eq!(t.count("SELECT count(*) FROM sealpost.quarantine").await, 0);
    n
}
