-- Sealpost outbox schema, version 2: loop pacing persisted with the row, so every
-- dispatcher and reconciler honours the same backoff (issue: "never sent" loops and a
-- spinning reconciler). Applied by `sealpost migrate` (idempotent).
ALTER TABLE sealpost.envelope ADD COLUMN IF NOT EXISTS not_before_ms bigint NOT NULL DEFAULT 0;
ALTER TABLE sealpost.envelope ADD COLUMN IF NOT EXISTS never_sent int NOT NULL DEFAULT 0;
ALTER TABLE sealpost.envelope ADD COLUMN IF NOT EXISTS next_lookup_at_ms bigint NOT NULL DEFAULT 0;
ALTER TABLE sealpost.envelope ADD COLUMN IF NOT EXISTS lookups int NOT NULL DEFAULT 0;
-- The last reason a row could not leave or was refused (shown by `status` and `trace`).
ALTER TABLE sealpost.envelope ADD COLUMN IF NOT EXISTS last_error text;

-- The reconciler takes unknown rows in the order they are due, so every unknown row is
-- looked up in turn and none is retried ahead of its backoff.
DROP INDEX IF EXISTS sealpost.envelope_unknown;
CREATE INDEX IF NOT EXISTS envelope_unknown_due
    ON sealpost.envelope (next_lookup_at_ms)
    WHERE state IN ('DISPATCH_UNKNOWN', 'RECONCILING');

-- SENDING rows whose lease ran out are found by their lease end, without walking the rest.
CREATE INDEX IF NOT EXISTS envelope_sending_lease
    ON sealpost.envelope (lease_until_ms)
    WHERE state = 'SENDING';

-- A dispatcher claims only the rows of the cluster its adapter is connected to, in commit
-- order: the claim index leads with the cluster, so the scan stops after one batch (an
-- ordered index scan with LIMIT), however many rows wait.
DROP INDEX IF EXISTS sealpost.envelope_claimable;
CREATE INDEX IF NOT EXISTS envelope_claimable_by_cluster
    ON sealpost.envelope (dest_cluster, committed_seq)
    WHERE state IN ('PENDING', 'CLAIMED', 'SENDING', 'RETRY_CLAIMED');

-- Published rows are re-checked at the broker in a rolling pass (R31); the cursor lives here.
-- The pass walks the primary key (event ids are UUIDv7, so roughly commit order).
CREATE TABLE IF NOT EXISTS sealpost.verify_cursor (
    name            text PRIMARY KEY,
    after_event_id  uuid NOT NULL,
    after_member    smallint NOT NULL
);
-- (A development build kept a commit-sequence cursor here; it is replaced.)
ALTER TABLE sealpost.verify_cursor DROP COLUMN IF EXISTS after_seq;
ALTER TABLE sealpost.verify_cursor
    ADD COLUMN IF NOT EXISTS after_event_id uuid NOT NULL DEFAULT '00000000-0000-0000-0000-000000000000';
ALTER TABLE sealpost.verify_cursor ADD COLUMN IF NOT EXISTS after_member smallint NOT NULL DEFAULT -1;

INSERT INTO sealpost.schema_version (version) VALUES (2) ON CONFLICT DO NOTHING;

-- Findings of the background passes (R31: published but missing at the broker), one per
-- event member and kind; `sealpost reconcile` reports them.
CREATE TABLE IF NOT EXISTS sealpost.finding (
    finding_id  bigserial PRIMARY KEY,
    event_id    uuid NOT NULL,
    member      smallint NOT NULL,
    kind        text NOT NULL,
    detail      text NOT NULL,
    at_ms       bigint NOT NULL,
    UNIQUE (event_id, member, kind)
);
