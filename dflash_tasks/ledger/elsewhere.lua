-- Prepended (by Ledger) to the scripts that give a prompt its outcome: complete.lua, fail.lua.
-- A prompt recalled from a GPU while its request ran there (cancel, fewer --gpus, a GPU whose
-- worker is gone) waits in pending or on another GPU when its outcome arrives: take it out
-- there too, so pending + in flight + completed + failed stays equal to the total.
-- pending: the job's pending list; first_other: the index in KEYS of the first of the job's
-- other GPUs' in-flight sets (the rest follow it).
local function forget_elsewhere(id, pending, first_other)
  for i = first_other, #KEYS do
    if redis.call('ZREM', KEYS[i], id) == 1 then
      return
    end
  end
  -- Recalled ids go to the front of pending, so this finds them near its head.
  redis.call('LREM', pending, 1, id)
end

