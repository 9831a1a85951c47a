-- A generation moved off a GPU (take.lua ordered it, or its worker is stopping): its worker
-- aborted it and read what it had generated there. The prompt's entry becomes the one that goes
-- on from there (its messages, its partial output's exact ids and texts), and the prompt moves
-- from that GPU's in-flight set to the target GPU's (the caller then publishes its message
-- there), or, with no target (a warm stop), to the front of pending. Only while the order is
-- still this one, the prompt is still in flight where it was and its entry is still the one the
-- aborted request started from: one recalled, done or deleted meanwhile is left as it is, and
-- its row is recorded once whatever arrives.
--- keys: migrating inflight_source inflight_target prompts pending counters config rate going_on
--- args: id entry source target tokens started_from rate_bucket_s held
--- uses: going_on
-- inflight_target is not touched without a target; target: '' for pending; tokens: what was
-- generated on source (counted in the rates now, when it was made); started_from: the SHA-1 of
-- the entry the request's task read; held: the tokens the generation goes on from (0: it starts
-- over). Returns 1 when it moved, 0 otherwise.
if redis.call('EXISTS', config) == 0 then
  return 0
end
if target ~= '' then
  local order = redis.call('HGET', migrating, id)
  if not order or string.sub(order, 1, #source + #target + 2) ~= source .. ' ' .. target .. ' ' then
    return 0
  end
end
if redis.sha1hex(redis.call('HGET', prompts, id) or '') ~= started_from then
  return 0
end
redis.call('HDEL', migrating, id)
if redis.call('ZREM', inflight_source, id) == 0 then
  return 0
end
redis.call('HSET', prompts, id, entry)
keep_going_on(going_on, id, held)
if target == '' then
  redis.call('LPUSH', pending, id)
else
  redis.call('ZADD', inflight_target, redis.call('TIME')[1], id)
end
redis.call('HINCRBY', counters, 'migrated', 1)
redis.call('HINCRBY', counters, 'migrated_tokens', tonumber(tokens))
local now = tonumber(redis.call('TIME')[1])
local bucket = now - now % tonumber(rate_bucket_s)
redis.call('HINCRBY', rate, 't:' .. bucket, tonumber(tokens))
redis.call('HINCRBY', rate, source .. ':t:' .. bucket, tonumber(tokens))
return 1
