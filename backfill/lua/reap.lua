-- reap: reclaim a node's expired leases (their holders stopped heartbeating), forget ended
-- leases older than ENDED_TTL_MS, and count each owner's interactive tokens again from the live
-- leases (recount_owners in _lib.lua: what a tenant's share is checked against is never off
-- for longer than one reap, whatever wrote the ledger). Owners whose count was off are counted
-- in the pool hash's 'owners_recounted' field (monotonic; 0 while every script keeps them).
-- The holders of each shared prefix are counted again the same way (recount_prefixes;
-- 'prefixes_recounted').
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
local off = recount_owners()
if off > 0 and redis.call('EXISTS', K_POOL) == 1 then
  redis.call('HINCRBY', K_POOL, 'owners_recounted', off)
end
local prefixes_off = recount_prefixes()
if prefixes_off > 0 and redis.call('EXISTS', K_POOL) == 1 then
  redis.call('HINCRBY', K_POOL, 'prefixes_recounted', prefixes_off)
end
return ids
