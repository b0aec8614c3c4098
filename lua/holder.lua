-- holder.lua: checks that a lease is alive and holds a task under a fencing token.
--
-- KEYS[1]  PREFIX:leases            sorted set lease_id -> expiry (ms)
-- KEYS[2]  PREFIX:lease:<id>        lease hash
-- KEYS[3]  PREFIX:task:<task_id>    the task lock
-- ARGV     lease_id, fencing_token
-- Returns  {code, app_status_id}: 1 holds it; 0 lease unknown or expired; -1 the task lock is
--          gone or another lease's; -2 this lease holds it under another fencing token.
-- Never    writes.

local expires = redis.call('ZSCORE', KEYS[1], ARGV[1])
local app_status = redis.call('HGET', KEYS[2], 'app_status')
if not expires or not app_status or tonumber(expires) <= now_ms() then
  return {0, ''}
end
local lock = redis.call('HMGET', KEYS[3], 'lease', 'token')
if lock[1] ~= ARGV[1] then
  return {-1, app_status}
end
if lock[2] ~= ARGV[2] then
  return {-2, app_status}
end
return {1, app_status}
