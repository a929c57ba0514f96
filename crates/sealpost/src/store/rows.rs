//! The work row as the store reads and writes it: the columns every decision reads, their
//! parsing into the core's [`EventRow`], and the writes of a step's result (`persist`, and
//! `persist_guarded` for the dispatcher's fast path).

use super::*;

/// The work row's `phase` codes ([`Phase::code`]): the SQL below is generated from them.
pub(super) const DISPATCHABLE: i16 = Phase::Dispatchable.code();
pub(super) const UNKNOWN: i16 = Phase::Unknown.code();
pub(super) const SETTLED: i16 = Phase::Settled.code();

/// A list of selected columns as an enum: the variants are the columns in select order, so a
/// column's index in the row ([`at`](RowCol::at)) and its place in the select list
/// ([`select`](RowCol::select)) come from the one list and cannot drift apart.
macro_rules! column_list {
    ($(#[$m:meta])* $name:ident from $base:expr; $($var:ident => $sql:expr),* $(,)?) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub(super) enum $name { $($var),* }
        impl $name {
            /// Every column, in select order.
            #[allow(dead_code)]
            pub(super) const ALL: &'static [$name] = &[$($name::$var),*];
            /// The column's index in a selected row.
            pub(super) const fn at(self) -> usize {
                $base + self as usize
            }
            /// The select list, in order.
            pub(super) fn select() -> String {
                [$(String::from($sql)),*].join(", ")
            }
        }
    };
}
pub(super) use column_list;

column_list! {
    /// The columns every decision reads: the work row and its current sealed generation
    /// ([`parse_row`] turns them into the core's [`EventRow`]).
    RowCol from 0;
    EventId => "w.event_id",
    Member => "w.member",
    EnvelopeGeneration => "w.envelope_generation",
    PayloadDigest => "e.payload_digest",
    DestCluster => "e.dest_cluster",
    DestTopic => "e.dest_topic",
    DestRoutingKey => "e.dest_routing_key",
    DestPartitionAlg => "e.dest_partition_alg",
    DestPolicyGeneration => "e.dest_policy_generation",
    DestSerializer => "e.dest_serializer",
    DestDurability => "e.dest_durability",
    DestRequiredAck => "e.dest_required_ack",
    DestinationDigest => "e.destination_digest",
    State => "w.state",
    ClaimOwner => "w.claim_owner",
    ClaimGeneration => "w.claim_generation",
    LeaseUntilMs => "w.lease_until_ms",
    AttemptGeneration => "w.attempt_generation",
    Rejections => "w.rejections",
    UnknownSinceMs => "w.unknown_since_ms",
    PublishedAtMs => "w.published_at_ms",
    PrimaryAttemptId => "w.primary_attempt_id",
    PrimaryCluster => "w.primary_cluster",
    PrimaryStream => "w.primary_stream",
    PrimaryPartition => "w.primary_partition",
    PrimarySequence => "w.primary_sequence",
    SupersededGenerations => "w.superseded_generations",
    SupersededDigests => "w.superseded_digests",
    NotBeforeMs => "w.not_before_ms",
    NeverSent => "w.never_sent",
    NextLookupAtMs => "w.next_lookup_at_ms",
    Lookups => "w.lookups",
    AttemptId => "w.attempt_id",
    AttemptAgen => "w.attempt_agen",
    AttemptClaimGeneration => "w.attempt_claim_generation",
    AttemptOwner => "w.attempt_owner",
    AttemptEnvelopeGeneration => "w.attempt_envelope_generation",
    AttemptStatus => "w.attempt_status",
    AttemptStartedMs => "w.attempt_started_ms",
    AttemptsArchived => "w.attempts_archived",
    DestOrdering => "e.dest_ordering",
    WorkCluster => "w.dest_cluster",
    Position => "w.committed_seq",
    RowXmin => "w.row_xmin",
}

/// Number of columns in [`RowCol`]; extra selected columns start here.
pub(super) const ROW_COLS_LEN: usize = RowCol::ALL.len();

/// Selects (and locks, if `pick` says `FOR UPDATE`) work rows with `pick` (a
/// `FROM sealpost.work w ...` clause with its own order and limit), then joins their sealed envelopes: the rows are chosen
/// and locked by an ordered scan of the work row's index alone (the planner cannot misjudge
/// the join and sort the whole backlog), and only the locked rows are joined. An empty
/// `order` leaves the result unordered: the caller sorts it (the claim does, in memory:
/// sorting a thousand wide rows with their payloads was a sixth of its statement's time).
pub(super) fn locked_rows_sql(pick: &str, extra_cols: &str, order: &str) -> String {
    let order_by = if order.is_empty() {
        String::new()
    } else {
        format!(" ORDER BY {order}")
    };
    let row_cols = RowCol::select();
    format!(
        "WITH w AS (SELECT w.*, w.xmin::text::bigint AS row_xmin {pick})
         SELECT {row_cols}{extra_cols} FROM w JOIN sealpost.envelope e
           ON e.event_id = w.event_id AND e.member = w.member
          AND e.envelope_generation = w.envelope_generation{order_by}"
    )
}

/// The fact the claim decision takes for a per-aggregate-ordered row (R29): "an earlier
/// version of this aggregate is unresolved". It reads every earlier version of the key in
/// the unresolved phases (0 dispatchable, 1 unknown, 3 quarantined; the `work_ordering_open`
/// index), *whoever holds or locks it*: `SKIP LOCKED` hides a row from the pick, not from
/// this probe. It is evaluated in the claim's own statement, on the statement's snapshot:
///
/// * a version that is unresolved in the snapshot counts, even if it is being published by
///   a transaction that has not committed: the fact errs towards "wait";
/// * a version resolved (phase 2) in the snapshot was published by a committed transaction
///   and never becomes unresolved again (only a database restore undoes it, and it undoes
///   the later versions' sends with it);
/// * so two dispatchers that lock v1 and v2 at the same moment cannot both send: the one
///   holding v2 sees v1 unresolved and waits, and v2 is only sent by a claim that starts
///   after the receipt of v1 committed.
///
/// The producer's side of the bargain: version v + 1 of an aggregate commits after version v
/// (it is written after reading v under the aggregate's lock, as an optimistic version check
/// does). An earlier version committed *later* is not seen by a claim that ran before it.
///
/// This is [`step::holds_back`] in SQL: `ordering_key` is set exactly for rows bound for a
/// per-aggregate-ordered destination, and the phase is the core's [`Phase`].
pub(super) fn earlier_unresolved_sql() -> String {
    format!(
        "(w.ordering_key IS NOT NULL AND EXISTS (
        SELECT 1 FROM sealpost.work p
        WHERE p.ordering_key = w.ordering_key AND p.aggregate_version < w.aggregate_version
          AND p.ordering_key IS NOT NULL AND p.phase <> {SETTLED}))"
    )
}

/// The sealed envelope's description of the event, read by the claim for the wire headers
/// ([`WireEnvelope`]); [`wire_envelope`] parses them from the given column on.
pub(super) const WIRE_ENVELOPE_COLS: &str = "e.event_type, e.aggregate_type, e.aggregate_id,
    e.aggregate_version, e.occurred_at_ms, e.tenant, e.payload_schema_digest";

pub(super) fn wire_envelope(r: &tokio_postgres::Row, from: usize) -> Result<WireEnvelope> {
    Ok(WireEnvelope {
        event_type: r.get(from),
        aggregate_type: r.get(from + 1),
        aggregate_id: r.get(from + 2),
        aggregate_version: r.get::<_, i64>(from + 3) as u64,
        occurred_at_ms: r.get::<_, i64>(from + 4) as u64,
        tenant: r.get(from + 5),
        payload_schema_digest: digest_of(r.get(from + 6))?,
    })
}

/// The database clock in milliseconds at the start of the statement, as SQL: a scalar
/// subquery, so the planner evaluates it once per statement (an init plan), not once per row
/// and condition (`numeric` arithmetic, three times per claimed row).
pub const NOW_MS_SQL: &str = "(SELECT (extract(epoch from statement_timestamp()) * 1000)::bigint)";

/// A loaded row and the number of its earlier attempts kept in `sealpost.attempt`.
pub(super) struct Loaded {
    pub(super) row: EventRow,
    pub(super) archived: i32,
    /// The work row's cluster and commit position: where a lease would list it.
    pub(super) listed_as: (String, u64),
}

pub(super) fn parse_row(r: &tokio_postgres::Row) -> Result<Loaded> {
    use RowCol as C;
    let alg: String = r.get(C::DestPartitionAlg.at());
    let destination = Destination {
        cluster: r.get(C::DestCluster.at()),
        topic: r.get(C::DestTopic.at()),
        routing_key: r.get(C::DestRoutingKey.at()),
        partition_algorithm: PartitionAlgorithm::parse(&alg)
            .ok_or_else(|| StoreError::Corrupt(format!("partition algorithm `{alg}`")))?,
        route_policy_generation: r.get::<_, i64>(C::DestPolicyGeneration.at()) as u64,
        serializer: r.get(C::DestSerializer.at()),
        durability: r.get(C::DestDurability.at()),
        required_ack: r.get(C::DestRequiredAck.at()),
        ordering: {
            let o: &str = r.get(C::DestOrdering.at());
            EventOrdering::parse(o)
                .ok_or_else(|| StoreError::Corrupt(format!("destination ordering `{o}`")))?
        },
    };
    let state_s: String = r.get(C::State.at());
    let state =
        State::parse(&state_s).ok_or_else(|| StoreError::Corrupt(format!("state `{state_s}`")))?;
    let event_id = event_of(r.get(C::EventId.at()));
    let member = r.get::<_, i16>(C::Member.at()) as u16;
    let payload_digest = digest_of(r.get(C::PayloadDigest.at()))?;
    let destination_digest = digest_of(r.get(C::DestinationDigest.at()))?;
    let envelope_generation = r.get::<_, i32>(C::EnvelopeGeneration.at()) as u32;
    // A row is claimed exactly when it has an owner, as the SQL reads it (`claim_owner IS
    // NULL` in the lease rule and the view of migration 12). An owner without a lease (no
    // Sealpost writes one) reads as a claim whose lease ran out at 0, which the next claim
    // takes over; a lease without an owner is no claim.
    let claim = r
        .get::<_, Option<i64>>(C::ClaimOwner.at())
        .map(|owner| Claim {
            owner: owner as u64,
            generation: r.get::<_, i64>(C::ClaimGeneration.at()) as u64,
            lease_until_ms: r.get::<_, Option<i64>>(C::LeaseUntilMs.at()).unwrap_or(0) as u64,
        });
    let primary = r
        .get::<_, Option<i64>>(C::PrimarySequence.at())
        .map(|seq| Receipt {
            event_id,
            member,
            envelope_generation,
            attempt_id: r
                .get::<_, Option<i64>>(C::PrimaryAttemptId.at())
                .unwrap_or(0) as u64,
            payload_digest,
            destination_digest,
            cluster: r
                .get::<_, Option<String>>(C::PrimaryCluster.at())
                .unwrap_or_default(),
            stream: r
                .get::<_, Option<String>>(C::PrimaryStream.at())
                .unwrap_or_default(),
            partition: r
                .get::<_, Option<i32>>(C::PrimaryPartition.at())
                .map(|p| p as u32),
            sequence: seq as u64,
            broker_duplicate: false,
            source: ReceiptSource::Ack,
        });
    let gens: Vec<i32> = r
        .get::<_, Option<Vec<i32>>>(C::SupersededGenerations.at())
        .unwrap_or_default();
    let digs: Vec<Vec<u8>> = r
        .get::<_, Option<Vec<Vec<u8>>>>(C::SupersededDigests.at())
        .unwrap_or_default();
    let superseded = gens
        .iter()
        .zip(&digs)
        .map(|(g, d)| {
            Ok(Superseded {
                envelope_generation: *g as u32,
                destination_digest: digest_of(d)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let mut attempts = Vec::new();
    if let Some(id) = r.get::<_, Option<i64>>(C::AttemptId.at()) {
        // The inline attempt's destination is the one of its envelope generation: the
        // current one, or a superseded one (R15).
        let egen = r.get::<_, i32>(C::AttemptEnvelopeGeneration.at()) as u32;
        let destination_digest = if egen == envelope_generation {
            destination_digest
        } else {
            superseded
                .iter()
                .find(|s| s.envelope_generation == egen)
                .map(|s| s.destination_digest)
                .ok_or_else(|| {
                    StoreError::Corrupt(format!(
                        "attempt {id} of event {event_id} names envelope generation {egen}, which the row does not know"
                    ))
                })?
        };
        let status: String = r.get(C::AttemptStatus.at());
        attempts.push(Attempt {
            id: id as u64,
            attempt_generation: r.get::<_, i32>(C::AttemptAgen.at()) as u32,
            claim_generation: r.get::<_, i64>(C::AttemptClaimGeneration.at()) as u64,
            owner: r.get::<_, i64>(C::AttemptOwner.at()) as u64,
            envelope_generation: egen,
            destination_digest,
            status: parse_status(&status)?,
            started_at_ms: r.get::<_, i64>(C::AttemptStartedMs.at()) as u64,
        });
    }
    Ok(Loaded {
        row: EventRow {
            event_id,
            member,
            envelope_generation,
            payload_digest,
            destination,
            destination_digest,
            state,
            claim,
            claim_generation: r.get::<_, i64>(C::ClaimGeneration.at()) as u64,
            attempt_generation: r.get::<_, i32>(C::AttemptGeneration.at()) as u32,
            attempts,
            primary,
            rejections: r.get::<_, i32>(C::Rejections.at()) as u32,
            unknown_since_ms: r
                .get::<_, Option<i64>>(C::UnknownSinceMs.at())
                .map(|v| v as u64),
            published_at_ms: r
                .get::<_, Option<i64>>(C::PublishedAtMs.at())
                .map(|v| v as u64),
            superseded,
            pacing: Pacing {
                not_before_ms: r.get::<_, i64>(C::NotBeforeMs.at()) as u64,
                never_sent: r.get::<_, i32>(C::NeverSent.at()) as u32,
                next_lookup_at_ms: r.get::<_, i64>(C::NextLookupAtMs.at()) as u64,
                lookups: r.get::<_, i32>(C::Lookups.at()) as u32,
            },
        },
        archived: r.get(C::AttemptsArchived.at()),
        listed_as: (
            r.get(C::WorkCluster.at()),
            r.get::<_, i64>(C::Position.at()) as u64,
        ),
    })
}

fn status_str(s: AttemptStatus) -> &'static str {
    match s {
        AttemptStatus::Sending => "SENDING",
        AttemptStatus::Unknown => "UNKNOWN",
        AttemptStatus::Acked => "ACKED",
        AttemptStatus::Failed => "FAILED",
    }
}

fn parse_status(s: &str) -> Result<AttemptStatus> {
    Ok(match s {
        "SENDING" => AttemptStatus::Sending,
        "UNKNOWN" => AttemptStatus::Unknown,
        "ACKED" => AttemptStatus::Acked,
        "FAILED" => AttemptStatus::Failed,
        other => return Err(StoreError::Corrupt(format!("attempt status `{other}`"))),
    })
}

/// Parses loaded rows and puts the earlier attempts (kept in `sealpost.attempt` only for rows
/// that have any) before the inline one, in registration order.
pub(super) async fn finish_load(
    tx: &impl GenericClient,
    found: &[tokio_postgres::Row],
) -> Result<Vec<EventRow>> {
    Ok(finish_load_through(tx, found, None).await?.0)
}

/// [`finish_load`], reading never-claimed rows through the leases in `known` (the claim's,
/// read under its lock) instead of asking the database; with the lease of each row read so.
pub(super) async fn finish_load_through(
    tx: &impl GenericClient,
    found: &[tokio_postgres::Row],
    known: Option<&super::lease::Leases>,
) -> Result<(Vec<EventRow>, Vec<Option<i64>>)> {
    let loaded = found.iter().map(parse_row).collect::<Result<Vec<_>>>()?;
    let ids: Vec<Uuid> = loaded
        .iter()
        .filter(|l| l.archived > 0)
        .map(|l| uuid_of(l.row.event_id))
        .collect();
    let listed_as: Vec<(String, u64)> = loaded.iter().map(|l| l.listed_as.clone()).collect();
    let mut rows: Vec<EventRow> = loaded.into_iter().map(|l| l.row).collect();
    // A row with archived attempts is never a never-claimed one: the two reads are apart.
    let leases = super::lease::read_through_leases(tx, &mut rows, &listed_as, known).await?;
    if ids.is_empty() {
        return Ok((rows, leases));
    }
    counted(1);
    let found = tx
        .query(
            "SELECT attempt_id, event_id, member, attempt_generation, claim_generation, owner,
                    envelope_generation, destination_digest, status, started_at_ms
             FROM sealpost.attempt WHERE event_id = ANY($1) ORDER BY attempt_id",
            &[&ids],
        )
        .await?;
    let mut index: HashMap<(EventId, u16), usize> = HashMap::with_capacity(rows.len());
    for (i, r) in rows.iter().enumerate() {
        index.insert((r.event_id, r.member), i);
    }
    let mut history: HashMap<usize, Vec<Attempt>> = HashMap::new();
    for a in found {
        let key = (event_of(a.get(1)), a.get::<_, i16>(2) as u16);
        if let Some(&i) = index.get(&key) {
            let status: String = a.get(8);
            history.entry(i).or_default().push(Attempt {
                id: a.get::<_, i64>(0) as u64,
                attempt_generation: a.get::<_, i32>(3) as u32,
                claim_generation: a.get::<_, i64>(4) as u64,
                owner: a.get::<_, i64>(5) as u64,
                envelope_generation: a.get::<_, i32>(6) as u32,
                destination_digest: digest_of(a.get(7))?,
                status: parse_status(&status)?,
                started_at_ms: a.get::<_, i64>(9) as u64,
            });
        }
    }
    for (i, mut h) in history {
        h.append(&mut rows[i].attempts);
        rows[i].attempts = h;
    }
    Ok((rows, leases))
}

/// Locks and loads the rows for `keys` (in key order, so concurrent batches cannot deadlock).
pub(super) async fn lock_rows(
    tx: &impl GenericClient,
    keys: &[(EventId, u16)],
) -> Result<Vec<EventRow>> {
    Ok(lock_rows_created(tx, keys).await?.0)
}

/// [`lock_rows`], with each row's commit time (`created_at_ms`, database clock) beside it:
/// the acceptance point measures commit -> `PUBLISHED` with it.
pub(super) async fn lock_rows_created(
    tx: &impl GenericClient,
    keys: &[(EventId, u16)],
) -> Result<(Vec<EventRow>, Vec<u64>)> {
    let mut sorted: Vec<(EventId, u16)> = keys.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let ids: Vec<Uuid> = sorted.iter().map(|k| uuid_of(k.0)).collect();
    let members: Vec<i16> = sorted.iter().map(|k| k.1 as i16).collect();
    let q = locked_rows_sql(
        "FROM sealpost.work w
         JOIN unnest($1::uuid[], $2::int2[]) AS k(id, m) ON w.event_id = k.id AND w.member = k.m
         ORDER BY w.event_id, w.member FOR UPDATE OF w",
        ", w.created_at_ms",
        "w.event_id, w.member",
    );
    counted(1);
    let found = tx.query(q.as_str(), &[&ids, &members]).await?;
    let created = found
        .iter()
        // `w.created_at_ms`, the one column after the row's.
        .map(|r| r.get::<_, i64>(ROW_COLS_LEN).max(0) as u64)
        .collect();
    Ok((finish_load(tx, &found).await?, created))
}

/// Writes every difference between `before` and `after` (same order, same keys): the work
/// row's columns the core may change (the latest attempt inline among them), and the earlier
/// attempts in `sealpost.attempt` (new ones inserted, status changes updated).
pub(super) async fn persist(
    tx: &impl GenericClient,
    before: &[EventRow],
    after: &[EventRow],
) -> Result<()> {
    persist_guarded(tx, before, after, None, None)
        .await
        .map(|_| ())
}

/// A column of a batched write: one value per row, or the one value every row gets. A batch
/// of claims or acceptances mostly writes the same state, owner, lease, cluster and stream
/// to every row: those go as one parameter, not an array of a thousand copies to unnest.
#[derive(Clone, Copy)]
enum Bind<'a> {
    Each(&'a (dyn tokio_postgres::types::ToSql + Sync)),
    Same(&'a (dyn tokio_postgres::types::ToSql + Sync)),
}

impl<'a> Bind<'a> {
    fn value(&self) -> &'a (dyn tokio_postgres::types::ToSql + Sync) {
        match self {
            Bind::Each(v) | Bind::Same(v) => *v,
        }
    }
}

// A `Vec`, not a slice: the array parameter is the `Vec` itself (`[T]` is unsized).
#[allow(clippy::ptr_arg)]
fn bind<T>(values: &Vec<T>) -> Bind<'_>
where
    T: tokio_postgres::types::ToSql + Sync + PartialEq,
{
    match values.split_first() {
        Some((first, rest)) if rest.iter().all(|x| x == first) => Bind::Same(first),
        _ => Bind::Each(values),
    }
}

/// The batched `UPDATE` of work rows: `$1`/`$2` are the keys, then one parameter per column
/// of `cols` in order (an array to unnest, or one value for every row), then the guard's
/// `xmin`s if any.
fn update_sql(cols: &[(&str, &str, Bind<'_>)], guard: Option<Bind<'_>>) -> String {
    let mut set = Vec::new();
    let mut arrays = vec!["$1::uuid[]".to_string(), "$2::int2[]".to_string()];
    let mut names = vec!["id", "m"];
    for (i, (c, t, b)) in cols.iter().enumerate() {
        let n = i + 3;
        match b {
            Bind::Each(_) => {
                set.push(format!("{c} = u.{c}"));
                arrays.push(format!("${n}::{t}[]"));
                names.push(c);
            }
            Bind::Same(_) => set.push(format!("{c} = ${n}::{t}")),
        }
    }
    // The guard: `xmin` is the id of the transaction that wrote the row version, so it
    // equals the caller's only if no one has written the row since.
    let n = cols.len() + 3;
    let (cas, returning) = match guard {
        None => (String::new(), ""),
        Some(Bind::Each(_)) => {
            arrays.push(format!("${n}::int8[]"));
            names.push("xmin_then");
            (
                " AND w.xmin = u.xmin_then::text::xid".to_string(),
                " RETURNING w.event_id, w.member",
            )
        }
        Some(Bind::Same(_)) => (
            format!(" AND w.xmin = ${n}::int8::text::xid"),
            " RETURNING w.event_id, w.member",
        ),
    };
    format!(
        "UPDATE sealpost.work w SET {}
         FROM unnest({}) AS u({})
         WHERE w.event_id = u.id AND w.member = u.m{cas}{returning}",
        set.join(", "),
        arrays.join(", "),
        names.join(", ")
    )
}

/// What identifies the inline (latest) attempt, its status aside.
fn inline_identity(r: &EventRow) -> Option<(u64, u32, u64, u64, u32, u64)> {
    r.attempts.last().map(|x| {
        (
            x.id,
            x.attempt_generation,
            x.claim_generation,
            x.owner,
            x.envelope_generation,
            x.started_at_ms,
        )
    })
}

/// Statements kept per connection at most (see [`Prepared`]).
const PREPARED_MAX: usize = 64;

/// Prepared statements of one connection, by SQL text: the dispatcher's claim and acceptance
/// statements are parsed once per connection, not once per batch (a round trip and the
/// server's parse and analysis each time). Statements belong to the connection that prepared
/// them: [`Held::forget_statements`] drops them when it is replaced.
#[derive(Default)]
pub(super) struct Prepared {
    by_sql: HashMap<String, tokio_postgres::Statement>,
}

impl std::fmt::Debug for Prepared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prepared")
            .field("statements", &self.by_sql.len())
            .finish()
    }
}

/// `sql` prepared on `client`, from `cache` if the caller keeps one.
pub(super) async fn prepare(
    cache: Option<&mut Prepared>,
    client: &impl GenericClient,
    sql: &str,
) -> Result<tokio_postgres::Statement> {
    match cache {
        Some(c) => c.get(client, sql).await,
        None => Ok(client.prepare(sql).await?),
    }
}

impl Prepared {
    async fn get(
        &mut self,
        client: &impl GenericClient,
        sql: &str,
    ) -> Result<tokio_postgres::Statement> {
        if let Some(s) = self.by_sql.get(sql) {
            return Ok(s.clone());
        }
        let s = client.prepare(sql).await?;
        // A dispatcher uses a handful of shapes (which columns a batch shares); the bound
        // only keeps an unusual mix of batches from holding statements without end.
        if self.by_sql.len() >= PREPARED_MAX {
            self.by_sql.clear();
        }
        self.by_sql.insert(sql.to_string(), s.clone());
        Ok(s)
    }
}

/// A work-row column the core may change, and how to read its value from a row.
pub(super) struct WorkColumn {
    name: &'static str,
    value: Getter,
}

/// A column's SQL type and its value for a row (`None` writes `NULL`).
#[derive(Clone, Copy)]
enum Getter {
    Int2(fn(&EventRow) -> Option<i16>),
    Int4(fn(&EventRow) -> Option<i32>),
    Int8(fn(&EventRow) -> Option<i64>),
    Text(fn(&EventRow) -> Option<String>),
}

/// One column's values over the rows of a write.
enum Values {
    Int2(Vec<Option<i16>>),
    Int4(Vec<Option<i32>>),
    Int8(Vec<Option<i64>>),
    Text(Vec<Option<String>>),
}

impl Getter {
    fn sql_type(self) -> &'static str {
        match self {
            Getter::Int2(_) => "int2",
            Getter::Int4(_) => "int4",
            Getter::Int8(_) => "int8",
            Getter::Text(_) => "text",
        }
    }

    fn of(self, rows: &[&EventRow]) -> Values {
        match self {
            Getter::Int2(f) => Values::Int2(rows.iter().map(|r| f(r)).collect()),
            Getter::Int4(f) => Values::Int4(rows.iter().map(|r| f(r)).collect()),
            Getter::Int8(f) => Values::Int8(rows.iter().map(|r| f(r)).collect()),
            Getter::Text(f) => Values::Text(rows.iter().map(|r| f(r)).collect()),
        }
    }
}

impl Values {
    fn bind(&self) -> Bind<'_> {
        match self {
            Values::Int2(v) => bind(v),
            Values::Int4(v) => bind(v),
            Values::Int8(v) => bind(v),
            Values::Text(v) => bind(v),
        }
    }
}

/// A group of work-row columns written together: when some row's `changed(before, after)`
/// holds (or `always`, for any changed row), the batch writes every column of the group.
pub(super) struct ColumnGroup {
    always: bool,
    changed: fn(&EventRow, &EventRow) -> bool,
    columns: &'static [WorkColumn],
}

const fn col(name: &'static str, value: Getter) -> WorkColumn {
    WorkColumn { name, value }
}

/// Every work-row column a step may change, by group: the one description [`persist`]
/// writes from. A changed row is one for which some group's `changed` holds; the history of
/// earlier attempts (`sealpost.attempt`) is written apart.
pub(super) static WRITTEN: &[ColumnGroup] = &[
    ColumnGroup {
        always: true,
        changed: |b, a| b.state != a.state,
        columns: &[
            col(
                "state",
                Getter::Text(|r| Some(r.state.as_str().to_string())),
            ),
            col("phase", Getter::Int2(|r| Some(r.state.phase().code()))),
        ],
    },
    ColumnGroup {
        always: false,
        changed: |b, a| b.claim != a.claim || b.claim_generation != a.claim_generation,
        columns: &[
            col(
                "claim_owner",
                Getter::Int8(|r| r.claim.as_ref().map(|c| c.owner as i64)),
            ),
            col(
                "claim_generation",
                Getter::Int8(|r| Some(r.claim_generation as i64)),
            ),
            col(
                "lease_until_ms",
                Getter::Int8(|r| r.claim.as_ref().map(|c| c.lease_until_ms as i64)),
            ),
        ],
    },
    ColumnGroup {
        always: false,
        changed: |b, a| b.attempt_generation != a.attempt_generation,
        columns: &[col(
            "attempt_generation",
            Getter::Int4(|r| Some(r.attempt_generation as i32)),
        )],
    },
    ColumnGroup {
        always: false,
        changed: |b, a| b.rejections != a.rejections,
        columns: &[col(
            "rejections",
            Getter::Int4(|r| Some(r.rejections as i32)),
        )],
    },
    ColumnGroup {
        always: false,
        changed: |b, a| b.unknown_since_ms != a.unknown_since_ms,
        columns: &[col(
            "unknown_since_ms",
            Getter::Int8(|r| r.unknown_since_ms.map(|v| v as i64)),
        )],
    },
    ColumnGroup {
        always: false,
        changed: |b, a| b.published_at_ms != a.published_at_ms,
        columns: &[col(
            "published_at_ms",
            Getter::Int8(|r| r.published_at_ms.map(|v| v as i64)),
        )],
    },
    ColumnGroup {
        always: false,
        changed: |b, a| b.primary != a.primary,
        columns: &[
            col(
                "primary_attempt_id",
                Getter::Int8(|r| r.primary.as_ref().map(|p| p.attempt_id as i64)),
            ),
            col(
                "primary_cluster",
                Getter::Text(|r| r.primary.as_ref().map(|p| p.cluster.clone())),
            ),
            col(
                "primary_stream",
                Getter::Text(|r| r.primary.as_ref().map(|p| p.stream.clone())),
            ),
            col(
                "primary_partition",
                Getter::Int4(|r| {
                    r.primary
                        .as_ref()
                        .and_then(|p| p.partition.map(|x| x as i32))
                }),
            ),
            col(
                "primary_sequence",
                Getter::Int8(|r| r.primary.as_ref().map(|p| p.sequence as i64)),
            ),
        ],
    },
    ColumnGroup {
        always: false,
        changed: |b, a| b.pacing != a.pacing,
        columns: &[
            col(
                "not_before_ms",
                Getter::Int8(|r| Some(r.pacing.not_before_ms as i64)),
            ),
            col(
                "never_sent",
                Getter::Int4(|r| Some(r.pacing.never_sent as i32)),
            ),
            col(
                "next_lookup_at_ms",
                Getter::Int8(|r| Some(r.pacing.next_lookup_at_ms as i64)),
            ),
            col("lookups", Getter::Int4(|r| Some(r.pacing.lookups as i32))),
        ],
    },
    // The inline (latest) attempt: a claim writes all of it, an acceptance its status only.
    ColumnGroup {
        always: false,
        changed: |b, a| {
            inline_identity(b) != inline_identity(a) || b.attempts.len() != a.attempts.len()
        },
        columns: &[
            col(
                "attempt_id",
                Getter::Int8(|r| r.attempts.last().map(|x| x.id as i64)),
            ),
            col(
                "attempt_agen",
                Getter::Int4(|r| r.attempts.last().map(|x| x.attempt_generation as i32)),
            ),
            col(
                "attempt_claim_generation",
                Getter::Int8(|r| r.attempts.last().map(|x| x.claim_generation as i64)),
            ),
            col(
                "attempt_owner",
                Getter::Int8(|r| r.attempts.last().map(|x| x.owner as i64)),
            ),
            col(
                "attempt_envelope_generation",
                Getter::Int4(|r| r.attempts.last().map(|x| x.envelope_generation as i32)),
            ),
            col(
                "attempt_started_ms",
                Getter::Int8(|r| r.attempts.last().map(|x| x.started_at_ms as i64)),
            ),
            col(
                "attempts_archived",
                Getter::Int4(|r| Some(r.attempts.len().saturating_sub(1) as i32)),
            ),
        ],
    },
    ColumnGroup {
        always: false,
        changed: |b, a| b.attempts.last() != a.attempts.last(),
        columns: &[col(
            "attempt_status",
            Getter::Text(|r| r.attempts.last().map(|x| status_str(x.status).to_string())),
        )],
    },
];

/// [`persist`], and with `guard` (each row's `xmin` as the caller last wrote it, parallel to
/// `before`) a compare-and-set: a row is written only if no one has written it since, and
/// the keys of the rows written are returned. A guarded write changes the work row only
/// (the caller ensures `after` adds no attempt history).
pub(super) async fn persist_guarded<B: std::borrow::Borrow<EventRow>>(
    tx: &impl GenericClient,
    before: &[B],
    after: &[EventRow],
    guard: Option<&[i64]>,
    prepared: Option<&mut Prepared>,
) -> Result<Vec<(EventId, u16)>> {
    let mut u_xmin: Vec<i64> = Vec::new();
    let mut u_id = Vec::new();
    let mut u_member = Vec::new();
    let mut changed_rows: Vec<&EventRow> = Vec::new();
    let mut a_id = Vec::new();
    let mut a_event = Vec::new();
    let mut a_member = Vec::new();
    let mut a_agen = Vec::new();
    let mut a_cgen = Vec::new();
    let mut a_owner = Vec::new();
    let mut a_egen = Vec::new();
    let mut a_dest: Vec<Vec<u8>> = Vec::new();
    let mut a_status = Vec::new();
    let mut a_started = Vec::new();
    let mut s_id = Vec::new();
    let mut s_status = Vec::new();
    // The column groups some row of this batch changed: only those are sent and written (a
    // claim writes the state, the claim and the inline attempt; an acceptance the state, the
    // slot and the attempt's status).
    let mut groups = vec![false; WRITTEN.len()];
    for (k, (b, a)) in before.iter().map(B::borrow).zip(after).enumerate() {
        debug_assert_eq!((b.event_id, b.member), (a.event_id, a.member));
        let mut row_changed = false;
        for (g, group) in WRITTEN.iter().enumerate() {
            if (group.changed)(b, a) {
                groups[g] = true;
                row_changed = true;
            }
        }
        if row_changed && sealpost_core::lease::as_leased(b).is_some() {
            // `b` may be a lease's view of a row still never claimed in its own columns:
            // the write stores every column, not only those that differ from the view.
            groups.iter_mut().for_each(|g| *g = true);
        }
        if row_changed {
            if let Some(g) = guard {
                u_xmin.push(g[k]);
            }
            u_id.push(uuid_of(a.event_id));
            u_member.push(a.member as i16);
            changed_rows.push(a);
        }
        // Every attempt but the latest is history, kept in sealpost.attempt.
        let hist_b = &b.attempts[..b.attempts.len().saturating_sub(1)];
        let hist_a = &a.attempts[..a.attempts.len().saturating_sub(1)];
        for at in hist_a {
            match hist_b.iter().find(|x| x.id == at.id) {
                None => {
                    a_id.push(at.id as i64);
                    a_event.push(uuid_of(a.event_id));
                    a_member.push(a.member as i16);
                    a_agen.push(at.attempt_generation as i32);
                    a_cgen.push(at.claim_generation as i64);
                    a_owner.push(at.owner as i64);
                    a_egen.push(at.envelope_generation as i32);
                    a_dest.push(at.destination_digest.0.to_vec());
                    a_status.push(status_str(at.status).to_string());
                    a_started.push(at.started_at_ms as i64);
                }
                Some(old) if old.status != at.status => {
                    s_id.push(at.id as i64);
                    s_status.push(status_str(at.status).to_string());
                }
                Some(_) => {}
            }
        }
    }
    let mut written = Vec::new();
    if !u_id.is_empty() {
        let columns: Vec<&WorkColumn> = WRITTEN
            .iter()
            .zip(&groups)
            .filter(|(g, changed)| g.always || **changed)
            .flat_map(|(g, _)| g.columns)
            .collect();
        let values: Vec<Values> = columns.iter().map(|c| c.value.of(&changed_rows)).collect();
        let cols: Vec<(&str, &str, Bind<'_>)> = columns
            .iter()
            .zip(&values)
            .map(|(c, v)| (c.name, c.value.sql_type(), v.bind()))
            .collect();
        let xmin_then = guard.map(|_| bind(&u_xmin));
        let q = update_sql(&cols, xmin_then);
        let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = vec![&u_id, &u_member];
        params.extend(cols.iter().map(|(_, _, b)| b.value()));
        params.extend(xmin_then.map(|b| b.value()));
        counted(1);
        let statement = prepare(prepared, tx, &q).await?;
        if guard.is_some() {
            written = tx
                .query(&statement, &params)
                .await?
                .iter()
                .map(|r| (event_of(r.get(0)), r.get::<_, i16>(1) as u16))
                .collect();
        } else {
            tx.execute(&statement, &params).await?;
        }
    }
    debug_assert!(
        guard.is_none() || (a_id.is_empty() && s_id.is_empty()),
        "a guarded write changes the work row only"
    );
    if !a_id.is_empty() {
        counted(1);
        tx.execute(
            "INSERT INTO sealpost.attempt (attempt_id, event_id, member, attempt_generation, claim_generation,
                owner, envelope_generation, destination_digest, status, started_at_ms)
             SELECT * FROM unnest($1::int8[], $2::uuid[], $3::int2[], $4::int4[], $5::int8[], $6::int8[],
                                  $7::int4[], $8::bytea[], $9::text[], $10::int8[])",
            &[&a_id, &a_event, &a_member, &a_agen, &a_cgen, &a_owner, &a_egen, &a_dest, &a_status, &a_started],
        )
        .await?;
    }
    if !s_id.is_empty() {
        counted(1);
        tx.execute(
            "UPDATE sealpost.attempt a SET status = u.status
             FROM unnest($1::int8[], $2::text[]) AS u(id, status) WHERE a.attempt_id = u.id",
            &[&s_id, &s_status],
        )
        .await?;
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_column_every_row_shares_is_one_parameter_and_the_rest_are_unnested() {
        let state = vec!["PUBLISHED".to_string(); 3];
        let seq: Vec<i64> = vec![7, 8, 9];
        let part: Vec<Option<i32>> = vec![None, None, None];
        let cols = vec![
            ("state", "text", bind(&state)),
            ("primary_sequence", "int8", bind(&seq)),
            ("primary_partition", "int4", bind(&part)),
        ];
        assert!(matches!(cols[0].2, Bind::Same(_)));
        assert!(matches!(cols[1].2, Bind::Each(_)));
        assert!(
            matches!(cols[2].2, Bind::Same(_)),
            "NULL for every row is one NULL"
        );
        let q = update_sql(&cols, None);
        assert!(q.contains("state = $3::text"), "{q}");
        assert!(q.contains("primary_sequence = u.primary_sequence"), "{q}");
        assert!(q.contains("primary_partition = $5::int4"), "{q}");
        assert!(
            q.contains("unnest($1::uuid[], $2::int2[], $4::int8[]) AS u(id, m, primary_sequence)"),
            "{q}"
        );
        assert!(!q.contains("RETURNING"), "{q}");
    }

    #[test]
    fn the_guard_compares_xmin_as_one_value_or_per_row() {
        let state = vec!["PUBLISHED".to_string(), "PUBLISHED".to_string()];
        let cols = vec![("state", "text", bind(&state))];
        let one: Vec<i64> = vec![41, 41];
        let q = update_sql(&cols, Some(bind(&one)));
        assert!(q.contains("AND w.xmin = $4::int8::text::xid"), "{q}");
        assert!(q.ends_with("RETURNING w.event_id, w.member"), "{q}");
        let two: Vec<i64> = vec![41, 42];
        let q = update_sql(&cols, Some(bind(&two)));
        assert!(q.contains("$4::int8[]) AS u(id, m, xmin_then)"), "{q}");
        assert!(q.contains("AND w.xmin = u.xmin_then::text::xid"), "{q}");
    }

    #[test]
    fn every_written_column_is_read_back_except_the_phase_derived_from_the_state() {
        let read = RowCol::select();
        let mut names = Vec::new();
        for c in WRITTEN.iter().flat_map(|g| g.columns) {
            assert!(!names.contains(&c.name), "{} written twice", c.name);
            names.push(c.name);
            if c.name != "phase" {
                assert!(
                    read.contains(&format!("w.{}", c.name)),
                    "{} is not read",
                    c.name
                );
            }
        }
        assert_eq!(RowCol::ALL.len(), read.split(", ").count());
        assert_eq!(RowCol::RowXmin.at(), ROW_COLS_LEN - 1);
    }

    #[test]
    fn an_empty_batch_has_no_shared_value() {
        let none: Vec<i64> = Vec::new();
        assert!(matches!(bind(&none), Bind::Each(_)));
    }
}
