-- The prompts in flight on one GPU, for the token ETA (progress.py, eta.py): a flat list of
-- (sent at, tokens held, count), oldest first. `sent at` is the Redis second the in-flight set
-- scored it with; `tokens held` what a generation going on from a round or a move held then
-- (going_on; 0 for most). Up to `strata` prompts are read one by one; past that, the set is cut
-- by age into `strata` runs of consecutive ranks, each counted at its middle prompt: the cost
-- stays O(strata log n) however many are in flight (64 GPUs x 300 read whole cost the snapshot
-- 55 ms, benchmarks case 11), and an age error is bounded by a stratum's spread. Equal
-- neighbouring triples are merged.
--- keys: inflight going_on
--- args: strata
local n = redis.call('ZCARD', inflight)
local parts = math.min(n, tonumber(strata))
local any_held = redis.call('EXISTS', going_on) == 1
local out, last_at, last_held, count = {}, nil, nil, 0
for j = 0, parts - 1 do
  local first, after = math.floor(j * n / parts), math.floor((j + 1) * n / parts)
  local middle = math.floor((first + after - 1) / 2)
  local got = redis.call('ZRANGE', inflight, middle, middle, 'WITHSCORES')
  local at, held = math.floor(tonumber(got[2])), 0
  if any_held then
    held = tonumber(redis.call('HGET', going_on, got[1]) or '0')
  end
  if at == last_at and held == last_held then
    count = count + after - first
  else
    if count > 0 then
      out[#out + 1], out[#out + 2], out[#out + 3] = last_at, last_held, count
    end
    last_at, last_held, count = at, held, after - first
  end
end
if count > 0 then
  out[#out + 1], out[#out + 2], out[#out + 3] = last_at, last_held, count
end
return out
