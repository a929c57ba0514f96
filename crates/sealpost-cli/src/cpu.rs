//! Where the CPU goes: the user + system time of this process, of every PostgreSQL server
//! process and of every `nats-server` process on this machine, read from `/proc` (Linux).
//! The bench and the measuring examples take a [`Sample`] before and after a drain and
//! divide the difference by the events drained; on a machine where the servers run
//! elsewhere (or without `/proc`) their share is absent, not zero.
//!
//! A server group's time includes its exited children's (`cutime` and `cstime` of the
//! process that reaped them): a PostgreSQL backend whose connection closes inside the window
//! moves its CPU to the postmaster, so the group's sum only grows and the backend's work
//! still counts.

use serde::Serialize;

/// Clock ticks per second of `/proc/<pid>/stat` (`sysconf(_SC_CLK_TCK)`, 100 on Linux).
const TICKS_PER_S: f64 = 100.0;

/// CPU seconds so far, per process group.
#[derive(Clone, Copy, Debug, Default)]
pub struct Sample {
    /// Every process named `postgres` (the postmaster, backends, WAL writer, checkpointer),
    /// with the exited backends the postmaster reaped.
    pub postgres_s: Option<f64>,
    /// Every process named `nats-server`.
    pub nats_s: Option<f64>,
    /// This process.
    pub process_s: Option<f64>,
}

/// CPU time per event between two samples, in microseconds.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq)]
pub struct PerEvent {
    /// PostgreSQL's processes.
    pub postgres_us: Option<f64>,
    /// The NATS servers.
    pub nats_us: Option<f64>,
    /// This process (dispatchers or relays, and the bench's own probes).
    pub process_us: Option<f64>,
    /// The three together, when all three were read.
    pub total_us: Option<f64>,
}

/// User + system CPU seconds of one process, from `/proc/<pid>/stat` (`pid` may be `self`).
pub fn process_cpu_s(pid: &str) -> Option<f64> {
    stat_ticks(pid, false)
}

/// The same plus the CPU of the children it has reaped (`cutime`, `cstime`).
fn with_reaped_children_cpu_s(pid: &str) -> Option<f64> {
    stat_ticks(pid, true)
}

fn stat_ticks(pid: &str, reaped_children: bool) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces; the fields after its `)` are fixed:
    // utime, stime, cutime, cstime are fields 14-17 of proc(5), 11-14 here.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let field = |i: usize| fields.get(i)?.parse::<f64>().ok();
    let mut ticks = field(11)? + field(12)?;
    if reaped_children {
        ticks += field(13)? + field(14)?;
    }
    Some(ticks / TICKS_PER_S)
}

/// Summed CPU seconds of every process whose name (`/proc/<pid>/comm`) is `name`, with
/// the children each has reaped; `None` when none runs here.
fn named_cpu_s(name: &str) -> Option<f64> {
    let mut total = None;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let pid = entry.file_name();
        let Some(pid) = pid
            .to_str()
            .filter(|p| p.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let Ok(comm) = std::fs::read_to_string(format!("/proc/{pid}/comm")) else {
            continue;
        };
        if comm.trim_end() == name {
            // A process that exits between the two reads counts as nothing here; its parent
            // (the postmaster, for a backend) counts it once it has reaped it.
            *total.get_or_insert(0.0) += with_reaped_children_cpu_s(pid).unwrap_or(0.0);
        }
    }
    total
}

/// Reads the three groups now.
pub fn sample() -> Sample {
    Sample {
        postgres_s: named_cpu_s("postgres"),
        nats_s: named_cpu_s("nats-server"),
        process_s: process_cpu_s("self"),
    }
}

impl Sample {
    /// CPU per event from `self` to `later`, over `events` events.
    pub fn per_event_until(&self, later: &Sample, events: u64) -> PerEvent {
        let per = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) if events > 0 => {
                Some(round1((b - a).max(0.0) * 1e6 / events as f64))
            }
            _ => None,
        };
        let postgres_us = per(self.postgres_s, later.postgres_s);
        let nats_us = per(self.nats_s, later.nats_s);
        let process_us = per(self.process_s, later.process_s);
        let total_us = match (postgres_us, nats_us, process_us) {
            (Some(a), Some(b), Some(c)) => Some(round1(a + b + c)),
            _ => None,
        };
        PerEvent {
            postgres_us,
            nats_us,
            process_us,
            total_us,
        }
    }
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

impl std::fmt::Display for PerEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let show = |v: Option<f64>| v.map_or("?".to_string(), |v| format!("{v:.1}"));
        write!(
            f,
            "CPU per event: PostgreSQL {} us, NATS {} us, this process {} us, total {} us",
            show(self.postgres_us),
            show(self.nats_us),
            show(self.process_us),
            show(self.total_us)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_burns_cpu_it_can_read() {
        let before = sample();
        let start = before.process_s.expect("Linux has /proc/self/stat");
        // Spin until the kernel has charged 30 ms to this process (a loaded machine may
        // take longer than 30 ms of wall time), for at most 10 s.
        let t = std::time::Instant::now();
        let mut x = 0u64;
        while process_cpu_s("self").is_some_and(|now| now - start < 0.03)
            && t.elapsed() < std::time::Duration::from_secs(10)
        {
            for _ in 0..10_000 {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            }
        }
        std::hint::black_box(x);
        let p = before.per_event_until(&sample(), 1);
        assert!(p.process_us.is_some_and(|us| us >= 30_000.0), "{p:?}");
    }

    #[test]
    fn a_reaped_childs_cpu_moves_to_its_parent() {
        // A child that burns CPU and exits: once waited for, its time is in our cutime.
        let before = with_reaped_children_cpu_s("self").expect("/proc/self/stat");
        let status = std::process::Command::new("sh")
            .args(["-c", "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done"])
            .status()
            .expect("sh runs");
        assert!(status.success());
        let after = with_reaped_children_cpu_s("self").unwrap();
        let own = process_cpu_s("self").unwrap();
        assert!(after - before >= 0.01, "{before} -> {after}");
        assert!(after > own, "own {own}, with children {after}");
    }

    #[test]
    fn a_group_not_read_is_absent_not_zero() {
        let a = Sample {
            postgres_s: None,
            nats_s: Some(1.0),
            process_s: Some(2.0),
        };
        let b = Sample {
            postgres_s: Some(5.0),
            nats_s: Some(1.5),
            process_s: Some(2.25),
        };
        let p = a.per_event_until(&b, 1_000);
        assert_eq!(p.postgres_us, None);
        assert_eq!(p.nats_us, Some(500.0));
        assert_eq!(p.process_us, Some(250.0));
        assert_eq!(p.total_us, None);
        assert_eq!(a.per_event_until(&b, 0), PerEvent::default());
    }
}
