-- lock_table.lua: every held task lock with its holder, for the operator's view (ExplainTask,
-- ListLocks, ForceRelease). Reads the registry of locked tasks, never the keyspace: the cost is
-- the number of locks held.
--
-- KEYS[1]  PREFIX:locked          set of every task id that holds a lock
-- KEYS[2]  PREFIX:leases          sorted set lease_id -> expiry (ms)
-- ARGV     prefix (with hash tag)
-- Returns  {now ms, then 7 entries per held task: task_id, lease_id, fencing token, exclusive
--          names and shared names (each joined with "\n"), worker name ("" when the lease
--          record is gone), lease expiry ms (0 when the lease record is gone)}
-- Never    writes.

local prefix = ARGV[1]
local reply = {now_ms()}
local workers = {}
for _, task_id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local lock = redis.call('HMGET', prefix .. ':task:' .. task_id, 'lease', 'token', 'x', 's')
  if lock[1] then
    local lease = lock[1]
    if workers[lease] == nil then
      local worker = redis.call('HGET', prefix .. ':lease:' .. lease, 'worker')
      local expires = redis.call('ZSCORE', KEYS[2], lease)
      if worker then
        workers[lease] = {worker, tonumber(expires or '0')}
      else
        workers[lease] = {'', 0}
      end
    end
    reply[#reply + 1] = task_id
    reply[#reply + 1] = lease
    reply[#reply + 1] = lock[2] or '0'
    reply[#reply + 1] = lock[3] or ''
    reply[#reply + 1] = lock[4] or ''
    reply[#reply + 1] = workers[lease][1]
    reply[#reply + 1] = workers[lease][2]
  end
end
return reply
