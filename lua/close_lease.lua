-- close_lease.lua: ends a lease and releases every lock it holds, through its registry.
--
-- KEYS[1]  PREFIX:leases             sorted set lease_id -> expiry (ms)
-- KEYS[2]  PREFIX:lease:<id>         lease hash
-- KEYS[3]  PREFIX:lease:<id>:tasks   the lease's registry
-- KEYS[4]  PREFIX:sweeper            the sweeper lock (checked when ARGV[3] is set)
-- ARGV     prefix (with hash tag), lease_id, sweeper id ("" for a worker's own CloseLease)
-- Returns  the number of task locks released; -1 when the lease is unknown; -3 when a sweeper
--          call no longer holds the sweeper lock or the lease is not expired (nothing changed).
-- Never    scans the keyspace: cost is O(locks the lease holds). A sweeper call never ends a
--          live lease and never runs when another replica took over sweeping.

if redis.call('EXISTS', KEYS[2]) == 0 and redis.call('ZSCORE', KEYS[1], ARGV[2]) == false then
  return -1
end
if ARGV[3] ~= '' then
  local expires = redis.call('ZSCORE', KEYS[1], ARGV[2])
  if redis.call('GET', KEYS[4]) ~= ARGV[3] or (expires and tonumber(expires) > now_ms()) then
    return -3
  end
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
