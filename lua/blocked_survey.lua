-- blocked_survey.lua: reads the survey of blocked resources that the last full lane pass
-- stored, with its stamp and Redis server time (so every replica judges its age alike).
--
-- KEYS[1]  PREFIX:lanes   hash {value, at, blocked, surveyed_at}
-- ARGV     none
-- Returns  {survey JSON or "" when none is stored, surveyed-at ms or 0, now ms}
-- Never    writes.

local cached = redis.call('HMGET', KEYS[1], 'blocked', 'surveyed_at', 'at')
return {cached[1] or '', tonumber(cached[2] or cached[3] or '0'), now_ms()}
