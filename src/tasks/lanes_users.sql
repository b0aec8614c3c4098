-- lanes_users.sql: the incomplete tasks that need any of a few resources, in queue order: what
-- takes over the places of tasks that ended (ready::Repair), looked up by name in the partial
-- GIN index (rare resources: the cost is the number of their users). The overlap is the only
-- selective condition, so that the generic plan is the GIN look-up; the caller keeps the tasks
-- between the oldest place repaired and the last task its counter saw.
--
-- $1 text[]  the record entries (r and shared:r per resource)
-- Returns: reserved_resources_record, pulp_id, pulp_created, pulp_domain_id, immediate,
-- task_group_id per task.
-- Never writes.
SELECT reserved_resources_record, pulp_id, pulp_created, pulp_domain_id, coalesce(immediate, false),
       task_group_id
FROM core_task
WHERE state NOT IN ($final_states)
  AND reserved_resources_record && $1::text[]
  AND state IN ('waiting', 'running')
ORDER BY pulp_created, pulp_id
