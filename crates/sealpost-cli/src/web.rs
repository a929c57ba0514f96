//! `sealpost serve`: the operator's status page (issue 10) and the JSON endpoints behind it.
//!
//! Every figure comes from the functions the command line uses: `/api/status` is
//! [`store::status`] (what `sealpost status --json` prints), `/api/trace` is [`ops::trace`],
//! and `POST /api/release` is [`store::release_quarantine`] (what `sealpost release` runs,
//! audit row included). What this module adds is a sampler that reads the status every
//! `--sample-ms` into a bounded ring buffer (backlog, ages, and the publish latency of the rows
//! accepted since the previous sample) for the page's chart, and the operator token that
//! guards the one write.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State as Shared};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use sealpost::runtime;
use sealpost::runtime::Config;
use sealpost::store::{self, StoreError};
use sealpost_core::envelope::EventId;
use sealpost_core::state::State;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::Mutex;

use crate::ops;

/// The page: one HTML file with its script inline (no CDN; the page works offline).
const INDEX_HTML: &str = include_str!("web/index.html");

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
/// Longest operator name and reason accepted by `POST /api/release` (kept in the audit row).
pub const AUDIT_TEXT_MAX: usize = 500;

/// The states of rows that are not yet published and not parked: the backlog on the chart.
const BACKLOG_STATES: [State; 6] = [
    State::Pending,
    State::Claimed,
    State::Sending,
    State::RetryClaimed,
    State::DispatchUnknown,
    State::Reconciling,
];

/// `sealpost serve` flags. Their `Debug` never shows the operator token.
#[derive(clap::Args, Clone)]
pub struct ServeArgs {
    /// Address to listen on (plain HTTP: keep it on loopback or behind a TLS proxy).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub http: SocketAddr,
    /// Token an operator must present to release a quarantined row; without one, releases
    /// are disabled.
    #[arg(long, env = "SEALPOST_OPERATOR_TOKEN", hide_env_values = true)]
    pub operator_token: Option<String>,
    /// File holding the operator token (one trailing newline ignored), so that the token is
    /// in neither the command line nor the environment.
    #[arg(
        long,
        env = "SEALPOST_OPERATOR_TOKEN_FILE",
        conflicts_with = "operator_token"
    )]
    pub operator_token_file: Option<std::path::PathBuf>,
    /// How often the server samples the status for the chart (ms).
    #[arg(long, default_value_t = 2_000, value_parser = clap::value_parser!(u64).range(100..=60_000))]
    pub sample_ms: u64,
    /// How much history the chart keeps (s).
    #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(10..=86_400))]
    pub history_s: u64,
}

impl std::fmt::Debug for ServeArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServeArgs")
            .field("http", &self.http)
            .field(
                "operator_token",
                &self
                    .operator_token
                    .as_ref()
                    .map(|_| sealpost::secret::REDACTED),
            )
            .field("operator_token_file", &self.operator_token_file)
            .field("sample_ms", &self.sample_ms)
            .field("history_s", &self.history_s)
            .finish()
    }
}

impl ServeArgs {
    /// The operator token: `--operator-token` (or `SEALPOST_OPERATOR_TOKEN`), else the
    /// contents of `--operator-token-file` (or `SEALPOST_OPERATOR_TOKEN_FILE`), else none.
    /// An unreadable or empty file is an error that names the file, never its contents.
    pub fn token(&self) -> Result<Option<String>, String> {
        if self.operator_token.is_some() {
            return Ok(self.operator_token.clone());
        }
        match &self.operator_token_file {
            None => Ok(None),
            Some(path) => sealpost::secret::read_secret_file("--operator-token-file", path)
                .map(Some)
                .map_err(|e| e.to_string()),
        }
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

/// What the handlers share.
struct App {
    database_url: String,
    operator_token: Option<String>,
    sample_ms: u64,
    history_max: usize,
    /// The handlers' connection, opened again when it closed.
    pg: Mutex<Option<tokio_postgres::Client>>,
    history: Mutex<History>,
}

#[derive(Default)]
struct History {
    samples: VecDeque<Sample>,
    /// The sampler's last failure, shown on the page until a sample succeeds.
    last_error: Option<String>,
    /// How long the last sample took (ms).
    last_took_ms: u64,
}

/// An error answered as `{"error": "..."}` with its status code.
struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.0, Json(json!({ "error": self.1 }))).into_response();
        if self.0 == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
        }
        r
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        let code = match &e {
            StoreError::UnknownEvent(_) => StatusCode::NOT_FOUND,
            StoreError::NotQuarantined { .. } => StatusCode::CONFLICT,
            StoreError::NotMigrated => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError(code, e.to_string())
    }
}

impl From<runtime::RunError> for ApiError {
    fn from(e: runtime::RunError) -> Self {
        ApiError(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
    }
}

impl App {
    /// The handlers' connection (one request at a time uses it), reconnecting if it closed.
    async fn client(
        &self,
    ) -> Result<tokio::sync::MutexGuard<'_, Option<tokio_postgres::Client>>, ApiError> {
        let mut g = self.pg.lock().await;
        if g.as_ref().is_none_or(|c| c.is_closed()) {
            *g = Some(runtime::pg_connect(&self.database_url).await?);
        }
        Ok(g)
    }
}

/// Runs the status page until Ctrl-C. Fails early, with the cause, when the database is
/// unreachable or not migrated, or the address cannot be bound.
pub async fn serve(cfg: &Config, args: ServeArgs) -> Result<(), String> {
    let operator_token = args.token()?;
    if operator_token.as_deref() == Some("") {
        return Err(
            "the operator token is empty; give a secret with --operator-token, SEALPOST_OPERATOR_TOKEN or --operator-token-file, or leave them unset to disable releases"
                .into(),
        );
    }
    let pg = runtime::pg_connect(&cfg.database_url)
        .await
        .map_err(|e| e.to_string())?;
    store::status(&pg).await.map_err(|e| e.to_string())?;
    let history_max =
        ((args.history_s * 1000 / args.sample_ms) as usize).clamp(2, HISTORY_SAMPLES_MAX);
    let app = Arc::new(App {
        database_url: cfg.database_url.clone(),
        operator_token,
        sample_ms: args.sample_ms,
        history_max,
        pg: Mutex::new(Some(pg)),
        history: Mutex::new(History::default()),
    });
    let listener = tokio::net::TcpListener::bind(args.http)
        .await
        .map_err(|e| {
            format!(
                "cannot listen on {}: {e}; pick another --http address",
                args.http
            )
        })?;
    if !args.http.ip().is_loopback() {
        tracing::warn!(
            addr = %args.http,
            "the status page is plain HTTP: the operator token crosses the network in clear text; put it behind a TLS proxy"
        );
    }
    if app.operator_token.is_none() {
        tracing::warn!("no operator token: releases are disabled (--operator-token or SEALPOST_OPERATOR_TOKEN)");
    }
    let sampler = tokio::spawn(sample_loop(app.clone()));
    let router = Router::new()
        .route("/", get(index))
        .route("/api/status", get(api_status))
        .route("/api/history", get(api_history))
        .route("/api/findings", get(api_findings))
        .route("/api/trace", get(api_trace))
        .route("/api/release", post(api_release))
        .with_state(app);
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    println!("status page on http://{addr}/ (Ctrl-C stops it)");
    let served = axum::serve(listener, router)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await;
    sampler.abort();
    served.map_err(|e| format!("the HTTP server stopped: {e}"))
}

async fn index() -> Html<&'static str> {
    Html(INDEX_HTML)
}

/// `/api/status`: exactly what `sealpost status --json` prints.
async fn api_status(Shared(app): Shared<Arc<App>>) -> Result<Json<store::Status>, ApiError> {
    let g = app.client().await?;
    let pg = g.as_ref().expect("connected by client()");
    Ok(Json(store::status(pg).await?))
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
    let g = app.client().await?;
    let pg = g.as_ref().expect("connected by client()");
    let db = |e: tokio_postgres::Error| ApiError::from(StoreError::from(e));
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
}

#[derive(Deserialize)]
struct TraceQuery {
    key: Option<String>,
}

/// `/api/trace?key=EVENT-ID` or `?key=TYPE/ID`: what `sealpost trace --json` prints.
async fn api_trace(
    Shared(app): Shared<Arc<App>>,
    Query(q): Query<TraceQuery>,
) -> Result<Json<Value>, ApiError> {
    let key = q.key.unwrap_or_default();
    let key = key.trim();
    if key.is_empty() {
        return Err(ApiError(
            StatusCode::BAD_REQUEST,
            "give ?key=EVENT-ID or ?key=AGGREGATE-TYPE/AGGREGATE-ID".into(),
        ));
    }
    let g = app.client().await?;
    let pg = g.as_ref().expect("connected by client()");
    Ok(Json(ops::trace(pg, key).await?))
}

#[derive(Deserialize)]
struct ReleaseRequest {
    event_id: String,
    reason: String,
    operator: Option<String>,
}

/// Compares without stopping at the first differing byte.
fn same_token(given: &str, expected: &str) -> bool {
    given.len() == expected.len()
        && given
            .bytes()
            .zip(expected.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

/// `POST /api/release` with `Authorization: Bearer TOKEN` and
/// `{"event_id", "reason", "operator"}`: `sealpost release`, audited. Checks the token before
/// it reads anything: 403 when releases are disabled or the token is wrong, 401 when none
/// was given.
async fn api_release(
    Shared(app): Shared<Arc<App>>,
    headers: HeaderMap,
    Json(req): Json<ReleaseRequest>,
) -> Result<Json<Value>, ApiError> {
    let Some(expected) = app.operator_token.as_deref() else {
        return Err(ApiError(
            StatusCode::FORBIDDEN,
            "releases are disabled: this server was started without an operator token; restart `sealpost serve` with --operator-token (or SEALPOST_OPERATOR_TOKEN), or run `sealpost release`".into(),
        ));
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|t| !t.is_empty());
    match given {
        None => {
            return Err(ApiError(
                StatusCode::UNAUTHORIZED,
                "an operator token is required to release (Authorization: Bearer TOKEN); nothing was changed".into(),
            ))
        }
        Some(t) if !same_token(t, expected) => {
            return Err(ApiError(
                StatusCode::FORBIDDEN,
                "the operator token is wrong; nothing was changed".into(),
            ))
        }
        Some(_) => {}
    }
    let id = EventId::parse(req.event_id.trim()).ok_or_else(|| {
        ApiError(
            StatusCode::BAD_REQUEST,
            format!(
                "`{}` is not an event id (a UUID such as 018f2c1e-...)",
                req.event_id
            ),
        )
    })?;
    let reason = req.reason.trim();
    let operator = req.operator.as_deref().map(str::trim).unwrap_or("");
    let operator = if operator.is_empty() {
        "web operator"
    } else {
        operator
    };
    if reason.is_empty() {
        return Err(ApiError(
            StatusCode::BAD_REQUEST,
            "give a reason (what was fixed); it is kept in the audit row".into(),
        ));
    }
    if reason.len() > AUDIT_TEXT_MAX || operator.len() > AUDIT_TEXT_MAX {
        return Err(ApiError(
            StatusCode::BAD_REQUEST,
            format!("the operator name and the reason are limited to {AUDIT_TEXT_MAX} bytes each"),
        ));
    }
    let mut g = app.client().await?;
    let pg = g.as_mut().expect("connected by client()");
    let released = store::release_quarantine(pg, id, operator, reason).await?;
    tracing::warn!(event_id = %id, operator, reason, released, "quarantine released from the status page");
    Ok(Json(json!({
        "event_id": id.to_string(),
        "released": released,
        "audit": format!("by {operator}: {reason}"),
    })))
}

/// Samples the status every `sample_ms` (or [`SAMPLE_DUTY_FACTOR`] times the last read's
/// duration, if longer) into the ring buffer, on a connection of its own.
async fn sample_loop(app: Arc<App>) {
    let mut pg: Option<tokio_postgres::Client> = None;
    let mut window_end_ms: Option<i64> = None;
    let period = Duration::from_millis(app.sample_ms);
    loop {
        let began = std::time::Instant::now();
        if pg.as_ref().is_none_or(|c| c.is_closed()) {
            match runtime::pg_connect(&app.database_url).await {
                Ok(c) => pg = Some(c),
                Err(e) => {
                    // The cause (redacted, `RunError::Connect`), not the "connection closed"
                    // the old client would answer.
                    pg = None;
                    let mut h = app.history.lock().await;
                    h.last_error = Some(e.to_string());
                    h.last_took_ms = began.elapsed().as_millis() as u64;
                }
            }
        }
        if let Some(client) = pg.as_ref() {
            let sample = take_sample(client, window_end_ms, app.sample_ms as i64).await;
            let mut h = app.history.lock().await;
            h.last_took_ms = began.elapsed().as_millis() as u64;
            match sample {
                Ok((s, end)) => {
                    window_end_ms = Some(end);
                    h.last_error = None;
                    h.samples.push_back(s);
                    while h.samples.len() > app.history_max {
                        h.samples.pop_front();
                    }
                }
                Err(e) => {
                    h.last_error = Some(e.to_string());
                    // A dead connection is dropped now, so the next round connects anew and
                    // reports why it cannot.
                    if client.is_closed() {
                        pg = None;
                    }
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
    use super::same_token;

    #[test]
    fn tokens_compare_whole() {
        assert!(same_token("s3cret", "s3cret"));
        assert!(!same_token("s3cre", "s3cret"));
        assert!(!same_token("s3creT", "s3cret"));
        assert!(!same_token("", "s3cret"));
    }
}
