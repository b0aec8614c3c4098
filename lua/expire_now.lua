-- expire_now.lua: ends a lease's life at once (no more grants, no heartbeat revives it) and
-- returns what ending it must clean up. The first step of CloseLease and of every sweep; if a
-- later step fails, the sweeper finds the lease expired and finishes the job.
--
-- KEYS[1]  PREFIX:leases             sorted set lease_id -> expiry (ms)
-- KEYS[2]  PREFIX:lease:<id>         lease hash
-- KEYS[3]  PREFIX:lease:<id>:tasks   the lease's registry
-- ARGV     lease_id, "rotate" to move an already expired lease behind the others, the key prefix
-- Returns  {app_status_id, owned ("1"/"0"), task_id, ...}: the registry's tasks but those whose
--          lock names another lease (close_lease.lua leaves their locks alone too, and their
--          rows are that lease's to end, even where both leases name one core_appstatus row);
--          {} when the lease is unknown.
-- Never    releases a lock; close_lease.lua does.

local lease = redis.call('HMGET', KEYS[2], 'app_status', 'owned')
if not lease[1] then
  return {}
end
-- Expired as of now; a lease whose clean-up fails is expired again later, so it moves behind
-- the others and cannot hold up the sweeper.
local now = now_ms()
local expires = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not expires or tonumber(expires) > now or ARGV[2] == 'rotate' then
  redis.call('ZADD', KEYS[1], now, ARGV[1])
end
local reply = {lease[1], lease[2] or '0'}
for _, task_id in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  local holder = redis.call('HGET', ARGV[3] .. ':task:' .. task_id, 'lease')
  if not holder or holder == ARGV[1] then
    reply[#reply + 1] = task_id
  end
end
return reply
