-- One worker per GPU name at a time: register this worker for the GPU and stamp its heartbeat,
-- unless another worker (another host, or another process) holds the name with a heartbeat
-- younger than fresh_s. Two nodes started with the same name would otherwise consume one
-- another's queues and hand back one another's prompts. Every heartbeat claims again, so a
-- worker learns at once when another took the name over.
--- keys: workers seen
--- args: gpu registration fresh_s mode
-- workers: GPU -> registration JSON; seen: GPU -> heartbeat time. registration: this worker's
-- (its `host` and `pid` say who it is); fresh_s negative: take the name whatever holds it (the
-- caller knows that holder is dead); mode: "claim", or "release" (a clean stop removes the
-- stamp, if it is still ours). Returns "" when claimed (or released), else the holder's JSON.
local mine, fresh = cjson.decode(registration), tonumber(fresh_s)
local raw = redis.call('HGET', workers, gpu)
local holder = nil
if raw then
  local ok, decoded = pcall(cjson.decode, raw)
  if ok and type(decoded) == 'table' and decoded.host ~= nil and decoded.pid ~= nil then
    holder = decoded
  end
end
local ours = holder == nil or (holder.host == mine.host and tonumber(holder.pid) == tonumber(mine.pid))
if mode == 'release' then
  if ours then
    redis.call('HDEL', seen, gpu)
  end
  return ''
end
local now = redis.call('TIME')
now = tonumber(now[1]) + tonumber(now[2]) / 1e6
if not ours and fresh >= 0 then
  local last = tonumber(redis.call('HGET', seen, gpu))
  if last and now - last < fresh then
    return raw
  end
end
if not ours or raw ~= registration then
  redis.call('HSET', workers, gpu, registration)
end
redis.call('HSET', seen, gpu, string.format('%.3f', now))
return ''
