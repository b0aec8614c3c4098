-- migrate.sql: the subset of pulpcore 3.123's schema that the broker needs, for a database that
-- has no Pulp tables. Column names, types and the resources index are pulpcore's own, so the same
-- queries run on both. Runs in one transaction; every statement is idempotent.

CREATE EXTENSION IF NOT EXISTS hstore;

CREATE TABLE IF NOT EXISTS core_appstatus (
    pulp_id uuid PRIMARY KEY,
    pulp_created timestamptz NOT NULL DEFAULT now(),
    pulp_last_updated timestamptz,
    app_type varchar(10) NOT NULL,
    name text NOT NULL,
    versions hstore NOT NULL DEFAULT ''::hstore,
    ttl interval NOT NULL,
    last_heartbeat timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS core_task (
    pulp_id uuid PRIMARY KEY,
    pulp_created timestamptz NOT NULL DEFAULT now(),
    pulp_last_updated timestamptz,
    state text NOT NULL DEFAULT 'waiting',
    name text NOT NULL,
    started_at timestamptz,
    finished_at timestamptz,
    error jsonb,
    reserved_resources_record text[],
    app_lock_id uuid REFERENCES core_appstatus (pulp_id) ON DELETE SET NULL
        DEFERRABLE INITIALLY DEFERRED,
    versions hstore NOT NULL DEFAULT ''::hstore,
    immediate boolean DEFAULT false,
    deferred boolean DEFAULT true,
    -- Pulp's domain (a foreign key to core_domain there); one default domain here.
    pulp_domain_id uuid NOT NULL DEFAULT '00000000-0000-0000-0000-000000000000',
    -- Pulp's task group (a foreign key to core_taskgroup there), if any.
    task_group_id uuid
);

CREATE INDEX IF NOT EXISTS core_task_state_pulp_created_idx ON core_task (state, pulp_created);
CREATE INDEX IF NOT EXISTS core_task_app_lock_id_idx ON core_task (app_lock_id);
CREATE INDEX IF NOT EXISTS pulp_task_resources_index ON core_task
    USING gin (reserved_resources_record)
    WHERE NOT (state = ANY (ARRAY[$final_states]));
-- Every claim, start and finish writes new index entries (the state changes); with GIN's pending
-- list on, each readiness look-up would scan up to 4 MB of unsorted entries until the next vacuum
-- (47 ms instead of 2.6 ms for one page of candidates, measured). gin_fastupdate.sql does the same
-- on existing databases.
ALTER INDEX pulp_task_resources_index SET (fastupdate = off);
-- Fair dispatch's indexes (fair_indexes.sql makes the same ones concurrently on existing databases).
CREATE INDEX IF NOT EXISTS dispatch_groups_idx ON core_task (pulp_domain_id, pulp_created, pulp_id)
    WHERE state = 'waiting';
CREATE INDEX IF NOT EXISTS dispatch_immediate_idx ON core_task (pulp_created, pulp_id)
    WHERE state = 'waiting' AND immediate;
CREATE INDEX IF NOT EXISTS dispatch_task_groups_idx
    ON core_task ((coalesce(task_group_id, '00000000-0000-0000-0000-000000000000'::uuid)),
                  pulp_created, pulp_id)
    WHERE state = 'waiting';
-- The lane gauge's index (lanes_index.sql makes the same one concurrently on existing databases).
CREATE INDEX IF NOT EXISTS dispatch_lanes_idx ON core_task (pulp_created, pulp_id)
    WHERE state IN ('waiting', 'running');

-- The insert trigger: the database stamps pulp_created, and among tasks that share a resource the
-- stamps strictly increase in commit order (per-resource advisory locks serialise such inserts).
-- This is what makes a task's readiness against older tasks stable: no older conflicting task can
-- appear after a task was found ready.
CREATE OR REPLACE FUNCTION dispatch_task_stamp_created() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    names text[];
    newest timestamptz;
BEGIN
    SELECT coalesce(array_agg(DISTINCT regexp_replace(entry, '^shared:', '')), '{}')
    INTO names
    FROM unnest(coalesce(NEW.reserved_resources_record, '{}'::text[])) AS entry;

    PERFORM pg_advisory_xact_lock(4711, lock_id)
    FROM (SELECT hashtext(name) AS lock_id FROM unnest(names) AS name ORDER BY 1) AS ordered;

    NEW.pulp_created := clock_timestamp();

    SELECT pulp_created INTO newest
    FROM core_task
    WHERE state NOT IN ($final_states)
      AND reserved_resources_record && (names || ARRAY(SELECT 'shared:' || n FROM unnest(names) AS n))
    ORDER BY pulp_created DESC
    LIMIT 1;
    IF newest IS NOT NULL AND NEW.pulp_created <= newest THEN
        RAISE EXCEPTION 'clock went backwards: a conflicting task is newer than %', NEW.pulp_created;
    END IF;
    RETURN NEW;
END;
$$;

DROP TRIGGER IF EXISTS dispatch_task_stamp_created ON core_task;
CREATE TRIGGER dispatch_task_stamp_created BEFORE INSERT ON core_task
    FOR EACH ROW EXECUTE FUNCTION dispatch_task_stamp_created();
