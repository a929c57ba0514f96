//! Delivery sets (R16): one event delivered to several destinations as an explicit contract.
//! `enqueue_set` writes the set row and one member per route in the caller's transaction;
//! the views (`delivery_set`, `set_summary`, `stuck_sets`) load the members' states and ask
//! the core's [`set_status`] whether the set is complete. Nothing stores completion.

use sealpost_core::delivery_set::{
    check_members, set_status, set_stuck, CompletionRule, SetStatus,
};

use super::enqueue::{check_input, insert_envelope, keyed_payload, load_policy_checking};
use super::*;

/// Enqueues `ev` as a delivery set (R16) inside the caller's transaction: one member per
/// route of `routes`, in that order (member 0 is `routes[0]`), each sealed against its own
/// route policy (its frozen destination, payload keying and contract check), each with its
/// own state, publish slot and receipts, under one event id; and the set row naming the
/// routes and the completion `rule`. Returns the members' envelopes.
///
/// Refused before anything is written: fewer than two or more than
/// [`sealpost_core::delivery_set::MEMBERS_MAX`] routes, two routes resolving to the same
/// cluster and topic (a second copy for one destination is a retry in disguise), an unknown
/// route, and everything [`enqueue`] refuses.
///
/// Ordering (R29): members carry the event's aggregate version; a later version of the
/// aggregate waits for every member of an earlier one bound for an ordered destination.
pub async fn enqueue_set(
    tx: &Transaction<'_>,
    routes: &[&str],
    rule: CompletionRule,
    event_id: EventId,
    ev: &NewEvent<'_>,
    routing_key: &str,
) -> Result<Vec<SealedEnvelope>> {
    check_input(0, ev, routing_key)?;
    let mut keys = HashMap::new();
    let mut sealed = Vec::with_capacity(routes.len());
    for route in routes {
        let loaded = load_policy_checking(tx, route, std::slice::from_ref(ev).iter()).await?;
        let payload = keyed_payload(tx, loaded.keying, 0, ev, &mut keys)
            .await?
            .unwrap_or_else(|| ev.payload.to_vec());
        let member_ev = NewEvent {
            creating_txid: loaded.txid,
            payload: &payload,
            ..ev.clone()
        };
        let env = SealedEnvelope::seal(event_id, &member_ev, &loaded.policy, routing_key);
        sealed.push((env, payload));
    }
    let named: Vec<(&str, &Destination)> = routes
        .iter()
        .zip(&sealed)
        .map(|(r, (env, _))| (*r, &env.destination))
        .collect();
    check_members(&named)?;
    counted(1);
    tx.execute(
        INSERT_SET_SQL,
        &[
            &uuid_of(event_id),
            &rule.name(),
            &routes.iter().map(|r| r.to_string()).collect::<Vec<_>>(),
        ],
    )
    .await?;
    for (member, (env, payload)) in sealed.iter().enumerate() {
        insert_envelope(tx, env, member as i16, payload).await?;
    }
    Ok(sealed.into_iter().map(|(env, _)| env).collect())
}

/// Refuses to migrate `member` of a delivery set to `to` (through `route`) when another
/// member's current destination has the same cluster and topic: [`check_members`] over the
/// set as it would be after the migration. Locks the set's other members (the migration
/// holds its own already). No set, or one member left after retention: nothing to check.
pub(super) async fn check_set_migration(
    tx: &Transaction<'_>,
    event_id: EventId,
    member: u16,
    route: &str,
    to: &Destination,
) -> Result<()> {
    let Some(set) = tx
        .query_opt(
            "SELECT routes FROM sealpost.delivery_set WHERE event_id = $1",
            &[&uuid_of(event_id)],
        )
        .await?
    else {
        return Ok(());
    };
    let routes: Vec<String> = set.get(0);
    let keys: Vec<(EventId, u16)> = (0..routes.len() as u16).map(|m| (event_id, m)).collect();
    let rows = lock_rows(tx, &keys).await?;
    if rows.len() < 2 {
        return Ok(());
    }
    let named: Vec<(&str, &Destination)> = rows
        .iter()
        .map(|r| {
            if r.member == member {
                (route, to)
            } else {
                let name = routes
                    .get(usize::from(r.member))
                    .map_or("?", |s| s.as_str());
                (name, &r.destination)
            }
        })
        .collect();
    check_members(&named)?;
    Ok(())
}

/// Inserts a set row: event id, rule name, routes (shared with the sqlx flavour).
pub(crate) const INSERT_SET_SQL: &str =
    "INSERT INTO sealpost.delivery_set (event_id, rule, routes) VALUES ($1, $2, $3)";

/// One member of a delivery set, as the views show it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SetMember {
    /// Member number (0 for the first route).
    pub member: u16,
    /// The route it was resolved from.
    pub route: String,
    /// Its frozen destination, `cluster/topic`.
    pub destination: String,
    /// Its state (`None` once retention removed the member).
    pub state: Option<String>,
}

/// A delivery set and the core's verdict on it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SetView {
    /// The event id all members share.
    pub event_id: String,
    /// `all` or `any`.
    pub rule: String,
    /// `complete`, `in_progress` or `blocked` ([`SetStatus::name`]).
    pub status: String,
    /// Members published (slot filled).
    pub published: u16,
    /// Members published for the rule to hold.
    pub needed: u16,
    /// The members, in member order.
    pub members: Vec<SetMember>,
    /// When the set committed, ms since the epoch (database clock).
    pub created_at_ms: i64,
}

/// The members' states of a set: settled members of which retention removed the work row
/// (only PURGED rows are removed) count as purged.
fn member_states(members: &[SetMember]) -> Vec<State> {
    members
        .iter()
        .map(|m| {
            m.state
                .as_deref()
                .and_then(State::parse)
                .unwrap_or(State::Purged)
        })
        .collect()
}

fn view_of(
    event_id: Uuid,
    rule: &str,
    members: Vec<SetMember>,
    created_at_ms: i64,
) -> Result<(SetView, SetStatus)> {
    let rule_parsed = CompletionRule::parse(rule)
        .ok_or_else(|| StoreError::Corrupt(format!("delivery set rule `{rule}`")))?;
    let states = member_states(&members);
    let status = set_status(&states, rule_parsed);
    let view = SetView {
        event_id: event_id.to_string(),
        rule: rule.to_string(),
        status: status.name().to_string(),
        published: states.iter().filter(|s| s.is_published()).count() as u16,
        needed: rule_parsed.needed(states.len() as u16),
        members,
        created_at_ms,
    };
    Ok((view, status))
}

/// Loads sets with their members: `filter` selects rows of `sealpost.delivery_set s`.
async fn load_sets(
    client: &impl GenericClient,
    filter: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Vec<(SetView, SetStatus)>> {
    let rows = client
        .query(
            &format!(
                "SELECT s.event_id, s.rule, s.created_at_ms, s.routes,
                        array_agg(w.member ORDER BY w.member) FILTER (WHERE w.member IS NOT NULL),
                        array_agg(CASE WHEN x.lease_id IS NULL THEN w.state ELSE 'SENDING' END
                                  ORDER BY w.member) FILTER (WHERE w.member IS NOT NULL),
                        array_agg(w.dest_cluster || '/' || e.dest_topic ORDER BY w.member)
                            FILTER (WHERE w.member IS NOT NULL)
                 FROM sealpost.delivery_set s
                 LEFT JOIN sealpost.work w ON w.event_id = s.event_id
                 LEFT JOIN sealpost.envelope e ON e.event_id = w.event_id AND e.member = w.member
                      AND e.envelope_generation = w.envelope_generation
                 LEFT JOIN sealpost.leased x ON x.event_id = w.event_id AND x.member = w.member
                 WHERE {filter}
                 GROUP BY s.event_id, s.rule, s.created_at_ms, s.routes
                 ORDER BY s.created_at_ms, s.event_id"
            ),
            params,
        )
        .await?;
    let mut out = Vec::with_capacity(rows.len());
    for r in rows {
        let routes: Vec<String> = r.get(3);
        let present: Vec<i16> = r.get::<_, Option<Vec<i16>>>(4).unwrap_or_default();
        let states: Vec<String> = r.get::<_, Option<Vec<String>>>(5).unwrap_or_default();
        let dests: Vec<Option<String>> = r
            .get::<_, Option<Vec<Option<String>>>>(6)
            .unwrap_or_default();
        let members = routes
            .iter()
            .enumerate()
            .map(|(k, route)| {
                let at = present.iter().position(|m| *m as usize == k);
                SetMember {
                    member: k as u16,
                    route: route.clone(),
                    destination: at
                        .and_then(|i| dests.get(i).cloned().flatten())
                        .unwrap_or_default(),
                    state: at.and_then(|i| states.get(i).cloned()),
                }
            })
            .collect();
        out.push(view_of(r.get(0), r.get(1), members, r.get(2))?);
    }
    Ok(out)
}

/// The delivery set of `event_id`, if it was enqueued as one.
pub async fn delivery_set(
    client: &impl GenericClient,
    event_id: EventId,
) -> Result<Option<SetView>> {
    Ok(load_sets(client, "s.event_id = $1", &[&uuid_of(event_id)])
        .await?
        .into_iter()
        .next()
        .map(|(v, _)| v))
}

/// The delivery sets at a glance, for `status` and the page.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct SetSummary {
    /// Sets in the outbox.
    pub total: i64,
    /// Sets whose completion rule holds.
    pub complete: i64,
    /// Sets on their way.
    pub in_progress: i64,
    /// Sets that need an operator (a quarantined member the rule needs).
    pub blocked: i64,
    /// Up to 20 sets that are not complete, oldest first.
    pub open: Vec<SetView>,
}

/// Whether this login can read `sealpost.delivery_set` (a database before migration 10, or
/// a login without the grant, shows no sets rather than failing the whole status).
async fn sets_readable(client: &impl GenericClient) -> Result<bool> {
    Ok(client
        .query_one(
            "SELECT to_regclass('sealpost.delivery_set') IS NOT NULL
                    AND has_table_privilege('sealpost.delivery_set', 'SELECT')",
            &[],
        )
        .await?
        .get(0))
}

/// A set with every member settled is complete under every rule, so only the sets with a
/// member still on its way are loaded and judged (the unsettled rows are the working set;
/// the settled history can be any size).
fn open_sets() -> String {
    format!("s.event_id IN (SELECT w2.event_id FROM sealpost.work w2 WHERE w2.phase <> {SETTLED})")
}

/// Counts the sets and judges the open ones ([`SetSummary`]).
pub async fn set_summary(client: &impl GenericClient) -> Result<SetSummary> {
    if !sets_readable(client).await? {
        return Ok(SetSummary::default());
    }
    let total: i64 = client
        .query_one("SELECT count(*) FROM sealpost.delivery_set", &[])
        .await?
        .get(0);
    let open = load_sets(client, &open_sets(), &[]).await?;
    let mut s = SetSummary {
        total,
        complete: total - open.len() as i64,
        ..SetSummary::default()
    };
    for (view, status) in open {
        match status {
            SetStatus::Complete => s.complete += 1,
            SetStatus::InProgress { .. } => s.in_progress += 1,
            SetStatus::Blocked => s.blocked += 1,
        }
        if status != SetStatus::Complete && s.open.len() < 20 {
            s.open.push(view);
        }
    }
    Ok(s)
}

/// Sets stuck incomplete ([`set_stuck`]): blocked, or in progress `stuck_after_ms` after
/// they committed. Returns how many, and up to `limit` of them, oldest first.
pub async fn stuck_sets(
    client: &impl GenericClient,
    stuck_after_ms: u64,
    limit: usize,
) -> Result<(i64, Vec<SetView>)> {
    if !sets_readable(client).await? {
        return Ok((0, Vec::new()));
    }
    let now_ms = db_now_ms(client).await?;
    let mut count = 0;
    let mut out = Vec::new();
    for (view, status) in load_sets(client, &open_sets(), &[]).await? {
        let age = now_ms.saturating_sub(view.created_at_ms.max(0) as u64);
        if set_stuck(status, age, stuck_after_ms) {
            count += 1;
            if out.len() < limit {
                out.push(view);
            }
        }
    }
    Ok((count, out))
}
