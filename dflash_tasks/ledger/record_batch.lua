-- Enter a written batch in the manifest and count it, once per batch name.
-- KEYS: manifest, counters     ARGV: name, record_json, bytes
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[2], 'batches', 1)
  redis.call('HINCRBY', KEYS[2], 'batch_bytes', tonumber(ARGV[3]))
  return 1
end
return 0
