-- release_orphan.lua: releases one task's lock for the audited ForceRelease when the lease that
-- holds it has no record left (a leak): only if the lock is still the one the operator saw
-- (same lease, same fencing token) and that lease is neither recorded nor alive.
--
-- KEYS[1]  PREFIX:task:<task_id>   the task lock
-- KEYS[2]  PREFIX:leases           sorted set lease_id -> expiry (ms)
-- KEYS[3]  PREFIX:lease:<id>       the holding lease's hash
-- ARGV     prefix (with hash tag), task_id, expected lease id, expected fencing token
-- Returns  1 released; 0 the lock is gone or is now another holder's (nothing done); -1 the
--          lease has a record again or is alive (nothing done).
-- Never    releases a lock whose lease lives, nor a lock granted after the operator looked.

local lock = redis.call('HMGET', KEYS[1], 'lease', 'token')
if lock[1] ~= ARGV[3] or lock[2] ~= ARGV[4] then
  return 0
end
if redis.call('EXISTS', KEYS[3]) == 1 then
  return -1
end
local expires = redis.call('ZSCORE', KEYS[2], ARGV[3])
if expires and tonumber(expires) > now_ms() then
  return -1
end
release_task(ARGV[1], ARGV[2])
return 1
