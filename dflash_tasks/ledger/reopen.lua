-- Take a finished prompt back for regeneration: its done mark and its row's share of the counters
-- go, its prompt (and, to continue a truncated output, the ids it already has) comes back to
-- pending. The old row stays in its batch; readers keep the newest row per id, and the counters
-- follow the newest row, so they keep equalling the dataset.
-- Its record in the index of rows by finish reason (complete.lua writes it) goes with the done
-- mark: the id is no longer done, and its next row is indexed under the reason it ends with.
-- A done job runs again in the same step (the lifecycle: beat marks it done once more when the
-- prompts taken back have their rows shipped).
-- The old row's place (its stream entry, or its batch's first entry) waits in `superseding`
-- until the new row is recorded (complete.lua then marks the old one superseded), so that
-- readers that cannot see every batch (the torch dataset) skip it: beat resolves the places to
-- batches in <job>/superseded.json (batches.py).
-- KEYS: done, prompts, pending, counters, ended(finish_reason), config, superseding
-- ARGV: id, prompt_entry, input_tokens, output_tokens, finish_reason, gpu, hist_bucket,
--       continued_tokens (ids kept from the old output; 0 to start over), indexed (the first
--       line of the index record as regenerate read it; empty: the row was read from a batch),
--       place (the old row's stream entry, or its batch's first entry; empty: unknown)
-- Returns 1 when reopened, 0 when the id was not done (already reopened, or unknown) or its
-- newest row is no longer the one indexed as read (taken back and finished again meanwhile:
-- the shares given are not its row's).
local id = ARGV[1]
if ARGV[9] ~= '' then
  local record = redis.call('HGET', KEYS[5], id)
  if not record or string.sub(record, 1, #ARGV[9] + 1) ~= ARGV[9] .. '\n' then
    return 0
  end
end
if redis.call('SREM', KEYS[1], id) == 0 then
  return 0
end
redis.call('HDEL', KEYS[5], id)
if ARGV[10] ~= '' then
  redis.call('HSET', KEYS[7], id, ARGV[10])
end
if redis.call('HGET', KEYS[6], 'status') == 'done' then
  redis.call('HSET', KEYS[6], 'status', 'running')
end
redis.call('HSET', KEYS[2], id, ARGV[2])
-- Longest expected work first (the LPT rule for the makespan): a row cut at the cap will be
-- longer than the cap, longer than most of what is pending: it goes to the front.
if ARGV[5] == 'length' then
  redis.call('LPUSH', KEYS[3], id)
else
  redis.call('RPUSH', KEYS[3], id)
end
local input_tokens, output_tokens = tonumber(ARGV[3]), tonumber(ARGV[4])
local gpu = 'gpu:' .. ARGV[6] .. ':'
redis.call('HINCRBY', KEYS[4], 'completed', -1)
redis.call('HINCRBY', KEYS[4], 'input_tokens', -input_tokens)
redis.call('HINCRBY', KEYS[4], 'output_tokens', -output_tokens)
redis.call('HINCRBY', KEYS[4], 'finish:' .. ARGV[5], -1)
redis.call('HINCRBY', KEYS[4], 'hist:' .. ARGV[7], -1)
redis.call('HINCRBY', KEYS[4], gpu .. 'completed', -1)
redis.call('HINCRBY', KEYS[4], gpu .. 'output_tokens', -output_tokens)
redis.call('HINCRBY', KEYS[4], 'regenerated', 1)
local kept = tonumber(ARGV[8])
if kept > 0 then
  redis.call('HINCRBY', KEYS[4], 'continued', 1)
  redis.call('HINCRBY', KEYS[4], 'continued_tokens_saved', kept)
end
return 1
