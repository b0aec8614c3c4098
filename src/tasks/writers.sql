-- writers.sql: the `writers` CTE that tasks.rs puts in front of candidates.sql and
-- lanes_late.sql: the transaction start (xact_start) of every other session that has written to
-- core_task (a RowExclusiveLock on it) and is still open; NULL when that start cannot be read (a
-- prepared transaction, or a session of a role this one may not see). Pulp's insert trigger
-- stamps pulp_created inside the inserting transaction, so such a writer may still commit tasks
-- created after its start. Kept apart so "open writer" has one definition. Not a statement on its
-- own.
writers AS (
    SELECT a.xact_start
    FROM pg_locks l
    LEFT JOIN pg_stat_activity a ON a.pid = l.pid
    WHERE l.locktype = 'relation'
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND l.relation = 'core_task'::regclass
      AND l.mode = 'RowExclusiveLock'
      AND l.pid IS DISTINCT FROM pg_backend_pid()
)
