-- Store new prompts and queue them for dispatch, skipping ids already known (resume).
-- KEYS: prompts, pending, done, counters     ARGV: id1, json1, id2, json2, ...
-- Returns the number of prompts added.
local added = 0
for i = 1, #ARGV, 2 do
  local id = ARGV[i]
  if redis.call('SISMEMBER', KEYS[3], id) == 0
     and redis.call('HSETNX', KEYS[1], id, ARGV[i + 1]) == 1 then
    redis.call('RPUSH', KEYS[2], id)
    added = added + 1
  end
end
if added > 0 then
  redis.call('HINCRBY', KEYS[4], 'total', added)
end
return added
