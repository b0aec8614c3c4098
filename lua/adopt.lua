-- adopt.lua: after lock state was rebuilt from Postgres, hands the locks rebuilt for a worker's
-- core_appstatus row to the lease that worker opens anew (passing that row), so its running
-- tasks stay locked without a gap.
--
-- KEYS[1]  PREFIX:recovered:<app_status_id>   string: the lease the rebuild made for that row
-- KEYS[2]  PREFIX:leases                      sorted set lease_id -> expiry (ms)
-- KEYS[3]  PREFIX:lease:<new id>:tasks        the new lease's registry
-- KEYS[4]  PREFIX:epoch                       the lock state's identity
-- ARGV     prefix (with hash tag), new lease_id, epoch
-- Returns  {task_id, fencing_token, ...} for every lock moved (empty when there was nothing).
-- Never    moves locks of a lease that is not a rebuilt one, of a rebuilt lease that already
--          expired (the sweeper owns those), or into a lease that does not exist.

if not epoch_ok(KEYS[4], ARGV[3]) then
  return {}
end
local old = redis.call('GET', KEYS[1])
local old_expires = old and redis.call('ZSCORE', KEYS[2], old)
if not old_expires or tonumber(old_expires) <= now_ms() or not redis.call('ZSCORE', KEYS[2], ARGV[2]) then
  return {}
end
local moved = {}
local old_tasks = ARGV[1] .. ':lease:' .. old .. ':tasks'
for _, task_id in ipairs(redis.call('SMEMBERS', old_tasks)) do
  local task_key = ARGV[1] .. ':task:' .. task_id
  if redis.call('HGET', task_key, 'lease') == old then
    redis.call('HSET', task_key, 'lease', ARGV[2])
    redis.call('SADD', KEYS[3], task_id)
    moved[#moved + 1] = task_id
    moved[#moved + 1] = redis.call('HGET', task_key, 'token')
  end
end
redis.call('DEL', old_tasks, ARGV[1] .. ':lease:' .. old, KEYS[1])
redis.call('ZREM', KEYS[2], old)
return moved
