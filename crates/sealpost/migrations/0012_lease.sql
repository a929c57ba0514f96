-- Sealpost outbox schema, migration 12: one row write per event after enqueue.
--
--   sealpost.lease   one row per dispatcher claim and destination cluster: the owner, the
--                    lease end, when the claim registered its attempts, and the commit
--                    positions of the rows whose first send it authorised (ascending) with
--                    the attempt id drawn for each. The claim writes this row instead of
--                    updating each work row.
--   sealpost.leased  the rows a lease stands for: listed in a lease and still never
--                    claimed in their own columns (PENDING, claim and attempt generation 0,
--                    no attempt, no receipt). Such a row is SENDING under claim generation 1
--                    with the lease's attempt registered (sealpost_core::lease::leased_view).
--                    The first write of the row after enqueue (its acceptance, an outcome
--                    report, an expiry) stores all of it, and from then on the work row
--                    stands alone.
--
-- A lease is dropped when none of its rows is still in sealpost.leased: dropping it earlier
-- would turn a row that was sent back into one that reads as never sent. Rows that a
-- dispatcher of the earlier layout left SENDING keep their own claim columns, as before.
--
-- Nothing is rewritten: the table and the view are new, and the views below keep their
-- columns (CREATE OR REPLACE keeps their grants).

-- Rows written from now on are protocol 2 (sealpost_core::rollout::PROTOCOL_VERSION): a
-- dispatcher that predates leases speaks only protocol 1 and never claims them, so it never
-- reads a leased row as never claimed. Rows written before keep protocol 1 and their claims
-- in the row, whoever claims them. (A new default rewrites nothing.)
ALTER TABLE sealpost.work ALTER COLUMN protocol SET DEFAULT 2;

CREATE TABLE sealpost.lease (
    lease_id       bigserial PRIMARY KEY,
    dest_cluster   text NOT NULL,
    owner          bigint NOT NULL,
    lease_until_ms bigint NOT NULL,
    started_at_ms  bigint NOT NULL,
    lo_seq         bigint NOT NULL,
    hi_seq         bigint NOT NULL,
    positions      bigint[] NOT NULL,
    attempt_ids    bigint[] NOT NULL,
    CHECK (cardinality(positions) > 0 AND cardinality(positions) = cardinality(attempt_ids)),
    CHECK (lo_seq <= hi_seq)
);
CREATE INDEX lease_span ON sealpost.lease (dest_cluster, lo_seq);

-- A lease's rows are found by its positions (`committed_seq = ANY (positions)`: one probe
-- of work_claimable per position), never by walking the cluster's claimable rows.
CREATE VIEW sealpost.leased AS
SELECT w.event_id, w.member, l.lease_id, l.owner, l.lease_until_ms, l.started_at_ms,
       l.attempt_ids[array_position(l.positions, w.committed_seq)] AS attempt_id
FROM sealpost.lease l
JOIN sealpost.work w
  ON w.dest_cluster = l.dest_cluster AND w.committed_seq = ANY (l.positions) AND w.phase = 0
WHERE w.state = 'PENDING' AND w.claim_owner IS NULL AND w.claim_generation = 0
  AND w.attempt_generation = 0 AND w.attempt_id IS NULL AND w.primary_sequence IS NULL;

-- The operators' views show a leased row as what it is: SENDING, its claim and its attempt.
CREATE OR REPLACE VIEW sealpost.outbox AS
SELECT w.event_id, w.member, w.envelope_generation, e.aggregate_type, e.aggregate_id,
       e.aggregate_version, e.event_type, e.payload_schema_digest, e.payload_digest, e.tenant,
       e.occurred_at_ms, e.creating_txid, e.dest_cluster, e.dest_topic, e.dest_routing_key,
       e.dest_partition_alg, e.dest_policy_generation, e.dest_serializer, e.dest_durability,
       e.dest_required_ack, e.destination_digest, e.envelope_digest, e.payload,
       CASE WHEN x.lease_id IS NULL THEN w.state ELSE 'SENDING' END AS state,
       coalesce(x.owner, w.claim_owner) AS claim_owner,
       CASE WHEN x.lease_id IS NULL THEN w.claim_generation ELSE 1 END AS claim_generation,
       coalesce(x.lease_until_ms, w.lease_until_ms) AS lease_until_ms,
       CASE WHEN x.lease_id IS NULL THEN w.attempt_generation ELSE 1 END AS attempt_generation,
       w.rejections, w.unknown_since_ms, w.published_at_ms, w.primary_attempt_id,
       w.primary_cluster, w.primary_stream, w.primary_partition, w.primary_sequence,
       w.committed_seq, w.created_at_ms, w.not_before_ms, w.never_sent, w.next_lookup_at_ms,
       w.lookups, w.last_error, coalesce(x.attempt_id, w.attempt_id) AS attempt_id,
       CASE WHEN x.lease_id IS NULL THEN w.attempt_status ELSE 'SENDING' END AS attempt_status
FROM sealpost.work w
JOIN sealpost.envelope e
  ON e.event_id = w.event_id AND e.member = w.member AND e.envelope_generation = w.envelope_generation
LEFT JOIN sealpost.leased x ON x.event_id = w.event_id AND x.member = w.member;

CREATE OR REPLACE VIEW sealpost.attempts AS
SELECT attempt_id, event_id, member, attempt_generation, claim_generation, owner,
       envelope_generation, status, started_at_ms
FROM sealpost.attempt
UNION ALL
SELECT attempt_id, event_id, member, attempt_agen, attempt_claim_generation, attempt_owner,
       attempt_envelope_generation, attempt_status, attempt_started_ms
FROM sealpost.work WHERE attempt_id IS NOT NULL
UNION ALL
SELECT x.attempt_id, x.event_id, x.member, 1, 1::bigint, x.owner, w.envelope_generation,
       'SENDING', x.started_at_ms
FROM sealpost.leased x
JOIN sealpost.work w ON w.event_id = x.event_id AND w.member = x.member;

ALTER FUNCTION sealpost.install_roles() RENAME TO install_roles_11;
CREATE FUNCTION sealpost.install_roles() RETURNS boolean
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $install$
DECLARE
    names text[];
BEGIN
    IF NOT sealpost.install_roles_11() THEN
        RETURN false;
    END IF;
    SELECT array_agg(role_name::text ORDER BY array_position(
               ARRAY['producer', 'dispatcher', 'reconciler', 'consumer', 'operator', 'reader'], kind))
      INTO names FROM sealpost.role;
    -- Dispatchers write leases and drop the ones they settled; reconcilers and operators
    -- drop settled ones (an expired lease whose rows were all written since); everyone who
    -- reads work rows reads the leases too.
    EXECUTE format('GRANT SELECT, INSERT, DELETE ON sealpost.lease TO %I', names[2]);
    EXECUTE format('GRANT USAGE ON SEQUENCE sealpost.lease_lease_id_seq TO %I', names[2]);
    EXECUTE format('GRANT SELECT, DELETE ON sealpost.lease TO %I, %I', names[3], names[5]);
    EXECUTE format('GRANT SELECT ON sealpost.lease TO %I', names[6]);
    EXECUTE format('GRANT SELECT ON sealpost.leased TO %I, %I, %I, %I',
                   names[2], names[3], names[5], names[6]);
    RETURN true;
END
$install$;
REVOKE ALL ON FUNCTION sealpost.install_roles() FROM PUBLIC;
REVOKE ALL ON FUNCTION sealpost.install_roles_11() FROM PUBLIC;

SELECT sealpost.install_roles();
