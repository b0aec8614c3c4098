-- lease_info.lua: reads a lease and tells whether it is alive, without extending it.
--
-- KEYS[1]  PREFIX:epoch           the lock state's identity
-- KEYS[2]  PREFIX:leases          sorted set lease_id -> expiry (ms)
-- KEYS[3]  PREFIX:lease:<id>      lease hash
-- KEYS[4]  PREFIX:changes         sorted set of changed names -> change sequence number
-- KEYS[5]  PREFIX:changeseq       the change counter
-- KEYS[6]  PREFIX:changefloor     changes at or below this sequence number were trimmed away
-- ARGV     epoch, lease_id, the scan hint's sequence number ('' without a hint)
-- Returns  {1, expiry ms, app_status_id, versions JSON, worker name, change counter, what
--          changed since ARGV[3]: 'fresh' (nothing), 'changed' followed by the names, or 'stale'
--          (no hint, the log no longer reaches back to it, or 1,000 names or more)}; {0} when the
--          lease is unknown or expired (judged by Redis server time); {-2} when the lock state is
--          not the expected one.
-- Never    writes.

if not epoch_ok(KEYS[1], ARGV[1]) then
  return {-2}
end
local expires = redis.call('ZSCORE', KEYS[2], ARGV[2])
local lease = redis.call('HMGET', KEYS[3], 'app_status', 'versions', 'worker')
if not expires or not lease[1] or tonumber(expires) <= now_ms() then
  return {0}
end
local seq = tonumber(redis.call('GET', KEYS[5]) or '0')
local reply = {1, tonumber(expires), lease[1], lease[2], lease[3], seq}
if ARGV[3] == '' then
  reply[#reply + 1] = 'stale'
  return reply
end
local since = tonumber(ARGV[3])
if since < tonumber(redis.call('GET', KEYS[6]) or '0') then
  reply[#reply + 1] = 'stale'
  return reply
end
local changed = redis.call('ZRANGEBYSCORE', KEYS[4], '(' .. since, '+inf', 'LIMIT', 0, 1000)
if #changed >= 1000 then
  reply[#reply + 1] = 'stale'
  return reply
end
reply[#reply + 1] = (#changed == 0) and 'fresh' or 'changed'
for _, name in ipairs(changed) do
  reply[#reply + 1] = name
end
return reply
