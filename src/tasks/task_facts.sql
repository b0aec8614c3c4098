-- task_facts.sql: one task as task.sql returns it, without the readiness look-up (older_conflicts
-- is 0): for explaining a task that is not waiting, where the look-up would cost a read of its
-- resources' whole queues for nothing.
--
-- $1 uuid[]  the tasks
-- Returns: pulp_id, pulp_created, name, record, versions (JSON text), immediate, 0, state,
--          app_lock_id, domain (pulp_domain_id), task_group (task_group_id)
-- Never writes.
SELECT t.pulp_id, t.pulp_created, t.name,
       coalesce(t.reserved_resources_record, '{}'::text[]) AS record,
       hstore_to_json(t.versions)::text AS versions,
       coalesce(t.immediate, false) AS immediate,
       0::bigint AS older_conflicts, t.state, t.app_lock_id, t.pulp_domain_id AS domain,
       t.task_group_id AS task_group
FROM core_task t
WHERE t.pulp_id = ANY ($1::uuid[])
