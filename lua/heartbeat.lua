-- heartbeat.lua: extends a live lease by its TTL.
--
-- KEYS[1]  PREFIX:epoch           the lock state's identity
-- KEYS[2]  PREFIX:leases          sorted set lease_id -> expiry (ms)
-- KEYS[3]  PREFIX:lease:<id>      lease hash
-- KEYS[4]  PREFIX:lease:<id>:tasks the lease's registry (read by lease_holding)
-- ARGV     epoch, lease_id, the key prefix
-- Returns  {1, new expiry ms, app_status_id, ttl ms, {task_id, fencing token, ...}} with every
--          task the lease holds locks for (in its registry, and the lock names it); {0} when
--          the lease is unknown or already expired; {-2} when the lock state is not the expected
--          one.
-- Never    revives an expired lease: its locks belong to the sweeper from that moment on.
--          O(tasks the lease holds).

if not epoch_ok(KEYS[1], ARGV[1]) then
  return {-2}
end
local expires = redis.call('ZSCORE', KEYS[2], ARGV[2])
local lease = redis.call('HMGET', KEYS[3], 'ttl_ms', 'app_status')
local now = now_ms()
if not expires or not lease[1] or tonumber(expires) <= now then
  return {0}
end
local next_expiry = now + tonumber(lease[1])
redis.call('ZADD', KEYS[2], next_expiry, ARGV[2])
local held = lease_holding(ARGV[3], ARGV[2], {})
return {1, next_expiry, lease[2], tonumber(lease[1]), held}
