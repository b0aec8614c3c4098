-- holder.lua: checks, for each of a number of (lease, task, fencing token), that the lease is
-- alive and holds the task under the token. One call checks a fetch round's grants.
--
-- KEYS[1]  PREFIX:leases            sorted set lease_id -> expiry (ms)
-- then for each check:
--          PREFIX:lease:<id>        lease hash
--          PREFIX:task:<task_id>    the task lock
-- ARGV     for each check: lease_id, fencing_token
-- Returns  for each check in order, code then app_status_id: 1 holds it; 0 lease unknown or
--          expired; -1 the task lock is gone or another lease's; -2 this lease holds it under
--          another fencing token.
-- Never    writes.

local now = now_ms()
local replies = {}
for i = 1, #ARGV / 2 do
  local lease_id, token = ARGV[2 * i - 1], ARGV[2 * i]
  local expires = redis.call('ZSCORE', KEYS[1], lease_id)
  local app_status = redis.call('HGET', KEYS[2 * i], 'app_status')
  if not expires or not app_status or tonumber(expires) <= now then
    replies[#replies + 1] = 0
    replies[#replies + 1] = ''
  else
    local lock = redis.call('HMGET', KEYS[2 * i + 1], 'lease', 'token')
    local code = 1
    if lock[1] ~= lease_id then
      code = -1
    elseif lock[2] ~= token then
      code = -2
    end
    replies[#replies + 1] = code
    replies[#replies + 1] = app_status
  end
end
return replies
