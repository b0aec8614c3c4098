-- held.sql: a fragment put in front of candidates.sql and hiding.sql (tasks.rs), so both use the
-- same notion of "held": the record entries of every claimed incomplete task and every running
-- or canceling task. Not a statement on its own.
WITH held AS (
    SELECT DISTINCT entry
    FROM (
        SELECT reserved_resources_record AS record FROM core_task
        WHERE app_lock_id IS NOT NULL
          AND state NOT IN ('completed', 'failed', 'canceled', 'skipped')
        UNION ALL
        SELECT reserved_resources_record FROM core_task WHERE state IN ('running', 'canceling')
    ) AS h, unnest(h.record) AS entry
)
