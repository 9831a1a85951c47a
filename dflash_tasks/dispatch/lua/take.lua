-- Top one GPU's window up: move ids from pending to that GPU's in-flight set, and publish their
-- Celery task messages onto its queue.
--- keys: config pending inflight gpus queue hold memory_hold speed seen workers breakers migrating
--- args: window job gpu task origin reply_to inflight_prefix alive_s migrations_prefix retrying_prefix faster_ratio order_lapse_s rounds
-- inflight, queue: the GPU's; hold, speed, migrating: the job's; memory_hold: Redis's; seen,
-- workers, breakers: the GPU registry's. migrations_prefix: a GPU's list of generations to hand
-- over, less its name; retrying_prefix: a GPU's set of retries waiting, less its name;
-- faster_ratio: how much faster (1.15: 15%) a GPU must be for the end game to favour it;
-- order_lapse_s: how long an order to move a generation stands; rounds: 1 when the end game runs
-- in rounds (window.round_cap), 0 when it does not.
-- Returns the ids taken; none unless the job is running, its GPU selection allows this GPU and
-- no hold is set.
--
-- The messages are LPUSHed exactly where kombu's Redis transport would put them, so a refill
-- costs one round trip instead of a take plus a publish (and a task-sent event) per id. They
-- are Celery protocol 2 with a plain JSON body (no body_encoding: kombu then reads the body as
-- it is); their task ids and delivery tags are unique per job (a per-job counter, hashed). They
-- say ignore_result, as the task does: Celery takes the message's word over the task's.
-- The queues are the only keys outside the job's hash slot: Celery's Redis broker does not run
-- on a Redis Cluster anyway. A GPU's queue bears its name (keys.py's queue_for), and its
-- in-flight set is inflight_prefix .. its name.
local ratio = tonumber(faster_ratio)

local function breaker_open(name)
  local breaker = redis.call('HGET', breakers, name)
  return breaker and string.find(breaker, '"state": *"open"') ~= nil
end

-- The end game: once pending is empty, a GPU whose own queue is empty takes one waiting
-- message from the longest queue of another of the job's GPUs (the newest one there: the last
-- that GPU would have started), so the prompts already queued behind a slow GPU finish on
-- whichever GPU frees a slot first instead of waiting for the slow one. A GPU measurably faster
-- (faster_ratio, complete.lua's `speed`) than another takes from that one's queue even while its
-- own still holds messages: they finish sooner here. Only this job's messages published here
-- are moved (not retries, which carry their attempt count).
local function steal(only_slower)
  local own = tonumber(redis.call('HGET', speed, gpu))
  if only_slower and not own then
    return nil
  end
  local skip = {}
  while true do
    local best, best_len = nil, 0
    for _, other in ipairs(redis.call('SMEMBERS', gpus)) do
      local theirs = only_slower and tonumber(redis.call('HGET', speed, other))
      if other ~= gpu and not skip[other] and not (only_slower and not (theirs and ratio * theirs <= own)) then
        local len = redis.call('LLEN', other)
        if len > best_len then
          best, best_len = other, len
        end
      end
    end
    if best == nil then
      return nil
    end
    local raw = redis.call('LPOP', best)
    local id = nil
    local ok, msg = pcall(cjson.decode, raw)
    if ok and type(msg) == 'table' and type(msg.properties) == 'table' and type(msg.headers) == 'table'
       and msg.properties.body_encoding == nil and msg.headers.task == task
       and type(msg.body) == 'string' then
      local ok2, body = pcall(cjson.decode, msg.body)
      if ok2 and type(body) == 'table' and type(body[1]) == 'table' and body[1][1] == job
         and type(body[1][2]) == 'string' and type(body[2]) == 'table' and next(body[2]) == nil then
        id = body[1][2]
      end
    end
    if id ~= nil and redis.call('ZREM', inflight_prefix .. best, id) == 1 then
      return id
    end
    redis.call('LPUSH', best, raw)  -- not ours to move: back where it was
    skip[best] = true
  end
end

-- The last step of the end game: nothing waits anywhere (pending empty, no queue holds one of
-- the job's messages) and a slot is free here. A generation still running on a measurably
-- slower GPU (faster_ratio, complete.lua's speed) would decide the end: it is moved here, the
-- one dispatched there last (expected to finish last). This orders it; the worker there aborts
-- it and hands its partial output over, to be continued here from its exact tokens
-- (generate.py, hand_over.lua). At most as many orders wait for this GPU as it has free slots;
-- an order older than order_lapse_s, or whose prompt left the GPU it was on, lapses. Retries
-- waiting for their ETA are not running: they are not moved.
local function order_migration(room)
  local own = tonumber(redis.call('HGET', speed, gpu))
  if not own then
    return
  end
  local now = tonumber(redis.call('TIME')[1])
  local waiting = 0
  local orders = redis.call('HGETALL', migrating)
  for i = 1, #orders, 2 do
    local from, to, at = string.match(orders[i + 1], '^(%S+) (%S+) (%d+)$')
    if not from or now - tonumber(at) > tonumber(order_lapse_s)
       or not redis.call('ZSCORE', inflight_prefix .. from, orders[i]) then
      redis.call('HDEL', migrating, orders[i])
    elseif to == gpu then
      waiting = waiting + 1
    end
  end
  if waiting >= room then
    return
  end
  local slowest, slowest_speed = nil, nil
  for _, other in ipairs(redis.call('SMEMBERS', gpus)) do
    local theirs = tonumber(redis.call('HGET', speed, other))
    if other ~= gpu and theirs and ratio * theirs <= own and (not slowest_speed or theirs < slowest_speed)
       and redis.call('ZCARD', inflight_prefix .. other) > 0 then
      slowest, slowest_speed = other, theirs
    end
  end
  if not slowest then
    return
  end
  for _, id in ipairs(redis.call('ZREVRANGE', inflight_prefix .. slowest, 0, 31)) do
    if redis.call('HEXISTS', migrating, id) == 0 and not redis.call('ZSCORE', retrying_prefix .. slowest, id) then
      redis.call('HSET', migrating, id, slowest .. ' ' .. gpu .. ' ' .. now)
      redis.call('LPUSH', migrations_prefix .. slowest, job .. '\n' .. id)
      redis.call('LTRIM', migrations_prefix .. slowest, 0, 999)
      return
    end
  end
end

-- The job's GPU selection (core/jobs.py's GpuSelection.allows says the same): config `nodes`,
-- a comma-separated list (empty: every node), and `gpus`: "all", a count N (local indices 0 to
-- N-1 on each node), or a comma-separated list of GPU names.
local function allowed(name)
  local index, node = string.match(name, '^gpu(%d+)@(.+)$')
  if index == nil then
    return false
  end
  local nodes = redis.call('HGET', config, 'nodes')
  if nodes and nodes ~= '' and not string.find(',' .. nodes .. ',', ',' .. node .. ',', 1, true) then
    return false
  end
  local selected = redis.call('HGET', config, 'gpus') or 'all'
  if selected == 'all' then
    return true
  end
  local count = tonumber(selected)
  if count then
    return tonumber(index) < count
  end
  return string.find(',' .. selected .. ',', ',' .. name .. ',', 1, true) ~= nil
end

-- The end game on unequal servers: when the last prompts of the run are so few that the GPUs
-- measurably faster than this one (their requests' speed, complete.lua) will free a slot for
-- each of them before this one would finish it, they go there: a long prompt started late on
-- a slow server is what decides the end of a run. Faster means faster_ratio or more; only GPUs
-- alive (heartbeat within alive_s) with a closed breaker, that the job may use, count. How many
-- they take: window x (their speed / ours - 1) each, the prompts they start in the time this
-- GPU's extra slowness costs. Checked only once pending is within a window per GPU of the job.
local function leave_to_faster(left)
  if left > tonumber(window) * redis.call('SCARD', gpus) then
    return false
  end
  local own = tonumber(redis.call('HGET', speed, gpu))
  if not own then
    return false
  end
  local now = redis.call('TIME')
  now = tonumber(now[1]) + tonumber(now[2]) / 1e6
  local reserve = 0
  for _, other in ipairs(redis.call('SMEMBERS', gpus)) do
    local theirs = tonumber(redis.call('HGET', speed, other))
    if other ~= gpu and theirs and theirs >= ratio * own and allowed(other) then
      local last = tonumber(redis.call('HGET', seen, other))
      local worker = redis.call('HGET', workers, other)
      if last and now - last <= tonumber(alive_s) and worker and not breaker_open(other) then
        local ok, reg = pcall(cjson.decode, worker)
        local slots = ok and type(reg) == 'table' and tonumber(reg.concurrency) or 0
        reserve = reserve + slots * (theirs / own - 1)
      end
    end
  end
  return reserve > 0 and left <= reserve
end

if redis.call('HGET', config, 'status') ~= 'running' then
  return {}
end
-- Dispatch is held (beat sets and clears the holds, dispatch/hold.py): the job's sealed rows can
-- go nowhere (storage and spool both fail), or Redis nears its maxmemory. New work would only
-- add rows Redis cannot give away; what is in flight finishes, and dispatch resumes by itself.
if redis.call('EXISTS', hold, memory_hold) > 0 then
  return {}
end
-- A GPU the job does not use (not selected, or no longer: an enqueue with another --gpus or
-- --nodes) takes nothing: its worker still refills after each of the job's requests it
-- finishes there.
if not allowed(gpu) then
  return {}
end
-- A GPU whose breaker is open (its server does not answer, or is misconfigured: breaker.py)
-- takes nothing: it could send nothing, and beat hands what it holds to the other GPUs.
if breaker_open(gpu) then
  return {}
end
local room = tonumber(window) - redis.call('ZCARD', inflight)
if room <= 0 then
  return {}
end
-- In rounds, what is pending at the end is a round at most, and a slower GPU's round costs
-- little more than a faster one's: it keeps taking them (leaving them to the faster GPUs would
-- idle its slots for the whole of the last rounds); the moves take care of the very end.
if rounds == '0' and leave_to_faster(redis.call('LLEN', pending)) then
  return {}
end
local ids = redis.call('LPOP', pending, room)
if not ids then
  ids = {}
  local stolen = steal(redis.call('LLEN', queue) > 0)
  if stolen then
    ids[1] = stolen
  end
  if #ids == 0 then
    order_migration(room)
    return {}
  end
end
local now = redis.call('TIME')
local scored = {}
for i, id in ipairs(ids) do
  scored[2 * i - 1] = now[1]
  scored[2 * i] = id
end
redis.call('ZADD', inflight, unpack(scored))
redis.call('SADD', gpus, gpu)  -- known to the job: searched by outcomes, the reaper, status

local seq = redis.call('HINCRBY', config, 'dispatch_seq', #ids) - #ids
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
      argsrepr = "('" .. job .. "', '" .. id .. "', '" .. gpu .. "')", kwargsrepr = '{}',
      origin = origin, ignore_result = true, replaced_task_nesting = 0,
      stamped_headers = null, stamps = {}},
    ['properties'] = {
      correlation_id = task_id, reply_to = reply_to, delivery_mode = 2,
      delivery_info = {exchange = '', routing_key = queue}, priority = 0,
      delivery_tag = uuid(salt .. 'tag')},
  })
end
redis.call('LPUSH', queue, unpack(messages))
return ids
