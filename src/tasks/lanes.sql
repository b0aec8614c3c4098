-- lanes.sql: the records of incomplete tasks older than the cut-off, in queue order, streamed to
-- ready::LaneCounter (memory grows with distinct resources and lanes, never with tasks): the
-- lane gauge's full pass.
--
-- $1 double precision  the cut-off in seconds (tasks younger than this are not counted yet)
-- Returns: reserved_resources_record (NULL for none), pulp_id, pulp_created, pulp_domain_id,
-- immediate, task_group_id (what the caps and the reserve ask of a lane), and whether it is
-- waiting (the waiting tasks by group the pass counts) per task, ordered by (pulp_created,
-- pulp_id); with dispatch_lanes_idx (lanes_index.sql) an ordered index scan
-- of incomplete tasks, no sort. (A lower bound on the position, as lanes_newer.sql has, would
-- make the generic plan sort the whole queue.)
-- Never writes.
SELECT reserved_resources_record, pulp_id, pulp_created, pulp_domain_id, coalesce(immediate, false),
       task_group_id, state = 'waiting'
FROM core_task
WHERE state IN ('waiting', 'running') AND pulp_created < now() - make_interval(secs => $1)
ORDER BY pulp_created, pulp_id
