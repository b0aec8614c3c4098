-- store_lanes.lua: publishes a freshly computed lane count and the survey of blocked resources
-- from the same pass, stamped with Redis server time.
--
-- KEYS[1]  PREFIX:lanes   hash {value, at, blocked}
-- ARGV     the lane count, the survey (JSON: [[resource, waiting, head task id], ...])
-- Returns  the stamp (ms since the epoch, server time).
-- Never    touches lock state.

local now = now_ms()
redis.call('HSET', KEYS[1], 'value', ARGV[1], 'at', now, 'blocked', ARGV[2])
return now
