-- hiding.sql: among the held entries a scan skipped by (candidates.sql reports them), the
-- resource names that hide at least one waiting, unclaimed task older than a position. A scan
-- hint that starts at that position must be dropped when any of these names changes; a held
-- task that finished meanwhile still counts, so its release drops the hint.
--
-- $1 timestamptz, $2 uuid  the position (pulp_created, pulp_id);  $3 text[]  the held entries
-- Returns: name (without the shared: prefix).
-- Never writes. Each look-up is a positive overlap, counted so that the planner uses the GIN
-- index (an EXISTS would make it scan the table).
WITH named AS (
    SELECT CASE WHEN entry LIKE 'shared:%' THEN substr(entry, 8) ELSE entry END AS name,
           CASE WHEN entry LIKE 'shared:%' THEN ARRAY[substr(entry, 8)]
                ELSE ARRAY[entry, 'shared:' || entry] END AS keys
    FROM unnest($3::text[]) AS entry
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
