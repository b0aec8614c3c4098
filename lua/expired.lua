-- expired.lua: the sweeper's turn. Takes or renews the sweeper lock for the caller and, if the
-- caller holds it, lists expired leases.
--
-- KEYS[1]  PREFIX:sweeper   string: the id of the replica sweeping now (with a TTL)
-- KEYS[2]  PREFIX:leases    sorted set lease_id -> expiry (ms)
-- ARGV     sweeper id, lock TTL in ms, most leases to return
-- Returns  {1, lease_id, ...} when the caller holds the sweeper lock (the ids of expired leases,
--          oldest expiry first); {0} when another replica does.
-- Never    touches a lease; ending them is close_lease.lua's job.

local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then
  return {0}
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', tonumber(ARGV[2]))
local reply = {1}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now_ms(), 'LIMIT', 0, tonumber(ARGV[3]))) do
  reply[#reply + 1] = id
end
return reply
