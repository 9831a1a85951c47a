-- Clear a job's batch-sealing intent once its batch is shipped, unless another writer's intent
-- replaced it meanwhile (compare and delete).
-- KEYS: sealing     ARGV: the intent this writer set
-- Returns 1 when it was cleared, 0 when the key held something else.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
