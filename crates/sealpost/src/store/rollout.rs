//! Rollout of a dispatcher implementation (R25): the implementations' announcements, the
//! routes' aliases as the claim reads them, and the commands that switch an alias
//! ([`sealpost_core::rollout`] decides; this module loads and persists).

use super::*;
use sealpost_core::rollout::{self, Alias, Implementation, Side, Stage, Switch};

/// The columns of `sealpost.rollout` in [`alias_of`]'s order.
const ALIAS_COLS: &str =
    "route, cluster, topic, incumbent, candidate, stage, types, share, generation, updated_at_ms";

fn alias_of(r: &tokio_postgres::Row) -> Result<Alias> {
    let stage: String = r.get(5);
    Ok(Alias {
        route: r.get(0),
        cluster: r.get(1),
        topic: r.get(2),
        incumbent: r.get(3),
        candidate: r.get(4),
        stage: Stage::parse(&stage)
            .ok_or_else(|| StoreError::Corrupt(format!("rollout stage `{stage}`")))?,
        types: r.get(6),
        share: r.get::<_, i16>(7).clamp(1, 100) as u8,
        generation: r.get::<_, i64>(8) as u64,
    })
}

/// The claim's first statement: the transaction's planner settings, the database's
/// [`Horizon`] (a snapshot's bounds, then the commit-position sequence's last value), then the
/// aliases read through `sealpost.rollout_aliases()`, which holds the rollout table in SHARE
/// mode until the claim commits (a switch waits for it; every later claim sees the switch).
/// One round trip (the simple query protocol carries all three).
pub(super) async fn claim_settings_and_aliases(
    tx: &Transaction<'_>,
) -> Result<(Vec<Alias>, Horizon)> {
    counted(1);
    // The horizon's statement runs before the pick's, so the pick's snapshot is newer:
    // whatever was final for the horizon is visible to the pick (`ScanHorizon`).
    let msgs = tx
        .simple_query(
            "SET LOCAL enable_bitmapscan = off; SET LOCAL enable_seqscan = off;
             SET LOCAL plan_cache_mode = force_custom_plan;
             SELECT pg_snapshot_xmin(s)::text, pg_snapshot_xmax(s)::text,
                    coalesce(pg_sequence_last_value('sealpost.committed_seq'), 0)::text
               FROM pg_current_snapshot() s;
             SELECT coalesce(json_agg(a), '[]')::text FROM sealpost.rollout_aliases() a",
        )
        .await?;
    let mut rows = msgs.iter().filter_map(|m| match m {
        tokio_postgres::SimpleQueryMessage::Row(r) => Some(r),
        _ => None,
    });
    let horizon = rows
        .next()
        .and_then(|r| {
            let n = |i| r.get(i).and_then(|v: &str| v.parse::<u64>().ok());
            Some(Horizon {
                xmin: n(0)?,
                xmax: n(1)?,
                last_position: n(2)?,
            })
        })
        .ok_or_else(|| StoreError::Corrupt("claim horizon: no snapshot bounds".into()))?;
    let text = rows
        .next()
        .and_then(|r| r.get(0).map(str::to_string))
        .unwrap_or_else(|| "[]".to_string());
    let aliases = serde_json::from_str(&text)
        .map_err(|e| StoreError::Corrupt(format!("rollout aliases: {e}")))?;
    Ok((aliases, horizon))
}

/// The claim filter's parameter: for each destination where `implementation` claims only
/// part of the rows, which part ([`rollout::slices`]); `None` when it may claim every row
/// the other predicates allow (no rollout touches it: the filter is planned away).
pub(super) fn slices_param(
    aliases: &[Alias],
    implementation: &Implementation,
) -> Option<serde_json::Value> {
    let slices = rollout::slices(aliases, implementation);
    if slices.is_empty() {
        return None;
    }
    Some(serde_json::Value::Array(
        slices
            .into_iter()
            .map(|s| {
                let (types, share) = match &s.side {
                    Side::Nothing => (Vec::new(), 0),
                    Side::Within { types, share } | Side::Outside { types, share } => {
                        (types.clone(), *share)
                    }
                };
                serde_json::json!({
                    "cluster": s.cluster,
                    "topic": s.topic,
                    "side": s.side.name(),
                    "types": types,
                    "share": share,
                })
            })
            .collect(),
    ))
}

/// [`rollout::share_bucket`] in SQL, over the envelope `e` (the claim filter's copy; the
/// claim step checks every picked row against the core's, and a test pins both).
pub(super) fn share_bucket_sql(e: &str) -> String {
    format!(
        "(('x' || substr(encode(sha256(convert_to({e}.aggregate_type || '/' || {e}.aggregate_id, 'UTF8')), 'hex'), 1, 7))::bit(28)::int % 100)"
    )
}

/// The claim's alias and protocol filter over the work row `w`: `$6`..`$8` are the lowest
/// and highest protocol spoken and the slices ([`slices_param`]). A row is excluded when a
/// slice of its destination does not take it ([`Side::takes`] in SQL).
pub(super) fn alias_filter_sql() -> String {
    let bucket = share_bucket_sql("ae");
    format!(
        "AND w.protocol BETWEEN $6 AND $7
         AND ($8::jsonb IS NULL OR NOT EXISTS (
             SELECT 1 FROM sealpost.envelope ae
               JOIN jsonb_to_recordset($8::jsonb)
                    AS s(cluster text, topic text, side text, types text[], share int)
                 ON s.cluster = ae.dest_cluster AND s.topic = ae.dest_topic
              WHERE ae.event_id = w.event_id AND ae.member = w.member
                AND ae.envelope_generation = w.envelope_generation
                AND NOT CASE s.side
                    WHEN 'nothing' THEN false
                    WHEN 'within' THEN (ae.event_type = ANY(s.types) AND {bucket} < s.share)
                    ELSE NOT (ae.event_type = ANY(s.types) AND {bucket} < s.share) END))"
    )
}

/// The role a process announces itself in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A dispatcher (claims and sends).
    Dispatcher,
    /// A reconciler.
    Reconciler,
    /// A CDC publisher (claims the rows the database log names).
    Cdc,
}

impl Role {
    /// The stored name.
    pub fn name(self) -> &'static str {
        match self {
            Role::Dispatcher => "dispatcher",
            Role::Reconciler => "reconciler",
            Role::Cdc => "cdc",
        }
    }
}

/// Records that process `owner` runs `implementation` in `role` for `cluster`: `sealpost
/// rollout status` lists it, and `rollout shadow` takes the incumbent from it.
pub async fn announce(
    client: &impl GenericClient,
    owner: u64,
    implementation: &Implementation,
    role: Role,
    cluster: &str,
) -> Result<()> {
    counted(1);
    client
        .execute(
            &format!(
                "INSERT INTO sealpost.implementation
                   (owner, implementation, role, cluster, protocol_min, protocol_max,
                    started_at_ms, seen_at_ms)
                 VALUES ($1, $2, $3, $4, $5, $6, {NOW_MS_SQL}, {NOW_MS_SQL})
                 ON CONFLICT (owner) DO UPDATE SET implementation = excluded.implementation,
                   role = excluded.role, cluster = excluded.cluster,
                   protocol_min = excluded.protocol_min, protocol_max = excluded.protocol_max,
                   seen_at_ms = excluded.seen_at_ms"
            ),
            &[
                &(owner as i64),
                &implementation.id,
                &role.name(),
                &cluster,
                &(implementation.protocol_min as i16),
                &(implementation.protocol_max as i16),
            ],
        )
        .await?;
    Ok(())
}

/// A rollout command (`sealpost rollout ...`).
#[derive(Clone, Debug)]
pub enum RolloutCommand {
    /// `shadow --candidate ID [--incumbent ID]`.
    Shadow {
        /// The candidate.
        candidate: String,
        /// The incumbent, when the route has no record yet (default: the one
        /// implementation announced by the dispatchers of its cluster).
        incumbent: Option<String>,
    },
    /// `takeover --candidate ID --types T,... --share N`.
    Takeover {
        /// The candidate.
        candidate: String,
        /// Event types.
        types: Vec<String>,
        /// Percentage of aggregates.
        share: u32,
    },
    /// `promote`.
    Promote,
    /// `rollback`.
    Rollback,
}

impl RolloutCommand {
    /// The command's name.
    pub fn name(&self) -> &'static str {
        match self {
            RolloutCommand::Shadow { .. } => "shadow",
            RolloutCommand::Takeover { .. } => "takeover",
            RolloutCommand::Promote => "promote",
            RolloutCommand::Rollback => "rollback",
        }
    }
}

/// A route's alias as shown (`rollout status`, the page, `--json`): the record, flattened,
/// and who claims what in words.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct AliasView {
    /// The record.
    #[serde(flatten)]
    pub alias: Alias,
    /// Who claims what, in words (`rollout status`, `status`, the page; empty in the log).
    pub claims: String,
}

/// Who claims a route's rows under `a`, in words.
fn claims_of(a: &Alias) -> String {
    let candidate = a.candidate.as_deref().unwrap_or("-");
    match a.stage {
        Stage::Shadow => format!(
            "{} claims every row; {candidate} in shadow claims none",
            a.incumbent
        ),
        Stage::Takeover => format!(
            "{candidate} claims {} at {}% of aggregates; {} the rest",
            a.types.join(","),
            a.share,
            a.incumbent
        ),
        Stage::Promoted => format!(
            "{candidate} claims every row (rollback target: {})",
            a.incumbent
        ),
        Stage::Incumbent => format!("{} claims every row", a.incumbent),
    }
}

impl From<&Alias> for AliasView {
    fn from(a: &Alias) -> Self {
        AliasView {
            claims: claims_of(a),
            alias: a.clone(),
        }
    }
}

/// What a rollout command did.
#[derive(Clone, Debug, serde::Serialize)]
pub struct RolloutChange {
    /// The route.
    pub route: String,
    /// The command.
    pub command: String,
    /// The alias before (none: the route had no rollout record).
    pub before: Option<AliasView>,
    /// The alias after (none: still no record).
    pub after: Option<AliasView>,
    /// Whether the alias moved (false: it already was what the command asks).
    pub changed: bool,
    /// What an operator should know: an implementation that now claims rows of the route
    /// has no dispatcher on its cluster announced in the last two minutes (its rows wait
    /// until one runs).
    pub warnings: Vec<String>,
}

/// Dispatchers are "seen lately" when they announced within this (four renewals).
const SEEN_LATELY_MS: i64 = 120_000;

/// The warnings of a switch to `a`: every implementation that claims rows under it and has
/// no dispatcher of its cluster seen lately.
async fn claimant_warnings(tx: &Transaction<'_>, a: &Alias) -> Result<Vec<String>> {
    let mut claimants = vec![a.incumbent.as_str()];
    match (a.stage, a.candidate.as_deref()) {
        (Stage::Takeover, Some(c)) => claimants.push(c),
        (Stage::Promoted, Some(c)) => claimants = vec![c],
        _ => {}
    }
    let mut out = Vec::new();
    for c in claimants {
        let seen: i64 = tx
            .query_one(
                &format!(
                    "SELECT count(*) FROM sealpost.implementation
                      WHERE implementation = $1 AND cluster = $2 AND role IN ('dispatcher', 'cdc')
                        AND seen_at_ms > {NOW_MS_SQL} - $3"
                ),
                &[&c, &a.cluster, &SEEN_LATELY_MS],
            )
            .await?
            .get(0);
        if seen == 0 {
            out.push(format!(
                "no dispatcher of \"{c}\" on cluster `{}` announced itself in the last {} s: the rows it now claims wait until one runs",
                a.cluster,
                SEEN_LATELY_MS / 1_000
            ));
        }
    }
    Ok(out)
}

/// Runs a rollout command on `route` in one transaction: the record is locked, the core
/// decides ([`Alias::shadow`], [`Alias::takeover`], [`Alias::promote`], [`Alias::rollback`]),
/// and a switch is written with its log entry. The write waits for the claims under way
/// (they hold the table in SHARE mode) and every later claim sees it.
pub async fn rollout(
    client: &mut tokio_postgres::Client,
    route: &str,
    command: &RolloutCommand,
) -> Result<RolloutChange> {
    let tx = client.transaction().await?;
    // Two commands on one route run one after the other, also a route's first two (which
    // have no record to lock yet).
    tx.execute(
        "SELECT pg_advisory_xact_lock(hashtext('sealpost.rollout'), hashtext($1))",
        &[&route],
    )
    .await?;
    let policy = tx
        .query_opt(
            "SELECT cluster, topic FROM sealpost.route_policy WHERE name = $1",
            &[&route],
        )
        .await?
        .ok_or_else(|| StoreError::NoRoutePolicy(route.to_string()))?;
    let (cluster, topic): (String, String) = (policy.get(0), policy.get(1));
    let before = match tx
        .query_opt(
            &format!("SELECT {ALIAS_COLS} FROM sealpost.rollout WHERE route = $1 FOR UPDATE"),
            &[&route],
        )
        .await?
    {
        Some(r) => Some(alias_of(&r)?),
        None => None,
    };
    let by_core = |e: rollout::RolloutError| refused(e);
    // A route without a record is at stage `incumbent`; only `shadow` names one (the
    // others are refused by the core or change nothing).
    let current = match (&before, command) {
        (Some(a), _) => a.clone(),
        (
            None,
            RolloutCommand::Shadow {
                candidate,
                incumbent,
            },
        ) => {
            rollout::check_id(candidate).map_err(by_core)?;
            let incumbent = match incumbent {
                Some(i) => {
                    rollout::check_id(i).map_err(by_core)?;
                    i.clone()
                }
                None => announced_incumbent(&tx, &cluster, candidate).await?,
            };
            Alias::new(route, &cluster, &topic, &incumbent)
        }
        (None, _) => Alias::new(route, &cluster, &topic, ""),
    };
    match (command, current.stage, &current.candidate) {
        (RolloutCommand::Promote, Stage::Takeover, Some(c)) => {
            check_evidence(&tx, route, c, true).await?
        }
        (RolloutCommand::Takeover { candidate, .. }, Stage::Shadow | Stage::Takeover, _) => {
            check_evidence(&tx, route, candidate, false).await?
        }
        _ => {}
    }
    let switch = match command {
        RolloutCommand::Shadow { candidate, .. } => current.shadow(candidate),
        RolloutCommand::Takeover {
            candidate,
            types,
            share,
        } => current.takeover(candidate, types, *share),
        RolloutCommand::Promote => current.promote(),
        RolloutCommand::Rollback => Ok(current.rollback()),
    }
    .map_err(by_core)?;
    let starts_shadow = matches!(command, RolloutCommand::Shadow { .. })
        && !matches!(current.stage, Stage::Shadow | Stage::Takeover);
    let after = match switch {
        Switch::Unchanged => {
            tx.rollback().await?;
            return Ok(RolloutChange {
                route: route.to_string(),
                command: command.name().to_string(),
                after: before.as_ref().map(AliasView::from),
                before: before.as_ref().map(AliasView::from),
                changed: false,
                warnings: Vec::new(),
            });
        }
        Switch::To(a) => a,
    };
    tx.execute(
        &format!(
            "INSERT INTO sealpost.rollout ({ALIAS_COLS})
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, {NOW_MS_SQL})
             ON CONFLICT (route) DO UPDATE SET incumbent = excluded.incumbent,
               candidate = excluded.candidate, stage = excluded.stage, types = excluded.types,
               share = excluded.share, generation = excluded.generation,
               updated_at_ms = excluded.updated_at_ms"
        ),
        &[
            &after.route,
            &after.cluster,
            &after.topic,
            &after.incumbent,
            &after.candidate,
            &after.stage.name(),
            &after.types,
            &(after.share as i16),
            &(after.generation as i64),
        ],
    )
    .await
    .map_err(|e| match e.as_db_error() {
        Some(d) if *d.code() == tokio_postgres::error::SqlState::UNIQUE_VIOLATION => {
            refused(format!(
                "another route already has a rollout on {}/{}: one alias per destination",
                after.cluster, after.topic
            ))
        }
        _ => StoreError::from(e),
    })?;
    tx.execute(
        &format!(
            "INSERT INTO sealpost.rollout_log
               (route, command, generation, stage, incumbent, candidate, types, share, at_ms)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, {NOW_MS_SQL})"
        ),
        &[
            &after.route,
            &command.name(),
            &(after.generation as i64),
            &after.stage.name(),
            &after.incumbent,
            &after.candidate,
            &after.types,
            &(after.share as i16),
        ],
    )
    .await?;
    if starts_shadow {
        // A new rollout of this candidate: its shadow starts a new tally (from the newest
        // row, at its next read), so nothing an earlier shadow compared counts for it.
        if let Some(c) = &after.candidate {
            tx.execute(
                "DELETE FROM sealpost.shadow_tally WHERE route = $1 AND candidate = $2",
                &[&route, c],
            )
            .await?;
        }
    }
    let warnings = claimant_warnings(&tx, &after).await?;
    tx.commit().await?;
    for w in &warnings {
        tracing::warn!(route, "{w}");
    }
    Ok(RolloutChange {
        route: route.to_string(),
        command: command.name().to_string(),
        before: before.as_ref().map(AliasView::from),
        after: Some(AliasView::from(&after)),
        changed: true,
        warnings,
    })
}

/// A refused rollout command.
fn refused(why: impl std::fmt::Display) -> StoreError {
    StoreError::Rollout(format!("rollout refused, the alias is unchanged: {why}"))
}

/// The incumbent of a route without a record: the one implementation other than
/// `candidate` that the dispatchers of `cluster` announced.
async fn announced_incumbent(
    tx: &Transaction<'_>,
    cluster: &str,
    candidate: &str,
) -> Result<String> {
    let ids: Vec<String> = tx
        .query(
            &format!(
                "SELECT DISTINCT implementation FROM sealpost.implementation
                  WHERE role IN ('dispatcher', 'cdc') AND cluster = $1 AND implementation <> $2
                    AND seen_at_ms > {NOW_MS_SQL} - $3
                  ORDER BY 1"
            ),
            &[&cluster, &candidate, &SEEN_LATELY_MS],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    match ids.as_slice() {
        [one] => Ok(one.clone()),
        [] => Err(refused(format!(
            "no dispatcher of cluster `{cluster}` other than \"{candidate}\" announced itself in the last {} s; name the incumbent with --incumbent",
            SEEN_LATELY_MS / 1_000
        ))),
        many => Err(refused(format!(
            "the dispatchers of cluster `{cluster}` seen in the last {} s run several implementations ({}); name the incumbent with --incumbent",
            SEEN_LATELY_MS / 1_000,
            many.join(", ")
        ))),
    }
}

/// An announced process.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Announced {
    /// Owner id.
    pub owner: u64,
    /// Implementation id.
    pub implementation: String,
    /// Role.
    pub role: String,
    /// Cluster.
    pub cluster: String,
    /// Protocol versions spoken.
    pub protocol_min: u16,
    /// Protocol versions spoken.
    pub protocol_max: u16,
    /// Last announcement (database clock).
    pub seen_at_ms: u64,
}

/// One switch of the log.
#[derive(Clone, Debug, serde::Serialize)]
pub struct RolloutLogEntry {
    /// Route.
    pub route: String,
    /// Command.
    pub command: String,
    /// The alias after it.
    pub alias: AliasView,
    /// Login that ran it.
    pub by_login: String,
    /// When (database clock).
    pub at_ms: u64,
}

/// Every rollout's state (`sealpost rollout status`, `status().rollout`, the page).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct RolloutStatus {
    /// Every alias.
    pub aliases: Vec<AliasView>,
    /// Every announced process, latest first.
    pub implementations: Vec<Announced>,
    /// The last 20 switches, latest first.
    pub log: Vec<RolloutLogEntry>,
    /// Every shadow's comparison.
    pub shadows: Vec<ShadowView>,
}

/// Every route's alias (a plain read: no lock, unlike a claim's).
pub async fn aliases(client: &impl GenericClient) -> Result<Vec<AliasView>> {
    client
        .query(
            &format!("SELECT {ALIAS_COLS} FROM sealpost.rollout ORDER BY route"),
            &[],
        )
        .await?
        .iter()
        .map(|r| alias_of(r).map(|a| AliasView::from(&a)))
        .collect()
}

/// The aliases, the announcements, the shadows and the latest switches (`sealpost
/// rollout status`, the page).
pub async fn rollout_status(client: &impl GenericClient) -> Result<RolloutStatus> {
    let aliases = aliases(client).await?;
    let implementations = client
        .query(
            "SELECT owner, implementation, role, cluster, protocol_min, protocol_max, seen_at_ms
               FROM sealpost.implementation ORDER BY seen_at_ms DESC, owner LIMIT 100",
            &[],
        )
        .await?
        .iter()
        .map(|r| Announced {
            owner: r.get::<_, i64>(0) as u64,
            implementation: r.get(1),
            role: r.get(2),
            cluster: r.get(3),
            protocol_min: r.get::<_, i16>(4) as u16,
            protocol_max: r.get::<_, i16>(5) as u16,
            seen_at_ms: r.get::<_, i64>(6) as u64,
        })
        .collect();
    let log = client
        .query(
            "SELECT route, command, generation, stage, incumbent, candidate, types, share,
                    by_login, at_ms
               FROM sealpost.rollout_log ORDER BY id DESC LIMIT 20",
            &[],
        )
        .await?
        .iter()
        .map(|r| {
            let stage: String = r.get(3);
            Ok(RolloutLogEntry {
                route: r.get(0),
                command: r.get(1),
                alias: AliasView {
                    alias: Alias {
                        route: r.get(0),
                        cluster: String::new(),
                        topic: String::new(),
                        generation: r.get::<_, i64>(2) as u64,
                        stage: Stage::parse(&stage).ok_or_else(|| {
                            StoreError::Corrupt(format!("rollout log stage `{stage}`"))
                        })?,
                        incumbent: r.get(4),
                        candidate: r.get(5),
                        types: r.get(6),
                        share: r.get::<_, i16>(7).clamp(1, 100) as u8,
                    },
                    claims: String::new(),
                },
                by_login: r.get(8),
                at_ms: r.get::<_, i64>(9) as u64,
            })
        })
        .collect::<Result<_>>()?;
    Ok(RolloutStatus {
        aliases,
        implementations,
        log,
        shadows: shadow_views(client).await?,
    })
}

/// A message the incumbent published, as the candidate's shadow reads its row.
#[derive(Clone, Debug)]
pub struct ShadowRow {
    /// The row.
    pub row: EventRow,
    /// Its envelope description (the headers the candidate would write).
    pub envelope: WireEnvelope,
    /// The attempt id of its primary receipt (the message to compare).
    pub primary_attempt_id: Option<u64>,
    /// An earlier version of the aggregate, bound for the same destination, was stored
    /// after it or is not stored yet.
    pub earlier_stored_later: bool,
    /// Its place in the walk (event id, member): where the cursor stands once it is
    /// compared.
    pub key: (Uuid, i16),
}

/// One page of the shadow's walk.
#[derive(Clone, Debug, Default)]
pub struct ShadowPage {
    /// The incumbent's published rows of the alias's destination to compare.
    pub rows: Vec<ShadowRow>,
    /// Rows read that are not compared (another destination, the candidate's own sends,
    /// not published).
    pub skipped: u64,
    /// Where the next page starts (unchanged when the walk waits for a row on its way).
    pub read_to: (Uuid, i16),
}

/// Rows of one page of the shadow's walk.
const SHADOW_PAGE: i64 = 200;

/// The shadow's cursor for `route` and `candidate`, created at the newest work row the
/// first time (the shadow compares what is published from then on).
pub async fn shadow_cursor(
    client: &impl GenericClient,
    route: &str,
    candidate: &str,
) -> Result<(Uuid, i16)> {
    if let Some(r) = client
        .query_opt(
            "SELECT read_to_event, read_to_member FROM sealpost.shadow_tally
              WHERE route = $1 AND candidate = $2",
            &[&route, &candidate],
        )
        .await?
    {
        return Ok((r.get(0), r.get(1)));
    }
    let newest = client
        .query_opt(
            "SELECT event_id, member FROM sealpost.work ORDER BY event_id DESC, member DESC LIMIT 1",
            &[],
        )
        .await?
        .map_or((Uuid::nil(), 0), |r| (r.get(0), r.get(1)));
    client
        .execute(
            &format!(
                "INSERT INTO sealpost.shadow_tally (route, candidate, read_to_event, read_to_member,
                   started_at_ms, updated_at_ms) VALUES ($1, $2, $3, $4, {NOW_MS_SQL}, {NOW_MS_SQL})
                 ON CONFLICT (route, candidate) DO NOTHING"
            ),
            &[&route, &candidate, &newest.0, &newest.1],
        )
        .await?;
    Ok(newest)
}

/// How old a row must be before the shadow's walk passes it: younger rows are usually still
/// on their way, and the walk waits for them rather than skip them.
const SHADOW_GRACE_MS: i64 = 5_000;

/// The next page of the shadow's walk after `from`, in primary key order (time order for
/// UUIDv7 event ids), over the rows of `alias`'s cluster: the ones of its destination that
/// an implementation other than `candidate` published. The walk stops at the first row
/// younger than [`SHADOW_GRACE_MS`]; an older row that is not published (on its way for
/// long, parked, quarantined) is passed without a comparison (counted in `skipped`).
pub async fn shadow_page(
    client: &impl GenericClient,
    alias: &Alias,
    candidate: &str,
    from: (Uuid, i16),
) -> Result<ShadowPage> {
    let q = locked_rows_sql(
        "FROM sealpost.work w WHERE (w.event_id, w.member) > ($1::uuid, $2::int2)
            AND w.dest_cluster = $4
          ORDER BY w.event_id, w.member LIMIT $3",
        &format!(
            ", {WIRE_ENVELOPE_COLS}, w.created_at_ms > {NOW_MS_SQL} - $5, w.primary_attempt_id,
             (SELECT i.implementation FROM sealpost.implementation i WHERE i.owner = w.attempt_owner),
             EXISTS (SELECT 1 FROM sealpost.envelope e2
                       JOIN sealpost.work w2 ON w2.event_id = e2.event_id AND w2.member = e2.member
                        AND w2.envelope_generation = e2.envelope_generation
                      WHERE e2.aggregate_type = e.aggregate_type AND e2.aggregate_id = e.aggregate_id
                        AND e2.aggregate_version < e.aggregate_version
                        AND e2.dest_cluster = e.dest_cluster AND e2.dest_topic = e.dest_topic
                        AND (w2.primary_sequence IS NULL OR w2.primary_sequence > w.primary_sequence))"
        ),
        "w.event_id, w.member",
    );
    counted(1);
    let found = client
        .query(
            &q,
            &[
                &from.0,
                &from.1,
                &SHADOW_PAGE,
                &alias.cluster,
                &SHADOW_GRACE_MS,
            ],
        )
        .await?;
    let rows = finish_load(client, &found).await?;
    let extra = RowCol::ALL.len();
    let mut page = ShadowPage {
        read_to: from,
        ..ShadowPage::default()
    };
    for (row, r) in rows.into_iter().zip(&found) {
        let young: bool = r.get(extra + 7);
        if young {
            break;
        }
        let key = (uuid_of(row.event_id), row.member as i16);
        page.read_to = key;
        let owner_impl: Option<String> = r.get(extra + 9);
        let mine = owner_impl.as_deref() == Some(candidate);
        let ours = row.destination.topic == alias.topic;
        if !ours || mine || !row.state.is_published() || row.primary.is_none() {
            page.skipped += 1;
            continue;
        }
        page.rows.push(ShadowRow {
            envelope: wire_envelope(r, extra)?,
            primary_attempt_id: r.get::<_, Option<i64>>(extra + 8).map(|a| a as u64),
            earlier_stored_later: r.get(extra + 10),
            key,
            row,
        });
    }
    Ok(page)
}

/// Records one page's comparisons: the divergences found (per row) and the tally, with
/// the cursor moved from `from` to `read_to`, in one transaction. Returns false (and
/// records nothing) when the cursor is no longer at `from`: another reader recorded the
/// page, or a new shadow started.
pub async fn record_shadow(
    client: &mut tokio_postgres::Client,
    route: &str,
    candidate: &str,
    compared: &[(EventId, u16, Vec<rollout::Divergence>)],
    from: (Uuid, i16),
    read_to: (Uuid, i16),
) -> Result<bool> {
    let tx = client.transaction().await?;
    // Several processes of the candidate run a shadow reader each: the page counts once,
    // for the reader whose cursor still is where the page started.
    let at = tx
        .query_opt(
            "SELECT read_to_event, read_to_member FROM sealpost.shadow_tally
              WHERE route = $1 AND candidate = $2 FOR UPDATE",
            &[&route, &candidate],
        )
        .await?
        .map(|r| (r.get::<_, Uuid>(0), r.get::<_, i16>(1)));
    if at != Some(from) {
        tx.rollback().await?;
        return Ok(false);
    }
    let mut diverged = 0i64;
    for (event_id, member, ds) in compared {
        if !ds.is_empty() {
            diverged += 1;
        }
        for d in ds {
            tx.execute(
                &format!(
                    "INSERT INTO sealpost.shadow_divergence (route, candidate, event_id, member,
                       kind, incumbent_value, candidate_value, at_ms)
                     VALUES ($1, $2, $3, $4, $5, $6, $7, {NOW_MS_SQL})"
                ),
                &[
                    &route,
                    &candidate,
                    &uuid_of(*event_id),
                    &(*member as i16),
                    &d.kind.name(),
                    &d.incumbent,
                    &d.candidate,
                ],
            )
            .await?;
        }
    }
    let n = compared.len() as i64;
    tx.execute(
        &format!(
            "UPDATE sealpost.shadow_tally SET compared = compared + $3,
               matched = matched + $3 - $4, diverged = diverged + $4,
               read_to_event = $5, read_to_member = $6, updated_at_ms = {NOW_MS_SQL}
             WHERE route = $1 AND candidate = $2"
        ),
        &[&route, &candidate, &n, &diverged, &read_to.0, &read_to.1],
    )
    .await?;
    tx.commit().await?;
    Ok(true)
}

/// Marks the unexplained divergences of `candidate`'s shadow on `route` (of one kind, or
/// all) as explained by `operator` with `reason` (audited in the rows themselves). Returns
/// how many.
pub async fn explain_divergences(
    client: &impl GenericClient,
    route: &str,
    candidate: &str,
    kind: Option<rollout::DivergenceKind>,
    operator: &str,
    reason: &str,
) -> Result<u64> {
    if operator.trim().is_empty() || reason.trim().is_empty() {
        return Err(StoreError::Rollout(
            "an explanation names the operator (--operator) and the reason (--reason); nothing was marked".into(),
        ));
    }
    Ok(client
        .execute(
            &format!(
                "UPDATE sealpost.shadow_divergence
                    SET explained_by = $4, explanation = $5, explained_at_ms = {NOW_MS_SQL}
                  WHERE route = $1 AND candidate = $2 AND explained_at_ms IS NULL
                    AND ($3::text IS NULL OR kind = $3)"
            ),
            &[
                &route,
                &candidate,
                &kind.map(|k| k.name()),
                &operator,
                &reason,
            ],
        )
        .await?)
}

/// A divergence as shown.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DivergenceView {
    /// Event id.
    pub event_id: String,
    /// Member.
    pub member: u16,
    /// Kind.
    pub kind: String,
    /// What the incumbent's message carries.
    pub incumbent: String,
    /// What the candidate would have sent.
    pub candidate: String,
    /// When found (database clock).
    pub at_ms: u64,
    /// The explanation, once given.
    pub explanation: Option<String>,
}

/// One candidate's shadow on one route.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ShadowView {
    /// Route.
    pub route: String,
    /// Candidate.
    pub candidate: String,
    /// Messages compared.
    pub compared: u64,
    /// Of which matched.
    pub matched: u64,
    /// Of which diverged.
    pub diverged: u64,
    /// Divergences not explained yet (promotion is refused while any is).
    pub unexplained: u64,
    /// The latest divergences of this shadow (up to 10), unexplained first.
    pub examples: Vec<DivergenceView>,
}

async fn shadow_views(client: &impl GenericClient) -> Result<Vec<ShadowView>> {
    let mut out = Vec::new();
    for r in client
        .query(
            "SELECT t.route, t.candidate, t.compared, t.matched, t.diverged,
                    (SELECT count(*) FROM sealpost.shadow_divergence d
                      WHERE d.route = t.route AND d.candidate = t.candidate
                        AND d.explained_at_ms IS NULL AND d.at_ms >= t.started_at_ms),
                    t.started_at_ms
               FROM sealpost.shadow_tally t ORDER BY t.route, t.candidate",
            &[],
        )
        .await?
    {
        let (route, candidate): (String, String) = (r.get(0), r.get(1));
        let started: i64 = r.get(6);
        let examples = client
            .query(
                "SELECT event_id::text, member, kind, incumbent_value, candidate_value, at_ms,
                        explanation
                   FROM sealpost.shadow_divergence
                  WHERE route = $1 AND candidate = $2 AND at_ms >= $3
                  ORDER BY (explained_at_ms IS NULL) DESC, id DESC LIMIT 10",
                &[&route, &candidate, &started],
            )
            .await?
            .iter()
            .map(|d| DivergenceView {
                event_id: d.get(0),
                member: d.get::<_, i16>(1) as u16,
                kind: d.get(2),
                incumbent: d.get(3),
                candidate: d.get(4),
                at_ms: d.get::<_, i64>(5) as u64,
                explanation: d.get(6),
            })
            .collect();
        out.push(ShadowView {
            route,
            candidate,
            compared: r.get::<_, i64>(2) as u64,
            matched: r.get::<_, i64>(3) as u64,
            diverged: r.get::<_, i64>(4) as u64,
            unexplained: r.get::<_, i64>(5) as u64,
            examples,
        });
    }
    Ok(out)
}

/// Refuses a takeover while `candidate`'s shadow on `route` has compared nothing, and (with
/// `promoting`) a promotion while it shows a divergence nobody explained. Only the current
/// shadow counts (since its `started_at_ms`).
async fn check_evidence(
    tx: &Transaction<'_>,
    route: &str,
    candidate: &str,
    promoting: bool,
) -> Result<()> {
    let r = tx
        .query_opt(
            "SELECT t.compared,
                    (SELECT count(*) FROM sealpost.shadow_divergence d
                      WHERE d.route = t.route AND d.candidate = t.candidate
                        AND d.explained_at_ms IS NULL AND d.at_ms >= t.started_at_ms),
                    (SELECT kind || ' of event ' || event_id || ': incumbent \"' || incumbent_value
                            || '\", candidate \"' || candidate_value || '\"'
                       FROM sealpost.shadow_divergence d
                      WHERE d.route = t.route AND d.candidate = t.candidate
                        AND d.explained_at_ms IS NULL AND d.at_ms >= t.started_at_ms
                      ORDER BY id LIMIT 1)
               FROM sealpost.shadow_tally t WHERE t.route = $1 AND t.candidate = $2",
            &[&route, &candidate],
        )
        .await?;
    let (compared, open, first): (i64, i64, Option<String>) = match &r {
        Some(r) => (r.get(0), r.get(1), r.get(2)),
        None => (0, 0, None),
    };
    if compared == 0 {
        return Err(refused(format!(
            "the shadow of \"{candidate}\" on route `{route}` has compared no message yet: run its dispatchers (they read back what the incumbent publishes) and try again"
        )));
    }
    if promoting && open > 0 {
        return Err(refused(format!(
            "the shadow of \"{candidate}\" on route `{route}` shows {open} unexplained divergence(s), first: {}; explain them with `sealpost rollout explain` or roll back",
            first.unwrap_or_default()
        )));
    }
    Ok(())
}
