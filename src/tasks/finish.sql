-- finish.sql: records tasks' final states, as Pulp's set_completed / set_failed / set_canceled do,
-- and gives up their claims (app_lock_id = NULL, as Pulp does after handling a task). One
-- statement for the FinishTask calls that arrive together (src/batch.rs).
--
-- $1 uuid[]  the tasks;  $2 uuid[]  the core_appstatus rows that claimed them
-- $3 text[]  the final states;  $4 text[]  the errors' reasons (NULL: none), recorded as
--            {"reason": ...}
-- Returns one row per task: the task; row_locked, when another transaction holds its row (Pulp
-- canceling it, say): it was not tried, and the caller finishes it on its own with the same
-- statement waiting for the row (`Tasks::finish`), so that one busy row holds up no other call
-- of the batch; finished, with its new state, its domain and task group, and how long it ran
-- (seconds from started_at to finished_at; NULL when it never started). finished is false for a
-- task that is not its holder's incomplete task.
-- The state is tested as `state || ''` so that only the primary key serves the look-up (see
-- claim.sql).
WITH wanted AS (
    SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::text[])
        AS f(task, app_status, state, reason)
), free AS (
    SELECT t.pulp_id
    FROM wanted f JOIN core_task t ON t.pulp_id = f.task
    ORDER BY t.pulp_id
    FOR NO KEY UPDATE OF t SKIP LOCKED
), finished AS (
    UPDATE core_task t
    SET state = f.state, finished_at = now(),
        error = CASE WHEN f.reason IS NULL THEN t.error
                     ELSE jsonb_build_object('reason', f.reason) END,
        app_lock_id = NULL,
        pulp_last_updated = now()
    FROM wanted f
    WHERE t.pulp_id = f.task AND t.pulp_id IN (SELECT pulp_id FROM free)
      AND t.app_lock_id = f.app_status
      AND t.state || '' IN ($incomplete_states)
    RETURNING t.pulp_id, t.state, t.pulp_domain_id, t.task_group_id,
              extract(epoch FROM t.finished_at - t.started_at)::float8 AS ran
)
SELECT DISTINCT ON (f.task) f.task,
       NOT EXISTS (SELECT 1 FROM free WHERE free.pulp_id = f.task) AS row_locked,
       d.pulp_id IS NOT NULL AS finished, d.state, d.pulp_domain_id, d.task_group_id, d.ran
FROM wanted f LEFT JOIN finished d ON d.pulp_id = f.task
