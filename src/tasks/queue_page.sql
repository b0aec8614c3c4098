-- queue_page.sql: the next incomplete tasks after a position, in queue order, with their
-- records: how the resource queues (ready::ResourceQueues) are loaded and kept up with
-- arrivals. Incomplete as the exact look-up counts it (canceling included).
--
-- $1 timestamptz, $2 uuid  only tasks after this position (both NULL: from the queue's head)
-- Returns: reserved_resources_record (NULL for none), pulp_id, pulp_created per task; at most
-- 5000 (a literal, so that the generic plan is known).
-- Never writes.
--
-- One ordered range per incomplete state, merged: each is a range of Pulp's (state,
-- pulp_created) index from the position, so a page reads about as many rows as it returns,
-- whatever lies before the position (a single `state NOT IN (...)` range reads every task after
-- it, completed ones included, or sorts them; tests/it/pulp_schema.rs checks the pages it reads).
-- Read under queue_page_settings.sql (no bitmaps, no full sorts): with statistics from
-- before a burst the generic plan otherwise bitmapped the state index and sorted every task after
-- the position, for every page (a_queue_page_reads_a_page_not_the_backlog).
-- Written out per state (as candidates.sql's look-up near the head is): one branch joined
-- laterally to a list of the states read 450 pages at 20,000 blocked without Pulp's plain
-- pulp_created index, against 28 at 1,000.
SELECT reserved_resources_record, pulp_id, pulp_created
FROM (
    (SELECT reserved_resources_record, pulp_id, pulp_created FROM core_task
     WHERE state = 'waiting'
       AND pulp_created >= coalesce($1::timestamptz, '-infinity')
       AND (pulp_created, pulp_id) > (coalesce($1::timestamptz, '-infinity'),
                                      coalesce($2::uuid, '00000000-0000-0000-0000-000000000000'))
     ORDER BY pulp_created, pulp_id LIMIT 5000)
    UNION ALL
    (SELECT reserved_resources_record, pulp_id, pulp_created FROM core_task
     WHERE state = 'running'
       AND pulp_created >= coalesce($1::timestamptz, '-infinity')
       AND (pulp_created, pulp_id) > (coalesce($1::timestamptz, '-infinity'),
                                      coalesce($2::uuid, '00000000-0000-0000-0000-000000000000'))
     ORDER BY pulp_created, pulp_id LIMIT 5000)
    UNION ALL
    (SELECT reserved_resources_record, pulp_id, pulp_created FROM core_task
     WHERE state = 'canceling'
       AND pulp_created >= coalesce($1::timestamptz, '-infinity')
       AND (pulp_created, pulp_id) > (coalesce($1::timestamptz, '-infinity'),
                                      coalesce($2::uuid, '00000000-0000-0000-0000-000000000000'))
     ORDER BY pulp_created, pulp_id LIMIT 5000)
) AS incomplete
ORDER BY pulp_created, pulp_id
LIMIT 5000
