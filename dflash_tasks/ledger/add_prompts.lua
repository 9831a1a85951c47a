-- Store new prompts and queue them for dispatch, skipping ids already known (resume).
-- KEYS: prompts, pending, done, counters, config     ARGV: id1, messages1, id2, messages2, ...
-- Returns the number of prompts added, or -1 when the job no longer exists (deleted while its
-- dataset was read: nothing is written). A done job with new prompts runs again in this step.
-- A few commands per chunk, not per prompt: one SMISMEMBER for the done marks, one HSETNX per
-- prompt, one RPUSH of the new ids (in slices: Lua's unpack takes a few thousand values at most).
local SLICE = 1000
if redis.call('EXISTS', KEYS[5]) == 0 then
  return -1
end
local added, ids = {}, {}
for i = 1, #ARGV, 2 do
  ids[#ids + 1] = ARGV[i]
end
for first = 1, #ids, SLICE do
  local last = math.min(first + SLICE - 1, #ids)
  local done = redis.call('SMISMEMBER', KEYS[3], unpack(ids, first, last))
  for j = first, last do
    if done[j - first + 1] == 0 and redis.call('HSETNX', KEYS[1], ids[j], ARGV[2 * j]) == 1 then
      added[#added + 1] = ids[j]
    end
  end
end
for first = 1, #added, SLICE do
  redis.call('RPUSH', KEYS[2], unpack(added, first, math.min(first + SLICE - 1, #added)))
end
if #added > 0 then
  redis.call('HINCRBY', KEYS[4], 'total', #added)
  if redis.call('HGET', KEYS[5], 'status') == 'done' then
    redis.call('HSET', KEYS[5], 'status', 'running')
  end
end
return #added
