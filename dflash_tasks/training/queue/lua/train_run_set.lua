-- Change a training run's record only while it is in an expected state (runs.py's compare-and-set).
--- keys: run
--- args: statuses owner status ...fields
-- run: the run's hash; statuses: those it may be in (comma-separated; empty: any); owner: the
-- task id it must have (empty: any); status: the new one (empty: unchanged); fields:
-- field/value pairs set with it. Returns the status it had, or false.
local current = redis.call('HGET', run, 'status')
if not current then return false end
if owner ~= '' and redis.call('HGET', run, 'task_id') ~= owner then return false end
local allowed = statuses == ''
for one in string.gmatch(statuses, '[^,]+') do
  if one == current then allowed = true end
end
if not allowed then return false end
if status ~= '' then redis.call('HSET', run, 'status', status) end
for i = 1, #fields - 1, 2 do redis.call('HSET', run, fields[i], fields[i + 1]) end
return current
