-- claimed_since.sql: claimed incomplete tasks not touched for a while, to find claims without a
-- lock (left by a failure half-way, or by Redis losing writes). Uses the app_lock_id index
-- (claimed tasks: about one per worker), never Pulp's state index: `state || ''` is not indexable,
-- so no plan can read every waiting task (a generic plan on statistics from before a backlog
-- arrived took the state index and read 1,000,000 entries per sweep: 200 ms).
-- Only claims of worker rows: a task claimed by a Pulp API or content process (an immediate task
-- it runs itself, guarded by the readiness rule alone) is not the broker's.
-- $1 double precision  seconds without an update.
-- Returns: pulp_id, state, app_lock_id.
SELECT pulp_id, state, app_lock_id
FROM core_task
WHERE app_lock_id IS NOT NULL
  AND app_lock_id IN (SELECT pulp_id FROM core_appstatus WHERE app_type = 'worker')
  AND state || '' IN ($incomplete_states)
  AND coalesce(pulp_last_updated, pulp_created) < now() - make_interval(secs => $1)
