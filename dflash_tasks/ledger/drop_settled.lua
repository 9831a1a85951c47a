-- A message whose prompt already has its outcome (done, or in the failed registry) or left the
-- job: take the id out of this GPU's in-flight set, in the same step as the check. Between the
-- task's read and this write the prompt may have come back (retry-failed, regenerate) and been
-- dispatched here again: that fresh entry is the new message's, and stays.
-- KEYS: inflight(gpu), done, failed, prompts     ARGV: id
-- Returns 1 when removed, 0 when the prompt is back in play (its entry is left).
local id = ARGV[1]
if redis.call('SISMEMBER', KEYS[2], id) == 1 or redis.call('HEXISTS', KEYS[3], id) == 1
   or redis.call('HEXISTS', KEYS[4], id) == 0 then
  return redis.call('ZREM', KEYS[1], id)
end
return 0
