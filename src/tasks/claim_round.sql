-- claim_round.sql: claims a fetch round's tasks in one statement, each as claim.sql claims one:
-- a waiting, unclaimed task made its lease's (Pulp's app_lock), and started too where its
-- caller asked.
--
-- $1 uuid[]  the tasks;  $2 uuid[]  each one's lease's core_appstatus row;  $3 boolean[]  start it
-- Returns one row per task: the task; row_locked, when another transaction holds its row (a
-- cancel in Pulp, say): it was not tried, and the caller claims it on its own with claim.sql,
-- which waits for the row, so that one busy row holds up no other grant of the round; claimed;
-- started_at (null unless started).
-- Never claims a task that is not `waiting`, or that another row claimed (as claim.sql). The
-- rows are found by primary key only (`state || ''`: see claim.sql), and locked in key order
-- with the lock the UPDATE takes anyway (NO KEY UPDATE: foreign-key checks of other rows that
-- point at a task do not make it look busy).
WITH wanted AS (
    SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::boolean[]) AS w(task, app_status, start)
), free AS (
    SELECT t.pulp_id
    FROM wanted w JOIN core_task t ON t.pulp_id = w.task
    ORDER BY t.pulp_id
    FOR NO KEY UPDATE OF t SKIP LOCKED
), claimed AS (
    UPDATE core_task t
    SET app_lock_id = w.app_status,
        pulp_last_updated = now(),
        state = CASE WHEN w.start THEN 'running' ELSE t.state END,
        started_at = CASE WHEN w.start THEN now() ELSE t.started_at END
    FROM wanted w
    WHERE t.pulp_id = w.task AND t.pulp_id IN (SELECT pulp_id FROM free)
      AND t.state || '' = 'waiting' AND (t.app_lock_id IS NULL OR t.app_lock_id = w.app_status)
    RETURNING t.pulp_id, CASE WHEN w.start THEN t.started_at END AS started_at
)
SELECT w.task,
       NOT EXISTS (SELECT 1 FROM free f WHERE f.pulp_id = w.task) AS row_locked,
       c.pulp_id IS NOT NULL AS claimed,
       c.started_at
FROM wanted w LEFT JOIN claimed c ON c.pulp_id = w.task
