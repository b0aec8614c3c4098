-- open_lease.lua: registers a new lease.
--
-- KEYS[1]  PREFIX:epoch           the lock state's identity
-- KEYS[2]  PREFIX:leases          sorted set lease_id -> expiry (Redis server time, ms)
-- KEYS[3]  PREFIX:lease:<id>      hash {worker, app_status, ttl_ms, owned, versions}; release.lua
--          adds "finished" (the last task a FinishTask released)
-- ARGV     epoch, lease_id, ttl_ms, worker_name, app_status_id, owned ("1"/"0"), versions (JSON)
-- Returns  the lease's expiry in ms since the epoch (server time); -1 when the id is taken;
--          -2 when the lock state is not the expected one (lost or being rebuilt).
-- Never    overwrites an existing lease, never writes into lock state it does not recognise.

if not epoch_ok(KEYS[1], ARGV[1]) then
  return -2
end
if redis.call('EXISTS', KEYS[3]) == 1 then
  return -1
end
local ttl = tonumber(ARGV[3])
local expires = now_ms() + ttl
redis.call('HSET', KEYS[3], 'worker', ARGV[4], 'app_status', ARGV[5], 'ttl_ms', ARGV[3],
  'owned', ARGV[6], 'versions', ARGV[7])
redis.call('ZADD', KEYS[2], expires, ARGV[2])
return expires
