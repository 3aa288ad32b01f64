-- release: give a lease's tokens back. Idempotent; only the holder (right fencing token, lease
-- still live) changes anything.
--
-- KEYS: the per-node keys (see _lib.lua)
-- ARGV[1] now_ms ('' = Redis TIME)
-- ARGV[2] lease id
-- ARGV[3] fencing token the holder was given
--
-- Returns {status}: 'released' (tokens freed now), 'already_released', 'expired',
-- 'preempted', 'fenced', or 'unknown'. An unknown id is remembered as released (with its
-- fencing token), so a rebuild from a slightly older Postgres read does not bring it back.
argc(3)
local now = now_arg(ARGV[1])
local id = str_arg(ARGV[2], 'lease_id', false)
local fence = int_arg(ARGV[3], 'fencing_token', 0)

local l, status = held(id, fence, now)
if l then
  end_lease(l, 'released', now)
  return {'released'}
end
if status == 'unknown' then
  redis.call('HSET', K_ENDED, id, 'released:' .. fmt(fence))
  redis.call('ZADD', K_ENDED_AT, fmt(now), id)
end
return {status}
