-- Prepended (`uses: elsewhere`) to the scripts that give a prompt its outcome: complete.lua,
-- fail.lua. A prompt recalled from a GPU while its request ran there (cancel, a GPU the job no
-- longer uses, a GPU whose worker is gone) waits in pending or on another GPU when its outcome
-- arrives: take it out there too, so pending + in flight + completed + failed stays equal to the
-- total. pending_list: the job's pending list; gpu_set: the set of the job's GPUs;
-- inflight_prefix: the name of an in-flight set less its GPU (keys.py's JobKeys.inflight). The
-- GPUs are read here, not passed in, so a GPU that joined the job a moment ago is searched too;
-- their sets share the job's hash slot.
local function forget_elsewhere(id, pending_list, gpu_set, inflight_prefix, here)
  for _, other in ipairs(redis.call('SMEMBERS', gpu_set)) do
    if other ~= here and redis.call('ZREM', inflight_prefix .. other, id) == 1 then
      return
    end
  end
  -- Recalled ids go to the front of pending, so this finds them near its head.
  redis.call('LREM', pending_list, 1, id)
end

