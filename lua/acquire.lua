-- acquire.lua: takes every lock a task needs, or none.
--
-- KEYS[1]  PREFIX:epoch              the lock state's identity
-- KEYS[2]  PREFIX:leases             sorted set lease_id -> expiry (ms)
-- KEYS[3]  PREFIX:lease:<id>:tasks   the lease's registry
-- KEYS[4]  PREFIX:task:<task_id>     the task lock: hash {lease, token, at, x, s}
-- KEYS[5]  PREFIX:fence              the fencing counter
-- KEYS[6]  PREFIX:locked             every locked task id
-- KEYS[7]  PREFIX:running            hash group -> tasks of that group holding locks
-- KEYS[8]  PREFIX:deferred           the number of deferred (not immediate) tasks holding locks
-- KEYS[9..] one pair per resource, exclusive resources first, then shared ones:
--          PREFIX:x:<resource>, PREFIX:s:<resource>
-- ARGV     epoch, highest fencing token the caller has seen, lease_id, task_id, n_exclusive,
--          n_shared, the task's group, "1" when it is immediate (else "0"), the group's cap (-1:
--          none), the reserve for immediate tasks (0: none), then the n_exclusive + n_shared
--          resource names in the order of the key pairs
-- Returns  {1, fencing_token} when granted;
--          {0, "lease"} when the lease is unknown or expired;
--          {0, "task"} when the task is already locked (by anyone);
--          {0, "blocked", name, ...} with every resource that is held in a conflicting mode;
--          {0, "cap", cap} when the task's group holds `cap` task locks already;
--          {0, "reserve", reserve} when the task is deferred and deferred tasks hold locks for
--          all live leases but `reserve` (fairness, src/fair.rs);
--          {0, "epoch"} when the lock state is not the expected one, or the fencing counter is
--          below a token already handed out (Redis lost writes).
-- Never    writes anything unless every check passed, so a refusal leaves Redis as it was.

local lease_id, task_id = ARGV[3], ARGV[4]
local n_x, n_s = tonumber(ARGV[5]), tonumber(ARGV[6])
local group, immediate = ARGV[7], ARGV[8] == '1'
local cap, reserve = tonumber(ARGV[9]), tonumber(ARGV[10])
local first_pair, first_name = 9, 10

if not epoch_ok(KEYS[1], ARGV[1]) then
  return {0, 'epoch'}
end
if tonumber(redis.call('GET', KEYS[5]) or '0') < tonumber(ARGV[2]) then
  return {0, 'epoch'}
end
local expires = redis.call('ZSCORE', KEYS[2], lease_id)
if not expires or tonumber(expires) <= now_ms() then
  return {0, 'lease'}
end
if redis.call('EXISTS', KEYS[4]) == 1 then
  return {0, 'task'}
end

local blocked = {}
for i = 1, n_x + n_s do
  local x_key, s_key = KEYS[first_pair + 2 * (i - 1)], KEYS[first_pair + 2 * (i - 1) + 1]
  local name = ARGV[first_name + i]
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
if cap >= 0 and tonumber(redis.call('HGET', KEYS[7], group) or '0') >= cap then
  return {0, 'cap', cap}
end
if not immediate and reserve > 0 then
  local live = redis.call('ZCOUNT', KEYS[2], '(' .. now_ms(), '+inf')
  if tonumber(redis.call('GET', KEYS[8]) or '0') >= live - reserve then
    return {0, 'reserve', reserve}
  end
end

local token = redis.call('INCR', KEYS[5])
local x_names, s_names = {}, {}
for i = 1, n_x + n_s do
  local name = ARGV[first_name + i]
  if i <= n_x then
    redis.call('SET', KEYS[first_pair + 2 * (i - 1)], task_id)
    x_names[#x_names + 1] = name
  else
    redis.call('SADD', KEYS[first_pair + 2 * (i - 1) + 1], task_id)
    s_names[#s_names + 1] = name
  end
end
redis.call('HSET', KEYS[4], 'lease', lease_id, 'token', string.format('%d', token),
  'at', now_ms(), 'x', table.concat(x_names, '\n'), 's', table.concat(s_names, '\n'),
  'g', group, 'd', immediate and '0' or '1')
redis.call('HINCRBY', KEYS[7], group, 1)
if not immediate then
  redis.call('INCR', KEYS[8])
end
redis.call('SADD', KEYS[3], task_id)
redis.call('SADD', KEYS[6], task_id)
return {1, token}
