-- Token bucket: one tenant's request rate at the API edge.
--
-- KEYS[1]  the bucket (hash: tokens, ts = Redis time in microseconds of the last update)
-- ARGV[1]  refill rate, tokens per second (> 0)
-- ARGV[2]  burst: the bucket's size (>= 1)
-- ARGV[3]  cost of this request (>= 1)
-- ARGV[4]  optional: tokens to take at most when allowed (>= cost; default cost): the rest,
--          beyond the cost, are credits the caller spends on the tenant's next requests
-- ARGV[5]  optional: unspent credits handed back first (>= 0; default 0)
--
-- Returns {allowed (1 or 0), milliseconds until the request would be allowed, tokens taken
-- (0 when refused; else between cost and ARGV[4])}.
-- The clock is Redis's own, so API processes on different machines share one time line.
-- Arguments are checked before the first write (a Lua error does not roll back writes).

local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local take = tonumber(ARGV[4] or ARGV[3])
local refund = tonumber(ARGV[5] or '0')
if not rate or rate <= 0 or not burst or burst < 1 or not cost or cost < 1 then
  return redis.error_reply('ERR rate_limit: rate > 0, burst >= 1 and cost >= 1 are required')
end
if not take or take < cost or not refund or refund < 0 then
  return redis.error_reply('ERR rate_limit: take >= cost and refund >= 0 are required')
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1])
local ts = tonumber(state[2])
if tokens == nil or ts == nil then
  tokens = burst
  ts = now
end
tokens = math.min(burst, tokens + math.max(0, now - ts) / 1000000 * rate + refund)

local allowed = 0
local wait_ms = 0
local taken = 0
if tokens >= cost then
  taken = math.max(cost, math.min(take, math.floor(tokens)))
  tokens = tokens - taken
  allowed = 1
else
  wait_ms = math.ceil((cost - tokens) / rate * 1000)
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
-- An idle bucket refills completely after burst / rate seconds; it need not outlive that.
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return {allowed, wait_ms, taken}
