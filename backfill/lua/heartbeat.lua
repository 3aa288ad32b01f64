-- heartbeat: extend a live lease held with the right fencing token.
--
-- KEYS: the per-node keys (see _lib.lua)
-- ARGV[1] now_ms ('' = Redis TIME)
-- ARGV[2] lease id
-- ARGV[3] fencing token the holder was given
-- ARGV[4] ttl_ms ('' = the lease's own TTL): the lease then expires at now + ttl
--
-- Returns {'ok', expires_ms} or {status} with status 'fenced' | 'expired' | 'preempted' |
-- 'already_released' | 'unknown' (nothing changed; the holder must stop: its tokens are gone,
-- or were never known here — after a loss of Redis data, 'unknown' lasts until the rebuild
-- restores the lease from Postgres).
argc(4)
local now = now_arg(ARGV[1])
local id = str_arg(ARGV[2], 'lease_id', false)
local fence = int_arg(ARGV[3], 'fencing_token', 0)
local ttl = opt_int(ARGV[4], 'ttl_ms', 1, nil)

local l, status = held(id, fence, now)
if not l then return {status} end
l.expires = now + (ttl or l.ttl)
redis.call('HSET', K_LEASES, id, encode(l))
redis.call('ZADD', K_EXPIRY, fmt(l.expires), id)
return {'ok', l.expires}
