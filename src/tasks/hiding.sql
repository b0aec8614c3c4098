-- hiding.sql: among the held entries a scan skipped by (candidates.sql reports them), the
-- resource names that hide at least one waiting, unclaimed task older than a position. A scan
-- hint that starts at that position must be dropped when any of these names changes; a held
-- task that finished meanwhile still counts, so its release drops the hint.
--
-- $1 timestamptz, $2 uuid  the position (pulp_created, pulp_id);  $3 text[]  the held entries
-- Returns: name (without the shared: prefix).
-- Never writes.
--
-- One look-up per name in the partial GIN index. Only the GIN match is inside the fence
-- (OFFSET 0): a generic plan then reads that match and nothing else, never a bitmap of Pulp's
-- plain indexes on state, app_lock_id or pulp_created (every older task), whatever the planner
-- guesses; the rest is checked on what the match returns (tests/it/pulp_schema.rs checks the pages
-- it reads). Counted, so that the planner uses the index (an EXISTS would make it scan the
-- table). Its cost is the number of incomplete tasks using the name.
WITH named AS (
    SELECT CASE WHEN entry LIKE 'shared:%' THEN substr(entry, 8) ELSE entry END AS name,
           CASE WHEN entry LIKE 'shared:%' THEN ARRAY[substr(entry, 8)]
                ELSE ARRAY[entry, 'shared:' || entry] END AS keys
    FROM unnest($3::text[]) AS entry
)
SELECT DISTINCT n.name
FROM named n
WHERE (SELECT count(*)
       FROM (
           SELECT t.pulp_created, t.pulp_id, t.state, t.app_lock_id
           FROM core_task t
           WHERE t.state NOT IN ($final_states)
             AND t.reserved_resources_record && n.keys
           OFFSET 0
       ) AS m
       WHERE m.state = 'waiting' AND m.app_lock_id IS NULL
         AND (m.pulp_created, m.pulp_id) < ($1::timestamptz, $2::uuid)) > 0
