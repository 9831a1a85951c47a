-- Before a prompt's transient failure is retried: count the retry, and keep the prompt's place in
-- its GPU's in-flight set fresh (the window counts it while it waits; the reaper leaves it alone).
-- The retry waits for its ETA in the worker, unacknowledged: it is recorded in the GPU's
-- `retrying` set until the task runs again (Ledger.task_state takes it out), so status counts the
-- retries waiting without reading the broker's messages.
--- keys: done inflight counters config retrying
--- args: id reason gpu due
-- inflight, retrying: the GPU's. Returns 0 when the prompt is already done (another delivery
-- finished it), or its job was deleted: nothing to retry.
if redis.call('EXISTS', config) == 0 then
  return 0
end
if redis.call('SISMEMBER', done, id) == 1 then
  redis.call('ZREM', inflight, id)
  return 0
end
redis.call('ZADD', inflight, 'XX', redis.call('TIME')[1], id)
redis.call('ZADD', retrying, tonumber(due), id)
redis.call('HINCRBY', counters, 'retries', 1)
redis.call('HINCRBY', counters, 'retry:' .. reason, 1)
redis.call('HINCRBY', counters, 'gpu:' .. gpu .. ':retries', 1)
return 1
