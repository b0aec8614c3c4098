-- lease_info.lua: reads a lease and tells whether it is alive, without extending it.
--
-- KEYS[1]  PREFIX:epoch           the lock state's identity
-- KEYS[2]  PREFIX:leases          sorted set lease_id -> expiry (ms)
-- KEYS[3]  PREFIX:lease:<id>      lease hash
-- ARGV     epoch, lease_id
-- Returns  {1, expiry ms, app_status_id, versions JSON, worker name}; {0} when the lease is
--          unknown or expired (judged by Redis server time); {-2} when the lock state is not the
--          expected one.
-- Never    writes.

if not epoch_ok(KEYS[1], ARGV[1]) then
  return {-2}
end
local expires = redis.call('ZSCORE', KEYS[2], ARGV[2])
local lease = redis.call('HMGET', KEYS[3], 'app_status', 'versions', 'worker')
if not expires or not lease[1] or tonumber(expires) <= now_ms() then
  return {0}
end
return {1, tonumber(expires), lease[1], lease[2], lease[3]}
