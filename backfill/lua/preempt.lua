-- preempt: free batch room on a node by preempting live, preemptible batch leases, and publish
-- each victim's lease id on the node's preempt channel so its worker aborts the request.
--
-- KEYS: the per-node keys (see _lib.lua)
-- ARGV[1]  preempt channel of the node
-- ARGV[2]  now_ms ('' = Redis TIME)
-- ARGV[3]  tokens_needed (>= 0)
-- ARGV[4..] victim lease ids (optional). Without them the script chooses victims by the rule
--           of backfill.policy.choose_victims. With them (chosen by the caller from a
--           snapshot), each is re-checked to be still live, batch and preemptible; those that
--           no longer are are skipped.
--
-- Returns {'preempted', freed_tokens, {victim ids}}, or {'insufficient', freeable_tokens, {}}
-- when preemptible batch cannot free tokens_needed (nothing changed).
if #ARGV < 3 then bad('expected at least 3 arguments, got ' .. #ARGV) end
local channel = str_arg(ARGV[1], 'channel', false)
local now = now_arg(ARGV[2])
local needed = int_arg(ARGV[3], 'tokens_needed', 0)
for i = 4, #ARGV do str_arg(ARGV[i], 'lease_id', false) end

local victims = {}
if #ARGV >= 4 then
  local seen = {}
  for i = 4, #ARGV do
    local raw = nil
    if not seen[ARGV[i]] then raw = redis.call('HGET', K_LEASES, ARGV[i]) end
    seen[ARGV[i]] = true
    if raw then
      local l = decode(ARGV[i], raw)
      if l.class == 'batch' and l.preemptible == 1 and l.expires > now then
        victims[#victims + 1] = l
      end
    end
  end
else
  local chosen = choose_victims(needed)
  if chosen == nil then
    local all = redis.call('HGETALL', K_LEASES)
    local freeable = 0
    for i = 1, #all, 2 do
      local l = decode(all[i], all[i + 1])
      if l.class == 'batch' and l.preemptible == 1 then freeable = freeable + l.tokens end
    end
    return {'insufficient', freeable, {}}
  end
  victims = chosen
end
local freed = 0
for _, v in ipairs(victims) do freed = freed + v.tokens end
return {'preempted', freed, preempt_all(victims, now, channel)}
