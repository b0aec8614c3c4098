-- heartbeat.sql: refreshes the workers' core_appstatus.last_heartbeat, for every lease that beat
-- since the last write, in one statement (src/leases/beats.rs; the tasks a worker must cancel
-- come from canceling.sql, read once per second per replica for all heartbeats).
--
-- $1 uuid[]  the leases' core_appstatus rows
-- Writes: those rows. Returns: the ids of the rows written (a row that is not returned was
-- deleted outside the broker, and its leases are ended).
UPDATE core_appstatus SET last_heartbeat = now(), pulp_last_updated = now()
WHERE pulp_id = ANY($1::uuid[])
RETURNING pulp_id
