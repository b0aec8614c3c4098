-- release.lua: releases one task's locks for the lease that holds them (checked release).
--
-- KEYS[1]  PREFIX:task:<task_id>   the task lock
-- ARGV     prefix (with hash tag), task_id, lease_id, fencing_token
-- Returns  {code, app_status_id of the caller's lease (or "")}, code being
--          1 released; 0 nothing held (already released: idempotent);
--          -1 held by another lease; -2 held by this lease under another fencing token.
-- Never    releases a lock for a caller that is not its holder with the holder's token.

local app_status = redis.call('HGET', ARGV[1] .. ':lease:' .. ARGV[3], 'app_status') or ''
local lock = redis.call('HMGET', KEYS[1], 'lease', 'token')
if not lock[1] then
  return {0, app_status}
end
if lock[1] ~= ARGV[3] then
  return {-1, app_status}
end
if lock[2] ~= ARGV[4] then
  return {-2, app_status}
end
release_task(ARGV[1], ARGV[2])
return {1, app_status}
