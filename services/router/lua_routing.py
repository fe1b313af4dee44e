"""The routing path's Lua scripts: the query a decision waits for, and the two writes it
sends without waiting (script_channel.py): a placement, and a placed request's completion.

They build on lua_scripts.py (its prelude: keys, clocks, the load rows) and the key layout
in keys.py. A query is most of what Redis does per routing decision, so it is written to
issue few commands: the cached runs of all workers share their bitmap look-ups, every
worker's load row comes from one HMGET, speculative entries are searched only for the
workers listed under the prompt's first block, and the reply is one string left for the
caller to parse. docs/benchmarks.md (Router) has what each of these saved.
"""

from __future__ import annotations

from .lua_scripts import PRELUDE

# The checkpoint positions of a prompt of `num` blocks: prefix_index.checkpoint_positions.
CHECKPOINTS = """
local function checkpoints(num)
  local positions, position, step = {}, 1, 1
  while position <= num do
    positions[#positions + 1] = position
    position = position + step
    if position >= 4 * step then step = step * 2 end
  end
  if num > 0 and positions[#positions] ~= num then positions[#positions + 1] = num end
  return positions
end
"""

# ARGV: ns, role, now_ms, the prompt's packed block hashes (in order), its first block hash
# in hex (empty: no full block).
# Returns one string of space-separated fields: Redis's clock and now_ms (ms), then eight per
# worker of the role,
#   <id> <alive until> <reported_at_ms>,<load> <pending requests> <pending tokens>
#   <pending until> <credited prefix blocks> <stored blocks>
# The caller drops workers whose heartbeat expired (alive until <= Redis's clock) and pending
# counts whose time is up (pending until <= now_ms): no row is parsed here.
# Hashes are split off the packed argument only when a lookup needs them.
QUERY = (
    PRELUDE
    + CHECKPOINTS
    + """
local server = server_ms()
local now = clock(ARGV[3], server)
local packed = ARGV[4]
local num = #packed / HASH_BYTES
local hashes, sub = {}, string.sub
local function at(i)
  local h = hashes[i]
  if not h then
    h = sub(packed, (i - 1) * HASH_BYTES + 1, i * HASH_BYTES)
    hashes[i] = h
  end
  return h
end

-- The cached runs of every worker at once, each searched as prefix_index.cached_run does:
-- block 1; then blocks 2, 4, 8, ... and the last, up to the first missing; then bisection
-- between the last held and the first missing block. The workers' searches share one
-- HMGET of the bitmaps per round. runs[j] is the run of slots[j] (false: no slot).
local function cached_runs(slots)
  local runs, masks, at_byte, flag = {}, {}, {}, {}  -- masks: position -> bitmap (false: none)
  local function fetch(positions)
    local todo, args = {}, {}
    for _, p in ipairs(positions) do
      if masks[p] == nil then
        todo[#todo + 1] = p
        args[#args + 1] = at(p)
      end
    end
    if #args == 0 then return end
    for i, mask in ipairs(redis.call('HMGET', key('blocks'), unpack(args))) do masks[todo[i]] = mask end
  end
  local function holds(j, p)
    local b = masks[p] and string.byte(masks[p], at_byte[j])
    return b ~= nil and b ~= false and band(b, flag[j]) ~= 0
  end
  local held, missing, searching = {}, {}, {}
  if num > 0 then fetch({1}) end
  for j, slot in ipairs(slots) do
    runs[j] = 0
    if slot and num > 0 then
      at_byte[j], flag[j] = math.floor(slot / 8) + 1, lshift(1, slot % 8)
      if holds(j, 1) then
        held[j], missing[j] = 1, num + 1
        searching[#searching + 1] = j
      end
    end
  end
  if #searching > 0 and num > 1 then
    local doubling, p = {}, 2
    while p < num do
      doubling[#doubling + 1] = p
      p = 2 * p
    end
    doubling[#doubling + 1] = num
    fetch(doubling)
    for _, j in ipairs(searching) do
      for _, q in ipairs(doubling) do
        if not holds(j, q) then missing[j] = q break end
        held[j] = q
      end
    end
  end
  while #searching > 0 do
    local still, middles = {}, {}
    for _, j in ipairs(searching) do
      if missing[j] - held[j] > 1 then
        still[#still + 1] = j
        middles[#middles + 1] = math.floor((held[j] + missing[j]) / 2)
      end
    end
    if #still > 0 then fetch(middles) end
    for i, j in ipairs(still) do
      if holds(j, middles[i]) then held[j] = middles[i] else missing[j] = middles[i] end
    end
    searching = still
  end
  for j, run in pairs(held) do runs[j] = run end
  return runs
end

-- The predicted run: the live checkpoints that continue a run of `length` blocks, one after
-- another, looked up in batches of 1 (most workers have none for this prompt), 4, 16, ...
local grid = checkpoints(num)
local function is_live(expiry) return expiry and tonumber(expiry) > now end
local function predicted_run(k, length)
  local first, size = 1, 1
  while grid[first] and grid[first] <= length do first = first + 1 end
  while grid[first] do
    local args = {}
    for j = first, math.min(first + size - 1, #grid) do args[#args + 1] = at(grid[j]) end
    local expiries = size == 1 and {redis.call('ZSCORE', k, args[1])} or redis.call('ZMSCORE', k, unpack(args))
    for j = 1, #args do
      if not is_live(expiries[j]) then return length end
      length = grid[first]
      first = first + 1
    end
    size = 4 * size
  end
  return length
end

local clocks = server .. ' ' .. now
local members = redis.call('SMEMBERS', key('role:' .. ARGV[2]))
local ids, rows, slots, stored = {}, {}, {}, {}
for i = 1, #members, CHUNK do
  local last = math.min(i + CHUNK - 1, #members)
  local got_rows = redis.call('HMGET', key('loads'), unpack(members, i, last))
  local got_slots = redis.call('HMGET', key('slots'), unpack(members, i, last))
  local got_stored = redis.call('HMGET', key('stored'), unpack(members, i, last))
  for k = 1, last - i + 1 do
    if got_rows[k] then  -- registered (a wipe removes the row)
      local j = #ids + 1
      ids[j], rows[j] = members[i + k - 1], got_rows[k]
      slots[j] = got_slots[k] and tonumber(got_slots[k])
      stored[j] = got_stored[k] or 0
    end
  end
end
if #ids == 0 then return clocks end
local runs = cached_runs(slots)
-- Only workers that took a prompt starting with this one's first block lately can hold
-- speculative entries for it (hashes chain): their sets are searched, no one else's.
local predicting = {}
if num > 0 then
  for _, id in ipairs(redis.call('SMEMBERS', key('predicted:' .. ARGV[5]))) do predicting[id] = true end
end
local out = {clocks}  -- one flat list, joined once: a table and a string per worker cost more
for j, id in ipairs(ids) do
  local n = 1 + 4 * (j - 1)
  out[n + 1], out[n + 2], out[n + 4] = id, rows[j], stored[j]
  out[n + 3] = predicting[id] and predicted_run(wkey(id, 'spec'), runs[j]) or runs[j]
end
return table.concat(out, ' ')
"""
)

# ARGV: ns, worker_id, new prompt tokens, spec_ttl_ms, pending_ttl_ms, now_ms, packed hashes
# of the placed prompt's checkpoints past its credited prefix (prefix_index.checkpoints_beyond),
# the prompt's first block hash in hex (empty: no full block).
# Returns 1, or 0 when the worker is no longer alive (nothing is written).
RECORD_PLACEMENT = (
    PRELUDE
    + """
local id = ARGV[2]
local spec = wkey(id, 'spec')
local row = load_row(id)
local server = server_ms()
if not row or tonumber(row.alive_until) <= server then return 0 end
local now = clock(ARGV[6], server)
local spec_ttl, pending_ttl = tonumber(ARGV[4]), tonumber(ARGV[5])
if spec_ttl > 0 and #ARGV[7] > 0 then
  -- GT: an entry's expiry only grows. CHUNK is even: (score, member) pairs stay whole.
  chunked('ZADD', spec, scored(now + spec_ttl, ARGV[7]), 'GT')
  redis.call('ZREMRANGEBYSCORE', spec, '-inf', now)
  -- The queries' filter: which workers may hold entries for prompts with this first block.
  -- It outlives its members' entries (removals, snapshots and expiry leave it), never the
  -- reverse. Key expiry runs on Redis's clock: with an injected clock it is kept.
  local predicted = key('predicted:' .. ARGV[8])
  redis.call('SADD', predicted, id)
  if tonumber(ARGV[6]) < 0 then redis.call('PEXPIRE', predicted, spec_ttl) end
end
if row.pending_until <= now then row.requests, row.tokens = 0, 0 end
row.requests, row.tokens = row.requests + 1, row.tokens + tonumber(ARGV[3])
row.pending_until = now + pending_ttl
save_row(id, row)
return 1
"""
)

# ARGV: ns, worker id, new tokens, now ms (-1: Redis TIME). A placed request finished: its
# pending load goes, unless a load report (or the pending TTL) already cleared it.
COMPLETE_PLACEMENT = (
    PRELUDE
    + """
local row = load_row(ARGV[2])
if not row or row.pending_until <= clock(ARGV[4]) then return 0 end
row.requests = math.max(row.requests - 1, 0)
row.tokens = math.max(row.tokens - tonumber(ARGV[3]), 0)
save_row(ARGV[2], row)
return 1
"""
)
