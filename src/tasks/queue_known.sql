-- queue_known.sql: up to when a read of the queue that starts after this statement sees every
-- incomplete task: the start of the oldest open writer of core_task (Pulp's insert trigger
-- stamps pulp_created inside the inserting transaction, so a writer still open may commit tasks
-- created after its start, never before), or this statement's start when none is open. Asked
-- before the read.
--
-- The statement's start, not the clock when the row is computed: a transaction that takes its
-- lock on core_task after pg_locks was read here is not among the writers, and stamps its task
-- after taking that lock, so after the statement's start, but it may stamp it before a later
-- clock reading, and commit after the read that follows. The queues would then say they know a
-- task they never read (a ready task no pass starting where they say would reach until the next
-- load; tests/it/readiness_prop.rs found it).
--
-- Returns: one timestamptz; NULL when a writer's start cannot be read (a prepared transaction,
-- or a session of a role this one may not see): the read then says nothing about completeness.
-- Never writes.
-- (after writers.sql's `writers` CTE, which tasks.rs puts in front)
SELECT CASE WHEN bool_or(w.xact_start IS NULL) THEN NULL
            ELSE least(min(w.xact_start), statement_timestamp()) END
FROM writers w
