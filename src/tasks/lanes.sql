-- lanes.sql: the records of incomplete tasks older than the cut-off, in queue order, streamed to
-- ready::LaneCounter (memory grows with distinct resources, never with tasks).
--
-- $1 double precision  the cut-off in seconds (tasks younger than this are not counted yet)
-- Returns: reserved_resources_record (NULL for none) and pulp_id per task (the survey of blocked
-- resources names each queue's head), ordered by (pulp_created, pulp_id);
-- with dispatch_lanes_idx (lanes_index.sql) an ordered index scan of incomplete tasks, no sort.
-- Never writes.
SELECT reserved_resources_record, pulp_id
FROM core_task
WHERE state IN ('waiting', 'running') AND pulp_created < now() - make_interval(secs => $1)
ORDER BY pulp_created, pulp_id
