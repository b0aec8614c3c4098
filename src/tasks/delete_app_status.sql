-- delete_app_status.sql: removes a worker's core_appstatus row. Every core_task reference to it is
-- cleared in the same statement, because pulpcore's foreign key has no ON DELETE action in the
-- database (Django emulates SET_NULL) and is checked at commit.
-- $1 uuid  the row.
WITH cleared AS (
    UPDATE core_task SET app_lock_id = NULL WHERE app_lock_id = $1 RETURNING pulp_id
)
DELETE FROM core_appstatus WHERE pulp_id = $1
