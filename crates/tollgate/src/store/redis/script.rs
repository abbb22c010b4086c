//! The Redis store's Lua: the general script (a plan, all or nothing), the one-take script
//! and its grouped form, the give-back of a cluster's split take, and the pieces they share
//! (the time, the save with its expiry, a leased state's records). Each decides as
//! tollgate-algebra does; the store checks what they answer against it.

/// Lua: `now`, the request's time in ms: `ARGV[1]` (a test's own time) or Redis `TIME`;
/// and `least`, the shortest time a state is kept for (see `lua_save`).
macro_rules! lua_now {
    () => {
        r#"
local now, least = tonumber(ARGV[1]), 10000
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
  least = 1
end
"#
    };
}

/// The longest expiry a state is given, in ms: the scripts' `1e15`, the longest period.
pub(super) const LONGEST_EXPIRY_MS: f64 = tollgate_algebra::MAX_AMOUNT;

/// Lua: saves the state (`v`, `ts`) under `key`, given `token_bucket`, `rate`, `period`,
/// `cap`, `now` and `least`: deleted if it is full again by `now`, else set to expire when it
/// will be (`tollgate_algebra::full_at`), counted from the script's own now and rounded up, so
/// never early; and never in less than `least` ms. That is 1 ms on Redis `TIME`. On a test's
/// own clock it is 10 s: Redis expires keys in real time, which does not move that clock, so
/// a state due back in 0.5 ms of the test's time would be gone a ms later while the test's
/// clock still counts its tokens as taken. Kept longer, a state full by then answers as full
/// (the algebra refills it); a state full by the script's now is deleted either way. And
/// never more than 1e15 ms (the longest period, about 31,700 years: [`LONGEST_EXPIRY_MS`]):
/// a state that far from full (a rate of a billionth of a token, a deep reservation) would
/// otherwise ask Redis for an expiry it cannot hold ("invalid expire time"), where every
/// other store keeps it. One copy for every script.
macro_rules! lua_save {
    () => {
        r#"
do
  local full = ts
  local missing = cap - v
  if missing > 0 then
    if token_bucket then
      full = ts + missing * period / rate
    else
      full = ts + math.ceil(missing / rate) * period
    end
  end
  if full <= now then
    redis.call('DEL', key)
  else
    -- The expiry as text made here: a number argument would be formatted by Redis with
    -- '%.17g', about 0.5 us slower a call (measured).
    redis.call('SET', key, struct.pack('<dd', v, ts), 'PX',
      string.format('%d', math.min(1e15, math.max(least, math.ceil(full - now)))))
  end
end
"#
    };
}

/// Lua: a state with lease records (issue 34), as `tollgate_algebra::lease::Leased` keeps it.
/// `lease_unpack(raw)` reads what [`Leased::pack`](tollgate_algebra::lease::Leased::pack)
/// made (`nil` for anything else): `v`, `ts` and the records `{ holder, tokens, expiry }`
/// in the order of their holders; a `v` of NaN is a state forgotten by a reset while leases
/// are out. `lease_fresh` starts a state that has none (never written, or forgotten): the
/// records expired by `now` dropped, as full as the others allow. `lease_advance` refills
/// `v`, `ts` to `now` under the cap `capacity - outstanding`, each record expired by `now`
/// counting until its expiry (the first first) and then dropped, as `Leased::advance` does. `lease_save` stores the state
/// with the records it keeps: until the last record expires and the state could be full
/// again after it (no sooner may a missing key read as a full bucket); deleted when it
/// keeps none and is full. One copy for the lease script and the plan script.
macro_rules! lua_lease {
    () => {
        r#"
local function lease_unpack(raw)
  if #raw < 16 or (#raw - 16) % 24 ~= 0 then return nil end
  local v, ts = struct.unpack('<dd', raw)
  local recs = {}
  for at = 17, #raw, 24 do
    local h, t, e = struct.unpack('<ddd', raw, at)
    recs[#recs + 1] = { h, t, e }
  end
  return v, ts, recs
end

local function lease_outstanding(recs)
  local sum = 0
  for i = 1, #recs do sum = sum + recs[i][2] end
  return sum
end

local function lease_fresh(recs, kind, period, cap, align, now)
  for i = #recs, 1, -1 do
    if recs[i][3] <= now then table.remove(recs, i) end
  end
  local ts = now
  if kind ~= 0 then ts = align + math.floor((now - align) / period) * period end
  return math.min(cap, cap - lease_outstanding(recs)), ts
end

local function lease_advance(recs, v, ts, kind, rate, period, cap, now)
  -- tollgate-algebra's lease::refill: to `to` under `c`.
  local function refill(to, c)
    if to <= ts then
      v = math.min(v, c)
    elseif kind == 0 then
      v = math.min(v + (to - ts) * rate / period, c)
      ts = to
    else
      local w = math.floor((to - ts) / period)
      if w >= 1 then
        v = math.min(v + rate * w, c)
        ts = ts + w * period
      end
    end
  end
  while true do
    local first
    for i = 1, #recs do
      if recs[i][3] <= now and (first == nil or recs[i][3] < recs[first][3]) then first = i end
    end
    if not first then break end
    local expiry = recs[first][3]
    if kind == 0 then
      refill(expiry, cap - lease_outstanding(recs))
      table.remove(recs, first)
    else
      table.remove(recs, first)
      refill(expiry, cap - lease_outstanding(recs))
    end
  end
  refill(now, cap - lease_outstanding(recs))
  return v, ts
end

local function lease_save(key, recs, v, ts, kind, rate, period, cap, now, least)
  local last = ts
  for i = 1, #recs do last = math.max(last, recs[i][3]) end
  local full = last
  if cap - v > 0 then
    if kind == 0 then
      full = last + (cap - v) * period / rate
    else
      full = last + (math.ceil((cap - v) / rate) + 1) * period
    end
  end
  if full <= now and #recs == 0 then
    redis.call('DEL', key)
  else
    local packed = { struct.pack('<dd', v, ts) }
    for i = 1, #recs do packed[#packed + 1] = struct.pack('<ddd', recs[i][1], recs[i][2], recs[i][3]) end
    redis.call('SET', key, table.concat(packed), 'PX',
      string.format('%d', math.min(1e15, math.max(least, math.ceil(full - now)))))
  end
end
"#
    };
}

/// Lua: [`SCRIPT`]'s body, given `now`, `least` and the lease functions, and `gate`: false
/// decides the plan as a check whatever `ARGV[2]` says (nothing written). Reads the plan's
/// states from the first `ARGV[3]` keys (others may follow, for the script around it);
/// leaves the answer in `reply`, and in `p` the index of the first argument after the
/// plan's.
macro_rules! lua_plan {
    () => {
        concat!(
            r#"
local writes = ARGV[2] == '1' and gate
local nslots = tonumber(ARGV[3])
local slot = {}
local p = 4
for i = 1, nslots do
  slot[i] = { kind = tonumber(ARGV[p]), rate = tonumber(ARGV[p + 1]), period = tonumber(ARGV[p + 2]),
              cap = tonumber(ARGV[p + 3]), maxr = tonumber(ARGV[p + 4]), align = tonumber(ARGV[p + 5]) }
  p = p + 6
end
local raw = {}
if nslots > 0 then raw = redis.call('MGET', unpack(KEYS, 1, nslots)) end
-- A leased state (with records) is refilled under its cap first, as the lease script
-- does, and taken from directly: never past what its leases leave.
local work, changed, recs = {}, {}, {}
for i = 1, nslots do
  if raw[i] then
    local v, ts, r = lease_unpack(raw[i])
    if not v then error('tollgate: ' .. KEYS[i] .. ' is not a state; not taken') end
    if #r > 0 or v ~= v then
      local s = slot[i]
      if v ~= v then v, ts = lease_fresh(r, s.kind, s.period, s.cap, s.align, now) end
      v, ts = lease_advance(r, v, ts, s.kind, s.rate, s.period, s.cap, now)
      recs[i] = r
    end
    work[i] = { v, ts }
  end
end

local function eval(i, st, count, reserve)
  local s = slot[i]
  local v, ts
  if st then
    v, ts = st[1], st[2]
  elseif s.kind == 0 then
    v, ts = s.cap, now
  else
    v, ts = s.cap, s.align + math.floor((now - s.align) / s.period) * s.period
  end
  local nv, nts
  if s.kind == 0 then
    nv = math.min(v + (now - ts) * s.rate / s.period, s.cap) - count
    nts = now
  else
    local w = math.floor((now - ts) / s.period)
    nv = math.min(v + s.rate * w, s.cap) - count
    nts = ts + w * s.period
  end
  local over = s.maxr ~= nil and -nv > s.maxr
  return (nv >= 0) or (reserve and not over), nv, nts
end

local function adjust(i, count)
  local _, nv, nts = eval(i, work[i], 0, false)
  local cap = slot[i].cap
  if recs[i] then cap = math.min(cap, cap - lease_outstanding(recs[i])) end
  return math.min(nv - count, cap), nts
end

local all_ok = true
local ntakes = tonumber(ARGV[p])
p = p + 1
for _ = 1, ntakes do
  local count, reserve, settle = tonumber(ARGV[p]), ARGV[p + 1] == '1', ARGV[p + 1] == '2'
  local shards, a, b = tonumber(ARGV[p + 2]), tonumber(ARGV[p + 3]), tonumber(ARGV[p + 4])
  p = p + 5
  local ok_a, va, ta = eval(a, work[a], count, reserve)
  local put
  local ok
  if settle then
    local i = a
    if b ~= 0 and shards > 1 then
      local _, na = eval(a, work[a], 0, false)
      local _, nb = eval(b, work[b], 0, false)
      if (count > 0 and nb > na) or (count <= 0 and nb < na) then i = b end
    end
    local nv, nts = adjust(i, count)
    ok, put = true, { { i, nv, nts } }
  elseif b == 0 or shards < 2 or work[a] == nil then
    ok, put = ok_a, { { a, va, ta } }
  else
    local ok_b, vb, tb = eval(b, work[b], count, reserve)
    if ok_a and ok_b and vb > va then
      ok, put = true, { { b, vb, tb } }
    elseif ok_a then
      ok, put = true, { { a, va, ta } }
    elseif ok_b then
      ok, put = true, { { b, vb, tb } }
    else
      local balance = va + vb + count
      local ca = va + count - balance / 2
      local cb = vb + count - balance / 2
      local oka, nva, nta = eval(a, work[a], ca, reserve)
      local okb, nvb, ntb = eval(b, work[b], cb, reserve)
      ok = oka and okb
      put = { { a, nva, nta }, { b, nvb, ntb } }
    end
  end
  if ok then
    for _, w in ipairs(put) do
      work[w[1]] = { w[2], w[3] }
      changed[w[1]] = true
    end
  end
  all_ok = all_ok and ok
end

if all_ok and writes then
  for i = 1, nslots do
    if changed[i] and recs[i] then
      local s = slot[i]
      lease_save(KEYS[i], recs[i], work[i][1], work[i][2], s.kind, s.rate, s.period, s.cap, now, least)
    elseif changed[i] then
      local key, v, ts = KEYS[i], work[i][1], work[i][2]
      local token_bucket, rate, period, cap = slot[i].kind == 0, slot[i].rate, slot[i].period, slot[i].cap
"#,
            lua_save!(),
            r#"
    end
  end
end

local reply = { struct.pack('<d', now), (all_ok and writes) and '1' or '0' }
for i = 1, nslots do
  reply[i + 2] = raw[i] or ''
end
"#
        )
    };
}

/// The algebra of SPEC §2 and §3 in Lua, kept equal to `tollgate-algebra`'s by the conformance
/// and differential tests. It loads every slot, decides all takes, and writes only if every
/// take is granted (and the request writes); it answers with the time it used and the states
/// it loaded, from which `tollgate-algebra` computes the answer itself.
///
/// KEYS: one per slot. ARGV: now ("" = Redis `TIME`), writes (0/1), slot count, then per
/// slot kind (0 token bucket, 1 fixed window), rate, period, capacity, maxReserved ("" =
/// unbounded), alignment; then take count, then per take count, reserve (0/1; 2 for an
/// adjust, SPEC §4: settled on the fuller of A and B when positive, the emptier otherwise,
/// under the capacity or a leased state's `capacity - outstanding`, never refused), shards,
/// slot of A (1-based), slot of B (0 = none). Numbers come in as the shortest text that
/// reads back exactly; a state is stored, and times and states are answered, as
/// little-endian doubles packed with `struct` (16 bytes a state): exact, where Lua's
/// `tostring` keeps 14 digits and an integer reply would truncate, and far cheaper than
/// formatting text in the script.
pub(super) const SCRIPT: &str =
    concat!(lua_now!(), lua_lease!(), "local gate = true\n", lua_plan!(), "return reply\n");

/// An acquire of a concurrency limit's slots and a plan, all or nothing (SPEC §6f;
/// `Store::slots_with`): the slots decided first, as [`SCRIPT_ACQUIRE`] decides; the
/// plan then run as [`SCRIPT`] runs it, as a check if the slots are full; the holder added
/// only if the plan wrote too.
///
/// KEYS: the plan's states, then the holders' two keys (as [`SCRIPT_ACQUIRE`]'s). ARGV: the
/// plan's (as [`SCRIPT`]'s), then the slots' count, ttl and max. Answers [`SCRIPT`]'s values,
/// then one more as [`SCRIPT_ACQUIRE`] answers (its time 0: it is the plan's): granted is 1
/// if the slots would be granted (whether taken or not), and a ticket is made only if they
/// were taken. Its time is `lua_now`'s, fractional on Redis `TIME` (an expiry a fraction,
/// which Redis keeps as text: a little slower to insert beside, never wrong).
pub(super) const SCRIPT_SLOTS_WITH: &str = concat!(
    lua_now!(),
    lua_lease!(),
    r#"
local z, h = KEYS[#KEYS - 1], KEYS[#KEYS]
local count, ttl, max = tonumber(ARGV[#ARGV - 2]), tonumber(ARGV[#ARGV - 1]), tonumber(ARGV[#ARGV])
local expired = redis.call('ZRANGEBYSCORE', z, '-inf', now)
local freed = 0
for i = 1, #expired, 1000 do
  local counts = redis.call('HMGET', h, unpack(expired, i, math.min(i + 999, #expired)))
  for j = 1, #counts do freed = freed + (tonumber(counts[j]) or 0) end
end
local in_flight = tonumber(redis.call('HGET', h, 'held') or '0') - freed
local holders = redis.call('ZCARD', z) - #expired
local gate = in_flight + count <= max
"#,
    lua_plan!(),
    r#"
local ticket = 0
if all_ok and writes then
  local t = redis.call('TIME')
  ticket = math.max(tonumber(redis.call('HGET', h, 'next') or '0') + 1,
    tonumber(t[1]) * 1000000 + tonumber(t[2]))
  if ticket >= 9007199254740992 then error('tollgate: ' .. h .. ' has made its last ticket') end
  local id, expiry = string.format('%d', ticket), now + ttl
  for i = 1, #expired, 1000 do
    redis.call('HDEL', h, unpack(expired, i, math.min(i + 999, #expired)))
  end
  if #expired > 0 then redis.call('ZREMRANGEBYSCORE', z, '-inf', now) end
  redis.call('ZADD', z, expiry, id)
  redis.call('HSET', h, id, count, 'next', id, 'held', in_flight + count)
  local latest = tonumber(redis.call('ZRANGE', z, -1, -1, 'WITHSCORES')[2])
  local px = string.format('%d', math.min(1e15, math.max(least, math.ceil(latest - now))))
  redis.call('PEXPIRE', z, px)
  redis.call('PEXPIRE', h, px)
end
-- The slots' answer, as SCRIPT_ACQUIRE's (its time is the plan's, the first value).
local first = ''
if not gate and holders > 0 then first = redis.call('ZRANGE', z, #expired, #expired, 'WITHSCORES')[2] end
reply[#reply + 1] = { gate and 1 or 0, 0, in_flight, first, ticket }
return reply
"#
);

/// Lua: one take from one unsharded limit, with no tables, loops or closures, which cost a
/// script far more than its arithmetic. The same algebra as [`SCRIPT`] (the differential
/// and conformance tests run both). Given `key` and `args` (see [`SCRIPT_ONE`]) and `time`
/// (Redis `TIME` once read, else nil), it leaves the answer in `answer`.
macro_rules! lua_one {
    () => {
        concat!(
            r#"
local writes, kind, reserve, rate, period, cap, maxr, align, count, now =
  struct.unpack('<BBBddddddd', args)
local least = 10000
if now ~= now then
  least = 1
  if not time then
    local t = redis.call('TIME')
    time = t[1] * 1000 + t[2] / 1000
  end
  now = time
end
local raw = redis.call('GET', key)
local v, ts
if raw then
  -- A state with lease records (or something else) is not this script's to change.
  if #raw ~= 16 then error('tollgate: ' .. key .. ' holds leases or is not a state; not taken') end
  v, ts = struct.unpack('<dd', raw)
elseif kind == 0 then
  v, ts = cap, now
else
  v, ts = cap, align + math.floor((now - align) / period) * period
end
local nv, nts
if kind == 0 then
  nv = math.min(v + (now - ts) * rate / period, cap) - count
  nts = now
else
  local w = math.floor((now - ts) / period)
  nv = math.min(v + rate * w, cap) - count
  nts = ts + w * period
end
local wrote = '0'
-- maxr is NaN when unbounded: the comparison is then false.
if writes == 1 and (nv >= 0 or (reserve == 1 and not (-nv > maxr))) then
  wrote = '1'
  local token_bucket, v, ts = kind == 0, nv, nts
"#,
            lua_save!(),
            r#"
end
local answer = struct.pack('<d', now) .. wrote .. (raw or '')
"#
        )
    };
}

/// The common request alone: one take from one unsharded limit.
///
/// KEYS: the state. ARGV: one string of 59 bytes, [`one_args`](super::one_args): writes, kind (0 token
/// bucket, 1 fixed window) and reserve as bytes, then rate, period, capacity, maxReserved
/// (NaN = unbounded), alignment, count and now (NaN = Redis `TIME`) as little-endian
/// doubles. One argument read by one `struct.unpack` costs the server about a quarter less
/// than ten arguments in text read by `tonumber` each (measured: 12 -> 9 us a call), and is
/// exact. Answers one string: the time it used (a packed double), `1` if it wrote (else
/// `0`), then the state it loaded (16 bytes, or nothing).
pub(super) const SCRIPT_ONE: &str =
    concat!("local key, args, time = KEYS[1], ARGV[1], nil\n", lua_one!(), "return answer\n");

/// Several one-takes sent together (see [`RedisStoreBuilder::group`](super::RedisStoreBuilder::group)): the same as
/// [`SCRIPT_ONE`] for each (KEYS\[i\], ARGV\[i\]) in turn, one Redis `TIME` for all, all
/// in one atomic run; answers the list of their answers. A state named twice is read again
/// after its first take, so the takes answer as if sent one after the other. A take that
/// fails (its key holds something else than a state) fails alone, before it writes: its
/// answer is [`SCRIPT_ERROR`] and the reason. Not used for one take alone: the loop and the
/// list cost about 2 us more a call than [`SCRIPT_ONE`].
pub(super) const SCRIPT_GROUP: &str = concat!(
    "local time\nlocal function one(key, args)\n",
    lua_one!(),
    r#"
return answer
end
local answers = {}
for i = 1, #KEYS do
  local ok, answer = pcall(one, KEYS[i], ARGV[i])
  if not ok then
    answer = 'script error: ' .. (type(answer) == 'table' and tostring(answer.err) or tostring(answer))
  end
  answers[i] = answer
end
return answers
"#
);

/// How an answer of [`SCRIPT_GROUP`] for a take that failed begins (its ninth byte, `r`,
/// is never that of a take's answer, `0` or `1`).
pub(super) const SCRIPT_ERROR: &[u8] = b"script error: ";

/// Gives a take back to one state (Redis Cluster, when the second shard of a take across two
/// nodes refused): if the state is still exactly what the take wrote, the state it replaced
/// is restored; if another request changed it since, the amount is added back at the
/// script's now, up to capacity. Either way the limit holds no more than had the take never
/// happened.
///
/// KEYS: the state. ARGV: now ("" = `TIME`), the state written (16 bytes), the state it
/// replaced (16 bytes, or "" for none), kind (0/1), rate, period, capacity, amount.
#[cfg(feature = "redis-cluster")]
pub(super) const GIVE_BACK: &str = concat!(
    lua_now!(),
    r#"
local kind, rate, period, cap = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local cur = redis.call('GET', KEYS[1])
local v, ts
if cur == ARGV[2] then
  if ARGV[3] == '' then
    redis.call('DEL', KEYS[1])
    return 1
  end
  v, ts = struct.unpack('<dd', ARGV[3])
elseif cur and #cur == 16 then
  v, ts = struct.unpack('<dd', cur)
  if kind == 0 then
    v = math.min(v + (now - ts) * rate / period, cap)
    ts = now
  else
    local w = math.floor((now - ts) / period)
    v = math.min(v + rate * w, cap)
    ts = ts + w * period
  end
  v = math.min(v + tonumber(ARGV[8]), cap)
else
  -- Gone (full again, or reset): nothing to give back.
  return 0
end
local key, token_bucket = KEYS[1], kind == 0
"#,
    lua_save!(),
    r#"
return 1
"#
);

/// Reads states and the time for a request decided here rather than in Lua (a calendar
/// window: Lua knows no time zones): the time it used (a packed double), the least expiry
/// (see `lua_save`), then each state as stored ('' for none).
///
/// KEYS: the states. ARGV: now ("" = Redis `TIME`).
pub(super) const CAS_READ: &str = concat!(
    lua_now!(),
    r#"
local reply = { struct.pack('<d', now), string.format('%d', least) }
for i = 1, #KEYS do reply[i + 2] = redis.call('GET', KEYS[i]) or '' end
return reply
"#
);

/// Writes states decided from what [`CAS_READ`] read, if they are all still what it read:
/// answers 1 when it wrote, 0 (writing nothing) when another request changed one since.
///
/// KEYS: the states to write. ARGV: per key, the state it must still hold ('' for none), the
/// state to write ('' to delete it) and its expiry in ms.
pub(super) const CAS_WRITE: &str = r#"
for i = 1, #KEYS do
  if (redis.call('GET', KEYS[i]) or '') ~= ARGV[3 * i - 2] then return 0 end
end
for i = 1, #KEYS do
  local new = ARGV[3 * i - 1]
  if new == '' then
    redis.call('DEL', KEYS[i])
  else
    redis.call('SET', KEYS[i], new, 'PX', ARGV[3 * i])
  end
end
return 1
"#;

/// Lua for [`SCRIPT_ACQUIRE`] and [`SCRIPT_RENEW`], before they write a holder's expiry,
/// given `fresh` (no live holder: the keys have no expiry yet): `latest`, the latest score,
/// read on a Redis before 7 only (see `lua_slots_outlive`).
macro_rules! lua_slots_latest {
    () => {
        r#"
local latest = not fresh and not redis.REDIS_VERSION_NUM
  and redis.call('ZRANGE', z, '-1', '-1', 'WITHSCORES')[2]
"#
    };
}

/// Lua for [`SCRIPT_ACQUIRE`] and [`SCRIPT_RENEW`], after they wrote `expiry` for a holder:
/// the keys made to outlive it and every other holder. Fresh keys are given its expiry; on
/// Redis 7 (which has `redis.REDIS_VERSION_NUM`) `PEXPIRE`'s `GT` moves theirs later, never
/// sooner; before 7, which has no `GT`, they are given it if it is the latest (read before
/// the write), so they may lose the extra time of a holder released since, never a live
/// holder's.
macro_rules! lua_slots_outlive {
    () => {
        r#"
local px = string.format('%d', math.min(1e15, math.max(least, math.ceil(expiry - now))))
if fresh or (latest and expiry >= tonumber(latest)) then
  redis.call('PEXPIRE', z, px)
  redis.call('PEXPIRE', h, px)
elseif redis.REDIS_VERSION_NUM then
  redis.call('PEXPIRE', z, px, 'GT')
  redis.call('PEXPIRE', h, px, 'GT')
end
"#
    };
}

/// Concurrency limits (SPEC §6f), on the holders of a (name, key): a script per frequent
/// operation ([`SCRIPT_ACQUIRE`], [`SCRIPT_RELEASE`], [`SCRIPT_RENEW`]), each making only the
/// Redis calls its operation needs, and [`SCRIPT_SLOTS`] for the rare ones (check, value,
/// reset). Each decides as `tollgate_algebra::slots::decide` decides; the store reads the
/// answer back from what they answer (see `slots.rs`).
///
/// KEYS, for all four: the tickets by expiry (a sorted set, scores in ms on the store's
/// clock) and the holders' counts (a hash: ticket -> count, and the fields `held`, the slots
/// its tickets hold, expired or not, and `next`, the last ticket made), both under one hash
/// tag. `ARGV[1]` is now ("" = Redis `TIME`, read only by an operation that needs it); the
/// others come in as the shortest text that reads back exactly; a number made of them goes
/// to Redis as text of its digits if whole, else as a Lua number (which Redis writes with 17
/// digits: exact).
///
/// A holder holds on `[acquired, expiry)`: those scored at most `now` are expired, and hold
/// nothing (they count in `held` until dropped). A grant drops them, when there are any; a
/// release, a renewal, a check and a value leave them. The keys expire no sooner than their
/// latest holder (a grant or a renewal moves their expiry later, or on a Redis before 7
/// gives them its own if it is the latest; never in less than `least` ms, see `lua_save`),
/// so idle keys vanish; a release leaves their expiry, and the release of the last holder
/// deletes the set and leaves the hash with `next` alone, for a second.
///
/// A ticket is the larger of the last one plus 1 and Redis `TIME` in microseconds (about
/// 1.8e15, below 2^53 until the year 2255): ever larger on one (name, key) while its keys
/// live, and larger than any made before they vanished (they outlive their last holder's
/// grant by at least a ms, so `TIME` has moved on by then, unless Redis's clock is stepped
/// back), so that a ticket released or renewed late never names a later holder.
///
/// On Redis `TIME`, these scripts' now is in whole milliseconds (rounded down), and their
/// answer carries it (0 on a test's own time, which the store knows), so that the store
/// makes the expiry `now + ttl` as the script did. Whole: an expiry of a whole ttl is then a
/// whole number, which Redis keeps in a small sorted set as an integer; a fraction is kept
/// as text, parsed again at every comparison of an insertion (a `ZADD` among 64 holders took
/// 4.0 us so, 1.1 us with whole numbers: measured). Whole numbers also go to Redis as text
/// made with `%d`: a Lua number is written by Redis with `%.17g`, 0.3 to 0.5 us slower a
/// number (measured).
///
/// Acquire. ARGV: now, the count, the ttl, the limit's max. Answers `{ granted (1 or 0),
/// now (0: ARGV's), the slots held (live, before it), the earliest live expiry as Redis
/// wrote it (a refusal's; "" on a grant), the ticket made (0: none) }`.
pub(super) const SCRIPT_ACQUIRE: &str = concat!(
    r#"
local z, h = KEYS[1], KEYS[2]
local t = redis.call('TIME')
local us = t[1] * 1000000 + t[2]
local now, at, least, time = tonumber(ARGV[1]), ARGV[1], 10000, 0
if not now then
  now = t[1] * 1000 + math.floor(t[2] / 1000)
  at, least, time = string.format('%d', now), 1, now
end
local count = tonumber(ARGV[2])
local seen = redis.call('HMGET', h, 'held', 'next')
local held = tonumber(seen[1]) or 0
-- Expired holders (by score the first), if any holder is: their counts taken from `held`.
-- (HMGET and HDEL take at most 1000 fields a call: `unpack` has a limit.) None held: the
-- set is gone.
local expired
if held > 0 and redis.call('ZRANGEBYSCORE', z, '-inf', at, 'LIMIT', '0', '1')[1] then
  expired = redis.call('ZRANGEBYSCORE', z, '-inf', at)
  for i = 1, #expired, 1000 do
    local counts = redis.call('HMGET', h, unpack(expired, i, math.min(i + 999, #expired)))
    for j = 1, #counts do held = held - (tonumber(counts[j]) or 0) end
  end
end
if held + count > tonumber(ARGV[4]) then
  -- Refused: the earliest live expiry, for the wait.
  local live = expired and string.format('%d', #expired) or '0'
  local first = redis.call('ZRANGE', z, live, live, 'WITHSCORES')
  return { 0, time, held, first[2] or '', 0 }
end
if expired then
  for i = 1, #expired, 1000 do
    redis.call('HDEL', h, unpack(expired, i, math.min(i + 999, #expired)))
  end
  redis.call('ZREMRANGEBYSCORE', z, '-inf', at)
end
local ticket = math.max((tonumber(seen[2]) or 0) + 1, us)
if ticket >= 9007199254740992 then error('tollgate: ' .. h .. ' has made its last ticket') end
local id, expiry = string.format('%d', ticket), now + tonumber(ARGV[3])
local fresh = held == 0
"#,
    lua_slots_latest!(),
    r#"
redis.call('ZADD', z, expiry % 1 == 0 and string.format('%d', expiry) or expiry, id)
redis.call('HSET', h, id, ARGV[2], 'held', string.format('%d', held + count), 'next', id)
"#,
    lua_slots_outlive!(),
    r#"
return { 1, time, held, '', ticket }
"#
);

/// Lua for [`SCRIPT_RELEASE`] and [`SCRIPT_RENEW`] (once they know their ticket is held) and
/// [`SCRIPT_SLOTS`]: `now` (`ARGV[1]`, or Redis `TIME` in whole ms) and `least` as in
/// `lua_now`, and `time`, the time read (0 when `ARGV[1]` gave it).
macro_rules! lua_slots_now {
    () => {
        r#"
local now, least, time = tonumber(ARGV[1]), 10000, 0
if not now then
  local t = redis.call('TIME')
  now = t[1] * 1000 + math.floor(t[2] / 1000)
  least, time = 1, now
end
"#
    };
}

/// Release. ARGV: now, the ticket. Answers 1 if the ticket was live and is released, else 0
/// (unknown, or expired: then left for a grant to drop). Reads the time only for a ticket it
/// finds.
pub(super) const SCRIPT_RELEASE: &str = concat!(
    r#"
local z, h, id = KEYS[1], KEYS[2], ARGV[2]
local score = redis.call('ZSCORE', z, id)
if not score then return 0 end
"#,
    lua_slots_now!(),
    r#"
if tonumber(score) <= now then return 0 end
local seen = redis.call('HMGET', h, id, 'held')
local held = (tonumber(seen[2]) or 0) - (tonumber(seen[1]) or 0)
redis.call('ZREM', z, id)
if held > 0 then
  redis.call('HDEL', h, id)
  redis.call('HSET', h, 'held', string.format('%d', held))
else
  -- The last holder: the set is gone with it; the hash keeps `next` for a second.
  redis.call('HDEL', h, id, 'held')
  redis.call('PEXPIRE', h, 1000)
end
return 1
"#
);

/// Renew. ARGV: now, the ticket, the ttl. Answers `{ 1, now (0: ARGV's) }` when the ticket
/// was live (its expiry now + ttl), else `{ 0 }`.
pub(super) const SCRIPT_RENEW: &str = concat!(
    r#"
local z, h, id = KEYS[1], KEYS[2], ARGV[2]
local score = redis.call('ZSCORE', z, id)
if not score then return { 0 } end
"#,
    lua_slots_now!(),
    r#"
if tonumber(score) <= now then return { 0 } end
local expiry, fresh = now + tonumber(ARGV[3]), false
"#,
    lua_slots_latest!(),
    r#"
redis.call('ZADD', z, expiry % 1 == 0 and string.format('%d', expiry) or expiry, id)
"#,
    lua_slots_outlive!(),
    r#"
return { 1, time }
"#
);

/// Check, value and reset. ARGV: now, the operation (`c` check, `v` value, `x` reset), the
/// count (check) and the limit's max. Answers one string: a byte (1: free, or reset; else
/// 0), then as little-endian doubles the time it used, the slots held and the holders (live),
/// the earliest live expiry (NaN: none).
pub(super) const SCRIPT_SLOTS: &str = concat!(
    lua_slots_now!(),
    r#"
local z, h, op = KEYS[1], KEYS[2], ARGV[2]
local ok = false
local in_flight, holders, earliest = 0, 0, 0 / 0
if op == 'x' then
  local last = redis.call('HGET', h, 'next')
  redis.call('DEL', z, h)
  if last then
    redis.call('HSET', h, 'next', last)
    redis.call('PEXPIRE', h, 1000)
  end
  ok = true
else
  local expired = redis.call('ZRANGEBYSCORE', z, '-inf', now)
  local freed = 0
  -- HMGET takes at most this many fields a call: `unpack` has a limit.
  for i = 1, #expired, 1000 do
    local counts = redis.call('HMGET', h, unpack(expired, i, math.min(i + 999, #expired)))
    for j = 1, #counts do freed = freed + (tonumber(counts[j]) or 0) end
  end
  in_flight = tonumber(redis.call('HGET', h, 'held') or '0') - freed
  holders = redis.call('ZCARD', z) - #expired
  if holders > 0 then
    -- By score, the expired come first.
    earliest = tonumber(redis.call('ZRANGE', z, #expired, #expired, 'WITHSCORES')[2])
  end
  if op == 'c' then
    ok = in_flight + tonumber(ARGV[3]) <= tonumber(ARGV[4])
  elseif op ~= 'v' then
    error('tollgate: no such operation on slots: ' .. op)
  end
end
return struct.pack('<Bdddd', ok and 1 or 0, now, in_flight, holders, earliest)
"#
);
