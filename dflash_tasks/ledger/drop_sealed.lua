-- Remove a sealed batch's rows from the output stream (batches.py's last step but one), and
-- their share of what beat's tick reads instead of the rows (complete.lua adds it):
-- `unsealed_bytes`, and `unsealed_since_ms`, now the time of the first row after the batch. That
-- row is read here, inside Redis, once per batch: beat receives its id's time, never the row.
-- KEYS: output, counters
-- ARGV: the batch's bytes as complete.lua counted them, then its entry ids
-- Returns how many entries were removed.
local removed = 0
for i = 2, #ARGV, 1000 do  -- unpack has a limit on arguments; a batch may hold more rows
  removed = removed + redis.call('XDEL', KEYS[1], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)[1]
if first == nil then
  -- Nothing waits: exactly zero, whatever a job begun before these counters existed kept.
  redis.call('HDEL', KEYS[2], 'unsealed_bytes', 'unsealed_since_ms')
  return removed
end
if removed > 0 then
  redis.call('HINCRBY', KEYS[2], 'unsealed_bytes', -tonumber(ARGV[1]))
end
redis.call('HSET', KEYS[2], 'unsealed_since_ms', string.match(first[1], '^%d+'))
return removed
