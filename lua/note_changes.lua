-- note_changes.lua: records that waiting tasks needing these resources may have become ready
-- without a lock being released (a waiting task canceled, a claim put back in the queue), so
-- scan hints that relied on them are dropped.
--
-- KEYS[1]  PREFIX:changes   (KEYS[2] PREFIX:changeseq, KEYS[3] PREFIX:changefloor: written by
--          lib.lua's note_changes through the prefix)
-- ARGV     prefix (with hash tag), resource names... ("*" for anything)
-- Returns  the sequence number of the change recorded (0 when no name was given), and the lock
--          state's epoch it belongs to ("" when there is none), so that the replica knows the
--          change it made without reading the log back.
-- Never    touches locks or leases.

local names = {}
for i = 2, #ARGV do
  names[#names + 1] = ARGV[i]
end
note_changes(ARGV[1], names)
return { noted.seq, redis.call('GET', ARGV[1] .. ':epoch') or '' }
