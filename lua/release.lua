-- release.lua: releases tasks' locks, each for the lease that holds it (checked release). One call
-- for the releases that arrive together (src/batch.rs).
--
-- KEYS     PREFIX:task:<task_id> of each task, in order
-- ARGV     prefix (with hash tag), then for each task: task_id, lease_id, fencing_token
-- Returns  for each task in order, code then the app_status_id of the caller's lease (or ""),
--          code being 1 released; 0 nothing held (already released: idempotent); -1 held by
--          another lease; -2 held by this lease under another fencing token.
-- Never    releases a lock for a caller that is not its holder with the holder's token.

local prefix = ARGV[1]
local replies = {}
for i = 1, #KEYS do
  local task_id, lease_id, token = ARGV[3 * i - 1], ARGV[3 * i], ARGV[3 * i + 1]
  local app_status = redis.call('HGET', prefix .. ':lease:' .. lease_id, 'app_status') or ''
  local lock = redis.call('HMGET', KEYS[i], 'lease', 'token')
  local code = 1
  if not lock[1] then
    code = 0
  elseif lock[1] ~= lease_id then
    code = -1
  elseif lock[2] ~= token then
    code = -2
  else
    release_task(prefix, task_id)
  end
  replies[#replies + 1] = code
  replies[#replies + 1] = app_status
end
return replies
