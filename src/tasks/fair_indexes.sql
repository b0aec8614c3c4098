-- fair_indexes.sql: the indexes fair dispatch reads through (src/dispatch/fairness.rs), made
-- without blocking writers; migrate.sql makes the same ones on a fresh database. Added to an
-- existing (e.g. Pulp's) database by `dispatch-broker migrate --fair-indexes`. Both hold waiting
-- tasks only.
--   dispatch_groups_idx     each group's waiting tasks in queue order: a directed page of one
--                           group, and the skip scan of groups_waiting.sql
--   dispatch_immediate_idx  the waiting immediate tasks in queue order
CREATE INDEX CONCURRENTLY IF NOT EXISTS dispatch_groups_idx
    ON core_task (pulp_domain_id, pulp_created, pulp_id) WHERE state = 'waiting';
CREATE INDEX CONCURRENTLY IF NOT EXISTS dispatch_immediate_idx
    ON core_task (pulp_created, pulp_id) WHERE state = 'waiting' AND immediate;
