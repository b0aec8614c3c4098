-- gin_clean.sql: merges the pending list of every GIN index on core_task whose pending list is
-- on (fastupdate, the default: Pulp's pulp_task_resources_index on a fresh Pulp database) into
-- the index proper. Every GIN search reads the whole pending list, so every readiness look-up
-- of a fetch pays for what is pending; merged often, it stays a few pages. Indexes with
-- fastupdate=off (`migrate --gin-fastupdate-off`) have no pending list and are left alone.
--
-- No parameters.
-- Returns: index (name), pages (pending-list pages merged now).
-- Changes no definition or setting: gin_clean_pending_list only moves pending entries into the
-- index, as VACUUM would. Needs the role that owns the index (as VACUUM does); the broker stops
-- calling it with a warning otherwise.
SELECT c.oid::regclass::text AS index,
       gin_clean_pending_list(c.oid::regclass) AS pages
FROM pg_index i
JOIN pg_class c ON c.oid = i.indexrelid
JOIN pg_am a ON a.oid = c.relam
WHERE i.indrelid = 'core_task'::regclass
  AND a.amname = 'gin'
  AND NOT coalesce('fastupdate=off' = ANY (c.reloptions), false)
