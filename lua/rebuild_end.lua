-- rebuild_end.lua: finishes a rebuild: publishes the new epoch and frees the rebuild lock, if and
-- only if the epoch is still this rebuild's (no newer rebuild took over meanwhile).
--
-- KEYS[1]  PREFIX:recovery   the rebuild lock
-- KEYS[2]  PREFIX:epoch      the lock state's identity
-- ARGV     replica id, this rebuild's epoch value, the new epoch
-- Returns  1 when published; 0 when another rebuild owns the state now (nothing changed).
-- Never    overwrites an epoch it did not set.

if redis.call('GET', KEYS[2]) ~= ARGV[2] then
  return 0
end
redis.call('SET', KEYS[2], ARGV[3])
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
end
return 1
