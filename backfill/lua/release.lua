-- release: give leases' tokens back. Idempotent; only the holder (right fencing token, lease
-- still live) changes anything. Takes one lease or a batch.
--
-- KEYS: the per-node keys (see _lib.lua)
-- ARGV[1] now_ms ('' = Redis TIME)
-- ARGV[2] count of leases that follow (>= 1); then, per lease: lease id, fencing token
--
-- Returns one status per lease: 'released' (tokens freed now), 'already_released',
-- 'expired', 'preempted', 'fenced', or 'unknown'. An unknown id is remembered as released
-- (with its fencing token), so a rebuild from a slightly older Postgres read does not bring
-- it back. A lease that expired but was not reaped yet stays lost to its holder ('expired':
-- expiry is final), but its holder's release reclaims it now, as the reaper would: its tokens
-- must not hold the node's slack until the next reap (a node whose dispatcher sees no slack
-- reserves nothing, so nothing reclaims it in passing either).
if #ARGV < 2 then bad('expected at least 2 arguments, got ' .. #ARGV) end
local now = now_arg(ARGV[1])
local count = int_arg(ARGV[2], 'count', 1)
argc(2 + 2 * count)
local leases = {}
for i = 0, count - 1 do
  leases[#leases + 1] = {str_arg(ARGV[3 + 2 * i], 'lease_id', false),
    int_arg(ARGV[4 + 2 * i], 'fencing_token', 0)}
end

local out = {}
for i, x in ipairs(leases) do
  local id, fence = x[1], x[2]
  local l, status = held(id, fence, now)
  if l then
    end_lease(l, 'released', now)
    status = 'released'
  elseif status == 'expired' then
    local raw = redis.call('HGET', K_LEASES, id)
    if raw then end_lease(decode(id, raw), 'expired', now) end
  elseif status == 'unknown' then
    redis.call('HSET', K_ENDED, id, 'released:' .. fmt(fence))
    redis.call('ZADD', K_ENDED_AT, fmt(now), id)
  end
  out[i] = status
end
return out
