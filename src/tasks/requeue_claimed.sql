-- requeue_claimed.sql: puts every task a worker claimed but did not start back in the queue.
-- $1 uuid  the core_appstatus row.  Returns the requeued tasks.
UPDATE core_task SET app_lock_id = NULL, pulp_last_updated = now()
WHERE app_lock_id = $1 AND state = 'waiting'
RETURNING pulp_id
