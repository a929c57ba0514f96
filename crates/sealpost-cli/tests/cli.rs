//! The integration tests of the `sealpost` command, in one test binary: each file of this
//! folder is a module of it. One binary compiles and links the shared code once: as 34
//! binaries these tests took 1,293 s of compile time in `.ci/run`'s release test build on 2
//! cores (of 14.5 minutes), as one 218 s. And `cargo test` runs the tests of every file side
//! by side, two at a time, instead of one binary after the other.
//!
//! Each file keeps its own resources (databases, streams, topics, queues, processes), and a
//! file whose tests must not overlap holds its own `static` lock, as before. A test that stops
//! a service the others share belongs in `exclusive.rs`, which `cargo test` runs alone. One
//! file's tests: `cargo test --release -p sealpost-cli --test cli -- kafka::`.

// Shared helpers, one copy for every module (`use crate::common;` in each file).
#[path = "support/chaos.rs"]
mod chaos;
#[path = "../../sealpost/tests/common/cluster.rs"]
mod cluster;
#[path = "../../sealpost/tests/common/mod.rs"]
mod common;
#[path = "support/process_drill.rs"]
mod process_drill;
#[path = "support/rollout.rs"]
mod rollout_support;
#[path = "../../sealpost/tests/common/teardown_kafka.rs"]
mod teardown_kafka;
#[path = "../../sealpost/tests/common/teardown_nats.rs"]
mod teardown_nats;
#[path = "../../sealpost/tests/common/teardown_rabbitmq.rs"]
mod teardown_rabbitmq;

mod bench;
mod broker_drills;
mod capacity;
mod cdc;
mod consume_batch;
mod consumer_api;
mod consumer_drills;
mod consumers;
mod contracts;
mod delivery_sets;
mod docs;
mod erasure;
mod external_effects;
mod failover;
mod forgery;
mod grants;
mod hostile;
mod injected;
mod kafka;
mod leases;
mod loops;
mod metrics;
mod network;
mod ordering;
mod pg_nats;
mod processes;
mod rabbitmq;
mod rabbitmq_failover;
mod retention;
mod roles;
mod rollout;
mod secrets;
mod upgrade;
mod upgrade_drill;
mod upgrade_lease;
mod web;
