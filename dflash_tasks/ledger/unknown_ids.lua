-- Which of these ids the job does not know yet (neither done nor stored): a resume sends the
-- messages of those only, so enqueueing a dataset again costs a read of it, not a second upload.
-- KEYS: prompts, done     ARGV: id1, id2, ...
-- Returns the 1-based positions in ARGV of the unknown ids. add_prompts.lua checks again.
local SLICE = 1000
local unknown = {}
for first = 1, #ARGV, SLICE do
  local last = math.min(first + SLICE - 1, #ARGV)
  local done = redis.call('SMISMEMBER', KEYS[2], unpack(ARGV, first, last))
  for j = first, last do
    if done[j - first + 1] == 0 and redis.call('HEXISTS', KEYS[1], ARGV[j]) == 0 then
      unknown[#unknown + 1] = j
    end
  end
end
return unknown
