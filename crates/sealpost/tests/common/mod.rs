//! Test support shared by the integration tests of `sealpost` and of `sealpost-cli` (which
//! include this file by path).

use sealpost::runtime::{self, Config};

/// The default configuration pointed at a database of the test's own, `name`, dropped and
/// made afresh: tests never truncate or read the machine's shared `test` database, and a
/// failed run's rows are there to look at until the next run.
pub async fn fresh_database(name: &str) -> Config {
    let admin = runtime::pg_connect("host=127.0.0.1 user=postgres dbname=postgres")
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
    let mut cfg = Config::from_env().expect("default config");
    cfg.database_url = format!("host=127.0.0.1 user=postgres dbname={name}");
    cfg
}
