-- notify_trigger.sql: tells waiting fetches that tasks were inserted. One notification per
-- INSERT statement, delivered at commit (so a woken fetch sees the rows), on the channel the
-- broker listens on (dispatch::wakeups::INSERT_CHANNEL). A fresh database gets it from
-- `migrate`; `dispatch-broker migrate --notify-trigger` adds it to Pulp's, whose own dispatch()
-- already notifies `pulp_worker_wakeup` for deferred tasks (the broker listens there too), so on
-- Pulp it only matters for tasks inserted some other way. Idempotent.
CREATE OR REPLACE FUNCTION dispatch_task_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('dispatch_task_inserted', '');
    RETURN NULL;
END;
$$;

CREATE OR REPLACE TRIGGER dispatch_task_notify AFTER INSERT ON core_task
    FOR EACH STATEMENT EXECUTE FUNCTION dispatch_task_notify();
