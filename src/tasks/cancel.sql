-- cancel.sql: cancels a task whose state was just read under FOR UPDATE (task_state.sql).
-- A waiting task becomes `canceled` at once and loses its claim; a running task becomes
-- `canceling`, and its holder learns it from its next heartbeat reply.
--
-- $1 uuid  the task
-- Returns: the new state; no row when the task was already canceling or final.
-- The state is tested as `state || ''` so that only the primary key serves the look-up (see
-- claim.sql).
UPDATE core_task
SET state = CASE WHEN state = 'waiting' THEN 'canceled' ELSE 'canceling' END,
    finished_at = CASE WHEN state = 'waiting' THEN now() ELSE finished_at END,
    app_lock_id = CASE WHEN state = 'waiting' THEN NULL ELSE app_lock_id END,
    pulp_last_updated = now()
WHERE pulp_id = $1 AND state || '' IN ('waiting', 'running')
RETURNING state
