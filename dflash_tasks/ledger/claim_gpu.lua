-- One worker per GPU name at a time: register this worker for the GPU and stamp its heartbeat,
-- unless another worker (another host, or another process) holds the name with a heartbeat
-- younger than fresh_s. Two nodes started with the same name would otherwise consume one
-- another's queues and hand back one another's prompts. Every heartbeat claims again, so a
-- worker learns at once when another took the name over.
-- KEYS: workers (GPU -> registration JSON), workers:seen (GPU -> heartbeat time)
-- ARGV: gpu, this worker's registration JSON (its `host` and `pid` say who it is), fresh_s
--       (negative: take the name whatever holds it: the caller knows that holder is dead),
--       mode ("claim", or "release": a clean stop removes the stamp, if it is still ours)
-- Returns "" when claimed (or released), else the holder's registration JSON.
local gpu, mine, fresh_s, mode = ARGV[1], cjson.decode(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local raw = redis.call('HGET', KEYS[1], gpu)
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
    redis.call('HDEL', KEYS[2], gpu)
  end
  return ''
end
local now = redis.call('TIME')
now = tonumber(now[1]) + tonumber(now[2]) / 1e6
if not ours and fresh_s >= 0 then
  local seen = tonumber(redis.call('HGET', KEYS[2], gpu))
  if seen and now - seen < fresh_s then
    return raw
  end
end
if not ours or raw ~= ARGV[2] then
  redis.call('HSET', KEYS[1], gpu, ARGV[2])
end
redis.call('HSET', KEYS[2], gpu, string.format('%.3f', now))
return ''
