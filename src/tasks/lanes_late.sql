-- lanes_late.sql: whether a task could still appear behind the position a lane pass counts up
-- to: a transaction that has written to core_task (a RowExclusiveLock on it) has been open for
-- longer than four fifths of the cut-off (a margin: Pulp stamps pulp_created before its INSERT), so
-- it may have inserted a task created before the cut-off that commits after this pass; or such a
-- writer's start cannot be read (a prepared transaction, or a session of a role this one may not
-- see). The next pass then reads the whole queue. Asked before the pass reads any task: a
-- transaction that inserts after this look-up stamps its task after the cut-off.
--
-- $1 double precision  the cut-off in seconds
-- Returns: one boolean.
-- Never writes.
-- (after writers.sql's `writers` CTE, which tasks.rs puts in front)
SELECT EXISTS (
    SELECT 1
    FROM writers w
    WHERE w.xact_start IS NULL
       OR w.xact_start < now() - make_interval(secs => $1::double precision * 0.8)
)
