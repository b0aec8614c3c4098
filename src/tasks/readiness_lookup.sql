-- readiness_lookup.sql: the exact readiness look-up that candidates.sql and task.sql share, for
-- each row `p` (columns pulp_created, pulp_id, record) of the statement it is written into, in
-- place of its `-- $readiness_lookup` line. It joins the row's conflict keys (`k.keys`: `r` and
-- `shared:r` for each exclusive `r`, `r` for each shared `r`), the bound of the look-up against
-- the older tasks (`b.bound`) and the count of older incomplete tasks that conflict
-- (`c.older_conflicts`, the readiness rule's decision).
--
-- $near_created  timestamptz  the end of the queue's head (NULL: none): tasks at or before it
-- $near_id       uuid         have few incomplete tasks before them (the resource queues know)
-- $busy_entries  text[]       the record entries of busy queues (32 or more tasks carry each; long
-- $busy_users    int[]        ones among them) and, at the same index, how many tasks carry each
--                             (`tasks::Near`)
-- $long_queue    (a number)   how many tasks carry an entry of a long queue at least
-- (tasks.rs writes in the parameter numbers of the statement, candidates.sql's $4-$7, task.sql's
-- $2-$5, and ready::LONG_QUEUE.) Read under candidates_settings.sql: the ranges in queue order
-- rely on it.
CROSS JOIN LATERAL (
    SELECT ARRAY(
        SELECT CASE WHEN e LIKE 'shared:%' THEN substr(e, 8) ELSE e END FROM unnest(p.record) AS e
        UNION
        SELECT 'shared:' || e FROM unnest(p.record) AS e WHERE e NOT LIKE 'shared:%'
    ) AS keys
) k
CROSS JOIN LATERAL (
    -- How many older tasks the look-up against them may read: all of them for a task up to the
    -- end of the queue's head (NULL) whose conflict keys include an entry of a busy queue; for a
    -- task whose conflict keys include entries of long queues, as many as carry those entries
    -- (at least what the look-up against the users would read); none otherwise (-1). A task near
    -- the head with no busy queue's entry is looked up against its resources' users: fewer than
    -- 32 each, where the tasks older than it may be hundreds (the tasks running and those
    -- waiting behind them).
    SELECT CASE
    WHEN $near_created::timestamptz IS NOT NULL
         AND (p.pulp_created, p.pulp_id) <= ($near_created::timestamptz, $near_id::uuid)
         AND k.keys && $busy_entries::text[] THEN NULL::bigint
    ELSE coalesce((SELECT sum(l.users) FROM unnest($busy_entries::text[], $busy_users::int[]) AS l(entry, users)
                   WHERE l.entry = ANY (k.keys) AND l.users >= $long_queue), -1)
    END AS bound
) b
CROSS JOIN LATERAL (
    SELECT coalesce(
        CASE WHEN b.bound IS DISTINCT FROM -1 THEN (
            -- Against the older tasks: the incomplete tasks older than it, one range of Pulp's
            -- (state, pulp_created) index per incomplete state, each fenced (OFFSET 0) so that
            -- the overlap is checked on what they return and no plan reads the users of the
            -- task's resources instead. Each in queue order: under candidates_settings.sql (no
            -- full sorts) only that index serves it, where statistics from before a burst made
            -- Pulp's index on state alone look as cheap, and it read every waiting task for each
            -- row of the page (R0's next task, once its head finished:
            -- no_fetch_reads_the_queue_behind_its_head). Read up to the bound plus one: when
            -- there are more, the answer is NULL and the look-up against the users below
            -- decides, so it never reads more than twice what that one reads. For R0's next task
            -- past the end of the queue's head, that one would read R0's whole queue. Incomplete
            -- here is Pulp's three incomplete states, the same set as NOT IN the final ones for
            -- every state Pulp's models allow; a row in a state Pulp does not know would be
            -- counted by the form below only.
            SELECT CASE WHEN b.bound IS NULL OR count(*) <= b.bound THEN
                count(*) FILTER (WHERE o.record && k.keys
                                   AND (o.pulp_created, o.pulp_id) < (p.pulp_created, p.pulp_id))
            END
            FROM (
                (SELECT u.reserved_resources_record AS record, u.pulp_created, u.pulp_id
                 FROM core_task u WHERE u.state = 'waiting' AND u.pulp_created <= p.pulp_created
                 ORDER BY u.pulp_created OFFSET 0)
                UNION ALL
                (SELECT u.reserved_resources_record, u.pulp_created, u.pulp_id
                 FROM core_task u WHERE u.state = 'running' AND u.pulp_created <= p.pulp_created
                 ORDER BY u.pulp_created OFFSET 0)
                UNION ALL
                (SELECT u.reserved_resources_record, u.pulp_created, u.pulp_id
                 FROM core_task u WHERE u.state = 'canceling' AND u.pulp_created <= p.pulp_created
                 ORDER BY u.pulp_created OFFSET 0)
                LIMIT b.bound + 1
            ) AS o)
        END,
        (
        -- Against its resources' users: one positive look-up in the partial GIN index, fenced
        -- from the time comparison (OFFSET 0): a generic plan would AND it with Pulp's plain
        -- pulp_created index and read every older task (tests/it/pulp_schema.rs checks the pages
        -- it reads).
        SELECT count(*)
        FROM (
            SELECT u.pulp_created, u.pulp_id
            FROM core_task u
            WHERE u.state NOT IN ($final_states)
              AND u.reserved_resources_record && k.keys
            OFFSET 0
        ) AS m
        WHERE (m.pulp_created, m.pulp_id) < (p.pulp_created, p.pulp_id))
    ) AS older_conflicts
) c
