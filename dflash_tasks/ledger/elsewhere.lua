-- Prepended (by Ledger) to the scripts that give a prompt its outcome: complete.lua, fail.lua.
-- A prompt recalled from a GPU while its request ran there (cancel, a GPU the job no longer
-- uses, a GPU whose worker is gone) waits in pending or on another GPU when its outcome arrives:
-- take it out there too, so pending + in flight + completed + failed stays equal to the total.
-- pending: the job's pending list; gpus: the set of the job's GPUs; inflight_prefix: the name of
-- an in-flight set less its GPU (keys.py's JobKeys.inflight). The GPUs are read here, not passed
-- in, so a GPU that joined the job a moment ago is searched too; their sets share the job's
-- hash slot.
local function forget_elsewhere(id, pending, gpus, inflight_prefix, here)
  for _, gpu in ipairs(redis.call('SMEMBERS', gpus)) do
    if gpu ~= here and redis.call('ZREM', inflight_prefix .. gpu, id) == 1 then
      return
    end
  end
  -- Recalled ids go to the front of pending, so this finds them near its head.
  redis.call('LREM', pending, 1, id)
end

