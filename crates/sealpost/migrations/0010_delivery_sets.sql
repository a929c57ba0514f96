-- Sealpost schema, migration 10: delivery sets (R16, issue 24).
--
-- One event delivered to several destinations is an explicit contract, written in the
-- producer's transaction with its members: the set (this row), one envelope and work row per
-- member (member 0, 1, ... in the order of `routes`, each with its own frozen destination,
-- state, publish slot and receipts) and a completion rule. Whether a set is complete is never
-- stored: it is the core's `delivery_set::set_status` over the members' states, so no
-- acceptance writes a second row and no stored flag can disagree with the members.
CREATE TABLE sealpost.delivery_set (
    event_id       uuid PRIMARY KEY,
    -- `all`: every member published; `any`: at least one.
    rule           text NOT NULL CHECK (rule IN ('all', 'any')),
    -- The route each member was resolved from, member k at index k + 1.
    routes         text[] NOT NULL CHECK (cardinality(routes) BETWEEN 2 AND 16),
    created_at_ms  bigint NOT NULL DEFAULT (extract(epoch from clock_timestamp()) * 1000)::bigint
);

-- Tombstone removal also removes the set row once no member's envelope is left.
CREATE OR REPLACE FUNCTION sealpost.remove_envelopes(p_ids uuid[], p_members int2[]) RETURNS bigint
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    n bigint;
    ids uuid[];
    bad text;
BEGIN
    SELECT string_agg(format('%s/%s (%s)', k.id, k.m, coalesce(w.state, 'no work row')), ', ')
      INTO bad
      FROM unnest(p_ids, p_members) AS k(id, m)
      LEFT JOIN sealpost.work w ON w.event_id = k.id AND w.member = k.m
     WHERE w.state IS DISTINCT FROM 'PURGED';
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'role % may remove the envelopes of PURGED events only, not of %', session_user, bad
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    WITH gone AS (
        DELETE FROM sealpost.envelope e USING unnest(p_ids, p_members) AS k(id, m)
         WHERE e.event_id = k.id AND e.member = k.m
        RETURNING e.event_id)
    SELECT count(*), coalesce(array_agg(DISTINCT event_id), '{}') INTO n, ids FROM gone;
    IF n > 0 THEN
        DELETE FROM sealpost.delivery_set s
         WHERE s.event_id = ANY(ids)
           AND NOT EXISTS (SELECT 1 FROM sealpost.envelope e WHERE e.event_id = s.event_id);
        INSERT INTO sealpost.erasure (what, events, event_ids, by_login, at_ms)
        VALUES ('envelope', cardinality(ids), ids, session_user,
                (extract(epoch from clock_timestamp()) * 1000)::bigint);
    END IF;
    RETURN n;
END
$$;
REVOKE ALL ON FUNCTION sealpost.remove_envelopes(uuid[], int2[]) FROM PUBLIC;

ALTER FUNCTION sealpost.install_roles() RENAME TO install_roles_9;
CREATE FUNCTION sealpost.install_roles() RETURNS boolean
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $install$
DECLARE
    names text[];
BEGIN
    IF NOT sealpost.install_roles_9() THEN
        RETURN false;
    END IF;
    SELECT array_agg(role_name::text ORDER BY array_position(
               ARRAY['producer', 'dispatcher', 'reconciler', 'consumer', 'operator', 'reader'], kind))
      INTO names FROM sealpost.role;
    -- The producer writes a set with its members; everyone else reads it.
    EXECUTE format('GRANT INSERT ON sealpost.delivery_set TO %I', names[1]);
    EXECUTE format('GRANT SELECT ON sealpost.delivery_set TO %I, %I, %I, %I, %I',
                   names[2], names[3], names[4], names[5], names[6]);
    RETURN true;
END
$install$;
REVOKE ALL ON FUNCTION sealpost.install_roles() FROM PUBLIC;
REVOKE ALL ON FUNCTION sealpost.install_roles_9() FROM PUBLIC;

SELECT sealpost.install_roles();
