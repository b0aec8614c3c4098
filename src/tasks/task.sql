-- task.sql: tasks by id, each with the exact readiness look-up against older incomplete tasks
-- (ClaimTask's one task; the claims put back that a scan hint checks first), made as
-- candidates.sql makes it (readiness_lookup.sql, which tasks.rs writes in at
-- `-- $readiness_lookup`): a task up to the end of the queue's head with a busy queue's entry
-- among its conflict keys, such as R0's next task once R0's head finished, is looked up against
-- the few incomplete tasks older than it, not against every user of R0 (through the GIN index
-- alone, that read R0's whole queue).
--
-- $1 uuid[]       the tasks
-- $2 timestamptz  the end of the queue's head (NULL: none), as candidates.sql's $4 and $5
-- $3 uuid
-- $4 text[]       the busy queues' entries and how many tasks carry each, as candidates.sql's
-- $5 int[]        $6 and $7
-- Returns: pulp_id, pulp_created, name, record, versions (JSON text), immediate, older_conflicts,
--          state, app_lock_id, domain (pulp_domain_id), task_group (task_group_id)
-- Read under candidates_settings.sql, as candidates.sql is. Never writes.
SELECT p.pulp_id, p.pulp_created, p.name, p.record,
       hstore_to_json(p.versions)::text AS versions,
       coalesce(p.immediate, false) AS immediate,
       c.older_conflicts, p.state, p.app_lock_id, p.pulp_domain_id AS domain,
       p.task_group_id AS task_group
FROM (
    SELECT t.pulp_id, t.pulp_created, t.name,
           coalesce(t.reserved_resources_record, '{}'::text[]) AS record,
           t.versions, t.immediate, t.state, t.app_lock_id, t.pulp_domain_id, t.task_group_id
    FROM core_task t
    WHERE t.pulp_id = ANY ($1::uuid[])
) p
-- $readiness_lookup
