-- task.sql: tasks by id, each with the exact readiness look-up against older incomplete tasks
-- (ClaimTask's one task; the claims put back that a scan hint checks first).
--
-- $1 uuid[]  the tasks
-- Returns: pulp_id, pulp_created, name, record, versions (JSON text), immediate, older_conflicts,
--          state, app_lock_id
-- Never writes.
SELECT t.pulp_id, t.pulp_created, t.name,
       coalesce(t.reserved_resources_record, '{}'::text[]) AS record,
       hstore_to_json(t.versions)::text AS versions,
       coalesce(t.immediate, false) AS immediate,
       c.older_conflicts, t.state, t.app_lock_id
FROM core_task t
CROSS JOIN LATERAL (
    SELECT ARRAY(
        SELECT CASE WHEN e LIKE 'shared:%' THEN substr(e, 8) ELSE e END
        FROM unnest(t.reserved_resources_record) AS e
        UNION
        SELECT 'shared:' || e FROM unnest(t.reserved_resources_record) AS e
        WHERE e NOT LIKE 'shared:%'
    ) AS keys
) k
CROSS JOIN LATERAL (
    -- One positive look-up in the partial GIN index, fenced from the time comparison (OFFSET 0):
    -- a generic plan would AND it with Pulp's plain pulp_created index and read every older task
    -- (tests/pulp_schema.rs checks the pages it reads).
    SELECT (
        SELECT count(*)
        FROM (
            SELECT u.pulp_created, u.pulp_id
            FROM core_task u
            WHERE u.state NOT IN ('completed', 'failed', 'canceled', 'skipped')
              AND u.reserved_resources_record && k.keys
            OFFSET 0
        ) AS m
        WHERE (m.pulp_created, m.pulp_id) < (t.pulp_created, t.pulp_id)
    ) AS older_conflicts
) c
WHERE t.pulp_id = ANY ($1::uuid[])
