-- Change a job's config only while it is as the command read it (compare and set): a command
-- that read the job, worked for a while (an enqueue reading a large dataset) and then writes
-- never overwrites what another command or beat changed meanwhile.
--- keys: config
--- args: checked ...fields
-- checked: the number of checked fields; fields: that many pairs (field, JSON array of the
-- values it may have; "" stands for a field that is absent), then pairs (field, new value) to
-- set. Returns {} when written, else {field, current value, ...} for each check that failed
-- (nothing is written; a job that does not exist fails its checks with the value "").
local n = tonumber(checked)
local wrong = {}
for i = 1, 2 * n - 1, 2 do
  local current = redis.call('HGET', config, fields[i]) or ''
  local ok = false
  for _, allowed in ipairs(cjson.decode(fields[i + 1])) do
    if allowed == current then ok = true end
  end
  if not ok then
    wrong[#wrong + 1] = fields[i]
    wrong[#wrong + 1] = current
  end
end
if #wrong > 0 then
  return wrong
end
for i = 2 * n + 1, #fields - 1, 2 do
  redis.call('HSET', config, fields[i], fields[i + 1])
end
return {}
