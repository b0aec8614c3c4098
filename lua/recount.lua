-- recount.lua: counts the tasks holding locks anew, by group and deferred, from the task locks
-- themselves (fair dispatch's counters, which acquire.lua raises and release_task lowers): run by
-- the sweeping replica every sweep, so a count that drifted (a lock released by a broker from
-- before fair dispatch, which did not lower it) is right again within one sweep interval.
--
-- KEYS[1]  PREFIX:locked     every locked task id
-- KEYS[2]  PREFIX:running    hash group -> tasks of that group holding locks
-- KEYS[3]  PREFIX:deferred   the number of deferred tasks holding locks
-- ARGV     prefix (with hash tag)
-- Returns  the number of task locks counted.
-- Never    touches a lock; reads O(locks held).

local running, deferred, counted = {}, 0, 0
for _, task_id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local lock = redis.call('HMGET', ARGV[1] .. ':task:' .. task_id, 'lease', 'g', 'd')
  if lock[1] then
    counted = counted + 1
    if lock[2] then
      running[lock[2]] = (running[lock[2]] or 0) + 1
    end
    if lock[3] == '1' then
      deferred = deferred + 1
    end
  end
end
redis.call('DEL', KEYS[2], KEYS[3])
for group, n in pairs(running) do
  redis.call('HSET', KEYS[2], group, n)
end
if deferred > 0 then
  redis.call('SET', KEYS[3], deferred)
end
return counted
