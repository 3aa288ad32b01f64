-- reap: reclaim a node's expired leases (their holders stopped heartbeating) and forget
-- ended leases older than ENDED_TTL_MS.
--
-- KEYS: the per-node keys (see _lib.lua)
-- ARGV[1] now_ms ('' = Redis TIME)
-- ARGV[2] limit: most leases reclaimed by this call (>= 1)
--
-- Returns the reclaimed lease ids.
argc(2)
local now = now_arg(ARGV[1])
local limit = int_arg(ARGV[2], 'limit', 1)
local ids = reap(now, limit)
trim_ended(now, limit)
return ids
