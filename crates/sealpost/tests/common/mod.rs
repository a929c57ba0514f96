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

/// Polls `f` every 200 ms until it holds; fails the test naming `what` after `limit`.
pub async fn wait_for(what: &str, limit: std::time::Duration, mut f: impl AsyncFnMut() -> bool) {
    let deadline = std::time::Instant::now() + limit;
    while !f().await {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// The single `int8` a counting query answers.
pub async fn count(pg: &tokio_postgres::Client, sql: &str) -> i64 {
    pg.query_one(sql, &[]).await.unwrap().get(0)
}

/// Publishes `n` claimable rows as a dispatcher does (claim, sign when a `signer` is given,
/// send, accept); every answer must be a receipt. Returns the requests as they were sent.
pub async fn publish_claimed<B: sealpost_core::port::Broker>(
    pg: &mut tokio_postgres::Client,
    broker: &B,
    n: usize,
    signer: Option<&sealpost::signing::Signer>,
) -> Vec<sealpost_core::port::SendRequest> {
    let claimed = sealpost::store::claim_batch(pg, 77, n, 10_000)
        .await
        .unwrap();
    assert_eq!(claimed.outgoing.len(), n, "rows claimed");
    let batch: Vec<_> = claimed
        .outgoing
        .iter()
        .map(|o| {
            let mut r = o.send_request();
            if let Some(s) = signer {
                s.sign_request(&mut r);
            }
            r
        })
        .collect();
    let receipts: Vec<_> = broker
        .send_batch(
            batch.clone(),
            std::time::Instant::now() + std::time::Duration::from_secs(30),
        )
        .await
        .into_iter()
        .map(|r| match r {
            sealpost_core::port::SendResult::Receipt(r) => r,
            other => panic!("a receipt, got {other:?}"),
        })
        .collect();
    sealpost::store::accept_receipts(pg, &receipts)
        .await
        .unwrap();
    batch
}

/// A directory of a test's signing keys, removed when dropped.
pub struct KeyDir(pub std::path::PathBuf);

impl Drop for KeyDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Makes a new Ed25519 key `k1` in a directory `name` of the temp dir and points `cfg` at
/// it: its dispatchers sign with it, its readers verify with it (and so require
/// signatures). The keys are loaded into `cfg`.
pub fn signing_keys(cfg: &mut Config, name: &str) -> KeyDir {
    let keys = KeyDir(std::env::temp_dir().join(name));
    let _ = std::fs::remove_dir_all(&keys.0);
    std::fs::create_dir_all(&keys.0).unwrap();
    let (private, _) = sealpost::signing::generate(&keys.0, "k1").unwrap();
    cfg.signing_key_file = private.display().to_string();
    cfg.verify_keys_dir = keys.0.display().to_string();
    cfg.load_keys().expect("the keys just written");
    keys
}
