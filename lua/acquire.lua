-- acquire.lua: takes every lock a task needs, or none.
--
-- KEYS[1]  PREFIX:leases             sorted set lease_id -> expiry (ms)
-- KEYS[2]  PREFIX:lease:<id>:tasks   the lease's registry
-- KEYS[3]  PREFIX:task:<task_id>     the task lock
-- KEYS[4]  PREFIX:fence              the fencing counter
-- KEYS[5..] one pair per resource, exclusive resources first, then shared ones:
--          PREFIX:x:<resource>, PREFIX:s:<resource>
-- ARGV     lease_id, task_id, n_exclusive, n_shared, then the n_exclusive + n_shared resource names
--          in the same order as the key pairs
-- Returns  {1, fencing_token} when granted;
--          {0, "lease"} when the lease is unknown or expired;
--          {0, "task"} when the task is already locked (by anyone);
--          {0, "blocked", name, ...} with every resource that is held in a conflicting mode.
-- Never    writes anything unless every check passed, so a refusal leaves Redis as it was.

local lease_id, task_id = ARGV[1], ARGV[2]
local n_x, n_s = tonumber(ARGV[3]), tonumber(ARGV[4])

local expires = redis.call('ZSCORE', KEYS[1], lease_id)
if not expires or tonumber(expires) <= now_ms() then
  return {0, 'lease'}
end
if redis.call('EXISTS', KEYS[3]) == 1 then
  return {0, 'task'}
end

local blocked = {}
for i = 1, n_x + n_s do
  local x_key, s_key = KEYS[3 + 2 * i], KEYS[4 + 2 * i]
  local name = ARGV[4 + i]
  if redis.call('EXISTS', x_key) == 1 then
    blocked[#blocked + 1] = name
  elseif i <= n_x and redis.call('SCARD', s_key) > 0 then
    blocked[#blocked + 1] = name
  end
end
if #blocked > 0 then
  local reply = {0, 'blocked'}
  for _, name in ipairs(blocked) do
    reply[#reply + 1] = name
  end
  return reply
end

local token = redis.call('INCR', KEYS[4])
local x_names, s_names = {}, {}
for i = 1, n_x + n_s do
  local name = ARGV[4 + i]
  if i <= n_x then
    redis.call('SET', KEYS[3 + 2 * i], task_id)
    x_names[#x_names + 1] = name
  else
    redis.call('SADD', KEYS[4 + 2 * i], task_id)
    s_names[#s_names + 1] = name
  end
end
redis.call('HSET', KEYS[3], 'lease', lease_id, 'token', token,
  'x', table.concat(x_names, '\n'), 's', table.concat(s_names, '\n'))
redis.call('SADD', KEYS[2], task_id)
return {1, token}
