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
--- keys: done prompts pending counters ended config superseding
--- args: id entry input_tokens output_tokens finish_reason gpu hist_bucket continued_tokens indexed place looping
--- uses: shares
-- ended: the index of rows that ended finish_reason; entry: the prompt's new `prompts` entry;
-- gpu: the GPU the row was recorded on, then, for a row made in several requests, "/" and its
-- shares (complete.lua's index record, shares.lua);
-- continued_tokens: ids kept from the old output (0 to start over); indexed: the first line of
-- the index record as regenerate read it (empty: the row was read from a batch); place: the old
-- row's stream entry, or its batch's first entry (empty: unknown); looping: "1" when the old row
-- was counted as looping (complete.lua).
-- Returns 1 when reopened, 0 when the id was not done (already reopened, or unknown) or its
-- newest row is no longer the one indexed as read (taken back and finished again meanwhile:
-- the shares given are not its row's).
if indexed ~= '' then
  local record = redis.call('HGET', ended, id)
  if not record or string.sub(record, 1, #indexed + 1) ~= indexed .. '\n' then
    return 0
  end
end
if redis.call('SREM', done, id) == 0 then
  return 0
end
redis.call('HDEL', ended, id)
if place ~= '' then
  redis.call('HSET', superseding, id, place)
end
if redis.call('HGET', config, 'status') == 'done' then
  redis.call('HSET', config, 'status', 'running')
end
redis.call('HSET', prompts, id, entry)
-- Longest expected work first (the LPT rule for the makespan): a row cut at the cap will be
-- longer than the cap, longer than most of what is pending: it goes to the front.
if finish_reason == 'length' then
  redis.call('LPUSH', pending, id)
else
  redis.call('RPUSH', pending, id)
end
local input, output_count = tonumber(input_tokens), tonumber(output_tokens)
local recorded_on = string.match(gpu, '^[^/]+')
local shares = string.match(gpu, '/(.*)$') or ''
local per_gpu = 'gpu:' .. recorded_on .. ':'
redis.call('HINCRBY', counters, 'completed', -1)
-- 0 - n, not -n: a row of no tokens would send Redis "-0" (shares.lua)
redis.call('HINCRBY', counters, 'input_tokens', 0 - input)
redis.call('HINCRBY', counters, 'output_tokens', 0 - output_count)
redis.call('HINCRBY', counters, 'finish:' .. finish_reason, -1)
if looping ~= '' then
  redis.call('HINCRBY', counters, 'looping:' .. finish_reason, -1)
  redis.call('HINCRBY', counters, 'looping_tokens:' .. finish_reason, 0 - output_count)
end
redis.call('HINCRBY', counters, 'hist:' .. hist_bucket, -1)
redis.call('HINCRBY', counters, per_gpu .. 'completed', -1)
credit_shares(counters, shares, recorded_on, output_count, -1)
redis.call('HINCRBY', counters, 'regenerated', 1)
local kept = tonumber(continued_tokens)
if kept > 0 then
  redis.call('HINCRBY', counters, 'continued', 1)
  redis.call('HINCRBY', counters, 'continued_tokens_saved', kept)
end
return 1
