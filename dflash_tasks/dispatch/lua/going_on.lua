-- Prepended (`uses: going_on`) to the scripts that hand a generation on from its tokens:
-- next_round.lua, hand_over.lua. going_on keeps what each generation holds before its next
-- request, for the ETA (progress.py); held 0 (a reply starting, a generation starting over)
-- drops it. complete.lua drops it when the row is recorded.
local function keep_going_on(going_on_hash, id, held)
  if tonumber(held) > 0 then
    redis.call('HSET', going_on_hash, id, held)
  else
    redis.call('HDEL', going_on_hash, id)
  end
end
