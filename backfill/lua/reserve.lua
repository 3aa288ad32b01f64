-- reserve: admit one lease on a node, or say why not (the rules of backfill.policy.decide).
--
-- KEYS: the per-node keys (see _lib.lua)
-- ARGV[1]  preempt channel of the node
-- ARGV[2]  now_ms ('' = Redis TIME)
-- ARGV[3]  lease id (a retry with a live id returns that lease: reserve is idempotent)
-- ARGV[4]  class: 'interactive' | 'batch'
-- ARGV[5]  prompt_tokens (>= 0)
-- ARGV[6]  max_output_tokens (>= 1)
-- ARGV[7]  n: sequences the request creates (>= 1)
-- ARGV[8]  ttl_ms (>= 1)
-- ARGV[9]  owner (worker or gateway id, for operators; may be '')
-- ARGV[10] preemptible: '1' | '0' (batch items at their preemption cap send '0')
-- ARGV[11] deadline_ms ('' or '0' = none)
-- ARGV[12] allow_preempt: '1' | '0' (interactive: may preempt batch to get room)
--
-- Returns {'admitted' | 'existing', lease..., interactive_in_use, batch_in_use, {victim ids}}
--   where lease... = id, class, tokens, owner, fence, expires_ms, preemptible, generated,
--   started_ms, deadline_ms; victims were preempted (and published) to make room;
-- or {'denied', reason, tokens, slack, room, interactive_in_use, batch_in_use}.
argc(12)
local channel = str_arg(ARGV[1], 'channel', false)
local now = now_arg(ARGV[2])
local id = str_arg(ARGV[3], 'lease_id', false)
local class = class_arg(ARGV[4])
local prompt = int_arg(ARGV[5], 'prompt_tokens', 0)
local max_out = int_arg(ARGV[6], 'max_output_tokens', 1)
local n = int_arg(ARGV[7], 'n', 1)
local ttl = int_arg(ARGV[8], 'ttl_ms', 1)
local owner = str_arg(ARGV[9], 'owner', true)
local preemptible = flag_arg(ARGV[10], 'preemptible')
local deadline = opt_int(ARGV[11], 'deadline_ms', 0, 0)
local allow_preempt = flag_arg(ARGV[12], 'allow_preempt')

local ready = redis.call('EXISTS', K_READY) == 1
local pool = load_pool()
if not pool then
  if ready then bad('unknown node') end
  return {'denied', 'ledger_rebuilding', 0, 0, 0, 0, 0}
end
if not pool.epoch then
  return {'denied', 'ledger_rebuilding', 0, 0, 0, pool.i_used, pool.b_used}
end

local existing = redis.call('HGET', K_LEASES, id)
if existing then
  local l = decode(id, existing)
  if l.class ~= class then bad('lease id ' .. id .. ' is held by another class') end
  return {'existing', l.id, l.class, l.tokens, l.owner, l.fence, l.expires, l.preemptible,
    l.generated, l.started, l.deadline, pool.i_used, pool.b_used, {}}
end
if redis.call('HEXISTS', K_ENDED, id) == 1 then bad('lease id ' .. id .. ' already ended') end

if #reap(now, REAP_IN_RESERVE) > 0 then pool = load_pool() end
trim_ended(now, REAP_IN_RESERVE)

local function denied(reason, tokens)
  return {'denied', reason, tokens, batch_slack(pool), interactive_room(pool), pool.i_used,
    pool.b_used}
end

local limit = pool.max_seq_b
if class == 'interactive' then limit = pool.max_seq_i end
if prompt + max_out > limit then return denied('over_class_limit', 0) end

local charged_out = max_out
if class == 'batch' and preemptible == 1 and pool.overcommit_ppm > 0 then
  charged_out = math.floor((max_out * pool.overcommit_ppm + PPM - 1) / PPM)
end
local bs = pool.block_size
local tokens = n * (math.floor((prompt + charged_out + bs - 1) / bs) * bs)

local ceiling = pool.capacity
if class == 'batch' then ceiling = batch_ceiling(pool) end
if tokens > ceiling then return denied('larger_than_pool', tokens) end

local victims = {}
if class == 'batch' then
  if not ready then return denied('ledger_rebuilding', tokens) end
  if tokens > batch_slack(pool) then return denied('no_slack', tokens) end
elseif not ready then
  -- Batch in use is unknown until the rebuild ends, but batch was only ever admitted outside
  -- the reserve: the reserve itself is safe to hand out.
  if pool.i_used + tokens > pool.reserve then return denied('ledger_rebuilding', tokens) end
elseif tokens > interactive_room(pool) then
  local chosen = nil
  if allow_preempt == 1 then
    chosen = choose_victims(pool.i_used + pool.b_used + tokens - pool.capacity)
  end
  if chosen == nil then return denied('no_room', tokens) end
  victims = chosen
end

-- Admitted: every write happens below this line.
local counter = redis.call('INCR', K_FENCE)
if counter >= SHIFT then
  -- The counter would spill into the epoch bits: start the next epoch. Tokens stay monotonic;
  -- a later rebuild takes max(its epoch, highest restored epoch + 1).
  pool.epoch = pool.epoch + 1
  redis.call('HSET', K_POOL, 'epoch', fmt(pool.epoch))
  redis.call('SET', K_FENCE, '1')
  counter = 1
end
local victim_ids = preempt_all(victims, now, channel)
local lease = {id = id, class = class, tokens = tokens, owner = owner,
  fence = pool.epoch * SHIFT + counter, expires = now + ttl, preemptible = preemptible,
  generated = 0, started = now, deadline = deadline, ttl = ttl}
redis.call('HSET', K_LEASES, id, encode(lease))
redis.call('ZADD', K_EXPIRY, fmt(lease.expires), id)
local field = used_field(class)
local used = redis.call('HINCRBY', K_POOL, field, fmt(tokens))
local i_used, b_used = pool.i_used, pool.b_used
for _, v in ipairs(victims) do b_used = b_used - v.tokens end
if class == 'interactive' then i_used = used else b_used = used end
return {'admitted', lease.id, lease.class, lease.tokens, lease.owner, lease.fence,
  lease.expires, lease.preemptible, lease.generated, lease.started, lease.deadline, i_used,
  b_used, victim_ids}
