-- any_incomplete.sql: whether any task is incomplete (KEDA's IsActive: never scale a worker
-- with a task in flight to zero).
-- Returns: one boolean.
SELECT EXISTS (SELECT 1 FROM core_task WHERE state IN ($incomplete_states))
