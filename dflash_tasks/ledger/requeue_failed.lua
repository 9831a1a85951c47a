-- `manage.py retry-failed`: move failed prompts back to the front of the job's pending list, in
-- one atomic step, so a prompt is always in exactly one place (registry, or dispatch) whatever
-- crashes. A prompt moves only if its registry record is still exactly the one the caller read,
-- so two runs at once, or a run repeated, never dispatch a prompt twice.
-- KEYS: config, failed, pending, done, prompts, counters
-- ARGV: id1, record1, id2, record2, ...
-- Returns {moved, missing}: missing = records left in place because the prompt's messages are gone.
local moved, missing = 0, 0
for i = 1, #ARGV, 2 do
  local id, record = ARGV[i], ARGV[i + 1]
  if redis.call('HGET', KEYS[2], id) == record then
    if redis.call('SISMEMBER', KEYS[4], id) == 1 then
      -- cannot happen (complete.lua clears the record, fail.lua skips done ids); if it does,
      -- the prompt is done: drop the stale record and its count
      redis.call('HDEL', KEYS[2], id)
      redis.call('HINCRBY', KEYS[6], 'failed', -1)
    elseif redis.call('HEXISTS', KEYS[5], id) == 0 then
      missing = missing + 1
    else
      redis.call('HDEL', KEYS[2], id)
      redis.call('LPUSH', KEYS[3], id)
      moved = moved + 1
    end
  end
end
if moved > 0 then
  redis.call('HINCRBY', KEYS[6], 'failed', -moved)
  redis.call('HINCRBY', KEYS[6], 'requeued', moved)
  if redis.call('HGET', KEYS[1], 'status') == 'done' then
    redis.call('HSET', KEYS[1], 'status', 'running')
  end
end
return {moved, missing}
