//! The status page (`sealpost serve`, issues 10 and 23) driven in a real headless Chromium
//! through chromedriver: a read without a token is refused and the page asks for one; the
//! security headers are on every answer (refusals included); a wrong `Host` is refused; with
//! the read token the figures it shows equal `sealpost status --json` for the same database,
//! the chart has its latency and backlog lines, findings are listed, a trace search shows the
//! causal chain of a known event; a release with the read token is refused, and with an
//! operator's token (from `--operator-tokens-file`) it succeeds, audited under that
//! operator's name whatever name the body claims; a server with no operator token releases
//! nothing; a token on the command line is refused.
//!
//! The test has its own database (`sealpost_web_<tag>`) and NATS stream (`WEB<tag>`), both
//! removed at the end, pass or fail; it starts `sealpost serve` and chromedriver on free
//! ports. It needs `chromedriver` and `chromium` (`apt-get install -y chromium
//! chromium-driver`; or set `CHROMEDRIVER`). With `SEALPOST_WEB_SCREENSHOT=PATH` it saves a screenshot of the page.

use crate::common;
use crate::teardown_nats;

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use sealpost::runtime::CancellationToken;
use sealpost::runtime::{self, Config, Counters};
use sealpost::store;
use sealpost_core::envelope::{EventId, NewEvent};
use sealpost_nats::async_nats::jetstream;
use sealpost_nats::Nats;
use serde_json::Value;

/// The read token (given in `SEALPOST_READ_TOKEN`).
const READ_TOKEN: &str = "web-test-read-token-7Qm2";
/// Alice's operator token (a line of `--operator-tokens-file`).
const ALICE_TOKEN: &str = "web-test-alice-token-Xc41";
/// The security headers every answer carries.
const SECURITY_HEADERS: [(&str, &str); 4] = [
    (
        "content-security-policy",
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    ),
    ("x-content-type-options", "nosniff"),
    ("cache-control", "no-store"),
    ("x-frame-options", "DENY"),
];

/// A child process (chromedriver, `sealpost serve`) killed when the test ends, pass or fail.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// chromedriver in a process group of its own, and the Chromium it starts: the whole group
/// is killed when the test ends. Killing chromedriver alone leaves its browser running when a
/// test fails before closing the session.
struct Browser(Child);

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.0.id())])
            .stderr(Stdio::null())
            .status();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind a free port")
        .local_addr()
        .unwrap()
        .port()
}

async fn wait_listening(what: &str, port: u16, child: &mut Child) {
    let start = Instant::now();
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("{what} exited before listening on port {port}: {status}");
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{what} is not listening on port {port} after 30 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// chromedriver from `CHROMEDRIVER` or the `PATH`; fails with how to install it.
fn chromedriver() -> PathBuf {
    let found = match std::env::var_os("CHROMEDRIVER") {
        Some(p) => Some(PathBuf::from(p)).filter(|p| p.is_file()),
        None => std::env::var_os("PATH")
            .into_iter()
            .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
            .map(|d| d.join("chromedriver"))
            .find(|p| p.is_file()),
    };
    found.unwrap_or_else(|| {
        panic!(
            "chromedriver is not installed (or CHROMEDRIVER names no file), so the status page \
             cannot be tested in a browser: install it with `apt-get update && apt-get install -y \
             chromium chromium-driver` (Debian; .ci/run does this), or set \
             CHROMEDRIVER=/path/to/chromedriver"
        )
    })
}

/// Starts chromedriver on a free port and opens a headless Chromium session.
async fn browser() -> (Client, Browser) {
    let port = free_port();
    let mut child = Command::new(chromedriver())
        .arg(format!("--port={port}"))
        .process_group(0)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start chromedriver");
    wait_listening("chromedriver", port, &mut child).await;
    let driver = Browser(child);
    let mut caps = serde_json::Map::new();
    let mut chrome = serde_json::json!({
        "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1500"]
    });
    if let Some(bin) = std::env::var_os("CHROME_BIN") {
        chrome["binary"] = Value::String(bin.to_string_lossy().into_owned());
    }
    caps.insert("goog:chromeOptions".into(), chrome);
    let client = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(caps)
        .connect(&format!("http://127.0.0.1:{port}"))
        .await
        .expect("open a Chromium session through chromedriver (is `chromium` installed?)");
    (client, driver)
}

/// A file removed when the test ends.
struct Removed(PathBuf);

impl Drop for Removed {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// `sealpost serve` against `cfg`'s database on `port`, with the read token in the
/// environment and, if given, `--operator-tokens-file`, plus `extra` flags.
fn serve_command(
    cfg: &Config,
    port: u16,
    operators: Option<&std::path::Path>,
    extra: &[&str],
) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sealpost"));
    cmd.args([
        "serve",
        "--http",
        &format!("127.0.0.1:{port}"),
        "--sample-ms",
        "250",
    ])
    .args(extra)
    .env("DATABASE_URL", &cfg.database_url)
    .env("SEALPOST_READ_TOKEN", READ_TOKEN);
    for v in [
        "SEALPOST_OPERATOR_TOKEN",
        "SEALPOST_OPERATOR_TOKEN_FILE",
        "SEALPOST_OPERATOR_TOKENS_FILE",
        "SEALPOST_READ_TOKEN_FILE",
        "SEALPOST_ALLOW_HOSTS",
    ] {
        cmd.env_remove(v);
    }
    if let Some(f) = operators {
        cmd.arg("--operator-tokens-file").arg(f);
    }
    cmd
}

/// Starts `sealpost serve` on a free port; returns its port and process.
async fn serve(cfg: &Config, operators: Option<&std::path::Path>) -> (u16, Killed) {
    let port = free_port();
    let mut child = serve_command(cfg, port, operators, &[])
        .stdout(Stdio::null())
        .spawn()
        .expect("start sealpost serve");
    wait_listening("sealpost serve", port, &mut child).await;
    (port, Killed(child))
}

/// One HTTP/1.1 exchange on a connection of its own: (status, lower-cased headers, body).
async fn http(
    port: u16,
    method: &str,
    path: &str,
    host: &str,
    token: Option<&str>,
    body: &str,
) -> (u16, Vec<(String, String)>, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect to sealpost serve");
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
    if let Some(t) = token {
        req.push_str(&format!("Authorization: Bearer {t}\r\n"));
    }
    req.push_str(&format!(
        "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    ));
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut out))
        .await
        .expect("an answer within 30 s")
        .unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {text:?}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    (status, headers, body.to_string())
}

#[track_caller]
fn assert_security_headers(what: &str, headers: &[(String, String)]) {
    for (name, value) in SECURITY_HEADERS {
        let got: Vec<&str> = headers
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .collect();
        assert_eq!(got, vec![value], "{what}: header {name}");
    }
}

/// Signs the page in with `token` (the page asks for it once per tab).
async fn sign_in(c: &Client, token: &str) {
    wait_displayed(c, "#login", true).await;
    set_input(c, "#access-token", token).await;
    c.find(Locator::Css("#login-go"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
}

/// Waits until `css` is shown (`true`) or hidden.
async fn wait_displayed(c: &Client, css: &str, shown: bool) {
    let start = Instant::now();
    loop {
        if let Ok(e) = c.find(Locator::Css(css)).await {
            if e.is_displayed().await.unwrap_or(!shown) == shown {
                return;
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "`{css}` is still {} after 20 s",
            if shown { "hidden" } else { "shown" }
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Runs `script` (a promise) in the page and returns its value.
async fn in_page(c: &Client, script: &str) -> Value {
    c.execute(script, vec![])
        .await
        .unwrap_or_else(|e| panic!("the page cannot run {script}: {e}"))
}

async fn enqueue(
    pg: &mut tokio_postgres::Client,
    batch: &str,
    payload: &[u8],
    n: usize,
) -> Vec<EventId> {
    let tx = pg.transaction().await.unwrap();
    let mut ids = Vec::new();
    for i in 0..n {
        let id = EventId(*uuid::Uuid::now_v7().as_bytes());
        let agg = format!("o-{batch}-{i}");
        let ev = NewEvent {
            aggregate_type: "order",
            aggregate_id: &agg,
            aggregate_version: 1,
            event_type: "order.created.v1",
            payload_schema: "order.created.v1",
            payload,
            tenant: "t",
            occurred_at_ms: 1,
            creating_txid: 0,
        };
        store::enqueue(&tx, "orders", id, &ev, &agg).await.unwrap();
        ids.push(id);
    }
    tx.commit().await.unwrap();
    ids
}

async fn state_of(pg: &tokio_postgres::Client, id: EventId) -> String {
    pg.query_one(
        "SELECT state FROM sealpost.work WHERE event_id = $1",
        &[&uuid::Uuid::from_bytes(id.0)],
    )
    .await
    .unwrap()
    .get(0)
}

async fn release_audits(pg: &tokio_postgres::Client, id: EventId) -> Vec<String> {
    pg.query(
        "SELECT detail FROM sealpost.audit WHERE event_id = $1 AND what = 'quarantine released'",
        &[&uuid::Uuid::from_bytes(id.0)],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}

fn cli_status(cfg: &Config) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_sealpost"))
        .args(["status", "--json"])
        .env("DATABASE_URL", &cfg.database_url)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("status --json prints JSON")
}

/// `of_it` (an expression of `e`, the element `css` selects) as the page shows it, read in
/// one script: the page re-renders itself every 2 s, and a found element can be replaced
/// before a second WebDriver call reads it.
async fn shown(c: &Client, css: &str, of_it: &str) -> Value {
    let value = c
        .execute(
            &format!("const e = document.querySelector(arguments[0]); return e ? {of_it} : null"),
            vec![Value::from(css)],
        )
        .await
        .unwrap_or_else(|e| panic!("the page cannot read `{css}`: {e}"));
    assert!(!value.is_null(), "the page has no `{css}`");
    value
}

/// The text of `css` as shown.
async fn text(c: &Client, css: &str) -> String {
    let value = shown(c, css, "e.innerText").await;
    value.as_str().unwrap_or_default().trim().to_string()
}

/// The cells of the table row `css`, as shown.
async fn row_cells(c: &Client, css: &str) -> Vec<String> {
    let value = shown(
        c,
        css,
        "Array.from(e.querySelectorAll('td'), td => td.innerText)",
    )
    .await;
    value
        .as_array()
        .into_iter()
        .flatten()
        .map(|cell| cell.as_str().unwrap_or_default().trim().to_string())
        .collect()
}

/// Polls `css`'s text until `ok` holds (the page updates itself every 2 s).
async fn wait_text(c: &Client, css: &str, ok: impl Fn(&str) -> bool) -> String {
    let start = Instant::now();
    loop {
        if let Ok(e) = c.find(Locator::Css(css)).await {
            if let Ok(t) = e.text().await {
                if ok(&t) {
                    return t;
                }
                assert!(
                    start.elapsed() < Duration::from_secs(20),
                    "`{css}` still shows {t:?} after 20 s"
                );
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "`{css}` is not on the page after 20 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn set_input(c: &Client, css: &str, value: &str) {
    let e = c.find(Locator::Css(css)).await.unwrap();
    e.clear().await.unwrap();
    if !value.is_empty() {
        e.send_keys(value).await.unwrap();
    }
}

/// Clicks the release button of `id`'s row and returns the page's answer.
async fn click_release(c: &Client, id: EventId) -> String {
    let button = format!("#quarantined-rows tr[data-event-id='{id}'] button.release");
    c.find(Locator::Css(&button))
        .await
        .unwrap_or_else(|e| panic!("no release button for {id}: {e}"))
        .click()
        .await
        .unwrap();
    wait_text(c, "#release-result", |t| {
        t.starts_with("release refused") || t.starts_with("released")
    })
    .await
}

fn f64_of(s: &str) -> f64 {
    s.trim()
        .parse()
        .unwrap_or_else(|_| panic!("{s:?} is not a number"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_needs_a_token_shows_the_status_and_releases_only_for_an_operator() {
    // Fail first, with how to install it, when there is no browser to drive.
    let driver_path = chromedriver();
    assert!(driver_path.is_file());

    let tag = format!("{}", runtime::owner_id() % 1_000_000_000);
    // Both removed when the test ends, pass or fail (dropped after the processes below).
    let mut cfg = common::fresh_database(&format!("sealpost_web_{tag}")).await;
    let stream = format!("WEB{tag}");
    let _stream = teardown_nats::stream(&common::nats_url(), &stream);
    cfg.rejection_limit = 2;
    let mut pg = runtime::pg_connect(&cfg.database_url).await.unwrap();
    store::migrate(&pg).await.unwrap();

    // A stream refusing payloads over 1 KiB: the big event becomes poison.
    let nats = Nats::connect(
        &common::nats_url(),
        common::NATS_CLUSTER,
        Duration::from_millis(cfg.ack_timeout_ms),
    )
    .await
    .expect("NATS must be running");
    nats.js
        .create_stream(jetstream::stream::Config {
            name: stream.clone(),
            subjects: vec![format!("sp.{stream}.>")],
            max_message_size: 1_024,
            ..Default::default()
        })
        .await
        .expect("create the test stream");
    store::set_route(&pg, "orders", common::NATS_CLUSTER, &stream)
        .await
        .unwrap();

    // Alice's operator token in a file (a comment and a blank line too).
    let operators = Removed(std::env::temp_dir().join(format!("sealpost_web_{tag}.tokens")));
    std::fs::write(
        &operators.0,
        format!("# operators of the web test\n\nalice:{ALICE_TOKEN}\n"),
    )
    .unwrap();

    // A token on the command line is refused, with what to use instead, and not echoed.
    for (flag, wants) in [
        ("--operator-token", "SEALPOST_OPERATOR_TOKEN"),
        ("--read-token", "SEALPOST_READ_TOKEN"),
    ] {
        let out = serve_command(&cfg, free_port(), None, &[flag, "cmdline-secret-Jq8"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag} was accepted");
        assert!(
            err.contains(flag) && err.contains("ps") && err.contains(wants),
            "{flag}: {err}"
        );
        assert!(!err.contains("cmdline-secret-Jq8"), "{err}");
    }
    // And a server with no token at all does not start.
    let out = serve_command(&cfg, free_port(), None, &[])
        .env_remove("SEALPOST_READ_TOKEN")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no token"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The page is up while events are published, so the chart has latency samples.
    let (port, _server) = serve(&cfg, Some(&operators.0)).await;
    let url = format!("http://127.0.0.1:{port}/");
    let host = format!("127.0.0.1:{port}");
    let poison = enqueue(&mut pg, "poison", &[b'x'; 4_096], 1).await[0];
    let mut stop = CancellationToken::new();
    let counters = Arc::new(Counters::default());
    let tasks = runtime::spawn_fleet(
        &cfg,
        &common::pg_source(&cfg),
        &Arc::new(nats.clone()),
        1,
        false,
        &stop,
        &counters,
    );
    let mut published = Vec::new();
    for b in 0..6 {
        published.extend(enqueue(&mut pg, &format!("b{b}"), b"{\"total\":1}", 20).await);
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    let start = Instant::now();
    loop {
        let mut done = state_of(&pg, poison).await == "QUARANTINED";
        for id in &published {
            done &= state_of(&pg, *id).await == "PUBLISHED";
        }
        if done {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the fleet did not settle"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.cancel();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    // Rows nobody dispatches stay PENDING; a published row is reported missing (R31).
    let pending = enqueue(&mut pg, "late", b"{}", 3).await;
    // And a delivery set (R16) nobody dispatches either: in progress, both members PENDING.
    store::set_route(
        &pg,
        "audit",
        common::NATS_CLUSTER,
        &format!("{stream}AUDIT"),
    )
    .await
    .unwrap();
    let set_id = EventId(*uuid::Uuid::now_v7().as_bytes());
    let tx = pg.transaction().await.unwrap();
    store::enqueue_set(
        &tx,
        &["orders", "audit"],
        sealpost_core::delivery_set::CompletionRule::All,
        set_id,
        &NewEvent {
            aggregate_type: "order",
            aggregate_id: "o-set",
            aggregate_version: 1,
            event_type: "order.created.v1",
            payload_schema: "order.created.v1",
            payload: b"{}",
            tenant: "t",
            occurred_at_ms: 1,
            creating_txid: 0,
        },
        "o-set",
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    // And a rollout (R25) in shadow whose shadow found one divergence in two messages.
    store::set_route(
        &pg,
        "rolled",
        common::NATS_CLUSTER,
        &format!("{stream}ROLL"),
    )
    .await
    .unwrap();
    store::rollout(
        &mut pg,
        "rolled",
        &store::RolloutCommand::Shadow {
            candidate: "v2".into(),
            incumbent: Some("v1".into()),
        },
    )
    .await
    .unwrap();
    let cursor = store::shadow_cursor(&pg, "rolled", "v2").await.unwrap();
    store::record_shadow(
        &mut pg,
        "rolled",
        "v2",
        &[
            (poison, 0, Vec::new()),
            (
                set_id,
                0,
                vec![sealpost_core::rollout::Divergence {
                    kind: sealpost_core::rollout::DivergenceKind::Headers,
                    incumbent: "Sealpost-Tenant: t9".into(),
                    candidate: "Sealpost-Tenant: t".into(),
                }],
            ),
        ],
        cursor,
        cursor,
    )
    .await
    .unwrap();
    let item = store::published_after_cursor(&mut pg, 1).await.unwrap();
    assert_eq!(item.len(), 1);
    assert!(store::record_missing(&pg, &item[0]).await.unwrap());

    // Over plain HTTP: every answer, refusals included, carries the security headers.
    let poison_id = poison.to_string();
    let (local, rebind, rebind_port) = (
        format!("localhost:{port}"),
        "rebind.example:80".to_string(),
        format!("rebind.example:{port}"),
    );
    let release_body = format!(r#"{{"event_id":"{poison_id}","reason":"r","operator":"mallory"}}"#);
    for (what, method, path, h, token, body, want) in [
        ("the page", "GET", "/", host.as_str(), None, "", 200),
        ("the script", "GET", "/app.js", host.as_str(), None, "", 200),
        (
            "a read without a token",
            "GET",
            "/api/status",
            host.as_str(),
            None,
            "",
            401,
        ),
        (
            "a read with a wrong token",
            "GET",
            "/api/trace?key=order/o-b0-0",
            host.as_str(),
            Some("wrong-token-0123456789"),
            "",
            401,
        ),
        (
            "a read with the read token",
            "GET",
            "/api/status",
            host.as_str(),
            Some(READ_TOKEN),
            "",
            200,
        ),
        (
            "localhost",
            "GET",
            "/api/history",
            local.as_str(),
            Some(READ_TOKEN),
            "",
            200,
        ),
        // DNS rebinding: the attacker's name in Host, even with a valid token.
        (
            "a foreign Host",
            "GET",
            "/api/status",
            rebind.as_str(),
            Some(READ_TOKEN),
            "",
            421,
        ),
        (
            "a foreign Host, the page",
            "GET",
            "/",
            rebind_port.as_str(),
            None,
            "",
            421,
        ),
        (
            "an unknown page",
            "GET",
            "/nope",
            host.as_str(),
            None,
            "",
            404,
        ),
        // The token is checked before the body is parsed: a malformed body is never read.
        (
            "a release without a token",
            "POST",
            "/api/release",
            host.as_str(),
            None,
            "{not json",
            401,
        ),
        (
            "a release with the read token",
            "POST",
            "/api/release",
            host.as_str(),
            Some(READ_TOKEN),
            "{not json",
            403,
        ),
        (
            "a release with the read token",
            "POST",
            "/api/release",
            host.as_str(),
            Some(READ_TOKEN),
            release_body.as_str(),
            403,
        ),
    ] {
        let (status, headers, answer) = http(port, method, path, h, token, body).await;
        assert_eq!(status, want, "{what}: {answer}");
        assert_security_headers(what, &headers);
        for secret in [READ_TOKEN, ALICE_TOKEN] {
            assert!(!answer.contains(secret), "{what}: {answer}");
        }
    }
    assert_eq!(state_of(&pg, poison).await, "QUARANTINED");
    assert!(release_audits(&pg, poison).await.is_empty());

    let (c, _driver) = browser().await;
    c.goto(&url).await.unwrap();
    assert_eq!(c.title().await.unwrap(), "Sealpost status");
    // Without a token the browser reads nothing: the page asks for one, and a read the
    // page's origin makes without it is refused.
    wait_displayed(&c, "#login", true).await;
    wait_displayed(&c, "#content", false).await;
    assert_eq!(text(&c, "#updated").await, "never");
    let answer = in_page(
        &c,
        "return fetch('/api/status').then(async r => [r.status, (await r.json()).error, r.headers.get('content-security-policy')])",
    )
    .await;
    assert_eq!(answer[0], 401, "{answer}");
    assert!(
        answer[1].as_str().unwrap().contains("token is required"),
        "{answer}"
    );
    assert_eq!(answer[2], SECURITY_HEADERS[0].1, "{answer}");
    // The page's headers, as the browser received them.
    let answer = in_page(
        &c,
        "return fetch('/').then(r => ['content-security-policy', 'x-content-type-options', 'cache-control', 'x-frame-options'].map(h => r.headers.get(h)))",
    )
    .await;
    assert_eq!(
        answer,
        Value::Array(
            SECURITY_HEADERS
                .iter()
                .map(|(_, v)| Value::from(*v))
                .collect()
        )
    );
    // A wrong token: refused, still asking.
    sign_in(&c, "not-the-token-0123456789").await;
    wait_text(&c, "#login-error", |t| t.contains("refused")).await;
    wait_displayed(&c, "#content", false).await;
    // The read token: the page shows the figures.
    sign_in(&c, READ_TOKEN).await;
    wait_text(&c, "#whoami", |t| t.contains("reader (read only)")).await;
    wait_displayed(&c, "#content", true).await;

    // The figures equal `sealpost status --json`: read between two CLI readings, so each age
    // on the page lies between them (the page shows tenths of a second).
    let before = cli_status(&cfg);
    c.refresh().await.unwrap();
    wait_text(&c, "#updated", |t| t != "never").await;
    let mut shown_states = serde_json::Map::new();
    for (name, _) in before["states"].as_object().unwrap() {
        let n: i64 = text(&c, &format!("#state-{name}")).await.parse().unwrap();
        shown_states.insert(name.clone(), n.into());
    }
    let shown_pending_age = f64_of(&text(&c, "#oldest-pending-s").await);
    let shown_unknown_age = f64_of(&text(&c, "#oldest-unknown-s").await);
    let shown_unknown: i64 = text(&c, "#unknown").await.parse().unwrap();
    let shown_quarantined: i64 = text(&c, "#quarantined").await.parse().unwrap();
    let shown_missing: i64 = text(&c, "#missing-at-broker").await.parse().unwrap();
    // Read in one script, as `text` reads (the page may re-render between two calls).
    let shown_rows = in_page(
        &c,
        "return Array.from(document.querySelectorAll('#quarantined-rows tr[data-event-id]'), \
         tr => [tr.dataset.eventId, tr.querySelector('td.reason').innerText.trim()])",
    )
    .await;
    let after = cli_status(&cfg);
    assert_eq!(
        before["states"], after["states"],
        "nothing runs: the counts hold still"
    );
    assert_eq!(Value::Object(shown_states), after["states"]);
    assert_eq!(shown_unknown, after["unknown"].as_i64().unwrap());
    assert_eq!(shown_quarantined, after["quarantined"].as_i64().unwrap());
    assert_eq!(shown_missing, after["missing_at_broker"].as_i64().unwrap());
    assert_eq!(shown_rows, after["quarantined_rows"]);
    for (shown, key) in [
        (shown_pending_age, "oldest_pending_s"),
        (shown_unknown_age, "oldest_unknown_s"),
    ] {
        let (lo, hi) = (before[key].as_f64().unwrap(), after[key].as_f64().unwrap());
        assert!(
            lo - 0.05 <= shown && shown <= hi + 0.05,
            "{key}: the page shows {shown}, status --json said {lo} then {hi}"
        );
    }
    // And they are the figures of this database, not an empty one.
    assert_eq!(after["states"]["PUBLISHED"], published.len() as i64);
    assert_eq!(after["states"]["PENDING"], pending.len() as i64 + 2);
    // The delivery set: the page's table and caption say what `status --json` says.
    assert_eq!(
        (
            after["sets"]["total"].as_i64(),
            after["sets"]["in_progress"].as_i64()
        ),
        (Some(1), Some(1)),
        "{after}"
    );
    assert_eq!(
        text(&c, "#sets-summary").await,
        "delivery sets: 1 (0 complete, 1 in progress, 0 blocked)"
    );
    let set_row = format!("#sets tr[data-event-id='{set_id}']");
    let cells = row_cells(&c, &set_row).await;
    assert_eq!(
        cells,
        vec![
            set_id.to_string(),
            "all (0/2)".to_string(),
            "in progress".to_string(),
            "orders: PENDING, audit: PENDING".to_string()
        ]
    );
    // The rollout: the page's tables say what `status --json` says.
    let ro = &after["rollout"];
    assert_eq!(
        ro["aliases"][0]["claims"],
        "v1 claims every row; v2 in shadow claims none"
    );
    assert_eq!(
        text(&c, "#rollout-summary").await,
        "rollouts: 1 route(s), 1 under way"
    );
    assert_eq!(
        row_cells(&c, "#rollout tr[data-route='rolled']").await,
        vec![
            "rolled".to_string(),
            ro["aliases"][0]["stage"].as_str().unwrap().to_string(),
            ro["aliases"][0]["generation"].to_string(),
            ro["aliases"][0]["claims"].as_str().unwrap().to_string(),
        ]
    );
    let sh = &ro["shadows"][0];
    assert_eq!(
        (
            sh["compared"].as_u64(),
            sh["diverged"].as_u64(),
            sh["unexplained"].as_u64()
        ),
        (Some(2), Some(1), Some(1))
    );
    assert_eq!(
        row_cells(&c, "#shadows tr[data-shadow='v2@rolled']").await,
        ["v2", "rolled", "2", "1", "1", "1"]
    );
    assert_eq!(
        row_cells(&c, &format!("#divergences tr[data-event-id='{set_id}']")).await,
        [
            "v2".to_string(),
            set_id.to_string(),
            "headers".to_string(),
            "Sealpost-Tenant: t9".to_string(),
            "Sealpost-Tenant: t".to_string(),
            "no".to_string()
        ]
    );
    assert_eq!(after["states"]["QUARANTINED"], 1);
    assert_eq!(after["missing_at_broker"], 1);
    assert_eq!(after["quarantined_rows"][0][0], poison.to_string());
    assert!(after["quarantined_rows"][0][1]
        .as_str()
        .unwrap()
        .contains("PayloadTooLarge"));
    assert!(shown_pending_age > 0.0);

    // The chart: the sampler saw the events published, and the backlog.
    let start = Instant::now();
    while c.find(Locator::Css("#line-p99")).await.is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "the chart has no latency line"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let points = c
        .find(Locator::Css("#line-p50"))
        .await
        .unwrap()
        .attr("points")
        .await
        .unwrap()
        .unwrap_or_default();
    assert!(!points.trim().is_empty(), "latency points: {points:?}");
    c.find(Locator::Css("#line-backlog"))
        .await
        .expect("a backlog line");

    // Findings: the recorded one, with its event id.
    let findings = text(&c, "#findings").await;
    assert!(
        findings.contains("published_missing_at_broker"),
        "{findings}"
    );
    assert!(
        findings.contains(&item[0].event_id.to_string()),
        "{findings}"
    );

    // Trace by event id: the chain of a published event, down to its broker position.
    let known = published[0];
    let (seq, txid): (i64, i64) = {
        let r = pg
            .query_one(
                "SELECT primary_sequence, creating_txid FROM sealpost.outbox WHERE event_id = $1",
                &[&uuid::Uuid::from_bytes(known.0)],
            )
            .await
            .unwrap();
        (r.get(0), r.get(1))
    };
    set_input(&c, "#trace-key", &known.to_string()).await;
    c.find(Locator::Css("#trace-go"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let chain = wait_text(&c, &format!(".trace-event[data-event-id='{known}']"), |t| {
        !t.is_empty()
    })
    .await;
    assert!(
        chain.contains(&format!("{known} member 0: PUBLISHED")),
        "{chain}"
    );
    assert!(
        chain.contains(&format!("committed: txid {txid}")),
        "{chain}"
    );
    assert!(
        chain.contains(&format!("broker: {stream}#{seq}")),
        "{chain}"
    );
    assert!(chain.contains("attempt: #"), "{chain}");
    // Trace by aggregate: the poison's chain shows its quarantine.
    set_input(&c, "#trace-key", "order/o-poison-0").await;
    c.find(Locator::Css("#trace-go"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let chain = wait_text(
        &c,
        &format!(".trace-event[data-event-id='{poison}']"),
        |t| !t.is_empty(),
    )
    .await;
    assert!(chain.contains("QUARANTINED"), "{chain}");
    assert!(chain.contains("quarantine: Poison"), "{chain}");

    if let Some(path) = std::env::var_os("SEALPOST_WEB_SCREENSHOT") {
        std::fs::write(&path, c.screenshot().await.unwrap()).expect("write the screenshot");
    }

    // A release with the read token: refused, nothing changes.
    set_input(&c, "#reason", "limit raised").await;
    let answer = click_release(&c, poison).await;
    assert!(answer.contains("may read but not release"), "{answer}");
    assert_eq!(state_of(&pg, poison).await, "QUARANTINED");
    assert!(release_audits(&pg, poison).await.is_empty());
    // Signed out, the page asks again; alice's token releases, audited under her name.
    c.find(Locator::Css("#logout"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    sign_in(&c, ALICE_TOKEN).await;
    wait_text(&c, "#whoami", |t| t.contains("alice (operator)")).await;
    wait_displayed(&c, "#content", true).await;
    set_input(&c, "#reason", "limit raised").await;
    let answer = click_release(&c, poison).await;
    assert!(
        answer.starts_with(&format!("released 1 row(s) of {poison} to PENDING")),
        "{answer}"
    );
    assert_eq!(state_of(&pg, poison).await, "PENDING");
    assert_eq!(
        release_audits(&pg, poison).await,
        vec!["by alice: limit raised".to_string()]
    );
    wait_text(&c, "#quarantined-rows", |t| {
        !t.contains(&poison.to_string())
    })
    .await;
    wait_text(&c, "#state-QUARANTINED", |t| t == "0").await;

    // A server started without an operator token releases nothing, whatever the page sends.
    let other = enqueue(&mut pg, "poison2", &[b'y'; 4_096], 1).await[0];
    let tasks = {
        stop = CancellationToken::new();
        runtime::spawn_fleet(
            &cfg,
            &common::pg_source(&cfg),
            &Arc::new(nats.clone()),
            1,
            false,
            &stop,
            &counters,
        )
    };
    let start = Instant::now();
    while state_of(&pg, other).await != "QUARANTINED" {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the second poison was not quarantined"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.cancel();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let (port2, _server2) = serve(&cfg, None).await;
    c.goto(&format!("http://127.0.0.1:{port2}/")).await.unwrap();
    sign_in(&c, READ_TOKEN).await;
    wait_text(&c, "#quarantined-rows", |t| t.contains(&other.to_string())).await;
    let answer = click_release(&c, other).await;
    assert!(answer.contains("releases are disabled"), "{answer}");
    assert_eq!(state_of(&pg, other).await, "QUARANTINED");
    assert!(release_audits(&pg, other).await.is_empty());
    // Alice's token means nothing there.
    let (status, _, _) = http(
        port2,
        "GET",
        "/api/status",
        &format!("127.0.0.1:{port2}"),
        Some(ALICE_TOKEN),
        "",
    )
    .await;
    assert_eq!(status, 401);

    // The operator is whoever's token matched: a body claiming another name is audited as
    // alice (from the first server's page, where this tab is still signed in as her).
    c.goto(&url).await.unwrap();
    wait_text(&c, "#whoami", |t| t.contains("alice (operator)")).await;
    let answer = in_page(
        &c,
        &format!(
            "return fetch('/api/release', {{method: 'POST', headers: {{'Content-Type': 'application/json', \
             'Authorization': 'Bearer ' + sessionStorage.getItem('sealpost.token')}}, \
             body: JSON.stringify({{event_id: '{other}', reason: 'fixed', operator: 'mallory'}})}}) \
             .then(async r => [r.status, await r.json()])"
        ),
    )
    .await;
    assert_eq!(answer[0], 200, "{answer}");
    assert_eq!(state_of(&pg, other).await, "PENDING");
    assert_eq!(
        release_audits(&pg, other).await,
        vec!["by alice: fixed".to_string()]
    );

    c.close().await.unwrap();
}
