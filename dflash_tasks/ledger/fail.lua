-- Move a prompt to the failed registry (a permanent error, or its transient retries exhausted).
-- KEYS: done, inflight(gpu), failed, counters, failures, pending, config, gpus
-- ARGV: id, record_json, gpu, inflight_prefix
-- The prompt's messages stay in `prompts`, so `manage.py retry-failed` can dispatch it again.
-- Returns 1 when newly failed, 0 when already done or already failed (the record is updated),
-- or when the job was deleted while the request ran (nothing is written).
local id = ARGV[1]
if redis.call('EXISTS', KEYS[7]) == 0 then
  return 0
end
local was_here = redis.call('ZREM', KEYS[2], id)
if redis.call('SISMEMBER', KEYS[1], id) == 1 then
  return 0
end
if redis.call('HSET', KEYS[3], id, ARGV[2]) == 1 then
  if was_here == 0 then forget_elsewhere(id, KEYS[6], KEYS[8], ARGV[4], ARGV[3]) end
  redis.call('HINCRBY', KEYS[4], 'failed', 1)
  redis.call('HINCRBY', KEYS[5], id, 1)
  return 1
end
return 0
