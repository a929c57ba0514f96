//! `--metrics-addr`: the Prometheus exporter of `sealpost dispatch`, `consume` and `demo`
//! (R23). The loops record through the `metrics` facade (`sealpost::observe`); this module
//! installs the exporter that serves them on `/metrics`, and samples the table-state
//! gauges on an interval: the figures of `store::status` (the function `sealpost status
//! --json` prints) and the purge backlog as `sealpost purge --dry-run` decides it.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use metrics::{counter, gauge};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use sealpost::observe;
use sealpost::runtime;
use sealpost::runtime::Config;

/// The metrics flags shared by `dispatch`, `consume` and `demo`.
#[derive(clap::Args, Clone, Debug)]
pub struct MetricsArgs {
    /// Serve Prometheus metrics on `http://ADDR/metrics` (e.g. 127.0.0.1:9464); off when
    /// not given.
    #[arg(long)]
    pub metrics_addr: Option<SocketAddr>,
    /// How often the table-state gauges are read (`sealpost status`'s queries), seconds.
    #[arg(long, default_value_t = 5.0)]
    pub metrics_every_s: f64,
    /// How often the purge backlog is decided (a `purge --dry-run` over the published rows),
    /// seconds; 0 turns it off.
    #[arg(long, default_value_t = 60.0)]
    pub metrics_purge_every_s: f64,
    /// Replay window the purge backlog assumes (as `sealpost purge --replay-window-s`).
    #[arg(long, default_value_t = 86_400)]
    pub metrics_replay_window_s: u64,
}

/// Installs the Prometheus exporter on `addr` (histogram buckets from `sealpost::observe`).
/// Call inside the tokio runtime; the listener runs on it.
pub fn install(addr: SocketAddr) -> Result<(), String> {
    let buckets = |b: PrometheusBuilder, name: &str, values: &[f64]| {
        b.set_buckets_for_metric(Matcher::Full(name.to_string()), values)
            .map_err(|e| format!("metrics buckets of {name}: {e}"))
    };
    let mut b = PrometheusBuilder::new().with_http_listener(addr);
    b = buckets(b, observe::PUBLISH_LATENCY, observe::LATENCY_BUCKETS_S)?;
    b = buckets(b, observe::CLAIM_DURATION, observe::DURATION_BUCKETS_S)?;
    b = buckets(b, observe::ACCEPT_DURATION, observe::DURATION_BUCKETS_S)?;
    b = buckets(b, observe::CLAIM_BATCH_ROWS, observe::BATCH_BUCKETS)?;
    b.install().map_err(|e| {
        format!(
            "cannot serve metrics on {addr}: {e}; is the port taken? choose another --metrics-addr"
        )
    })?;
    describe();
    Ok(())
}

/// Installs the exporter when `--metrics-addr` was given and, with `tables`, starts the
/// table sampler ([`sample_tables`]) on a task that runs until the process ends.
pub fn start(cfg: &Config, args: &MetricsArgs, tables: bool) -> Result<(), String> {
    let Some(addr) = args.metrics_addr else {
        return Ok(());
    };
    install(addr)?;
    if tables {
        let stop = Arc::new(AtomicBool::new(false));
        tokio::spawn(sample_tables(cfg.clone(), args.clone(), stop));
    }
    Ok(())
}

/// The `# HELP` lines.
fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_histogram!(
        observe::PUBLISH_LATENCY,
        Unit::Seconds,
        "commit -> PUBLISHED, database clock, per accepted primary receipt"
    );
    describe_counter!(
        observe::DUPLICATE_RECEIPTS,
        "duplicate transport receipts (same position or a second stored copy)"
    );
    describe_counter!(
        observe::RECEIPTS_QUARANTINED,
        "receipts contradicting the sealed envelope, quarantined"
    );
    describe_counter!(observe::RECEIPTS_REJECTED, "receipts rejected and audited");
    describe_counter!(
        observe::SEND_OUTCOMES,
        "sends that ended without a receipt, by outcome (refused: the broker's refusals)"
    );
    describe_counter!(
        observe::POISON_QUARANTINED,
        "rows quarantined as poison at the refusal limit"
    );
    describe_histogram!(observe::CLAIM_BATCH_ROWS, "rows per claim transaction");
    describe_histogram!(
        observe::CLAIM_DURATION,
        Unit::Seconds,
        "claim transaction time"
    );
    describe_histogram!(
        observe::ACCEPT_DURATION,
        Unit::Seconds,
        "submission (acceptance point and outcome reports) transaction time"
    );
    describe_counter!(
        observe::EXPIRED_TO_UNKNOWN,
        "SENDING rows past their lease moved to DISPATCH_UNKNOWN"
    );
    describe_counter!(observe::LOOKUPS, "broker lookups by pass and outcome");
    describe_counter!(observe::RECONCILE_DECISIONS, "reconciler decisions");
    describe_counter!(
        observe::MISSING_FOUND,
        "published rows the verification pass found missing at the broker"
    );
    describe_counter!(observe::UNKNOWN_ALERTS, "unknown-age alerts");
    describe_gauge!(observe::ROWS, "rows per state (sealpost status)");
    describe_gauge!(
        observe::OLDEST_PENDING_AGE,
        Unit::Seconds,
        "age of the oldest PENDING row (sealpost status)"
    );
    describe_gauge!(
        observe::UNKNOWN_ROWS,
        "rows in DISPATCH_UNKNOWN or RECONCILING (sealpost status)"
    );
    describe_gauge!(
        observe::OLDEST_UNKNOWN_AGE,
        Unit::Seconds,
        "age of the oldest unknown row (sealpost status)"
    );
    describe_gauge!(
        observe::QUARANTINED,
        "quarantine entries (sealpost status quarantined)"
    );
    describe_gauge!(
        observe::MISSING_AT_BROKER,
        "open published-but-missing-at-the-broker findings"
    );
    describe_gauge!(
        observe::DELIVERY_SETS,
        "delivery sets by status: complete, in_progress, blocked (sealpost status sets)"
    );
    describe_counter!(observe::STATUS_SAMPLES, "status samples taken");
    describe_gauge!(
        observe::PURGE_ELIGIBLE,
        "rows a purge would remove now (purge --dry-run)"
    );
    describe_gauge!(
        observe::PURGE_HELD,
        "published rows a purge keeps, by reason (purge --dry-run)"
    );
    describe_counter!(observe::PURGE_SAMPLES, "purge backlog samples taken");
    describe_counter!(
        observe::CONSUMER_MESSAGES,
        "messages a consumer handled, by outcome"
    );
    describe_gauge!(
        observe::CONSUMER_LAG,
        "messages the broker holds for the consumer, not yet acked"
    );
}

/// The label of a purge report's reason (`ops::PurgeReport::kept` keys).
pub fn purge_reason_label(reason: &str) -> &'static str {
    match reason {
        "inside the replay window" => "replay_window",
        "a required consumer has not consumed it" => "consumer_behind",
        "not published" => "not_published",
        "its CDC slot has not confirmed it" => "cdc_position",
        _ => observe::OTHER,
    }
}

/// Sets the purge backlog gauges from a dry run's report. Every known reason is set, to 0
/// when the report has none, so a cleared reason does not keep its last figure.
pub fn record_purge(r: &crate::ops::PurgeReport) {
    gauge!(observe::PURGE_ELIGIBLE).set(r.purged as f64);
    let mut held = std::collections::BTreeMap::<&'static str, u64>::new();
    for l in [
        "replay_window",
        "consumer_behind",
        "not_published",
        "cdc_position",
    ] {
        held.insert(l, 0);
    }
    for (why, n) in &r.kept {
        *held.entry(purge_reason_label(why)).or_default() += n;
    }
    for (l, n) in held {
        gauge!(observe::PURGE_HELD, "reason" => l).set(n as f64);
    }
}

/// Samples the table-state gauges every `every_s` and the purge backlog every
/// `purge_every_s` (required consumers: every consumer with a watermark, as `sealpost
/// reconcile` assumes) until `stop`. Runs on a connection of its own; a failed sample is
/// logged and counted, and the next one reconnects if the connection is gone.
pub async fn sample_tables(cfg: Config, args: MetricsArgs, stop: Arc<AtomicBool>) {
    let every = Duration::from_secs_f64(args.metrics_every_s.max(0.1));
    let purge_every = (args.metrics_purge_every_s > 0.0)
        .then(|| Duration::from_secs_f64(args.metrics_purge_every_s));
    let mut pg: Option<tokio_postgres::Client> = None;
    let mut last_purge: Option<Instant> = None;
    while !stop.load(Ordering::Relaxed) {
        if pg.as_ref().is_none_or(|c| c.is_closed()) {
            match runtime::pg_connect(&cfg.database_url).await {
                Ok(c) => pg = Some(c),
                Err(e) => {
                    // Not the closed client again: its "connection closed" would hide the
                    // cause (the error is redacted, `RunError::Connect`).
                    pg = None;
                    tracing::warn!(error = %e, "metrics: cannot read the status");
                }
            }
        }
        if let Some(c) = pg.as_mut() {
            if let Err(e) = observe::sample_status(&*c).await {
                tracing::warn!(error = %e, "metrics: status sample failed");
            }
            if purge_every.is_some_and(|p| last_purge.is_none_or(|t| t.elapsed() >= p)) {
                last_purge = Some(Instant::now());
                match purge_backlog(c, args.metrics_replay_window_s).await {
                    Ok(r) => {
                        record_purge(&r);
                        counter!(observe::PURGE_SAMPLES, "result" => "ok").increment(1);
                    }
                    Err(e) => {
                        counter!(observe::PURGE_SAMPLES, "result" => "error").increment(1);
                        tracing::warn!(error = %e, "metrics: purge backlog sample failed");
                    }
                }
            }
        }
        let until = Instant::now() + every;
        while !stop.load(Ordering::Relaxed) && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(100).min(every)).await;
        }
    }
}

/// The purge backlog: `sealpost purge --dry-run` over every stream, the required consumers
/// being every consumer that reports its progress to this database (none: the figures of a
/// purge with `--no-consumers`).
async fn purge_backlog(
    pg: &mut tokio_postgres::Client,
    replay_window_s: u64,
) -> std::result::Result<crate::ops::PurgeReport, crate::ops::PurgeError> {
    let consumers: Vec<String> = pg
        .query(
            "SELECT DISTINCT consumer_id FROM sealpost.consumer_progress ORDER BY 1",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut o = crate::ops::PurgeOptions::new(&consumers, replay_window_s);
    o.no_consumers = consumers.is_empty();
    o.dry_run = true;
    crate::ops::purge(pg, &o).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_purge_reason_has_a_label() {
        use sealpost_core::cleanup::PurgeRefusal;
        use sealpost_core::state::State;
        for (refusal, label) in [
            (
                PurgeRefusal::ReplayWindow { remaining_ms: 1 },
                "replay_window",
            ),
            (
                PurgeRefusal::ConsumerBehind {
                    consumer: 0,
                    position: 1,
                    watermark: None,
                },
                "consumer_behind",
            ),
            (PurgeRefusal::NotPublished(State::Pending), "not_published"),
            (
                PurgeRefusal::CdcPosition {
                    created_at_ms: 2,
                    hold_from_ms: 1,
                },
                "cdc_position",
            ),
        ] {
            assert_eq!(purge_reason_label(&crate::ops::reason_key(&refusal)), label);
        }
        assert_eq!(purge_reason_label("something new"), observe::OTHER);
    }
}
