-- Sealpost schema, migration 4: bounded consumers and safe retention (issue 10, seed 003).

-- Consumer side (the consumer's own database). A dead letter is recorded here before the
-- broker is told to stop redelivering: `kind` says why the row exists
--   'refused'     a payload not matching its digest header, or a different payload under a
--                 consumed event id (rows written before this migration);
--   'dead_letter' the effect failed on `delivered` deliveries, the consumer's limit;
--   'unreadable'  the Sealpost headers are missing or do not parse (no event id, perhaps).
-- The payload is kept so the operator's exit (fix, then re-apply) needs nothing else; it
-- expires with the audit retention (`sealpost purge --audit-retention-days`).
ALTER TABLE sealpost.inbox_quarantine ADD COLUMN kind text NOT NULL DEFAULT 'refused'
    CHECK (kind IN ('refused', 'dead_letter', 'unreadable'));
ALTER TABLE sealpost.inbox_quarantine ALTER COLUMN event_id DROP NOT NULL;
ALTER TABLE sealpost.inbox_quarantine ALTER COLUMN member DROP NOT NULL;
ALTER TABLE sealpost.inbox_quarantine ADD COLUMN subject text;
ALTER TABLE sealpost.inbox_quarantine ADD COLUMN delivered int;
ALTER TABLE sealpost.inbox_quarantine ADD COLUMN payload bytea;
-- One dead letter per message position: a redelivery after a lost "terminate" records nothing
-- twice.
CREATE UNIQUE INDEX inbox_quarantine_one_dead_letter
    ON sealpost.inbox_quarantine (consumer_id, stream, sequence) WHERE kind <> 'refused';
CREATE INDEX inbox_quarantine_at ON sealpost.inbox_quarantine (at_ms);

-- Outbox side. Consumers whose inbox lives in their own database report their contiguous
-- watermark here (every position up to `watermark` of `stream` is applied or
-- dead-lettered); `sealpost purge` reads it. A narrow table a consumer's role may write
-- without any other right on the outbox:
--   GRANT USAGE ON SCHEMA sealpost TO fulfilment;
--   GRANT SELECT, INSERT, UPDATE ON sealpost.consumer_progress TO fulfilment;
CREATE TABLE sealpost.consumer_progress (
    consumer_id     text NOT NULL,
    stream          text NOT NULL,
    watermark       bigint NOT NULL CHECK (watermark >= 0),
    reported_at_ms  bigint NOT NULL,
    PRIMARY KEY (consumer_id, stream)
);

-- When retention purged a row (its tombstone is removed a replay window later).
ALTER TABLE sealpost.work ADD COLUMN purged_at_ms bigint;
-- Audit evidence expires by age: the scans walk these.
CREATE INDEX audit_at ON sealpost.audit (at_ms);
CREATE INDEX quarantine_at ON sealpost.quarantine (at_ms);
-- Tombstones purged before this migration start their replay window now.
UPDATE sealpost.work SET purged_at_ms = (extract(epoch from clock_timestamp()) * 1000)::bigint
 WHERE state = 'PURGED';
