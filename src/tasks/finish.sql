-- finish.sql: records a task's final state, as Pulp's set_completed / set_failed / set_canceled do,
-- and gives up the claim (app_lock_id = NULL, as Pulp does after handling a task).
--
-- $1 uuid   the task;  $2 uuid  the core_appstatus row that claimed it
-- $3 text   the final state;  $4 jsonb  the error ({"reason": ...}) or NULL
-- Returns: the new state, the task's domain and task group, and how long it ran (seconds from started_at to
-- finished_at; NULL when it never started); no row when the task is not this holder's incomplete
-- task.
-- The state is tested as `state || ''` so that only the primary key serves the look-up (see
-- claim.sql).
UPDATE core_task
SET state = $3, finished_at = now(), error = coalesce($4, error), app_lock_id = NULL,
    pulp_last_updated = now()
WHERE pulp_id = $1 AND app_lock_id = $2
  AND state || '' IN ($incomplete_states)
RETURNING state, pulp_domain_id, task_group_id,
          extract(epoch FROM finished_at - started_at)::float8
