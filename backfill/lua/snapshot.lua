-- snapshot: one node's pool and its live leases, read at one instant (read-only).
--
-- KEYS: the per-node keys (see _lib.lua)
-- ARGV[1] now_ms ('' = Redis TIME)
--
-- Returns {} when the node has no pool, else {now_ms, ready, capacity, block_size, reserve,
-- headroom, safety, max_seq_interactive, max_seq_batch, overcommit_ppm, epoch (0 = none yet),
-- observed, observed_ms, interactive_in_use, batch_in_use, batch_slack, interactive_room,
-- fence_counter, {lease...}, {prefix...}} with each lease as lease_reply gives it and each
-- shared prompt prefix the node holds as {prefix id, tokens, holders}. Leases past their expiry
-- that no one reaped yet are listed (and counted in use) until they are reaped.
argc(1)
local now = now_arg(ARGV[1])
local p = load_pool()
if not p then return {} end
local ready = redis.call('EXISTS', K_READY)
local leases = {}
local all = redis.call('HGETALL', K_LEASES)
for i = 1, #all, 2 do leases[#leases + 1] = lease_reply(decode(all[i], all[i + 1])) end
local counter = tonumber(redis.call('GET', K_FENCE) or '0')
local prefixes = {}
local stored = redis.call('HGETALL', K_PREFIXES)
for i = 1, #stored, 2 do
  local tokens, holders = prefix_entry(stored[i])
  prefixes[#prefixes + 1] = {stored[i], tokens, holders}
end
return {now, ready, p.capacity, p.block_size, p.reserve, p.headroom, p.safety, p.max_seq_i,
  p.max_seq_b, p.overcommit_ppm, p.epoch or 0, p.observed, p.observed_ms, p.i_used, p.b_used,
  batch_slack(p), interactive_room(p), counter, leases, prefixes}
