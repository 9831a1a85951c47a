-- Change a training run's record only while it is in an expected state (runs.py's compare-and-set).
-- KEYS[1]: the run's hash. ARGV[1]: the statuses it may be in (comma-separated; empty: any),
-- ARGV[2]: the owner it must have (empty: any), ARGV[3]: the new status (empty: unchanged), then
-- field/value pairs set with it. Returns the status it had, or false.
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return false end
if ARGV[2] ~= '' and redis.call('HGET', KEYS[1], 'task_id') ~= ARGV[2] then return false end
local allowed = ARGV[1] == ''
for status in string.gmatch(ARGV[1], '[^,]+') do
  if status == current then allowed = true end
end
if not allowed then return false end
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'status', ARGV[3]) end
for i = 4, #ARGV - 1, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return current
