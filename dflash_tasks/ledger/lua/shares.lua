-- Prepended (`uses: shares`) to complete.lua and reopen.lua: a row's output tokens credited to
-- (sign 1) or taken from (sign -1) the GPUs that generated them. shares: "gpu=tokens,..." for a
-- row made in more than one request (sglang/ongoing.py), empty for one request's; then all its
-- tokens are `gpu`'s.
local function credit_shares(counters_key, shares_list, gpu_name, output, sign)
  if shares_list == '' then
    redis.call('HINCRBY', counters_key, 'gpu:' .. gpu_name .. ':output_tokens', sign * output)
    return
  end
  for name, tokens in string.gmatch(shares_list, '([^,=]+)=(%d+)') do
    redis.call('HINCRBY', counters_key, 'gpu:' .. name .. ':output_tokens', sign * tonumber(tokens))
  end
end
