-- Enter a written batch in the manifest and count it, once per batch name.
--- keys: manifest counters
--- args: name record bytes ...increments
-- increments: optional pairs (counter field, increment) added with the batch (latency
-- histogram, S3 totals), also exactly once. Returns 1 when entered, 0 when it was already.
if redis.call('HSETNX', manifest, name, record) == 1 then
  redis.call('HINCRBY', counters, 'batches', 1)
  redis.call('HINCRBY', counters, 'batch_bytes', tonumber(bytes))
  for i = 1, #increments - 1, 2 do
    redis.call('HINCRBY', counters, increments[i], tonumber(increments[i + 1]))
  end
  return 1
end
return 0
