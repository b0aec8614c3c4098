-- finished_among.sql: which of these tasks are final, or gone: their locks serve no one.
-- $1 uuid[]  locked task ids.  Returns the ids whose task is final or does not exist.
SELECT l.id
FROM unnest($1::uuid[]) AS l(id)
LEFT JOIN core_task t ON t.pulp_id = l.id
WHERE t.pulp_id IS NULL OR t.state IN ('completed', 'failed', 'canceled', 'skipped')
