-- app_status_exists.sql: whether a core_appstatus row exists.
-- $1 uuid  pulp_id.  Returns one row when it does.
SELECT 1 FROM core_appstatus WHERE pulp_id = $1
