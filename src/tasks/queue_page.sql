-- queue_page.sql: the next incomplete tasks after a position, in queue order, with their
-- records: how the resource queues (ready::ResourceQueues) are loaded and kept up with
-- arrivals. Incomplete as the exact look-up counts it (canceling included).
--
-- $1 timestamptz, $2 uuid  only tasks after this position (both NULL: from the queue's head)
-- Returns: reserved_resources_record (NULL for none), pulp_id, pulp_created per task; at most
-- 5000 (a literal: the generic plan is then an ordered range scan of an index on pulp_created).
-- Never writes.
SELECT reserved_resources_record, pulp_id, pulp_created
FROM core_task
WHERE state NOT IN ('completed', 'failed', 'canceled', 'skipped')
  -- The bound alone too: a plain comparison every index on pulp_created can start at.
  AND pulp_created >= coalesce($1::timestamptz, '-infinity')
  AND (pulp_created, pulp_id) > (coalesce($1::timestamptz, '-infinity'),
                                 coalesce($2::uuid, '00000000-0000-0000-0000-000000000000'))
ORDER BY pulp_created, pulp_id
LIMIT 5000
