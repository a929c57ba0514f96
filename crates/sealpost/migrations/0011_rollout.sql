-- Sealpost outbox schema, migration 11: rolling out a new dispatcher implementation (R25).
--
--   sealpost.work.protocol   the protocol version the row was written under; a dispatcher
--                            that does not speak it never claims the row. Rows written
--                            before this migration are version 1 (a constant default: adding
--                            the column rewrites nothing).
--   sealpost.implementation  what each dispatcher, reconciler and CDC publisher announced:
--                            implementation id, the protocol versions it speaks, when seen.
--   sealpost.rollout         per route, the alias: which implementation claims its rows
--                            (incumbent, candidate, stage, takeover types and share) and the
--                            generation every switch raises.
--   sealpost.rollout_log     every switch, who made it and when (insert-only).
--   sealpost.shadow_tally    per route and candidate in shadow: the incumbent's messages
--                            compared, matched and diverged, and how far it has read.
--   sealpost.shadow_divergence  each difference the shadow found, until an operator
--                            explains it; promotion is refused while one is unexplained.
--
-- A claim reads the aliases through sealpost.rollout_aliases(), which locks the table in
-- SHARE mode until the claim's transaction ends: a switch (an INSERT or UPDATE, ROW
-- EXCLUSIVE) waits for the claims under way and every later claim sees it, so no send is
-- started under an alias that was already switched away.

ALTER TABLE sealpost.work ADD COLUMN protocol smallint NOT NULL DEFAULT 1;

CREATE TABLE sealpost.implementation (
    owner          bigint PRIMARY KEY,
    implementation text NOT NULL,
    role           text NOT NULL CHECK (role IN ('dispatcher', 'reconciler', 'cdc')),
    cluster        text NOT NULL,
    protocol_min   smallint NOT NULL,
    protocol_max   smallint NOT NULL,
    started_at_ms  bigint NOT NULL,
    seen_at_ms     bigint NOT NULL
);

CREATE TABLE sealpost.rollout (
    route          text PRIMARY KEY,
    cluster        text NOT NULL,
    topic          text NOT NULL,
    incumbent      text NOT NULL,
    candidate      text,
    stage          text NOT NULL CHECK (stage IN ('incumbent', 'shadow', 'takeover', 'promoted')),
    types          text[] NOT NULL DEFAULT '{}',
    share          smallint NOT NULL CHECK (share BETWEEN 1 AND 100),
    generation     bigint NOT NULL,
    updated_at_ms  bigint NOT NULL,
    -- One alias per destination: two routes on one topic would give its rows two claimants.
    UNIQUE (cluster, topic),
    -- A candidate exactly while a rollout is under way, and never the incumbent itself.
    CHECK ((stage = 'incumbent') = (candidate IS NULL)),
    CHECK (candidate IS DISTINCT FROM incumbent)
);

CREATE TABLE sealpost.rollout_log (
    id             bigserial PRIMARY KEY,
    route          text NOT NULL,
    command        text NOT NULL,
    generation     bigint NOT NULL,
    stage          text NOT NULL,
    incumbent      text NOT NULL,
    candidate      text,
    types          text[] NOT NULL,
    share          smallint NOT NULL,
    by_login       text NOT NULL DEFAULT session_user,
    at_ms          bigint NOT NULL
);

CREATE TABLE sealpost.shadow_tally (
    route          text NOT NULL,
    candidate      text NOT NULL,
    compared       bigint NOT NULL DEFAULT 0,
    matched        bigint NOT NULL DEFAULT 0,
    diverged       bigint NOT NULL DEFAULT 0,
    -- Where the shadow's walk of the work rows (in primary key order: time order for
    -- UUIDv7 event ids) has read to; it starts at the newest row when the shadow starts.
    read_to_event  uuid NOT NULL,
    read_to_member smallint NOT NULL,
    -- When this shadow started (a new `shadow` of the candidate starts a new tally): only
    -- divergences found since count against its promotion.
    started_at_ms  bigint NOT NULL,
    updated_at_ms  bigint NOT NULL,
    PRIMARY KEY (route, candidate)
);

CREATE TABLE sealpost.shadow_divergence (
    id               bigserial PRIMARY KEY,
    route            text NOT NULL,
    candidate        text NOT NULL,
    event_id         uuid NOT NULL,
    member           smallint NOT NULL,
    kind             text NOT NULL CHECK (kind IN ('destination_digest', 'payload_digest',
                         'envelope_generation', 'headers', 'ordering')),
    incumbent_value  text NOT NULL,
    candidate_value  text NOT NULL,
    at_ms            bigint NOT NULL,
    explained_by     text,
    explanation      text,
    explained_at_ms  bigint
);
CREATE INDEX shadow_divergence_open ON sealpost.shadow_divergence (route, candidate)
    WHERE explained_at_ms IS NULL;

CREATE FUNCTION sealpost.rollout_aliases() RETURNS SETOF sealpost.rollout
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    LOCK TABLE sealpost.rollout IN SHARE MODE;
    RETURN QUERY SELECT * FROM sealpost.rollout;
END
$$;
REVOKE ALL ON FUNCTION sealpost.rollout_aliases() FROM PUBLIC;

ALTER FUNCTION sealpost.install_roles() RENAME TO install_roles_10;
CREATE FUNCTION sealpost.install_roles() RETURNS boolean
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $install$
DECLARE
    names text[];
BEGIN
    IF NOT sealpost.install_roles_10() THEN
        RETURN false;
    END IF;
    SELECT array_agg(role_name::text ORDER BY array_position(
               ARRAY['producer', 'dispatcher', 'reconciler', 'consumer', 'operator', 'reader'], kind))
      INTO names FROM sealpost.role;
    -- Dispatchers and reconcilers announce themselves; dispatchers read the alias in their
    -- claims; the operator switches it; everyone but the producer and consumer reads it.
    EXECUTE format('GRANT INSERT, UPDATE ON sealpost.implementation TO %I, %I', names[2], names[3]);
    EXECUTE format('GRANT SELECT ON sealpost.implementation TO %I, %I, %I, %I',
                   names[2], names[3], names[5], names[6]);
    EXECUTE format('GRANT EXECUTE ON FUNCTION sealpost.rollout_aliases() TO %I', names[2]);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE ON sealpost.rollout TO %I', names[5]);
    EXECUTE format('GRANT SELECT ON sealpost.rollout TO %I, %I, %I', names[2], names[3], names[6]);
    EXECUTE format('GRANT SELECT, INSERT ON sealpost.rollout_log TO %I', names[5]);
    EXECUTE format('GRANT USAGE ON SEQUENCE sealpost.rollout_log_id_seq TO %I', names[5]);
    EXECUTE format('GRANT SELECT ON sealpost.rollout_log TO %I', names[6]);
    -- A candidate's dispatchers record what their shadow compared; the operator explains
    -- a divergence; the reader reads both.
    EXECUTE format('GRANT SELECT, INSERT, UPDATE ON sealpost.shadow_tally TO %I', names[2]);
    EXECUTE format('GRANT DELETE ON sealpost.shadow_tally TO %I', names[5]);
    EXECUTE format('GRANT SELECT, INSERT ON sealpost.shadow_divergence TO %I', names[2]);
    EXECUTE format('GRANT USAGE ON SEQUENCE sealpost.shadow_divergence_id_seq TO %I', names[2]);
    EXECUTE format('GRANT SELECT ON sealpost.shadow_tally TO %I, %I', names[5], names[6]);
    EXECUTE format('GRANT SELECT, UPDATE ON sealpost.shadow_divergence TO %I', names[5]);
    EXECUTE format('GRANT SELECT ON sealpost.shadow_divergence TO %I', names[6]);
    RETURN true;
END
$install$;
REVOKE ALL ON FUNCTION sealpost.install_roles() FROM PUBLIC;
REVOKE ALL ON FUNCTION sealpost.install_roles_10() FROM PUBLIC;

SELECT sealpost.install_roles();
