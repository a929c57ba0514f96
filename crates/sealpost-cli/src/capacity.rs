//! `sealpost capacity` (R27): from a workload (average and peak events/s, payload bytes,
//! retention, replicas, retry amplification) and measured per-event costs, the database
//! growth, WAL volume, index size and the time to drain a backlog with production running.
//! The costs come from a saved `sealpost bench --json` (`--from-bench`) or, by default, from
//! the figures in `docs/schema.md`; the output says which, and what each figure assumes.
//! Pure arithmetic: nothing here touches a database.

use serde::{Deserialize, Serialize};

/// The workload, from flags or a TOML file (same keys).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Workload {
    /// Average events per second over a day.
    pub avg_events_per_s: f64,
    /// Peak events per second.
    pub peak_events_per_s: f64,
    /// 99th percentile payload size, bytes (peak WAL is computed with it).
    pub payload_bytes_p99: f64,
    /// Average payload size, bytes (storage is computed with it; default: the p99).
    pub payload_bytes_avg: Option<f64>,
    /// How long a published row stays in the outbox before it is purged, days.
    pub retention_days: f64,
    /// Copies of every byte: the primary database and its standbys, and the stream's
    /// replicas (1: no replica).
    pub replicas: f64,
    /// Sends per event on average (1.0: every event published by its first attempt).
    pub retry_amplification: f64,
    /// A backlog to drain, events (0: none).
    pub backlog: u64,
}

/// Errors of the inputs; each names the key and what to do.
#[derive(Debug, thiserror::Error)]
pub enum CapacityError {
    /// A value out of range.
    #[error("capacity input `{key}`: {message}")]
    Invalid {
        /// Key.
        key: &'static str,
        /// What is wrong.
        message: String,
    },
    /// A file could not be read or parsed.
    #[error("{path}: {message}")]
    File {
        /// Path.
        path: String,
        /// The reader's or parser's words.
        message: String,
    },
}

impl Workload {
    /// Range checks.
    pub fn validate(&self) -> Result<(), CapacityError> {
        let bad = |key, message: &str| {
            Err(CapacityError::Invalid {
                key,
                message: message.to_string(),
            })
        };
        if self.avg_events_per_s.is_nan() || self.avg_events_per_s <= 0.0 {
            return bad("avg_events_per_s", "must be above 0 (--avg-events-per-s)");
        }
        if self.peak_events_per_s.is_nan() || self.peak_events_per_s < self.avg_events_per_s {
            return bad(
                "peak_events_per_s",
                "must be at least the average (--peak-events-per-s)",
            );
        }
        if self.payload_bytes_p99.is_nan() || self.payload_bytes_p99 <= 0.0 {
            return bad("payload_bytes_p99", "must be above 0 (--payload-bytes-p99)");
        }
        if self
            .payload_bytes_avg
            .is_some_and(|a| a.is_nan() || a <= 0.0)
        {
            return bad("payload_bytes_avg", "must be above 0");
        }
        if self.retention_days.is_nan() || self.retention_days < 0.0 {
            return bad("retention_days", "must be 0 or more (--retention-days)");
        }
        if self.replicas.is_nan() || self.replicas < 1.0 {
            return bad("replicas", "must be at least 1 (the primary copy)");
        }
        if self.retry_amplification.is_nan() || self.retry_amplification < 1.0 {
            return bad(
                "retry_amplification",
                "must be at least 1.0 (one send per event)",
            );
        }
        Ok(())
    }
}

/// Measured per-event costs of the happy path.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct Costs {
    /// Payload size the costs were measured with, bytes (`sealpost bench --payload-bytes`).
    pub payload_bytes: f64,
    /// WAL of enqueueing one event (envelope and work row, their index entries).
    pub enqueue_wal_bytes_per_event: f64,
    /// WAL of claiming and accepting one event (`bench` `wal_bytes_per_event`).
    pub wal_bytes_per_event: f64,
    /// Outbox heap growth per event (envelope and work row, TOAST included).
    pub heap_bytes_per_event: f64,
    /// Outbox index growth per event.
    pub index_bytes_per_event: f64,
    /// Net drain rate of a backlog with producers running (`bench` `net_drain_events_per_s`).
    pub net_drain_events_per_s: f64,
    /// The producers' rate while the net drain was measured (`bench` `produced_events_per_s`).
    pub produced_events_per_s: f64,
}

/// The defaults: the figures measured on the 2-core development machine and written in
/// `docs/schema.md` ("Per-event cost of the happy path" and "Storage and WAL per event").
pub const DOC_COSTS: Costs = Costs {
    payload_bytes: 200.0,
    enqueue_wal_bytes_per_event: 1_115.0,
    wal_bytes_per_event: 664.0,
    heap_bytes_per_event: 1_068.0,
    index_bytes_per_event: 167.0,
    net_drain_events_per_s: 20_113.0,
    produced_events_per_s: 2_000.0,
};

/// Reads the costs from a saved `sealpost bench --json`. Keys a bench of an older version
/// did not print are taken from [`DOC_COSTS`] and listed in the second value.
pub fn costs_from_bench(json: &str, path: &str) -> Result<(Costs, Vec<String>), CapacityError> {
    let v: serde_json::Value = serde_json::from_str(json).map_err(|e| CapacityError::File {
        path: path.to_string(),
        message: format!("not a `sealpost bench --json` output: {e}"),
    })?;
    let mut defaulted = Vec::new();
    let mut take = |key: &str, default: f64| match v.get(key).and_then(|x| x.as_f64()) {
        Some(x) if x.is_finite() => x,
        _ => {
            defaulted.push(key.to_string());
            default
        }
    };
    let d = DOC_COSTS;
    let payload_bytes = take("payload_bytes", d.payload_bytes);
    let c = Costs {
        payload_bytes,
        enqueue_wal_bytes_per_event: take(
            "enqueue_wal_bytes_per_event",
            d.enqueue_wal_bytes_per_event,
        ),
        wal_bytes_per_event: take("wal_bytes_per_event", d.wal_bytes_per_event),
        heap_bytes_per_event: take("heap_bytes_per_event", d.heap_bytes_per_event),
        index_bytes_per_event: take("index_bytes_per_event", d.index_bytes_per_event),
        net_drain_events_per_s: take("net_drain_events_per_s", d.net_drain_events_per_s),
        produced_events_per_s: take("produced_events_per_s", d.produced_events_per_s),
    };
    if c.net_drain_events_per_s <= 0.0 {
        return Err(CapacityError::File {
            path: path.to_string(),
            message: "net_drain_events_per_s is not above 0: the bench did not drain".into(),
        });
    }
    Ok((c, defaulted))
}

/// One figure and what it assumes.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Figure {
    /// The value (`null` in JSON when it does not exist, e.g. a backlog that never drains).
    pub value: Option<f64>,
    /// Unit.
    pub unit: &'static str,
    /// What it assumes.
    pub assumes: String,
}

/// The plan: inputs, costs and figures.
#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    /// Where the costs come from: `bench FILE` or `docs/schema.md (defaults)`.
    pub costs_source: String,
    /// Cost keys a bench file lacked, taken from the defaults.
    pub costs_defaulted: Vec<String>,
    /// The costs used.
    pub costs: Costs,
    /// The workload.
    pub workload: Workload,
    /// The figures, by name.
    pub figures: std::collections::BTreeMap<&'static str, Figure>,
}

const DAY_S: f64 = 86_400.0;

/// The arithmetic.
pub fn plan(w: &Workload, c: &Costs, costs_source: String, costs_defaulted: Vec<String>) -> Plan {
    let avg_payload = w.payload_bytes_avg.unwrap_or(w.payload_bytes_p99);
    // The payload is written once, at enqueue; the measured costs carry `payload_bytes` of it.
    let enqueue_wal =
        |payload: f64| (c.enqueue_wal_bytes_per_event + payload - c.payload_bytes).max(0.0);
    let heap = (c.heap_bytes_per_event + avg_payload - c.payload_bytes).max(0.0);
    let wal_per_event =
        |payload: f64| enqueue_wal(payload) + c.wal_bytes_per_event * w.retry_amplification;
    let wal_avg_per_s = w.avg_events_per_s * wal_per_event(avg_payload);
    let wal_peak_per_s = w.peak_events_per_s * wal_per_event(w.payload_bytes_p99);
    let rows = w.avg_events_per_s * DAY_S * w.retention_days;
    let gross = c.net_drain_events_per_s + c.produced_events_per_s;
    let drain = |produced: f64| {
        let net = gross - produced;
        (net > 0.0).then(|| w.backlog as f64 / net)
    };
    let mut f = std::collections::BTreeMap::new();
    let mut put = |name, value: Option<f64>, unit, assumes: String| {
        f.insert(
            name,
            Figure {
                value,
                unit,
                assumes,
            },
        );
    };
    put(
        "wal_bytes_per_s_avg",
        Some(wal_avg_per_s),
        "bytes/s",
        format!(
            "avg rate x (enqueue WAL with the avg payload + claim/accept WAL x retry amplification {}); \
             the payload is written to WAL once, at enqueue; retries repeat claim and acceptance only",
            w.retry_amplification
        ),
    );
    put(
        "wal_bytes_per_s_peak",
        Some(wal_peak_per_s),
        "bytes/s",
        "peak rate x the same per-event WAL with the p99 payload".to_string(),
    );
    put(
        "wal_bytes_per_day",
        Some(wal_avg_per_s * DAY_S),
        "bytes",
        "the average rate all day; on the primary, before compression; checkpoints' full-page images are in the measured figure only as far as the bench's run had them".to_string(),
    );
    put(
        "wal_shipped_bytes_per_day",
        Some(wal_avg_per_s * DAY_S * (w.replicas - 1.0)),
        "bytes",
        format!(
            "the day's WAL sent to each of {} standby copies",
            w.replicas - 1.0
        ),
    );
    put(
        "outbox_rows",
        Some(rows),
        "rows",
        "avg rate x retention: rows kept until purge (not counted: the tombstones of purged rows, each kept a replay window after its purge)".to_string(),
    );
    put(
        "heap_bytes",
        Some(rows * heap),
        "bytes",
        "outbox rows x heap per event as measured right after enqueue (the work rows' HOT updates fit in their fillfactor room; dead versions awaiting VACUUM not counted), the avg payload in place of the bench's; one copy".to_string(),
    );
    put(
        "index_bytes",
        Some(rows * c.index_bytes_per_event),
        "bytes",
        "outbox rows x measured index bytes per event; one copy".to_string(),
    );
    put(
        "database_growth_bytes",
        Some(rows * (heap + c.index_bytes_per_event) * w.replicas),
        "bytes",
        format!(
            "heap + index of the retained rows on all {} copies",
            w.replicas
        ),
    );
    put(
        "stream_bytes",
        Some(rows * avg_payload * w.replicas),
        "bytes",
        "payload bytes kept by the broker for the same retention on every replica (headers and per-message overhead not counted)".to_string(),
    );
    put(
        "drain_s_at_avg",
        drain(w.avg_events_per_s),
        "s",
        format!(
            "backlog {} / (gross rate - avg rate); gross = measured net drain {} + the producers' {} events/s during that measurement; null: the backlog never drains",
            w.backlog, c.net_drain_events_per_s, c.produced_events_per_s
        ),
    );
    put(
        "drain_s_at_peak",
        drain(w.peak_events_per_s),
        "s",
        "the same with production at the peak rate".to_string(),
    );
    put(
        "peak_utilisation",
        Some(w.peak_events_per_s / gross),
        "ratio",
        "peak rate / gross rate: above 1, a backlog grows during the peak".to_string(),
    );
    Plan {
        costs_source,
        costs_defaulted,
        costs: c.clone(),
        workload: w.clone(),
        figures: f,
    }
}

/// The workload flags of `sealpost capacity` (each overrides the file's key).
#[derive(Clone, Debug, Default)]
pub struct Flags {
    /// `--avg-events-per-s`.
    pub avg_events_per_s: Option<f64>,
    /// `--peak-events-per-s`.
    pub peak_events_per_s: Option<f64>,
    /// `--payload-bytes-p99`.
    pub payload_bytes_p99: Option<f64>,
    /// `--payload-bytes-avg`.
    pub payload_bytes_avg: Option<f64>,
    /// `--retention-days`.
    pub retention_days: Option<f64>,
    /// `--replicas`.
    pub replicas: Option<f64>,
    /// `--retry-amplification`.
    pub retry_amplification: Option<f64>,
    /// `--backlog`.
    pub backlog: Option<u64>,
}

/// The workload: the file's keys (if any), then the flags over them; `replicas` and
/// `retry_amplification` default to 1.
pub fn workload(file: Option<&str>, flags: &Flags) -> Result<Workload, CapacityError> {
    let mut w = match file {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| CapacityError::File {
                path: path.to_string(),
                message: format!("cannot read: {e}"),
            })?;
            toml::from_str::<Workload>(&text).map_err(|e| CapacityError::File {
                path: path.to_string(),
                message: format!("not a capacity workload: {e}"),
            })?
        }
        None => Workload::default(),
    };
    if w.replicas == 0.0 {
        w.replicas = 1.0;
    }
    if w.retry_amplification == 0.0 {
        w.retry_amplification = 1.0;
    }
    let set = |dst: &mut f64, v: Option<f64>| {
        if let Some(v) = v {
            *dst = v;
        }
    };
    set(&mut w.avg_events_per_s, flags.avg_events_per_s);
    set(&mut w.peak_events_per_s, flags.peak_events_per_s);
    set(&mut w.payload_bytes_p99, flags.payload_bytes_p99);
    set(&mut w.retention_days, flags.retention_days);
    set(&mut w.replicas, flags.replicas);
    set(&mut w.retry_amplification, flags.retry_amplification);
    if flags.payload_bytes_avg.is_some() {
        w.payload_bytes_avg = flags.payload_bytes_avg;
    }
    if let Some(b) = flags.backlog {
        w.backlog = b;
    }
    w.validate()?;
    Ok(w)
}

/// `sealpost capacity`: reads the workload and the costs, prints the plan.
pub fn run(
    file: Option<&str>,
    flags: Flags,
    from_bench: Option<&str>,
    json: bool,
) -> Result<(), CapacityError> {
    let w = workload(file, &flags)?;
    let (costs, source, defaulted) = match from_bench {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| CapacityError::File {
                path: path.to_string(),
                message: format!("cannot read: {e}"),
            })?;
            let (c, d) = costs_from_bench(&text, path)?;
            (c, format!("bench {path}"), d)
        }
        None => (
            DOC_COSTS,
            "docs/schema.md (defaults: measured on the 2-core development machine)".to_string(),
            Vec::new(),
        ),
    };
    let p = plan(&w, &costs, source, defaulted);
    if json {
        println!("{}", serde_json::to_string(&p).expect("a plan serialises"));
    } else {
        print(&p);
    }
    Ok(())
}

/// Prints a plan as text.
pub fn print(p: &Plan) {
    println!("costs: {}", p.costs_source);
    if !p.costs_defaulted.is_empty() {
        println!(
            "  (from docs/schema.md, missing in the bench file: {})",
            p.costs_defaulted.join(", ")
        );
    }
    for (name, f) in &p.figures {
        match f.value {
            Some(v) => println!("{name:<26} {v:>18.1} {}", f.unit),
            None => println!("{name:<26} {:>18} {}", "never", f.unit),
        }
        println!("    assumes: {}", f.assumes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w() -> Workload {
        Workload {
            avg_events_per_s: 100.0,
            peak_events_per_s: 1_000.0,
            payload_bytes_p99: 200.0,
            payload_bytes_avg: None,
            retention_days: 1.0,
            replicas: 3.0,
            retry_amplification: 1.0,
            backlog: 1_000_000,
        }
    }

    fn costs() -> Costs {
        Costs {
            payload_bytes: 200.0,
            enqueue_wal_bytes_per_event: 1_000.0,
            wal_bytes_per_event: 500.0,
            heap_bytes_per_event: 600.0,
            index_bytes_per_event: 300.0,
            net_drain_events_per_s: 9_000.0,
            produced_events_per_s: 1_000.0,
        }
    }

    fn val(p: &Plan, k: &str) -> Option<f64> {
        p.figures[k].value
    }

    #[test]
    fn wal_is_enqueue_plus_claim_and_accept_per_send() {
        let p = plan(&w(), &costs(), "t".into(), vec![]);
        assert_eq!(val(&p, "wal_bytes_per_s_avg"), Some(100.0 * 1_500.0));
        assert_eq!(val(&p, "wal_bytes_per_day"), Some(100.0 * 1_500.0 * DAY_S));
        assert_eq!(
            val(&p, "wal_shipped_bytes_per_day"),
            Some(100.0 * 1_500.0 * DAY_S * 2.0)
        );
        let mut retried = w();
        retried.retry_amplification = 2.0;
        let p = plan(&retried, &costs(), "t".into(), vec![]);
        // The payload is not written again by a retry: only claim and acceptance repeat.
        assert_eq!(val(&p, "wal_bytes_per_s_avg"), Some(100.0 * 2_000.0));
    }

    #[test]
    fn a_larger_payload_adds_its_bytes_once_to_wal_and_heap() {
        let mut big = w();
        big.payload_bytes_p99 = 1_200.0;
        big.payload_bytes_avg = Some(700.0);
        let p = plan(&big, &costs(), "t".into(), vec![]);
        assert_eq!(
            val(&p, "wal_bytes_per_s_peak"),
            Some(1_000.0 * (2_000.0 + 500.0))
        );
        assert_eq!(
            val(&p, "wal_bytes_per_s_avg"),
            Some(100.0 * (1_500.0 + 500.0))
        );
        let rows = 100.0 * DAY_S;
        assert_eq!(val(&p, "outbox_rows"), Some(rows));
        assert_eq!(val(&p, "heap_bytes"), Some(rows * 1_100.0));
        assert_eq!(val(&p, "index_bytes"), Some(rows * 300.0));
        assert_eq!(val(&p, "database_growth_bytes"), Some(rows * 1_400.0 * 3.0));
        assert_eq!(val(&p, "stream_bytes"), Some(rows * 700.0 * 3.0));
    }

    #[test]
    fn drain_time_uses_the_gross_rate_minus_production() {
        let p = plan(&w(), &costs(), "t".into(), vec![]);
        // gross = 9,000 + 1,000; at the average 100/s the net is 9,900/s.
        assert_eq!(val(&p, "drain_s_at_avg"), Some(1_000_000.0 / 9_900.0));
        assert_eq!(val(&p, "drain_s_at_peak"), Some(1_000_000.0 / 9_000.0));
        assert_eq!(val(&p, "peak_utilisation"), Some(0.1));
        let mut hot = w();
        hot.peak_events_per_s = 10_000.0;
        let p = plan(&hot, &costs(), "t".into(), vec![]);
        assert_eq!(val(&p, "drain_s_at_peak"), None, "never drains at the peak");
        assert_eq!(val(&p, "peak_utilisation"), Some(1.0));
    }

    #[test]
    fn out_of_range_inputs_name_their_key() {
        let mut bad = w();
        bad.replicas = 0.0;
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains("`replicas`"), "{e}");
        let mut bad = w();
        bad.peak_events_per_s = 10.0;
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("peak_events_per_s"));
        let mut bad = w();
        bad.retry_amplification = 0.5;
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("retry_amplification"));
        assert!(w().validate().is_ok());
    }

    #[test]
    fn a_bench_file_gives_the_costs_and_says_what_it_lacked() {
        let json = r#"{"wal_bytes_per_event": 700.5, "net_drain_events_per_s": 15000,
                       "produced_events_per_s": 1990, "payload_bytes": 300}"#;
        let (c, missing) = costs_from_bench(json, "b.json").unwrap();
        assert_eq!(c.wal_bytes_per_event, 700.5);
        assert_eq!(c.net_drain_events_per_s, 15_000.0);
        assert_eq!(c.payload_bytes, 300.0);
        assert_eq!(c.heap_bytes_per_event, DOC_COSTS.heap_bytes_per_event);
        assert_eq!(
            missing,
            vec![
                "enqueue_wal_bytes_per_event",
                "heap_bytes_per_event",
                "index_bytes_per_event"
            ]
        );
        assert!(costs_from_bench("nope", "b.json")
            .unwrap_err()
            .to_string()
            .contains("b.json"));
    }

    #[test]
    fn the_default_costs_are_the_figures_in_docs_schema_md() {
        let doc = include_str!("../../../docs/schema.md");
        for (what, v) in [
            ("enqueue WAL", DOC_COSTS.enqueue_wal_bytes_per_event),
            ("drain WAL", DOC_COSTS.wal_bytes_per_event),
            ("heap", DOC_COSTS.heap_bytes_per_event),
            ("index", DOC_COSTS.index_bytes_per_event),
            ("net drain", DOC_COSTS.net_drain_events_per_s),
        ] {
            let shown = format!("{}", v as u64);
            let with_comma = if v >= 1_000.0 {
                format!("{},{:03}", v as u64 / 1_000, v as u64 % 1_000)
            } else {
                shown.clone()
            };
            assert!(
                doc.contains(&format!("| {what} | {with_comma} |")),
                "docs/schema.md lists {what} = {with_comma}"
            );
        }
    }
}
