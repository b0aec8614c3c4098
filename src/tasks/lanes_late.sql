-- lanes_late.sql: whether a task could still appear behind the position a lane pass counts up
-- to: another session has had a writing transaction open for longer than the cut-off (it may
-- have inserted a task created before the cut-off and commit after this pass; a transaction
-- that inserts later creates its task later), or a session this role may not see is busy. The
-- next pass then reads the whole queue.
--
-- $1 double precision  the cut-off in seconds
-- Returns: one boolean.
-- Never writes.
SELECT EXISTS (
    SELECT 1
    FROM pg_stat_activity
    WHERE datname = current_database()
      AND pid <> pg_backend_pid()
      AND backend_type = 'client backend'
      AND ((backend_xid IS NOT NULL AND xact_start < now() - make_interval(secs => $1))
           OR (xact_start IS NULL AND state IS NULL))
)
