-- lease_info.lua: reads a lease and tells whether it is alive, without extending it.
--
-- KEYS[1]  PREFIX:leases          sorted set lease_id -> expiry (ms)
-- KEYS[2]  PREFIX:lease:<id>      lease hash
-- ARGV     lease_id
-- Returns  {expiry ms, app_status_id, versions JSON, worker name}, or false when the lease is
--          unknown or expired (judged by Redis server time).
-- Never    writes.

local expires = redis.call('ZSCORE', KEYS[1], ARGV[1])
local lease = redis.call('HMGET', KEYS[2], 'app_status', 'versions', 'worker')
if not expires or not lease[1] or tonumber(expires) <= now_ms() then
  return false
end
return {tonumber(expires), lease[1], lease[2], lease[3]}
