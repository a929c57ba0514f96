-- Sealpost outbox schema, version 3 (the "v2 layout"): the sealed envelope is written once
-- and never updated; the state that changes lives in a narrow work row. Applied once by
-- `sealpost migrate` (the runner records the version and skips it afterwards), in one
-- transaction: a v1 database with rows in every state is converted in place, nothing is
-- copied out of the outbox and nothing is lost.
--
--   sealpost.envelope  insert-only: identity, digests, frozen destination, payload. One row
--                      per (event, member, envelope generation); a migration (R15) adds a
--                      generation, it never rewrites the first. Retention's purge is the one
--                      later write: it erases the payload bytes of a purged event.
--   sealpost.work      one narrow row per (event, member): state, claim, lease, the current
--                      attempt, the primary receipt, pacing. Earlier attempts move to
--                      sealpost.attempt (evidence); the happy path writes no attempt or
--                      receipt row at all.

CREATE TABLE sealpost.work (
    event_id                     uuid NOT NULL,
    member                       smallint NOT NULL,
    envelope_generation          int NOT NULL,
    -- The current generation's destination cluster: the claim index leads with it.
    dest_cluster                 text NOT NULL,
    committed_seq                bigint NOT NULL,
    created_at_ms                bigint NOT NULL,
    -- (fillfactor 35: a claim's new row version, about 200 bytes with the attempt inline,
    -- must fit on the page of the ~120-byte version it replaces for the update to be HOT;
    -- measured, 70 made one claim in three HOT and 35 all of them.)
    -- 0: dispatchable (PENDING, CLAIMED, SENDING, RETRY_CLAIMED); 1: unknown
    -- (DISPATCH_UNKNOWN, RECONCILING); 2: settled or parked. Only `phase` appears in index
    -- predicates, so a claim (PENDING -> SENDING, phase 0 -> 0) changes no indexed column and
    -- is a HOT update: no new index entry.
    phase                        smallint NOT NULL,
    state                        text NOT NULL,
    claim_owner                  bigint,
    claim_generation             bigint NOT NULL DEFAULT 0,
    lease_until_ms               bigint,
    attempt_generation           int NOT NULL DEFAULT 0,
    -- The latest registered attempt (R8), inline; earlier ones are in sealpost.attempt.
    attempt_id                   bigint,
    attempt_agen                 int,
    attempt_claim_generation     bigint,
    attempt_owner                bigint,
    attempt_envelope_generation  int,
    attempt_status               text,
    attempt_started_ms           bigint,
    attempts_archived            int NOT NULL DEFAULT 0,
    rejections                   int NOT NULL DEFAULT 0,
    unknown_since_ms             bigint,
    published_at_ms              bigint,
    primary_attempt_id           bigint,
    primary_cluster              text,
    primary_stream               text,
    primary_partition            int,
    primary_sequence             bigint,
    superseded_generations       int[],
    superseded_digests           bytea[],
    not_before_ms                bigint NOT NULL DEFAULT 0,
    never_sent                   int NOT NULL DEFAULT 0,
    next_lookup_at_ms            bigint NOT NULL DEFAULT 0,
    lookups                      int NOT NULL DEFAULT 0,
    last_error                   text,
    PRIMARY KEY (event_id, member)
) WITH (fillfactor = 35, autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 2000,
        autovacuum_analyze_scale_factor = 0.05);

-- v1 rows: the mutable columns move to the work row; the latest attempt goes inline.
INSERT INTO sealpost.work
SELECT e.event_id, e.member, e.envelope_generation, e.dest_cluster, e.committed_seq, e.created_at_ms,
       CASE WHEN e.state IN ('PENDING', 'CLAIMED', 'SENDING', 'RETRY_CLAIMED') THEN 0
            WHEN e.state IN ('DISPATCH_UNKNOWN', 'RECONCILING') THEN 1 ELSE 2 END,
       e.state, e.claim_owner, e.claim_generation, e.lease_until_ms, e.attempt_generation,
       a.attempt_id, a.attempt_generation, a.claim_generation, a.owner, a.envelope_generation, a.status,
       a.started_at_ms,
       (SELECT count(*) FROM sealpost.attempt h
         WHERE h.event_id = e.event_id AND h.member = e.member) - (a.attempt_id IS NOT NULL)::int,
       e.rejections, e.unknown_since_ms, e.published_at_ms, e.primary_attempt_id, e.primary_cluster,
       e.primary_stream, e.primary_partition, e.primary_sequence,
       NULLIF(e.superseded_generations, '{}'), NULLIF(e.superseded_digests, '{}'),
       e.not_before_ms, e.never_sent, e.next_lookup_at_ms, e.lookups, e.last_error
FROM sealpost.envelope e
LEFT JOIN LATERAL (
    SELECT * FROM sealpost.attempt x WHERE x.event_id = e.event_id AND x.member = e.member
    ORDER BY x.attempt_id DESC LIMIT 1
) a ON true;
DELETE FROM sealpost.attempt x USING sealpost.work w
 WHERE x.attempt_id = w.attempt_id AND x.event_id = w.event_id AND x.member = w.member;

CREATE SEQUENCE sealpost.committed_seq;
SELECT setval('sealpost.committed_seq', greatest((SELECT max(committed_seq) FROM sealpost.work), 0) + 1, false);
ALTER TABLE sealpost.work ALTER COLUMN committed_seq SET DEFAULT nextval('sealpost.committed_seq');

-- The claim scan: dispatchable rows of one cluster in commit order (R24: settled rows are not
-- in it, however many are retained).
CREATE INDEX work_claimable ON sealpost.work (dest_cluster, committed_seq) WHERE phase = 0;
-- The reconciler takes unknown rows in the order they fall due.
CREATE INDEX work_unknown_due ON sealpost.work (next_lookup_at_ms) WHERE phase = 1;

-- The envelope keeps only what was sealed.
DROP INDEX IF EXISTS sealpost.envelope_claimable;
DROP INDEX IF EXISTS sealpost.envelope_claimable_by_cluster;
DROP INDEX IF EXISTS sealpost.envelope_unknown;
DROP INDEX IF EXISTS sealpost.envelope_unknown_due;
DROP INDEX IF EXISTS sealpost.envelope_sending_lease;
ALTER TABLE sealpost.envelope
    DROP COLUMN state, DROP COLUMN claim_owner, DROP COLUMN claim_generation,
    DROP COLUMN lease_until_ms, DROP COLUMN attempt_generation, DROP COLUMN rejections,
    DROP COLUMN unknown_since_ms, DROP COLUMN published_at_ms, DROP COLUMN primary_attempt_id,
    DROP COLUMN primary_cluster, DROP COLUMN primary_stream, DROP COLUMN primary_partition,
    DROP COLUMN primary_sequence, DROP COLUMN superseded_generations,
    DROP COLUMN superseded_digests, DROP COLUMN committed_seq, DROP COLUMN not_before_ms,
    DROP COLUMN never_sent, DROP COLUMN next_lookup_at_ms, DROP COLUMN lookups,
    DROP COLUMN last_error;
ALTER TABLE sealpost.envelope DROP CONSTRAINT envelope_pkey;
ALTER TABLE sealpost.envelope ADD PRIMARY KEY (event_id, member, envelope_generation);
ALTER TABLE sealpost.envelope RESET (autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold,
                                     autovacuum_analyze_scale_factor);

-- For operators and reports: the current generation of every event with its state, one row
-- per (event, member), with the column names of the v1 table.
CREATE VIEW sealpost.outbox AS
SELECT w.event_id, w.member, w.envelope_generation, e.aggregate_type, e.aggregate_id,
       e.aggregate_version, e.event_type, e.payload_schema_digest, e.payload_digest, e.tenant,
       e.occurred_at_ms, e.creating_txid, e.dest_cluster, e.dest_topic, e.dest_routing_key,
       e.dest_partition_alg, e.dest_policy_generation, e.dest_serializer, e.dest_durability,
       e.dest_required_ack, e.destination_digest, e.envelope_digest, e.payload, w.state,
       w.claim_owner, w.claim_generation, w.lease_until_ms, w.attempt_generation, w.rejections,
       w.unknown_since_ms, w.published_at_ms, w.primary_attempt_id, w.primary_cluster,
       w.primary_stream, w.primary_partition, w.primary_sequence, w.committed_seq,
       w.created_at_ms, w.not_before_ms, w.never_sent, w.next_lookup_at_ms, w.lookups,
       w.last_error, w.attempt_id, w.attempt_status
FROM sealpost.work w
JOIN sealpost.envelope e
  ON e.event_id = w.event_id AND e.member = w.member AND e.envelope_generation = w.envelope_generation;

-- Every registered attempt: the earlier ones kept as evidence and the latest, inline.
CREATE VIEW sealpost.attempts AS
SELECT attempt_id, event_id, member, attempt_generation, claim_generation, owner,
       envelope_generation, status, started_at_ms
FROM sealpost.attempt
UNION ALL
SELECT attempt_id, event_id, member, attempt_agen, attempt_claim_generation, attempt_owner,
       attempt_envelope_generation, attempt_status, attempt_started_ms
FROM sealpost.work WHERE attempt_id IS NOT NULL;

-- Every receipt: the evidence rows (primaries found by lookups, broker duplicates, second
-- copies) and the primaries of the happy path, which live in the work row only.
CREATE VIEW sealpost.receipts AS
SELECT receipt_id, event_id, member, attempt_id, kind, source, cluster, stream, partition,
       sequence, broker_duplicate, accepted_at_ms
FROM sealpost.receipt
UNION ALL
SELECT NULL::bigint, w.event_id, w.member, w.primary_attempt_id, 'primary', 'ack',
       w.primary_cluster, w.primary_stream, w.primary_partition, w.primary_sequence, false,
       w.published_at_ms
FROM sealpost.work w
WHERE w.primary_sequence IS NOT NULL
  AND NOT EXISTS (SELECT 1 FROM sealpost.receipt r
                  WHERE r.event_id = w.event_id AND r.member = w.member AND r.kind = 'primary');
