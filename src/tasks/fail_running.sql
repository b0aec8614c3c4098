-- fail_running.sql: fails every task a worker was running, as Pulp's missing-worker cleanup does.
-- $1 uuid  the core_appstatus row;  $2 text  the reason.  Returns the failed tasks.
UPDATE core_task
SET state = 'failed', finished_at = now(), error = jsonb_build_object('reason', $2::text),
    app_lock_id = NULL, pulp_last_updated = now()
WHERE app_lock_id = $1 AND state IN ('running', 'canceling')
RETURNING pulp_id
