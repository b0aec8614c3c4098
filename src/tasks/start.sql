-- start.sql: marks a claimed task running.
--
-- $1 uuid  the task;  $2 uuid  the core_appstatus row that claimed it
-- Returns: started_at when the task started; no row when it is not this holder's waiting task.
-- The state is tested as `state || ''` so that only the primary key serves the look-up (see
-- claim.sql).
UPDATE core_task
SET state = 'running', started_at = now(), pulp_last_updated = now()
WHERE pulp_id = $1 AND app_lock_id = $2 AND state || '' = 'waiting'
RETURNING started_at
