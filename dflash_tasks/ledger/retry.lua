-- Before a prompt's transient failure is retried: count the retry, and keep the prompt's place in
-- its GPU's in-flight set fresh (the window counts it while it waits; the reaper leaves it alone).
-- The retry waits for its ETA in the worker, unacknowledged: it is recorded in the GPU's
-- `retrying` set until the task runs again (Ledger.task_state takes it out), so status counts the
-- retries waiting without reading the broker's messages.
-- KEYS: done, inflight(gpu), counters, config, retrying(gpu)     ARGV: id, reason, gpu, due
-- Returns 0 when the prompt is already done (another delivery finished it), or its job was
-- deleted: nothing to retry.
local id = ARGV[1]
if redis.call('EXISTS', KEYS[4]) == 0 then
  return 0
end
if redis.call('SISMEMBER', KEYS[1], id) == 1 then
  redis.call('ZREM', KEYS[2], id)
  return 0
end
redis.call('ZADD', KEYS[2], 'XX', redis.call('TIME')[1], id)
redis.call('ZADD', KEYS[5], tonumber(ARGV[4]), id)
redis.call('HINCRBY', KEYS[3], 'retries', 1)
redis.call('HINCRBY', KEYS[3], 'retry:' .. ARGV[2], 1)
redis.call('HINCRBY', KEYS[3], 'gpu:' .. ARGV[3] .. ':retries', 1)
return 1
