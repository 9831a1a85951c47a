-- Take prompts in flight on a GPU back to the front of pending: the given ids (their queued
-- messages were just withdrawn: a cancel), or all of them (a GPU the job no longer uses). Ids
-- already done are only dropped. A message of a recalled id that still runs somewhere is
-- harmless: the ledger records a prompt once.
-- KEYS: inflight(gpu), pending, done     ARGV: ids (none: every id in flight there)
-- Returns the number of ids put back in pending.
local ids = ARGV
if #ids == 0 then
  ids = redis.call('ZRANGE', KEYS[1], 0, -1)
end
local back = {}
for _, id in ipairs(ids) do
  if redis.call('ZREM', KEYS[1], id) == 1 and redis.call('SISMEMBER', KEYS[3], id) == 0 then
    back[#back + 1] = id
  end
end
for first = 1, #back, 1000 do
  redis.call('LPUSH', KEYS[2], unpack(back, first, math.min(first + 999, #back)))
end
return #back
