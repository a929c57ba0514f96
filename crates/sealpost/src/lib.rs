//! Sealpost: the PostgreSQL store, the NATS JetStream adapter, dispatcher and reconciler
//! loops and the operator tools around `sealpost-core`.

pub mod bench;
pub mod demo;
pub mod inbox;
pub mod nats;
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
