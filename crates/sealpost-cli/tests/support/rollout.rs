//! Two implementations over one outbox, for `rollout.rs` and `upgrade_drill.rs` (the test
//! binary's `rollout_support` module): the events they enqueue, who sent each one, and the
//! alias switches. Each test reads the fields it needs, so some go unread in one of them.
#![allow(dead_code)]

use sealpost::store::{self, RolloutCommand};
use sealpost_core::envelope::NewEvent;
use sealpost_core::rollout::Alias;

/// The two event types the tests enqueue, alternately (a takeover names one of them).
pub const CREATED: &str = "order.created.v1";
pub const PAID: &str = "order.paid.v1";

/// Enqueues events `PREFIX-0` .. `PREFIX-(n-1)` on `route` in one transaction, one aggregate
/// each, alternating created and paid.
pub async fn enqueue(pg: &mut tokio_postgres::Client, route: &str, prefix: &str, n: usize) {
    let tx = pg.transaction().await.unwrap();
    for i in 0..n {
        let id = format!("{prefix}-{i}");
        let ev = NewEvent {
            aggregate_id: &id,
            event_type: if i % 2 == 0 { CREATED } else { PAID },
            ..sealpost_cli::demo::order_created("", br#"{"total":1}"#)
        };
        store::enqueue(&tx, route, sealpost_cli::demo::mint_event_id(), &ev, &id)
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
}

/// One event of a test's batch, and which implementation sent it.
#[derive(Clone, Debug)]
pub struct Sent {
    /// Its event type.
    pub event_type: String,
    /// Its aggregate id (`PREFIX-i`).
    pub aggregate_id: String,
    /// Its work row's state.
    pub state: String,
    /// The implementation announced by the owner of the row's latest attempt: the last
    /// process that started a send of it (none: never claimed).
    pub last_attempt_by: Option<String>,
    /// The implementation announced by the owner of the primary receipt's attempt: who sent
    /// the copy the row accepted.
    pub accepted_from: Option<String>,
}

/// Every event of `prefix`, by aggregate id.
pub async fn senders(pg: &tokio_postgres::Client, prefix: &str) -> Vec<Sent> {
    pg.query(
        "SELECT e.event_type, e.aggregate_id, w.state,
                (SELECT i.implementation FROM sealpost.implementation i
                  WHERE i.owner = w.attempt_owner),
                (SELECT i.implementation FROM sealpost.implementation i
                  WHERE i.owner = coalesce(
                        (SELECT a.owner FROM sealpost.attempt a WHERE a.attempt_id = w.primary_attempt_id),
                        CASE WHEN w.attempt_id = w.primary_attempt_id THEN w.attempt_owner END))
           FROM sealpost.work w
           JOIN sealpost.envelope e ON e.event_id = w.event_id AND e.member = w.member
          WHERE e.aggregate_id LIKE $1 || '-%' ORDER BY e.aggregate_id",
        &[&prefix],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| Sent {
        event_type: r.get(0),
        aggregate_id: r.get(1),
        state: r.get(2),
        last_attempt_by: r.get(3),
        accepted_from: r.get(4),
    })
    .collect()
}

/// Is every event of `prefix` published?
pub async fn published(pg: &tokio_postgres::Client, prefix: &str) -> bool {
    senders(pg, prefix)
        .await
        .iter()
        .all(|s| s.state == "PUBLISHED")
}

/// The alias of `route` as the store holds it.
pub async fn alias(pg: &tokio_postgres::Client, route: &str) -> Alias {
    store::aliases(pg)
        .await
        .unwrap()
        .into_iter()
        .find(|a| a.alias.route == route)
        .unwrap_or_else(|| panic!("no rollout record for {route}"))
        .alias
}

/// Runs `cmd` on `route`, which must move the alias; the alias after it and the command's
/// warnings.
pub async fn switch(
    pg: &mut tokio_postgres::Client,
    route: &str,
    cmd: RolloutCommand,
) -> (Alias, Vec<String>) {
    let c = store::rollout(pg, route, &cmd).await.unwrap();
    assert!(c.changed, "{cmd:?} should switch the alias: {c:?}");
    (alias(pg, route).await, c.warnings)
}
