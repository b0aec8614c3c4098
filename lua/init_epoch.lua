-- init_epoch.lua: gives a lock state its identity when it has none (a fresh or emptied Redis),
-- and raises the fencing counter to a floor taken from Redis server time, so tokens drawn after a
-- loss of state are greater than every token drawn before it (as long as fewer than 1,024 grants
-- per millisecond were made on average since the previous floor).
--
-- KEYS[1]  PREFIX:epoch    KEYS[2]  PREFIX:fence
-- ARGV     a new epoch value to use if none is set
-- Returns  {epoch now in force, 1 if this call set it / 0 if one was there}
-- Never    replaces an epoch that exists, never lowers the counter.

local current = redis.call('GET', KEYS[1])
if current then
  return {current, 0}
end
local floor = now_ms() * 1024
if tonumber(redis.call('GET', KEYS[2]) or '0') < floor then
  redis.call('SET', KEYS[2], floor)
end
redis.call('SET', KEYS[1], ARGV[1])
return {ARGV[1], 1}
