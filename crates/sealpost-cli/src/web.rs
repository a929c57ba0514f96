//! `sealpost serve`: the operator's status page (issue 10) and the JSON endpoints behind it,
//! hardened (issue 23, item 4).
//!
//! Every figure comes from the functions the command line uses: `/api/status` is
//! [`store::status`] (what `sealpost status --json` prints), `/api/trace` is
//! [`ops::trace_bounded`] (`sealpost trace --json`, at most [`TRACE_EVENTS_MAX`] events), and
//! `POST /api/release` is [`store::release_quarantine`] (what `sealpost release` runs, audit
//! row included). What this module adds is a sampler that reads the status every
//! `--sample-ms` into a bounded ring buffer for the page's chart, and the guards:
//!
//! - **Tokens.** Every `/api/*` request needs `Authorization: Bearer TOKEN`: the read token
//!   (`SEALPOST_READ_TOKEN` or `--read-token-file`) or an operator's token
//!   (`SEALPOST_OPERATOR_TOKEN`, `--operator-token-file`, or `--operator-tokens-file` with
//!   `NAME:TOKEN` lines). Only an operator's token releases, and the audit row names the
//!   operator whose token matched, never a name from the body. Tokens come from the
//!   environment or files only: a token on the command line is visible in `ps`. They are
//!   compared in constant time, lengths included ([`Credentials::identify`]), and checked
//!   before the request body is read.
//! - **Host allowlist.** A request whose `Host` is not the bound address, `localhost:PORT`
//!   or an `--allow-host` is refused (421) before anything else: a DNS-rebinding page in an
//!   operator's browser cannot read the page even on loopback.
//! - **Headers on every response.** A CSP without inline script or style, `frame-ancestors
//!   'none'` (and `X-Frame-Options: DENY`), `nosniff`, `Cache-Control: no-store`,
//!   `Referrer-Policy: no-referrer`.
//! - **Bounded database use.** Reads go through a pool of at most `--db-connections`
//!   read-only sessions with `statement_timeout`; a request that waits longer than
//!   [`POOL_WAIT`] for one is answered 503. Releases have one connection of their own.
//!   The trace answers at most [`TRACE_EVENTS_MAX`] events.
//! - **Generic errors.** An error answer says what kind of failure it was; the cause is in
//!   the server's log (redacted: no password, no token).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::ops::Deref;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Query, Request, State as Shared};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use sealpost::pg::{PgConn, PgConnector, PgSource};
use sealpost::runtime::Config;
use sealpost::secret;
use sealpost::store::{self, StoreError};
use sealpost_core::envelope::EventId;
use sealpost_core::state::State;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use subtle::{ConditionallySelectable, ConstantTimeEq};
use tokio::sync::{Mutex, Semaphore, SemaphorePermit};

use crate::ops;

/// The page: one HTML file; its script and style are served beside it (`/app.js`,
/// `/app.css`) so that the CSP forbids inline script. No CDN; the page works offline.
const INDEX_HTML: &str = include_str!("web/index.html");
const APP_JS: &str = include_str!("web/app.js");
const APP_CSS: &str = include_str!("web/app.css");

/// Samples kept in the ring buffer at most, whatever `--history-s` asks.
pub const HISTORY_SAMPLES_MAX: usize = 10_000;
/// The latency sample reads at most this many of the newest rows (a backward scan of the
/// work table's primary key: event ids are UUIDv7, so the newest ids are the newest events).
pub const LATENCY_ROWS_MAX: i64 = 5_000;
/// A sample covers acceptances up to this long before its read, so that a transaction that
/// took its clock reading before the sample but committed after it is not missed.
pub const SETTLE_MS: i64 = 1_000;
/// The sampler starts its next read no sooner than this many times the last read's duration
/// after it began (on a large table `store::status` scans; this keeps the sampler under a
/// fifth of one database backend). The page's script backs off the same way.
pub const SAMPLE_DUTY_FACTOR: u32 = 5;
/// Findings returned by `/api/findings` at most (newest first).
pub const FINDINGS_MAX: i64 = 100;
/// Event members answered by `/api/trace` at most (the first committed); the answer says
/// `"truncated": true` when the aggregate has more.
pub const TRACE_EVENTS_MAX: i64 = 50;
/// Longest reason accepted by `POST /api/release` (kept in the audit row).
pub const AUDIT_TEXT_MAX: usize = 500;
/// Largest request body read (only `POST /api/release` has one).
pub const BODY_BYTES_MAX: usize = 4 * 1024;
/// Shortest token accepted at startup (bytes).
pub const TOKEN_BYTES_MIN: usize = 16;
/// Longest operator name in `--operator-tokens-file` (it goes into audit rows and logs).
pub const OPERATOR_NAME_MAX: usize = 64;
/// How long a request waits for a pooled connection before it is answered 503.
pub const POOL_WAIT: Duration = Duration::from_secs(3);
/// The operator name of `SEALPOST_OPERATOR_TOKEN` / `--operator-token-file`.
pub const SINGLE_OPERATOR_NAME: &str = "operator";

/// The Content-Security-Policy of every response: the page's own script, style and
/// requests only, no inline script, no framing, no form posted anywhere.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// The states of rows that are not yet published and not parked: the backlog on the chart.
const BACKLOG_STATES: [State; 6] = [
    State::Pending,
    State::Claimed,
    State::Sending,
    State::RetryClaimed,
    State::DispatchUnknown,
    State::Reconciling,
];

/// `sealpost serve` flags. No flag carries a token (a command line is visible in `ps`);
/// `--operator-token` and `--read-token` exist only to refuse them with what to use.
#[derive(clap::Args, Clone, Debug)]
pub struct ServeArgs {
    /// Address to listen on (plain HTTP: keep it on loopback or behind a TLS proxy).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub http: SocketAddr,
    /// Refused: a token on the command line is visible to every local user in `ps`.
    #[arg(long, hide = true, value_name = "REFUSED")]
    pub operator_token: Option<Refused>,
    /// Refused: a token on the command line is visible to every local user in `ps`.
    #[arg(long, hide = true, value_name = "REFUSED")]
    pub read_token: Option<Refused>,
    /// File holding the read token (one trailing newline ignored); or set
    /// SEALPOST_READ_TOKEN. The read token reads every endpoint but cannot release.
    #[arg(long, env = "SEALPOST_READ_TOKEN_FILE")]
    pub read_token_file: Option<PathBuf>,
    /// File holding one operator token (audited as `operator`); or set
    /// SEALPOST_OPERATOR_TOKEN.
    #[arg(long, env = "SEALPOST_OPERATOR_TOKEN_FILE")]
    pub operator_token_file: Option<PathBuf>,
    /// File of per-operator tokens, one `NAME:TOKEN` a line (`#` comments and blank lines
    /// ignored); a release is audited under the NAME whose token matched.
    #[arg(long, env = "SEALPOST_OPERATOR_TOKENS_FILE")]
    pub operator_tokens_file: Option<PathBuf>,
    /// Another `Host` the page answers to, as the browser sends it (`status.example.com`,
    /// `10.0.0.5:8080`); repeatable. The bound address and `localhost:PORT` always are.
    #[arg(
        long = "allow-host",
        env = "SEALPOST_ALLOW_HOSTS",
        value_delimiter = ','
    )]
    pub allow_hosts: Vec<String>,
    /// Login for the page's reads and its sampler: a PostgreSQL URL or `key=value` DSN
    /// (TLS settings as in DATABASE_URL) of a login mapped to the `reader` role (`sealpost
    /// migrate --grant reader=LOGIN`). Unset: the reads use DATABASE_URL too. Releases always
    /// run as DATABASE_URL, which then needs only the `operator` role. Give it in the
    /// environment, never with a password on the command line.
    #[arg(long, env = "SEALPOST_READER_DATABASE_URL", hide_env_values = true)]
    pub reader_database_url: Option<Dsn>,
    /// File holding the password of --reader-database-url (one trailing newline ignored).
    #[arg(long, env = "SEALPOST_READER_DATABASE_PASSWORD_FILE")]
    pub reader_database_password_file: Option<PathBuf>,
    /// Database connections the page's reads may use at once (read-only sessions).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=16))]
    pub db_connections: u32,
    /// `statement_timeout` of every statement the page and its sampler run (ms).
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(100..=600_000))]
    pub statement_timeout_ms: u64,
    /// How often the server samples the status for the chart (ms).
    #[arg(long, default_value_t = 2_000, value_parser = clap::value_parser!(u64).range(100..=60_000))]
    pub sample_ms: u64,
    /// How much history the chart keeps (s).
    #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(10..=86_400))]
    pub history_s: u64,
}

/// A connection string given on the command line or in the environment; its `Debug` is
/// redacted (`secret::redact_dsn`), so a password in it never reaches a log line.
#[derive(Clone)]
pub struct Dsn(pub String);

impl std::fmt::Debug for Dsn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&secret::redact_dsn(&self.0))
    }
}

impl std::str::FromStr for Dsn {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Dsn, Self::Err> {
        Ok(Dsn(s.to_string()))
    }
}

/// The value of a refused flag, never kept (so never printed by `Debug`).
#[derive(Clone, Debug)]
pub struct Refused;

impl std::str::FromStr for Refused {
    type Err = std::convert::Infallible;
    fn from_str(_: &str) -> Result<Refused, Self::Err> {
        Ok(Refused)
    }
}

/// What a token may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Every read endpoint.
    Reader,
    /// Every read endpoint and releases.
    Operator,
}

/// Who sent a request: the credential its token matched.
#[derive(Clone, Debug)]
pub struct Identity {
    /// What the token may do.
    pub role: Role,
    /// `reader`, or the operator's name (what the audit row records).
    pub name: String,
}

/// One accepted token, kept as its SHA-256 only.
struct Credential {
    digest: [u8; 32],
    identity: Identity,
}

/// The accepted tokens. Its `Debug` shows names and roles, never a token.
pub struct Credentials(Vec<Credential>);

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|c| &c.identity))
            .finish()
    }
}

fn digest(token: &[u8]) -> [u8; 32] {
    Sha256::digest(token).into()
}

impl Credentials {
    /// Builds the set; refuses a short or non-printable token, a duplicate token (one token
    /// must mean one identity) and a duplicate or malformed operator name. Errors name the
    /// source (file or variable), never a token.
    pub fn new(
        entries: impl IntoIterator<Item = (String, Identity, String)>,
    ) -> Result<Credentials, String> {
        let mut out: Vec<Credential> = Vec::new();
        for (source, identity, token) in entries {
            if token.len() < TOKEN_BYTES_MIN {
                return Err(format!(
                    "{source}: the token is shorter than {TOKEN_BYTES_MIN} bytes; use a long random one (e.g. `openssl rand -hex 32`)"
                ));
            }
            if !token.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(format!(
                    "{source}: the token has a space or a non-printable or non-ASCII character; it must fit an HTTP header"
                ));
            }
            if identity.role == Role::Operator {
                let n = &identity.name;
                if n.is_empty()
                    || n.len() > OPERATOR_NAME_MAX
                    || !n
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"._@-".contains(&b))
                {
                    return Err(format!(
                        "{source}: an operator name must be 1 to {OPERATOR_NAME_MAX} letters, digits or `._@-`"
                    ));
                }
                if out
                    .iter()
                    .any(|c| c.identity.role == Role::Operator && c.identity.name == *n)
                {
                    return Err(format!("{source}: the operator `{n}` has two tokens"));
                }
            }
            let d = digest(token.as_bytes());
            if out.iter().any(|c| c.digest == d) {
                return Err(format!(
                    "{source}: this token is also given for another identity (the read token, or another operator); each must be different"
                ));
            }
            out.push(Credential {
                digest: d,
                identity,
            });
        }
        Ok(Credentials(out))
    }

    /// The identity whose token is `given`, or none. Constant time in the token's content
    /// and length: both sides are hashed to 32 bytes and compared with `subtle`, and every
    /// credential is compared (no early exit), so neither a matching prefix nor a matching
    /// length answers sooner.
    pub fn identify(&self, given: &[u8]) -> Option<&Identity> {
        let d = digest(given);
        let mut found = u32::MAX;
        for (i, c) in self.0.iter().enumerate() {
            found.conditional_assign(&(i as u32), d.ct_eq(&c.digest));
        }
        self.0.get(found as usize).map(|c| &c.identity)
    }

    /// Whether any operator token is configured (else releases are disabled).
    pub fn has_operator(&self) -> bool {
        self.0.iter().any(|c| c.identity.role == Role::Operator)
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A secret from an environment variable, if set (an empty value is an error).
fn env_secret(name: &str) -> Result<Option<String>, String> {
    match std::env::var(name) {
        Ok(v) if v.is_empty() => Err(format!(
            "{name} is set but empty; give the token, or unset it"
        )),
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(format!("{name} is not UTF-8")),
    }
}

fn file_secret(flag: &'static str, path: &std::path::Path) -> Result<String, String> {
    sealpost::secret::read_secret_file(flag, path).map_err(|e| e.to_string())
}

impl ServeArgs {
    /// The accepted tokens, from the environment and the files. Refuses a token on the
    /// command line, the same token from two places, and a server with no token at all.
    pub fn credentials(&self) -> Result<Credentials, String> {
        if self.operator_token.is_some() {
            return Err("--operator-token is refused: a token on the command line is visible to every local user in `ps`; set SEALPOST_OPERATOR_TOKEN, or give --operator-token-file PATH, or per-operator tokens with --operator-tokens-file PATH (lines NAME:TOKEN)".into());
        }
        if self.read_token.is_some() {
            return Err("--read-token is refused: a token on the command line is visible to every local user in `ps`; set SEALPOST_READ_TOKEN or give --read-token-file PATH".into());
        }
        let reader = || Identity {
            role: Role::Reader,
            name: "reader".into(),
        };
        let operator = |name: &str| Identity {
            role: Role::Operator,
            name: name.into(),
        };
        let mut entries = Vec::new();
        match (env_secret("SEALPOST_READ_TOKEN")?, &self.read_token_file) {
            (Some(_), Some(_)) => return Err("both SEALPOST_READ_TOKEN and --read-token-file (SEALPOST_READ_TOKEN_FILE) are set; keep one".into()),
            (Some(t), None) => entries.push(("SEALPOST_READ_TOKEN".to_string(), reader(), t)),
            (None, Some(p)) => entries.push((
                format!("--read-token-file {}", p.display()),
                reader(),
                file_secret("--read-token-file", p)?,
            )),
            (None, None) => {}
        }
        match (env_secret("SEALPOST_OPERATOR_TOKEN")?, &self.operator_token_file) {
            (Some(_), Some(_)) => return Err("both SEALPOST_OPERATOR_TOKEN and --operator-token-file (SEALPOST_OPERATOR_TOKEN_FILE) are set; keep one".into()),
            (Some(t), None) => entries.push((
                "SEALPOST_OPERATOR_TOKEN".to_string(),
                operator(SINGLE_OPERATOR_NAME),
                t,
            )),
            (None, Some(p)) => entries.push((
                format!("--operator-token-file {}", p.display()),
                operator(SINGLE_OPERATOR_NAME),
                file_secret("--operator-token-file", p)?,
            )),
            (None, None) => {}
        }
        if let Some(p) = &self.operator_tokens_file {
            let text = file_secret("--operator-tokens-file", p)?;
            for (i, line) in text.lines().enumerate() {
                let line = line.trim_end_matches('\r').trim();
                if line.is_empty() || line.starts_with('#') {
                    continue;
                }
                let source = format!("--operator-tokens-file {} line {}", p.display(), i + 1);
                let Some((name, token)) = line.split_once(':') else {
                    return Err(format!("{source}: expected NAME:TOKEN"));
                };
                entries.push((source, operator(name.trim()), token.trim().to_string()));
            }
        }
        let creds = Credentials::new(entries)?;
        if creds.is_empty() {
            return Err("no token: every endpoint of the status page needs one; set SEALPOST_READ_TOKEN (or --read-token-file PATH) for readers, and SEALPOST_OPERATOR_TOKEN (or --operator-token-file PATH, or --operator-tokens-file PATH with NAME:TOKEN lines) for releases".into());
        }
        Ok(creds)
    }

    /// The reads' login ([`ServeArgs::reader_database_url`]) with the password from its file,
    /// if one is given.
    pub fn reader_url(&self) -> Result<Option<String>, String> {
        let Some(Dsn(url)) = &self.reader_database_url else {
            if self.reader_database_password_file.is_some() {
                return Err("--reader-database-password-file is set but --reader-database-url (SEALPOST_READER_DATABASE_URL) is not; set both or neither".into());
            }
            return Ok(None);
        };
        let url = url.trim();
        if url.is_empty() {
            return Err("SEALPOST_READER_DATABASE_URL is empty; give the reader login's connection string, or unset it".into());
        }
        Ok(Some(match &self.reader_database_password_file {
            Some(path) => {
                let password = secret::read_secret_file("--reader-database-password-file", path)
                    .map_err(|e| e.to_string())?;
                secret::with_password(url, &password)
            }
            None => url.to_string(),
        }))
    }

    /// The `Host` values the page answers to: the bound address, `localhost:PORT` (and
    /// `[::1]:PORT` on IPv6 loopback), and every `--allow-host`, lower-cased.
    pub fn allowed_hosts(&self, bound: SocketAddr) -> Vec<String> {
        let mut hosts = vec![bound.to_string(), format!("localhost:{}", bound.port())];
        if bound.is_ipv6() && bound.ip().is_loopback() {
            hosts.push(format!("[::1]:{}", bound.port()));
        }
        hosts.extend(
            self.allow_hosts
                .iter()
                .map(|h| h.trim().to_ascii_lowercase())
                .filter(|h| !h.is_empty()),
        );
        hosts
    }
}

/// One point of the chart.
#[derive(Clone, Debug, Serialize)]
pub struct Sample {
    /// When it was read (database clock, ms).
    pub at_ms: i64,
    /// Rows not yet published and not parked (pending, claimed, sending, unknown).
    pub backlog: i64,
    /// Age of the oldest `PENDING` row (s).
    pub oldest_pending_s: f64,
    /// Rows whose outcome is unknown.
    pub unknown: i64,
    /// Age of the oldest unknown (s).
    pub oldest_unknown_s: f64,
    /// Rows accepted (`PUBLISHED`) in this sample's window, among the newest
    /// [`LATENCY_ROWS_MAX`] rows.
    pub published: i64,
    /// Commit → `PUBLISHED` latency of those rows (ms), median; `None` when there were none.
    pub latency_ms_p50: Option<i64>,
    /// The same, 99th percentile.
    pub latency_ms_p99: Option<i64>,
}

/// A small bounded pool: at most `slots` connections lent at once, each set up with
/// `setup` when opened; a broken one is dropped, an idle one kept for the next request.
struct Pool {
    source: Arc<dyn PgSource>,
    setup: String,
    slots: Semaphore,
    idle: std::sync::Mutex<Vec<PgConn>>,
    what: &'static str,
}

/// A connection lent by a [`Pool`], given back on drop (unless it broke).
struct Lease<'a> {
    conn: Option<PgConn>,
    pool: &'a Pool,
    _slot: SemaphorePermit<'a>,
}

impl Deref for Lease<'_> {
    type Target = tokio_postgres::Client;
    fn deref(&self) -> &tokio_postgres::Client {
        self.conn.as_ref().expect("held until drop")
    }
}

impl Lease<'_> {
    fn client_mut(&mut self) -> &mut tokio_postgres::Client {
        self.conn.as_mut().expect("held until drop")
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        if let Some(c) = self.conn.take() {
            if !c.is_closed() {
                self.pool.idle.lock().expect("idle list").push(c);
            }
        }
    }
}

impl Pool {
    fn new(source: Arc<dyn PgSource>, size: usize, setup: String, what: &'static str) -> Pool {
        Pool {
            source,
            setup,
            slots: Semaphore::new(size),
            idle: std::sync::Mutex::new(Vec::new()),
            what,
        }
    }

    /// A set-up connection, or 503 after [`POOL_WAIT`] (busy) or when none can be opened
    /// (the cause logged, redacted by the source).
    async fn get(&self) -> Result<Lease<'_>, ApiError> {
        let slot = match tokio::time::timeout(POOL_WAIT, self.slots.acquire()).await {
            Ok(Ok(s)) => s,
            _ => {
                tracing::warn!(
                    pool = self.what,
                    "no database connection free within {POOL_WAIT:?}: the page answers 503"
                );
                return Err(ApiError::BUSY);
            }
        };
        loop {
            let next = self.idle.lock().expect("idle list").pop();
            match next {
                Some(c) if !c.is_closed() => {
                    return Ok(Lease {
                        conn: Some(c),
                        pool: self,
                        _slot: slot,
                    })
                }
                Some(_) => continue,
                None => break,
            }
        }
        let c = self.source.connect().await.map_err(|e| {
            tracing::warn!(pool = self.what, error = %e, "the status page cannot connect to PostgreSQL");
            ApiError::UNAVAILABLE
        })?;
        c.batch_execute(&self.setup).await.map_err(|e| {
            tracing::warn!(pool = self.what, error = %StoreError::from(e), "cannot set up a status page session");
            ApiError::UNAVAILABLE
        })?;
        Ok(Lease {
            conn: Some(c),
            pool: self,
            _slot: slot,
        })
    }
}

/// What the handlers share.
struct App {
    credentials: Credentials,
    allowed_hosts: Vec<String>,
    sample_ms: u64,
    history_max: usize,
    statement_timeout_ms: u64,
    /// The handlers' reads: read-only sessions with `statement_timeout`.
    reads: Pool,
    /// Releases, one at a time, on a session of their own.
    writes: Pool,
    /// The sampler's connection source (the reads' login).
    source: Arc<dyn PgSource>,
    history: Mutex<History>,
}

#[derive(Default)]
struct History {
    samples: VecDeque<Sample>,
    /// Whether the sampler's last read failed (the cause is in the log).
    last_error: Option<String>,
    /// How long the last sample took (ms).
    last_took_ms: u64,
}

/// An error answered as `{"error": "..."}` with its status code: a fixed, generic text
/// (the cause, if any, was logged where it happened).
#[derive(Debug)]
struct ApiError(StatusCode, &'static str);

impl ApiError {
    const BUSY: ApiError = ApiError(
        StatusCode::SERVICE_UNAVAILABLE,
        "the server is busy; try again shortly",
    );
    const UNAVAILABLE: ApiError = ApiError(
        StatusCode::SERVICE_UNAVAILABLE,
        "the database cannot be read now; the cause is in the server's log",
    );
    const SLOW: ApiError = ApiError(
        StatusCode::SERVICE_UNAVAILABLE,
        "the database took too long to answer; try again later",
    );
    const NO_TOKEN: ApiError = ApiError(
        StatusCode::UNAUTHORIZED,
        "a token is required (Authorization: Bearer TOKEN)",
    );
    const BAD_TOKEN: ApiError = ApiError(StatusCode::UNAUTHORIZED, "the token is not valid");
    const NOT_OPERATOR: ApiError = ApiError(
        StatusCode::FORBIDDEN,
        "this token may read but not release; sign in with an operator token; nothing was changed",
    );
    const RELEASES_DISABLED: ApiError = ApiError(
        StatusCode::FORBIDDEN,
        "releases are disabled: this server has no operator token; nothing was changed",
    );
    const HOST: ApiError = ApiError(
        StatusCode::MISDIRECTED_REQUEST,
        "this server does not answer to that Host",
    );
    const NOT_FOUND: ApiError = ApiError(StatusCode::NOT_FOUND, "no such page");
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.0, Json(json!({ "error": self.1 }))).into_response();
        if self.0 == StatusCode::UNAUTHORIZED {
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        r
    }
}

/// A store failure as a generic answer; the cause goes to the log (its text is redacted by
/// the store: no password).
fn store_error(what: &'static str, e: StoreError) -> ApiError {
    let answer = match &e {
        StoreError::UnknownEvent(_) => ApiError(StatusCode::NOT_FOUND, "no such event"),
        StoreError::NotQuarantined { .. } => ApiError(
            StatusCode::CONFLICT,
            "that event is not quarantined; nothing was changed",
        ),
        StoreError::NotMigrated => ApiError(
            StatusCode::SERVICE_UNAVAILABLE,
            "the database is not migrated; run `sealpost migrate`",
        ),
        StoreError::Db(db)
            if db.code() == Some(&tokio_postgres::error::SqlState::QUERY_CANCELED) =>
        {
            ApiError::SLOW
        }
        _ => ApiError::UNAVAILABLE,
    };
    if answer.0.is_server_error() {
        tracing::warn!(what, error = %e, "a status page request failed");
    }
    answer
}

impl App {
    /// Runs a handler's database work with a deadline (the statement timeout, twice): a
    /// request that runs many statements cannot hold a connection for long either.
    async fn deadline<T>(
        &self,
        fut: impl std::future::Future<Output = Result<T, ApiError>>,
    ) -> Result<T, ApiError> {
        let limit = Duration::from_millis(self.statement_timeout_ms * 2);
        tokio::time::timeout(limit, fut).await.unwrap_or_else(|_| {
            tracing::warn!("a status page request passed its deadline of {limit:?}");
            Err(ApiError::SLOW)
        })
    }
}

/// Runs the status page until Ctrl-C. Fails early, with the cause, when a token is missing
/// or malformed, the database is unreachable or not migrated, or the address cannot be
/// bound.
pub async fn serve(cfg: &Config, args: ServeArgs) -> Result<(), String> {
    let credentials = args.credentials()?;
    let source: Arc<dyn PgSource> = Arc::new(PgConnector::from_config(cfg));
    let read_source: Arc<dyn PgSource> = match args.reader_url()? {
        Some(url) => Arc::new(PgConnector::new(url)),
        None => {
            tracing::warn!("the page's reads run as DATABASE_URL's login; give a login of the reader role in SEALPOST_READER_DATABASE_URL (docs/operations.md, \"Roles and logins\")");
            source.clone()
        }
    };
    let timeout = format!("SET statement_timeout = {}", args.statement_timeout_ms);
    let reads = Pool::new(
        read_source.clone(),
        args.db_connections as usize,
        format!("{timeout}; SET default_transaction_read_only = on"),
        "reads",
    );
    let writes = Pool::new(source.clone(), 1, timeout, "releases");
    // Fail early, with the cause (redacted): unreachable, refused, not migrated, a reader
    // login without the reader role.
    {
        let pg = read_source
            .connect()
            .await
            .map_err(|e| format!("the page's reads ({}): {e}", read_source.describe()))?;
        store::status(&*pg)
            .await
            .map_err(|e| format!("the page's reads ({}): {e}", read_source.describe()))?;
    }
    let listener = tokio::net::TcpListener::bind(args.http)
        .await
        .map_err(|e| {
            format!(
                "cannot listen on {}: {e}; pick another --http address",
                args.http
            )
        })?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let history_max =
        ((args.history_s * 1000 / args.sample_ms) as usize).clamp(2, HISTORY_SAMPLES_MAX);
    let app = Arc::new(App {
        allowed_hosts: args.allowed_hosts(addr),
        credentials,
        sample_ms: args.sample_ms,
        history_max,
        statement_timeout_ms: args.statement_timeout_ms,
        reads,
        writes,
        source: read_source,
        history: Mutex::new(History::default()),
    });
    if !addr.ip().is_loopback() {
        tracing::warn!(
            addr = %addr,
            "the status page is plain HTTP: tokens cross the network in clear text; put it behind a TLS proxy"
        );
    }
    if addr.ip().is_unspecified() && args.allow_hosts.is_empty() {
        tracing::warn!(addr = %addr, "bound to every interface but no --allow-host given: only requests with Host {addr} or localhost:{} are answered", addr.port());
    }
    if !app.credentials.has_operator() {
        tracing::warn!("no operator token: releases are disabled (SEALPOST_OPERATOR_TOKEN, --operator-token-file or --operator-tokens-file)");
    }
    tracing::info!(tokens = ?app.credentials, hosts = ?app.allowed_hosts, "status page guards");
    let sampler = tokio::spawn(sample_loop(app.clone()));
    let router = router(app);
    println!("status page on http://{addr}/ (Ctrl-C stops it)");
    let served = axum::serve(listener, router)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await;
    sampler.abort();
    served.map_err(|e| format!("the HTTP server stopped: {e}"))
}

/// The routes and their guards. Layers run outside in: the security headers (on every
/// answer, refusals included), the Host check, then, for `/api/*`, the token, before any
/// handler reads a body.
fn router(app: Arc<App>) -> Router {
    let api = Router::new()
        .route("/api/session", get(api_session))
        .route("/api/status", get(api_status))
        .route("/api/history", get(api_history))
        .route("/api/findings", get(api_findings))
        .route("/api/trace", get(api_trace))
        .route("/api/release", post(api_release))
        .route_layer(middleware::from_fn_with_state(app.clone(), require_token));
    Router::new()
        .route("/", get(index))
        .route("/app.js", get(app_js))
        .route("/app.css", get(app_css))
        .merge(api)
        .fallback(|| async { ApiError::NOT_FOUND })
        .layer(DefaultBodyLimit::max(BODY_BYTES_MAX))
        .layer(middleware::from_fn_with_state(app.clone(), check_host))
        .layer(middleware::from_fn(security_headers))
        .with_state(app)
}

/// Adds the security headers to every response.
async fn security_headers(req: Request, next: Next) -> Response {
    let mut r = next.run(req).await;
    let h = r.headers_mut();
    for (k, v) in [
        (header::CONTENT_SECURITY_POLICY, CSP),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::CACHE_CONTROL, "no-store"),
        (header::REFERRER_POLICY, "no-referrer"),
        (
            header::HeaderName::from_static("cross-origin-opener-policy"),
            "same-origin",
        ),
        (
            header::HeaderName::from_static("cross-origin-resource-policy"),
            "same-origin",
        ),
    ] {
        h.insert(k, HeaderValue::from_static(v));
    }
    r
}

/// Refuses (421) a request whose `Host` (or HTTP/2 authority) is not allowed: what a
/// DNS-rebinding page sends is its own name.
async fn check_host(Shared(app): Shared<Arc<App>>, req: Request, next: Next) -> Response {
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or_else(|| req.uri().authority().map(|a| a.to_string()));
    let allowed = host
        .as_deref()
        .map(|h| h.trim().to_ascii_lowercase())
        .is_some_and(|h| app.allowed_hosts.contains(&h));
    if !allowed {
        let shown: String = host
            .unwrap_or_default()
            .chars()
            .take(100)
            .collect::<String>();
        tracing::warn!(host = ?shown, "refused a request for a Host not allowed (--allow-host adds one)");
        return ApiError::HOST.into_response();
    }
    next.run(req).await
}

/// Refuses (401) an `/api/*` request without a valid token, before its body is read; the
/// handler gets the [`Identity`] the token matched.
async fn require_token(Shared(app): Shared<Arc<App>>, mut req: Request, next: Next) -> Response {
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|t| !t.is_empty());
    let Some(given) = given else {
        return ApiError::NO_TOKEN.into_response();
    };
    let Some(who) = app.credentials.identify(given.as_bytes()).cloned() else {
        tracing::warn!(path = %req.uri().path(), "refused a status page request with a wrong token");
        return ApiError::BAD_TOKEN.into_response();
    };
    req.extensions_mut().insert(who);
    next.run(req).await
}

async fn index() -> Html<&'static str> {
    Html(INDEX_HTML)
}

async fn app_js() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        APP_JS,
    )
}

async fn app_css() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], APP_CSS)
}

/// `/api/session`: who the token says the caller is, and whether it may release.
async fn api_session(
    Shared(app): Shared<Arc<App>>,
    Extension(who): Extension<Identity>,
) -> Json<Value> {
    Json(json!({
        "name": who.name,
        "role": match who.role { Role::Reader => "reader", Role::Operator => "operator" },
        "may_release": who.role == Role::Operator,
        "releases_enabled": app.credentials.has_operator(),
    }))
}

/// `/api/status`: exactly what `sealpost status --json` prints.
async fn api_status(Shared(app): Shared<Arc<App>>) -> Result<Json<store::Status>, ApiError> {
    app.deadline(async {
        let pg = app.reads.get().await?;
        store::status(&*pg)
            .await
            .map(Json)
            .map_err(|e| store_error("status", e))
    })
    .await
}

/// `/api/history`: the sampler's ring buffer, oldest first.
async fn api_history(Shared(app): Shared<Arc<App>>) -> Json<Value> {
    let h = app.history.lock().await;
    Json(json!({
        "sample_ms": app.sample_ms,
        "samples_max": app.history_max,
        "samples": h.samples,
        "last_error": h.last_error,
        "last_took_ms": h.last_took_ms,
    }))
}

/// `/api/findings`: the newest findings of the background passes (`sealpost.finding`).
async fn api_findings(Shared(app): Shared<Arc<App>>) -> Result<Json<Value>, ApiError> {
    app.deadline(async {
        let pg = app.reads.get().await?;
        let db = |e: tokio_postgres::Error| store_error("findings", StoreError::from(e));
        let total: i64 = pg
            .query_one("SELECT count(*) FROM sealpost.finding", &[])
            .await
            .map_err(db)?
            .get(0);
        let rows = pg
            .query(
                "SELECT event_id::text, member, kind, detail, at_ms FROM sealpost.finding
                 ORDER BY finding_id DESC LIMIT $1",
                &[&FINDINGS_MAX],
            )
            .await
            .map_err(db)?;
        let findings: Vec<Value> = rows
            .iter()
            .map(|r| {
                json!({"event_id": r.get::<_, String>(0), "member": r.get::<_, i16>(1),
                       "kind": r.get::<_, String>(2), "detail": r.get::<_, String>(3),
                       "at_ms": r.get::<_, i64>(4)})
            })
            .collect();
        Ok(Json(json!({ "total": total, "findings": findings })))
    })
    .await
}

#[derive(Deserialize)]
struct TraceQuery {
    key: Option<String>,
}

/// `/api/trace?key=EVENT-ID` or `?key=TYPE/ID`: what `sealpost trace --json` prints, at most
/// [`TRACE_EVENTS_MAX`] events (`"truncated": true` when there were more).
async fn api_trace(
    Shared(app): Shared<Arc<App>>,
    q: Result<Query<TraceQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let key = q.ok().and_then(|Query(q)| q.key).unwrap_or_default();
    let key = key.trim();
    if key.is_empty() || key.len() > 1_000 {
        return Err(ApiError(
            StatusCode::BAD_REQUEST,
            "give ?key=EVENT-ID or ?key=AGGREGATE-TYPE/AGGREGATE-ID",
        ));
    }
    app.deadline(async {
        let pg = app.reads.get().await?;
        ops::trace_bounded(&pg, key, Some(TRACE_EVENTS_MAX))
            .await
            .map(Json)
            .map_err(|e| store_error("trace", e))
    })
    .await
}

/// The body of `POST /api/release`. An `operator` field, if a client still sends one, is
/// ignored: the operator is whoever's token matched.
#[derive(Deserialize)]
struct ReleaseRequest {
    event_id: String,
    reason: String,
}

/// `POST /api/release` with an operator's `Authorization: Bearer TOKEN` and
/// `{"event_id", "reason"}`: `sealpost release`, audited under the operator's name. The
/// token was checked before the body is read ([`require_token`]); a read token gets 403.
async fn api_release(
    Shared(app): Shared<Arc<App>>,
    Extension(who): Extension<Identity>,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    if who.role != Role::Operator {
        return Err(if app.credentials.has_operator() {
            ApiError::NOT_OPERATOR
        } else {
            ApiError::RELEASES_DISABLED
        });
    }
    let body = body.map_err(|_| {
        ApiError(
            StatusCode::PAYLOAD_TOO_LARGE,
            "the request body is too large or unreadable",
        )
    })?;
    let req: ReleaseRequest = serde_json::from_slice(&body).map_err(|_| {
        ApiError(
            StatusCode::BAD_REQUEST,
            "expected a JSON body {\"event_id\": \"...\", \"reason\": \"...\"}",
        )
    })?;
    let id = EventId::parse(req.event_id.trim()).ok_or(ApiError(
        StatusCode::BAD_REQUEST,
        "that is not an event id (a UUID such as 018f2c1e-...)",
    ))?;
    let reason = req.reason.trim();
    if reason.is_empty() {
        return Err(ApiError(
            StatusCode::BAD_REQUEST,
            "give a reason (what was fixed); it is kept in the audit row",
        ));
    }
    if reason.len() > AUDIT_TEXT_MAX {
        return Err(ApiError(
            StatusCode::BAD_REQUEST,
            "the reason is limited to 500 bytes",
        ));
    }
    let operator = who.name.as_str();
    let released = app
        .deadline(async {
            let mut pg = app.writes.get().await?;
            store::release_quarantine(pg.client_mut(), id, operator, reason)
                .await
                .map_err(|e| store_error("release", e))
        })
        .await?;
    tracing::warn!(event_id = %id, operator, reason, released, "quarantine released from the status page");
    Ok(Json(json!({
        "event_id": id.to_string(),
        "released": released,
        "audit": format!("by {operator}: {reason}"),
    })))
}

/// Samples the status every `sample_ms` (or [`SAMPLE_DUTY_FACTOR`] times the last read's
/// duration, if longer) into the ring buffer, on a read-only session of its own with the
/// same `statement_timeout`. A failure is logged with its cause (when it changes) and shown
/// on the page generically.
async fn sample_loop(app: Arc<App>) {
    let mut pg: Option<PgConn> = None;
    let mut window_end_ms: Option<i64> = None;
    let mut logged: Option<String> = None;
    let period = Duration::from_millis(app.sample_ms);
    let setup = format!(
        "SET statement_timeout = {}; SET default_transaction_read_only = on",
        app.statement_timeout_ms
    );
    loop {
        let began = std::time::Instant::now();
        let mut failure: Option<String> = None;
        if pg.as_ref().is_none_or(|c| c.is_closed()) {
            pg = None;
            match app.source.connect().await {
                Ok(c) => match c.batch_execute(&setup).await {
                    Ok(()) => pg = Some(c),
                    Err(e) => failure = Some(StoreError::from(e).to_string()),
                },
                Err(e) => failure = Some(e.to_string()),
            }
        }
        let mut sample = None;
        if let Some(client) = pg.as_ref() {
            match take_sample(client, window_end_ms, app.sample_ms as i64).await {
                Ok(s) => sample = Some(s),
                Err(e) => {
                    failure = Some(e.to_string());
                    if client.is_closed() {
                        pg = None;
                    }
                }
            }
        }
        if failure != logged {
            match &failure {
                Some(cause) => {
                    tracing::warn!(error = %cause, "the status page's sampler cannot read the status")
                }
                None => tracing::info!("the status page's sampler reads the status again"),
            }
            logged = failure.clone();
        }
        {
            let mut h = app.history.lock().await;
            h.last_took_ms = began.elapsed().as_millis() as u64;
            match sample {
                Some((s, end)) => {
                    window_end_ms = Some(end);
                    h.last_error = None;
                    h.samples.push_back(s);
                    while h.samples.len() > app.history_max {
                        h.samples.pop_front();
                    }
                }
                None => {
                    h.last_error = Some(
                        "the status cannot be read now; the cause is in the server's log".into(),
                    )
                }
            }
        }
        let took = began.elapsed();
        tokio::time::sleep(period.max(took * SAMPLE_DUTY_FACTOR).saturating_sub(took)).await;
    }
}

/// One sample: the status figures, and the latency of rows accepted in
/// `(previous end, now - SETTLE_MS]`. Returns the sample and its window's end.
async fn take_sample(
    pg: &tokio_postgres::Client,
    previous_end_ms: Option<i64>,
    sample_ms: i64,
) -> Result<(Sample, i64), StoreError> {
    let s = store::status(pg).await?;
    let now_ms = store::db_now_ms(pg).await? as i64;
    let end_ms = now_ms - SETTLE_MS;
    let start_ms = previous_end_ms.unwrap_or(end_ms - sample_ms);
    let r = pg
        .query_one(
            "SELECT count(*),
                    percentile_disc(0.5) WITHIN GROUP (ORDER BY lat_ms),
                    percentile_disc(0.99) WITHIN GROUP (ORDER BY lat_ms)
             FROM (SELECT published_at_ms, published_at_ms - created_at_ms AS lat_ms
                   FROM sealpost.work ORDER BY event_id DESC, member DESC LIMIT $3) newest
             WHERE published_at_ms > $1 AND published_at_ms <= $2",
            &[&start_ms, &end_ms, &LATENCY_ROWS_MAX],
        )
        .await?;
    let backlog = BACKLOG_STATES
        .iter()
        .map(|st| s.states.get(st.as_str()).copied().unwrap_or(0))
        .sum();
    Ok((
        Sample {
            at_ms: now_ms,
            backlog,
            oldest_pending_s: s.oldest_pending_s,
            unknown: s.unknown,
            oldest_unknown_s: s.oldest_unknown_s,
            published: r.get(0),
            latency_ms_p50: r.get(1),
            latency_ms_p99: r.get(2),
        },
        end_ms,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(name: &str) -> Identity {
        Identity {
            role: Role::Operator,
            name: name.into(),
        }
    }

    fn reader() -> Identity {
        Identity {
            role: Role::Reader,
            name: "reader".into(),
        }
    }

    #[test]
    fn a_reader_login_is_never_shown_with_its_password() {
        let d: Dsn = "host=db user=status_page password=hunter2-secret dbname=app"
            .parse()
            .unwrap();
        let shown = format!("{d:?}");
        assert!(!shown.contains("hunter2-secret"), "{shown}");
        assert!(shown.contains("user=status_page"), "{shown}");
    }

    #[test]
    fn tokens_compare_whole_and_name_their_identity() {
        let c = Credentials::new([
            (
                "r".to_string(),
                reader(),
                "read-token-0123456789".to_string(),
            ),
            (
                "a".to_string(),
                op("alice"),
                "alice-token-0123456789".to_string(),
            ),
            (
                "b".to_string(),
                op("bob"),
                "bob-token-0123456789ab".to_string(),
            ),
        ])
        .unwrap();
        assert_eq!(c.identify(b"alice-token-0123456789").unwrap().name, "alice");
        assert_eq!(c.identify(b"bob-token-0123456789ab").unwrap().name, "bob");
        assert_eq!(
            c.identify(b"read-token-0123456789").unwrap().role,
            Role::Reader
        );
        for wrong in [
            &b"alice-token-012345678"[..],
            b"alice-token-01234567890",
            b"alice-token-0123456788",
            b"",
        ] {
            assert!(c.identify(wrong).is_none(), "{wrong:?}");
        }
    }

    #[test]
    fn weak_or_shared_tokens_and_bad_names_are_refused() {
        let short = Credentials::new([("r".into(), reader(), "short".into())]).unwrap_err();
        assert!(short.contains("shorter than 16"), "{short}");
        assert!(!short.contains("short\""), "{short}");
        let same = Credentials::new([
            ("r".into(), reader(), "same-token-0123456789".into()),
            ("a".into(), op("alice"), "same-token-0123456789".into()),
        ])
        .unwrap_err();
        assert!(same.contains("each must be different"), "{same}");
        assert!(!same.contains("same-token"), "{same}");
        let twice = Credentials::new([
            ("a".into(), op("alice"), "alice-token-0123456789".into()),
            ("b".into(), op("alice"), "alice-token-9876543210".into()),
        ])
        .unwrap_err();
        assert!(twice.contains("two tokens"), "{twice}");
        let bad = Credentials::new([("a".into(), op("a b"), "alice-token-0123456789".into())])
            .unwrap_err();
        assert!(bad.contains("operator name"), "{bad}");
    }
}
