-- canceling.sql: every claimed task that was asked to cancel, with the row that claimed it: what
-- heartbeat replies list. One statement serves all heartbeats of a replica for a second, so an
-- idle fleet's heartbeats do not query the task table each. Uses core_task's state index.
--
-- Returns: pulp_id, app_lock_id.
-- Never writes.
SELECT pulp_id, app_lock_id
FROM core_task
WHERE state = 'canceling' AND app_lock_id IS NOT NULL
