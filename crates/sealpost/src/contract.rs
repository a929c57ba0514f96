//! Contracts (R26) in the outbox database: the registry of each event type's payload schemas
//! (`sealpost.contract`), the route switch that makes `enqueue` check payloads, and loading a
//! consumer's [`Reader`].
//!
//! The rules themselves (parsing and annotations, the breaking-change table, the enqueue
//! check, reading any version into a reader's) are [`sealpost_core::contract`]'s pure
//! functions, re-exported here; the simulator decides with the same ones. See that module
//! for the table of rules.

use std::collections::HashMap;

use sealpost_core::envelope::NewEvent;
use tokio_postgres::GenericClient;

use crate::store::StoreError;

pub use sealpost_core::contract::*;

/// Errors of the registry: a contract refused, or the database.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The schema, registration or payload was refused; says which rule and what to do.
    #[error(transparent)]
    Contract(#[from] ContractError),
    /// The database.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<tokio_postgres::Error> for Error {
    fn from(e: tokio_postgres::Error) -> Self {
        Error::Store(e.into())
    }
}

/// The registered versions of `event_type`, oldest first.
pub async fn versions(
    client: &impl GenericClient,
    event_type: &str,
) -> Result<Vec<SchemaVersion>, Error> {
    let rows = client
        .query(
            "SELECT version, schema_text FROM sealpost.contract WHERE event_type = $1 ORDER BY version",
            &[&event_type],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| registered(event_type, r.get::<_, i32>(0) as u32, r.get(1)))
        .collect::<Result<_, _>>()?)
}

/// Each event type with a registered contract: (event type, latest version, when registered).
pub async fn event_types(client: &impl GenericClient) -> Result<Vec<(String, u32, String)>, Error> {
    let rows = client
        .query(
            "SELECT DISTINCT ON (event_type) event_type, version,
                    to_char(registered_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')
               FROM sealpost.contract ORDER BY event_type, version DESC",
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| (r.get(0), r.get::<_, i32>(1) as u32, r.get(2)))
        .collect())
}

/// Checks `text` as the next version of `event_type` without writing anything.
pub async fn check(
    client: &impl GenericClient,
    event_type: &str,
    text: &str,
) -> Result<Check, Error> {
    let candidate = parse(event_type, text)?;
    let registered = versions(client, event_type).await?;
    Ok(Check::new(&registered, candidate))
}

/// Registers `text` as the next version of `event_type` if it breaks no rule against any
/// registered version (both ways); registering a text already registered returns that
/// version. Concurrent registrations of one event type take turns.
pub async fn register(
    client: &mut tokio_postgres::Client,
    event_type: &str,
    text: &str,
) -> Result<(SchemaVersion, bool), Error> {
    if event_type.is_empty() || event_type.chars().any(|c| c.is_control() || c == '@') {
        return Err(ContractError::Parse {
            event_type: event_type.escape_debug().to_string(),
            reason: "an event type is non-empty, without control characters or `@`".into(),
        }
        .into());
    }
    let tx = client.transaction().await?;
    tx.execute(
        "SELECT pg_advisory_xact_lock(hashtextextended('sealpost.contract:' || $1, 0))",
        &[&event_type],
    )
    .await?;
    let (s, new) = check(&tx, event_type, text).await?.registration()?;
    if new {
        tx.execute(
            "INSERT INTO sealpost.contract (event_type, version, schema_text, fingerprint)
             VALUES ($1, $2, $3, $4)",
            &[
                &event_type,
                &(s.version as i32),
                &s.text,
                &s.fingerprint.0.as_slice(),
            ],
        )
        .await?;
        tx.commit().await?;
    }
    Ok((s, new))
}

/// Turns the contract check of route `route` on or off; `false` when there is no such route.
pub async fn set_route_contracts(
    client: &impl GenericClient,
    route: &str,
    required: bool,
) -> Result<bool, Error> {
    let n = client
        .execute(
            "UPDATE sealpost.route_policy SET contracts = $2, updated_at = now() WHERE name = $1",
            &[&route, &required],
        )
        .await?;
    Ok(n == 1)
}

/// A [`Reader`] of `event_type` at `reader_version`, resolving from the versions registered in
/// the outbox database now; refused when one of them cannot be read into the reader's version.
pub async fn load_reader(
    client: &impl GenericClient,
    event_type: &str,
    reader_version: u32,
) -> Result<Reader, Error> {
    Ok(Reader::new(
        event_type,
        reader_version,
        versions(client, event_type).await?,
    )?)
}

/// [`Reader::read`] of a consumer's delivery (its envelope's schema digest).
pub fn read_delivery(
    reader: &Reader,
    d: &crate::consumer::Delivery,
) -> Result<(u32, apache_avro::types::Value), ContractError> {
    let env = d.envelope.as_ref().ok_or_else(|| ContractError::Payload {
        id: reader.version().id(),
        reason: "the delivery carries no envelope headers, so its schema version is not known"
            .into(),
    })?;
    reader.read(&env.payload_schema_digest, &d.payload)
}

/// The schema text `enqueue` checks a payload against (shared with the sqlx flavour).
pub(crate) const SCHEMA_FOR_ENQUEUE_SQL: &str =
    "SELECT schema_text FROM sealpost.contract WHERE event_type = $1 AND version = $2";

/// The enqueue check with tokio-postgres of each of `events` (its index in the call names a
/// refused one), the schemas fetched once per distinct id.
pub(crate) async fn check_payloads<'e, 'a: 'e>(
    client: &impl GenericClient,
    events: impl Iterator<Item = &'e NewEvent<'a>>,
) -> crate::store::Result<()> {
    let mut texts: HashMap<&str, Option<String>> = HashMap::new();
    for (index, ev) in events.enumerate() {
        let id = ev.payload_schema;
        if !texts.contains_key(id) {
            let text = match schema_to_fetch(ev) {
                Some((t, v)) => client
                    .query_opt(SCHEMA_FOR_ENQUEUE_SQL, &[&t, &v])
                    .await?
                    .map(|r| r.get::<_, String>(0)),
                None => None,
            };
            texts.insert(id, text);
        }
        check_payload(ev.event_type, id, texts[id].as_deref(), ev.payload).map_err(|e| {
            StoreError::Contract {
                index,
                reason: e.to_string(),
            }
        })?;
    }
    Ok(())
}
