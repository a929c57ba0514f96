//! The dispatcher's claim: load the candidate rows, run [`step::step_claim`], persist the
//! attempts it opened, and hand the dispatcher its sends.

use super::*;
use sealpost_core::rollout::{self, AliasCheck, ClaimFacts, Implementation};

/// A send this dispatcher is now authorised to make.
#[derive(Clone, Debug)]
pub struct Outgoing {
    /// The row as it is after registration.
    pub event_id: EventId,
    /// Member.
    pub member: u16,
    /// Envelope generation.
    pub envelope_generation: u32,
    /// The registered attempt.
    pub attempt_id: u64,
    /// The claim to present with every later write.
    pub token: ClaimToken,
    /// Payload digest (header).
    pub payload_digest: Digest,
    /// Frozen destination.
    pub destination: Destination,
    /// Its digest (header).
    pub destination_digest: Digest,
    /// Payload bytes as sealed.
    pub payload: Vec<u8>,
    /// Lease end of the claim (database clock).
    pub lease_until_ms: u64,
    /// The envelope's description of the event (wire headers).
    pub envelope: WireEnvelope,
}

impl Outgoing {
    /// [`Outgoing::send_request`] without copying the payload.
    pub fn into_send_request(self) -> SendRequest {
        SendRequest {
            event_id: self.event_id,
            member: self.member,
            envelope_generation: self.envelope_generation,
            attempt_id: self.attempt_id,
            payload_digest: self.payload_digest,
            destination: self.destination,
            destination_digest: self.destination_digest,
            payload: self.payload,
            envelope: self.envelope,
            signature: None,
        }
    }

    /// The message the broker adapter sends for this authorised attempt (the adapter sees
    /// the broker port's [`SendRequest`], never the store's row or claim token).
    pub fn send_request(&self) -> SendRequest {
        self.clone().into_send_request()
    }
}

/// What one claim scan did.
#[derive(Clone, Debug, Default)]
pub struct ClaimBatch {
    /// The database clock inside the claim transaction.
    pub db_now_ms: u64,
    /// Sends authorised (attempts registered, rows `SENDING`).
    pub outgoing: Vec<Outgoing>,
    /// `SENDING` rows whose lease had expired, moved to `DISPATCH_UNKNOWN`.
    pub expired_to_unknown: usize,
    /// The highest commit position among the rows the scan locked.
    pub last_position: Option<u64>,
    /// The lowest commit position among the sends bound for an ordered destination.
    pub ordered_from: Option<u64>,
    /// Rows the scan locked that wait for an earlier event of their aggregate (R29).
    pub ordering_waits: usize,
    /// The database's transactions when the claim began (a scan's claim; `None` for a claim
    /// of named rows).
    pub horizon: Option<Horizon>,
}

impl ClaimBatch {
    /// The claim as the dispatcher machine takes it; `claim_started_ms` is the shell's clock
    /// read just before the claim transaction started.
    pub fn claimed(self, claim_started_ms: u64) -> Claimed {
        let db_now_ms = self.db_now_ms;
        Claimed {
            last_position: self.last_position,
            ordered_from: self.ordered_from,
            claim_started_ms,
            db_now_ms,
            horizon: self.horizon,
            sends: self
                .outgoing
                .into_iter()
                .map(|o| ClaimedSend {
                    token: o.token,
                    db_lease_until_ms: o.lease_until_ms,
                    request: o.into_send_request(),
                })
                .collect(),
        }
    }
}

/// What a claim takes: whose claim it is, which rows it may pick and how many, and for how
/// long. The one request type of every claim: the polling dispatcher's (commit order over the
/// claim index), a test's, and the CDC publisher's (only the rows the database log named).
#[derive(Clone, Copy, Debug)]
pub struct ClaimRequest<'a> {
    /// The claiming process ([`crate::runtime::owner_id`]).
    pub owner: u64,
    /// Only rows bound for this destination cluster (`None`: every cluster). A dispatcher
    /// never claims a row it cannot send; those rows wait for a dispatcher of their cluster
    /// instead of cycling through "never sent".
    pub cluster: Option<&'a str>,
    /// Only rows at or after this commit position (the dispatcher machine's scan position:
    /// it skips the head of the queue that earlier batches claimed, whose index entries are
    /// dead until vacuum, and scans from 0 at least every `rescan_every_ms`).
    pub from_position: u64,
    /// Rows picked at most (each picked row counts, sent or not).
    pub batch_size_max: usize,
    /// Lease of the claim, milliseconds of the database clock.
    pub lease_ms: u64,
    /// Only these `(event, member)` rows (`None`: any row). The CDC publisher names the rows
    /// a committed transaction inserted; the pick, the ordering rule and the step are the
    /// same as for a scan.
    pub only: Option<&'a [(EventId, u16)]>,
    /// The implementation claiming (`None`: this build under its default id,
    /// [`Implementation::this_build`]). It claims only rows whose protocol it speaks and
    /// that the routes' rollout aliases give it (R25).
    pub implementation: Option<&'a Implementation>,
}

impl<'a> ClaimRequest<'a> {
    /// A claim of up to `batch_size_max` rows of any cluster from position 0.
    pub fn new(owner: u64, batch_size_max: usize, lease_ms: u64) -> Self {
        ClaimRequest {
            owner,
            cluster: None,
            from_position: 0,
            batch_size_max,
            lease_ms,
            only: None,
            implementation: None,
        }
    }

    /// Claims as `implementation` (R25).
    pub fn implementation(mut self, implementation: &'a Implementation) -> Self {
        self.implementation = Some(implementation);
        self
    }

    /// Only rows bound for `cluster` (`None`: every cluster).
    pub fn cluster(mut self, cluster: Option<&'a str>) -> Self {
        self.cluster = cluster;
        self
    }

    /// Only rows at or after commit position `from_position`.
    pub fn from_position(mut self, from_position: u64) -> Self {
        self.from_position = from_position;
        self
    }

    /// Only the listed rows.
    pub fn only(mut self, rows: &'a [(EventId, u16)]) -> Self {
        self.only = Some(rows);
        self
    }
}

/// Claims up to `batch_size_max` rows of any cluster and registers one attempt for each:
/// [`claim`] with [`ClaimRequest::new`].
pub async fn claim_batch(
    client: &mut tokio_postgres::Client,
    owner: u64,
    batch_size_max: usize,
    lease_ms: u64,
) -> Result<ClaimBatch> {
    claim(
        client,
        &ClaimRequest::new(owner, batch_size_max, lease_ms),
        None,
    )
    .await
}

/// Claims the rows `req` allows and registers one attempt for each, in one short
/// transaction (R7–R9). With `held`, the rows it wrote are kept there for the guarded
/// acceptance ([`Held`], [`submit_held`]).
///
/// # Transactions and locks
/// One transaction. It first takes the claim lock of its cluster (an advisory lock: claims
/// of one cluster run one at a time, see [`lease`](super::lease)), reads the cluster's
/// batch leases, then `SELECT ... FOR UPDATE SKIP LOCKED` over the partial claim index
/// `(dest_cluster, committed_seq)` in commit order, skipping the rows a live lease stands
/// for: rows other writers hold are skipped, rows of other clusters are neither read,
/// locked nor counted, and the scan stops after one batch however many rows wait. The first
/// sends of rows of protocol 2 are recorded in one lease row per cluster
/// (`sealpost_core::lease`); every other change is written to its row. Rows of a transaction that
/// committed late are still `PENDING` and are found by the next scan from position 0.
/// `PENDING` rows still waiting out a never-sent backoff (`not_before_ms`, the core's
/// `decide_dispatch_claim` skips them) are not selected, so they take no place in the batch.
/// The lease end comes from the database clock. The transaction commits before anything is
/// sent. [`ClaimBatch::last_position`] is where the next scan may start.
pub async fn claim(
    client: &mut tokio_postgres::Client,
    req: &ClaimRequest<'_>,
    mut held: Option<&mut Held>,
) -> Result<ClaimBatch> {
    let r = claim_in(client, req, held.as_deref_mut()).await;
    if r.is_err() {
        if let Some(held) = held {
            held.forget_statements();
        }
    }
    r
}

/// The rows a dispatcher's claims wrote and it still holds (sent, or on their way), as it
/// wrote them: [`submit_held`] accepts an ordinary receipt for such a row with one guarded
/// write instead of locking and reading it again.
///
/// The decision is the core's either way: `decide_receipt` and `apply_receipt` run on the
/// row as the claim left it, and the write only lands if the row is still exactly that (its
/// `xmin`, the id of the transaction that wrote the row version, is still the claim's).
/// A row someone else wrote since (a reconciler, another dispatcher after the lease, an
/// operator) takes the locked path, as does every receipt that is not an ordinary first
/// ACK.
#[derive(Debug, Default)]
pub struct Held {
    pub(super) rows: foldhash::HashMap<(EventId, u16), HeldRow>,
    /// The database clock at the last claim and the local clock then.
    pub(super) clock: Option<(u64, std::time::Instant)>,
    /// The claim's and the guarded acceptance's statements, prepared on the connection.
    pub(super) statements: Prepared,
    /// The leases this dispatcher's claims wrote, with what it knows of their rows: a lease
    /// whose rows are all answered is dropped.
    pub(super) leases: foldhash::HashMap<i64, HeldLease>,
}

/// What a dispatcher knows of the rows of a lease its claim wrote.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct HeldLease {
    /// Rows it has not answered yet.
    pub(super) unanswered: usize,
    /// Rows no guarded write of its own has proven written (the `RETURNING` of the
    /// compare-and-set): each may still be never claimed, so the lease stands for it. With
    /// none left, [`lease::may_drop`] holds without reading the rows again.
    pub(super) unproven: usize,
}

#[derive(Debug)]
pub(super) struct HeldRow {
    pub(super) row: EventRow,
    pub(super) xmin: i64,
    /// The commit time of the row (database clock), for the commit -> `PUBLISHED` latency.
    pub(super) created_at_ms: u64,
    /// Set once a guarded write accepted this receipt, so a submission retried after a later
    /// failure returns the same verdict instead of accepting twice.
    pub(super) accepted: Option<(Accepted, Published)>,
    /// The lease that stands for the row's claim, if the claim wrote a lease rather than the
    /// row.
    pub(super) lease: Option<i64>,
}

impl Held {
    /// Rows held now.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether no row is held.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// One row of lease `lease` is answered (or no longer held): returns the lease when that
    /// was its last one, and the lease may be dropped once it stands for nothing.
    pub(super) fn unhold_lease(&mut self, lease: i64) -> Option<HeldLease> {
        match self.leases.get_mut(&lease) {
            Some(h) if h.unanswered > 1 => {
                h.unanswered -= 1;
                None
            }
            Some(_) => self.leases.remove(&lease),
            None => None,
        }
    }

    /// A guarded write of this dispatcher wrote one row of lease `lease`: the row is no
    /// longer never claimed, and never will be again (a claim generation only grows).
    pub(super) fn proven_written(&mut self, lease: i64) {
        if let Some(h) = self.leases.get_mut(&lease) {
            h.unproven = h.unproven.saturating_sub(1);
        }
    }

    /// Drops the prepared statements: call it when the connection is replaced (they belong
    /// to the old one). A failed claim or submission drops them too.
    pub fn forget_statements(&mut self) {
        self.statements = Prepared::default();
    }

    /// The database clock now, as far as the last claim tells (its reading plus the local
    /// time since): the time `apply_receipt` stamps on a guarded acceptance.
    pub fn db_now_ms(&self) -> Option<u64> {
        self.clock
            .map(|(db, at)| db + at.elapsed().as_millis() as u64)
    }
}

/// How long a held row is kept after its lease ended (its answer may still come late).
const HELD_AFTER_LEASE_MS: u64 = 60_000;

column_list! {
    /// What the claim selects after the [`RowCol`] columns: the payload, the attempt id it
    /// draws, the database clock, its own transaction id (the guard of the held rows it
    /// writes), the commit time, the "earlier version unresolved" probe and the
    /// sealed envelope's wire description ([`wire_envelope`] reads it from
    /// [`ClaimCol::Envelope`] on).
    ClaimCol from ROW_COLS_LEN;
    Payload => "e.payload",
    AttemptId => "nextval('sealpost.attempt_id_seq')",
    NowMs => NOW_MS_SQL,
    Xid => "(SELECT pg_current_xact_id()::xid::text::bigint)",
    CreatedAtMs => "w.created_at_ms",
    Protocol => "w.protocol",
    EarlierUnresolved => earlier_unresolved_sql(),
    Envelope => WIRE_ENVELOPE_COLS,
}

async fn claim_in(
    client: &mut tokio_postgres::Client,
    req: &ClaimRequest<'_>,
    mut held: Option<&mut Held>,
) -> Result<ClaimBatch> {
    let ClaimRequest {
        owner,
        cluster,
        from_position,
        batch_size_max,
        lease_ms,
        only,
        implementation,
    } = *req;
    let implementation = implementation.unwrap_or_else(|| Implementation::this_build());
    let claim_local_start = std::time::Instant::now();
    // READ COMMITTED whatever the server's default: the aliases read after the SHARE lock
    // (and the pick after them) must see a switch that committed while the claim waited.
    let tx = client
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::ReadCommitted)
        .start()
        .await?;
    // No other claim may lease rows between this claim's read of the leases and its commit.
    lease::lock_claims(&tx, cluster, held.as_deref_mut().map(|h| &mut h.statements)).await?;
    // The claim must walk the claim index in commit order and stop after one batch. With
    // statistics that have not seen the current backlog (a new cluster, positions past the
    // histogram, autovacuum behind) the planner estimates a few hundred rows and prefers a
    // bitmap scan of every claimable row and a sort: measured 100-180 ms instead of 3 ms per
    // 1,000-row claim on a 50,000-row backlog, half of all claims. The claim's statements
    // are prepared once per connection, but planned for their parameters every time (a
    // generic plan could not use the cluster and position as index bounds). These settings
    // end with the transaction.
    let (aliases, horizon) = claim_settings_and_aliases(&tx).await?;
    let leases =
        lease::load_leases(&tx, cluster, held.as_deref_mut().map(|h| &mut h.statements)).await?;
    let slices = slices_param(&aliases, implementation);
    // One statement reads the clock, picks and locks the batch, joins the sealed envelope
    // (destination, digests, payload) and draws an attempt id per row.
    // The pick is `step::picks` in SQL (the step checks every picked row against it).
    let q = locked_rows_sql(
        &format!(
            "FROM sealpost.work w
             WHERE w.phase = {DISPATCHABLE} AND ($2::text IS NULL OR w.dest_cluster = $2)
               AND w.committed_seq >= $3
               AND ($4::uuid[] IS NULL OR (w.event_id, w.member) IN
                    (SELECT * FROM unnest($4::uuid[], $5::int2[])))
               AND (w.state = 'PENDING' OR w.lease_until_ms IS NULL OR w.lease_until_ms <= {NOW_MS_SQL})
               AND (w.state <> 'PENDING' OR w.not_before_ms <= {NOW_MS_SQL})
               AND (w.committed_seq <> ALL($9::int8[]) OR NOT ({NEVER_CLAIMED_SQL}))
               {alias_filter}
             ORDER BY w.dest_cluster, w.committed_seq LIMIT $1 FOR UPDATE OF w SKIP LOCKED",
            alias_filter = alias_filter_sql(),
        ),
        &format!(", {}", ClaimCol::select()),
        "",
    );
    counted(3);
    let statement = prepare(held.as_deref_mut().map(|h| &mut h.statements), &tx, &q).await?;
    let only_ids: Option<Vec<Uuid>> = only.map(|rows| rows.iter().map(|r| uuid_of(r.0)).collect());
    let only_members: Option<Vec<i16>> = only.map(|rows| rows.iter().map(|r| r.1 as i16).collect());
    let found = tx
        .query(
            &statement,
            &[
                &(batch_size_max as i64),
                &cluster,
                &(from_position as i64),
                &only_ids,
                &only_members,
                &(implementation.protocol_min as i16),
                &(implementation.protocol_max as i16),
                &slices,
                &leases.live_positions,
            ],
        )
        .await?;
    // The batch in claim order: the order of the pick (cluster, then commit position). The
    // keys are read once per row, not once per comparison.
    let found = {
        let mut order: Vec<(&str, i64, usize)> = found
            .iter()
            .enumerate()
            .map(|(i, r)| (r.get(4), r.get(RowCol::Position.at()), i))
            .collect();
        order.sort_unstable();
        let order: Vec<usize> = order.into_iter().map(|(_, _, i)| i).collect();
        let mut slots: Vec<Option<tokio_postgres::Row>> = found.into_iter().map(Some).collect();
        order
            .into_iter()
            .filter_map(|i| slots[i].take())
            .collect::<Vec<_>>()
    };
    let now_ms = match found.first() {
        Some(r) => r.get::<_, i64>(ClaimCol::NowMs.at()) as u64,
        None => db_now_ms(&tx).await?,
    };
    let served: Vec<String> = cluster.map(str::to_string).into_iter().collect();
    let mut payloads = Vec::with_capacity(found.len());
    let mut envelopes = Vec::with_capacity(found.len());
    for r in &found {
        payloads.push(r.get::<_, Vec<u8>>(ClaimCol::Payload.at()));
        envelopes.push(wire_envelope(r, ClaimCol::Envelope.at())?);
    }
    let picked: Vec<Pick<'_>> = found
        .iter()
        .zip(&envelopes)
        .map(|(r, env)| Pick {
            position: r.get::<_, i64>(RowCol::Position.at()) as u64,
            earlier_unresolved: r.get::<_, bool>(ClaimCol::EarlierUnresolved.at()),
            attempt_id: r.get::<_, i64>(ClaimCol::AttemptId.at()) as u64,
            facts: ClaimFacts {
                event_type: &env.event_type,
                share_bucket: rollout::share_bucket(&env.aggregate_type, &env.aggregate_id),
                protocol: r.get::<_, i16>(ClaimCol::Protocol.at()).max(0) as u16,
            },
        })
        .collect();
    let protocols: Vec<u16> = picked.iter().map(|p| p.facts.protocol).collect();
    // Rows of an expired lease are read through it (`SENDING`, expired): the step moves
    // them to `DISPATCH_UNKNOWN`. Rows of a live lease were not picked.
    let (before, _) = finish_load_through(&tx, &found, Some(&leases)).await?;
    let mut after = before.clone();
    let input = ClaimInput {
        owner,
        served: match cluster {
            Some(_) => Served::Only(&served),
            None => Served::Every,
        },
        now_ms,
        lease_ms,
        batch_max: batch_size_max,
        alias: AliasCheck {
            implementation,
            aliases: &aliases,
        },
    };
    let step = step::step_claim(&mut after, &picked, &input, &mut CoreRules)?;
    let mut batch = ClaimBatch {
        db_now_ms: now_ms,
        last_position: step.last_position,
        ordered_from: step.ordered_from,
        expired_to_unknown: step.expired_to_unknown,
        ordering_waits: step.ordering_waits,
        horizon: only.is_none().then_some(horizon),
        ..ClaimBatch::default()
    };
    for (i, sent) in step.sends() {
        let row = &after[i];
        batch.outgoing.push(Outgoing {
            event_id: sent.begin.event_id,
            member: row.member,
            envelope_generation: sent.begin.envelope_generation,
            attempt_id: sent.attempt_id,
            token: sent.token,
            payload_digest: row.payload_digest,
            destination: row.destination.clone(),
            destination_digest: sent.begin.destination_digest,
            payload: std::mem::take(&mut payloads[i]),
            lease_until_ms: sent.lease_until_ms,
            envelope: std::mem::take(&mut envelopes[i]),
        });
    }
    // A first send is recorded in the claim's lease, not in its row; every other change is
    // written to the row.
    let mut leased = vec![None; after.len()];
    for (i, _) in step.sends() {
        leased[i] = sealpost_core::lease::lease_entry_of(&before[i], &after[i], protocols[i]);
    }
    let (mut b_rows, mut a_rows) = (Vec::new(), Vec::new());
    let mut firsts: Vec<(&str, u64, sealpost_core::lease::LeasedSend)> = Vec::new();
    for (i, l) in leased.iter().enumerate() {
        match l {
            Some(send) => firsts.push((
                found[i].get::<_, &str>(RowCol::WorkCluster.at()),
                found[i].get::<_, i64>(RowCol::Position.at()) as u64,
                *send,
            )),
            None => {
                b_rows.push(&before[i]);
                a_rows.push(after[i].clone());
            }
        }
    }
    persist_guarded(
        &tx,
        &b_rows,
        &a_rows,
        None,
        held.as_deref_mut().map(|h| &mut h.statements),
    )
    .await?;
    let lease_ids =
        lease::insert_leases(&tx, &firsts, held.as_deref_mut().map(|h| &mut h.statements)).await?;
    // Expired leases whose rows have all been written since (by this claim's expiries among
    // them) stand for nothing any more.
    lease::drop_listed(&tx, &leases.expired, false).await?;
    tx.commit().await?;
    if let Some(held) = held {
        // The rows this claim wrote now carry its transaction id as their `xmin`; the rows
        // it leased keep the version it read.
        let xid = found
            .first()
            .map_or(0, |r| r.get::<_, i64>(ClaimCol::Xid.at()));
        held.clock = Some((now_ms, claim_local_start));
        let mut dropped = Vec::new();
        held.rows.retain(|_, h| {
            let keep = h
                .row
                .claim
                .as_ref()
                .is_some_and(|c| c.lease_until_ms + HELD_AFTER_LEASE_MS > now_ms);
            if !keep {
                dropped.extend(h.lease);
            }
            keep
        });
        for l in dropped {
            // Long expired: a claim's expiry or the reconciler settles it.
            held.leases.remove(&l);
        }
        let mut sent = vec![false; after.len()];
        for (i, _) in step.sends() {
            sent[i] = true;
        }
        // `insert_leases` returned one id per first send, in claim order.
        let mut ids = lease_ids.into_iter();
        let lease_of: Vec<Option<i64>> =
            leased.iter().map(|l| l.and_then(|_| ids.next())).collect();
        for (i, ((row, r), sent)) in after.into_iter().zip(&found).zip(sent).enumerate() {
            if sent {
                let lease = lease_of[i];
                if let Some(l) = lease {
                    let h = held.leases.entry(l).or_default();
                    h.unanswered += 1;
                    h.unproven += 1;
                }
                let replaced = held.rows.insert(
                    (row.event_id, row.member),
                    HeldRow {
                        row,
                        xmin: match lease {
                            Some(_) => r.get::<_, i64>(RowCol::RowXmin.at()),
                            None => xid,
                        },
                        created_at_ms: r.get::<_, i64>(ClaimCol::CreatedAtMs.at()).max(0) as u64,
                        accepted: None,
                        lease,
                    },
                );
                if let Some(l) = replaced.and_then(|h| h.lease) {
                    held.unhold_lease(l);
                }
            }
        }
    }
    Ok(batch)
}
