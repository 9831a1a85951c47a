-- The rate hash's counts over the window, summed per series inside Redis (progress.py, eta.py):
-- one field per series and 10-second bucket made an HMGET of about 4,000 fields at 64 GPUs,
-- whose packing and reply cost the snapshot more than all its other reads (benchmarks, case 11).
-- Returns one total per series, in the order given.
--- keys: rate
--- args: first_bucket last_bucket bucket_s ...series
local fields = {}
for bucket = tonumber(first_bucket), tonumber(last_bucket), tonumber(bucket_s) do
  fields[#fields + 1] = bucket
end
local out = {}
for i, name in ipairs(series) do
  local sum = 0
  for _, bucket in ipairs(fields) do
    sum = sum + tonumber(redis.call('HGET', rate, name .. ':' .. bucket) or '0')
  end
  out[i] = sum
end
return out
