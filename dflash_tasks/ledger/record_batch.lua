-- Enter a written batch in the manifest and count it, once per batch name.
-- KEYS: manifest, counters
-- ARGV: name, record_json, bytes, then optional pairs (counter field, increment) added with the
--       batch (latency histogram, S3 totals), also exactly once.
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[2], 'batches', 1)
  redis.call('HINCRBY', KEYS[2], 'batch_bytes', tonumber(ARGV[3]))
  for i = 4, #ARGV - 1, 2 do
    redis.call('HINCRBY', KEYS[2], ARGV[i], tonumber(ARGV[i + 1]))
  end
  return 1
end
return 0
