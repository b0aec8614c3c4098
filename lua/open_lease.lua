-- open_lease.lua: registers a new lease; with the worker's own core_appstatus row, hands it the
-- locks a rebuild of lost lock state made for that row (so its running tasks stay locked without
-- a gap); with an open id, answers a retry of the same OpenLease with the lease it opened.
--
-- KEYS[1]  PREFIX:epoch                       the lock state's identity
-- KEYS[2]  PREFIX:leases                      sorted set lease_id -> expiry (Redis server time, ms)
-- KEYS[3]  PREFIX:lease:<id>                  hash {worker, app_status, ttl_ms, owned, versions};
--          release.lua adds "finished" (the last task a FinishTask released)
-- KEYS[4]  PREFIX:lease:<id>:tasks            the new lease's registry
-- KEYS[5]  PREFIX:recovered:<app_status_id>   string: the lease a rebuild made for that row
-- KEYS[6]  PREFIX:open:<open_id>              string: the lease that open id opened (PX its TTL)
-- ARGV     epoch, lease_id, ttl_ms, worker_name, app_status_id, owned ("1"/"0"), versions (JSON),
--          prefix (with hash tag), adopt ("1"/"0"), open id given ("1"/"0")
-- Returns  {expiry (ms since the epoch, server time), lease_id, app_status_id, ttl_ms,
--          task_id, fencing_token, ...}: the new lease with the tasks it adopted, or, for a
--          retry, the live lease the open id opened with every task it holds;
--          {-1} when the id is taken; {-2} when the lock state is not the expected one (lost or
--          being rebuilt); {-3, app_status_id} when the open id opened a lease for another row
--          (another named row, or a named row where this call names none, or the other way).
-- Never    overwrites an existing lease, never writes into lock state it does not recognise,
--          never moves locks of a lease that is not a rebuilt one or of a rebuilt lease that
--          already expired (the sweeper owns those), never opens two leases for one open id
--          while the first lives.

if not epoch_ok(KEYS[1], ARGV[1]) then
  return {-2}
end
local prefix = ARGV[8]
local now = now_ms()

if ARGV[10] == '1' then
  local earlier = redis.call('GET', KEYS[6])
  local expires = earlier and redis.call('ZSCORE', KEYS[2], earlier)
  if expires and tonumber(expires) > now then
    local lease = redis.call('HMGET', prefix .. ':lease:' .. earlier, 'app_status', 'ttl_ms', 'owned')
    -- A named row must be the same row; a row the broker made for the earlier call stands for
    -- the one it made for this call.
    if (ARGV[6] == '0' and lease[1] ~= ARGV[5]) or (ARGV[6] == '1' and lease[3] ~= '1') then
      return {-3, lease[1] or ''}
    end
    return lease_holding(prefix, earlier, {tonumber(expires), earlier, lease[1], lease[2]})
  end
end

if redis.call('EXISTS', KEYS[3]) == 1 then
  return {-1}
end
local ttl = tonumber(ARGV[3])
local expires = now + ttl
redis.call('HSET', KEYS[3], 'worker', ARGV[4], 'app_status', ARGV[5], 'ttl_ms', ARGV[3],
  'owned', ARGV[6], 'versions', ARGV[7])
redis.call('ZADD', KEYS[2], expires, ARGV[2])
if ARGV[10] == '1' then
  redis.call('SET', KEYS[6], ARGV[2], 'PX', ttl)
end
local answer = {expires, ARGV[2], ARGV[5], ARGV[3]}
if ARGV[9] ~= '1' then
  return answer
end

local rebuilt = redis.call('GET', KEYS[5])
local rebuilt_expires = rebuilt and redis.call('ZSCORE', KEYS[2], rebuilt)
if not rebuilt_expires or tonumber(rebuilt_expires) <= now then
  return answer
end
local rebuilt_tasks = prefix .. ':lease:' .. rebuilt .. ':tasks'
for _, task_id in ipairs(redis.call('SMEMBERS', rebuilt_tasks)) do
  local task_key = prefix .. ':task:' .. task_id
  if redis.call('HGET', task_key, 'lease') == rebuilt then
    redis.call('HSET', task_key, 'lease', ARGV[2])
    redis.call('SADD', KEYS[4], task_id)
    answer[#answer + 1] = task_id
    answer[#answer + 1] = redis.call('HGET', task_key, 'token')
  end
end
redis.call('DEL', rebuilt_tasks, prefix .. ':lease:' .. rebuilt, KEYS[5])
redis.call('ZREM', KEYS[2], rebuilt)
return answer
