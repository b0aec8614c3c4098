-- lanes_index.sql: the optional index that hands the lane gauge the incomplete tasks already in
-- queue order, so Postgres neither reads completed tasks nor sorts (lanes.sql). migrate.sql makes
-- the same index on a fresh database; `dispatch-broker migrate --lanes-index` adds it to an existing
-- (e.g. Pulp's) database without blocking writers. Holds only waiting and running tasks.
CREATE INDEX CONCURRENTLY IF NOT EXISTS dispatch_lanes_idx ON core_task (pulp_created, pulp_id)
    WHERE state IN ('waiting', 'running')
