-- schema_check.sql: what of the broker's required schema is present.
-- Returns: one row per present column as 'table.column', plus 'index:<name>' for a GIN index on
-- core_task(reserved_resources_record), 'extension:hstore', and 'lanes-index' when the optional
-- dispatch_lanes_idx exists and is valid (a failed concurrent build leaves an invalid one), and
-- 'gin-fastupdate-off' when every such GIN index has its pending list turned off, and
-- 'fair-indexes' when fair dispatch's dispatch_groups_idx, dispatch_immediate_idx and
-- dispatch_task_groups_idx all exist and are valid, 'core_domain' when Pulp's domain table is there, and
-- 'stamp-trigger' when an enabled insert trigger on core_task stamps pulp_created (Pulp's
-- on_insert_timestamp_task, or the broker's own dispatch_task_stamp_created from migrate.sql).
SELECT table_name || '.' || column_name AS item
FROM information_schema.columns
WHERE table_schema = current_schema() AND table_name IN ('core_task', 'core_appstatus')
UNION ALL
SELECT 'index:' || indexname FROM pg_indexes
WHERE schemaname = current_schema() AND tablename = 'core_task'
  AND indexdef ILIKE '%USING gin (reserved_resources_record)%'
UNION ALL
SELECT 'extension:' || extname FROM pg_extension WHERE extname = 'hstore'
UNION ALL
SELECT 'lanes-index' FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
WHERE c.relname = 'dispatch_lanes_idx' AND c.relnamespace = current_schema()::regnamespace
  AND i.indisvalid
UNION ALL
SELECT 'fair-indexes' WHERE (
    SELECT count(*) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
    WHERE c.relname IN ('dispatch_groups_idx', 'dispatch_immediate_idx', 'dispatch_task_groups_idx')
      AND c.relnamespace = current_schema()::regnamespace AND i.indisvalid) = 3
UNION ALL
SELECT 'core_domain' WHERE to_regclass(quote_ident(current_schema()) || '.core_domain') IS NOT NULL
UNION ALL
SELECT 'gin-fastupdate-off'
WHERE EXISTS (SELECT 1 FROM pg_indexes WHERE schemaname = current_schema() AND tablename = 'core_task'
              AND indexdef ILIKE '%USING gin (reserved_resources_record)%')
  AND NOT EXISTS (
    SELECT 1 FROM pg_indexes x JOIN pg_class c ON c.relname = x.indexname
      AND c.relnamespace = current_schema()::regnamespace
    WHERE x.schemaname = current_schema() AND x.tablename = 'core_task'
      AND x.indexdef ILIKE '%USING gin (reserved_resources_record)%'
      AND NOT coalesce('fastupdate=off' = ANY (c.reloptions), false))
UNION ALL
SELECT 'stamp-trigger'
WHERE EXISTS (
    SELECT 1 FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid
    WHERE t.tgrelid = to_regclass(quote_ident(current_schema()) || '.core_task')
      AND t.tgenabled IN ('O', 'A')
      AND p.proname IN ('on_insert_timestamp_task', 'dispatch_task_stamp_created'))
