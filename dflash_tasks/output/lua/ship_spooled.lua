-- A spooled batch reached the storage: its manifest record becomes the shipped one and its
-- counters move (out of the spool, into the S3 totals), once: only if the record is still the
-- spooled one this writer read (compare and set), so a retried or doubled step counts nothing.
--- keys: manifest counters
--- args: name spooled shipped ...increments
-- spooled: the record as read; shipped: the new one; increments: pairs (counter, increment).
-- Returns 1 when it switched the record, 0 when it was not the spooled one any more.
if redis.call('HGET', manifest, name) ~= spooled then
  return 0
end
redis.call('HSET', manifest, name, shipped)
for i = 1, #increments - 1, 2 do
  redis.call('HINCRBY', counters, increments[i], tonumber(increments[i + 1]))
end
return 1
