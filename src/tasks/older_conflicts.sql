-- older_conflicts.sql: the oldest incomplete tasks older than one task that conflict with it,
-- for ExplainTask. The same positive look-up as the readiness check (task.sql's count), listed.
--
-- $1 uuid     the explained task
-- $2 text[]   its conflict keys, C(T) (ready::Resources::conflict_keys)
-- $3 bigint   how many to list
-- Returns: pulp_id, state, name, record, pulp_created of each, oldest first.
-- Never writes.
SELECT m.pulp_id, m.state, m.name, m.record, m.pulp_created
FROM core_task t
CROSS JOIN LATERAL (
    -- Fenced (OFFSET 0) from the time comparison: a generic plan reads the GIN match only.
    SELECT u.pulp_id, u.state, u.name,
           coalesce(u.reserved_resources_record, '{}'::text[]) AS record, u.pulp_created
    FROM core_task u
    WHERE u.state NOT IN ($final_states)
      AND u.reserved_resources_record && $2::text[]
    OFFSET 0
) AS m
WHERE t.pulp_id = $1
  AND (m.pulp_created, m.pulp_id) < (t.pulp_created, t.pulp_id)
ORDER BY m.pulp_created, m.pulp_id
LIMIT $3
