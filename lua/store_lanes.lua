-- store_lanes.lua: publishes a freshly computed lane count, stamped with Redis server time.
--
-- KEYS[1]  PREFIX:lanes   hash {value, at}
-- ARGV     the lane count
-- Returns  the stamp (ms since the epoch, server time).
-- Never    touches lock state.

local now = now_ms()
redis.call('HSET', KEYS[1], 'value', ARGV[1], 'at', now)
return now
