//! The PostgreSQL roles shipped with the schema (issue 23, item 1), against the real
//! PostgreSQL and NATS: `sealpost migrate --role-prefix P --grant KIND=LOGIN` creates the six
//! NOLOGIN roles and maps a login to each; then every command runs under its own login. The
//! allowed path works (a producer enqueues, a dispatcher login publishes through NATS, a
//! consumer login applies and reports its own watermark, the operator purges through the
//! audited erase, the reader reads `status` and `trace`), and every forbidden statement fails
//! with SQLSTATE 42501, which Sealpost reports as `StoreError::Permission` naming the login,
//! its Sealpost role and the grant it lacks. Each test has its own database, its own role
//! prefix (roles are cluster-wide) and its own logins, all dropped when it ends.

use crate::common;
use crate::teardown_nats;

use common::wait_for;
use std::process::Command;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use common::teardown::Teardown;
use sealpost::roles::Kind;
use sealpost::runtime::{self, CancellationToken, Counters};
use sealpost::store::{self, StoreError};
use sealpost_cli::ops;
use sealpost_core::envelope::EventId;
use sealpost_nats::Nats;

/// A database with the schema migrated under a prefix of its own, one login per role (the
/// dispatcher's also holds the reconciler role, as `sealpost dispatch` runs both), and the
/// guard that drops the database, the logins and the roles.
struct Env {
    // Drops first (fields drop in order): the database, then the logins and roles.
    _guard: Teardown,
    db: common::TestDb,
    prefix: String,
    tag: u64,
}

impl Env {
    fn login(&self, k: Kind) -> String {
        format!("sprl{}_{}_login", self.tag, k.name())
    }

    fn url(&self, login: &str) -> String {
        format!("host=127.0.0.1 user={login} dbname={}", self.db.name())
    }

    async fn connect(&self, k: Kind) -> tokio_postgres::Client {
        runtime::pg_connect(&self.url(&self.login(k)))
            .await
            .unwrap()
    }
}

fn sealpost(args: &[&str], database_url: &str) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_sealpost"))
        .args(args)
        .env("DATABASE_URL", database_url)
        .env_remove("SEALPOST_CONFIG")
        .env_remove("SEALPOST_ROLE_PREFIX")
        .output()
        .unwrap()
}

async fn setup(name: &str, route: &str, topic: &str) -> Env {
    let tag = runtime::owner_id() % 1_000_000_000;
    let prefix = format!("sprl{tag}_");
    let db = common::fresh_database(&format!("sealpost_roles_{name}_{tag}")).await;
    let logins: Vec<String> = Kind::ALL
        .iter()
        .map(|k| format!("sprl{tag}_{}_login", k.name()))
        .collect();
    let roles: Vec<String> = Kind::ALL
        .iter()
        .map(|k| format!("{prefix}{}", k.name()))
        .collect();
    let dbname = db.name().to_string();
    let guard = {
        let (logins, roles) = (logins.clone(), roles.clone());
        Teardown::new(
            format!("roles {prefix}* and their logins"),
            move || async move {
                let admin = runtime::pg_connect(common::ADMIN_URL)
                    .await
                    .map_err(|e| e.to_string())?;
                // The grants live in the database: drop it first, then the roles are free.
                admin
                    .batch_execute(&format!("DROP DATABASE IF EXISTS {dbname} WITH (FORCE)"))
                    .await
                    .map_err(|e| e.to_string())?;
                for r in logins.iter().chain(&roles) {
                    admin
                        .batch_execute(&format!("DROP ROLE IF EXISTS \"{r}\""))
                        .await
                        .map_err(|e| format!("role {r}: {e}"))?;
                }
                Ok(())
            },
        )
    };
    let admin = runtime::pg_connect(common::ADMIN_URL).await.unwrap();
    for l in &logins {
        admin
            .batch_execute(&format!("CREATE ROLE \"{l}\" LOGIN"))
            .await
            .unwrap();
    }
    let env = Env {
        _guard: guard,
        db,
        prefix,
        tag,
    };
    // The demo's business tables (the consumer's effect writes one): the application's own
    // grants, not Sealpost's.
    let owner = runtime::pg_connect(&env.db.database_url).await.unwrap();
    let route_arg = format!("{route}={}/{topic}", common::NATS_CLUSTER);
    let mut args = vec![
        "migrate".to_string(),
        "--role-prefix".into(),
        env.prefix.clone(),
        "--route".into(),
        route_arg,
    ];
    for k in Kind::ALL {
        args.push("--grant".into());
        args.push(match k {
            Kind::Consumer => format!("consumer={}:c-{tag}", env.login(k)),
            _ => format!("{}={}", k.name(), env.login(k)),
        });
    }
    // `sealpost dispatch` runs the reconciler too: its login holds both roles.
    args.push("--grant".into());
    args.push(format!("reconciler={}", env.login(Kind::Dispatcher)));
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = sealpost(&argv, &env.db.database_url);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(&format!(
            "granted {}consumer to {} (writes as consumer c-{tag})",
            env.prefix,
            env.login(Kind::Consumer)
        )),
        "{stdout}"
    );
    sealpost_cli::demo::prepare(&owner).await.unwrap();
    owner
        .batch_execute(&format!(
            "GRANT SELECT, INSERT ON demo_fulfilment TO \"{}\"",
            env.login(Kind::Consumer)
        ))
        .await
        .unwrap();
    env
}

/// The statement fails with SQLSTATE 42501.
async fn refused(pg: &tokio_postgres::Client, sql: &str) {
    match pg.batch_execute(sql).await {
        Ok(()) => panic!("`{sql}` was allowed"),
        Err(e) => assert_eq!(
            e.code(),
            Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE),
            "`{sql}`: {}",
            store::db_message(&e)
        ),
    }
}

/// A store error is the permission kind and, explained, names the login, its Sealpost role
/// and each of `needles` (the privilege and the role that holds it).
async fn permission(pg: &tokio_postgres::Client, e: StoreError, login: &str, needles: &[&str]) {
    assert!(
        matches!(e, StoreError::Permission { role: None, .. }),
        "not a permission error: {e:?}"
    );
    let e = sealpost::roles::explain(pg, e).await;
    let StoreError::Permission { role: Some(r), .. } = &e else {
        panic!("not explained: {e:?}");
    };
    assert!(r.contains(login), "{r}");
    let text = e.to_string();
    for n in ["SQLSTATE 42501", "--grant"].iter().chain(needles) {
        assert!(text.contains(n), "`{n}` missing from: {text}");
    }
}

async fn enqueue(pg: &mut tokio_postgres::Client, route: &str, n: usize) -> Vec<EventId> {
    let keys: Vec<String> = (0..n).map(|i| format!("o-{i}")).collect();
    let events = sealpost_cli::demo::order_batch(&keys, br#"{"order_id":"r"}"#);
    let tx = pg.transaction().await.unwrap();
    store::enqueue_many(&tx, route, &events).await.unwrap();
    tx.commit().await.unwrap();
    events.iter().map(|e| e.0).collect()
}

/// Every role through a whole life: enqueue as the producer, publish through NATS as the
/// dispatcher (with its reconciler), consume and report as the consumer, read as the reader,
/// purge as the operator; and at each step the statements the role must not run are refused
/// with 42501 and reported as a permission error naming the login and what it lacks.
#[tokio::test]
async fn each_role_does_its_job_and_is_refused_everything_else() {
    let topic = format!("ROLES{}", runtime::owner_id() % 1_000_000);
    let route = format!("r-{topic}");
    let env = setup("life", &route, &topic).await;
    let tag = env.tag;
    let _stream = teardown_nats::stream(&common::nats_url(), &topic);
    let nats = Nats::connect(
        &common::nats_url(),
        common::NATS_CLUSTER,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    nats.ensure_stream(&topic).await.unwrap();
    let login = |k| env.login(k);

    // The envelope is immutable for every role, and nobody but the owner edits the schema
    // or the route policy.
    for k in Kind::ALL {
        let pg = env.connect(k).await;
        refused(&pg, "UPDATE sealpost.envelope SET payload = '\\x00'::bytea").await;
        refused(&pg, "DELETE FROM sealpost.envelope").await;
        refused(&pg, "UPDATE sealpost.route_policy SET topic = 'elsewhere'").await;
        refused(&pg, "CREATE TABLE sealpost.x (a int)").await;
        refused(&pg, "TRUNCATE sealpost.work").await;
    }

    // Producer: enqueues; may not claim, read status, or touch work rows.
    let mut producer = env.connect(Kind::Producer).await;
    let n = 20;
    let ids = enqueue(&mut producer, &route, n).await;
    let e = store::claim_batch(&mut producer, 1, 10, 10_000)
        .await
        .unwrap_err();
    permission(
        &producer,
        e,
        &login(Kind::Producer),
        &[
            "Sealpost role producer",
            "EXECUTE on sealpost.rollout_aliases, which role dispatcher holds",
        ],
    )
    .await;
    let e = store::status(&producer).await.unwrap_err();
    permission(&producer, e, &login(Kind::Producer), &["SELECT"]).await;
    refused(&producer, "SELECT payload FROM sealpost.envelope").await;
    refused(&producer, "DELETE FROM sealpost.work").await;
    refused(
        &producer,
        "INSERT INTO sealpost.audit (what, detail, at_ms) VALUES ('x', 'y', 0)",
    )
    .await;

    // Reader: status, trace and the CLI's `status` work; no payload, no writes.
    let reader = env.connect(Kind::Reader).await;
    let s = store::status(&reader).await.unwrap();
    assert_eq!(s.states.get("PENDING"), Some(&(n as i64)), "{s:?}");
    let t = ops::trace(&reader, &ids[0].to_string()).await.unwrap();
    assert_eq!(t["found"], serde_json::Value::Bool(true), "{t}");
    let out = sealpost(&["status", "--json"], &env.url(&login(Kind::Reader)));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    refused(&reader, "SELECT payload FROM sealpost.envelope").await;
    refused(&reader, "SELECT payload FROM sealpost.outbox").await;
    refused(&reader, "UPDATE sealpost.work SET state = 'PENDING'").await;
    refused(
        &reader,
        "INSERT INTO sealpost.audit (what, detail, at_ms) VALUES ('x', 'y', 0)",
    )
    .await;
    let mut reader_mut = env.connect(Kind::Reader).await;
    let e = store::release_quarantine(&mut reader_mut, ids[0], "mallory", "no")
        .await
        .unwrap_err();
    permission(
        &reader_mut,
        e,
        &login(Kind::Reader),
        &[
            "Sealpost role reader",
            "UPDATE (held by dispatcher, operator, reconciler",
        ],
    )
    .await;
    // The CLI says the same, to a person: `release` as the reader, `status` as the producer.
    let out = sealpost(
        &["release", &ids[0].to_string(), "--operator", "mallory"],
        &env.url(&login(Kind::Reader)),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    for needle in [
        "permission denied",
        "SQLSTATE 42501",
        login(Kind::Reader).as_str(),
        "Sealpost role reader",
        "--grant operator=",
    ] {
        assert!(err.contains(needle), "`{needle}` missing from: {err}");
    }
    let out = sealpost(&["status"], &env.url(&login(Kind::Producer)));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("SQLSTATE 42501") && err.contains(&login(Kind::Producer)),
        "{err}"
    );

    // Dispatcher (+ reconciler): the real loops publish every row through NATS.
    let dispatcher = env.connect(Kind::Dispatcher).await;
    refused(
        &dispatcher,
        "INSERT INTO sealpost.envelope (event_id) VALUES (gen_random_uuid())",
    )
    .await;
    refused(&dispatcher, "DELETE FROM sealpost.audit").await;
    refused(&dispatcher, "SELECT * FROM sealpost.consumer_progress").await;
    refused(
        &dispatcher,
        "INSERT INTO sealpost.consumer_progress VALUES ('x', 's', 1, 0)",
    )
    .await;
    refused(
        &dispatcher,
        "SELECT sealpost.erase_payloads(ARRAY[gen_random_uuid()], ARRAY[0::int2])",
    )
    .await;
    let mut cfg = env.db.config();
    cfg.database_url = env.url(&login(Kind::Dispatcher));
    let stop = CancellationToken::new();
    let fleet = runtime::spawn_fleet(
        &cfg,
        &common::pg_source(&cfg),
        &Arc::new(nats.clone()),
        1,
        true,
        &stop,
        &Arc::new(Counters::default()),
    );
    wait_for(
        "every row published by the dispatcher login",
        Duration::from_secs(60),
        async || {
            store::status(&reader)
                .await
                .unwrap()
                .states
                .get("PUBLISHED")
                == Some(&(n as i64))
        },
    )
    .await;
    stop.cancel();
    for t in fleet {
        t.await.unwrap().unwrap();
    }

    // Consumer: applies the stream as its own consumer id and reports its watermark to the
    // outbox; it cannot write another consumer's watermark, progress, inbox or dead letter.
    let me = format!("c-{tag}");
    let other = format!("someone-else-{tag}");
    let mut ccfg = env.db.config();
    ccfg.database_url = env.url(&login(Kind::Consumer));
    ccfg.outbox_database_url = env.url(&login(Kind::Consumer));
    ccfg.consumer_progress_every_ms = 200;
    let cstop = CancellationToken::new();
    let consumer_task = tokio::spawn(sealpost_cli::consumer::run(
        ccfg,
        nats.clone(),
        me.clone(),
        topic.clone(),
        cstop.clone(),
        Arc::new(AtomicU64::new(0)),
    ));
    let consumer = env.connect(Kind::Consumer).await;
    wait_for(
        "the consumer login's progress report",
        Duration::from_secs(30),
        async || {
            reader
                .query_opt(
                    "SELECT watermark FROM sealpost.consumer_progress WHERE consumer_id = $1",
                    &[&me],
                )
                .await
                .unwrap()
                .is_some_and(|r| r.get::<_, i64>(0) == n as i64)
        },
    )
    .await;
    cstop.cancel();
    consumer_task.await.unwrap().unwrap();
    let applied: i64 = reader
        .query_one(
            "SELECT count(*) FROM sealpost.inbox WHERE consumer_id = $1",
            &[&me],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(applied, n as i64);
    // R20: the consumer login may not move another consumer's watermark (and so a purge
    // past rows that consumer never read).
    let e = sealpost::inbox::report_progress(&consumer, &other, &topic, 1_000_000)
        .await
        .unwrap_err();
    permission(
        &consumer,
        e,
        &login(Kind::Consumer),
        &["consumer_progress", "consumer="],
    )
    .await;
    sealpost::inbox::report_progress(&consumer, &me, &topic, n as u64)
        .await
        .unwrap();
    // The other consumer's existing row: invisible, and an upsert over it is refused.
    let owner = runtime::pg_connect(&env.db.database_url).await.unwrap();
    owner
        .execute(
            "INSERT INTO sealpost.consumer_progress VALUES ($1, $2, 3, 0)",
            &[&other, &topic],
        )
        .await
        .unwrap();
    let e = sealpost::inbox::report_progress(&consumer, &other, &topic, 1_000_000)
        .await
        .unwrap_err();
    assert!(matches!(e, StoreError::Permission { .. }), "{e:?}");
    let seen: i64 = consumer
        .query_one("SELECT count(*) FROM sealpost.consumer_progress", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(seen, 1, "a consumer sees its own progress rows only");
    let moved = consumer
        .execute(
            "UPDATE sealpost.consumer_progress SET watermark = 1000000 WHERE consumer_id = $1",
            &[&other],
        )
        .await
        .unwrap();
    assert_eq!(moved, 0, "another consumer's row is out of reach");
    let wm: i64 = owner
        .query_one(
            "SELECT watermark FROM sealpost.consumer_progress WHERE consumer_id = $1",
            &[&other],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(wm, 3);
    refused(
        &consumer,
        &format!("INSERT INTO sealpost.consumer_watermark VALUES ('{other}', 's', 9, 0)"),
    )
    .await;
    refused(
        &consumer,
        &format!(
            "INSERT INTO sealpost.inbox (consumer_id, event_id, member, payload_digest, stream, sequence)
             VALUES ('{other}', gen_random_uuid(), 0, '\\x00', 's', 1)"
        ),
    )
    .await;
    let e = sealpost::inbox::dead_letter(
        &consumer,
        &other,
        &[sealpost::inbox::DeadLetter {
            kind: sealpost::inbox::DeadLetterKind::Unreadable,
            event: None,
            stream: topic.clone(),
            sequence: 1,
            subject: "x".into(),
            delivered: 1,
            reason: "test".into(),
            payload: Vec::new(),
        }],
    )
    .await
    .unwrap_err();
    assert!(matches!(e, StoreError::Permission { .. }), "{e:?}");
    refused(&consumer, "SELECT count(*) FROM sealpost.envelope").await;
    refused(&consumer, "UPDATE sealpost.work SET state = 'PURGED'").await;

    // Operator: the erase function refuses rows that are not PURGED; a purge as the operator
    // erases payloads through it and records who asked.
    let mut operator = env.connect(Kind::Operator).await;
    refused(
        &operator,
        &format!(
            "SELECT sealpost.erase_payloads(ARRAY['{}'::uuid], ARRAY[0::int2])",
            ids[0]
        ),
    )
    .await;
    refused(&operator, "INSERT INTO sealpost.route_policy (name, generation, cluster, topic) VALUES ('x', 1, 'c', 't')").await;
    refused(
        &operator,
        "UPDATE sealpost.consumer_progress SET watermark = 0",
    )
    .await;
    // Release: a quarantined event (an extra, never dispatched) goes back to PENDING through
    // `sealpost release` as the operator, audited with the operator's name.
    let extra = enqueue(&mut producer, &route, 1).await[0];
    owner
        .execute(
            "UPDATE sealpost.work SET state = 'QUARANTINED', phase = 3 WHERE event_id = $1",
            &[&uuid::Uuid::from_bytes(extra.0)],
        )
        .await
        .unwrap();
    let out = sealpost(
        &[
            "release",
            &extra.to_string(),
            "--operator",
            "alice",
            "--reason",
            "test",
        ],
        &env.url(&login(Kind::Operator)),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let state: String = reader
        .query_one(
            "SELECT state FROM sealpost.outbox WHERE event_id = $1",
            &[&uuid::Uuid::from_bytes(extra.0)],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(state, "PENDING");
    let mut o = ops::PurgeOptions::new(std::slice::from_ref(&me), 1);
    o.stream = Some(topic.clone());
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let r = ops::purge(&mut operator, &o).await.unwrap();
    assert_eq!(r.purged, n as u64, "{r:?}");
    let (events, by): (i32, String) = {
        let row = reader
            .query_one(
                "SELECT sum(events)::int, string_agg(DISTINCT by_login::text, ',') FROM sealpost.erasure WHERE what = 'payload'",
                &[],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert_eq!(
        (events, by.as_str()),
        (n as i32, login(Kind::Operator).as_str())
    );
    let (rows, with_payload): (i64, i64) = {
        let row = owner
            .query_one(
                "SELECT count(*), count(*) FILTER (WHERE length(payload) > 0) FROM sealpost.envelope
                 WHERE event_id <> $1",
                &[&uuid::Uuid::from_bytes(extra.0)],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert_eq!(
        (rows, with_payload),
        (n as i64, 0),
        "tombstones without payloads"
    );
    // A replay window later the tombstones go, through the other audited function.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let r = ops::purge(&mut operator, &o).await.unwrap();
    assert_eq!(r.tombstones_removed, n as u64, "{r:?}");
    let removed: i64 = reader
        .query_one(
            "SELECT coalesce(sum(events), 0) FROM sealpost.erasure WHERE what = 'envelope'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(removed, n as i64);
}

/// Roles are cluster-wide: migrating a second database with the same prefix reuses them
/// (concurrently, too), a login that does not exist is refused with what to do, a prefix that
/// differs from the recorded one is refused, and a role that can log in is never taken over.
#[tokio::test]
async fn migrations_share_roles_safely_and_grants_say_what_is_wrong() {
    let env = setup("share", "r-share", "SHARE").await;
    let tag = env.tag;
    let names: Vec<String> = (0..3)
        .map(|i| format!("sealpost_roles_sh{i}_{tag}"))
        .collect();
    let mut dbs = Vec::new();
    for n in &names {
        dbs.push(common::fresh_database(n).await);
    }
    // Three databases migrate at once under the same prefix: one creates the roles, the
    // others reuse them; each gets its own grants.
    let mut tasks = Vec::new();
    for d in &dbs {
        let url = d.database_url.clone();
        let prefix = env.prefix.clone();
        tasks.push(tokio::spawn(async move {
            let pg = runtime::pg_connect(&url).await.unwrap();
            sealpost::roles::migrate(&pg, Some(&prefix)).await
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    for d in &dbs {
        let pg = runtime::pg_connect(&d.database_url).await.unwrap();
        assert_eq!(
            sealpost::roles::role_name(&pg, Kind::Reader).await.unwrap(),
            format!("{}reader", env.prefix)
        );
        let e = sealpost::roles::migrate(&pg, Some("sealpost_other_"))
            .await
            .unwrap_err();
        assert!(
            matches!(e, sealpost::roles::RoleError::OtherPrefix { .. }),
            "{e}"
        );
    }
    for d in dbs {
        d.drop_now().unwrap();
    }
    // A grant to a login that does not exist.
    let out = sealpost(
        &["migrate", "--grant", &format!("reader=nobody_{tag}")],
        &env.db.database_url,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("create the login first"), "{err}");
    let out = sealpost(&["migrate", "--grant", "janitor=x"], &env.db.database_url);
    assert_eq!(out.status.code(), Some(2));
    // A login role under a Sealpost role's name is not taken over.
    let admin = runtime::pg_connect(common::ADMIN_URL).await.unwrap();
    let squat = format!("sprq{tag}_");
    let _squat_guard = {
        let r = format!("{squat}producer");
        Teardown::new(format!("role {r}"), move || async move {
            let admin = runtime::pg_connect(common::ADMIN_URL)
                .await
                .map_err(|e| e.to_string())?;
            admin
                .batch_execute(&format!("DROP ROLE IF EXISTS \"{r}\""))
                .await
                .map_err(|e| e.to_string())
        })
    };
    admin
        .batch_execute(&format!("CREATE ROLE \"{squat}producer\" LOGIN"))
        .await
        .unwrap();
    let d = common::fresh_database(&format!("sealpost_roles_sq_{tag}")).await;
    let pg = runtime::pg_connect(&d.database_url).await.unwrap();
    let e = sealpost::roles::migrate(&pg, Some(&squat))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("can log in"), "{e}");
    assert_eq!(store::schema_version(&pg).await.unwrap(), 0, "rolled back");

    // A schema owner without CREATEROLE: the migration applies, granting nothing (a warning
    // says so); `--grant` says what a DBA must do; once the roles exist, `--grant` applies
    // the grants and maps the login.
    let plain = format!("sprn{tag}_");
    let owner_login = format!("sprn{tag}_owner");
    let reader_login = format!("sprn{tag}_reader_login");
    let dbname = format!("sealpost_roles_plain_{tag}");
    let _plain_guard = {
        let (dbname, plain, owner_login, reader_login) = (
            dbname.clone(),
            plain.clone(),
            owner_login.clone(),
            reader_login.clone(),
        );
        Teardown::new(format!("roles {plain}*"), move || async move {
            let admin = runtime::pg_connect(common::ADMIN_URL)
                .await
                .map_err(|e| e.to_string())?;
            admin
                .batch_execute(&format!("DROP DATABASE IF EXISTS {dbname} WITH (FORCE)"))
                .await
                .map_err(|e| e.to_string())?;
            let mut roles: Vec<String> = Kind::ALL
                .iter()
                .map(|k| format!("{plain}{}", k.name()))
                .collect();
            roles.extend([owner_login, reader_login]);
            for r in roles {
                admin
                    .batch_execute(&format!("DROP ROLE IF EXISTS \"{r}\""))
                    .await
                    .map_err(|e| format!("role {r}: {e}"))?;
            }
            Ok(())
        })
    };
    admin
        .batch_execute(&format!(
            "CREATE ROLE \"{owner_login}\" LOGIN; CREATE ROLE \"{reader_login}\" LOGIN"
        ))
        .await
        .unwrap();
    admin
        .batch_execute(&format!("CREATE DATABASE {dbname} OWNER \"{owner_login}\""))
        .await
        .unwrap();
    let owner_url = format!("host=127.0.0.1 user={owner_login} dbname={dbname}");
    let out = sealpost(&["migrate", "--role-prefix", &plain], &owner_url);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("do not exist") && err.contains("--grant"),
        "{err}"
    );
    let grant = format!("reader={reader_login}");
    let args = [
        "migrate",
        "--role-prefix",
        plain.as_str(),
        "--grant",
        grant.as_str(),
    ];
    let out = sealpost(&args, &owner_url);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("have a DBA create them"), "{err}");
    for k in Kind::ALL {
        admin
            .batch_execute(&format!("CREATE ROLE \"{plain}{}\" NOLOGIN", k.name()))
            .await
            .unwrap();
    }
    // Without ADMIN OPTION on a role the owner cannot hand it out: the error says so.
    let out = sealpost(&args, &owner_url);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("WITH ADMIN OPTION"), "{err}");
    for k in Kind::ALL {
        admin
            .batch_execute(&format!(
                "GRANT \"{plain}{}\" TO \"{owner_login}\" WITH ADMIN OPTION",
                k.name()
            ))
            .await
            .unwrap();
    }
    let out = sealpost(&args, &owner_url);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rd = runtime::pg_connect(&format!(
        "host=127.0.0.1 user={reader_login} dbname={dbname}"
    ))
    .await
    .unwrap();
    store::status(&rd).await.unwrap();
    refused(&rd, "DELETE FROM sealpost.work").await;
}

/// Payload keys (migration 7) live in a schema no role may use: the producer reaches them
/// only by enqueueing on a keyed route, the consumer only by reading keys, the operator only
/// by erasing; the reader, dispatcher and reconciler never.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payload_keys_are_reached_only_through_their_functions() {
    use sealpost::payload_key::{self, KeyState, Keying, Subject};
    let topic = format!("ROLESKEY{}", runtime::owner_id() % 1_000_000);
    let route = format!("r-{topic}");
    let env = setup("keys", &route, &topic).await;
    let owner = runtime::pg_connect(&env.db.database_url).await.unwrap();
    assert!(
        store::set_route_lifecycle(&owner, &route, Some(Keying::Aggregate), None)
            .await
            .unwrap()
    );
    let read_keys =
        "SELECT * FROM sealpost.subject_keys(ARRAY['aggregate'], ARRAY['order'], ARRAY['o-0'])";
    let erase = "SELECT sealpost.erase_subject('aggregate', 'order', 'o-0')";
    for k in Kind::ALL {
        let pg = env.connect(k).await;
        refused(&pg, "SELECT * FROM sealpost_key.subject_key").await;
        if k != Kind::Producer {
            refused(
                &pg,
                "SELECT sealpost.subject_key_for_enqueue('aggregate', 'order', 'x', '\\x00'::bytea)",
            )
            .await;
        }
        if k != Kind::Consumer {
            refused(&pg, read_keys).await;
        }
        if k != Kind::Operator {
            refused(&pg, erase).await;
        }
    }

    // The producer's enqueue on the keyed route makes the subjects' keys.
    let mut producer = env.connect(Kind::Producer).await;
    enqueue(&mut producer, &route, 2).await;
    let o0 = Subject::parse("order/o-0").unwrap();
    let consumer = env.connect(Kind::Consumer).await;
    let keys = payload_key::keys_of(&consumer, std::slice::from_ref(&o0))
        .await
        .unwrap();
    assert!(matches!(keys.get(&o0), Some(KeyState::Live(_))), "{keys:?}");

    // The operator erases with the binary; the erasure names the operator's login.
    let out = sealpost(
        &["erase", "order/o-0"],
        &env.url(&env.login(Kind::Operator)),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let keys = payload_key::keys_of(&consumer, std::slice::from_ref(&o0))
        .await
        .unwrap();
    assert!(
        matches!(keys.get(&o0), Some(KeyState::Erased { .. })),
        "{keys:?}"
    );
    let by: String = owner
        .query_one("SELECT by_login::text FROM sealpost.subject_erasure", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(by, env.login(Kind::Operator));
    // The reader erases nothing, and the CLI says which right it lacks.
    let out = sealpost(&["erase", "order/o-1"], &env.url(&env.login(Kind::Reader)));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("SQLSTATE 42501"), "{err}");
}

/// The login names with a connection to the test's database, among the test's logins.
async fn logins_connected(env: &Env) -> Vec<String> {
    let admin = runtime::pg_connect(common::ADMIN_URL).await.unwrap();
    admin
        .query(
            "SELECT DISTINCT usename::text FROM pg_stat_activity \
             WHERE datname = $1 AND usename::text LIKE $2 ORDER BY 1",
            &[&env.db.name(), &format!("sprl{}\\_%", env.tag)],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// `GET path` on the page with `token`: (status, body).
async fn page_get(port: u16, path: &str, token: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let req = format!(
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut out))
        .await
        .expect("an answer within 30 s")
        .unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {text:?}"));
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (status, body.to_string())
}

/// `sealpost serve` with DATABASE_URL the operator's login and SEALPOST_READER_DATABASE_URL
/// `reads`, on a free port.
fn page(env: &Env, reads: &str) -> (u16, std::process::Child) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new(env!("CARGO_BIN_EXE_sealpost"))
        .args([
            "serve",
            "--http",
            &format!("127.0.0.1:{port}"),
            "--sample-ms",
            "200",
        ])
        .env("DATABASE_URL", env.url(&env.login(Kind::Operator)))
        .env("SEALPOST_READER_DATABASE_URL", env.url(reads))
        .env("SEALPOST_READ_TOKEN", "roles-page-read-token-5Fq9")
        .env("SEALPOST_OPERATOR_TOKEN", "roles-page-operator-token-8Lw3")
        .env_remove("SEALPOST_CONFIG")
        .env_remove("SEALPOST_ROLE_PREFIX")
        .env_remove("SEALPOST_READER_DATABASE_PASSWORD_FILE")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start sealpost serve");
    (port, child)
}

/// The status page reads (its handlers and its sampler) as the reader's login given in
/// SEALPOST_READER_DATABASE_URL, and keeps DATABASE_URL (the operator's) for releases; a
/// reads login without the reader role is refused at start, naming the login and the grant.
#[tokio::test]
async fn the_page_reads_as_the_reader_login_and_refuses_a_login_without_the_role() {
    let topic = format!("ROLESPAGE{}", runtime::owner_id() % 1_000_000);
    let route = format!("r-{topic}");
    let env = setup("page", &route, &topic).await;
    let mut producer = env.connect(Kind::Producer).await;
    enqueue(&mut producer, &route, 2).await;
    drop(producer);

    let (port, child) = page(&env, &env.login(Kind::Reader));
    struct Killed(std::process::Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut child = Killed(child);
    wait_for("the page to listen", Duration::from_secs(30), async || {
        if let Ok(Some(status)) = child.0.try_wait() {
            let mut err = String::new();
            use std::io::Read;
            let _ = child.0.stderr.take().unwrap().read_to_string(&mut err);
            panic!("sealpost serve exited ({status}): {err}");
        }
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
    })
    .await;
    let (status, body) = page_get(port, "/api/status", "roles-page-read-token-5Fq9").await;
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["states"]["PENDING"], 2, "{body}");
    let reader = env.login(Kind::Reader);
    wait_for(
        "the sampler's and the reads' sessions",
        Duration::from_secs(10),
        async || logins_connected(&env).await == vec![reader.clone()],
    )
    .await;
    drop(child);

    // A login without the reader role: refused before the page listens, with the cause.
    let (_, child) = page(&env, &env.login(Kind::Producer));
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("the page's reads"), "{err}");
    assert!(err.contains("SQLSTATE 42501"), "{err}");
    assert!(err.contains(&env.login(Kind::Producer)), "{err}");
}

/// Delivery sets (migration 10) under the roles: the producer writes a set with its members
/// and may not read or change set rows; every other role reads it (the reader's status and
/// trace judge it); nobody but the owner updates or deletes one.
#[tokio::test]
async fn the_producer_writes_a_delivery_set_and_only_reads_follow() {
    let topic = format!("ROLESET{}", runtime::owner_id() % 1_000_000);
    let route = format!("r-{topic}");
    let env = setup("sets", &route, &topic).await;
    let owner = runtime::pg_connect(&env.db.database_url).await.unwrap();
    store::set_route(
        &owner,
        "audit",
        common::NATS_CLUSTER,
        &format!("{topic}AUDIT"),
    )
    .await
    .unwrap();
    let mut producer = env.connect(Kind::Producer).await;
    let id = sealpost_cli::demo::mint_event_id();
    let tx = producer.transaction().await.unwrap();
    store::enqueue_set(
        &tx,
        &[route.as_str(), "audit"],
        sealpost_core::delivery_set::CompletionRule::All,
        id,
        &sealpost_cli::demo::order_created("o-set", b"{}"),
        "o-set",
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    refused(&producer, "SELECT rule FROM sealpost.delivery_set").await;
    for k in Kind::ALL {
        let pg = env.connect(k).await;
        refused(&pg, "UPDATE sealpost.delivery_set SET rule = 'any'").await;
        refused(&pg, "DELETE FROM sealpost.delivery_set").await;
        if k != Kind::Producer {
            let n: i64 = pg
                .query_one("SELECT count(*) FROM sealpost.delivery_set", &[])
                .await
                .unwrap()
                .get(0);
            assert_eq!(n, 1, "{}", k.name());
        }
    }
    let reader = env.connect(Kind::Reader).await;
    let s = store::status(&reader).await.unwrap().sets;
    assert_eq!((s.total, s.in_progress), (1, 1), "{s:?}");
    let t = ops::trace(&reader, &id.to_string()).await.unwrap();
    assert_eq!(t["sets"][0]["status"], "in_progress", "{t}");
    assert_eq!(t["sets"][0]["members"][0]["route"], route.as_str(), "{t}");
}

#[tokio::test]
async fn the_operator_switches_an_alias_dispatchers_claim_under_it_and_shadow_and_nobody_else_writes_it(
) {
    use sealpost_core::rollout::{Divergence, DivergenceKind, Implementation};
    use store::RolloutCommand;
    let topic = format!("ROLEROLL{}", runtime::owner_id() % 1_000_000);
    let route = format!("r-{topic}");
    let env = setup("rollout", &route, &topic).await;
    let mut operator = env.connect(Kind::Operator).await;
    let shadow = RolloutCommand::Shadow {
        candidate: "v2".into(),
        incumbent: Some("v1".into()),
    };
    assert!(
        store::rollout(&mut operator, &route, &shadow)
            .await
            .unwrap()
            .changed
    );
    // The dispatcher announces itself and keeps its shadow's tally and divergences.
    let mut dispatcher = env.connect(Kind::Dispatcher).await;
    let v2 = Implementation::new("v2").unwrap();
    store::announce(
        &dispatcher,
        7,
        &v2,
        store::Role::Dispatcher,
        common::NATS_CLUSTER,
    )
    .await
    .unwrap();
    let cursor = store::shadow_cursor(&dispatcher, &route, "v2")
        .await
        .unwrap();
    let id = sealpost_cli::demo::mint_event_id();
    let compared = [(
        id,
        0,
        vec![Divergence {
            kind: DivergenceKind::Headers,
            incumbent: "a".into(),
            candidate: "b".into(),
        }],
    )];
    assert!(
        store::record_shadow(&mut dispatcher, &route, "v2", &compared, cursor, cursor)
            .await
            .unwrap()
    );
    let takeover = RolloutCommand::Takeover {
        candidate: "v2".into(),
        types: vec!["order.created.v1".into()],
        share: 100,
    };
    assert!(
        store::rollout(&mut operator, &route, &takeover)
            .await
            .unwrap()
            .changed
    );
    // Nobody else switches an alias, explains a divergence or writes the log.
    for k in [
        Kind::Producer,
        Kind::Dispatcher,
        Kind::Reconciler,
        Kind::Consumer,
        Kind::Reader,
    ] {
        let mut pg = env.connect(k).await;
        let e = store::rollout(&mut pg, &route, &RolloutCommand::Rollback)
            .await
            .unwrap_err();
        assert_eq!(e.kind(), store::ErrorKind::Permission, "{}: {e}", k.name());
        refused(&pg, "UPDATE sealpost.rollout SET stage = 'promoted'").await;
        refused(
            &pg,
            "UPDATE sealpost.shadow_divergence SET explanation = 'x'",
        )
        .await;
        refused(&pg, "DELETE FROM sealpost.rollout_log").await;
    }
    // The dispatcher claims under the alias (reading it through rollout_aliases, the only
    // way it may take the table's SHARE lock): v1 gets nothing of the taken-over type, v2
    // both events.
    let mut producer = env.connect(Kind::Producer).await;
    enqueue(&mut producer, &route, 2).await;
    refused(
        &dispatcher,
        "BEGIN; LOCK TABLE sealpost.rollout IN SHARE MODE",
    )
    .await;
    dispatcher.batch_execute("ROLLBACK").await.unwrap();
    let v1 = Implementation::new("v1").unwrap();
    for (imp, n) in [(&v1, 0), (&v2, 2)] {
        let b = store::claim(
            &mut dispatcher,
            &store::ClaimRequest::new(7, 10, 60_000).implementation(imp),
            None,
        )
        .await
        .unwrap();
        assert_eq!(b.outgoing.len(), n, "{}", imp.id);
    }
    // The operator explains it; the reader sees the whole rollout in the status.
    let n = store::explain_divergences(&operator, &route, "v2", None, "ops", "expected")
        .await
        .unwrap();
    assert_eq!(n, 1);
    let reader = env.connect(Kind::Reader).await;
    let r = store::status(&reader).await.unwrap().rollout;
    assert_eq!(r.aliases[0].alias.stage.name(), "takeover");
    assert_eq!((r.shadows[0].compared, r.shadows[0].unexplained), (1, 0));
    assert_eq!(r.implementations[0].implementation, "v2");
    assert_eq!(r.log.len(), 2);
}
