-- Change a job's config only while it is as the command read it (compare and set): a command
-- that read the job, worked for a while (an enqueue reading a large dataset) and then writes
-- never overwrites what another command or beat changed meanwhile.
-- KEYS: config
-- ARGV: n (the number of checked fields), then n pairs (field, JSON array of the values it may
--       have; "" stands for a field that is absent), then pairs (field, new value) to set.
-- Returns {} when written, else {field, current value, ...} for each check that failed (nothing
-- is written; a job that does not exist fails its checks with the value "").
local n = tonumber(ARGV[1])
local wrong = {}
for i = 2, 2 * n, 2 do
  local current = redis.call('HGET', KEYS[1], ARGV[i]) or ''
  local ok = false
  for _, allowed in ipairs(cjson.decode(ARGV[i + 1])) do
    if allowed == current then ok = true end
  end
  if not ok then
    wrong[#wrong + 1] = ARGV[i]
    wrong[#wrong + 1] = current
  end
end
if #wrong > 0 then
  return wrong
end
for i = 2 * n + 2, #ARGV - 1, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
end
return {}
