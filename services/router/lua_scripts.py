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
keeps redis-py's per-element packing and parsing off the routing path. The worker side's
scripts are here; the routing path's (query, placement, completion) are in lua_routing.py.
"""

from __future__ import annotations

from ..engine.core.block_hash import BLOCK_HASH_BYTES

PRELUDE = f"""
local ns = ARGV[1]
local HASH_BYTES = {BLOCK_HASH_BYTES}
local CHUNK = 4000  -- values per command: Lua's unpack() stops near 8000
local function key(part) return ns .. ':' .. part end
local function wkey(id, part) return ns .. ':w:' .. id .. ':' .. part end
local function server_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- The script's clock: `ms` when a caller injects one, else Redis's (`server`, if the script
-- read it already: one TIME per script).
local function clock(ms, server)
  ms = tonumber(ms)
  if ms >= 0 then return ms end
  return server or server_ms()
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
# heartbeat, -1 when a later epoch of the same name owns the registration, -2 when a router
# retired the worker (RETIRE).
HEARTBEAT = (
    PRELUDE
    + """
local id, name, epoch = ARGV[2], ARGV[3], ARGV[4]
if redis.call('EXISTS', ns .. ':retired:' .. id) == 1 then return -2 end
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
local ttl, server = tonumber(ARGV[8]), server_ms()
redis.call('SET', wkey(id, 'alive'), 1, 'PX', ttl)
save_row(id, {alive_until = server + ttl, report = clock(ARGV[9], server) .. ',' .. ARGV[7], requests = 0, tokens = 0,
              pending_until = 0})
return registered
"""
)

# ARGV: ns, worker_id
DEREGISTER = PRELUDE + "wipe(ARGV[2])\nreturn 1\n"

# ARGV: ns, worker_id, ttl_ms. A deregistration, and a tombstone that refuses the worker's
# heartbeats until it expires.
RETIRE = PRELUDE + "wipe(ARGV[2])\nredis.call('SET', ns .. ':retired:' .. ARGV[2], 1, 'PX', ARGV[3])\nreturn 1\n"

# ARGV: ns, worker_id, then each event as three arguments: kind (S stored | R removed |
# C cleared), seq, packed hashes. Events below the expected seq were applied already (a
# retried batch) and are skipped; one above it is a gap: the script stops there. A removal
# also drops the blocks' speculative entries; a clear drops them all.
# Returns {status, next expected seq}; status is ok | gap | missing | unregistered.
APPLY_EVENTS = (
    PRELUDE
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
    PRELUDE
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

# ARGV: ns. Wipes every registered worker whose heartbeat has expired; returns how many.
COLLECT_GARBAGE = (
    PRELUDE
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
