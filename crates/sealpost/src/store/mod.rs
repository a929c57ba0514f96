//! The PostgreSQL store: schema, the producer's `enqueue`, and every state change of the
//! protocol as a short transaction that loads row snapshots, calls `sealpost-core` and
//! persists the difference. No transaction is ever held across a network send.

use std::collections::HashMap;

use sealpost_core::claim::apply_release_quarantine;
use sealpost_core::claim::NEVER_SENT_ALERT_COUNT;
use sealpost_core::claim::{ClaimToken, SendOutcomeDecision};
use sealpost_core::dispatcher::{Claimed, ClaimedSend, Horizon, Submission};
use sealpost_core::encoding::Digest;
use sealpost_core::envelope::{
    ordering_key, Destination, EventId, EventOrdering, NewEvent, PartitionAlgorithm, RoutePolicy,
    SealedEnvelope,
};
use sealpost_core::port::{SendRequest, WireEnvelope};
use sealpost_core::receipt::{decide_receipt, Receipt, ReceiptSource, ReceiptVerdict};
use sealpost_core::reconcile::{
    decide_reconcile_missing, Lookup, ReconcileDecision, ReconcilePolicy,
};
use sealpost_core::reconciler::{verify_window_rows, VerifyItem};
use sealpost_core::row::{Attempt, AttemptStatus, Claim, EventRow, Pacing, Superseded};
use sealpost_core::state::{Phase, State};
use sealpost_core::step::{self, Acceptance, ClaimInput, CoreRules, Pick, Served, StepError};
use tokio_postgres::{GenericClient, Transaction};

use crate::payload_key::{self, KeyError, Keying, Subject};
use uuid::Uuid;

mod accept;
mod claim;
mod enqueue;
mod lease;
mod operator;
mod reconcile;
mod rollout;
mod rows;
mod schema;
mod sets;
mod status;
mod verify;

pub use accept::*;
pub use claim::*;
pub use enqueue::*;
use lease::NEVER_CLAIMED_SQL;
pub use lease::{check_lease_rule, LeaseRuleDisagreement};
pub use operator::*;
pub use reconcile::*;
pub use rollout::*;
pub use rows::NOW_MS_SQL;
use rows::*;
pub use schema::*;
pub use sets::*;
pub use status::*;
pub use verify::*;

/// The embedded schema migrations, in order.
pub const MIGRATIONS: &[(i32, &str)] = &[
    (1, include_str!("../../migrations/0001_outbox.sql")),
    (2, include_str!("../../migrations/0002_pacing.sql")),
    (3, include_str!("../../migrations/0003_split.sql")),
    (
        4,
        include_str!("../../migrations/0004_consumers_retention.sql"),
    ),
    (5, include_str!("../../migrations/0005_ordering.sql")),
    (6, include_str!("../../migrations/0006_roles.sql")),
    (7, include_str!("../../migrations/0007_lifecycle.sql")),
    (8, include_str!("../../migrations/0008_cdc.sql")),
    (9, include_str!("../../migrations/0009_contracts.sql")),
    (10, include_str!("../../migrations/0010_delivery_sets.sql")),
    (11, include_str!("../../migrations/0011_rollout.sql")),
    (12, include_str!("../../migrations/0012_lease.sql")),
];

/// Statements the store has sent to PostgreSQL in this process (each query, `BEGIN` and
/// `COMMIT` counts one): `sealpost bench` divides it by the events drained.
static STATEMENTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Statements sent by the store in this process so far.
pub fn statements_issued() -> u64 {
    STATEMENTS.load(std::sync::atomic::Ordering::Relaxed)
}

fn counted(n: u64) {
    STATEMENTS.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
}

/// Largest payload accepted by `enqueue` (NATS' default max_payload is 1 MiB; headers need room).
pub const PAYLOAD_BYTES_MAX: usize = 900 * 1024;

/// Store errors.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database refused or failed a statement.
    #[error("database error: {}", db_message(.0))]
    Db(tokio_postgres::Error),
    /// The database refused a statement for want of a privilege (SQLSTATE 42501): the login
    /// is not mapped to the Sealpost role whose grant this needs
    /// ([`crate::roles::explain`] names both).
    #[error("permission denied (SQLSTATE 42501): {} lacks {needed}; map the login to the role that holds it with `sealpost migrate --grant KIND=LOGIN` (docs/operations.md, \"Roles and logins\")", role.as_deref().unwrap_or("this login"))]
    Permission {
        /// The refused login (`current_user`) and the Sealpost roles it holds, once known.
        role: Option<String>,
        /// What it lacks, in the server's words, then (once explained) the privilege and the
        /// Sealpost roles that hold it.
        needed: String,
        /// The server's error.
        source: tokio_postgres::Error,
    },
    /// No route policy with that name; create one with `sealpost route set`.
    #[error("no route policy named `{0}`; add one to sealpost.route_policy (sealpost migrate --route NAME=CLUSTER/TOPIC)")]
    NoRoutePolicy(String),
    /// The payload is larger than the broker accepts.
    #[error("payload is {len} bytes, more than the {max}-byte limit; store large blobs elsewhere and send a reference")]
    PayloadTooLarge {
        /// Payload length.
        len: usize,
        /// Limit.
        max: usize,
    },
    /// A producer string no broker could carry (a control character, too long, empty, a
    /// wildcard in a routing key); nothing was written.
    #[error("event {index} refused at enqueue: {source}; nothing was written (the caller's transaction is still open)")]
    InvalidInput {
        /// Position of the event in the call (0 for `enqueue`).
        index: usize,
        /// The field and the rule it broke.
        source: sealpost_core::wire::FieldError,
    },
    /// The route encrypts payloads per data subject and this event's could not be
    /// (`payload_key.rs`); nothing was written.
    #[error("event {index} refused at enqueue: {source}; nothing was written (the caller's transaction is still open)")]
    PayloadKey {
        /// Position of the event in the call (0 for `enqueue`).
        index: usize,
        /// Why.
        source: crate::payload_key::KeyError,
    },
    /// The route checks payloads against registered contracts (R26) and this event's was
    /// refused ([`crate::contract`]); nothing was written.
    #[error("event {index} refused at enqueue: {reason}; nothing was written (the caller's transaction is still open)")]
    Contract {
        /// Position of the event in the call (0 for `enqueue`).
        index: usize,
        /// The schema id, and what is wrong with it or with the payload.
        reason: String,
    },
    /// A delivery set's routes do not make a set (R16, [`sealpost_core::delivery_set`]);
    /// nothing was written.
    #[error("delivery set refused at enqueue: {0}; nothing was written (the caller's transaction is still open)")]
    DeliverySet(#[from] sealpost_core::delivery_set::SetError),
    /// A rollout command the route's alias does not allow (R25,
    /// [`sealpost_core::rollout`]; the alias is unchanged), or a bad explanation.
    #[error("{0}")]
    Rollout(String),
    /// A core step refused its inputs or broke its own postcondition: a bug in the store's
    /// query or in the core, never bad data from a user. The transaction was rolled back.
    #[error("internal invariant broken, nothing was written: {0}; please report it with `sealpost trace` of the event")]
    Invariant(#[from] StepError),
    /// A stored row does not parse (corrupted or written by a newer version).
    #[error("stored row is invalid: {0}; was it written by a newer Sealpost?")]
    Corrupt(String),
    /// No envelope has this event id.
    #[error(
        "no event {0} in the outbox; check the id (`sealpost trace` searches by aggregate too)"
    )]
    UnknownEvent(String),
    /// An operator release of an event that is not quarantined.
    #[error("event {event_id} is not quarantined (state {states}); only QUARANTINED rows can be released")]
    NotQuarantined {
        /// Event id.
        event_id: String,
        /// States of its rows.
        states: String,
    },
    /// A schema migration failed; the database stays at its previous version.
    #[error("schema migration {0} failed and was rolled back: {1}")]
    Migration(i32, String),
    /// The schema has not been applied.
    #[error("the sealpost schema is missing; run `sealpost migrate` first")]
    NotMigrated,
    /// A consumer's effect ran past its time limit; it was rolled back.
    #[error("the effect did not finish within {0} ms and was rolled back (a hanging downstream?); the message is retried later, or raise consumer_effect_timeout_ms")]
    EffectTimeout(u64),
    /// A consumer's handler returned an error; its writes were rolled back.
    #[error(
        "the handler failed: {0}; its writes were rolled back and the message is retried later"
    )]
    Effect(String),
}

impl From<tokio_postgres::Error> for StoreError {
    fn from(e: tokio_postgres::Error) -> Self {
        match e.as_db_error() {
            Some(d) if *d.code() == tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE => {
                StoreError::Permission {
                    role: None,
                    needed: format!("the right to do this: \"{}\"", d.message()),
                    source: e,
                }
            }
            _ => StoreError::Db(e),
        }
    }
}

/// What a [`StoreError`] means for the caller: whether to retry, reconnect, or stop and
/// tell an operator. The shells branch on this, not on the error's words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// The database aborted the transaction because of a concurrent one (serialization
    /// failure 40001, deadlock 40P01, lock not available 55P03): run it again.
    Retryable,
    /// A time limit ended the statement or the session (query canceled 57014, idle in
    /// transaction 25P03, a consumer effect past its limit): run it again, later or with a
    /// higher limit; the connection may still be usable.
    Timeout,
    /// The connection is gone (closed, an I/O error, SQLSTATE class 08, the server shutting
    /// down 57P01–57P03): drop it and connect again; whether a commit in flight reached the
    /// database is not known.
    ConnectionLost,
    /// The login lacks a privilege (42501): an operator grants it; retrying alone does not help.
    Permission,
    /// A core step refused its inputs or broke its postcondition: a bug; nothing was written.
    Invariant,
    /// The caller's input was refused (a route, a payload, a producer string, an event id or
    /// state): fix the input.
    Input,
    /// A stored row does not parse, or the schema is missing or could not be migrated: an
    /// operator looks at the database.
    Schema,
    /// A consumer's handler failed; its writes were rolled back and the message is retried.
    Effect,
    /// Any other database error.
    Other,
}

impl ErrorKind {
    /// Whether the same call may succeed later without anyone changing anything.
    pub fn is_transient(self) -> bool {
        matches!(
            self,
            ErrorKind::Retryable
                | ErrorKind::Timeout
                | ErrorKind::ConnectionLost
                | ErrorKind::Effect
        )
    }
}

/// The kind of a database error, from its SQLSTATE or, for client-side errors, from the
/// state of the connection.
pub fn db_error_kind(e: &tokio_postgres::Error) -> ErrorKind {
    use tokio_postgres::error::SqlState;
    let Some(d) = e.as_db_error() else {
        // No SQLSTATE: the client failed (I/O, a closed connection, a protocol error).
        return if e.is_closed()
            || std::error::Error::source(e).is_some_and(|s| s.is::<std::io::Error>())
        {
            ErrorKind::ConnectionLost
        } else {
            ErrorKind::Other
        };
    };
    let code = d.code();
    if *code == SqlState::T_R_SERIALIZATION_FAILURE
        || *code == SqlState::T_R_DEADLOCK_DETECTED
        || *code == SqlState::LOCK_NOT_AVAILABLE
    {
        ErrorKind::Retryable
    } else if *code == SqlState::QUERY_CANCELED
        || *code == SqlState::IDLE_IN_TRANSACTION_SESSION_TIMEOUT
    {
        ErrorKind::Timeout
    } else if code.code().starts_with("08")
        || *code == SqlState::ADMIN_SHUTDOWN
        || *code == SqlState::CRASH_SHUTDOWN
        || *code == SqlState::CANNOT_CONNECT_NOW
    {
        ErrorKind::ConnectionLost
    } else if *code == SqlState::INSUFFICIENT_PRIVILEGE {
        ErrorKind::Permission
    } else {
        ErrorKind::Other
    }
}

impl StoreError {
    /// What this error means for the caller ([`ErrorKind`]).
    pub fn kind(&self) -> ErrorKind {
        match self {
            StoreError::Db(e) => db_error_kind(e),
            StoreError::Permission { .. } => ErrorKind::Permission,
            StoreError::Invariant(_) => ErrorKind::Invariant,
            StoreError::NoRoutePolicy(_)
            | StoreError::PayloadTooLarge { .. }
            | StoreError::InvalidInput { .. }
            | StoreError::PayloadKey { .. }
            | StoreError::Contract { .. }
            | StoreError::DeliverySet(_)
            | StoreError::Rollout(_)
            | StoreError::UnknownEvent(_)
            | StoreError::NotQuarantined { .. } => ErrorKind::Input,
            StoreError::Corrupt(_) | StoreError::Migration(..) | StoreError::NotMigrated => {
                ErrorKind::Schema
            }
            StoreError::EffectTimeout(_) => ErrorKind::Timeout,
            StoreError::Effect(_) => ErrorKind::Effect,
        }
    }
}

/// The database's own words: message, SQLSTATE, detail and hint when the server sent them,
/// else the client error and its cause (tokio-postgres alone prints only "db error").
pub fn db_message(e: &tokio_postgres::Error) -> String {
    if let Some(d) = e.as_db_error() {
        let mut m = format!("{} (SQLSTATE {})", d.message(), d.code().code());
        if let Some(detail) = d.detail() {
            m.push_str(&format!("; {detail}"));
        }
        if let Some(hint) = d.hint() {
            m.push_str(&format!("; hint: {hint}"));
        }
        return m;
    }
    match std::error::Error::source(e) {
        Some(cause) => format!("{e}: {cause}"),
        None => e.to_string(),
    }
}

/// Result alias.
pub type Result<T> = std::result::Result<T, StoreError>;

fn uuid_of(e: EventId) -> Uuid {
    Uuid::from_bytes(e.0)
}

fn event_of(u: Uuid) -> EventId {
    EventId(*u.as_bytes())
}

fn digest_of(b: &[u8]) -> Result<Digest> {
    let arr: [u8; 32] = b
        .try_into()
        .map_err(|_| StoreError::Corrupt(format!("digest of {} bytes", b.len())))?;
    Ok(Digest(arr))
}

/// The database clock in milliseconds (R7: leases use it, never a worker's clock).
pub async fn db_now_ms(client: &impl GenericClient) -> Result<u64> {
    counted(1);
    let row = client
        .query_one(
            "SELECT (extract(epoch from clock_timestamp()) * 1000)::bigint",
            &[],
        )
        .await?;
    Ok(row.get::<_, i64>(0) as u64)
}
