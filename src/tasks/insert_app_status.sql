-- insert_app_status.sql: the core_appstatus row of a worker whose lease the broker opened,
-- written as pulpcore writes a worker's own row (app_type 'worker', versions as hstore, ttl).
--
-- $1 uuid  pulp_id;  $2 text  name;  $3 text[]  version components;  $4 text[]  versions
-- $5 double precision  ttl in seconds
INSERT INTO core_appstatus
    (pulp_id, pulp_created, pulp_last_updated, app_type, name, versions, ttl, last_heartbeat)
VALUES ($1, now(), now(), 'worker', $2, hstore($3::text[], $4::text[]),
        make_interval(secs => $5), now())
