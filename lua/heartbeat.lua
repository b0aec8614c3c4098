-- heartbeat.lua: extends a live lease by its TTL.
--
-- KEYS[1]  PREFIX:leases          sorted set lease_id -> expiry (ms)
-- KEYS[2]  PREFIX:lease:<id>      lease hash
-- ARGV     lease_id
-- Returns  {new expiry ms, app_status_id}, or false when the lease is unknown or already expired.
-- Never    revives an expired lease: its locks belong to the sweeper from that moment on.
--          O(1) whatever the lease holds.

local expires = redis.call('ZSCORE', KEYS[1], ARGV[1])
local lease = redis.call('HMGET', KEYS[2], 'ttl_ms', 'app_status')
local now = now_ms()
if not expires or not lease[1] or tonumber(expires) <= now then
  return false
end
local next_expiry = now + tonumber(lease[1])
redis.call('ZADD', KEYS[1], next_expiry, ARGV[1])
return {next_expiry, lease[2]}
