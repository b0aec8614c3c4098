-- fair_indexes.sql: the indexes fair dispatch reads through (src/dispatch/fairness.rs), made
-- without blocking writers; migrate.sql makes the same ones on a fresh database. Added to an
-- existing (e.g. Pulp's) database by `dispatch-broker migrate --fair-indexes`. All hold waiting
-- tasks only.
--   dispatch_groups_idx       each domain's waiting tasks in queue order: a directed page of one
--                             domain, and the skip scan of groups_waiting.sql (--fair-by domain)
--   dispatch_immediate_idx    the waiting immediate tasks in queue order
--   dispatch_task_groups_idx  the same as dispatch_groups_idx by task group (--fair-by
--                             task-group; no task group is the nil id)
CREATE INDEX CONCURRENTLY IF NOT EXISTS dispatch_groups_idx
    ON core_task (pulp_domain_id, pulp_created, pulp_id) WHERE state = 'waiting';
CREATE INDEX CONCURRENTLY IF NOT EXISTS dispatch_immediate_idx
    ON core_task (pulp_created, pulp_id) WHERE state = 'waiting' AND immediate;
CREATE INDEX CONCURRENTLY IF NOT EXISTS dispatch_task_groups_idx
    ON core_task ((coalesce(task_group_id, '00000000-0000-0000-0000-000000000000'::uuid)),
                  pulp_created, pulp_id)
    WHERE state = 'waiting';
