-- lease_table.lua: one page of leases with what they hold, for the operator's view (ListLeases,
-- and the live leases' versions for ExplainTask). The cost is the number of leases plus what
-- the page's leases hold; never a keyspace scan.
--
-- KEYS[1]  PREFIX:leases          sorted set lease_id -> expiry (ms)
-- ARGV     prefix (with hash tag), worker-name filter (substring; "" for all), "1" to include
--          expired leases not yet swept, page token (the last lease id of the previous page;
--          "" for the first), page size, "1" for each lease's tasks and locks ("0": left empty)
-- Returns  {now ms, leases matching in all, then one entry per lease on the page, in lease id
--          order: {lease_id, expiry ms, worker, app_status_id, versions JSON,
--          {task_id, ...} (those whose lock names the lease), {record entry of each held lock
--          ("name" or "shared:name"), ...}}}
-- Never    writes.

local prefix, filter, with_expired, after = ARGV[1], ARGV[2], ARGV[3] == '1', ARGV[4]
local limit = tonumber(ARGV[5])
local details = ARGV[6] == '1'
local now = now_ms()
local ids
if with_expired then
  ids = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
else
  ids = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf', 'WITHSCORES')
end
local matching = {}
local expiry = {}
for i = 1, #ids, 2 do
  local id = ids[i]
  local lease = redis.call('HMGET', prefix .. ':lease:' .. id, 'worker', 'app_status', 'versions')
  if lease[2] and (filter == '' or string.find(lease[1] or '', filter, 1, true)) then
    matching[#matching + 1] = id
    expiry[id] = {tonumber(ids[i + 1]), lease[1] or '', lease[2], lease[3] or '{}'}
  end
end
table.sort(matching)
local reply = {now, #matching}
for _, id in ipairs(matching) do
  if #reply - 2 >= limit then
    break
  end
  if id > after then
    local tasks = {}
    if details then
      local holding = lease_holding(prefix, id, {})
      for i = 1, #holding, 2 do
        tasks[#tasks + 1] = holding[i]
      end
      table.sort(tasks)
    end
    local held = {}
    for _, task_id in ipairs(tasks) do
      local lock = redis.call('HMGET', prefix .. ':task:' .. task_id, 'x', 's')
      for _, name in ipairs(split_names(lock[1])) do
        held[#held + 1] = name
      end
      for _, name in ipairs(split_names(lock[2])) do
        held[#held + 1] = 'shared:' .. name
      end
    end
    local e = expiry[id]
    reply[#reply + 1] = {id, e[1], e[2], e[3], e[4], tasks, held}
  end
end
return reply
