-- Record a finished prompt exactly once: done mark, counters and output row in one atomic step,
-- so the counters always equal what the output holds, whatever is delivered twice.
-- KEYS: done, inflight(gpu), prompts, failed, counters, rate, output, pending, config, gpus,
--       ended(finish_reason), speed, superseding, superseded
-- ARGV: id, row_json, input_tokens, output_tokens, finish_reason, gpu, rate_bucket_s, hist_bucket,
--       inflight_prefix, prompt (its messages as `prompts` stores them; empty: a reason not indexed),
--       tokens_per_s (the request's; empty when too short to say)
-- Returns 1 when recorded, 0 when the id was already done (a duplicate delivery) or the job was
-- deleted while the request ran (nothing is written: its keys stay gone).
-- A row recorded after the job was marked done (a late delivery of a prompt in the failed
-- registry) moves it back to running in this step: beat ticks running jobs only, and a done
-- job's rows must all be shipped.
local id = ARGV[1]
if redis.call('EXISTS', KEYS[9]) == 0 then
  return 0
end
local was_here = redis.call('ZREM', KEYS[2], id)
if redis.call('SADD', KEYS[1], id) == 0 then
  return 0
end
redis.call('HDEL', KEYS[3], id)
if redis.call('HDEL', KEYS[4], id) == 1 then
  redis.call('HINCRBY', KEYS[5], 'failed', -1)
elseif was_here == 0 then
  forget_elsewhere(id, KEYS[8], KEYS[10], ARGV[9], ARGV[6])
end
if redis.call('HGET', KEYS[9], 'status') == 'done' then
  redis.call('HSET', KEYS[9], 'status', 'running')
end
local input_tokens, output_tokens = tonumber(ARGV[3]), tonumber(ARGV[4])
local gpu = 'gpu:' .. ARGV[6] .. ':'
redis.call('HINCRBY', KEYS[5], 'completed', 1)
redis.call('HINCRBY', KEYS[5], 'input_tokens', input_tokens)
redis.call('HINCRBY', KEYS[5], 'output_tokens', output_tokens)
redis.call('HINCRBY', KEYS[5], 'finish:' .. ARGV[5], 1)
redis.call('HINCRBY', KEYS[5], 'hist:' .. ARGV[8], 1)
redis.call('HINCRBY', KEYS[5], gpu .. 'completed', 1)
redis.call('HINCRBY', KEYS[5], gpu .. 'output_tokens', output_tokens)
local now = tonumber(redis.call('TIME')[1])
local bucket = now - now % tonumber(ARGV[7])
redis.call('HINCRBY', KEYS[6], 'c:' .. bucket, 1)
redis.call('HINCRBY', KEYS[6], 't:' .. bucket, output_tokens)
redis.call('HINCRBY', KEYS[6], 'i:' .. bucket, input_tokens)
redis.call('HINCRBY', KEYS[6], ARGV[6] .. ':c:' .. bucket, 1)
redis.call('HINCRBY', KEYS[6], ARGV[6] .. ':t:' .. bucket, output_tokens)
redis.call('HSETNX', KEYS[5], 'first_completed_at', now)
redis.call('HSET', KEYS[5], 'last_completed_at', now)
-- How fast this GPU's requests go, for take.lua's end game: a moving average over its last
-- twenty or so requests (a server's speed drifts with its load and the prompts' lengths).
local speed = tonumber(ARGV[11])
if speed and speed > 0 then
  local old = tonumber(redis.call('HGET', KEYS[12], ARGV[6]))
  redis.call('HSET', KEYS[12], ARGV[6], old and old + 0.05 * (speed - old) or speed)
end
local entry = redis.call('XADD', KEYS[7], '*', 'id', id, 'row', ARGV[2])
-- A regenerated prompt's new row: the row it replaces is superseded from now (reopen.lua).
local replaced = redis.call('HGET', KEYS[13], id)
if replaced then
  redis.call('SADD', KEYS[14], replaced .. ' ' .. id)
  redis.call('HDEL', KEYS[13], id)
end
-- The index regenerate reads instead of the rows (Ledger.ended_rows): where the row is (its
-- stream entry, which names its batch once sealed), its share of the counters, and its prompt.
-- Written here, with the done mark, so the two never disagree; reopen.lua takes it out again.
if ARGV[10] ~= '' then
  redis.call('HSET', KEYS[11], id,
             entry .. ' ' .. ARGV[3] .. ' ' .. ARGV[4] .. ' ' .. ARGV[6] .. '\n' .. ARGV[10])
end
-- What beat's tick reads to decide whether to seal, instead of the rows (batches.py): the bytes
-- waiting (each row and its newline, as in the batch file), and the time of the oldest row (its
-- stream id's milliseconds), set here when the stream was empty, kept by drop_sealed.lua.
redis.call('HINCRBY', KEYS[5], 'unsealed_bytes', #ARGV[2] + 1)
if redis.call('XLEN', KEYS[7]) == 1 then
  redis.call('HSET', KEYS[5], 'unsealed_since_ms', string.match(entry, '^%d+'))
end
return 1
