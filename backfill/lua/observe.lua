-- observe: record the engine-observed non-batch KV use of a node (from vLLM's metrics), which
-- narrows batch slack when interactive traffic bypasses the gateway.
--
-- KEYS: the per-node keys (see _lib.lua)
-- ARGV[1] now_ms ('' = Redis TIME)
-- ARGV[2] observed_tokens (>= 0)
-- ARGV[3] (optional; '' = not measured) allocated_over_reserved: KV tokens the engine held
--         above what the ledger reserved on the node at the sample (>= 0): kept as the pool
--         hash's 'over_reserved' gauge, and each sample above 0 counted in its monotonic
--         'over_reserved_samples' (the invariant, checked physically; issue 36)
--
-- Returns {'ok', batch_slack} or {'unknown_node'} (nothing changed).
if #ARGV ~= 2 and #ARGV ~= 3 then bad('expected 2 or 3 arguments, got ' .. #ARGV) end
local now = now_arg(ARGV[1])
local observed = int_arg(ARGV[2], 'observed_tokens', 0)
local over = opt_int(ARGV[3], 'allocated_over_reserved', 0, nil)
local pool = load_pool()
if not pool then return {'unknown_node'} end
redis.call('HSET', K_POOL, 'observed', fmt(observed), 'observed_ms', fmt(now))
if over ~= nil then
  redis.call('HSET', K_POOL, 'over_reserved', fmt(over))
  if over > 0 then redis.call('HINCRBY', K_POOL, 'over_reserved_samples', 1) end
end
pool.observed = observed
return {'ok', batch_slack(pool)}
