-- Sealpost schema, migration 5: per-aggregate ordering (R29, issue 9).
--
-- A route may ask that one aggregate's events reach the broker in `aggregate_version` order.
-- The choice is frozen into every destination resolved from the route (`dest_ordering`,
-- field 9 of destination.v1), so a revision cannot change it under a committed event.
ALTER TABLE sealpost.route_policy ADD COLUMN ordering text NOT NULL DEFAULT 'none'
    CHECK (ordering IN ('none', 'per_aggregate'));
ALTER TABLE sealpost.envelope ADD COLUMN dest_ordering text NOT NULL DEFAULT 'none'
    CHECK (dest_ordering IN ('none', 'per_aggregate'));

-- The work row carries what the claim needs to find "an earlier event of this aggregate is
-- unresolved" without joining the envelope: the ordering key (aggregate type and id, NULL
-- when the destination is unordered) and the version.
ALTER TABLE sealpost.work ADD COLUMN ordering_key text;
ALTER TABLE sealpost.work ADD COLUMN aggregate_version bigint;

-- QUARANTINED gets a phase of its own (3) so the index below can keep it among the
-- unresolved rows without naming `state` (a column in an index predicate is an indexed
-- column: naming `state` would make every claim a non-HOT update). Phase 2 is now only
-- PUBLISHED, RETAINED and PURGED: resolved.
UPDATE sealpost.work SET phase = 3 WHERE state = 'QUARANTINED';

-- The earlier-unresolved probe: one index range per ordered candidate of a claim, over the
-- unresolved rows of its aggregate only (a published history of any length is not in it).
CREATE INDEX work_ordering_open ON sealpost.work (ordering_key, aggregate_version)
    WHERE ordering_key IS NOT NULL AND phase <> 2;
