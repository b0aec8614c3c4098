-- hiding.sql: among the held entries a scan skipped by (candidates.sql reports them), the
-- resource names that hide at least one waiting, unclaimed task older than a position. A scan
-- hint that starts at that position must be dropped when any of these names changes; a held
-- task that finished meanwhile still counts, so its release drops the hint.
--
-- $1 timestamptz, $2 uuid  the position (pulp_created, pulp_id);  $3 text[]  the held entries
-- Returns: name (without the shared: prefix).
-- Never writes.
--
-- Two ways, chosen by the queue in front of the position. When fewer than 64 waiting, unclaimed
-- tasks are older (a busy queue whose hint sits near its head), those tasks are read in queue
-- order (`core_task_state_pulp_created_idx`, bounded by the position) and matched in memory: one
-- short index range instead of a GIN look-up per held name (with 32 workers, 32 look-ups per
-- call). Otherwise (a blocked head of thousands) each name is looked up in the partial GIN index,
-- counted so that the planner uses it (an EXISTS would make it scan the table). CASE evaluates
-- only the branch it takes.
WITH named AS (
    SELECT CASE WHEN entry LIKE 'shared:%' THEN substr(entry, 8) ELSE entry END AS name,
           CASE WHEN entry LIKE 'shared:%' THEN ARRAY[substr(entry, 8)]
                ELSE ARRAY[entry, 'shared:' || entry] END AS keys
    FROM unnest($3::text[]) AS entry
),
older AS MATERIALIZED (
    SELECT coalesce(t.reserved_resources_record, '{}'::text[]) AS record
    FROM core_task t
    WHERE t.state = 'waiting'
      AND t.pulp_created <= $1::timestamptz
      AND (t.pulp_created, t.pulp_id) < ($1::timestamptz, $2::uuid)
      AND t.app_lock_id IS NULL
    ORDER BY t.state, t.pulp_created
    LIMIT 64
),
few AS MATERIALIZED (
    SELECT count(*) < 64 AS yes FROM older
)
SELECT DISTINCT n.name
FROM named n
WHERE CASE
    WHEN (SELECT yes FROM few) THEN
        EXISTS (SELECT 1 FROM older o WHERE o.record && n.keys)
    ELSE
        -- Fenced (OFFSET 0) from the position, so a generic plan reads the GIN match only and
        -- never ANDs it with Pulp's plain pulp_created index (every older task).
        (SELECT count(*)
         FROM (
             SELECT t.pulp_created, t.pulp_id
             FROM core_task t
             WHERE t.state NOT IN ('completed', 'failed', 'canceled', 'skipped')
               AND t.reserved_resources_record && n.keys
               AND t.state = 'waiting' AND t.app_lock_id IS NULL
             OFFSET 0
         ) AS m
         WHERE (m.pulp_created, m.pulp_id) < ($1::timestamptz, $2::uuid)) > 0
END
