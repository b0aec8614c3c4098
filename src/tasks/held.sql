-- held.sql: the `held` CTE that tasks.rs puts in front of candidates.sql: the record entries of
-- every claimed incomplete task and every running task (claimed or not: Pulp's API runs immediate
-- tasks itself). Not a canceling task nobody claimed: Pulp canceled it while it waited, it holds
-- nothing, and the sweeper finishes it; tasks behind it are judged by the exact look-up instead
-- (and reserved by a scan hint, which its finishing then drops). Kept apart so the notion of
-- "held" has one definition. Not a statement on its own.
WITH held AS (
    SELECT DISTINCT entry
    FROM (
        SELECT reserved_resources_record AS record FROM core_task
        WHERE app_lock_id IS NOT NULL
          AND state NOT IN ($final_states)
        UNION ALL
        SELECT reserved_resources_record FROM core_task WHERE state = 'running'
    ) AS h, unnest(h.record) AS entry
)
