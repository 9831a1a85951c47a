-- Move a prompt to the failed registry (a permanent error, or its transient retries exhausted).
--- keys: done inflight failed counters failures pending config gpus
--- args: id record gpu inflight_prefix
--- uses: elsewhere
-- inflight: the GPU's. The prompt's messages stay in `prompts`, so `manage.py retry-failed` can
-- dispatch it again. Returns 1 when newly failed, 0 when already done or already failed (the
-- record is updated), or when the job was deleted while the request ran (nothing is written).
if redis.call('EXISTS', config) == 0 then
  return 0
end
local was_here = redis.call('ZREM', inflight, id)
if redis.call('SISMEMBER', done, id) == 1 then
  return 0
end
if redis.call('HSET', failed, id, record) == 1 then
  if was_here == 0 then forget_elsewhere(id, pending, gpus, inflight_prefix, gpu) end
  redis.call('HINCRBY', counters, 'failed', 1)
  redis.call('HINCRBY', failures, id, 1)
  return 1
end
return 0
