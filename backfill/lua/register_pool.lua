-- register_pool: create or update a node's pool from the engine's measured capacity and the
-- policy. Leases and usage are kept; a smaller pool only stops new admissions.
--
-- KEYS: the per-node keys (see _lib.lua)
-- ARGV[1] capacity_tokens (>= 1)
-- ARGV[2] block_size (>= 1)
-- ARGV[3] interactive reserve tokens (0..capacity)
-- ARGV[4] headroom tokens (>= 0)
-- ARGV[5] safety margin tokens (>= 0)
-- ARGV[6] max sequence tokens, interactive (>= 1)
-- ARGV[7] max sequence tokens, batch (>= 1)
-- ARGV[8] batch overcommit, ppm of max_output charged (0 = off, else 1..1,000,000)
-- ARGV[9] epoch ('' = keep the pool's; a new pool then takes ARGV[10], or none: then it admits
--         nothing until a rebuild gives it one). A higher epoch restarts the fencing counter;
--         a lower one is an error. An epoch given here does not set the ready marker: the
--         rebuild sets it once the node's leases are back.
-- ARGV[10] the epoch of the built ledger, for a node the ledger never held ('' = none: the
--         ledger is being rebuilt, or the node was held and its keys were lost). A new pool
--         takes it and opens at once (sets the node's ready marker).
--
-- Returns {'registered', epoch (0 = none yet)}.
argc(10)
local capacity = int_arg(ARGV[1], 'capacity_tokens', 1)
local block_size = int_arg(ARGV[2], 'block_size', 1)
local reserve = int_arg(ARGV[3], 'reserve_tokens', 0)
local headroom = int_arg(ARGV[4], 'headroom_tokens', 0)
local safety = int_arg(ARGV[5], 'safety_margin_tokens', 0)
local max_i = int_arg(ARGV[6], 'max_sequence_interactive', 1)
local max_b = int_arg(ARGV[7], 'max_sequence_batch', 1)
local ppm = int_arg(ARGV[8], 'overcommit_ppm', 0)
local epoch = opt_int(ARGV[9], 'epoch', 1, nil)
local adopt = opt_int(ARGV[10], 'ledger epoch', 1, nil)
if reserve > capacity then bad('reserve_tokens exceeds capacity_tokens') end
if ppm > PPM then bad('overcommit_ppm exceeds ' .. PPM) end
if epoch ~= nil and epoch > MAX_EPOCH then bad('epoch exceeds ' .. MAX_EPOCH) end
if adopt ~= nil and adopt > MAX_EPOCH then bad('ledger epoch exceeds ' .. MAX_EPOCH) end

local current = tonumber(redis.call('HGET', K_POOL, 'epoch') or '')
if epoch ~= nil and current ~= nil and epoch < current then
  bad('stale epoch ' .. fmt(epoch) .. ' (the pool is at ' .. fmt(current) .. ')')
end
local opens = false
if epoch == nil and current == nil and adopt ~= nil then
  epoch = adopt
  opens = true
end

redis.call('HSET', K_POOL, 'capacity', fmt(capacity), 'block_size', fmt(block_size),
  'reserve', fmt(reserve), 'headroom', fmt(headroom), 'safety', fmt(safety),
  'max_seq_i', fmt(max_i), 'max_seq_b', fmt(max_b), 'overcommit_ppm', fmt(ppm))
redis.call('HSETNX', K_POOL, 'i_used', '0')
redis.call('HSETNX', K_POOL, 'b_used', '0')
if epoch ~= nil and (current == nil or epoch > current) then
  redis.call('HSET', K_POOL, 'epoch', fmt(epoch))
  redis.call('DEL', K_FENCE)
  if opens then redis.call('SET', K_READY, fmt(epoch)) end
  return {'registered', epoch}
end
return {'registered', current or 0}
