-- Sealpost outbox schema, version 9: contracts (R26). A registry of payload schemas per event
-- type, each version immutable once registered (`sealpost schema register` checks a new
-- version against every registered one, both ways, before it inserts it), and a per-route
-- switch that makes `enqueue` refuse a payload whose schema is not registered or that does
-- not match it.

CREATE TABLE sealpost.contract (
    event_type     text NOT NULL,
    version        int NOT NULL CHECK (version >= 1),
    -- The Avro schema (JSON) as registered, with its field annotations ("contract": unit,
    -- time_zone, null_meaning, unique, ordering_key, delete).
    schema_text    text NOT NULL,
    -- SHA-256 of schema_text (domain-separated); registering the same text again is a no-op.
    fingerprint    bytea NOT NULL,
    registered_at  timestamptz NOT NULL DEFAULT now(),
    registered_by  text NOT NULL DEFAULT session_user,
    PRIMARY KEY (event_type, version),
    UNIQUE (event_type, fingerprint)
);

-- A registered version is what producers wrote and readers resolve against: it never changes.
CREATE FUNCTION sealpost.contract_immutable() RETURNS trigger
    LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION 'version % of % is registered and never changes; register a new version instead',
        OLD.version, OLD.event_type USING ERRCODE = 'insufficient_privilege';
END
$$;
CREATE TRIGGER contract_immutable BEFORE UPDATE ON sealpost.contract
    FOR EACH ROW EXECUTE FUNCTION sealpost.contract_immutable();

-- Off by default: a route that turns it on makes enqueue check every payload.
ALTER TABLE sealpost.route_policy ADD COLUMN contracts boolean NOT NULL DEFAULT false;

-- Grants (migration 6's roles). Producers read the registry to check payloads at enqueue;
-- consumers read it to resolve a writer's version into their own; the operator registers
-- (`sealpost schema register`); the reader reads every table (install_roles_6).
ALTER FUNCTION sealpost.install_roles() RENAME TO install_roles_8;
CREATE FUNCTION sealpost.install_roles() RETURNS boolean
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $install$
DECLARE
    names text[];
BEGIN
    IF NOT sealpost.install_roles_8() THEN
        RETURN false;
    END IF;
    SELECT array_agg(role_name::text ORDER BY array_position(
               ARRAY['producer', 'dispatcher', 'reconciler', 'consumer', 'operator', 'reader'], kind))
      INTO names FROM sealpost.role;
    EXECUTE format('GRANT SELECT ON sealpost.contract TO %I, %I, %I, %I, %I',
                   names[1], names[2], names[3], names[4], names[6]);
    EXECUTE format('GRANT SELECT, INSERT ON sealpost.contract TO %I', names[5]);
    EXECUTE format('GRANT UPDATE (contracts) ON sealpost.route_policy TO %I', names[5]);
    RETURN true;
END
$install$;
REVOKE ALL ON FUNCTION sealpost.install_roles() FROM PUBLIC;
REVOKE ALL ON FUNCTION sealpost.install_roles_8() FROM PUBLIC;

SELECT sealpost.install_roles();
