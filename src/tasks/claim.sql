-- claim.sql: makes a waiting, unclaimed task the lease's (Pulp's app_lock), and with $3 also
-- starts it (running, started_at now) in the same statement.
--
-- $1 uuid  the task;  $2 uuid  the lease's core_appstatus row;  $3 bool  start it
-- Returns: started_at (null unless started) when claimed; no row when the task was canceled,
-- finished or claimed meanwhile.
-- Never claims a task that is not `waiting`, or that another row claimed: app_lock_id must be
-- empty, or already the lease's own row (Pulp's dispatch() marks an immediate task with the
-- dispatching process's row before asking to run it; ClaimTask then takes its locks).
-- The state is tested as an expression (`state || ''`), which no index serves: with statistics
-- taken before a backlog arrived, a generic plan picked Pulp's (state, pulp_created) index for
-- `state = 'waiting'` and read every waiting task (200 ms a claim at 1,000,000 blocked). The
-- primary key is then the only index that fits.
UPDATE core_task
SET app_lock_id = $2,
    pulp_last_updated = now(),
    state = CASE WHEN $3::boolean THEN 'running' ELSE state END,
    started_at = CASE WHEN $3::boolean THEN now() ELSE started_at END
WHERE pulp_id = $1 AND state || '' = 'waiting' AND (app_lock_id IS NULL OR app_lock_id = $2)
RETURNING CASE WHEN $3::boolean THEN started_at END AS started_at
