-- release.lua: releases tasks' locks, each for the lease that holds it (checked release). One call
-- for the releases that arrive together (src/batch.rs).
--
-- KEYS     PREFIX:task:<task_id> of each task, in order
-- ARGV     prefix (with hash tag), then for each task: task_id, lease_id, fencing_token, and "1"
--          when the release ends a FinishTask (then noted in the lease's hash as its last
--          finished task, "task_id:fencing_token", so that a retry of that FinishTask is known),
--          else "0"
-- Returns  for each task in order: code, the app_status_id of the caller's lease (or ""), and
--          the change this release recorded in PREFIX:changes, as its sequence number (0: none)
--          and its names (an array), so that the replica knows the changes it made without
--          reading the log back; code being 1 released; 0 nothing held (already released:
--          idempotent); -1 held by another lease; -2 held by this lease under another fencing
--          token; after them all, the lock state's epoch ("" when it has none), which those
--          sequence numbers belong to.
-- Never    releases a lock for a caller that is not its holder with the holder's token.

local prefix = ARGV[1]
local replies = {}
for i = 1, #KEYS do
  local task_id, lease_id, token = ARGV[4 * i - 2], ARGV[4 * i - 1], ARGV[4 * i]
  local finished = ARGV[4 * i + 1] == '1'
  local lease_key = prefix .. ':lease:' .. lease_id
  local app_status = redis.call('HGET', lease_key, 'app_status') or ''
  local lock = redis.call('HMGET', KEYS[i], 'lease', 'token')
  local code = 1
  noted.seq, noted.names = 0, {}
  if not lock[1] then
    code = 0
  elseif lock[1] ~= lease_id then
    code = -1
  elseif lock[2] ~= token then
    code = -2
  else
    release_task(prefix, task_id)
    if finished and app_status ~= '' then
      redis.call('HSET', lease_key, 'finished', task_id .. ':' .. token)
    end
  end
  replies[#replies + 1] = code
  replies[#replies + 1] = app_status
  replies[#replies + 1] = noted.seq
  replies[#replies + 1] = noted.names
end
replies[#replies + 1] = redis.call('GET', prefix .. ':epoch') or ''
return replies
