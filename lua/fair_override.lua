-- fair_override.lua: records overrides of the fairness policy made at run time (SetFairness),
-- each field on its own so that two operators' overrides never undo each other. Overrides made
-- over another policy file (another base) are dropped first: a new policy file ends them.
--
-- KEYS[1]  PREFIX:fair:overrides   hash {base, reserve, weight:<group>, cap:<group>}
-- ARGV     the base (the hash of the policy file's text, 0 for none), then field, value pairs
-- Returns  every field kept now: {field, value, ...}
-- Never    touches lock state.

if redis.call('HGET', KEYS[1], 'base') ~= ARGV[1] then
  redis.call('DEL', KEYS[1])
end
redis.call('HSET', KEYS[1], 'base', ARGV[1], unpack(ARGV, 2))
return redis.call('HGETALL', KEYS[1])
