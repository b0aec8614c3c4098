-- domain_names.sql: every domain's id and name (Pulp's core_domain), to read a policy that names
-- domains; on the broker's own schema, which has no core_domain, nothing.
-- Returns: pulp_id, name. Never writes.
SELECT pulp_id, name FROM core_domain
