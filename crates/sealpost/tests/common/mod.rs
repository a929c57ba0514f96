//! Test support shared by the integration tests of `sealpost` and of `sealpost-cli` (which
//! include this file by path). `teardown.rs` is the guard that removes what a test made
//! when the test ends, passed or failed; `teardown_nats.rs`, `teardown_rabbitmq.rs` and
//! `teardown_kafka.rs` are its broker flavours, included by path where the client is.

#![allow(dead_code)]

pub mod teardown;

use std::ops::{Deref, DerefMut};

use sealpost::runtime::{self, Config};
use teardown::Teardown;

/// The loops' connections to the test's database (`cfg.database_url`).
pub fn pg_source(cfg: &Config) -> std::sync::Arc<dyn sealpost::pg::PgSource> {
    std::sync::Arc::new(sealpost::pg::PgConnector::from_config(cfg))
}

/// The NATS server the tests use: `NATS_URL`, as `sealpost_nats::NatsConfig::from_env`
/// reads it, or the machine's.
pub fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// The NATS cluster identity of the tests' routes (the adapter's default).
pub const NATS_CLUSTER: &str = "nats-local";

/// The RabbitMQ broker the tests use: `RABBITMQ_URL` or the machine's.
pub fn rabbitmq_url() -> String {
    std::env::var("RABBITMQ_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// The RabbitMQ cluster identity of the tests' routes (the adapter's default).
pub const RABBITMQ_CLUSTER: &str = "rabbitmq-local";

/// The Kafka bootstrap servers the tests use: `KAFKA_BROKERS` or the local tansu.
pub fn kafka_brokers() -> String {
    std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

/// The librdkafka properties the tests' clients need (`KAFKA_CLIENT_PROPERTIES`; .ci/run sets
/// tansu's).
pub fn kafka_client_properties() -> String {
    std::env::var("KAFKA_CLIENT_PROPERTIES").unwrap_or_default()
}

/// The Kafka cluster identity of the tests' routes (the adapter's default).
pub const KAFKA_CLUSTER: &str = "kafka-local";

/// The maintenance database the test databases are created from and dropped through.
pub const ADMIN_URL: &str = "host=127.0.0.1 user=postgres dbname=postgres";

/// A test's own database and the runtime `Config` pointed at it (`Deref`s to the `Config`).
/// Dropping it drops the database (`WITH (FORCE)`, so connections still open do not keep it),
/// also when the test panics.
pub struct TestDb {
    cfg: Config,
    name: String,
    drop: Teardown,
}

impl TestDb {
    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The `Config` alone (a copy); the database stays until `self` drops.
    pub fn config(&self) -> Config {
        self.cfg.clone()
    }

    /// Drops the database now and reports a failure (instead of at the end of the scope).
    pub fn drop_now(mut self) -> Result<(), String> {
        self.drop.run_now()
    }
}

impl Deref for TestDb {
    type Target = Config;
    fn deref(&self) -> &Config {
        &self.cfg
    }
}

impl DerefMut for TestDb {
    fn deref_mut(&mut self) -> &mut Config {
        &mut self.cfg
    }
}

/// A guard that drops database `name` when it drops (absent already is fine).
pub fn drop_database_guard(name: &str) -> Teardown {
    let db = name.to_string();
    Teardown::new(format!("database {db}"), move || async move {
        let admin = runtime::pg_connect(ADMIN_URL)
            .await
            .map_err(|e| format!("cannot connect: {e}"))?;
        admin
            .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
            .await
            .map_err(|e| e.to_string())
    })
}

/// The default configuration pointed at a database of the test's own, `name`, made afresh
/// (a leftover of a killed run is dropped first) and dropped again when the returned guard
/// drops: tests never truncate or read the machine's shared `test` database, and leave no
/// database behind.
pub async fn fresh_database(name: &str) -> TestDb {
    let admin = runtime::pg_connect(ADMIN_URL)
        .await
        .expect("PostgreSQL must be running");
    // Two statements: neither may run inside an (implicit) transaction block.
    admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .await
        .expect("drop the test database");
    admin
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .expect("create the test database");
    let drop = drop_database_guard(name);
    let mut cfg = Config::from_env().expect("default config");
    cfg.database_url = format!("host=127.0.0.1 user=postgres dbname={name}");
    TestDb {
        cfg,
        name: name.to_string(),
        drop,
    }
}
