-- heartbeat.sql: refreshes a worker's core_appstatus.last_heartbeat (the tasks it must cancel come
-- from canceling.sql, read once per second per replica for all heartbeats).
--
-- $1 uuid  the lease's core_appstatus row
-- Writes: that row.
UPDATE core_appstatus SET last_heartbeat = now(), pulp_last_updated = now()
WHERE pulp_id = $1
