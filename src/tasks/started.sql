-- started.sql: when this holder's task is already running, the time it started: the answer to
-- a StartTask retried after its answer was lost (start.sql found the task no longer waiting).
-- A statement of its own, so that its snapshot is taken after the start it may have waited for.
-- A task asked to cancel since it started (`canceling`) is answered too: the holder learns of the
-- cancel from its heartbeat and ends it with FinishTask, as it would had the cancel come later.
--
-- $1 uuid  the task;  $2 uuid  the core_appstatus row that claimed it
-- Returns: started_at when the task is running (or canceling) for that row; no row otherwise.
-- The state is tested as `state || ''` so that only the primary key serves the look-up (see
-- claim.sql).
SELECT started_at
FROM core_task
WHERE pulp_id = $1 AND app_lock_id = $2 AND state || '' IN ('running', 'canceling')
  AND started_at IS NOT NULL
