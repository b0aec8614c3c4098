-- close_lease.lua: ends a lease and releases every lock it holds, through its registry.
--
-- KEYS[1]  PREFIX:leases             sorted set lease_id -> expiry (ms)
-- KEYS[2]  PREFIX:lease:<id>         lease hash
-- KEYS[3]  PREFIX:lease:<id>:tasks   the lease's registry
-- ARGV     prefix (with hash tag), lease_id
-- Returns  the number of task locks released, or -1 when the lease is unknown.
-- Never    scans the keyspace: cost is O(locks the lease holds). Works on an expired lease too.

if redis.call('EXISTS', KEYS[2]) == 0 and redis.call('ZSCORE', KEYS[1], ARGV[2]) == false then
  return -1
end
local released = 0
for _, task_id in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  local task_key = ARGV[1] .. ':task:' .. task_id
  if redis.call('HGET', task_key, 'lease') == ARGV[2] then
    release_task(ARGV[1], task_id)
    released = released + 1
  end
end
redis.call('DEL', KEYS[3], KEYS[2])
redis.call('ZREM', KEYS[1], ARGV[2])
return released
