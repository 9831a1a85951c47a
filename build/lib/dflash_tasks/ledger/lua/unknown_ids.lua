-- Which of these ids the job does not know yet (neither done nor stored): a resume sends the
-- messages of those only, so enqueueing a dataset again costs a read of it, not a second upload.
--- keys: prompts done
--- args: ...ids
-- Returns the 1-based positions in ids of the unknown ones. add_prompts.lua checks again.
local SLICE = 1000
local unknown = {}
for first = 1, #ids, SLICE do
  local last = math.min(first + SLICE - 1, #ids)
  local is_done = redis.call('SMISMEMBER', done, unpack(ids, first, last))
  for j = first, last do
    if is_done[j - first + 1] == 0 and redis.call('HEXISTS', prompts, ids[j]) == 0 then
      unknown[#unknown + 1] = j
    end
  end
end
return unknown
