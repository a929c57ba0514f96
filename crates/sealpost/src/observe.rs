//! What the loops and the store report, through the `metrics` facade (R23, seed 003: publish
//! latency, the oldest unpublished age, the duplicate rate and the cleanup backlog must be
//! observable). The library only records: with no recorder installed every call here is a
//! no-op, and it carries no HTTP server. The `sealpost` command installs a Prometheus
//! exporter (`--metrics-addr`); a service embedding the loops installs whatever recorder it
//! uses. Every metric name is a constant of this module, documented in
//! `docs/operations.md` ("Metrics").
//!
//! Labels are bounded: destination and consumer values pass through a [`LabelCap`] that keeps
//! the first [`LABEL_VALUES_MAX`] distinct values a process sees and folds the rest into
//! [`OTHER`], so a route per tenant cannot blow up the scrape.
//!
//! Table-state gauges ([`record_status`]) are the figures of [`store::status`], the same
//! function `sealpost status --json` prints, sampled by the caller on an interval.

use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use metrics::{counter, gauge, histogram};
use sealpost_core::dispatcher::Submission;
use sealpost_core::reconcile::{Lookup, ReconcileDecision};
use sealpost_core::{DuplicateKind, ReceiptVerdict, SendOutcome};

use crate::store::{self, Accepted, Published, Status, Submitted};

/// Commit -> `PUBLISHED` latency (histogram, seconds; label `destination`).
pub const PUBLISH_LATENCY: &str = "sealpost_publish_latency_seconds";
/// Duplicate transport receipts (counter; labels `destination`, `kind` = `same_position` |
/// `second_copy`).
pub const DUPLICATE_RECEIPTS: &str = "sealpost_duplicate_receipts_total";
/// Receipts quarantined at the acceptance point (counter; labels `destination`, `reason`).
pub const RECEIPTS_QUARANTINED: &str = "sealpost_receipts_quarantined_total";
/// Receipts rejected and audited (counter; label `reason`).
pub const RECEIPTS_REJECTED: &str = "sealpost_receipts_rejected_total";
/// Sends that did not end in a receipt (counter; labels `destination`, `outcome` =
/// `ack_timeout` | `never_sent` | `refused`). `refused` are the broker's refusals.
pub const SEND_OUTCOMES: &str = "sealpost_send_outcomes_total";
/// Rows quarantined as poison (refused `rejection_limit` times; counter; label `destination`).
pub const POISON_QUARANTINED: &str = "sealpost_poison_quarantined_total";
/// Rows per claim transaction (histogram).
pub const CLAIM_BATCH_ROWS: &str = "sealpost_claim_batch_rows";
/// Claim transaction time (histogram, seconds).
pub const CLAIM_DURATION: &str = "sealpost_claim_duration_seconds";
/// Submission (acceptance point + outcome reports) transaction time (histogram, seconds;
/// label `result` = `ok` | `error`).
pub const ACCEPT_DURATION: &str = "sealpost_accept_duration_seconds";
/// `SENDING` rows past their lease moved to `DISPATCH_UNKNOWN` by a claim scan (counter).
pub const EXPIRED_TO_UNKNOWN: &str = "sealpost_expired_to_unknown_total";
/// Broker lookups (counter; labels `pass` = `unknown` | `verify`, `outcome` = `found` |
/// `absent` | `unqueryable` | `unavailable`).
pub const LOOKUPS: &str = "sealpost_lookups_total";
/// Reconciler decisions (counter; label `decision` = `accept` | `retry_same_destination` |
/// `stay_unknown` | `conflict` | `fenced`).
pub const RECONCILE_DECISIONS: &str = "sealpost_reconcile_decisions_total";
/// "Published but missing at the broker" findings of the verification pass (counter, R31).
pub const MISSING_FOUND: &str = "sealpost_missing_at_broker_found_total";
/// Unknown-age alerts raised by the reconciler (counter).
pub const UNKNOWN_ALERTS: &str = "sealpost_unknown_alerts_total";

/// Rows per state (gauge; label `state`), from [`store::status`].
pub const ROWS: &str = "sealpost_rows";
/// Age of the oldest `PENDING` row (gauge, seconds), from [`store::status`].
pub const OLDEST_PENDING_AGE: &str = "sealpost_oldest_pending_age_seconds";
/// Rows the CDC publisher offered to claims (counter; label `claimed` = `sent` | `not_sent`).
pub const CDC_OFFERED: &str = "sealpost_cdc_offered_rows_total";
/// Rows the CDC publisher's window holds unsettled (gauge).
pub const CDC_WINDOW_ROWS: &str = "sealpost_cdc_window_rows";
/// Bytes the CDC publisher's window holds (gauge).
pub const CDC_WINDOW_BYTES: &str = "sealpost_cdc_window_bytes";
/// Log bytes between what the CDC publisher received and what it confirmed (gauge).
pub const CDC_UNCONFIRMED_BYTES: &str = "sealpost_cdc_unconfirmed_bytes";
/// Rows in `DISPATCH_UNKNOWN` or `RECONCILING` (gauge), from [`store::status`].
pub const UNKNOWN_ROWS: &str = "sealpost_unknown_rows";
/// Age of the oldest unknown row (gauge, seconds), from [`store::status`].
pub const OLDEST_UNKNOWN_AGE: &str = "sealpost_oldest_unknown_age_seconds";
/// Quarantine entries: contradicting receipts, poison, conflicts (gauge), from
/// [`store::status`] (its `quarantined`).
pub const QUARANTINED: &str = "sealpost_quarantined";
/// Open "published but missing at the broker" findings (gauge), from [`store::status`].
pub const MISSING_AT_BROKER: &str = "sealpost_missing_at_broker";
/// Delivery sets by the core's verdict (gauge; label `status` = `complete` | `in_progress` |
/// `blocked`), from [`store::status`] (its `sets`).
pub const DELIVERY_SETS: &str = "sealpost_delivery_sets";
/// A shadow's divergences nobody explained yet (gauge; labels `route`, `candidate`), from
/// [`store::status`] (its `rollout.shadows`): promotion is refused while it is above zero.
pub const SHADOW_UNEXPLAINED: &str = "sealpost_shadow_unexplained_divergences";
/// Messages a shadow compared (gauge; labels `route`, `candidate`, `result` = `matched` |
/// `diverged`), from the same.
pub const SHADOW_COMPARED: &str = "sealpost_shadow_compared";
/// Status samples taken (counter; label `result` = `ok` | `error`).
pub const STATUS_SAMPLES: &str = "sealpost_status_samples_total";

/// Rows a purge would remove now (gauge), from `sealpost purge --dry-run`'s decision.
pub const PURGE_ELIGIBLE: &str = "sealpost_purge_eligible_rows";
/// Published rows a purge keeps (gauge; label `reason` = `replay_window` |
/// `consumer_behind` | `not_published` | `cdc_position`).
pub const PURGE_HELD: &str = "sealpost_purge_held_rows";
/// Purge backlog samples taken (counter; label `result`).
pub const PURGE_SAMPLES: &str = "sealpost_purge_samples_total";

/// Messages a consumer handled (counter; labels `consumer`, `outcome` = `applied` |
/// `duplicate` | `quarantined` | `failed`).
pub const CONSUMER_MESSAGES: &str = "sealpost_consumer_messages_total";
/// Messages the broker holds for a consumer that it has not acked (gauge; label `consumer`):
/// pending delivery plus delivered and unacknowledged.
pub const CONSUMER_LAG: &str = "sealpost_consumer_lag_messages";

/// Histogram buckets for [`PUBLISH_LATENCY`] (seconds): 1 ms to 15 min (G3's bound).
pub const LATENCY_BUCKETS_S: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    300.0, 900.0,
];
/// Histogram buckets for the transaction durations (seconds).
pub const DURATION_BUCKETS_S: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];
/// Histogram buckets for [`CLAIM_BATCH_ROWS`].
pub const BATCH_BUCKETS: &[f64] = &[0.0, 1.0, 10.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 10000.0];

/// Distinct values one label keeps per process before folding the rest into [`OTHER`].
pub const LABEL_VALUES_MAX: usize = 32;
/// The value every label value past the cap is folded into.
pub const OTHER: &str = "other";

/// A bounded set of label values: the first `max` distinct values pass, later ones become
/// [`OTHER`]. A value once admitted stays admitted.
#[derive(Debug)]
pub struct LabelCap {
    max: usize,
    seen: Mutex<HashSet<String>>,
}

impl LabelCap {
    /// A cap of `max` distinct values.
    pub fn new(max: usize) -> LabelCap {
        LabelCap {
            max,
            seen: Mutex::new(HashSet::new()),
        }
    }

    /// The label value to use for `value`.
    pub fn label(&self, value: &str) -> String {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if seen.contains(value) {
            return value.to_string();
        }
        if seen.len() < self.max {
            seen.insert(value.to_string());
            return value.to_string();
        }
        OTHER.to_string()
    }
}

/// The process-wide cap of `destination` label values.
pub fn destinations() -> &'static LabelCap {
    static CAP: OnceLock<LabelCap> = OnceLock::new();
    CAP.get_or_init(|| LabelCap::new(LABEL_VALUES_MAX))
}

/// The process-wide cap of `consumer` label values.
pub fn consumers() -> &'static LabelCap {
    static CAP: OnceLock<LabelCap> = OnceLock::new();
    CAP.get_or_init(|| LabelCap::new(LABEL_VALUES_MAX))
}

/// Records one accepted primary receipt.
pub fn record_published(p: &Published) {
    histogram!(PUBLISH_LATENCY, "destination" => destinations().label(&p.topic))
        .record(p.latency_ms as f64 / 1000.0);
}

/// Records what one committed submission did: publications with their latency, duplicate,
/// quarantined and rejected receipts, send outcomes and poison.
pub fn record_submitted(done: &Submitted, sub: &Submission) {
    for p in &done.published {
        record_published(p);
    }
    for (a, r) in done.accepted.iter().zip(&sub.receipts) {
        let dest = || destinations().label(&r.stream);
        match a {
            Accepted::Verdict(ReceiptVerdict::Duplicate(k)) => {
                let kind = match k {
                    DuplicateKind::SamePosition => "same_position",
                    DuplicateKind::SecondCopy => "second_copy",
                };
                counter!(DUPLICATE_RECEIPTS, "destination" => dest(), "kind" => kind).increment(1);
            }
            Accepted::Verdict(ReceiptVerdict::Quarantine(q)) => {
                counter!(RECEIPTS_QUARANTINED, "destination" => dest(), "reason" => format!("{q:?}"))
                    .increment(1);
            }
            Accepted::Verdict(ReceiptVerdict::Reject(why)) => {
                let reason = match why {
                    sealpost_core::RejectReason::NotInFlight(_) => "NotInFlight".to_string(),
                    other => format!("{other:?}"),
                };
                counter!(RECEIPTS_REJECTED, "reason" => reason).increment(1);
            }
            Accepted::UnknownEvent => {
                counter!(RECEIPTS_REJECTED, "reason" => "UnknownEvent").increment(1);
            }
            Accepted::Verdict(ReceiptVerdict::Primary) => {}
        }
    }
    for (i, r) in sub.reports.iter().enumerate() {
        let topic = done.report_topics.get(i).map_or("", String::as_str);
        let dest = destinations().label(topic);
        let outcome = match r.outcome {
            SendOutcome::AckTimeout => "ack_timeout",
            SendOutcome::NeverSent => "never_sent",
            SendOutcome::Rejected => "refused",
        };
        counter!(SEND_OUTCOMES, "destination" => dest.clone(), "outcome" => outcome).increment(1);
        if done.reported.get(i) == Some(&sealpost_core::SendOutcomeDecision::ToQuarantine) {
            counter!(POISON_QUARANTINED, "destination" => dest).increment(1);
        }
    }
}

/// Records one claim transaction: rows authorised to send, rows moved to unknown, its time.
pub fn record_claim(rows: usize, expired_to_unknown: usize, took: Duration) {
    histogram!(CLAIM_BATCH_ROWS).record(rows as f64);
    histogram!(CLAIM_DURATION).record(took.as_secs_f64());
    if expired_to_unknown > 0 {
        counter!(EXPIRED_TO_UNKNOWN).increment(expired_to_unknown as u64);
    }
}

/// Records one claim of rows the CDC publisher's log named.
pub fn record_cdc_claim(offered: usize, sent: usize) {
    counter!(CDC_OFFERED, "claimed" => "sent").increment(sent as u64);
    counter!(CDC_OFFERED, "claimed" => "not_sent").increment(offered.saturating_sub(sent) as u64);
}

/// Records the CDC publisher's window.
pub fn record_cdc_window(f: &sealpost_core::cdc::WindowFigures) {
    gauge!(CDC_WINDOW_ROWS).set(f.unsettled as f64);
    gauge!(CDC_WINDOW_BYTES).set(f.bytes as f64);
    gauge!(CDC_UNCONFIRMED_BYTES).set(f.received_lsn.saturating_sub(f.confirmed_lsn) as f64);
}

/// Records one submission transaction's time.
pub fn record_accept_duration(took: Duration, ok: bool) {
    histogram!(ACCEPT_DURATION, "result" => if ok { "ok" } else { "error" })
        .record(took.as_secs_f64());
}

/// Records one broker lookup (`pass`: `unknown` or `verify`).
pub fn record_lookup(pass: &'static str, l: &Lookup) {
    let outcome = match l {
        Lookup::Found(_) => "found",
        Lookup::Unsealed { .. } => "unsealed",
        Lookup::Copies(_) => "unjudged",
        Lookup::Absent => "absent",
        Lookup::Unqueryable => "unqueryable",
        Lookup::Unavailable => "unavailable",
    };
    counter!(LOOKUPS, "pass" => pass, "outcome" => outcome).increment(1);
}

/// Records one reconciler decision and, when it published the row, its latency.
pub fn record_reconciled(d: &ReconcileDecision, published: Option<&Published>) {
    let decision = match d {
        ReconcileDecision::Accept(_) => "accept",
        ReconcileDecision::RetrySameDestination { .. } => "retry_same_destination",
        ReconcileDecision::StayUnknown => "stay_unknown",
        ReconcileDecision::Conflict(_) => "conflict",
        ReconcileDecision::Fenced(_) => "fenced",
    };
    counter!(RECONCILE_DECISIONS, "decision" => decision).increment(1);
    if let Some(p) = published {
        record_published(p);
    }
}

/// Records a "published but missing at the broker" finding.
pub fn record_missing_found() {
    counter!(MISSING_FOUND).increment(1);
}

/// Records an unknown-age alert.
pub fn record_unknown_alert() {
    counter!(UNKNOWN_ALERTS).increment(1);
}

/// Sets the table-state gauges from a [`Status`] (the figures `sealpost status` prints).
pub fn record_status(s: &Status) {
    for (state, n) in &s.states {
        gauge!(ROWS, "state" => state.clone()).set(*n as f64);
    }
    gauge!(OLDEST_PENDING_AGE).set(s.oldest_pending_s);
    gauge!(UNKNOWN_ROWS).set(s.unknown as f64);
    gauge!(OLDEST_UNKNOWN_AGE).set(s.oldest_unknown_s);
    gauge!(QUARANTINED).set(s.quarantined as f64);
    gauge!(MISSING_AT_BROKER).set(s.missing_at_broker as f64);
    for (status, n) in [
        ("complete", s.sets.complete),
        ("in_progress", s.sets.in_progress),
        ("blocked", s.sets.blocked),
    ] {
        gauge!(DELIVERY_SETS, "status" => status).set(n as f64);
    }
    for sh in &s.rollout.shadows {
        let (route, candidate) = (sh.route.clone(), sh.candidate.clone());
        gauge!(SHADOW_UNEXPLAINED, "route" => route.clone(), "candidate" => candidate.clone())
            .set(sh.unexplained as f64);
        for (result, n) in [("matched", sh.matched), ("diverged", sh.diverged)] {
            gauge!(SHADOW_COMPARED, "route" => route.clone(), "candidate" => candidate.clone(), "result" => result)
                .set(n as f64);
        }
    }
}

/// Reads [`store::status`] once and sets the table-state gauges; a failed read counts as an
/// error sample and leaves the gauges as they were (a scrape then shows stale figures and a
/// growing error count, never zeros).
pub async fn sample_status(client: &impl tokio_postgres::GenericClient) -> store::Result<Status> {
    match store::status(client).await {
        Ok(s) => {
            record_status(&s);
            counter!(STATUS_SAMPLES, "result" => "ok").increment(1);
            Ok(s)
        }
        Err(e) => {
            counter!(STATUS_SAMPLES, "result" => "error").increment(1);
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_cap_folds_values_past_the_cap_into_other() {
        let cap = LabelCap::new(2);
        assert_eq!(cap.label("ORDERS"), "ORDERS");
        assert_eq!(cap.label("BILLING"), "BILLING");
        assert_eq!(cap.label("T-3"), OTHER);
        assert_eq!(cap.label("T-4"), OTHER);
        // Admitted values stay admitted; the cap never evicts.
        assert_eq!(cap.label("ORDERS"), "ORDERS");
        assert_eq!(cap.label("BILLING"), "BILLING");
    }

    #[test]
    fn label_cap_of_zero_folds_everything() {
        let cap = LabelCap::new(0);
        assert_eq!(cap.label("ORDERS"), OTHER);
    }
}
