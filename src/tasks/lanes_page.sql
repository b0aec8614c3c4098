-- lanes_page.sql: the next incomplete tasks after a position, in queue order, up to another: how
-- a repair walks the queue for resources that many tasks need (their next user is near, where a
-- look-up by name would read every one of them).
--
-- $1 timestamptz, $2 uuid  only tasks after this position
-- $3 timestamptz, $4 uuid  and not after this one (the last task the counter saw)
-- Returns: reserved_resources_record, pulp_id, pulp_created, pulp_domain_id, immediate,
-- task_group_id per task;
-- at most 512 (a literal, so the generic plan is the ordered range scan of dispatch_lanes_idx).
-- Never writes.
SELECT reserved_resources_record, pulp_id, pulp_created, pulp_domain_id, coalesce(immediate, false),
       task_group_id
FROM core_task
WHERE state IN ('waiting', 'running')
  AND (pulp_created, pulp_id) > ($1::timestamptz, $2::uuid)
  AND (pulp_created, pulp_id) <= ($3::timestamptz, $4::uuid)
ORDER BY pulp_created, pulp_id
LIMIT 512
