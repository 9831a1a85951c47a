-- The generations going on from a round or a move (going_on), counted by the tokens each holds:
-- a flat list of (tokens, count). Those not in flight are paused in pending between rounds
-- (progress.py takes the in-flight ones' counts away, in_flight_ages.lua).
--- keys: going_on
local counts, order = {}, {}
for _, held in ipairs(redis.call('HVALS', going_on)) do
  if counts[held] == nil then
    counts[held] = 0
    order[#order + 1] = held
  end
  counts[held] = counts[held] + 1
end
local out = {}
for _, held in ipairs(order) do
  out[#out + 1] = tonumber(held)
  out[#out + 1] = counts[held]
end
return out
