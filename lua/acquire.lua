-- acquire.lua: for each of a number of tasks in turn, takes every lock the task needs, or none.
-- One call locks a fetch round's tasks (src/dispatch.rs, grant_round); the tasks are tried in
-- order, each seeing what the ones before it took, exactly as one call per task would.
--
-- KEYS[1]  PREFIX:epoch              the lock state's identity
-- KEYS[2]  PREFIX:leases             sorted set lease_id -> expiry (ms)
-- KEYS[3]  PREFIX:fence              the fencing counter
-- KEYS[4]  PREFIX:locked             every locked task id
-- KEYS[5]  PREFIX:running            hash group -> tasks of that group holding locks
-- KEYS[6]  PREFIX:deferred           the number of deferred (not immediate) tasks holding locks
-- then for each task:
--          PREFIX:lease:<id>:tasks   the lease's registry
--          PREFIX:task:<task_id>     the task lock: hash {lease, token, at, x, s, g, d}
--          one pair per resource, exclusive resources first, then shared ones:
--          PREFIX:x:<resource>, PREFIX:s:<resource>
-- ARGV     epoch, highest fencing token the caller has seen, the number of tasks; then for each
--          task: lease_id, task_id, n_exclusive, n_shared, the task's group, "1" when it is
--          immediate (else "0"), the group's cap (-1: none), the reserve for immediate tasks (0:
--          none), then the n_exclusive + n_shared resource names in the order of the key pairs
-- Returns  one reply per task, in order:
--          {1, fencing_token} when granted;
--          {0, "lease"} when the lease is unknown or expired;
--          {0, "task"} when the task is already locked (by anyone);
--          {0, "blocked", name, ...} with every resource that is held in a conflicting mode;
--          {0, "cap", cap} when the task's group holds `cap` task locks already;
--          {0, "reserve", reserve} when the task is deferred and deferred tasks hold locks for
--          all live leases but `reserve` (fairness, src/fair.rs);
--          or a single reply {{0, "epoch"}} when the lock state is not the expected one, or the
--          fencing counter is below a token already handed out (Redis lost writes).
-- Never    writes anything for a task unless every check of that task passed, so a refusal
--          leaves Redis as the tasks before it left it.

if not epoch_ok(KEYS[1], ARGV[1]) then
  return {{0, 'epoch'}}
end
if tonumber(redis.call('GET', KEYS[3]) or '0') < tonumber(ARGV[2]) then
  return {{0, 'epoch'}}
end
local count = tonumber(ARGV[3])
local now = now_ms()
local live = nil

local function acquire(k, a)
  local lease_id, task_id = ARGV[a], ARGV[a + 1]
  local n_x, n_s = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local group, immediate = ARGV[a + 4], ARGV[a + 5] == '1'
  local cap, reserve = tonumber(ARGV[a + 6]), tonumber(ARGV[a + 7])
  local first_pair, first_name = k + 2, a + 7
  local expires = redis.call('ZSCORE', KEYS[2], lease_id)
  if not expires or tonumber(expires) <= now then
    return {0, 'lease'}
  end
  if redis.call('EXISTS', KEYS[k + 1]) == 1 then
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
  if cap >= 0 and tonumber(redis.call('HGET', KEYS[5], group) or '0') >= cap then
    return {0, 'cap', cap}
  end
  if not immediate and reserve > 0 then
    live = live or redis.call('ZCOUNT', KEYS[2], '(' .. now, '+inf')
    if tonumber(redis.call('GET', KEYS[6]) or '0') >= live - reserve then
      return {0, 'reserve', reserve}
    end
  end

  local token = redis.call('INCR', KEYS[3])
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
  redis.call('HSET', KEYS[k + 1], 'lease', lease_id, 'token', string.format('%d', token),
    'at', now, 'x', table.concat(x_names, '\n'), 's', table.concat(s_names, '\n'),
    'g', group, 'd', immediate and '0' or '1')
  redis.call('HINCRBY', KEYS[5], group, 1)
  if not immediate then
    redis.call('INCR', KEYS[6])
  end
  redis.call('SADD', KEYS[k], task_id)
  redis.call('SADD', KEYS[4], task_id)
  return {1, token}
end

local replies = {}
local k, a = 7, 4
for _ = 1, count do
  local names = tonumber(ARGV[a + 2]) + tonumber(ARGV[a + 3])
  replies[#replies + 1] = acquire(k, a)
  k = k + 2 + 2 * names
  a = a + 8 + names
end
return replies
