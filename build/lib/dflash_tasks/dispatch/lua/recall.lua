-- Take prompts in flight on a GPU back to the front of pending: the given ids (their queued
-- messages were just withdrawn: a cancel), or all of them (a GPU the job no longer uses). Ids
-- already done are only dropped. A message of a recalled id that still runs somewhere is
-- harmless: the ledger records a prompt once.
--- keys: inflight pending done
--- args: ...ids
-- inflight: the GPU's; ids: none means every id in flight there.
-- Returns the number of ids put back in pending.
if #ids == 0 then
  ids = redis.call('ZRANGE', inflight, 0, -1)
end
local back = {}
for _, id in ipairs(ids) do
  if redis.call('ZREM', inflight, id) == 1 and redis.call('SISMEMBER', done, id) == 0 then
    back[#back + 1] = id
  end
end
for first = 1, #back, 1000 do
  redis.call('LPUSH', pending, unpack(back, first, math.min(first + 999, #back)))
end
return #back
