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

-- Grants (migration 6's roles). The publisher is a dispatcher: it records its progress here,
-- beside the claims it makes as one; the reconciler that runs beside it likewise. The
-- operator's `sealpost cdc --drop` deletes the row; the reader and the operator read it
-- (install_roles grants them every table). Making the slot and the publication is the schema
-- owner's (`sealpost cdc --setup`: a publication needs the table's owner); the publisher's
-- login needs the REPLICATION attribute besides its role (an attribute, not a grant).
ALTER FUNCTION sealpost.install_roles() RENAME TO install_roles_7;
CREATE FUNCTION sealpost.install_roles() RETURNS boolean
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $install$
DECLARE
    names text[];
BEGIN
    IF NOT sealpost.install_roles_7() THEN
        RETURN false;
    END IF;
    SELECT array_agg(role_name::text ORDER BY array_position(
               ARRAY['producer', 'dispatcher', 'reconciler', 'consumer', 'operator', 'reader'], kind))
      INTO names FROM sealpost.role;
    EXECUTE format('GRANT SELECT, INSERT, UPDATE ON sealpost.cdc_progress TO %I, %I', names[2], names[3]);
    EXECUTE format('GRANT DELETE ON sealpost.cdc_progress TO %I', names[5]);
    RETURN true;
END
$install$;
REVOKE ALL ON FUNCTION sealpost.install_roles() FROM PUBLIC;
REVOKE ALL ON FUNCTION sealpost.install_roles_7() FROM PUBLIC;

SELECT sealpost.install_roles();
