-- groups_waiting.sql: the groups that have waiting tasks, each with its oldest waiting task, and
-- whether any immediate task waits: fair dispatch's directory (src/dispatch/fairness.rs).
--
-- $group   the group's expression, written in by tasks.rs: `t.pulp_domain_id` (--fair-by domain,
--          dispatch_groups_idx) or `coalesce(t.task_group_id, <nil uuid>)` (--fair-by
--          task-group, dispatch_task_groups_idx)
-- $1 bigint  at most this many groups
-- Returns: the group, pulp_created, pulp_id of each group's oldest waiting task, in group order;
--          then one closing row whose group is NULL and whose pulp_id is non-NULL when an
--          immediate task waits
--
-- A skip scan of the group's index: one index descent per group, so it costs the number of
-- groups, never the number of waiting tasks (a GROUP BY would read every waiting task).
-- Never writes.
WITH RECURSIVE groups AS (
    (SELECT $group AS grp, t.pulp_created, t.pulp_id
     FROM core_task t
     WHERE t.state = 'waiting'
     ORDER BY $group, t.pulp_created, t.pulp_id
     LIMIT 1)
    UNION ALL
    SELECT n.grp, n.pulp_created, n.pulp_id
    FROM groups g
    CROSS JOIN LATERAL (
        SELECT $group AS grp, t.pulp_created, t.pulp_id
        FROM core_task t
        WHERE t.state = 'waiting' AND $group > g.grp
        ORDER BY $group, t.pulp_created, t.pulp_id
        LIMIT 1
    ) n
)
SELECT grp, pulp_created, pulp_id FROM (SELECT * FROM groups LIMIT $1) g
UNION ALL
SELECT NULL, NULL, (SELECT t.pulp_id FROM core_task t WHERE t.state = 'waiting' AND t.immediate
                    ORDER BY t.pulp_created, t.pulp_id LIMIT 1)
