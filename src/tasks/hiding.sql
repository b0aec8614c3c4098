-- hiding.sql: the resource names of claimed or running tasks that hide at least one waiting,
-- unclaimed task older than a position from candidates.sql (it skips tasks overlapping them). A
-- scan hint that starts at that position must be dropped when any of these names changes.
--
-- $1 timestamptz, $2 uuid  the position (pulp_created, pulp_id)
-- Returns: name (without the shared: prefix).
-- Never writes. Each look-up is a positive overlap, counted so that the planner uses the GIN
-- index (an EXISTS would make it scan the table).
, -- (after held.sql's `held` CTE, which tasks.rs puts in front)
named AS (
    SELECT CASE WHEN entry LIKE 'shared:%' THEN substr(entry, 8) ELSE entry END AS name,
           CASE WHEN entry LIKE 'shared:%' THEN ARRAY[substr(entry, 8)]
                ELSE ARRAY[entry, 'shared:' || entry] END AS keys
    FROM held
)
SELECT DISTINCT n.name
FROM named n
CROSS JOIN LATERAL (
    SELECT count(*) AS hidden
    FROM core_task t
    WHERE t.state NOT IN ('completed', 'failed', 'canceled', 'skipped')
      AND t.reserved_resources_record && n.keys
      AND t.state = 'waiting' AND t.app_lock_id IS NULL
      AND (t.pulp_created, t.pulp_id) < ($1::timestamptz, $2::uuid)
) c
WHERE c.hidden > 0
