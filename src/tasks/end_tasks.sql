-- end_tasks.sql: ends the tasks an ended lease held: claimed tasks that had not started go back to
-- the queue, running (or canceling) tasks fail with the reason, as Pulp's missing-worker cleanup
-- does. Only tasks still claimed by that lease's worker row are touched, and running ones no row
-- claims: their claim was cleared when the row was deleted (Django's SET_NULL in pulpcore's
-- clean-up of missing workers), nobody else can have claimed a running task, and its worker stops
-- it once told its lease ended (Pulp's own workers fail such an abandoned task the same way).
--
-- $1 uuid[]  the tasks the lease held locks for;  $2 uuid  its core_appstatus row;  $3 text  reason
-- Returns: requeued count, failed count.
-- The state is tested as `state || ''`, and "claimed by the row or by none" as
-- `coalesce(app_lock_id, $2) = $2`, so that only the primary key serves the look-up (see
-- claim.sql): written as `app_lock_id IS NULL OR ...`, the generic plan ORed in Pulp's
-- app_lock_id index and read every unclaimed waiting task (tests/it/pulp_schema.rs).
WITH requeued AS (
    UPDATE core_task SET app_lock_id = NULL, pulp_last_updated = now()
    WHERE pulp_id = ANY($1) AND app_lock_id = $2 AND state || '' = 'waiting'
    RETURNING pulp_id
), failed AS (
    UPDATE core_task
    SET state = 'failed', finished_at = now(), error = jsonb_build_object('reason', $3::text),
        app_lock_id = NULL, pulp_last_updated = now()
    WHERE pulp_id = ANY($1) AND coalesce(app_lock_id, $2) = $2
      AND state || '' IN ('running', 'canceling')
    RETURNING pulp_id
)
SELECT (SELECT count(*) FROM requeued), (SELECT count(*) FROM failed)
