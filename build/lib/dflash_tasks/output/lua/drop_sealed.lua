-- Remove a sealed batch's rows from the output stream (batches.py's last step but one), and
-- their share of what beat's tick reads instead of the rows (complete.lua adds it):
-- `unsealed_bytes`, and `unsealed_since_ms`, now the time of the first row after the batch. That
-- row is read here, inside Redis, once per batch: beat receives its id's time, never the row.
--- keys: output counters
--- args: bytes ...entries
-- bytes: the batch's as complete.lua counted them. Returns how many entries were removed.
local removed = 0
for i = 1, #entries, 1000 do  -- unpack has a limit on arguments; a batch may hold more rows
  removed = removed + redis.call('XDEL', output, unpack(entries, i, math.min(i + 999, #entries)))
end
local first = redis.call('XRANGE', output, '-', '+', 'COUNT', 1)[1]
if first == nil then
  -- Nothing waits: exactly zero, whatever a job begun before these counters existed kept.
  redis.call('HDEL', counters, 'unsealed_bytes', 'unsealed_since_ms')
  return removed
end
if removed > 0 then
  redis.call('HINCRBY', counters, 'unsealed_bytes', -tonumber(bytes))
end
redis.call('HSET', counters, 'unsealed_since_ms', string.match(first[1], '^%d+'))
return removed
