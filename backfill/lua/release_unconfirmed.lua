-- release_unconfirmed: give back reservations whose answer their holder never heard (the reply
-- to its reserve was lost with its connection: granted or not, it cannot tell, and it never
-- learned their fencing tokens). By lease id, fenced by owner: lease ids are the holder's own
-- and never reused, and the owner names the holder's attempt.
--
-- KEYS: the per-node keys (see _lib.lua)
-- ARGV[1] now_ms ('' = Redis TIME)
-- ARGV[2] count of leases that follow (>= 1); then, per lease: lease id, owner
--
-- Returns one status per lease: 'released' (it was granted: its tokens are freed now),
-- 'unknown' (never granted: the id is remembered as ended, so the reservation, should it still
-- arrive, is refused), 'fenced' (the id holds another owner's lease), or how the lease already
-- ended ('already_released', 'expired', 'preempted'). A lease expired but not reaped yet is
-- reclaimed now and answers 'expired', as a release does.
if #ARGV < 2 then bad('expected at least 2 arguments, got ' .. #ARGV) end
local now = now_arg(ARGV[1])
local count = int_arg(ARGV[2], 'count', 1)
argc(2 + 2 * count)

local out = {}
for i = 0, count - 1 do
  local id = str_arg(ARGV[3 + 2 * i], 'lease_id', false)
  local owner = str_arg(ARGV[4 + 2 * i], 'owner', true)
  local status
  local raw = redis.call('HGET', K_LEASES, id)
  if raw then
    local l = decode(id, raw)
    if l.owner ~= owner then
      status = 'fenced'
    elseif l.expires <= now then
      end_lease(l, 'expired', now)
      status = 'expired'
    else
      end_lease(l, 'released', now)
      status = 'released'
    end
  else
    local reason = ended(id)
    if reason == nil then
      redis.call('HSET', K_ENDED, id, 'released:0')
      redis.call('ZADD', K_ENDED_AT, fmt(now), id)
      status = 'unknown'
    elseif reason == 'released' then
      status = 'already_released'
    else
      status = reason
    end
  end
  out[i + 1] = status
end
return out
