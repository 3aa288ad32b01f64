-- Shared helpers of the ledger scripts. backfill/ledger.py prepends a line of constants
-- (SHIFT, MAX_INT, PPM, ENDED_TTL_MS, REAP_IN_RESERVE, from backfill/keys.py) and this file
-- to every script, so the rules below exist once.
--
-- Every per-node script takes the same KEYS:
--   KEYS[1] pool hash      KEYS[2] leases hash (id -> msgpack)   KEYS[3] expiry zset
--   KEYS[4] fence counter  KEYS[5] ended hash (id -> reason:fence)  KEYS[6] ended_at zset
--   KEYS[7] the node's ready marker (holds its epoch: the node's ledger is complete; absent
--           after a loss of data until a rebuild restores it)
--   KEYS[8] owners hash (owner -> interactive tokens its live leases hold; see hold())
--   KEYS[9] prefixes hash (shared prompt prefix id -> 'tokens:holders'; see join_prefix())
-- All nine share the node's hash tag, so each script runs on one Redis Cluster shard.
--
-- Redis runs a script to the end or stops at the first error, keeping earlier writes: every
-- script validates all of its arguments before its first write.
--
-- Numbers go to redis.call through fmt(): Lua turns numbers into strings with "%.14g", which
-- would round fencing tokens (up to 2^53).
local K_POOL, K_LEASES, K_EXPIRY, K_FENCE, K_ENDED, K_ENDED_AT, K_READY, K_OWNERS =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local K_PREFIXES = KEYS[9]

local function fmt(n) return string.format('%d', n) end

local function bad(msg) error({err = 'backfill: ' .. msg}) end

local function int_arg(v, name, lo)
  local n = tonumber(v)
  if n == nil or n ~= n or n ~= math.floor(n) or n < lo or n > MAX_INT then
    bad('bad ' .. name .. ': ' .. tostring(v))
  end
  return n
end

local function opt_int(v, name, lo, default)
  if v == nil or v == '' then return default end
  return int_arg(v, name, lo)
end

local function flag_arg(v, name)
  if v == '1' then return 1 elseif v == '0' then return 0 end
  bad('bad ' .. name .. ' (0 or 1): ' .. tostring(v))
end

local function str_arg(v, name, allow_empty)
  if v == nil or (v == '' and not allow_empty) or string.len(v) > 256 then
    bad('bad ' .. name .. ': ' .. tostring(v))
  end
  return v
end

local function class_arg(v)
  if v == 'interactive' or v == 'batch' then return v end
  bad('bad class: ' .. tostring(v))
end

local function now_arg(v)
  if v == nil or v == '' then
    local t = redis.call('TIME')
    return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return int_arg(v, 'now_ms', 0)
end

local function argc(n)
  if #ARGV ~= n then bad('expected ' .. n .. ' arguments, got ' .. #ARGV) end
end

local POOL_FIELDS = {'capacity', 'block_size', 'reserve', 'headroom', 'safety', 'max_seq_i',
  'max_seq_b', 'overcommit_ppm', 'epoch', 'observed', 'observed_ms', 'i_used', 'b_used'}

-- The pool as numbers (epoch is nil until a rebuild or a registration gives it one), or nil.
local function load_pool()
  local v = redis.call('HMGET', K_POOL, unpack(POOL_FIELDS))
  if not v[1] then return nil end
  local p = {}
  for i, f in ipairs(POOL_FIELDS) do p[f] = tonumber(v[i]) end
  for _, f in ipairs({'observed', 'observed_ms', 'i_used', 'b_used', 'overcommit_ppm'}) do
    p[f] = p[f] or 0
  end
  return p
end

-- The formulas of backfill/policy.py and backfill/reservations.py.
local function batch_ceiling(p)
  return math.max(0, p.capacity - math.max(p.reserve, p.headroom) - p.safety)
end

local function batch_slack(p)
  local i_eff = math.max(p.i_used, p.observed)
  return math.max(0, p.capacity - math.max(p.reserve, i_eff + p.headroom) - p.b_used - p.safety)
end

local function interactive_room(p)
  return math.max(0, p.capacity - p.i_used - p.b_used)
end

-- A lease is stored as a msgpack array (integers stay exact up to 2^53). `prefix` ('' = none)
-- names the shared prompt prefix the lease holds a reference to and `ptok` its tokens; the
-- lease's own `tokens` leave them out (a lease stored before prefixes has neither).
local function decode(id, raw)
  local t = cmsgpack.unpack(raw)
  return {id = id, class = t[1], tokens = t[2], owner = t[3], fence = t[4], expires = t[5],
    preemptible = t[6], generated = t[7], started = t[8], deadline = t[9], ttl = t[10],
    prefix = t[11] or '', ptok = t[12] or 0}
end

local function encode(l)
  return cmsgpack.pack({l.class, l.tokens, l.owner, l.fence, l.expires, l.preemptible,
    l.generated, l.started, l.deadline, l.ttl, l.prefix or '', l.ptok or 0})
end

local function lease_reply(l)
  return {l.id, l.class, l.tokens, l.owner, l.fence, l.expires, l.preemptible, l.generated,
    l.started, l.deadline, l.prefix or '', l.ptok or 0}
end

local function used_field(class)
  if class == 'interactive' then return 'i_used' end
  return 'b_used'
end

-- Change what live lease `l` holds by `delta` tokens (positive when it is admitted or
-- restored, negative when it shrinks or ends): its class's use in the pool hash and, for an
-- interactive lease, its owner's in the owners hash, which a tenant's share is checked
-- against. Every change of a lease's tokens goes through here, so the two never part. An
-- owner holding nothing leaves the hash (it does not grow with every tenant ever seen; a
-- count below zero, from leases admitted before owners were counted, goes with it).
-- Returns the class's new use.
local function hold(l, delta)
  local used = redis.call('HINCRBY', K_POOL, used_field(l.class), fmt(delta))
  if l.class == 'interactive' then
    if redis.call('HINCRBY', K_OWNERS, l.owner, fmt(delta)) <= 0 then
      redis.call('HDEL', K_OWNERS, l.owner)
    end
  end
  return used
end

-- The interactive tokens `owner`'s live leases hold on this node.
local function owner_holds(owner)
  return tonumber(redis.call('HGET', K_OWNERS, owner) or '0')
end

-- Count each owner's interactive tokens again from the live leases, replacing the owners hash;
-- returns how many owners' counts were off. hold() keeps the two together; this puts them back
-- together after something that did not (a process still on a version from before owners were
-- counted, during a rolling upgrade): a count left too high would shrink its tenant's share on
-- the node for good.
local function recount_owners()
  local counts, found = {}, {}
  local all = redis.call('HGETALL', K_LEASES)
  for i = 1, #all, 2 do
    local l = decode(all[i], all[i + 1])
    if l.class == 'interactive' and l.tokens > 0 then
      counts[l.owner] = (counts[l.owner] or 0) + l.tokens
    end
  end
  local stored = redis.call('HGETALL', K_OWNERS)
  for i = 1, #stored, 2 do found[stored[i]] = tonumber(stored[i + 1]) end
  local off = 0
  for owner, n in pairs(found) do
    if counts[owner] ~= n then
      off = off + 1
      if counts[owner] == nil then redis.call('HDEL', K_OWNERS, owner) end
    end
  end
  for owner, n in pairs(counts) do
    if found[owner] ~= n then
      if found[owner] == nil then off = off + 1 end
      redis.call('HSET', K_OWNERS, owner, fmt(n))
    end
  end
  return off
end

-- A node's shared prompt prefixes (issue 36): the engine's prefix cache holds a prefix's
-- blocks once for every request that starts with it, so the ledger holds its tokens once, in
-- batch use, for as long as one live lease refers to it. The prefixes hash keeps, per prefix,
-- 'tokens:holders'; the first holder brings the tokens in, the last one to end takes them out
-- (end_lease, whichever way a lease ends: released, expired, reaped, preempted), and reap
-- counts the holders again from the live leases (recount_prefixes). Holders never go below 1
-- in the hash: a prefix with none is not there.
local function prefix_entry(pid)
  local v = redis.call('HGET', K_PREFIXES, pid)
  if not v then return nil, 0 end
  local sep = string.find(v, ':', 1, true)
  return tonumber(string.sub(v, 1, sep - 1)), tonumber(string.sub(v, sep + 1))
end

local BATCH_PREFIX = {class = 'batch'}

local function join_prefix(l)
  if l.prefix == '' then return end
  local tokens, holders = prefix_entry(l.prefix)
  if tokens == nil then
    redis.call('HSET', K_PREFIXES, l.prefix, fmt(l.ptok) .. ':1')
    hold(BATCH_PREFIX, l.ptok)
  else
    redis.call('HSET', K_PREFIXES, l.prefix, fmt(tokens) .. ':' .. fmt(holders + 1))
  end
end

local function leave_prefix(l)
  if l.prefix == '' then return end
  local tokens, holders = prefix_entry(l.prefix)
  if tokens == nil then return end
  if holders <= 1 then
    redis.call('HDEL', K_PREFIXES, l.prefix)
    hold(BATCH_PREFIX, -tokens)
  else
    redis.call('HSET', K_PREFIXES, l.prefix, fmt(tokens) .. ':' .. fmt(holders - 1))
  end
end

-- Count each prefix's holders again from the live leases, replacing the prefixes hash and
-- moving batch use by what it gains or loses; returns how many prefixes were off.
local function recount_prefixes()
  local counts, sizes = {}, {}
  local all = redis.call('HGETALL', K_LEASES)
  for i = 1, #all, 2 do
    local l = decode(all[i], all[i + 1])
    if l.prefix ~= '' then
      counts[l.prefix] = (counts[l.prefix] or 0) + 1
      sizes[l.prefix] = math.max(sizes[l.prefix] or 0, l.ptok)
    end
  end
  local off = 0
  local stored = redis.call('HGETALL', K_PREFIXES)
  local found = {}
  for i = 1, #stored, 2 do
    local pid = stored[i]
    local tokens, holders = prefix_entry(pid)
    found[pid] = true
    if counts[pid] == nil then
      off = off + 1
      redis.call('HDEL', K_PREFIXES, pid)
      hold(BATCH_PREFIX, -tokens)
    elseif counts[pid] ~= holders then
      off = off + 1
      redis.call('HSET', K_PREFIXES, pid, fmt(tokens) .. ':' .. fmt(counts[pid]))
    end
  end
  for pid, n in pairs(counts) do
    if not found[pid] then
      off = off + 1
      redis.call('HSET', K_PREFIXES, pid, fmt(sizes[pid]) .. ':' .. fmt(n))
      hold(BATCH_PREFIX, sizes[pid])
    end
  end
  return off
end

local function end_lease(l, reason, now)
  redis.call('HDEL', K_LEASES, l.id)
  redis.call('ZREM', K_EXPIRY, l.id)
  redis.call('HSET', K_ENDED, l.id, reason .. ':' .. fmt(l.fence))
  redis.call('ZADD', K_ENDED_AT, fmt(now), l.id)
  hold(l, -l.tokens)
  leave_prefix(l)
end

-- Reclaim up to `limit` leases whose expiry is at or before now; returns their ids.
local function reap(now, limit)
  local ids = redis.call('ZRANGEBYSCORE', K_EXPIRY, '-inf', fmt(now), 'LIMIT', 0, limit)
  for _, id in ipairs(ids) do
    local raw = redis.call('HGET', K_LEASES, id)
    if raw then
      end_lease(decode(id, raw), 'expired', now)
    else
      redis.call('ZREM', K_EXPIRY, id)
    end
  end
  return ids
end

local function trim_ended(now, limit)
  local old = redis.call('ZRANGEBYSCORE', K_ENDED_AT, '-inf', fmt(now - ENDED_TTL_MS),
    'LIMIT', 0, limit)
  if #old > 0 then
    redis.call('HDEL', K_ENDED, unpack(old))
    redis.call('ZREM', K_ENDED_AT, unpack(old))
  end
end

-- Why a lease id is not live: 'released' | 'expired' | 'preempted' with its fence, or nil.
local function ended(id)
  local e = redis.call('HGET', K_ENDED, id)
  if not e then return nil, nil end
  local sep = string.find(e, ':', 1, true)
  return string.sub(e, 1, sep - 1), tonumber(string.sub(e, sep + 1))
end

-- The live lease `id` if `fence` holds it, else nil and the holder's status: 'fenced',
-- 'expired', 'preempted', 'already_released' or 'unknown'. An expired lease not yet reaped is
-- already lost to its holder: expiry is final.
local function held(id, fence, now)
  local raw = redis.call('HGET', K_LEASES, id)
  if raw then
    local l = decode(id, raw)
    if l.fence ~= fence then return nil, 'fenced' end
    if l.expires <= now then return nil, 'expired' end
    return l, 'ok'
  end
  local reason, efence = ended(id)
  if reason == nil then return nil, 'unknown' end
  if efence ~= fence then return nil, 'fenced' end
  if reason == 'released' then return nil, 'already_released' end
  return nil, reason
end

-- Victims as backfill.policy.choose_victims picks them: preemptible batch leases, least
-- generated work first, then the latest deadline (0 = none = latest), then the most recently
-- started, then by id; greedy until `needed` is freed, then drop picks the rest cover.
local function choose_victims(needed)
  if needed <= 0 then return {} end
  local all = redis.call('HGETALL', K_LEASES)
  local cands = {}
  for i = 1, #all, 2 do
    local l = decode(all[i], all[i + 1])
    if l.class == 'batch' and l.preemptible == 1 then
      l.dkey = (l.deadline == 0) and math.huge or l.deadline
      cands[#cands + 1] = l
    end
  end
  table.sort(cands, function(a, b)
    if a.generated ~= b.generated then return a.generated < b.generated end
    if a.dkey ~= b.dkey then return a.dkey > b.dkey end
    if a.started ~= b.started then return a.started > b.started end
    return a.id < b.id
  end)
  local chosen, freed = {}, 0
  for _, l in ipairs(cands) do
    if freed >= needed then break end
    chosen[#chosen + 1] = l
    freed = freed + l.tokens
  end
  if freed < needed then return nil end
  for i = #chosen, 1, -1 do
    if freed - chosen[i].tokens >= needed then
      freed = freed - chosen[i].tokens
      table.remove(chosen, i)
    end
  end
  return chosen
end

-- Preempt `victims`: free their tokens, remember why they ended, tell their workers.
local function preempt_all(victims, now, channel)
  local ids = {}
  for _, v in ipairs(victims) do
    end_lease(v, 'preempted', now)
    ids[#ids + 1] = v.id
  end
  -- A monotonic count in the pool hash: /metrics reads it without asking every holder.
  if #ids > 0 then redis.call('HINCRBY', K_POOL, 'preemptions', fmt(#ids)) end
  for _, id in ipairs(ids) do redis.call('PUBLISH', channel, id) end
  return ids
end
