-- force_release.lua: releases one task's locks whoever holds them. Used when the task itself is
-- over (canceled while waiting, finished: the reconciler), and by the audited ForceRelease only
-- for a lock whose lease record is gone; never while the holding lease lives.
--
-- KEYS[1]  PREFIX:task:<task_id>   the task lock
-- ARGV     prefix (with hash tag), task_id
-- Returns  the holding lease id when something was released, false when nothing was held.
-- Never    touches resource keys that name another task.

if redis.call('EXISTS', KEYS[1]) == 0 then
  return false
end
return release_task(ARGV[1], ARGV[2])
