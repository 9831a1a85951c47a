-- Record a finished prompt exactly once: done mark, counters and output row in one atomic step,
-- so the counters always equal what the output holds, whatever is delivered twice.
--- keys: done inflight prompts failed counters rate output pending config gpus ended speed superseding superseded going_on
--- args: id row input_tokens output_tokens finish_reason gpu rate_bucket_s hist_bucket inflight_prefix prompt tokens_per_s speed_weight shares made looping
--- uses: elsewhere shares
-- inflight: the GPU's; ended: the index of rows that ended finish_reason. prompt: its messages as
-- `prompts` stores them (empty: a reason not indexed); tokens_per_s: the request's (empty when
-- too short to say); shares: each GPU's tokens of a row made in several requests (shares.lua);
-- made: the tokens this last request generated here (the rates: a round handed on counted its
-- own when it was made, next_round.lua, and a truncated row's prefix was counted long ago);
-- looping: "1" when the row's output ends in a loop (output/loops.py), counted by finish reason
-- ("looping:length": the truncated rows not worth continuing) and marked in its index record.
-- Returns 1 when recorded, 0 when the id was already done (a duplicate delivery) or the job was
-- deleted while the request ran (nothing is written: its keys stay gone).
-- A row recorded after the job was marked done (a late delivery of a prompt in the failed
-- registry) moves it back to running in this step: beat ticks running jobs only, and a done
-- job's rows must all be shipped.
if redis.call('EXISTS', config) == 0 then
  return 0
end
local was_here = redis.call('ZREM', inflight, id)
if redis.call('SADD', done, id) == 0 then
  return 0
end
redis.call('HDEL', prompts, id)
redis.call('HDEL', going_on, id)
if redis.call('HDEL', failed, id) == 1 then
  redis.call('HINCRBY', counters, 'failed', -1)
elseif was_here == 0 then
  forget_elsewhere(id, pending, gpus, inflight_prefix, gpu)
end
if redis.call('HGET', config, 'status') == 'done' then
  redis.call('HSET', config, 'status', 'running')
end
local input, output_count = tonumber(input_tokens), tonumber(output_tokens)
local per_gpu = 'gpu:' .. gpu .. ':'
redis.call('HINCRBY', counters, 'completed', 1)
redis.call('HINCRBY', counters, 'input_tokens', input)
redis.call('HINCRBY', counters, 'output_tokens', output_count)
redis.call('HINCRBY', counters, 'finish:' .. finish_reason, 1)
if looping ~= '' then
  redis.call('HINCRBY', counters, 'looping:' .. finish_reason, 1)
  redis.call('HINCRBY', counters, 'looping_tokens:' .. finish_reason, output_count)
end
redis.call('HINCRBY', counters, 'hist:' .. hist_bucket, 1)
redis.call('HINCRBY', counters, per_gpu .. 'completed', 1)
credit_shares(counters, shares, gpu, output_count, 1)
local now = tonumber(redis.call('TIME')[1])
local bucket = now - now % tonumber(rate_bucket_s)
redis.call('HINCRBY', rate, 'c:' .. bucket, 1)
redis.call('HINCRBY', rate, 't:' .. bucket, tonumber(made))
redis.call('HINCRBY', rate, 'i:' .. bucket, input)
redis.call('HINCRBY', rate, gpu .. ':c:' .. bucket, 1)
redis.call('HINCRBY', rate, gpu .. ':t:' .. bucket, tonumber(made))
redis.call('HSETNX', counters, 'first_completed_at', now)
redis.call('HSET', counters, 'last_completed_at', now)
-- How fast this GPU's requests go, for take.lua's end game: a moving average (speed_weight
-- 0.05: over its last twenty or so requests; a server's speed drifts with its load and the
-- prompts' lengths).
local measured = tonumber(tokens_per_s)
if measured and measured > 0 then
  local old = tonumber(redis.call('HGET', speed, gpu))
  redis.call('HSET', speed, gpu, old and old + tonumber(speed_weight) * (measured - old) or measured)
end
local entry = redis.call('XADD', output, '*', 'id', id, 'row', row)
-- A regenerated prompt's new row: the row it replaces is superseded from now (reopen.lua).
local replaced = redis.call('HGET', superseding, id)
if replaced then
  redis.call('SADD', superseded, replaced .. ' ' .. id)
  redis.call('HDEL', superseding, id)
end
-- The index regenerate reads instead of the rows (Ledger.ended_rows): where the row is (its
-- stream entry, which names its batch once sealed), its share of the counters, and its prompt.
-- Written here, with the done mark, so the two never disagree; reopen.lua takes it out again.
if prompt ~= '' then
  local made_by = shares ~= '' and (gpu .. '/' .. shares) or gpu
  redis.call('HSET', ended, id,
             entry .. ' ' .. input_tokens .. ' ' .. output_tokens .. ' ' .. made_by
             .. (looping ~= '' and ' loop' or '') .. '\n' .. prompt)
end
-- What beat's tick reads to decide whether to seal, instead of the rows (batches.py): the bytes
-- waiting (each row and its newline, as in the batch file), and the time of the oldest row (its
-- stream id's milliseconds), set here when the stream was empty, kept by drop_sealed.lua.
redis.call('HINCRBY', counters, 'unsealed_bytes', #row + 1)
if redis.call('XLEN', output) == 1 then
  redis.call('HSET', counters, 'unsealed_since_ms', string.match(entry, '^%d+'))
end
return 1
