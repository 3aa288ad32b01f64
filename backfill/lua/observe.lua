-- observe: record the engine-observed non-batch KV use of a node (from vLLM's metrics), which
-- narrows batch slack when interactive traffic bypasses the gateway.
--
-- KEYS: the per-node keys (see _lib.lua)
-- ARGV[1] now_ms ('' = Redis TIME)
-- ARGV[2] observed_tokens (>= 0)
--
-- Returns {'ok', batch_slack} or {'unknown_node'} (nothing changed).
argc(2)
local now = now_arg(ARGV[1])
local observed = int_arg(ARGV[2], 'observed_tokens', 0)
local pool = load_pool()
if not pool then return {'unknown_node'} end
redis.call('HSET', K_POOL, 'observed', fmt(observed), 'observed_ms', fmt(now))
pool.observed = observed
return {'ok', batch_slack(pool)}
