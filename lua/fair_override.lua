-- fair_override.lua: records overrides of the fairness policy made at run time (SetFairness),
-- each field on its own so that two operators' overrides never undo each other. Refused while
-- overrides made over another policy file (another base) are kept: the replicas may disagree on
-- the file during a rollout, and one on the old file must not erase what was made over the new.
--
-- KEYS[1]  PREFIX:fair:overrides   hash {base, reserve, weight:<group>, cap:<group>}
-- ARGV     the base (the hash of the policy file's text, 0 for none), then field, value pairs
-- Returns  {1, field, value, ...}: every field kept now; or {0, the base kept}: refused
-- Never    touches lock state.

local base = redis.call('HGET', KEYS[1], 'base')
if base and base ~= ARGV[1] then
  return {0, base}
end
redis.call('HSET', KEYS[1], 'base', ARGV[1], unpack(ARGV, 2))
local kept = redis.call('HGETALL', KEYS[1])
table.insert(kept, 1, 1)
return kept
