-- store_lanes.lua: publishes a freshly computed lane count, stamped with Redis server time, and
-- the survey of blocked resources and the waiting tasks by domain when the pass took them (a full
-- pass; a maintained pass leaves the last survey and its own stamp in place).
--
-- KEYS[1]  PREFIX:lanes   hash {value, at, blocked, waiting, surveyed_at}
-- ARGV     the lane count, the survey (JSON: [[resource, waiting, head task id], ...]) or "",
--          the waiting tasks by domain (JSON: {"top": [[domain, n], ...], "rest": n})
-- Returns  the stamp (ms since the epoch, server time).
-- Never    touches lock state.

local now = now_ms()
if ARGV[2] == '' then
  redis.call('HSET', KEYS[1], 'value', ARGV[1], 'at', now)
else
  redis.call('HSET', KEYS[1], 'value', ARGV[1], 'at', now, 'blocked', ARGV[2],
             'waiting', ARGV[3], 'surveyed_at', now)
end
return now
