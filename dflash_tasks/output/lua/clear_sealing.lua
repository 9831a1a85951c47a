-- Clear a job's batch-sealing intent once its batch is shipped, unless another writer's intent
-- replaced it meanwhile (compare and delete).
--- keys: sealing
--- args: intent
-- intent: the one this writer set. Returns 1 when it was cleared, 0 when the key held another.
if redis.call('GET', sealing) == intent then return redis.call('DEL', sealing) end
return 0
