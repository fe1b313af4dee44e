"""The index's Lua scripts: each call is one atomic Redis round trip.

Every script takes the namespace (keys.py) as ARGV[1] and builds its keys from it; all of
them carry the model's hash tag, so under Redis Cluster a script touches a single slot.
A `now_ms` argument of -1 means "Redis's own clock" (`TIME`), so every router judges
expiry by the same clock; tests and simulations pass their own time instead.

A worker's blocks live in one sorted set, so one ZMSCORE answers "cached or predicted?":
a block its events stored scores +inf, a router's speculative entry scores its expiry.

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
local function clock(ms)
  ms = tonumber(ms)
  if ms >= 0 then return ms end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
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
local function wipe(id)
  redis.call('UNLINK', wkey(id, 'state'), wkey(id, 'blocks'), wkey(id, 'seq'), wkey(id, 'snapshot'))
  redis.call('HDEL', key('workers'), id)
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
  registered = 1
end
-- The report includes the placements made so far: pending counts restart from zero.
local state = wkey(id, 'state')
redis.call('HSET', state, 'load', clock(ARGV[9]) .. ',' .. ARGV[7], 'requests', 0, 'tokens', 0, 'until', 0)
redis.call('PEXPIRE', state, ARGV[8])
return registered
"""
)

# ARGV: ns, worker_id
DEREGISTER = _PRELUDE + "wipe(ARGV[2])\nreturn 1\n"

# ARGV: ns, worker_id, then each event as three arguments: kind (S stored | R removed |
# C cleared), seq, packed hashes. Events below the expected seq were applied already (a
# retried batch) and are skipped; one above it is a gap: the script stops there.
# Returns {status, next expected seq}; status is ok | gap | missing | unregistered.
APPLY_EVENTS = (
    _PRELUDE
    + """
local id = ARGV[2]
if redis.call('HEXISTS', key('workers'), id) == 0 then return {'unregistered', -1} end
local seq_key, blocks = wkey(id, 'seq'), wkey(id, 'blocks')
local nxt = redis.call('GET', seq_key)
if not nxt then return {'missing', -1} end
nxt = tonumber(nxt)
local status = 'ok'
for i = 3, #ARGV, 3 do
  local kind, seq = ARGV[i], tonumber(ARGV[i + 1])
  if seq > nxt then status = 'gap' break end
  if seq == nxt then
    if kind == 'S' then
      chunked('ZADD', blocks, scored('inf', ARGV[i + 2]))  -- CHUNK is even: pairs stay whole
    elseif kind == 'R' then
      chunked('ZREM', blocks, split(ARGV[i + 2]))
    else
      redis.call('UNLINK', blocks)
    end
    nxt = nxt + 1
  end
end
redis.call('SET', seq_key, nxt)
return {status, nxt}
"""
)

# Runs after the pipeline that filled ns:w:<id>:snapshot. ARGV: ns, worker_id, next_seq,
# number of hashes. Returns 1, -1 (worker not registered) or -2 (the upload is incomplete).
COMMIT_SNAPSHOT = (
    _PRELUDE
    + """
local id = ARGV[2]
local tmp, blocks = wkey(id, 'snapshot'), wkey(id, 'blocks')
if redis.call('HEXISTS', key('workers'), id) == 0 then redis.call('UNLINK', tmp) return -1 end
if redis.call('ZCARD', tmp) ~= tonumber(ARGV[4]) then redis.call('UNLINK', tmp) return -2 end
redis.call('UNLINK', blocks)
if tonumber(ARGV[4]) > 0 then redis.call('RENAME', tmp, blocks) end
redis.call('SET', wkey(id, 'seq'), ARGV[3])
return 1
"""
)

# ARGV: ns, role, now_ms, the prompt's packed block hashes (in order).
# Returns one string, a line per alive worker of the role:
#   "<id> <reported_at_ms>,<load> <cached prefix blocks> <pending requests> <pending tokens>"
# The prefix search gallops (1, 2, 4, ... hashes per command) and stops at the first block
# the worker lacks, so a worker costs in proportion to what it holds, not to the prompt.
QUERY = (
    _PRELUDE
    + """
local now = clock(ARGV[3])
local hashes = split(ARGV[4])
local function prefix_len(id)
  local blocks = wkey(id, 'blocks')
  local n, step = 0, 1
  while n < #hashes do
    local first, last = n + 1, math.min(n + step, #hashes)
    local scores = redis.call('ZMSCORE', blocks, unpack(hashes, first, last))
    for j = 1, #scores do
      local score = scores[j]  -- false: absent; 'inf': cached; a number: speculative until then
      if not (score and (score == 'inf' or tonumber(score) > now)) then return n end
      n = n + 1
    end
    step = math.min(step * 2, CHUNK)
  end
  return n
end
local rows = {}
for _, id in ipairs(redis.call('SMEMBERS', key('role:' .. ARGV[2]))) do
  local state = redis.call('HMGET', wkey(id, 'state'), 'load', 'requests', 'tokens', 'until')
  if state[1] then  -- the heartbeat has not expired
    local requests, tokens = state[2], state[3]
    if tonumber(state[4]) <= now then requests, tokens = 0, 0 end
    rows[#rows + 1] = table.concat({id, state[1], prefix_len(id), requests, tokens}, ' ')
  end
end
return table.concat(rows, '\\n')
"""
)

# ARGV: ns, worker_id, new prompt tokens, spec_ttl_ms, pending_ttl_ms, now_ms, packed hashes
# of the blocks the worker will hold once it has prefilled the prompt.
# Returns 1, or 0 when the worker is no longer alive (nothing is written).
RECORD_PLACEMENT = (
    _PRELUDE
    + """
local id = ARGV[2]
local state, blocks = wkey(id, 'state'), wkey(id, 'blocks')
local pending = redis.call('HMGET', state, 'requests', 'tokens', 'until')
if not pending[1] then return 0 end
local now = clock(ARGV[6])
local spec_ttl, pending_ttl = tonumber(ARGV[4]), tonumber(ARGV[5])
if spec_ttl > 0 and #ARGV[7] > 0 then
  -- GT: a cached block (+inf) stays cached; an older speculative entry gets the later expiry.
  chunked('ZADD', blocks, scored(now + spec_ttl, ARGV[7]), 'GT')
  redis.call('ZREMRANGEBYSCORE', blocks, '-inf', now)
end
local requests, tokens = tonumber(pending[1]), tonumber(pending[2])
if tonumber(pending[3]) <= now then requests, tokens = 0, 0 end
redis.call('HSET', state, 'requests', requests + 1, 'tokens', tokens + tonumber(ARGV[3]), 'until', now + pending_ttl)
return 1
"""
)

# ARGV: ns, worker id, new tokens, now ms (-1: Redis TIME). A placed request finished: its
# pending load goes, unless a load report (or the pending TTL) already cleared it.
COMPLETE_PLACEMENT = (
    _PRELUDE
    + """
local state = wkey(ARGV[2], 'state')
local pending = redis.call('HMGET', state, 'requests', 'tokens', 'until')
if not pending[1] or tonumber(pending[3]) <= clock(ARGV[4]) then return 0 end
local requests = math.max(tonumber(pending[1]) - 1, 0)
local tokens = math.max(tonumber(pending[2]) - tonumber(ARGV[3]), 0)
redis.call('HSET', state, 'requests', requests, 'tokens', tokens)
return 1
"""
)

# ARGV: ns. Wipes every registered worker whose heartbeat has expired; returns how many.
COLLECT_GARBAGE = (
    _PRELUDE
    + """
local count = 0
for _, id in ipairs(redis.call('HKEYS', key('workers'))) do
  if redis.call('EXISTS', wkey(id, 'state')) == 0 then
    wipe(id)
    count = count + 1
  end
end
return count
"""
)
