-- A spooled batch reached the storage: its manifest record becomes the shipped one and its
-- counters move (out of the spool, into the S3 totals), once: only if the record is still the
-- spooled one this writer read (compare and set), so a retried or doubled step counts nothing.
-- KEYS: manifest, counters
-- ARGV: name, the spooled record as read, the shipped record, then pairs (counter, increment)
-- Returns 1 when it switched the record, 0 when it was not the spooled one any more.
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
for i = 4, #ARGV - 1, 2 do
  redis.call('HINCRBY', KEYS[2], ARGV[i], tonumber(ARGV[i + 1]))
end
return 1
