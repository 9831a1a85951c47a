-- Store new prompts and queue them for dispatch, skipping ids already known (resume).
--- keys: prompts pending done counters config
--- args: ...items
-- items: id1, messages1, id2, messages2, ...
-- Returns the number of prompts added, or -1 when the job no longer exists (deleted while its
-- dataset was read: nothing is written). A done job with new prompts runs again in this step.
-- A few commands per chunk, not per prompt: one SMISMEMBER for the done marks, one HSETNX per
-- prompt, one RPUSH of the new ids (in slices: Lua's unpack takes a few thousand values at most).
local SLICE = 1000
if redis.call('EXISTS', config) == 0 then
  return -1
end
local added, ids = {}, {}
for i = 1, #items, 2 do
  ids[#ids + 1] = items[i]
end
for first = 1, #ids, SLICE do
  local last = math.min(first + SLICE - 1, #ids)
  local is_done = redis.call('SMISMEMBER', done, unpack(ids, first, last))
  for j = first, last do
    if is_done[j - first + 1] == 0 and redis.call('HSETNX', prompts, ids[j], items[2 * j]) == 1 then
      added[#added + 1] = ids[j]
    end
  end
end
for first = 1, #added, SLICE do
  redis.call('RPUSH', pending, unpack(added, first, math.min(first + SLICE - 1, #added)))
end
if #added > 0 then
  redis.call('HINCRBY', counters, 'total', #added)
  if redis.call('HGET', config, 'status') == 'done' then
    redis.call('HSET', config, 'status', 'running')
  end
end
return #added
