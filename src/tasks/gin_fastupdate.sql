-- gin_fastupdate.sql: turns off the pending list of the GIN index on reserved resources
-- (Pulp's pulp_task_resources_index) and merges what is pending now. Each claim, start and finish
-- adds index entries (the row's state changes); with the pending list on, every readiness look-up
-- scans up to gin_pending_list_limit (4 MB) of unsorted entries until the next vacuum: 47 ms
-- instead of 2.6 ms for one page of candidates was measured. A storage parameter only: the
-- index's definition, and so Pulp's schema, is unchanged. migrate.sql sets it on fresh databases.
-- `dispatch-broker migrate --gin-fastupdate-off` runs it on existing ones.
DO $$
DECLARE idx regclass;
BEGIN
    FOR idx IN
        SELECT (quote_ident(schemaname) || '.' || quote_ident(indexname))::regclass FROM pg_indexes
        WHERE schemaname = current_schema() AND tablename = 'core_task'
          AND indexdef ILIKE '%USING gin (reserved_resources_record)%'
    LOOP
        EXECUTE format('ALTER INDEX %s SET (fastupdate = off)', idx);
        PERFORM gin_clean_pending_list(idx);
    END LOOP;
END $$;
