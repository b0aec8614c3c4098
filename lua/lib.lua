-- lib.lua: helpers prepended to every script of dispatch-broker (src/locks/scripts.rs does it).
--
-- Key format (the same as src/locks/keys.rs; a test checks that both agree):
--   PREFIX:lease:<lease_id>:tasks   set of task ids the lease holds locks for (the per-lease registry)
--   PREFIX:task:<task_id>           hash {lease, token, at, x, s, g, d}: the task lock; x and s are
--                                   the task's exclusive and shared resource names joined with "\n",
--                                   g its group, d "1" when it is deferred (not immediate)
--   PREFIX:running                  hash group -> the number of its tasks holding locks
--   PREFIX:deferred                 the number of deferred tasks holding locks
--   PREFIX:x:<resource>             string: the task id holding <resource> exclusively
--   PREFIX:s:<resource>             set: the task ids holding <resource> shared
--   PREFIX:locked                   set of every task id that holds a lock (the reconciler's list)
--   PREFIX:epoch                    the identity of the current lock state; a script that grants
--                                   refuses when it is not what the caller expects (lost state)
--   PREFIX:changes                  sorted set resource name -> sequence number of its last
--                                   release (or other change that may make waiting tasks ready);
--                                   a shared lock's release is recorded as "shared:" .. name (only
--                                   tasks needing the name exclusively may be ready after it);
--                                   "*" stands for "anything may have changed"
--   PREFIX:changeseq                the sequence counter of PREFIX:changes
--   PREFIX:changefloor              changes at or below this sequence were trimmed away
--   PREFIX:recovered:<app_status>   string: the lease a rebuild made for that worker row
--   PREFIX:open:<open_id>           string: the lease an OpenLease with that open id opened
-- PREFIX carries the hash tag ("{dispatch}"), so every key a script builds hashes to the same
-- Redis Cluster slot as the keys it was given.
--
-- Never called on its own.

local function split_names(joined)
  local names = {}
  if joined == nil or joined == false or joined == '' then
    return names
  end
  for name in string.gmatch(joined, '([^\n]+)') do
    names[#names + 1] = name
  end
  return names
end

-- Redis server time in milliseconds: the one clock every replica agrees on.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The last change note_changes recorded in this script run (seq 0: none), for scripts that tell
-- the caller what they recorded (release.lua).
local noted = { seq = 0, names = {} }

-- Records that waiting tasks needing these names may have become ready (a scan hint that
-- relied on them being reserved is stale). Keeps the newest 10,000 names.
local function note_changes(prefix, names)
  if #names == 0 then
    return
  end
  local seq = redis.call('INCR', prefix .. ':changeseq')
  noted.seq, noted.names = seq, names
  local changes = prefix .. ':changes'
  for _, name in ipairs(names) do
    redis.call('ZADD', changes, seq, name)
  end
  local excess = redis.call('ZCARD', changes) - 10000
  if excess > 0 then
    local dropped = redis.call('ZRANGE', changes, 0, excess - 1, 'WITHSCORES')
    redis.call('SET', prefix .. ':changefloor', dropped[#dropped])
    redis.call('ZREMRANGEBYRANK', changes, 0, excess - 1)
  end
end

-- Deletes the lock of one task: its resource entries, its registry entry and the task lock itself.
-- Only touches resource keys that still name this task, so it can never free another task's lock.
local function release_task(prefix, task_id)
  local task_key = prefix .. ':task:' .. task_id
  local lock = redis.call('HMGET', task_key, 'lease', 'x', 's', 'g', 'd')
  if not lock[1] then
    return false
  end
  local changed = {}
  for _, name in ipairs(split_names(lock[2])) do
    local key = prefix .. ':x:' .. name
    if redis.call('GET', key) == task_id then
      redis.call('DEL', key)
    end
    changed[#changed + 1] = name
  end
  for _, name in ipairs(split_names(lock[3])) do
    redis.call('SREM', prefix .. ':s:' .. name, task_id)
    changed[#changed + 1] = 'shared:' .. name
  end
  note_changes(prefix, changed)
  redis.call('SREM', prefix .. ':lease:' .. lock[1] .. ':tasks', task_id)
  redis.call('SREM', prefix .. ':locked', task_id)
  if lock[4] then
    local running = prefix .. ':running'
    if redis.call('HINCRBY', running, lock[4], -1) <= 0 then
      redis.call('HDEL', running, lock[4])
    end
  end
  if lock[5] == '1' then
    local deferred = prefix .. ':deferred'
    if redis.call('DECR', deferred) <= 0 then
      redis.call('DEL', deferred)
    end
  end
  redis.call('DEL', task_key)
  return lock[1]
end

-- True when the lock state is the one the caller knows: the epoch key holds `expected`. A Redis
-- that restarted empty has no epoch; one that is being rebuilt has another.
local function epoch_ok(epoch_key, expected)
  return redis.call('GET', epoch_key) == expected
end

-- The tasks `lease` holds locks for (in its registry, and the lock names it), as
-- {task_id, fencing token, ...} appended to `out`. O(tasks in the registry).
local function lease_holding(prefix, lease, out)
  for _, task_id in ipairs(redis.call('SMEMBERS', prefix .. ':lease:' .. lease .. ':tasks')) do
    local lock = redis.call('HMGET', prefix .. ':task:' .. task_id, 'lease', 'token')
    if lock[1] == lease then
      out[#out + 1] = task_id
      out[#out + 1] = lock[2]
    end
  end
  return out
end
