-- task_seen.sql: what a few tasks are now, for the resource queues' check before a scan starts
-- past them (ready::Seen).
--
-- $1 uuid[]  the tasks
-- Returns: pulp_id, then 'waiting' (waiting and unclaimed; also canceling and unclaimed: Pulp
-- canceled it while it waited, it holds no lock, and a scan that starts past it reserves it as
-- it would a waiting task, so that its leaving drops the scan hint), 'held' (incomplete
-- otherwise: claimed or running) or 'gone' (final, or no such task) per task. One primary-key
-- probe per task.
-- Never writes.
SELECT id,
       CASE WHEN t.pulp_id IS NULL OR t.state IN ($final_states)
                THEN 'gone'
            WHEN t.state IN ('waiting', 'canceling') AND t.app_lock_id IS NULL THEN 'waiting'
            ELSE 'held' END
FROM unnest($1::uuid[]) AS id
LEFT JOIN core_task t ON t.pulp_id = id
