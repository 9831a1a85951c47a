-- Prepended (`uses: shares`) to complete.lua and reopen.lua: a row's output tokens credited to
-- (sign 1) or taken from (sign -1) the GPUs that generated them. shares: "gpu=tokens,..." for a
-- row made in more than one request (sglang/ongoing.py), empty for one request's; then all its
-- tokens are `gpu`'s.
-- Taken as 0 - n, never -n nor -1 * n: Lua's -0 reaches Redis as "-0", which HINCRBY refuses (a
-- share of no tokens: a generation moved before its first token).
local function credit_shares(counters_key, shares_list, gpu_name, output, sign)
  local function signed(n)
    return sign < 0 and 0 - n or n
  end
  if shares_list == '' then
    redis.call('HINCRBY', counters_key, 'gpu:' .. gpu_name .. ':output_tokens', signed(output))
    return
  end
  for name, tokens in string.gmatch(shares_list, '([^,=]+)=(%d+)') do
    redis.call('HINCRBY', counters_key, 'gpu:' .. name .. ':output_tokens', signed(tonumber(tokens)))
  end
end
