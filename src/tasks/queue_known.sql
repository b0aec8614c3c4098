-- queue_known.sql: up to when a read of the queue that starts after this statement sees every
-- incomplete task: the start of the oldest open writer of core_task (Pulp's insert trigger
-- stamps pulp_created inside the inserting transaction, so a writer still open may commit tasks
-- created after its start, never before), or now when none is open. Asked before the read.
--
-- Returns: one timestamptz; NULL when a writer's start cannot be read (a prepared transaction,
-- or a session of a role this one may not see): the read then says nothing about completeness.
-- Never writes.
-- (after writers.sql's `writers` CTE, which tasks.rs puts in front)
SELECT CASE WHEN bool_or(w.xact_start IS NULL) THEN NULL
            ELSE least(min(w.xact_start), clock_timestamp()) END
FROM writers w
