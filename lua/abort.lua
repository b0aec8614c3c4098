-- abort.lua: releases a task's locks if this lease holds them, without a fencing token. Used only
-- by the broker itself when it cannot tell whether its own acquire went through (the call timed
-- out) and the task was never claimed, so no worker can hold that token yet.
--
-- KEYS[1]  PREFIX:task:<task_id>   the task lock
-- ARGV     prefix (with hash tag), task_id, lease_id
-- Returns  1 when released, 0 when the lease held nothing for this task.
-- Never    releases a lock another lease holds.

if redis.call('HGET', KEYS[1], 'lease') ~= ARGV[3] then
  return 0
end
release_task(ARGV[1], ARGV[2])
return 1
