-- lock_targets.sql: for locked task ids, which locks serve no one: the task is final or gone, or
-- it is waiting and unclaimed (a grant that was never completed).
-- $1 uuid[]  locked task ids.
-- Returns: id, and 'final' (final or deleted) or 'unclaimed'; ids whose lock is in use are left out.
SELECT l.id, CASE WHEN t.pulp_id IS NULL OR t.state IN ($final_states)
                  THEN 'final' ELSE 'unclaimed' END
FROM unnest($1::uuid[]) AS l(id)
LEFT JOIN core_task t ON t.pulp_id = l.id
WHERE t.pulp_id IS NULL
   OR t.state IN ($final_states)
   OR (t.state = 'waiting' AND t.app_lock_id IS NULL)
