-- Sealpost outbox schema, version 8: the CDC publisher's progress (R32). One row per
-- replication slot a CDC publisher (`sealpost cdc`) reads. The slot itself lives in
-- pg_replication_slots; this row outlives it, so a slot that disappears is noticed (and
-- announced) when the publisher starts again, and cleanup knows how far the publisher got.

CREATE TABLE sealpost.cdc_progress (
    slot_name        text PRIMARY KEY,
    cluster          text NOT NULL,
    publication      text NOT NULL,
    -- When the slot was (last) created, database clock.
    created_at_ms    bigint NOT NULL,
    -- The position confirmed to the slot: every envelope row committed before it is settled.
    confirmed_lsn    pg_lsn,
    confirmed_at_ms  bigint,
    -- Cleanup keeps every row created at or after this time (the oldest unconfirmed
    -- transaction's commit, less the margin for long transactions; NULL: nothing held yet).
    hold_from_ms     bigint,
    -- Rows the publisher holds unsettled.
    window_rows      bigint NOT NULL DEFAULT 0,
    updated_at_ms    bigint NOT NULL
);
