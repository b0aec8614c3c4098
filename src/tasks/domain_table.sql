-- domain_table.sql: whether Pulp's domain table is there (the broker's own schema has none).
-- Returns: one boolean. Never writes.
SELECT to_regclass('core_domain') IS NOT NULL
