-- note_changes.lua: records that waiting tasks needing these resources may have become ready
-- without a lock being released (a waiting task canceled, a claim put back in the queue), so
-- scan hints that relied on them are dropped.
--
-- KEYS[1]  PREFIX:changes   (KEYS[2] PREFIX:changeseq, KEYS[3] PREFIX:changefloor: written by
--          lib.lua's note_changes through the prefix)
-- ARGV     prefix (with hash tag), resource names... ("*" for anything)
-- Returns  the new change sequence.
-- Never    touches locks or leases.

local names = {}
for i = 2, #ARGV do
  names[#names + 1] = ARGV[i]
end
note_changes(ARGV[1], names)
return tonumber(redis.call('GET', ARGV[1] .. ':changeseq') or '0')
