-- Top one GPU's window up: move ids from pending to that GPU's in-flight set.
-- KEYS: config, pending, inflight(gpu) [, queue]
-- ARGV: window [, job, gpu, task name, origin, reply_to]
-- Returns the ids taken; none unless the job is running.
--
-- With the queue and the message fields (dispatch.topup), it also publishes one Celery task
-- message per id, LPUSHed exactly where kombu's Redis transport would put it, so a refill costs
-- one round trip instead of a take plus a publish (and a task-sent event) per id. The messages
-- are Celery protocol 2 with a plain JSON body (no body_encoding: kombu then reads the body as
-- it is); their task ids and delivery tags are unique per job (a per-job counter, hashed).
-- The queue is the one key outside the job's hash slot: Celery's Redis broker does not run on
-- a Redis Cluster anyway.
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then
  return {}
end
local room = tonumber(ARGV[1]) - redis.call('ZCARD', KEYS[3])
if room <= 0 then
  return {}
end
local ids = redis.call('LPOP', KEYS[2], room)
if not ids then
  return {}
end
local now = redis.call('TIME')
local scored = {}
for i, id in ipairs(ids) do
  scored[2 * i - 1] = now[1]
  scored[2 * i] = id
end
redis.call('ZADD', KEYS[3], unpack(scored))
if KEYS[4] == nil then
  return ids
end

local job, gpu, task, origin, reply_to = ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5], ARGV[6]
local seq = redis.call('HINCRBY', KEYS[1], 'dispatch_seq', #ids) - #ids
local null = cjson.null
local function uuid(text)
  local h = redis.sha1hex(text)
  return h:sub(1, 8) .. '-' .. h:sub(9, 12) .. '-4' .. h:sub(14, 16) .. '-a' .. h:sub(18, 20) ..
         '-' .. h:sub(21, 32)
end
local messages = {}
for i, id in ipairs(ids) do
  local salt = job .. '\0' .. (seq + i) .. '\0' .. now[1] .. '.' .. now[2] .. '\0'
  local task_id = uuid(salt .. 'task')
  local body = cjson.encode({{job, id, gpu}, setmetatable({}, {}), {
    callbacks = null, errbacks = null, chain = null, chord = null}})
  messages[#messages + 1] = cjson.encode({
    ['body'] = body,
    ['content-encoding'] = 'utf-8',
    ['content-type'] = 'application/json',
    ['headers'] = {
      lang = 'py', task = task, id = task_id, shadow = null, eta = null, expires = null,
      group = null, group_index = null, retries = 0, timelimit = {null, null},
      root_id = task_id, parent_id = null,
      argsrepr = "('" .. job .. "', '" .. id .. "', " .. ARGV[3] .. ")", kwargsrepr = '{}',
      origin = origin, ignore_result = false, replaced_task_nesting = 0,
      stamped_headers = null, stamps = {}},
    ['properties'] = {
      correlation_id = task_id, reply_to = reply_to, delivery_mode = 2,
      delivery_info = {exchange = '', routing_key = KEYS[4]}, priority = 0,
      delivery_tag = uuid(salt .. 'tag')},
  })
end
redis.call('LPUSH', KEYS[4], unpack(messages))
return ids
