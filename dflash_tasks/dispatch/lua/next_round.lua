-- The end game in rounds: a generation sent for one round (at most a round's tokens more than it
-- had) came back cut there, its worker holding the exact ids. The prompt's entry becomes the one
-- that goes on from them, and the prompt leaves that GPU's in-flight set for the back of pending,
-- behind the prompts not started yet: every prompt is started before any goes on, and whichever
-- GPU frees a slot continues it. Only while the prompt is still in flight there: one recalled,
-- done or deleted meanwhile is left as it is, and its row is recorded once whatever arrives.
--- keys: inflight prompts pending counters config
--- args: id entry tokens
-- inflight: the GPU's the round ran on; tokens: what that round generated. Returns 1 when it
-- went back to pending, 0 otherwise.
if redis.call('EXISTS', config) == 0 then
  return 0
end
if redis.call('ZREM', inflight, id) == 0 then
  return 0
end
redis.call('HSET', prompts, id, entry)
redis.call('RPUSH', pending, id)
redis.call('HINCRBY', counters, 'rounds', 1)
redis.call('HINCRBY', counters, 'round_tokens', tonumber(tokens))
return 1
