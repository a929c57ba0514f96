//! Sealpost: the PostgreSQL store, the NATS JetStream adapter, dispatcher and reconciler
//! loops and the operator tools around `sealpost-core`.

pub mod bench;
pub mod demo;
pub mod inbox;
pub mod nats;
pub mod ops;
pub mod runtime;
#[cfg(feature = "sqlx")]
pub mod sqlx_store;
pub mod store;

/// Prints a status table.
pub fn print_status(s: &store::Status) {
    println!("{:<18}{:>10}", "state", "rows");
    for (k, v) in &s.states {
        println!("{k:<18}{v:>10}");
    }
    println!("oldest PENDING    {:>9.1}s", s.oldest_pending_s);
    println!(
        "unknown           {:>10}  (oldest {:.1}s)",
        s.unknown, s.oldest_unknown_s
    );
    println!("quarantined       {:>10}", s.quarantined);
}

/// Prints a reconciliation report.
pub fn print_reconcile(r: &ops::ReconcileReport) {
    println!(
        "committed {}  published {}  stream messages scanned {}",
        r.committed, r.published, r.stream_messages_scanned
    );
    for (c, n) in &r.consumed {
        println!("consumer {c}: {n} consumption receipts");
    }
    if r.findings.is_empty() {
        println!("no findings");
    }
    for f in &r.findings {
        let who = f
            .consumer
            .as_deref()
            .map(|c| format!(" [{c}]"))
            .unwrap_or_default();
        println!(
            "FINDING {}{who}: {} (threshold {} s), e.g. {:?}",
            f.kind,
            f.count,
            f.threshold_s,
            f.event_ids.iter().take(3).collect::<Vec<_>>()
        );
    }
}
