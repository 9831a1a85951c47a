-- A message whose prompt already has its outcome (done, or in the failed registry) or left the
-- job: take the id out of this GPU's in-flight set, in the same step as the check. Between the
-- task's read and this write the prompt may have come back (retry-failed, regenerate) and been
-- dispatched here again: that fresh entry is the new message's, and stays.
--- keys: inflight done failed prompts
--- args: id
-- inflight: the GPU's. Returns 1 when removed, 0 when the prompt is back in play (its entry is
-- left).
if redis.call('SISMEMBER', done, id) == 1 or redis.call('HEXISTS', failed, id) == 1
   or redis.call('HEXISTS', prompts, id) == 0 then
  return redis.call('ZREM', inflight, id)
end
return 0
