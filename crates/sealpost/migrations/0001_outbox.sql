-- Sealpost outbox schema, version 1. Applied by `sealpost migrate` (idempotent).
CREATE SCHEMA IF NOT EXISTS sealpost;

CREATE TABLE IF NOT EXISTS sealpost.schema_version (
    version     int PRIMARY KEY,
    applied_at  timestamptz NOT NULL DEFAULT now()
);

-- Route policy: event type prefix -> destination template, versioned by generation.
CREATE TABLE IF NOT EXISTS sealpost.route_policy (
    name                text PRIMARY KEY,
    generation          bigint NOT NULL,
    cluster             text NOT NULL,
    topic               text NOT NULL,
    partition_algorithm text NOT NULL DEFAULT 'none',
    serializer          text NOT NULL DEFAULT 'json.v1',
    durability          text NOT NULL DEFAULT 'file',
    required_ack        text NOT NULL DEFAULT 'stream',
    updated_at          timestamptz NOT NULL DEFAULT now()
);

-- One row per (event, delivery-set member): the sealed envelope, its frozen destination,
-- the claim and the publish slot. Times are milliseconds of the database clock.
CREATE TABLE IF NOT EXISTS sealpost.envelope (
    event_id                uuid NOT NULL,
    member                  smallint NOT NULL DEFAULT 0,
    envelope_generation     int NOT NULL,
    aggregate_type          text NOT NULL,
    aggregate_id            text NOT NULL,
    aggregate_version       bigint NOT NULL,
    event_type              text NOT NULL,
    payload_schema_digest   bytea NOT NULL,
    payload_digest          bytea NOT NULL,
    tenant                  text NOT NULL,
    occurred_at_ms          bigint NOT NULL,
    creating_txid           bigint NOT NULL,
    dest_cluster            text NOT NULL,
    dest_topic              text NOT NULL,
    dest_routing_key        text NOT NULL,
    dest_partition_alg      text NOT NULL,
    dest_policy_generation  bigint NOT NULL,
    dest_serializer         text NOT NULL,
    dest_durability         text NOT NULL,
    dest_required_ack       text NOT NULL,
    destination_digest      bytea NOT NULL,
    envelope_digest         bytea NOT NULL,
    payload                 bytea NOT NULL,
    state                   text NOT NULL,
    claim_owner             bigint,
    claim_generation        bigint NOT NULL DEFAULT 0,
    lease_until_ms          bigint,
    attempt_generation      int NOT NULL DEFAULT 0,
    rejections              int NOT NULL DEFAULT 0,
    unknown_since_ms        bigint,
    published_at_ms         bigint,
    primary_attempt_id      bigint,
    primary_cluster         text,
    primary_stream          text,
    primary_partition       int,
    primary_sequence        bigint,
    superseded_generations  int[] NOT NULL DEFAULT '{}',
    superseded_digests      bytea[] NOT NULL DEFAULT '{}',
    committed_seq           bigserial,
    created_at_ms           bigint NOT NULL DEFAULT (extract(epoch from clock_timestamp()) * 1000)::bigint,
    PRIMARY KEY (event_id, member)
);

-- R24: the claim scan reads only rows that still need work; PUBLISHED/RETAINED rows are
-- not in this index, so it stays small however many rows are retained.
CREATE INDEX IF NOT EXISTS envelope_claimable
    ON sealpost.envelope (committed_seq)
    WHERE state IN ('PENDING', 'CLAIMED', 'SENDING', 'RETRY_CLAIMED');
CREATE INDEX IF NOT EXISTS envelope_unknown
    ON sealpost.envelope (unknown_since_ms)
    WHERE state IN ('DISPATCH_UNKNOWN', 'RECONCILING');
CREATE INDEX IF NOT EXISTS envelope_aggregate
    ON sealpost.envelope (aggregate_type, aggregate_id);

CREATE SEQUENCE IF NOT EXISTS sealpost.attempt_id_seq;

-- Every registered send attempt (registered before the request leaves the process).
CREATE TABLE IF NOT EXISTS sealpost.attempt (
    attempt_id          bigint PRIMARY KEY,
    event_id            uuid NOT NULL,
    member              smallint NOT NULL,
    attempt_generation  int NOT NULL,
    claim_generation    bigint NOT NULL,
    owner               bigint NOT NULL,
    envelope_generation int NOT NULL,
    destination_digest  bytea NOT NULL,
    status              text NOT NULL,
    started_at_ms       bigint NOT NULL
);
CREATE INDEX IF NOT EXISTS attempt_event ON sealpost.attempt (event_id, member);

-- Receipts: exactly one primary per event member; duplicates kept as evidence.
CREATE TABLE IF NOT EXISTS sealpost.receipt (
    receipt_id          bigserial PRIMARY KEY,
    event_id            uuid NOT NULL,
    member              smallint NOT NULL,
    attempt_id          bigint NOT NULL,
    kind                text NOT NULL CHECK (kind IN ('primary', 'same_position', 'second_copy')),
    source              text NOT NULL,
    cluster             text NOT NULL,
    stream              text NOT NULL,
    partition           int,
    sequence            bigint NOT NULL,
    broker_duplicate    boolean NOT NULL,
    accepted_at_ms      bigint NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS receipt_one_primary
    ON sealpost.receipt (event_id, member) WHERE kind = 'primary';
CREATE INDEX IF NOT EXISTS receipt_event ON sealpost.receipt (event_id, member);

-- Receipts or messages that contradict the sealed envelope, and poison.
CREATE TABLE IF NOT EXISTS sealpost.quarantine (
    quarantine_id   bigserial PRIMARY KEY,
    event_id        uuid NOT NULL,
    member          smallint NOT NULL,
    attempt_id      bigint,
    reason          text NOT NULL,
    detail          text NOT NULL,
    at_ms           bigint NOT NULL
);

-- Audit: fenced writes of stale claims, rejected receipts.
CREATE TABLE IF NOT EXISTS sealpost.audit (
    audit_id    bigserial PRIMARY KEY,
    event_id    uuid,
    member      smallint,
    attempt_id  bigint,
    owner       bigint,
    what        text NOT NULL,
    detail      text NOT NULL,
    at_ms       bigint NOT NULL
);

INSERT INTO sealpost.schema_version (version) VALUES (1) ON CONFLICT DO NOTHING;

-- Migration receipts (R15): an event moved to another destination under a new envelope
-- generation, with the proof that the old destination did not accept it.
CREATE TABLE IF NOT EXISTS sealpost.migration (
    migration_id        bigserial PRIMARY KEY,
    event_id            uuid NOT NULL,
    member              smallint NOT NULL,
    from_generation     int NOT NULL,
    to_generation       int NOT NULL,
    from_digest         bytea NOT NULL,
    to_digest           bytea NOT NULL,
    failed_attempts     int NOT NULL,
    at_ms               bigint NOT NULL
);

-- Queue-table hygiene: rows churn through the claim index quickly; vacuum early so claim
-- scans do not walk long runs of dead index entries.
ALTER TABLE sealpost.envelope SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 2000,
                                   autovacuum_analyze_scale_factor = 0.05);
ALTER TABLE sealpost.attempt SET (autovacuum_vacuum_scale_factor = 0.05);

-- Consumer side (R17-R19). These live in the consumer's own database; the demo keeps them
-- in the same one. One row per (consumer, event, member): the consumption receipt.
CREATE TABLE IF NOT EXISTS sealpost.inbox (
    consumer_id     text NOT NULL,
    event_id        uuid NOT NULL,
    member          smallint NOT NULL,
    payload_digest  bytea NOT NULL,
    receipt_id      bigserial,
    stream          text NOT NULL,
    sequence        bigint NOT NULL,
    consumed_at_ms  bigint NOT NULL DEFAULT (extract(epoch from clock_timestamp()) * 1000)::bigint,
    PRIMARY KEY (consumer_id, event_id, member)
);
-- Highest stream position each consumer has committed, kept with the receipts.
CREATE TABLE IF NOT EXISTS sealpost.consumer_watermark (
    consumer_id     text NOT NULL,
    stream          text NOT NULL,
    high_water      bigint NOT NULL,
    updated_at_ms   bigint NOT NULL,
    PRIMARY KEY (consumer_id, stream)
);
-- Messages a consumer refused: a payload that does not match its digest, or a different
-- payload under an event id it already consumed.
CREATE TABLE IF NOT EXISTS sealpost.inbox_quarantine (
    quarantine_id   bigserial PRIMARY KEY,
    consumer_id     text NOT NULL,
    event_id        uuid NOT NULL,
    member          smallint NOT NULL,
    stream          text NOT NULL,
    sequence        bigint NOT NULL,
    reason          text NOT NULL,
    at_ms           bigint NOT NULL
);
