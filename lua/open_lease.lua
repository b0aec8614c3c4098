-- open_lease.lua: registers a new lease.
--
-- KEYS[1]  PREFIX:leases          sorted set lease_id -> expiry (Redis server time, ms)
-- KEYS[2]  PREFIX:lease:<id>      hash {worker, app_status, ttl_ms, owned, versions}
-- ARGV     lease_id, ttl_ms, worker_name, app_status_id, owned ("1"/"0"), versions (JSON)
-- Returns  the lease's expiry in ms since the epoch (server time), or -1 when the id is taken.
-- Never    overwrites an existing lease.

if redis.call('EXISTS', KEYS[2]) == 1 then
  return -1
end
local ttl = tonumber(ARGV[2])
local expires = now_ms() + ttl
redis.call('HSET', KEYS[2], 'worker', ARGV[3], 'app_status', ARGV[4], 'ttl_ms', ARGV[2],
  'owned', ARGV[5], 'versions', ARGV[6])
redis.call('ZADD', KEYS[1], expires, ARGV[1])
return expires
