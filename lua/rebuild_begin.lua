-- rebuild_begin.lua: starts a rebuild of lost lock state for the caller that holds the rebuild
-- lock: marks the epoch as being rebuilt, so no replica grants anything from now on.
--
-- KEYS[1]  PREFIX:recovery   the rebuild lock (holds the rebuilding replica's id, with a TTL)
-- KEYS[2]  PREFIX:epoch      the lock state's identity
-- KEYS[3]  PREFIX:fence      the fencing counter
-- KEYS[4]  PREFIX:running    tasks holding locks by group   } counted anew as the rebuild locks
-- KEYS[5]  PREFIX:deferred   deferred tasks holding locks   } the claimed tasks again
-- ARGV     replica id, rebuilding epoch value ("rebuilding:<uuid>"), the highest fencing token
--          the caller knows
-- Returns  1 when the rebuild may go on; 0 when the caller does not hold the rebuild lock.
-- Never    marks the epoch for a caller without the lock; never lowers the counter. The counter
--          is raised to a floor from Redis server time (ms x 1024) and above the caller's highest
--          token, so tokens drawn after the rebuild exceed every token drawn before the loss.

if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('DEL', KEYS[4], KEYS[5])
local floor = math.max(now_ms() * 1024, tonumber(ARGV[3] or '0') + 1)
if tonumber(redis.call('GET', KEYS[3]) or '0') < floor then
  redis.call('SET', KEYS[3], string.format('%d', floor))
end
return 1
