-- lanes_gone.sql: which of the tasks the lane count depends on are no longer incomplete
-- (finished, canceled, canceling or deleted since the last pass).
--
-- $1 uuid[]  the tasks the counter tracks (ready::LaneCounter::tracked_ids)
-- Returns: pulp_id of each that is not waiting or running now. One primary-key probe per task.
-- Never writes.
SELECT id
FROM unnest($1::uuid[]) AS id
WHERE NOT EXISTS (
    SELECT 1 FROM core_task t WHERE t.pulp_id = id AND t.state IN ('waiting', 'running')
)
