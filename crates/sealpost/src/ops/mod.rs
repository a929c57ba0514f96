//! Operator functions a service can call without the CLI: the reconciliation report
//! (R19, R31), retention and purge (R20, R34) and the causal trace (R22). `sealpost
//! reconcile`, `purge` and `trace` and the status page are thin wrappers over these.

pub mod reconcile;
pub mod retention;
pub mod trace;

pub use reconcile::{reconcile, Finding, NoScan, ReconcileOptions, ReconcileReport};
pub use retention::{purge, reason_key, PurgeError, PurgeOptions, PurgeReport};
pub use trace::{trace, trace_bounded};
