-- reserve: admit leases on one node, or say why not (the rules of backfill.policy.decide).
-- Takes one request or a batch: requests are decided one after another, each seeing the pool
-- as the previous ones left it, all in one atomic call (one round trip for a worker's batch).
--
-- KEYS: the per-node keys (see _lib.lua)
-- ARGV[1]  preempt channel of the node
-- ARGV[2]  now_ms ('' = Redis TIME)
-- ARGV[3]  count of requests that follow (>= 1); then, per request, 13 values:
--   lease id (a live id returns that lease: reserve is idempotent; ids must be distinct)
--   class: 'interactive' | 'batch'
--   prompt_tokens (>= 0)
--   max_output_tokens (>= 0; 0: an embedding, which holds its prompt alone;
--     prompt_tokens + max_output_tokens >= 1)
--   n: sequences the request creates (>= 1)
--   ttl_ms (>= 1)
--   owner (worker or gateway id, for operators; may be '')
--   preemptible: '1' | '0' (batch items at their preemption cap send '0')
--   deadline_ms ('' or '0' = none)
--   allow_preempt: '1' | '0' (interactive: may preempt batch to get room)
--   tenant_share_ppm: '' = none, else 1..1,000,000 (interactive only): the millionths of the
--     node's capacity that the interactive leases of this request's owner (the gateway owns
--     a tenant's leases as gateway/{tenant_id}) may hold with it, rounded down; an owner that
--     holds nothing on the node is not refused by it, so no request is refused for good
--   prefix_id ('' = none; batch only, n = 1): the shared prompt prefix the request starts with
--     (issue 36). Its tokens are held once on the node, by the first lease that refers to it
--     (in batch use, apart from any lease's own), until the last such lease ends; the lease
--     itself holds round_up(prompt + max_output) - prefix_tokens (the block that straddles
--     the prefix's end counted whole), and asks for the prefix's tokens too where the node
--     does not hold them yet
--   prefix_tokens (0 with no prefix; else whole blocks, at least one, below prompt_tokens;
--     a prefix the node holds must be held with the same tokens)
--
-- Returns one reply per request:
--   {'admitted' | 'existing', fence, tokens, expires_ms, started_ms, generated, {victim ids}}
--     (victims were preempted, and published, to make room), or
--   {'denied', reason, tokens, slack, room}, and for 'tenant_share' also what the owner
--   holds and its bound, {..., held, bound}; each denial also adds 1 to the pool hash's
--   'denied:<class>:<reason>' field (a monotonic count for /metrics), or
--   {'no_pool'} for every request when the node has no pool and no ready marker: the caller
--   tells an unknown node (an error) from one whose keys were lost (rebuilding) by the
--   ledger's member set, which lives in another slot.
if #ARGV < 3 then bad('expected at least 3 arguments, got ' .. #ARGV) end
local channel = str_arg(ARGV[1], 'channel', false)
local now = now_arg(ARGV[2])
local count = int_arg(ARGV[3], 'count', 1)
argc(3 + 13 * count)

local reqs, ids = {}, {}
for i = 0, count - 1 do
  local b = 3 + 13 * i
  local r = {id = str_arg(ARGV[b + 1], 'lease_id', false), class = class_arg(ARGV[b + 2]),
    prompt = int_arg(ARGV[b + 3], 'prompt_tokens', 0),
    max_out = int_arg(ARGV[b + 4], 'max_output_tokens', 0),
    n = int_arg(ARGV[b + 5], 'n', 1), ttl = int_arg(ARGV[b + 6], 'ttl_ms', 1),
    owner = str_arg(ARGV[b + 7], 'owner', true),
    preemptible = flag_arg(ARGV[b + 8], 'preemptible'),
    deadline = opt_int(ARGV[b + 9], 'deadline_ms', 0, 0),
    allow_preempt = flag_arg(ARGV[b + 10], 'allow_preempt'),
    share = opt_int(ARGV[b + 11], 'tenant_share_ppm', 1, nil),
    prefix = str_arg(ARGV[b + 12], 'prefix_id', true),
    ptok = int_arg(ARGV[b + 13], 'prefix_tokens', 0)}
  if (r.prefix == '') ~= (r.ptok == 0) then bad('a prefix_id goes with its prefix_tokens') end
  if r.prefix ~= '' and (r.class ~= 'batch' or r.n ~= 1 or r.ptok >= r.prompt) then
    bad('a shared prefix is for a batch request of one sequence, shorter than its prompt')
  end
  if r.prompt + r.max_out < 1 then bad('a reservation holds at least one token') end
  if r.share and (r.share > PPM or r.class ~= 'interactive') then
    bad('bad tenant_share_ppm (1..' .. PPM .. ', interactive only): ' .. fmt(r.share))
  end
  if ids[r.id] then bad('lease id ' .. r.id .. ' appears twice') end
  ids[r.id] = true
  reqs[#reqs + 1] = r
end

local ready = redis.call('EXISTS', K_READY) == 1
local pool = load_pool()
if not pool and ready then bad('unknown node') end
if not pool then
  local out = {}
  for i = 1, count do out[i] = {'no_pool'} end
  return out
end
if not pool.epoch then
  local out = {}
  for i = 1, count do out[i] = {'denied', 'ledger_rebuilding', 0, 0, 0} end
  return out
end
for _, r in ipairs(reqs) do
  if r.prefix ~= '' then
    if r.ptok % pool.block_size ~= 0 then bad('prefix_tokens must be whole blocks') end
    local held_tokens = prefix_entry(r.prefix)
    if held_tokens ~= nil and held_tokens ~= r.ptok then
      bad('prefix ' .. r.prefix .. ' is held with ' .. fmt(held_tokens) .. ' tokens')
    end
  end
end

for _, r in ipairs(reqs) do
  local raw = redis.call('HGET', K_LEASES, r.id)
  if raw then
    r.existing = decode(r.id, raw)
    if r.existing.class ~= r.class then bad('lease id ' .. r.id .. ' is held by another class') end
  elseif redis.call('HEXISTS', K_ENDED, r.id) == 1 then
    bad('lease id ' .. r.id .. ' already ended')
  end
end

-- Every argument is valid: writes start here.
if #reap(now, REAP_IN_RESERVE) > 0 then pool = load_pool() end

local function denied(reason, tokens)
  return {'denied', reason, tokens, batch_slack(pool), interactive_room(pool)}
end

local function decide(r)
  local limit = pool.max_seq_b
  if r.class == 'interactive' then limit = pool.max_seq_i end
  if r.prompt + r.max_out > limit then return denied('over_class_limit', 0) end
  local charged_out = r.max_out
  if r.class == 'batch' and r.preemptible == 1 and pool.overcommit_ppm > 0 then
    charged_out = math.floor((r.max_out * pool.overcommit_ppm + PPM - 1) / PPM)
  end
  local bs = pool.block_size
  local tokens = r.n * (math.floor((r.prompt + charged_out + bs - 1) / bs) * bs)
  -- A shared prefix: the lease's own tokens leave it out, and what is asked of the pool
  -- leaves it out too where the node holds it already.
  local own = tokens - r.ptok
  if r.prefix ~= '' and prefix_entry(r.prefix) ~= nil then tokens = own end
  local ceiling = pool.capacity
  if r.class == 'batch' then ceiling = batch_ceiling(pool) end
  if tokens > ceiling then return denied('larger_than_pool', tokens) end

  if r.share then
    -- Checked before room and preemption: a tenant over its share waits for its own leases
    -- to end, and preempts no batch on the way.
    local held = owner_holds(r.owner)
    local bound = math.floor(pool.capacity * r.share / PPM)
    if held > 0 and held + tokens > bound then
      local d = denied('tenant_share', tokens)
      d[6], d[7] = held, bound
      return d
    end
  end

  local victims = {}
  if r.class == 'batch' then
    if not ready then return denied('ledger_rebuilding', tokens) end
    if tokens > batch_slack(pool) then return denied('no_slack', tokens) end
  elseif not ready then
    -- Batch in use is unknown until the rebuild ends, but batch was only ever admitted
    -- outside the reserve: the reserve itself is safe to hand out.
    if pool.i_used + tokens > pool.reserve then return denied('ledger_rebuilding', tokens) end
  elseif tokens > interactive_room(pool) then
    local chosen = nil
    if r.allow_preempt == 1 then
      chosen = choose_victims(pool.i_used + pool.b_used + tokens - pool.capacity)
    end
    if chosen == nil then return denied('no_room', tokens) end
    victims = chosen
  end

  local counter = redis.call('INCR', K_FENCE)
  if counter >= SHIFT then
    -- The counter would spill into the epoch bits: start the next epoch. Tokens stay
    -- monotonic; a later rebuild takes max(its epoch, highest restored epoch + 1).
    pool.epoch = pool.epoch + 1
    redis.call('HSET', K_POOL, 'epoch', fmt(pool.epoch))
    redis.call('SET', K_FENCE, '1')
    counter = 1
  end
  for _, v in ipairs(victims) do pool.b_used = pool.b_used - v.tokens end
  local victim_ids = preempt_all(victims, now, channel)
  local l = {id = r.id, class = r.class, tokens = own, owner = r.owner,
    fence = pool.epoch * SHIFT + counter, expires = now + r.ttl, preemptible = r.preemptible,
    generated = 0, started = now, deadline = r.deadline, ttl = r.ttl, prefix = r.prefix,
    ptok = r.ptok}
  redis.call('HSET', K_LEASES, l.id, encode(l))
  redis.call('ZADD', K_EXPIRY, fmt(l.expires), l.id)
  pool[used_field(r.class)] = hold(l, own)
  join_prefix(l)
  pool.b_used = tonumber(redis.call('HGET', K_POOL, 'b_used'))
  return {'admitted', l.fence, l.tokens, l.expires, l.started, 0, victim_ids}
end

local out = {}
for i, r in ipairs(reqs) do
  local e = r.existing
  if e then
    out[i] = {'existing', e.fence, e.tokens, e.expires, e.started, e.generated, {}}
  else
    out[i] = decide(r)
    if out[i][1] == 'denied' then
      -- Counted inside the decision's atomic call, so /metrics sees every holder's denials.
      redis.call('HINCRBY', K_POOL, 'denied:' .. r.class .. ':' .. out[i][2], 1)
    end
  end
end
return out
