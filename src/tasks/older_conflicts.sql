-- older_conflicts.sql: the oldest incomplete tasks older than one task that conflict with it,
-- for ExplainTask. The same positive look-up as the readiness check (task.sql's count), listed.
--
-- $1 uuid     the explained task
-- $2 text[]   its conflict keys, C(T) (ready::Resources::conflict_keys)
-- $3 bigint   how many to list
-- Returns: pulp_id, state, name, record, pulp_created of each, oldest first.
-- Never writes.
SELECT u.pulp_id, u.state, u.name,
       coalesce(u.reserved_resources_record, '{}'::text[]) AS record, u.pulp_created
FROM core_task t
JOIN core_task u
  ON u.state NOT IN ('completed', 'failed', 'canceled', 'skipped')
 AND u.reserved_resources_record && $2::text[]
 AND (u.pulp_created, u.pulp_id) < (t.pulp_created, t.pulp_id)
WHERE t.pulp_id = $1
ORDER BY u.pulp_created, u.pulp_id
LIMIT $3
