-- The prompts in flight on one GPU, counted for the token ETA (progress.py, eta.py) instead of
-- listed: at 64 GPUs x 300 in flight, reading every id and score cost the snapshot ten times its
-- own time (benchmarks, case 11). Returns a flat list of (sent at, tokens held, count): the
-- in-flight set's scores (the Redis second each was sent), oldest first, and what a generation
-- held then (going_on: a round's or a move's tokens; 0 for most), each run of equal pairs once
-- with its length.
--- keys: inflight going_on
local sent = redis.call('ZRANGE', inflight, 0, -1, 'WITHSCORES')
local any_held = redis.call('EXISTS', going_on) == 1
local out, last_at, last_held, n = {}, nil, nil, 0
for i = 1, #sent, 2 do
  local at, held = sent[i + 1], 0
  if any_held then
    held = tonumber(redis.call('HGET', going_on, sent[i]) or '0')
  end
  if at == last_at and held == last_held then
    n = n + 1
  else
    if n > 0 then
      out[#out + 1], out[#out + 2], out[#out + 3] = math.floor(tonumber(last_at)), last_held, n
    end
    last_at, last_held, n = at, held, 1
  end
end
if n > 0 then
  out[#out + 1], out[#out + 2], out[#out + 3] = math.floor(tonumber(last_at)), last_held, n
end
return out
