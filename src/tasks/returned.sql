-- returned.sql: the tasks among some that are waiting and unclaimed, each with the exact readiness
-- look-up against older incomplete tasks: claims put back in the queue behind a scan hint's
-- position, which the hint's page no longer reaches.
--
-- $1 uuid[]  the tasks
-- Returns: pulp_id, pulp_created, name, record, versions (JSON text), immediate, older_conflicts,
--          oldest first.
-- Never writes.
-- The state is tested as `state || ''` so that only the primary key serves the look-up (see
-- claim.sql).
SELECT t.pulp_id, t.pulp_created, t.name,
       coalesce(t.reserved_resources_record, '{}'::text[]) AS record,
       hstore_to_json(t.versions)::text AS versions,
       coalesce(t.immediate, false) AS immediate,
       c.older_conflicts
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
    -- The same fenced GIN look-up as candidates.sql and task.sql.
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
  AND t.state || '' = 'waiting'
  AND t.app_lock_id IS NULL
ORDER BY t.pulp_created, t.pulp_id
