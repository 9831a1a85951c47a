-- Beat marks a job done only inside this one step, so `done` is a fact at the moment it is
-- written: the job is still running, every prompt has its outcome (completed + failed = total),
-- nothing waits to be dispatched, in flight on any of its GPUs (retries waiting for their ETA
-- are in flight too), in the output stream, in a batch being sealed, or in beat's spool. Whatever
-- puts work back afterwards (retry-failed, regenerate, a late row, an enqueue) moves the job back
-- to running in its own step (requeue_failed.lua, reopen.lua, complete.lua, add_prompts.lua).
--- keys: config counters pending output sealing gpus
--- args: inflight_prefix
-- Returns 'done', or what still holds the job (a short phrase; the status is unchanged).
if redis.call('HGET', config, 'status') ~= 'running' then
  return 'not running'
end
if redis.call('HEXISTS', config, 'incomplete') == 1 then
  return 'its dataset not all enqueued'  -- an enqueue interrupted midway (jobs.mark_incomplete)
end
local c = redis.call('HMGET', counters, 'total', 'completed', 'failed', 'spooled')
local total, completed, failed = tonumber(c[1]) or 0, tonumber(c[2]) or 0, tonumber(c[3]) or 0
if total == 0 or completed + failed ~= total then
  return 'completed ' .. completed .. ' + failed ' .. failed .. ' of ' .. total
end
local waiting = redis.call('LLEN', pending)
if waiting > 0 then
  return waiting .. ' pending'
end
for _, gpu in ipairs(redis.call('SMEMBERS', gpus)) do
  local n = redis.call('ZCARD', inflight_prefix .. gpu)
  if n > 0 then
    return n .. ' in flight on ' .. gpu
  end
end
local unsealed = redis.call('XLEN', output)
if unsealed > 0 then
  return unsealed .. ' rows not sealed'
end
if redis.call('EXISTS', sealing) == 1 then
  return 'a batch being sealed'
end
if (tonumber(c[4]) or 0) > 0 then
  return c[4] .. ' batches in the spool'
end
redis.call('HSET', config, 'status', 'done')
return 'done'
