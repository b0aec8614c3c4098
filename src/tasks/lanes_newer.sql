-- lanes_newer.sql: the records of incomplete tasks older than the cut-off and newer than the last
-- task a lane counter saw, in queue order: the arrivals a maintained pass of the gauge counts.
--
-- $1 double precision  the cut-off in seconds (tasks younger than this are not counted yet)
-- $2 timestamptz, $3 uuid  the counter's last task (pulp_created, pulp_id)
-- Returns: reserved_resources_record (NULL for none), pulp_id, pulp_created, pulp_domain_id,
-- immediate, task_group_id (what the caps and the reserve ask of a lane) per task, ordered
-- by (pulp_created, pulp_id) (an index range from the position; few rows to sort at most).
-- Never writes.
SELECT reserved_resources_record, pulp_id, pulp_created, pulp_domain_id, coalesce(immediate, false),
       task_group_id
FROM core_task
WHERE state IN ('waiting', 'running')
  AND pulp_created < now() - make_interval(secs => $1)
  AND pulp_created >= $2::timestamptz
  AND (pulp_created, pulp_id) > ($2::timestamptz, $3::uuid)
ORDER BY pulp_created, pulp_id
