-- Sealpost schema, migration 6: PostgreSQL roles shipped with the schema (issue 23, item 1).
--
-- Six NOLOGIN roles, one per job, named PREFIX || kind (PREFIX: the session setting
-- `sealpost.role_prefix`, which `sealpost migrate --role-prefix` sets; default `sealpost_`):
--   producer    reads the route policy, inserts envelopes and their work rows;
--   dispatcher  claims and accepts: reads envelopes, updates work rows, inserts attempts,
--               receipts, quarantine and audit rows;
--   reconciler  the dispatcher's rights plus the verification pass (cursor, findings);
--   consumer    its own inbox rows, dead letters, watermarks and reported progress, as row
--               level security keyed on `current_user` and sealpost.consumer_login says;
--   operator    release, purge (the envelope only through the audited functions below),
--               migrate an event (R15), read everything;
--   reader      reads everything but payloads (the status page, `status`, `trace`).
-- Nobody but the schema owner may UPDATE or DELETE a sealed envelope: retention's payload
-- erase and tombstone removal go through sealpost.erase_payloads and
-- sealpost.remove_envelopes, SECURITY DEFINER functions that refuse rows that are not
-- PURGED and record who called them in sealpost.erasure.
--
-- Roles are cluster-wide and several databases may share them: a role that exists already is
-- reused (created by another database's migration or by a DBA beforehand) if it cannot log
-- in and is not a superuser; the grants below are this database's. Logins are mapped to
-- roles with `sealpost migrate --grant KIND=LOGIN` (consumers: `consumer=LOGIN:CONSUMER_ID`).

-- Which role does which job in this database (written once, here).
CREATE TABLE sealpost.role (
    kind       text PRIMARY KEY
               CHECK (kind IN ('producer', 'dispatcher', 'reconciler', 'consumer', 'operator', 'reader')),
    role_name  name NOT NULL UNIQUE
);

-- The consumer ids a login may write as (its inbox rows, dead letters, watermarks and
-- progress). Written by `sealpost migrate --grant consumer=LOGIN[:CONSUMER_ID]`.
CREATE TABLE sealpost.consumer_login (
    login          name NOT NULL,
    consumer_id    text NOT NULL,
    granted_at_ms  bigint NOT NULL DEFAULT (extract(epoch from clock_timestamp()) * 1000)::bigint,
    PRIMARY KEY (login, consumer_id)
);

-- Every call of the two functions that write a sealed envelope: what, how many, which
-- events, and the login that asked (session_user). Not audit evidence: purge keeps it.
CREATE TABLE sealpost.erasure (
    erasure_id  bigserial PRIMARY KEY,
    what        text NOT NULL CHECK (what IN ('payload', 'envelope')),
    events      int NOT NULL,
    event_ids   uuid[] NOT NULL,
    by_login    name NOT NULL,
    at_ms       bigint NOT NULL
);

-- May login `p_login` write rows of consumer `p_consumer`? (The row security policies call
-- it with `current_user`; it reads the mapping with the owner's rights.)
CREATE FUNCTION sealpost.may_write_as(p_login name, p_consumer text) RETURNS boolean
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
    SELECT EXISTS (SELECT 1 FROM sealpost.consumer_login
                   WHERE login = p_login AND consumer_id = p_consumer)
$$;

-- Reads a route policy for `enqueue`, locking it against a concurrent revision until the
-- caller's transaction ends (FOR SHARE needs UPDATE rights, which the producer has not).
CREATE FUNCTION sealpost.route_for_enqueue(p_name text) RETURNS SETOF sealpost.route_policy
    LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
    SELECT * FROM sealpost.route_policy WHERE name = p_name FOR SHARE
$$;

-- Retention's one write to the sealed envelope: the payload bytes of PURGED events are
-- erased (every generation). Refuses (42501) a key whose work row is not PURGED.
CREATE FUNCTION sealpost.erase_payloads(p_ids uuid[], p_members int2[]) RETURNS bigint
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
        RAISE EXCEPTION 'role % may erase the payload of PURGED events only, not of %', session_user, bad
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    WITH gone AS (
        UPDATE sealpost.envelope e SET payload = '\x'::bytea
          FROM unnest(p_ids, p_members) AS k(id, m)
         WHERE e.event_id = k.id AND e.member = k.m
        RETURNING e.event_id)
    SELECT count(*), coalesce(array_agg(DISTINCT event_id), '{}') INTO n, ids FROM gone;
    IF n > 0 THEN
        INSERT INTO sealpost.erasure (what, events, event_ids, by_login, at_ms)
        VALUES ('payload', cardinality(ids), ids, session_user,
                (extract(epoch from clock_timestamp()) * 1000)::bigint);
    END IF;
    RETURN n;
END
$$;

-- Tombstone removal: the envelope rows (every generation) of PURGED events are deleted.
-- Refuses (42501) a key whose work row is not PURGED.
CREATE FUNCTION sealpost.remove_envelopes(p_ids uuid[], p_members int2[]) RETURNS bigint
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
        INSERT INTO sealpost.erasure (what, events, event_ids, by_login, at_ms)
        VALUES ('envelope', cardinality(ids), ids, session_user,
                (extract(epoch from clock_timestamp()) * 1000)::bigint);
    END IF;
    RETURN n;
END
$$;

-- Functions are executable by PUBLIC unless revoked.
REVOKE ALL ON FUNCTION sealpost.may_write_as(name, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION sealpost.route_for_enqueue(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION sealpost.erase_payloads(uuid[], int2[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION sealpost.remove_envelopes(uuid[], int2[]) FROM PUBLIC;

-- The consumer tables: each consumer login sees and writes its own consumer ids' rows.
ALTER TABLE sealpost.inbox ENABLE ROW LEVEL SECURITY;
ALTER TABLE sealpost.inbox_quarantine ENABLE ROW LEVEL SECURITY;
ALTER TABLE sealpost.consumer_watermark ENABLE ROW LEVEL SECURITY;
ALTER TABLE sealpost.consumer_progress ENABLE ROW LEVEL SECURITY;

-- Which role of this database does which job, from the prefix `sealpost migrate
-- --role-prefix` set (default `sealpost_`).
DO $prefix$
DECLARE
    prefix text := coalesce(nullif(current_setting('sealpost.role_prefix', true), ''), 'sealpost_');
BEGIN
    IF prefix !~ '^[a-z_][a-z0-9_]{0,39}$' THEN
        RAISE EXCEPTION 'role prefix % must be lower-case letters, digits and _ (at most 40)', prefix;
    END IF;
    INSERT INTO sealpost.role (kind, role_name)
    SELECT k, prefix || k
    FROM unnest(ARRAY['producer', 'dispatcher', 'reconciler', 'consumer', 'operator', 'reader']) AS k;
END
$prefix$;

-- Creates the roles of sealpost.role that are missing and (re)applies every grant and
-- policy; idempotent. Returns false, granting nothing, when a role is missing and the caller
-- may not create roles (no CREATEROLE): a DBA creates them (NOLOGIN), then
-- `sealpost migrate --grant ...` calls this again. Run by the schema owner.
CREATE FUNCTION sealpost.install_roles() RETURNS boolean
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $install$
DECLARE
    k text;
    r text;
    found_role record;
    names text[];
    -- Positional arguments of every statement: 1 producer, 2 dispatcher, 3 reconciler,
    -- 4 consumer, 5 operator, 6 reader.
    stmts text[] := ARRAY[
        'GRANT USAGE ON SCHEMA sealpost TO %1$I, %2$I, %3$I, %4$I, %5$I, %6$I',
        'GRANT SELECT ON sealpost.schema_version, sealpost.role TO %1$I, %2$I, %3$I, %4$I, %5$I, %6$I',
        'GRANT USAGE ON ALL SEQUENCES IN SCHEMA sealpost TO %1$I, %2$I, %3$I, %4$I, %5$I',
        -- producer
        'GRANT SELECT ON sealpost.route_policy TO %1$I',
        'GRANT EXECUTE ON FUNCTION sealpost.route_for_enqueue(text) TO %1$I',
        'GRANT INSERT ON sealpost.envelope, sealpost.work TO %1$I',
        'GRANT SELECT (event_id, member, envelope_generation, dest_cluster, created_at_ms, aggregate_version)
             ON sealpost.envelope TO %1$I',
        -- dispatcher and reconciler
        'GRANT SELECT ON sealpost.envelope, sealpost.route_policy, sealpost.attempt, sealpost.receipt
             TO %2$I, %3$I',
        'GRANT SELECT, UPDATE ON sealpost.work TO %2$I, %3$I',
        'GRANT INSERT ON sealpost.attempt, sealpost.receipt, sealpost.quarantine, sealpost.audit TO %2$I, %3$I',
        'GRANT SELECT, INSERT, UPDATE ON sealpost.verify_cursor TO %3$I',
        'GRANT SELECT, INSERT ON sealpost.finding TO %3$I',
        -- consumer (rows limited by the policies below)
        'GRANT SELECT, INSERT ON sealpost.inbox, sealpost.inbox_quarantine TO %4$I',
        'GRANT SELECT, INSERT, UPDATE ON sealpost.consumer_watermark, sealpost.consumer_progress TO %4$I',
        'GRANT EXECUTE ON FUNCTION sealpost.may_write_as(name, text) TO %4$I',
        'DROP POLICY IF EXISTS own_rows ON sealpost.inbox',
        'CREATE POLICY own_rows ON sealpost.inbox TO %4$I
             USING (sealpost.may_write_as(current_user, consumer_id))
             WITH CHECK (sealpost.may_write_as(current_user, consumer_id))',
        'DROP POLICY IF EXISTS own_rows ON sealpost.inbox_quarantine',
        'CREATE POLICY own_rows ON sealpost.inbox_quarantine TO %4$I
             USING (sealpost.may_write_as(current_user, consumer_id))
             WITH CHECK (sealpost.may_write_as(current_user, consumer_id))',
        'DROP POLICY IF EXISTS own_rows ON sealpost.consumer_watermark',
        'CREATE POLICY own_rows ON sealpost.consumer_watermark TO %4$I
             USING (sealpost.may_write_as(current_user, consumer_id))
             WITH CHECK (sealpost.may_write_as(current_user, consumer_id))',
        'DROP POLICY IF EXISTS own_rows ON sealpost.consumer_progress',
        'CREATE POLICY own_rows ON sealpost.consumer_progress TO %4$I
             USING (sealpost.may_write_as(current_user, consumer_id))
             WITH CHECK (sealpost.may_write_as(current_user, consumer_id))',
        -- operator: reads everything; release and purge; migrates an event (R15)
        'GRANT SELECT ON ALL TABLES IN SCHEMA sealpost TO %5$I',
        'GRANT UPDATE, DELETE ON sealpost.work TO %5$I',
        'GRANT INSERT ON sealpost.audit, sealpost.envelope, sealpost.migration TO %5$I',
        'GRANT DELETE ON sealpost.attempt, sealpost.receipt, sealpost.quarantine, sealpost.audit,
             sealpost.finding, sealpost.migration, sealpost.inbox_quarantine TO %5$I',
        'GRANT EXECUTE ON FUNCTION sealpost.erase_payloads(uuid[], int2[]),
             sealpost.remove_envelopes(uuid[], int2[]) TO %5$I',
        -- (purge's pass 3 locks evidence rows FOR UPDATE, which needs UPDATE on a column:
        -- the id column only)
        'GRANT UPDATE (attempt_id) ON sealpost.attempt TO %5$I',
        'GRANT UPDATE (receipt_id) ON sealpost.receipt TO %5$I',
        'GRANT UPDATE (quarantine_id) ON sealpost.quarantine TO %5$I',
        'GRANT UPDATE (audit_id) ON sealpost.audit TO %5$I',
        'GRANT UPDATE (finding_id) ON sealpost.finding TO %5$I',
        'GRANT UPDATE (migration_id) ON sealpost.migration TO %5$I',
        'GRANT UPDATE (quarantine_id) ON sealpost.inbox_quarantine TO %5$I',
        'DROP POLICY IF EXISTS operator_purges ON sealpost.inbox_quarantine',
        'CREATE POLICY operator_purges ON sealpost.inbox_quarantine FOR DELETE TO %5$I USING (true)',
        'DROP POLICY IF EXISTS operator_locks ON sealpost.inbox_quarantine',
        'CREATE POLICY operator_locks ON sealpost.inbox_quarantine FOR UPDATE TO %5$I USING (true)',
        -- operator and reader read every consumer's rows (the reports, status)
        'DROP POLICY IF EXISTS read_all ON sealpost.inbox',
        'CREATE POLICY read_all ON sealpost.inbox FOR SELECT TO %5$I, %6$I USING (true)',
        'DROP POLICY IF EXISTS read_all ON sealpost.inbox_quarantine',
        'CREATE POLICY read_all ON sealpost.inbox_quarantine FOR SELECT TO %5$I, %6$I USING (true)',
        'DROP POLICY IF EXISTS read_all ON sealpost.consumer_watermark',
        'CREATE POLICY read_all ON sealpost.consumer_watermark FOR SELECT TO %5$I, %6$I USING (true)',
        'DROP POLICY IF EXISTS read_all ON sealpost.consumer_progress',
        'CREATE POLICY read_all ON sealpost.consumer_progress FOR SELECT TO %5$I, %6$I USING (true)'
    ];
    s text;
    cols text;
    rel text;
BEGIN
    FOR k, r IN SELECT kind, role_name::text FROM sealpost.role LOOP
        SELECT rolcanlogin, rolsuper INTO found_role FROM pg_roles WHERE rolname = r;
        IF NOT FOUND THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', r);
            EXCEPTION
                WHEN duplicate_object OR unique_violation THEN
                    NULL; -- another database's migration created it meanwhile
                WHEN insufficient_privilege THEN
                    RAISE WARNING 'Sealpost role % does not exist and % may not create roles: no grants applied; a DBA creates the roles (CREATE ROLE % NOLOGIN, ...), then run sealpost migrate --grant', r, current_user, r;
                    RETURN false;
            END;
        ELSIF found_role.rolcanlogin OR found_role.rolsuper THEN
            RAISE EXCEPTION 'role % exists and can log in or is a superuser; Sealpost grants its rights to NOLOGIN roles only (choose another prefix with --role-prefix)', r;
        END IF;
    END LOOP;
    SELECT array_agg(role_name::text ORDER BY array_position(
               ARRAY['producer', 'dispatcher', 'reconciler', 'consumer', 'operator', 'reader'], kind))
      INTO names FROM sealpost.role;
    FOREACH s IN ARRAY stmts LOOP
        EXECUTE format(s, names[1], names[2], names[3], names[4], names[5], names[6]);
    END LOOP;
    -- The reader reads every table and view but no payload: column grants on the three
    -- relations with one (a later migration adding a column grants it too).
    FOREACH rel IN ARRAY ARRAY['envelope', 'outbox', 'inbox_quarantine'] LOOP
        SELECT string_agg(quote_ident(attname), ', ' ORDER BY attnum) INTO cols
          FROM pg_attribute
         WHERE attrelid = format('sealpost.%I', rel)::regclass AND attnum > 0
           AND NOT attisdropped AND attname <> 'payload';
        EXECUTE format('GRANT SELECT (%s) ON sealpost.%I TO %I', cols, rel, names[6]);
    END LOOP;
    FOR rel IN SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                WHERE n.nspname = 'sealpost' AND c.relkind IN ('r', 'v', 'p')
                  AND c.relname NOT IN ('envelope', 'outbox', 'inbox_quarantine') LOOP
        EXECUTE format('GRANT SELECT ON sealpost.%I TO %I', rel, names[6]);
    END LOOP;
    RETURN true;
END
$install$;
REVOKE ALL ON FUNCTION sealpost.install_roles() FROM PUBLIC;

SELECT sealpost.install_roles();
