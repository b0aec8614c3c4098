-- finish_orphan_cancels.sql: finishes tasks that were asked to cancel while nobody held them
-- (Pulp's own cancel API sets a waiting task `canceling`; Pulp's workers then finish it as
-- `canceled`; with the broker, nothing else would, and the task would reserve its resources
-- forever). Same outcome as Pulp: state `canceled`, finished_at set, error left alone.
-- Returns: the finished tasks' records (so scan hints relying on them are dropped).
-- Reads Pulp's state index for `canceling` only: the app_lock_id test goes through a cast, which
-- no index serves (a generic plan ANDed a bitmap of the app_lock_id index's NULLs, every
-- unclaimed task: 1,000,000 entries per sweep at 1,000,000 blocked).
UPDATE core_task
SET state = 'canceled', finished_at = now(), pulp_last_updated = now()
WHERE state = 'canceling' AND app_lock_id::text IS NULL
RETURNING coalesce(reserved_resources_record, '{}'::text[])
