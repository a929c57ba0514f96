//! No secret leaves Sealpost (issue 20), checked on the real processes: `sealpost dispatch`,
//! `consume`, `serve` and `status` are run with a database password (in a key=value string,
//! in a `postgres://` URL, and from `DATABASE_PASSWORD_FILE`) and an operator token (from
//! `--operator-token-file`) that the test knows, (a) against a port nobody listens on and
//! (b) against a real database whose role is then cut off mid-run (`ALTER ROLE ... NOLOGIN`
//! and its connections terminated). Every page and JSON endpoint of `serve`, every
//! `/metrics`, and every byte the processes write to stdout and stderr is collected; the
//! password and the token must appear nowhere, while the cause (connection refused, role not
//! permitted to log in) must. A dispatcher stopped while the database is down must exit.
//!
//! Uses PostgreSQL on 127.0.0.1:5432 (user postgres) and NATS on 127.0.0.1:4222. The role,
//! database and stream it creates are named `sealpost_secrets_*` / `SECRETS*` and are dropped
//! when the test ends, pass or fail (the [`Guard`]).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use sealpost::runtime;
use sealpost::store;
use sealpost_nats::async_nats::jetstream;
use sealpost_nats::Nats;

const ADMIN_URL: &str = "host=127.0.0.1 user=postgres dbname=postgres";
const NATS_URL: &str = "nats://127.0.0.1:4222";
/// The database password: distinctive, so that any appearance is a leak.
const PASSWORD: &str = "Sp-Secret-Pw-q7Xk2Lm9";
/// The operator token of `sealpost serve`.
const TOKEN: &str = "Sp-Operator-Tk-Z3v8Rw1";
/// The read token of `sealpost serve` (every `/api/*` asks for one).
const READ: &str = "Sp-Read-Tk-Q4n7Pz2Wx9";

static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// What the test made, undone when it ends, pass or fail: the processes are killed, the
/// database and the role dropped, the stream deleted, the directory removed.
struct Guard {
    dir: PathBuf,
    children: Vec<(String, Child)>,
    role: Option<String>,
    db: Option<String>,
    stream: Option<String>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        for (_, c) in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let (role, db, stream) = (self.role.clone(), self.db.clone(), self.stream.clone());
        // A runtime of its own: the test's runtime may be shutting down.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                if let Some(stream) = stream {
                    if let Ok(c) = sealpost_nats::async_nats::connect(NATS_URL).await {
                        let _ = jetstream::new(c).delete_stream(&stream).await;
                    }
                }
                if let Ok(admin) = runtime::pg_connect(ADMIN_URL).await {
                    if let Some(db) = db {
                        let _ = admin
                            .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
                            .await;
                    }
                    if let Some(role) = role {
                        let _ = admin
                            .batch_execute(&format!("DROP ROLE IF EXISTS {role}"))
                            .await;
                    }
                }
            });
        })
        .join();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Guard {
    fn new(tag: &str) -> Guard {
        let dir = std::env::temp_dir().join(format!(
            "sealpost-secrets-{tag}-{}-{}",
            std::process::id(),
            runtime::owner_id() % 1_000_000
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Guard {
            dir,
            children: Vec::new(),
            role: None,
            db: None,
            stream: None,
        }
    }

    /// A file in the test's directory holding `text`.
    fn file(&self, name: &str, text: &str) -> PathBuf {
        let p = self.dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    /// `sealpost ARGS` with a clean environment plus `env`, its stdout and stderr going to
    /// files named after `name`.
    fn command(&self, name: &str, args: &[String], env: &[(&str, String)]) -> Command {
        let out = std::fs::File::create(self.dir.join(format!("{name}.stdout"))).unwrap();
        let err = std::fs::File::create(self.dir.join(format!("{name}.stderr"))).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sealpost"));
        cmd.args(args)
            .env_remove("DATABASE_URL")
            .env_remove("DATABASE_PASSWORD_FILE")
            .env_remove("SEALPOST_OPERATOR_TOKEN")
            .env_remove("SEALPOST_OPERATOR_TOKEN_FILE")
            .env_remove("SEALPOST_CONFIG")
            .env("NATS_URL", NATS_URL)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err));
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd
    }

    fn spawn(&mut self, name: &str, args: &[String], env: &[(&str, String)]) {
        let child = self
            .command(name, args, env)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn sealpost {name}: {e}"));
        self.children.push((name.to_string(), child));
    }

    fn child(&mut self, name: &str) -> &mut Child {
        &mut self
            .children
            .iter_mut()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("no process {name}"))
            .1
    }

    /// Runs `sealpost ARGS` to its end (at most 60 s) and returns its exit status.
    fn run(&mut self, name: &str, args: &[String], env: &[(&str, String)]) -> Output {
        self.spawn(name, args, env);
        let status = wait_exit(self.child(name), Duration::from_secs(60))
            .unwrap_or_else(|| panic!("sealpost {name} still runs after 60 s"));
        Output {
            status,
            stdout: std::fs::read(self.dir.join(format!("{name}.stdout"))).unwrap(),
            stderr: std::fs::read(self.dir.join(format!("{name}.stderr"))).unwrap(),
        }
    }

    /// Everything every process wrote so far, by name.
    fn outputs(&self) -> Vec<(String, String)> {
        let mut all = Vec::new();
        for entry in std::fs::read_dir(&self.dir).unwrap() {
            let p = entry.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            if name.ends_with(".stdout") || name.ends_with(".stderr") {
                let bytes = std::fs::read(&p).unwrap();
                all.push((name, String::from_utf8_lossy(&bytes).into_owned()));
            }
        }
        all
    }
}

fn wait_exit(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let start = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        if start.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind a free port")
        .local_addr()
        .unwrap()
        .port()
}

fn wait_listening(what: &str, port: u16, child: &mut Child) {
    let start = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("{what} exited before listening on port {port}: {status}");
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{what} is not listening on port {port} after 30 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// One HTTP/1.1 exchange on a connection of its own: the whole response (status line,
/// headers and body) as text.
fn http(port: u16, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut req =
        format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    s.write_all(req.as_bytes()).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// Every page and endpoint of `sealpost serve` on `port`, as (what, response).
fn fetch_serve(port: u16) -> Vec<(String, String)> {
    let json = [("Content-Type", "application/json")];
    let bearer = format!("Bearer {TOKEN}");
    let with_token = [
        ("Content-Type", "application/json"),
        ("Authorization", bearer.as_str()),
    ];
    let wrong = [
        ("Content-Type", "application/json"),
        ("Authorization", "Bearer wrong-token"),
    ];
    let release = r#"{"event_id":"018f2c1e-0000-7000-8000-000000000001","reason":"secrets test","operator":"t"}"#;
    let mut got = Vec::new();
    let read = format!("Bearer {READ}");
    let reader = [("Authorization", read.as_str())];
    for path in [
        "/",
        "/api/status",
        "/api/history",
        "/api/findings",
        "/api/trace",
        "/api/trace?key=018f2c1e-0000-7000-8000-000000000001",
        "/api/trace?key=order/o-1",
        "/no-such-page",
    ] {
        got.push((format!("GET {path}"), http(port, "GET", path, &reader, "")));
    }
    for (what, headers) in [
        ("no token", &json[..]),
        ("wrong token", &wrong[..]),
        ("the token", &with_token[..]),
    ] {
        got.push((
            format!("POST /api/release ({what})"),
            http(port, "POST", "/api/release", headers, release),
        ));
    }
    got
}

/// Fails if the password or the token appears in any of `texts`.
#[track_caller]
fn assert_no_secret(texts: &[(String, String)]) {
    for (what, text) in texts {
        for secret in [PASSWORD, TOKEN, READ] {
            assert!(
                !text.contains(secret),
                "a secret leaked into {what}:\n{text}"
            );
        }
    }
}

/// Whether any of `texts` whose name starts with `prefix` contains `needle`.
fn any_has(texts: &[(String, String)], prefix: &str, needle: &str) -> bool {
    texts
        .iter()
        .any(|(what, text)| what.starts_with(prefix) && text.contains(needle))
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_port_shows_the_cause_and_never_the_password() {
    let _l = LOCK.lock().await;
    let mut g = Guard::new("closed");
    let port = free_port();
    let pw_file = g.file("db-password", &format!("{PASSWORD}\n"));
    let token_file = g.file("token", &format!("{TOKEN}\n"));
    let read_file = g.file("read-token", &format!("{READ}\n"));
    let read = read_file.display().to_string();
    let user = "sealpost_secrets_app";
    let forms: [(&str, String, Option<&PathBuf>); 3] = [
        (
            "kv",
            format!("host=127.0.0.1 port={port} user={user} password='{PASSWORD}' dbname=sealpost_secrets_none connect_timeout=5"),
            None,
        ),
        (
            "url",
            format!("postgres://{user}:{PASSWORD}@127.0.0.1:{port}/sealpost_secrets_none?sslmode=disable"),
            None,
        ),
        (
            "file",
            format!("host=127.0.0.1 port={port} user={user} dbname=sealpost_secrets_none"),
            Some(&pw_file),
        ),
    ];
    for (form, dsn, file) in &forms {
        let mut env = vec![("DATABASE_URL", dsn.clone())];
        if let Some(f) = file {
            env.push(("DATABASE_PASSWORD_FILE", f.display().to_string()));
        }
        let metrics = format!("127.0.0.1:{}", free_port());
        let http = format!("127.0.0.1:{}", free_port());
        let token = token_file.display().to_string();
        for (name, a) in [
            ("dispatch", args(&["dispatch", "--metrics-addr", &metrics])),
            (
                "consume",
                args(&[
                    "consume",
                    "--consumer",
                    "sealpost_secrets_c",
                    "--topic",
                    "SECRETSNONE",
                ]),
            ),
            (
                "serve",
                args(&[
                    "serve",
                    "--http",
                    &http,
                    "--operator-token-file",
                    &token,
                    "--read-token-file",
                    &read,
                ]),
            ),
            ("status", args(&["status"])),
        ] {
            let name = format!("{form}-{name}");
            let out = g.run(&name, &a, &env);
            assert!(
                !out.status.success(),
                "sealpost {name} succeeded without a database"
            );
        }
    }
    let outputs = g.outputs();
    assert_no_secret(&outputs);
    for (form, _, _) in &forms {
        for name in ["dispatch", "consume", "serve", "status"] {
            let what = format!("{form}-{name}.stderr");
            let text = &outputs.iter().find(|(w, _)| *w == what).unwrap().1;
            assert!(
                text.contains("cannot connect to PostgreSQL") && text.contains("refused"),
                "{what} does not name the cause:\n{text}"
            );
            // Still useful: the server and the user are there.
            assert!(
                text.contains(&format!("{port}")) && text.contains(user),
                "{what}:\n{text}"
            );
        }
    }
    // The key=value form shows where the password was.
    assert!(any_has(&outputs, "kv-status", "password=***"));
    assert!(any_has(
        &outputs,
        "url-status",
        &format!("{user}:***@127.0.0.1:{port}")
    ));

    // A secret file that cannot be read is named, with the key that named it.
    let missing = g.dir.join("no-such-file");
    let out = g.run(
        "missing-file-status",
        &args(&["status"]),
        &[
            ("DATABASE_URL", forms[2].1.clone()),
            ("DATABASE_PASSWORD_FILE", missing.display().to_string()),
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("database_password_file") && err.contains(&missing.display().to_string()),
        "{err}"
    );
    let out = g.run(
        "missing-token-serve",
        &args(&[
            "serve",
            "--http",
            &format!("127.0.0.1:{}", free_port()),
            "--operator-token-file",
            &missing.display().to_string(),
            "--read-token-file",
            &read,
        ]),
        &[("DATABASE_URL", forms[0].1.clone())],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("--operator-token-file") && err.contains(&missing.display().to_string()),
        "{err}"
    );
    assert_no_secret(&g.outputs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_cut_mid_run_shows_the_cause_and_never_the_password() {
    let _l = LOCK.lock().await;
    let mut g = Guard::new("cut");
    let n = runtime::owner_id() % 1_000_000_000;
    let role = format!("sealpost_secrets_r{n}");
    let db = format!("sealpost_secrets_d{n}");
    let topic = format!("SECRETS{n}");
    let admin = runtime::pg_connect(ADMIN_URL)
        .await
        .expect("PostgreSQL must be running");
    g.role = Some(role.clone());
    admin
        .batch_execute(&format!("CREATE ROLE {role} LOGIN PASSWORD '{PASSWORD}'"))
        .await
        .expect("create the role");
    g.db = Some(db.clone());
    admin
        .batch_execute(&format!("CREATE DATABASE {db} OWNER {role}"))
        .await
        .expect("create the database");
    let kv = format!("host=127.0.0.1 user={role} password='{PASSWORD}' dbname={db}");
    let url = format!("postgres://{role}:{PASSWORD}@127.0.0.1:5432/{db}?sslmode=disable");
    let without = format!("host=127.0.0.1 user={role} dbname={db}");
    {
        let pg = runtime::pg_connect(&kv).await.expect("connect as the role");
        store::migrate(&pg).await.expect("migrate");
        store::set_route(&pg, "orders", "nats-local", &topic)
            .await
            .expect("route");
    }
    g.stream = Some(topic.clone());
    let nats = Nats::connect(NATS_URL, "nats-local", Duration::from_secs(5))
        .await
        .expect("NATS must be running");
    nats.ensure_stream(&topic).await.expect("stream");
    let pw_file = g.file("db-password", &format!("{PASSWORD}\n"));
    let token_file = g.file("token", &format!("{TOKEN}\n"));
    let read_file = g.file("read-token", &format!("{READ}\n"));

    let (dispatch_metrics, consume_metrics, serve_port) = (free_port(), free_port(), free_port());
    g.spawn(
        "dispatch",
        &args(&[
            "dispatch",
            "--metrics-addr",
            &format!("127.0.0.1:{dispatch_metrics}"),
            "--metrics-every-s",
            "0.5",
        ]),
        &[("DATABASE_URL", kv.clone())],
    );
    g.spawn(
        "consume",
        &args(&[
            "consume",
            "--consumer",
            "sealpost_secrets_c",
            "--topic",
            &topic,
            "--metrics-addr",
            &format!("127.0.0.1:{consume_metrics}"),
        ]),
        &[("DATABASE_URL", url.clone())],
    );
    g.spawn(
        "serve",
        &args(&[
            "serve",
            "--http",
            &format!("127.0.0.1:{serve_port}"),
            "--sample-ms",
            "300",
        ]),
        &[
            ("DATABASE_URL", without.clone()),
            ("DATABASE_PASSWORD_FILE", pw_file.display().to_string()),
            (
                "SEALPOST_OPERATOR_TOKEN_FILE",
                token_file.display().to_string(),
            ),
            ("SEALPOST_READ_TOKEN_FILE", read_file.display().to_string()),
        ],
    );
    wait_listening("sealpost serve", serve_port, g.child("serve"));
    wait_listening(
        "sealpost dispatch /metrics",
        dispatch_metrics,
        g.child("dispatch"),
    );
    wait_listening(
        "sealpost consume /metrics",
        consume_metrics,
        g.child("consume"),
    );
    tokio::time::sleep(Duration::from_secs(2)).await;

    // Healthy: every endpoint answers, and the token from the file is the one accepted.
    let mut before = fetch_serve(serve_port);
    before.push((
        "dispatch /metrics".into(),
        http(dispatch_metrics, "GET", "/metrics", &[], ""),
    ));
    before.push((
        "consume /metrics".into(),
        http(consume_metrics, "GET", "/metrics", &[], ""),
    ));
    let healthy = |what: &str| before.iter().find(|(w, _)| w == what).unwrap().1.clone();
    assert!(
        healthy("GET /api/status").starts_with("HTTP/1.1 200"),
        "{}",
        healthy("GET /api/status")
    );
    assert!(
        healthy("POST /api/release (the token)").starts_with("HTTP/1.1 404"),
        "the token from the file is refused: {}",
        healthy("POST /api/release (the token)")
    );
    assert!(healthy("POST /api/release (wrong token)").starts_with("HTTP/1.1 401"));
    assert!(healthy("dispatch /metrics").starts_with("HTTP/1.1 200"));

    // The cut: the role may no longer log in, and its connections end now.
    admin
        .batch_execute(&format!(
            "ALTER ROLE {role} NOLOGIN;
             SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'"
        ))
        .await
        .expect("cut the role off");
    tokio::time::sleep(Duration::from_secs(4)).await;

    let mut after = fetch_serve(serve_port);
    after.push((
        "dispatch /metrics".into(),
        http(dispatch_metrics, "GET", "/metrics", &[], ""),
    ));
    let cause = "not permitted to log in";
    let down = |what: &str| after.iter().find(|(w, _)| w == what).unwrap().1.clone();
    // The page answers with a generic body; the cause is in its log, not in the answer.
    let status = down("GET /api/status");
    assert!(
        status.starts_with("HTTP/1.1 503") && !status.contains(cause),
        "/api/status while the database is down:\n{status}"
    );
    let out = g.run(
        "status",
        &args(&["status"]),
        &[
            ("DATABASE_URL", without.clone()),
            ("DATABASE_PASSWORD_FILE", pw_file.display().to_string()),
        ],
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains(cause));

    // A dispatcher told to stop while the database is down stops.
    let pid = g.child("dispatch").id().to_string();
    assert!(Command::new("kill")
        .args(["-INT", &pid])
        .status()
        .unwrap()
        .success());
    let stopped = wait_exit(g.child("dispatch"), Duration::from_secs(15));
    assert!(
        stopped.is_some(),
        "sealpost dispatch does not stop while the database is down"
    );
    // Let the others write what they have.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let outputs = g.outputs();
    let dispatch_err = &outputs
        .iter()
        .find(|(w, _)| w == "dispatch.stderr")
        .unwrap()
        .1;
    assert!(
        dispatch_err.contains(cause) && dispatch_err.contains("password=***"),
        "the dispatcher does not log the cause:\n{dispatch_err}"
    );
    let serve_err = &outputs.iter().find(|(w, _)| w == "serve.stderr").unwrap().1;
    assert!(
        serve_err.contains(cause),
        "the status page does not log the cause:\n{serve_err}"
    );
    assert_no_secret(&before);
    assert_no_secret(&after);
    assert_no_secret(&outputs);
}
