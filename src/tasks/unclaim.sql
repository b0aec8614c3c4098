-- unclaim.sql: puts a claimed task that has not started back in the queue.
--
-- $1 uuid  the task;  $2 uuid  the core_appstatus row that claimed it
-- Returns: one row when the task went back to the queue.
-- Never touches a task that is running, final, or claimed by someone else.
UPDATE core_task
SET app_lock_id = NULL, pulp_last_updated = now()
WHERE pulp_id = $1 AND app_lock_id = $2 AND state = 'waiting'
RETURNING pulp_id
