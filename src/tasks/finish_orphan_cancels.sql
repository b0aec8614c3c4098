-- finish_orphan_cancels.sql: finishes tasks that were asked to cancel while nobody held them
-- (Pulp's own cancel API sets a waiting task `canceling`; Pulp's workers then finish it as
-- `canceled`; with the broker, nothing else would, and the task would reserve its resources
-- forever). Same outcome as Pulp: state `canceled`, finished_at set, error left alone.
-- Returns: the finished tasks' records (so scan hints relying on them are dropped).
UPDATE core_task
SET state = 'canceled', finished_at = now(), pulp_last_updated = now()
WHERE state = 'canceling' AND app_lock_id IS NULL
RETURNING coalesce(reserved_resources_record, '{}'::text[])
