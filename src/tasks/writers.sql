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
      -- A session pg_stat_activity shows outside a transaction (no xact_start, though its state
      -- is readable: idle, or just ending a statement) or no longer shows is no writer: either
      -- it ended the transaction pg_locks saw, so what it committed is visible to a read that
      -- starts after this statement, or it began one after this statement began, so it stamps
      -- its tasks later than the statement's start. (Counted as a start that cannot be read,
      -- such sessions made about one read in three beside a stream of claims answer "cannot
      -- tell", and a resource queues' load that met one knew nothing for a minute.) A session
      -- whose state this role may not read (NULL) still counts, as does every session when
      -- activity is not tracked (track_activities off: state 'disabled', xact_start always
      -- NULL), and every session when the server allows prepared transactions (PREPARE
      -- TRANSACTION hands the locks to a dummy entry, then clears xact_start: a session seen
      -- between the two may commit much later). candidates.sql reads in the same statement,
      -- not after: an excluded writer is one that commits while its page is read (see the note
      -- on its tail). pg_stat_activity is read once per transaction: a statement with this CTE
      -- must be its transaction's first read of it.
      AND NOT (l.pid IS NOT NULL
               AND current_setting('max_prepared_transactions')::int = 0
               AND (a.pid IS NULL
                    OR (a.state IS NOT NULL AND a.state <> 'disabled' AND a.xact_start IS NULL)))
)
