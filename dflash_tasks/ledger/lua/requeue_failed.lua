-- `manage.py retry-failed`: move failed prompts back to the front of the job's pending list, in
-- one atomic step, so a prompt is always in exactly one place (registry, or dispatch) whatever
-- crashes. A prompt moves only if its registry record is still exactly the one the caller read,
-- so two runs at once, or a run repeated, never dispatch a prompt twice.
--- keys: config failed pending done prompts counters
--- args: ...items
-- items: id1, record1, id2, record2, ...
-- Returns {moved, missing}: missing = records left in place because the prompt's messages are gone.
local moved, missing = 0, 0
for i = 1, #items, 2 do
  local id, record = items[i], items[i + 1]
  if redis.call('HGET', failed, id) == record then
    if redis.call('SISMEMBER', done, id) == 1 then
      -- cannot happen (complete.lua clears the record, fail.lua skips done ids); if it does,
      -- the prompt is done: drop the stale record and its count
      redis.call('HDEL', failed, id)
      redis.call('HINCRBY', counters, 'failed', -1)
    elseif redis.call('HEXISTS', prompts, id) == 0 then
      missing = missing + 1
    else
      redis.call('HDEL', failed, id)
      redis.call('LPUSH', pending, id)
      moved = moved + 1
    end
  end
end
if moved > 0 then
  redis.call('HINCRBY', counters, 'failed', -moved)
  redis.call('HINCRBY', counters, 'requeued', moved)
  if redis.call('HGET', config, 'status') == 'done' then
    redis.call('HSET', config, 'status', 'running')
  end
end
return {moved, missing}
