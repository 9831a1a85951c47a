-- The end game in rounds: a generation sent for one round (at most a round's tokens more than it
-- had) came back cut there, its worker holding the exact ids. The prompt's entry becomes the one
-- that goes on from them, and the prompt leaves that GPU's in-flight set for the back of pending,
-- behind the prompts not started yet: every prompt is started before any goes on, and whichever
-- GPU frees a slot continues it. Only while the prompt is still in flight there and its entry is
-- still the one the round started from: one recalled, done or deleted meanwhile is left as it
-- is, and so is a stale second delivery of an earlier round (the generation has gone on since:
-- counting it would count that round twice). Its row is recorded once whatever arrives.
-- (generate.py also hands on this way a generation that ended while its text could not be
-- decoded: tokens 0, and the next GPU only decodes it.)
-- A conversation's reply made, with more to make (enqueue --turns all), goes on the same way
-- (turn = '1'), counted as a turn, and before the end game to the *front* of pending
-- (front = '1'): the GPU that frees the slot takes it next, so the conversations in progress,
-- whose entries Redis holds, are about those in flight.
--- keys: inflight prompts pending counters config rate going_on
--- args: id entry tokens started_from gpu rate_bucket_s turn front held
--- uses: going_on
-- inflight: the GPU's the round ran on; tokens: what that round generated there (counted in
-- the job's and the GPU's rates now, when it was made); started_from: the SHA-1 of the entry the
-- round's task read; held: the tokens the generation has now (0, a reply starting, drops it).
-- Returns 1 when it went back to pending, 0 otherwise.
if redis.call('EXISTS', config) == 0 then
  return 0
end
if redis.sha1hex(redis.call('HGET', prompts, id) or '') ~= started_from then
  return 0
end
if redis.call('ZREM', inflight, id) == 0 then
  return 0
end
redis.call('HSET', prompts, id, entry)
keep_going_on(going_on, id, held)
local made = tonumber(tokens)
if front == '1' then
  redis.call('LPUSH', pending, id)
else
  redis.call('RPUSH', pending, id)
end
local now = tonumber(redis.call('TIME')[1])
local bucket = now - now % tonumber(rate_bucket_s)
if turn == '1' then
  redis.call('HINCRBY', counters, 'turns', 1)
  redis.call('HINCRBY', counters, 'turn_tokens', made)
  redis.call('HINCRBY', rate, 'r:' .. bucket, 1)  -- a reply made (progress.py's reply rate)
elseif made > 0 then
  redis.call('HINCRBY', counters, 'rounds', 1)
  redis.call('HINCRBY', counters, 'round_tokens', made)
end
if made > 0 then
  redis.call('HINCRBY', rate, 't:' .. bucket, made)
  redis.call('HINCRBY', rate, gpu .. ':t:' .. bucket, made)
end
return 1
