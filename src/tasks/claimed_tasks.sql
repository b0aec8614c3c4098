-- claimed_tasks.sql: every claimed incomplete task with its worker row: what a rebuild of lost
-- lock state must lock again.
-- Returns: task pulp_id, record, app_lock_id, worker name, worker ttl (ms), worker versions (JSON),
--          pulp_domain_id, immediate, task_group_id.
SELECT t.pulp_id, coalesce(t.reserved_resources_record, '{}'::text[]), t.app_lock_id, a.name,
       (extract(epoch FROM a.ttl) * 1000)::bigint,
       hstore_to_json(a.versions)::text, t.pulp_domain_id, coalesce(t.immediate, false),
       t.task_group_id
FROM core_task t
JOIN core_appstatus a ON a.pulp_id = t.app_lock_id
WHERE t.app_lock_id IS NOT NULL AND t.state IN ($incomplete_states)
ORDER BY t.app_lock_id, t.pulp_created, t.pulp_id
