-- requeue.sql: puts a claimed task that has not started back in the queue.
--
-- $1 uuid  the task;  $2 uuid  the core_appstatus row that claimed it;  $3 bool  the grant
-- being requeued started it (FetchTaskRequest.start) and was never delivered, so nobody ran it:
-- running under this row, it goes back to waiting too; asked to cancel meanwhile (canceling
-- under this row), it ends canceled, as a waiting task asked to cancel does.
-- Otherwise never touches a task that is running, final, or claimed by someone else.
-- Returns: requeued (it went back to the queue now), running_here (it is running or canceling
-- under this row: not touched), the task's domain and task group, and how long it ran when it is final (seconds
-- from started_at to finished_at, as Pulp recorded them; NULL otherwise): a release after Pulp
-- ran the task is when the broker learns it ended.
WITH task AS (
    SELECT state, app_lock_id, pulp_domain_id, task_group_id,
           CASE WHEN state IN ($final_states)
                THEN extract(epoch FROM finished_at - started_at)::float8 END AS ran
    FROM core_task WHERE pulp_id = $1
), requeued AS (
    UPDATE core_task
    SET app_lock_id = NULL,
        pulp_last_updated = now(),
        state = CASE WHEN state = 'canceling' THEN 'canceled' ELSE 'waiting' END,
        started_at = CASE WHEN state = 'canceling' THEN started_at END,
        finished_at = CASE WHEN state = 'canceling' THEN now() END
    WHERE pulp_id = $1 AND app_lock_id = $2
      AND (state = 'waiting' OR ($3::boolean AND state IN ('running', 'canceling')))
    RETURNING pulp_id
)
SELECT EXISTS (SELECT 1 FROM requeued) AS requeued,
       coalesce((SELECT state IN ('running', 'canceling') AND app_lock_id = $2 FROM task), false)
           AS running_here,
       (SELECT pulp_domain_id FROM task) AS domain,
       (SELECT task_group_id FROM task) AS task_group,
       (SELECT ran FROM task) AS ran
