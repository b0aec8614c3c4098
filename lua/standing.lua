-- standing.lua: what holds locks now, for fair dispatch (src/fair.rs): the tasks holding locks by
-- group, the deferred ones among them, and the live leases.
--
-- KEYS[1]  PREFIX:running    hash group -> tasks of that group holding locks
-- KEYS[2]  PREFIX:deferred   the number of deferred tasks holding locks
-- KEYS[3]  PREFIX:leases     sorted set lease_id -> expiry (ms)
-- ARGV     none
-- Returns  {deferred, live leases, group, count, group, count, ...}
-- Never    writes.

local reply = {
  tonumber(redis.call('GET', KEYS[2]) or '0'),
  redis.call('ZCOUNT', KEYS[3], '(' .. now_ms(), '+inf'),
}
local running = redis.call('HGETALL', KEYS[1])
for i = 1, #running, 2 do
  reply[#reply + 1] = running[i]
  reply[#reply + 1] = tonumber(running[i + 1])
end
return reply
