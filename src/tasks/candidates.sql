-- candidates.sql: one page of waiting, unclaimed tasks in queue order, each with the exact
-- readiness look-up against older incomplete tasks (readiness_lookup.sql, which tasks.rs writes
-- in at `-- $readiness_lookup`).
--
-- $1 text[]       extra record entries whose tasks are known not to be ready in this fetch (the
--                 conflict keys of tasks already found unready or blocked); tasks overlapping them
--                 are skipped, which is safe because such a task is not ready either
-- $2 timestamptz  keyset: only tasks after ($2, $3) in (pulp_created, pulp_id) order; NULL for
-- $3 uuid         the first page
-- $4 timestamptz  the end of the queue's head (NULL: none): tasks at or before ($4, $5) have few
-- $5 uuid         incomplete tasks before them (the resource queues know), so the exact look-up
--                 of one with a busy queue's entry among its conflict keys reads those instead
--                 of every user of its resources (R0's next task, once its head finished, would
--                 read R0's whole queue)
-- $6 text[]       the record entries of busy queues (the resource queues know: `NAME` for
-- $7 int[]        exclusive users, `shared:NAME` for shared ones; long ones among them) and, at
--                 the same index, how many tasks carry each: a task whose conflict keys include
--                 a long queue's is looked up against the incomplete tasks older than it as long
--                 as they are no more than that many
-- $scope, $only, $scanned  (lines) nothing for a pass in queue order. For a directed pass (fair
--                 dispatch, src/dispatch/fairness.rs; tasks.rs writes them): a CTE `scope`, read
--                 in place of `core_task t`, of one group's ($8 uuid, dispatch_groups_idx or
--                 dispatch_task_groups_idx) or the immediate tasks' (dispatch_immediate_idx) first
--                 waiting tasks, at most $scan read and the page's rows kept (those the page would
--                 skip left out), then for each group of $9 uuid[] (read ahead for the next passes)
--                 at most a quarter of that; so a directed page reads a bounded number of rows
--                 however long any queue is. The closing row's `scanned` is a JSON object: for each
--                 group with a row kept (the immediate tasks: the nil id), how many rows its scan
--                 read. The page's tail (the whole queue's) is not computed.
-- $page_size      the page size (the LIMIT), written into the text as a number by tasks.rs
--                 (one prepared statement per page size): the broker's sessions use generic
--                 plans, and a generic plan with a parameter LIMIT guesses a tenth of the table
--                 and sorts it
-- Returns: the page's tasks in queue order (pulp_id, pulp_created, name, record, versions (JSON
--          text), immediate, older_conflicts, ..., domain (pulp_domain_id), task_group
--          (task_group_id)), then one closing row whose pulp_id is NULL and
--          which holds the held entries this page skipped by (held_entries) and, when the page is
--          not full, the tail: every waiting task created up to it, now or committed later, was
--          returned or skipped (for the scan hint); and, for a directed page, `scanned`
--
-- Tasks overlapping the conflict keys of claimed or running tasks are skipped in SQL too, so a
-- resource whose head task runs does not make every fetch read its queue. The skip is only a
-- shortcut: `older_conflicts` (the positive overlap with C(T), counted so that the planner uses
-- the partial GIN index `pulp_task_resources_index`) is the decision, and it sees hidden tasks.
-- Never writes.
, -- (after held.sql's `held` and writers.sql's `writers` CTEs, which tasks.rs puts in front)
excluded AS (
    SELECT coalesce(array_agg(DISTINCT k), '{}'::text[]) AS keys
    FROM (
        SELECT CASE WHEN entry LIKE 'shared:%' THEN substr(entry, 8) ELSE entry END AS k FROM held
        UNION ALL
        SELECT 'shared:' || entry FROM held WHERE entry NOT LIKE 'shared:%'
        UNION ALL
        SELECT unnest($1::text[])
    ) AS x
),
-- $scope
page AS (
    SELECT t.pulp_id, t.pulp_created, t.name,
           coalesce(t.reserved_resources_record, '{}'::text[]) AS record,
           t.versions, t.immediate, t.pulp_domain_id, t.task_group_id
    FROM core_task t
    -- $only
    WHERE t.state = 'waiting'
      -- Unclaimed, written so that no index serves it: a generic plan otherwise ANDs a bitmap of
      -- Pulp's app_lock_id index, every unclaimed task (the whole backlog), with the range below.
      -- And as a boolean test, which the planner takes to hold for half the rows: written as an
      -- equality (default: 0.5% of rows) it made the generic plan read every waiting task after
      -- the position through a bitmap and sort them, rather than walk the index in order, which
      -- costs the whole queue when a pass starts at its head (R0's next task, once its head
      -- finished: 591 pages at 20,000 blocked; tests/it/hol_blocking.rs).
      AND (t.app_lock_id IS NULL) IS TRUE
      AND NOT (coalesce(t.reserved_resources_record, '{}'::text[]) && (SELECT keys FROM excluded))
      -- The bound alone too: a plain comparison every index on pulp_created can start at
      -- (Pulp's (state, pulp_created) after state; the row comparison below it only filters).
      -- Without it a generic plan may read every waiting task from the queue's head and sort.
      AND t.pulp_created >= coalesce($2::timestamptz, '-infinity')
      AND (t.pulp_created, t.pulp_id) > (coalesce($2::timestamptz, '-infinity'),
                                         coalesce($3::uuid, '00000000-0000-0000-0000-000000000000'))
    ORDER BY t.pulp_created, t.pulp_id
    LIMIT $page_size
)
SELECT p.pulp_id, p.pulp_created, p.name, p.record,
       hstore_to_json(p.versions)::text AS versions,
       coalesce(p.immediate, false) AS immediate,
       c.older_conflicts,
       NULL::text[] AS held_entries, NULL::timestamptz AS tail, p.pulp_domain_id AS domain,
       p.task_group_id AS task_group, NULL::json AS scanned
FROM page p
-- $readiness_lookup
UNION ALL
-- The closing row. The tail is one step of the (state, pulp_created) index, from its end.
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       (SELECT coalesce(array_agg(entry), '{}'::text[]) FROM held),
       -- The tail, when the page is not full: the newest waiting task, but no later than the
       -- start of any open writer of core_task when this row is computed (writers.sql); none
       -- when a writer's start cannot be read. A writer that commits while the page is read is
       -- missed: its task waits for the next walk at most.
       CASE WHEN (SELECT count(*) FROM page) < $page_size THEN (
           SELECT CASE WHEN bool_or(w.xact_start IS NULL) THEN NULL
                       ELSE least((SELECT max(t.pulp_created) FROM core_task t
                                   WHERE t.state = 'waiting'),
                                  min(w.xact_start)) END
           FROM writers w)
       END,
       NULL, NULL,
       NULL::json -- $scanned
-- (The closing row last: NULLS LAST is the default of an ascending order.)
ORDER BY 2, 1
