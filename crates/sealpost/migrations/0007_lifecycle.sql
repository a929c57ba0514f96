-- Sealpost schema, migration 7: data lifecycle (R34, issue 23 item 5).
--
-- * A route may encrypt its payloads with a key per data subject (`payload_key`: 'aggregate'
--   keys each aggregate, 'tenant' each tenant). `enqueue` encrypts the producer's bytes
--   before sealing, so the envelope, every broker copy and every dead letter hold only the
--   ciphertext; its digests are the ciphertext's and stay valid after an erasure.
-- * `sealpost erase` destroys a subject's key (sealpost.erase_subject): every copy of its
--   events, wherever it lies, then reads as erased. The erasure is recorded.
-- * Dead letters are capped in bytes (payload_bytes records the size of one not kept).
-- * A route may give its stream or topic a retention (`max_age_ms`): Sealpost creates
--   streams with it.
--
-- The keys live in their own schema, which no Sealpost role may use: producers, consumers
-- and operators reach them only through the three SECURITY DEFINER functions below, and the
-- reader (the status page) never.

ALTER TABLE sealpost.route_policy
    ADD COLUMN payload_key text NOT NULL DEFAULT 'none'
        CHECK (payload_key IN ('none', 'aggregate', 'tenant')),
    ADD COLUMN max_age_ms bigint CHECK (max_age_ms > 0);

-- Dead letters keep a payload of at most sealpost::inbox::DEAD_LETTER_PAYLOAD_BYTES_MAX
-- bytes; a larger one is not kept (NULL), only its size (the outbox envelope holds it until
-- purge).
ALTER TABLE sealpost.inbox_quarantine ADD COLUMN payload_bytes integer;

CREATE SCHEMA sealpost_key;
REVOKE ALL ON SCHEMA sealpost_key FROM PUBLIC;

-- One key per data subject: scope 'aggregate' (aggregate_type, subject_id = aggregate id) or
-- 'tenant' (aggregate_type '', subject_id = tenant). An erased subject keeps its row, without
-- the key, so that no later event can bring a key back under the same name.
CREATE TABLE sealpost_key.subject_key (
    scope           text NOT NULL CHECK (scope IN ('aggregate', 'tenant')),
    aggregate_type  text NOT NULL,
    subject_id      text NOT NULL,
    key             bytea CHECK (octet_length(key) = 32),
    created_at_ms   bigint NOT NULL,
    erased_at_ms    bigint,
    PRIMARY KEY (scope, aggregate_type, subject_id),
    CHECK ((key IS NULL) = (erased_at_ms IS NOT NULL))
);

-- Every erasure of a subject: who asked and when (no key, no payload).
CREATE TABLE sealpost.subject_erasure (
    erasure_id      bigserial PRIMARY KEY,
    scope           text NOT NULL,
    aggregate_type  text NOT NULL,
    subject_id      text NOT NULL,
    envelopes       bigint NOT NULL,
    by_login        name NOT NULL,
    at_ms           bigint NOT NULL
);

-- The producer's one access: the subject's key, created with `p_fresh` (32 random bytes the
-- caller drew) when the subject has none yet. NULL when the subject was erased.
CREATE FUNCTION sealpost.subject_key_for_enqueue(p_scope text, p_type text, p_id text, p_fresh bytea)
    RETURNS bytea
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    k bytea;
BEGIN
    INSERT INTO sealpost_key.subject_key (scope, aggregate_type, subject_id, key, created_at_ms)
    VALUES (p_scope, p_type, p_id, p_fresh, (extract(epoch from clock_timestamp()) * 1000)::bigint)
    ON CONFLICT DO NOTHING;
    SELECT key INTO k FROM sealpost_key.subject_key
     WHERE scope = p_scope AND aggregate_type = p_type AND subject_id = p_id;
    RETURN k;
END
$$;

-- The consumer's one access: the keys of the subjects a batch names (an erased subject's
-- key is NULL with its erasure time; an unknown subject has no row).
CREATE FUNCTION sealpost.subject_keys(p_scopes text[], p_types text[], p_ids text[])
    RETURNS TABLE (scope text, aggregate_type text, subject_id text, key bytea, erased_at_ms bigint)
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
    SELECT k.scope, k.aggregate_type, k.subject_id, k.key, k.erased_at_ms
      FROM sealpost_key.subject_key k
      JOIN unnest(p_scopes, p_types, p_ids) AS q(s, t, i)
        ON k.scope = q.s AND k.aggregate_type = q.t AND k.subject_id = q.i
$$;

-- The operator's erasure: destroys the subject's key (or records that it never had one, so
-- that none is created later) and records who asked. Returns how many envelopes of the
-- subject are on record (their payloads now read as erased).
CREATE FUNCTION sealpost.erase_subject(p_scope text, p_type text, p_id text) RETURNS bigint
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    now_ms bigint := (extract(epoch from clock_timestamp()) * 1000)::bigint;
    n bigint;
BEGIN
    IF p_scope NOT IN ('aggregate', 'tenant') THEN
        RAISE EXCEPTION 'subject scope must be aggregate or tenant, not %', p_scope;
    END IF;
    INSERT INTO sealpost_key.subject_key (scope, aggregate_type, subject_id, key, created_at_ms, erased_at_ms)
    VALUES (p_scope, p_type, p_id, NULL, now_ms, now_ms)
    ON CONFLICT (scope, aggregate_type, subject_id)
        DO UPDATE SET key = NULL, erased_at_ms = coalesce(sealpost_key.subject_key.erased_at_ms, now_ms);
    IF p_scope = 'aggregate' THEN
        SELECT count(*) INTO n FROM sealpost.envelope
         WHERE aggregate_type = p_type AND aggregate_id = p_id;
    ELSE
        SELECT count(*) INTO n FROM sealpost.envelope WHERE tenant = p_id;
    END IF;
    INSERT INTO sealpost.subject_erasure (scope, aggregate_type, subject_id, envelopes, by_login, at_ms)
    VALUES (p_scope, p_type, p_id, n, session_user, now_ms);
    RETURN n;
END
$$;

REVOKE ALL ON FUNCTION sealpost.subject_key_for_enqueue(text, text, text, bytea) FROM PUBLIC;
REVOKE ALL ON FUNCTION sealpost.subject_keys(text[], text[], text[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION sealpost.erase_subject(text, text, text) FROM PUBLIC;

-- install_roles of migration 6 stays as it was; this migration's grants follow it, in the
-- function `sealpost migrate --grant` calls.
ALTER FUNCTION sealpost.install_roles() RENAME TO install_roles_6;
CREATE FUNCTION sealpost.install_roles() RETURNS boolean
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $install$
DECLARE
    names text[];
BEGIN
    IF NOT sealpost.install_roles_6() THEN
        RETURN false;
    END IF;
    SELECT array_agg(role_name::text ORDER BY array_position(
               ARRAY['producer', 'dispatcher', 'reconciler', 'consumer', 'operator', 'reader'], kind))
      INTO names FROM sealpost.role;
    EXECUTE format('GRANT EXECUTE ON FUNCTION sealpost.subject_key_for_enqueue(text, text, text, bytea) TO %I',
                   names[1]);
    EXECUTE format('GRANT EXECUTE ON FUNCTION sealpost.subject_keys(text[], text[], text[]) TO %I', names[4]);
    EXECUTE format('GRANT EXECUTE ON FUNCTION sealpost.erase_subject(text, text, text) TO %I', names[5]);
    RETURN true;
END
$install$;
REVOKE ALL ON FUNCTION sealpost.install_roles() FROM PUBLIC;
REVOKE ALL ON FUNCTION sealpost.install_roles_6() FROM PUBLIC;

SELECT sealpost.install_roles();
