-- A chunk number no job of this name has used, not even one deleted since (chunk objects are
-- never rewritten, and a deletion removes only the numbers up to its job's last: jobs.delete).
-- One step, no WATCH: the end game stores a generation's entry in a chunk of its own at every
-- round's end, from every worker thread at once, and optimistic retries on one key spun
-- (benchmarks, case 7).
--- keys: config chunk_numbers
-- chunk_numbers: the job name's counter, which outlives the job; a job made before it numbered
-- its chunks in its config alone (body_chunks), so the higher of the two goes on. The config is
-- not written: a command's compare-and-set on it (jobs._write_if_exists) would lose to every
-- chunk. Returns the number, or 0 when the job is gone.
if redis.call('HEXISTS', config, 'status') == 0 then
  return 0
end
local number = math.max(tonumber(redis.call('GET', chunk_numbers) or '0'),
                        tonumber(redis.call('HGET', config, 'body_chunks') or '0')) + 1
redis.call('SET', chunk_numbers, number)
return number
