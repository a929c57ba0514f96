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

/// A rollout record as `sealpost.rollout_aliases()` returns it in JSON.
#[derive(serde::Deserialize)]
struct AliasJson {
    route: String,
    cluster: String,
    topic: String,
    incumbent: String,
    candidate: Option<String>,
    stage: String,
    types: Vec<String>,
    share: i16,
    generation: i64,
}

/// The claim's first statement: the transaction's planner settings, then the aliases read
/// through `sealpost.rollout_aliases()`, which holds the rollout table in SHARE mode until
/// the claim commits (a switch waits for it; every later claim sees the switch). One round
/// trip (the simple query protocol carries both).
pub(super) async fn claim_settings_and_aliases(tx: &Transaction<'_>) -> Result<Vec<Alias>> {
    counted(1);
    let msgs = tx
        .simple_query(
            "SET LOCAL enable_bitmapscan = off; SET LOCAL enable_seqscan = off;
             SET LOCAL plan_cache_mode = force_custom_plan;
             SELECT coalesce(json_agg(a), '[]')::text FROM sealpost.rollout_aliases() a",
        )
        .await?;
    let text = msgs
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_string),
            _ => None,
        })
        .unwrap_or_else(|| "[]".to_string());
    let rows: Vec<AliasJson> = serde_json::from_str(&text)
        .map_err(|e| StoreError::Corrupt(format!("rollout aliases: {e}")))?;
    rows.into_iter()
        .map(|a| {
            Ok(Alias {
                stage: Stage::parse(&a.stage)
                    .ok_or_else(|| StoreError::Corrupt(format!("rollout stage `{}`", a.stage)))?,
                route: a.route,
                cluster: a.cluster,
                topic: a.topic,
                incumbent: a.incumbent,
                candidate: a.candidate,
                types: a.types,
                share: a.share.clamp(1, 100) as u8,
                generation: a.generation as u64,
            })
        })
        .collect()
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

/// A route's alias as shown (`rollout status`, the page, `--json`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct AliasView {
    /// Route.
    pub route: String,
    /// Destination cluster.
    pub cluster: String,
    /// Destination topic.
    pub topic: String,
    /// Incumbent implementation.
    pub incumbent: String,
    /// Candidate, if any.
    pub candidate: Option<String>,
    /// Stage name.
    pub stage: String,
    /// Takeover event types.
    pub types: Vec<String>,
    /// Takeover share (percent of aggregates).
    pub share: u8,
    /// Alias generation.
    pub generation: u64,
}

impl From<&Alias> for AliasView {
    fn from(a: &Alias) -> Self {
        AliasView {
            route: a.route.clone(),
            cluster: a.cluster.clone(),
            topic: a.topic.clone(),
            incumbent: a.incumbent.clone(),
            candidate: a.candidate.clone(),
            stage: a.stage.name().to_string(),
            types: a.types.clone(),
            share: a.share,
            generation: a.generation,
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
    let refused = |e: rollout::RolloutError| StoreError::Rollout(e.to_string());
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
            rollout::check_id(candidate).map_err(refused)?;
            let incumbent = match incumbent {
                Some(i) => {
                    rollout::check_id(i).map_err(refused)?;
                    i.clone()
                }
                None => announced_incumbent(&tx, &cluster, candidate).await?,
            };
            unrecorded(route, &cluster, &topic, &incumbent)
        }
        (None, _) => unrecorded(route, &cluster, &topic, ""),
    };
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
    .map_err(refused)?;
    let after = match switch {
        Switch::Unchanged => {
            tx.rollback().await?;
            return Ok(RolloutChange {
                route: route.to_string(),
                command: command.name().to_string(),
                after: before.as_ref().map(AliasView::from),
                before: before.as_ref().map(AliasView::from),
                changed: false,
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
            StoreError::Rollout(format!(
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
    tx.commit().await?;
    Ok(RolloutChange {
        route: route.to_string(),
        command: command.name().to_string(),
        before: before.as_ref().map(AliasView::from),
        after: Some(AliasView::from(&after)),
        changed: true,
    })
}

/// The alias of a route without a rollout record: `incumbent` claims every row.
fn unrecorded(route: &str, cluster: &str, topic: &str, incumbent: &str) -> Alias {
    Alias {
        route: route.to_string(),
        cluster: cluster.to_string(),
        topic: topic.to_string(),
        incumbent: incumbent.to_string(),
        candidate: None,
        stage: Stage::Incumbent,
        types: Vec::new(),
        share: 100,
        generation: 0,
    }
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
            "SELECT DISTINCT implementation FROM sealpost.implementation
              WHERE role = 'dispatcher' AND cluster = $1 AND implementation <> $2
              ORDER BY 1",
            &[&cluster, &candidate],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    match ids.as_slice() {
        [one] => Ok(one.clone()),
        [] => Err(StoreError::Rollout(format!(
            "no dispatcher of cluster `{cluster}` has announced an implementation other than \"{candidate}\"; name the incumbent with --incumbent"
        ))),
        many => Err(StoreError::Rollout(format!(
            "the dispatchers of cluster `{cluster}` announced several implementations ({}); name the incumbent with --incumbent",
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

/// Rows not yet published, per route and claimant.
#[derive(Clone, Debug, serde::Serialize)]
pub struct RolloutStatus {
    /// Every alias.
    pub aliases: Vec<AliasView>,
    /// Every announced process, latest first.
    pub implementations: Vec<Announced>,
    /// The last 20 switches, latest first.
    pub log: Vec<RolloutLogEntry>,
}

/// The aliases, the announcements and the latest switches (`sealpost rollout status`).
pub async fn rollout_status(client: &impl GenericClient) -> Result<RolloutStatus> {
    let aliases = client
        .query(
            &format!("SELECT {ALIAS_COLS} FROM sealpost.rollout ORDER BY route"),
            &[],
        )
        .await?
        .iter()
        .map(|r| alias_of(r).map(|a| AliasView::from(&a)))
        .collect::<Result<Vec<_>>>()?;
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
        .map(|r| RolloutLogEntry {
            route: r.get(0),
            command: r.get(1),
            alias: AliasView {
                route: r.get(0),
                cluster: String::new(),
                topic: String::new(),
                generation: r.get::<_, i64>(2) as u64,
                stage: r.get(3),
                incumbent: r.get(4),
                candidate: r.get(5),
                types: r.get(6),
                share: r.get::<_, i16>(7).clamp(1, 100) as u8,
            },
            by_login: r.get(8),
            at_ms: r.get::<_, i64>(9) as u64,
        })
        .collect();
    Ok(RolloutStatus {
        aliases,
        implementations,
        log,
    })
}
