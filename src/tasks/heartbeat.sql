-- heartbeat.sql: refreshes a worker's core_appstatus.last_heartbeat and lists the tasks it holds
-- that were asked to cancel.
--
-- $1 uuid  the lease's core_appstatus row
-- Returns: pulp_id of every `canceling` task claimed by that row.
WITH beat AS (
    UPDATE core_appstatus SET last_heartbeat = now(), pulp_last_updated = now()
    WHERE pulp_id = $1
    RETURNING pulp_id
)
SELECT pulp_id FROM core_task WHERE app_lock_id = $1 AND state = 'canceling'
