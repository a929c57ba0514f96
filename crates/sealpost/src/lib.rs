//! Sealpost, the library a service depends on: the PostgreSQL store (`enqueue` in the
//! caller's transaction and every protocol step as a short transaction), the consumer inbox,
//! and the dispatcher and reconciler loops around `sealpost-core`, generic over a broker
//! adapter ([`sealpost_core::port::Broker`], e.g. `sealpost-nats`). It knows no broker
//! client and no command line: the `sealpost` binary is the `sealpost-cli` crate.

pub mod cdc;
pub mod consumer;
pub mod contract;
pub mod inbox;
pub mod observe;
pub mod ops;
pub mod payload_key;
pub mod pg;
pub mod roles;
pub mod runtime;
pub mod secret;
pub mod signing;
#[cfg(feature = "sqlx")]
pub mod sqlx_store;
pub mod store;
pub mod tls;
