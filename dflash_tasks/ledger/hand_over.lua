-- A generation moved off a GPU (take.lua ordered it, or its worker is stopping): its worker
-- aborted it and read what it had generated there. The prompt's entry becomes the one that goes
-- on from there (its messages, its partial output's exact ids and texts), and the prompt moves
-- from that GPU's in-flight set to the target GPU's (the caller then publishes its message
-- there), or, with no target (a warm stop), to the front of pending. Only while the order is
-- still this one and the prompt is still in flight where it was: one recalled, done or deleted
-- meanwhile is left as it is, and its row is recorded once whatever arrives.
-- KEYS: migrating, inflight(from), inflight(to) (not touched without a target), prompts, pending,
--       counters, config
-- ARGV: id, entry, from, to ('' for pending), tokens (what was generated on `from`)
-- Returns 1 when it moved, 0 otherwise.
local id, from, to = ARGV[1], ARGV[3], ARGV[4]
if redis.call('EXISTS', KEYS[7]) == 0 then
  return 0
end
if to ~= '' then
  local order = redis.call('HGET', KEYS[1], id)
  if not order or string.sub(order, 1, #from + #to + 2) ~= from .. ' ' .. to .. ' ' then
    return 0
  end
end
redis.call('HDEL', KEYS[1], id)
if redis.call('ZREM', KEYS[2], id) == 0 then
  return 0
end
redis.call('HSET', KEYS[4], id, ARGV[2])
if to == '' then
  redis.call('LPUSH', KEYS[5], id)
else
  redis.call('ZADD', KEYS[3], redis.call('TIME')[1], id)
end
redis.call('HINCRBY', KEYS[6], 'migrated', 1)
redis.call('HINCRBY', KEYS[6], 'migrated_tokens', tonumber(ARGV[5]))
return 1
