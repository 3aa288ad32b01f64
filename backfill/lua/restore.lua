-- restore: put back a node's live leases after Redis lost them: batch leases from Postgres
-- (part of a rebuild), or an interactive lease by the gateway that holds it. Leases still live here are kept as they are, leases that ended here lately (same
-- fencing token) and leases already past their expiry are skipped: a rebuild can only ever
-- count more tokens as held, never fewer.
--
-- KEYS: the per-node keys (see _lib.lua)
-- ARGV[1] now_ms ('' = Redis TIME)
-- ARGV[2] count of leases that follow
-- then, per lease, 12 values: lease id, tokens (>= 0), fencing token, expires_ms, owner,
--   preemptible ('1' | '0'), generated_tokens, started_ms, deadline_ms ('' or '0' = none),
--   service class ('batch' | 'interactive'), prefix_id ('' = none), prefix_tokens (0 with no
--   prefix): a restored lease refers to its shared prefix again, and the first one restored
--   brings the prefix's tokens back into batch use (a prefix the node still holds keeps its
--   tokens)
-- Every fencing token must be below the pool's epoch * 2^32 (given from an earlier epoch), so
-- tokens handed out after the rebuild are larger.
--
-- Returns {restored, skipped}.
if #ARGV < 2 then bad('expected at least 2 arguments, got ' .. #ARGV) end
local now = now_arg(ARGV[1])
local count = int_arg(ARGV[2], 'count', 0)
argc(2 + 12 * count)
local pool = load_pool()
if not pool then bad('unknown node') end
if not pool.epoch then bad('the pool has no epoch: register it with one first') end
local floor = pool.epoch * SHIFT
local leases = {}
for i = 0, count - 1 do
  local b = 2 + 12 * i
  local l = {id = str_arg(ARGV[b + 1], 'lease_id', false), class = class_arg(ARGV[b + 10]),
    tokens = int_arg(ARGV[b + 2], 'tokens', 0),
    fence = int_arg(ARGV[b + 3], 'fencing_token', 0),
    expires = int_arg(ARGV[b + 4], 'expires_ms', 0),
    owner = str_arg(ARGV[b + 5], 'owner', true),
    preemptible = flag_arg(ARGV[b + 6], 'preemptible'),
    generated = int_arg(ARGV[b + 7], 'generated_tokens', 0),
    started = int_arg(ARGV[b + 8], 'started_ms', 0),
    deadline = opt_int(ARGV[b + 9], 'deadline_ms', 0, 0),
    prefix = str_arg(ARGV[b + 11], 'prefix_id', true),
    ptok = int_arg(ARGV[b + 12], 'prefix_tokens', 0)}
  if (l.prefix == '') ~= (l.ptok == 0) then bad('a prefix_id goes with its prefix_tokens') end
  if l.fence >= floor then
    bad('fencing token ' .. fmt(l.fence) .. ' of ' .. l.id .. ' is not below epoch ' ..
      fmt(pool.epoch) .. ' * 2^32')
  end
  l.ttl = math.max(1, l.expires - now)
  leases[#leases + 1] = l
end

local restored, skipped = 0, 0
for _, l in ipairs(leases) do
  local _, efence = ended(l.id)
  if l.expires <= now or efence == l.fence or redis.call('HEXISTS', K_LEASES, l.id) == 1 then
    skipped = skipped + 1
  else
    redis.call('HSET', K_LEASES, l.id, encode(l))
    redis.call('ZADD', K_EXPIRY, fmt(l.expires), l.id)
    hold(l, l.tokens)
    join_prefix(l)
    restored = restored + 1
  end
end
return {restored, skipped}
