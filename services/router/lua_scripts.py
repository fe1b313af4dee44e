"""The index's Lua scripts: each call is one atomic Redis round trip.

Every script takes the namespace (keys.py) as ARGV[1] and builds its keys from it; all of
them carry the model's hash tag, so under Redis Cluster a script touches a single slot.
A `now_ms` argument of -1 means "Redis's own clock" (`TIME`), so every router judges
expiry by the same clock; tests and simulations pass their own time instead.

A worker's blocks live in a set (what its events stored) and, for queries, in one inverted
index per model: block hash -> a bitmap of the workers holding it, a worker's bit being the
slot it got when it registered. Events, snapshots and wipes keep the two in step. A query
searches every worker's cached run at once in the bitmaps (block 1 settles the workers
without it; then doubling and bisection, trusting prefix closure), so its look-ups grow
with the log of the runs, not with the number of workers. Routers' predictions live
beside the sets in a small sorted set per worker, of checkpoint hashes scored by expiry
(prefix_index.py says what a query credits), searched only for the workers listed under
the prompt's first block. Every worker's load, pending placements and heartbeat expiry
are one row of one hash, so a query reads them all with one command. A look-up in a big
set or hash costs about a microsecond of cache misses: the number of look-ups and of
commands is what a query costs.

Block hashes travel packed: one argument holding n * 16 bytes, split inside the script.
Packing a prompt's 128 hashes into one argument, and answering a query with one string,
keeps redis-py's per-element packing and parsing off the routing path.
"""

from __future__ import annotations

from ..engine.block_hash import BLOCK_HASH_BYTES

_PRELUDE = f"""
local ns = ARGV[1]
local HASH_BYTES = {BLOCK_HASH_BYTES}
local CHUNK = 4000  -- values per command: Lua's unpack() stops near 8000
local function key(part) return ns .. ':' .. part end
local function wkey(id, part) return ns .. ':w:' .. id .. ':' .. part end
local function server_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function clock(ms)
  ms = tonumber(ms)
  if ms >= 0 then return ms end
  return server_ms()
end
-- A worker's row in ns:loads (keys.py): alive_until, report, pending requests, tokens, until.
local function load_row(id)
  local row = redis.call('HGET', key('loads'), id)
  if not row then return nil end
  local alive_until, report, requests, tokens, pending_until = string.match(row, '^(%S+) (%S+) (%S+) (%S+) (%S+)$')
  return {{alive_until = alive_until, report = report, requests = tonumber(requests), tokens = tonumber(tokens),
           pending_until = tonumber(pending_until)}}
end
local function save_row(id, row)
  redis.call('HSET', key('loads'), id, table.concat(
    {{row.alive_until, row.report, row.requests, row.tokens, row.pending_until}}, ' '))
end
local function split(packed)
  local hashes, sub = {{}}, string.sub
  for i = 1, #packed / HASH_BYTES do hashes[i] = sub(packed, (i - 1) * HASH_BYTES + 1, i * HASH_BYTES) end
  return hashes
end
local function chunked(cmd, k, items, flag)
  for i = 1, #items, CHUNK do
    if flag then redis.call(cmd, k, flag, unpack(items, i, math.min(i + CHUNK - 1, #items)))
    else redis.call(cmd, k, unpack(items, i, math.min(i + CHUNK - 1, #items))) end
  end
end
local function scored(score, packed)  -- ZADD arguments for packed hashes: score, member, ...
  local args, sub = {{}}, string.sub
  for i = 1, #packed / HASH_BYTES do
    args[2 * i - 1] = score
    args[2 * i] = sub(packed, (i - 1) * HASH_BYTES + 1, i * HASH_BYTES)
  end
  return args
end
local band, bor, lshift = bit.band, bit.bor, bit.lshift
local HALF = CHUNK / 2  -- field-value pairs per HSET
-- A mask is a string of bytes, bit (slot % 8) of byte (slot // 8 + 1) for each slot; no
-- trailing zero bytes, so a block nobody holds has no field at all.
local function with_bit(mask, slot, on)
  local i, flag = math.floor(slot / 8) + 1, lshift(1, slot % 8)
  local b = string.byte(mask, i) or 0
  if (band(b, flag) ~= 0) == on then return mask end
  if #mask < i then mask = mask .. string.rep(string.char(0), i - #mask) end
  mask = string.sub(mask, 1, i - 1) .. string.char(on and bor(b, flag) or b - flag) .. string.sub(mask, i + 1)
  if on then return mask end
  return (string.gsub(mask, '%z+$', ''))
end
-- Sets (on) or clears one worker's bit in the masks of these blocks.
local function mark(hashes, slot, on)
  local blocks = key('blocks')
  for i = 1, #hashes, HALF do
    local last = math.min(i + HALF - 1, #hashes)
    local masks = redis.call('HMGET', blocks, unpack(hashes, i, last))
    local set, drop = {{}}, {{}}
    for j = i, last do
      local old = masks[j - i + 1] or ''
      local new = with_bit(old, slot, on)
      if new ~= old then
        if new == '' then
          drop[#drop + 1] = hashes[j]
        else
          set[#set + 1] = hashes[j]
          set[#set + 1] = new
        end
      end
    end
    if #set > 0 then redis.call('HSET', blocks, unpack(set)) end
    if #drop > 0 then redis.call('HDEL', blocks, unpack(drop)) end
  end
end
-- The worker's slot: its bit in every mask. The lowest free one, taken at registration.
local function slot_of(id)
  local slot = redis.call('HGET', key('slots'), id)
  if slot then return tonumber(slot) end
  local used = {{}}
  for _, s in ipairs(redis.call('HVALS', key('slots'))) do used[tonumber(s)] = true end
  slot = 0
  while used[slot] do slot = slot + 1 end
  redis.call('HSET', key('slots'), id, slot)
  return slot
end
local function count_stored(id)
  redis.call('HSET', key('stored'), id, redis.call('SCARD', wkey(id, 'cached')))
end
local function wipe(id)
  local slot = redis.call('HGET', key('slots'), id)
  if slot then mark(redis.call('SMEMBERS', wkey(id, 'cached')), tonumber(slot), false) end
  redis.call('UNLINK', wkey(id, 'alive'), wkey(id, 'cached'), wkey(id, 'spec'), wkey(id, 'seq'), wkey(id, 'snapshot'))
  redis.call('HDEL', key('workers'), id)
  redis.call('HDEL', key('loads'), id)
  redis.call('HDEL', key('slots'), id)
  redis.call('HDEL', key('stored'), id)
  redis.call('SREM', key('role:prefill'), id)
  redis.call('SREM', key('role:decode'), id)
  local name, epoch = string.match(id, '^(.*)@(%x+)$')
  if name and redis.call('HGET', key('names'), name) == epoch then redis.call('HDEL', key('names'), name) end
end
"""

# ARGV: ns, worker_id, name, epoch, info_json, roles (space-separated), load, ttl_ms, now_ms
# Returns 1 when it (re-)registered the worker (its index is empty), 0 for a plain
# heartbeat, -1 when a later epoch of the same name owns the registration.
HEARTBEAT = (
    _PRELUDE
    + """
local id, name, epoch = ARGV[2], ARGV[3], ARGV[4]
local current = redis.call('HGET', key('names'), name)
if current and current > epoch then return -1 end
local registered = 0
if current ~= epoch or redis.call('HEXISTS', key('workers'), id) == 0 then
  if current and current ~= epoch then wipe(name .. '@' .. current) end
  redis.call('HSET', key('names'), name, epoch)
  redis.call('HSET', key('workers'), id, ARGV[5])
  for role in string.gmatch(ARGV[6], '%S+') do redis.call('SADD', key('role:' .. role), id) end
  slot_of(id)
  registered = 1
end
-- The heartbeat key, and the same expiry in the row queries read (both on Redis's clock).
-- The report includes the placements made so far: pending counts restart from zero.
local ttl = tonumber(ARGV[8])
redis.call('SET', wkey(id, 'alive'), 1, 'PX', ttl)
save_row(id, {alive_until = server_ms() + ttl, report = clock(ARGV[9]) .. ',' .. ARGV[7], requests = 0, tokens = 0,
              pending_until = 0})
return registered
"""
)

# ARGV: ns, worker_id
DEREGISTER = _PRELUDE + "wipe(ARGV[2])\nreturn 1\n"

# ARGV: ns, worker_id, then each event as three arguments: kind (S stored | R removed |
# C cleared), seq, packed hashes. Events below the expected seq were applied already (a
# retried batch) and are skipped; one above it is a gap: the script stops there. A removal
# also drops the blocks' speculative entries; a clear drops them all.
# Returns {status, next expected seq}; status is ok | gap | missing | unregistered.
APPLY_EVENTS = (
    _PRELUDE
    + """
local id = ARGV[2]
if redis.call('HEXISTS', key('workers'), id) == 0 then return {'unregistered', -1} end
local seq_key, cached, spec = wkey(id, 'seq'), wkey(id, 'cached'), wkey(id, 'spec')
local nxt = redis.call('GET', seq_key)
if not nxt then return {'missing', -1} end
nxt = tonumber(nxt)
local slot = slot_of(id)
local status = 'ok'
for i = 3, #ARGV, 3 do
  local kind, seq = ARGV[i], tonumber(ARGV[i + 1])
  if seq > nxt then status = 'gap' break end
  if seq == nxt then
    if kind == 'S' then
      local hashes = split(ARGV[i + 2])
      chunked('SADD', cached, hashes)
      mark(hashes, slot, true)
    elseif kind == 'R' then
      local hashes = split(ARGV[i + 2])
      chunked('SREM', cached, hashes)
      chunked('ZREM', spec, hashes)
      mark(hashes, slot, false)
    else
      mark(redis.call('SMEMBERS', cached), slot, false)
      redis.call('UNLINK', cached, spec)
    end
    nxt = nxt + 1
  end
end
redis.call('SET', seq_key, nxt)
count_stored(id)
return {status, nxt}
"""
)

# Runs after the pipeline that filled ns:w:<id>:snapshot. ARGV: ns, worker_id, next_seq,
# number of hashes. Returns 1, -1 (worker not registered) or -2 (the upload is incomplete).
# The worker's speculative entries go too: the snapshot starts its entries afresh.
COMMIT_SNAPSHOT = (
    _PRELUDE
    + """
local id = ARGV[2]
local tmp, cached = wkey(id, 'snapshot'), wkey(id, 'cached')
if redis.call('HEXISTS', key('workers'), id) == 0 then redis.call('UNLINK', tmp) return -1 end
if redis.call('SCARD', tmp) ~= tonumber(ARGV[4]) then redis.call('UNLINK', tmp) return -2 end
local slot = slot_of(id)
mark(redis.call('SDIFF', cached, tmp), slot, false)
mark(redis.call('SDIFF', tmp, cached), slot, true)
redis.call('UNLINK', cached, wkey(id, 'spec'))
if tonumber(ARGV[4]) > 0 then redis.call('RENAME', tmp, cached) end
redis.call('SET', wkey(id, 'seq'), ARGV[3])
count_stored(id)
return 1
"""
)

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
    _PRELUDE
    + CHECKPOINTS
    + """
local now = clock(ARGV[3])
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

local clocks = server_ms() .. ' ' .. now
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
    _PRELUDE
    + """
local id = ARGV[2]
local spec = wkey(id, 'spec')
local row = load_row(id)
if not row or tonumber(row.alive_until) <= server_ms() then return 0 end
local now = clock(ARGV[6])
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
    _PRELUDE
    + """
local row = load_row(ARGV[2])
if not row or row.pending_until <= clock(ARGV[4]) then return 0 end
row.requests = math.max(row.requests - 1, 0)
row.tokens = math.max(row.tokens - tonumber(ARGV[3]), 0)
save_row(ARGV[2], row)
return 1
"""
)

# ARGV: ns. Wipes every registered worker whose heartbeat has expired; returns how many.
COLLECT_GARBAGE = (
    _PRELUDE
    + """
local count = 0
for _, id in ipairs(redis.call('HKEYS', key('workers'))) do
  if redis.call('EXISTS', wkey(id, 'alive')) == 0 then
    wipe(id)
    count = count + 1
  end
end
return count
"""
)
