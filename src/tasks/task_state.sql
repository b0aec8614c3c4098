-- task_state.sql: a task's state and claim, locked for the rest of the transaction.
--
-- $1 uuid  the task
-- Returns: state, app_lock_id; no row for an unknown task.
SELECT state, app_lock_id FROM core_task WHERE pulp_id = $1 FOR UPDATE
