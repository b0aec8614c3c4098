-- lanes_cache.lua: reads the shared lane count and Redis server time, so every replica judges
-- its age by the same clock.
--
-- KEYS[1]  PREFIX:lanes   hash {value, at, surveyed_at}: the last lane count and when it was
--                         computed (ms), and when the last full pass surveyed the queue
-- ARGV     none
-- Returns  {value or -1 when none is cached, computed-at ms or 0, now ms, surveyed-at ms or 0}
-- Never    writes.

local cached = redis.call('HMGET', KEYS[1], 'value', 'at', 'surveyed_at')
return {tonumber(cached[1] or '-1'), tonumber(cached[2] or '0'), now_ms(), tonumber(cached[3] or '0')}
