-- Top one GPU's window up: move ids from pending to that GPU's in-flight set.
-- KEYS: config, pending, inflight(gpu)     ARGV: window
-- Returns the ids to publish; none unless the job is running.
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then
  return {}
end
local room = tonumber(ARGV[1]) - redis.call('ZCARD', KEYS[3])
if room <= 0 then
  return {}
end
local ids = redis.call('LPOP', KEYS[2], room)
if not ids then
  return {}
end
local now = redis.call('TIME')[1]
for _, id in ipairs(ids) do
  redis.call('ZADD', KEYS[3], now, id)
end
return ids
