-- settle: record a lease's actual use. Never grows the reservation beyond what was admitted.
--
-- KEYS: the per-node keys (see _lib.lua)
-- ARGV[1] now_ms ('' = Redis TIME)
-- ARGV[2] lease id
-- ARGV[3] fencing token the holder was given
-- ARGV[4] generated_tokens so far (>= 0; the ledger keeps the largest seen, since reports can
--         arrive out of order; the victim chooser reads it as work at stake)
-- ARGV[5] reservation_tokens ('' = keep): shrink the reservation to this many tokens rounded
--         up to the block size, e.g. once the request finished or proved smaller; a value above
--         the current reservation leaves it unchanged
--
-- Returns {'ok', tokens, generated, interactive_in_use, batch_in_use}
-- or {status} with status 'fenced' | 'expired' | 'preempted' | 'already_released' | 'unknown'
-- (nothing changed).
argc(5)
local now = now_arg(ARGV[1])
local id = str_arg(ARGV[2], 'lease_id', false)
local fence = int_arg(ARGV[3], 'fencing_token', 0)
local generated = int_arg(ARGV[4], 'generated_tokens', 0)
local shrink_to = opt_int(ARGV[5], 'reservation_tokens', 0, nil)

local l, status = held(id, fence, now)
if not l then return {status} end
local pool = load_pool()
if not pool then bad('unknown node') end

l.generated = math.max(l.generated, generated)
local freed = 0
if shrink_to ~= nil then
  local bs = pool.block_size
  local rounded = math.floor((shrink_to + bs - 1) / bs) * bs
  if rounded < l.tokens then
    freed = l.tokens - rounded
    l.tokens = rounded
  end
end
redis.call('HSET', K_LEASES, id, encode(l))
if freed > 0 then pool[used_field(l.class)] = hold(l, -freed) end
return {'ok', l.tokens, l.generated, pool.i_used, pool.b_used}
