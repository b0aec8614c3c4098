-- groups_waiting.sql: the groups (domains) that have waiting tasks, each with its oldest waiting
-- task, and whether any immediate task waits: fair dispatch's directory (src/dispatch/fairness.rs).
--
-- $1 bigint  at most this many groups
-- Returns: pulp_domain_id, pulp_created, pulp_id of each group's oldest waiting task, in group
--          order; then one closing row whose pulp_domain_id is NULL and whose pulp_id is non-NULL
--          when an immediate task waits
--
-- A skip scan of dispatch_groups_idx: one index descent per group, so it costs the number of
-- groups, never the number of waiting tasks (a GROUP BY would read every waiting task).
-- Never writes.
WITH RECURSIVE groups AS (
    (SELECT t.pulp_domain_id, t.pulp_created, t.pulp_id
     FROM core_task t
     WHERE t.state = 'waiting'
     ORDER BY t.pulp_domain_id, t.pulp_created, t.pulp_id
     LIMIT 1)
    UNION ALL
    SELECT n.pulp_domain_id, n.pulp_created, n.pulp_id
    FROM groups g
    CROSS JOIN LATERAL (
        SELECT t.pulp_domain_id, t.pulp_created, t.pulp_id
        FROM core_task t
        WHERE t.state = 'waiting' AND t.pulp_domain_id > g.pulp_domain_id
        ORDER BY t.pulp_domain_id, t.pulp_created, t.pulp_id
        LIMIT 1
    ) n
)
SELECT pulp_domain_id, pulp_created, pulp_id FROM (SELECT * FROM groups LIMIT $1) g
UNION ALL
SELECT NULL, NULL, (SELECT t.pulp_id FROM core_task t WHERE t.state = 'waiting' AND t.immediate
                    ORDER BY t.pulp_created, t.pulp_id LIMIT 1)
