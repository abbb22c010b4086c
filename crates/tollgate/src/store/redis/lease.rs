//! Leases on Redis (issue 34, the store's side): one script runs a step on one shard whose
//! state carries its lease records, exactly as `tollgate_core::lease` computes it, and the
//! answer is the core's, computed from what the script loaded (the script only mirrors it, as
//! the take scripts do). Nothing in the limiter calls it yet: the holder comes next.
//!
//! A leased state is stored under the state's own key (so a cluster keeps it in one slot):
//! `value` and `ts`, then `holder`, `tokens` and `expiry` per record, little-endian doubles
//! ([`Leased::pack`]). The take scripts refuse a key longer than a plain state, before they
//! write, so a leased state is never refilled past its cap by a path that ignores its
//! records.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use redis::Value;
use tollgate_core::lease::{Grant, Holder, Leased};
use tollgate_core::{Clock, Config, Decision, OneTake, Slot, State, Status, Taken};

use super::{
    AnyConnection, Inner, RedisStore, Writes, disagree, garbage, num, slot_args, unpack_f64,
};
use crate::StoreError;

/// A step on a leased shard.
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) enum Step {
    /// A direct take of `count` (a check when not `writes`).
    Take { count: f64, reserve: bool, writes: bool },
    /// See [`Leased::grant`].
    Grant { holder: u64, want: f64, unused: f64, term: f64, share: f64 },
    /// See [`Leased::release`].
    Release { holder: u64, unused: f64 },
    /// See [`Leased::reset`].
    Reset,
}

/// What a step answered.
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) enum Answer {
    Taken(bool),
    Granted(Grant),
    Released,
}

/// Runs a [`Step`] on one shard: loads the state and its records, refills it under the cap
/// `capacity - outstanding` (each expired record dropped at its expiry), runs the step, and
/// saves the state with its records (kept at least until the last record's expiry and until
/// the state could be full again).
///
/// KEYS: the state. ARGV: now ("" = Redis `TIME`), the step (`take`, `grant`, `release`),
/// kind (0 token bucket, 1 fixed window), rate, period, capacity, maxReserved ("" =
/// unbounded), alignment, then for a take count, reserve (0/1), writes (0/1); for a grant
/// holder, want, unused, term, share; for a return holder, unused. Answers the time it used
/// (a packed double), what it loaded (or ""), and the step's answer: `1`/`0` for a take,
/// kept, tokens and expiry packed for a grant, "" for a return.
pub(super) const SCRIPT_LEASE: &str = concat!(
    lua_now!(),
    r#"
local key, step = KEYS[1], ARGV[2]
local kind, rate, period, cap = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local maxr, align = tonumber(ARGV[7]), tonumber(ARGV[8])
local raw = redis.call('GET', key)
local v, ts
-- The records, in the order of their holders: { holder, tokens, expiry }.
local recs = {}
if raw then
  if #raw < 16 or (#raw - 16) % 24 ~= 0 then error('tollgate: ' .. key .. ' is not a state') end
  v, ts = struct.unpack('<dd', raw)
  for at = 17, #raw, 24 do
    local h, t, e = struct.unpack('<ddd', raw, at)
    recs[#recs + 1] = { h, t, e }
  end
elseif kind == 0 then
  v, ts = cap, now
else
  v, ts = cap, align + math.floor((now - align) / period) * period
end

local function outstanding()
  local sum = 0
  for i = 1, #recs do sum = sum + recs[i][2] end
  return sum
end

-- The state refilled to `to` under `c` (tollgate-core's lease::refill).
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

-- Leased::advance: each record expired by now counts until its expiry, the first first.
while true do
  local first
  for i = 1, #recs do
    if recs[i][3] <= now and (first == nil or recs[i][3] < recs[first][3]) then first = i end
  end
  if not first then break end
  local expiry = recs[first][3]
  if kind == 0 then
    refill(expiry, cap - outstanding())
    table.remove(recs, first)
  else
    table.remove(recs, first)
    refill(expiry, cap - outstanding())
  end
end
refill(now, cap - outstanding())

local function find(holder)
  for i = 1, #recs do
    if recs[i][1] == holder then return i end
  end
end

local answer, save = '', true
if step == 'take' then
  local count, reserve, writes = tonumber(ARGV[9]), ARGV[10] == '1', ARGV[11] == '1'
  local nv = v - count
  local ok = nv >= 0 or (reserve and not (maxr ~= nil and -nv > maxr))
  if ok and writes then v = nv end
  answer, save = ok and '1' or '0', ok and writes
elseif step == 'grant' then
  local holder, want, unused = tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11])
  local term, share = tonumber(ARGV[12]), tonumber(ARGV[13])
  local kept = 0
  local i = find(holder)
  if i then
    kept = math.min(recs[i][2], math.max(unused, 0))
    table.remove(recs, i)
  end
  local room = share * cap - outstanding() - kept
  local tokens = math.max(math.min(math.min(want, v), room), 0)
  local expiry = now + term
  if kind ~= 0 then expiry = math.min(expiry, ts + period) end
  v = v - tokens
  if kept + tokens > 0 then
    local at = #recs + 1
    for j = 1, #recs do
      if recs[j][1] > holder then at = j break end
    end
    table.insert(recs, at, { holder, kept + tokens, expiry })
  end
  answer = struct.pack('<ddd', kept, tokens, expiry)
elseif step == 'reset' then
  v = cap - outstanding()
  if kind == 0 then ts = now else ts = align + math.floor((now - align) / period) * period end
elseif step == 'release' then
  local holder, unused = tonumber(ARGV[9]), tonumber(ARGV[10])
  local i = find(holder)
  if i then
    v = v + math.min(recs[i][2], math.max(unused, 0))
    table.remove(recs, i)
  end
else
  error('tollgate: unknown lease step ' .. tostring(step))
end

if save then
  -- Kept until the last record expires and the state could be full again after it: no
  -- sooner may a missing key read as a full bucket.
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
      string.format('%d', math.max(least, math.ceil(full - now))))
  end
end
return { struct.pack('<d', now), raw or '', answer }
"#
);

impl<C: Clock> RedisStore<C> {
    /// Runs `step` on the leased shard of `slot`; the answer is tollgate-core's on what the
    /// script loaded, at the time it used (an answer the script disagrees with is an error).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) async fn lease_step(
        &self,
        slot: &Slot<'_>,
        step: Step,
    ) -> Result<Answer, StoreError> {
        self.inner.lease_step(slot, step).await.map(|(answer, _, _)| answer)
    }
}

impl<C: Clock> Inner<C> {
    /// Sends `step` to the lease script: the time it used, what it loaded, what it said.
    async fn lease_call(
        &self,
        slot: &Slot<'_>,
        step: Step,
    ) -> Result<(f64, Leased, Vec<u8>), StoreError> {
        let mut invocation = self.lease.prepare_invoke();
        invocation.key(self.key(slot.name, slot.key, slot.shard)).arg(self.now_arg());
        let name = match step {
            Step::Take { .. } => "take",
            Step::Grant { .. } => "grant",
            Step::Release { .. } => "release",
            Step::Reset => "reset",
        };
        invocation.arg(name);
        slot_args(&mut invocation, slot);
        // Holder ids are below 2^53: exact as the doubles Lua keeps them in.
        #[allow(clippy::cast_precision_loss)]
        let id = |holder: u64| num(holder as f64);
        match step {
            Step::Take { count, reserve, writes } => {
                invocation.arg(num(count)).arg(u8::from(reserve)).arg(u8::from(writes));
            }
            Step::Grant { holder, want, unused, term, share } => {
                invocation.arg(id(holder)).arg(num(want)).arg(num(unused));
                invocation.arg(num(term)).arg(num(share));
            }
            Step::Release { holder, unused } => {
                invocation.arg(id(holder)).arg(num(unused));
            }
            Step::Reset => {}
        }
        let reply: Vec<Value> = self
            .on_connection(Writes::Yes, |mut conn: AnyConnection| async move {
                invocation.invoke_async(&mut conn).await
            })
            .await?;
        let [Value::BulkString(now), Value::BulkString(loaded), Value::BulkString(said)] =
            reply.as_slice()
        else {
            return Err(garbage("not the lease script's three strings"));
        };
        let now = unpack_f64(now).ok_or_else(|| garbage("the time"))?;
        let leased = match loaded.as_slice() {
            [] => Leased::default(),
            bytes => Leased::unpack(bytes).ok_or_else(|| garbage("a leased state"))?,
        };
        Ok((now, leased, said.clone()))
    }

    /// Runs `step` on the leased shard of `slot`: the answer (tollgate-core's on what the
    /// script loaded; one the script disagrees with is an error), the store's time, and the
    /// shard after it.
    pub(super) async fn lease_step(
        &self,
        slot: &Slot<'_>,
        step: Step,
    ) -> Result<(Answer, f64, Leased), StoreError> {
        let c = &slot.config;
        let (now, mut leased, said) = self.lease_call(slot, step).await?;
        let answer = match step {
            Step::Take { count, reserve, writes } => {
                let taken = leased.take(c, slot.alignment, now, count, reserve, writes);
                Answer::Taken(taken.ok)
            }
            Step::Grant { holder, want, unused, term, share } => {
                let grant = leased.grant(c, slot.alignment, now, holder, want, unused, term, share);
                Answer::Granted(grant)
            }
            Step::Release { holder, unused } => {
                leased.release(c, slot.alignment, now, holder, unused);
                Answer::Released
            }
            Step::Reset => {
                leased.reset(c, slot.alignment, now);
                Answer::Released
            }
        };
        let agrees = match answer {
            Answer::Taken(ok) => said.as_slice() == if ok { b"1" } else { b"0" },
            // Compared as numbers: Lua's math.max and Rust's may differ on the sign of a zero.
            Answer::Granted(g) => {
                let said: Vec<f64> = said.chunks(8).filter_map(unpack_f64).collect();
                said == [g.kept, g.tokens, g.expiry]
            }
            Answer::Released => said.is_empty(),
        };
        if !agrees {
            return Err(disagree());
        }
        Ok((answer, now, leased))
    }

    /// The states of `slots` as a read sees them: a leased one refilled under its cap (so
    /// `value` is what may be taken directly; the leased tokens are apart).
    pub(super) async fn leased_read(
        &self,
        slots: &[Slot<'_>],
    ) -> Result<(f64, Vec<Option<State>>), StoreError> {
        let mut now = f64::NAN;
        let mut states = Vec::with_capacity(slots.len());
        for slot in slots {
            let look = Step::Take { count: 0.0, reserve: false, writes: false };
            let (at, mut leased, _) = self.lease_call(slot, look).await?;
            now = at;
            states.push(
                leased.state.is_some().then(|| leased.advance(&slot.config, slot.alignment, at)),
            );
        }
        Ok((now, states))
    }

    /// A direct take from a leased shard: answered as any take (its `retryAfter` and status
    /// too) on the state refilled under its cap; also the value it leaves.
    async fn lease_take(&self, one: &OneTake<'_>) -> Result<(Taken, f64), StoreError> {
        let step = Step::Take { count: one.count, reserve: one.reserve, writes: one.writes };
        let (now, mut leased, said) = self.lease_call(&one.slot, step).await?;
        let state = leased.advance(&one.slot.config, one.slot.alignment, now);
        let (taken, new) = one.decide(now, Some(state));
        let wrote: &[u8] = if taken.decision.ok { b"1" } else { b"0" };
        if said != wrote {
            return Err(disagree());
        }
        Ok((taken, new.map_or(state.value, |s| s.value)))
    }
}

/// How a leased limit is served ([`RedisStoreBuilder::lease`](super::RedisStoreBuilder::lease)).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LeaseOptions {
    pub(super) term: Duration,
    pub(super) share: f64,
    pub(super) floor: f64,
}

impl Default for LeaseOptions {
    fn default() -> Self {
        LeaseOptions { term: Duration::from_secs(2), share: 0.5, floor: 0.25 }
    }
}

impl LeaseOptions {
    /// The defaults: leases of 2 s, at most half the capacity leased out in all, none while
    /// the limit has less than a quarter of its capacity left.
    pub fn new() -> Self {
        Self::default()
    }

    /// How long a lease lasts at the store (default 2 s): a holder killed with its lease
    /// keeps those tokens from everyone for this long at most.
    #[must_use]
    pub fn term(mut self, term: Duration) -> Self {
        self.term = term;
        self
    }

    /// The most of the capacity leased out at once, over every holder (default 0.5).
    #[must_use]
    pub fn share(mut self, share: f64) -> Self {
        self.share = share.clamp(0.0, 1.0);
        self
    }

    /// Below this fraction of the capacity left (default 0.25), holders stop leasing and
    /// return what they hold: every request is a direct take, exact as without leases,
    /// until the limit has room again.
    #[must_use]
    pub fn floor(mut self, floor: f64) -> Self {
        self.floor = floor.clamp(0.0, 1.0);
        self
    }
}

/// What a leased limit did in this process: grants, returns, answers from the lease, direct
/// takes, and tokens held now.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LeaseStats {
    /// Grants received (renewals included).
    pub grants: u64,
    /// Leases returned (near the limit, or by [`RedisStore::release_leases`]).
    pub returns: u64,
    /// Requests answered from a lease, with no store call.
    pub local: u64,
    /// Requests sent to the store as direct takes.
    pub direct: u64,
    /// Tokens held now.
    pub held: f64,
}

/// The leased limits of a store and their holders in this process.
pub(super) struct Leases {
    names: HashMap<String, LeaseOptions>,
    /// This process's holder id (below 2^53).
    id: u64,
    /// The holder's clock: milliseconds since this, unless the store runs on a test's clock.
    started: Instant,
    /// The entries by a hash of (name, key), copied on insert (a lookup takes no lock).
    entries: ArcSwap<Entries>,
    hasher: foldhash::fast::RandomState,
    inserting: parking_lot::Mutex<()>,
    /// How many entries there are (at most [`MOST_HELD`]).
    held_keys: AtomicUsize,
}

type Entries = HashMap<u64, Vec<Arc<Entry>>>;

/// One leased (name, key) in this process.
struct Entry {
    holder: Holder,
    name: Box<str>,
    key: Option<Box<str>>,
    config: Config,
    alignment: f64,
    options: LeaseOptions,
    /// Near the limit: no leases until it has room again.
    near: AtomicBool,
    /// Tokens taken directly since the last request for a lease (the bits of an `f64`);
    /// with what was spent from the lease ([`Holder::spent`]), the next lease's size.
    spent: AtomicU64,
    grants: AtomicU64,
    returns: AtomicU64,
    local: AtomicU64,
    direct: AtomicU64,
}

impl Entry {
    fn slot(&self) -> Slot<'_> {
        Slot {
            name: &self.name,
            key: self.key.as_deref(),
            shard: 0,
            config: self.config,
            alignment: self.alignment,
        }
    }

    fn spend(&self, count: f64) {
        let _ = self.spent.fetch_update(Ordering::AcqRel, Ordering::Acquire, |bits| {
            Some((f64::from_bits(bits) + count).to_bits())
        });
    }
}

impl Leases {
    pub(super) fn new(names: HashMap<String, LeaseOptions>) -> Option<Leases> {
        if names.is_empty() {
            return None;
        }
        // Random enough to tell processes apart; below 2^53 so that Lua keeps it exactly.
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ u64::from(std::process::id()).rotate_left(32);
        let id = tollgate_core::splitmix64(seed) >> 11;
        Some(Leases {
            names,
            id,
            started: Instant::now(),
            entries: ArcSwap::from_pointee(HashMap::new()),
            hasher: foldhash::fast::RandomState::default(),
            inserting: parking_lot::Mutex::new(()),
            held_keys: AtomicUsize::new(0),
        })
    }

    pub(super) fn is_leased(&self, name: &str) -> bool {
        self.names.contains_key(name)
    }

    /// The entry of `slot`'s (name, key), made if there is room (at most [`MOST_HELD`] in
    /// a store: a leased limit keyed by users would otherwise hold one per user for ever).
    fn entry(&self, slot: &Slot<'_>) -> Option<Arc<Entry>> {
        if let Some(entry) = self.lookup(&self.entries.load(), slot.name, slot.key) {
            return Some(entry);
        }
        // Full: no lock, no count, for each request of the keys left out.
        if self.held_keys.load(Ordering::Acquire) >= MOST_HELD {
            return None;
        }
        let _inserting = self.inserting.lock();
        let map = self.entries.load_full();
        if let Some(entry) = self.lookup(&map, slot.name, slot.key) {
            return Some(entry);
        }
        if self.held_keys.load(Ordering::Acquire) >= MOST_HELD {
            return None;
        }
        let entry = Arc::new(Entry {
            holder: Holder::new(MARGIN_MS),
            name: slot.name.into(),
            key: slot.key.map(Into::into),
            config: slot.config,
            alignment: slot.alignment,
            options: self.names[slot.name],
            near: AtomicBool::new(false),
            spent: AtomicU64::new(0f64.to_bits()),
            grants: AtomicU64::new(0),
            returns: AtomicU64::new(0),
            local: AtomicU64::new(0),
            direct: AtomicU64::new(0),
        });
        let mut next = (*map).clone();
        next.entry(self.hash(slot.name, slot.key)).or_default().push(Arc::clone(&entry));
        self.entries.store(Arc::new(next));
        self.held_keys.fetch_add(1, Ordering::AcqRel);
        Some(entry)
    }

    fn hash(&self, name: &str, key: Option<&str>) -> u64 {
        self.hasher.hash_one((name, key))
    }

    /// The entry of (name, key) in `map`: found by the hash and compared, with no
    /// allocation on the way.
    fn lookup(&self, map: &Entries, name: &str, key: Option<&str>) -> Option<Arc<Entry>> {
        let entries = map.get(&self.hash(name, key))?;
        entries.iter().find(|e| &*e.name == name && e.key.as_deref() == key).map(Arc::clone)
    }

    fn all(&self) -> Vec<Arc<Entry>> {
        self.entries.load().values().flatten().map(Arc::clone).collect()
    }

    fn now<C: Clock>(&self, inner: &Inner<C>) -> f64 {
        inner.clock.as_ref().map_or_else(|| self.started.elapsed().as_secs_f64() * 1e3, Clock::now)
    }
}

/// Returns what `entry` holds (the holder stops spending it at once).
async fn release<C: Clock>(inner: &Inner<C>, entry: &Entry, id: u64) {
    let Some(leases) = &inner.leases else { return };
    let unused = entry.holder.release(leases.now(inner));
    if inner.lease_step(&entry.slot(), Step::Release { holder: id, unused }).await.is_ok() {
        entry.returns.fetch_add(1, Ordering::Relaxed);
    }
}

/// The most (name, key) pairs a store leases for: past it, a leased limit's other keys are
/// direct takes (exact; only not from a lease).
const MOST_HELD: usize = 1_024;

/// Milliseconds a holder's deadline keeps before its lease's end, besides the drift.
const MARGIN_MS: f64 = 5.0;

impl<C: Clock> RedisStore<C> {
    /// A take from a leased limit: from this process's lease if it holds enough, else a
    /// direct take; either way the next lease is fetched in the background when this one
    /// runs low (one request on its way at a time).
    pub(super) async fn leased_one(
        &self,
        leases: &Leases,
        one: &OneTake<'_>,
    ) -> Result<Taken, StoreError> {
        let Some(entry) = leases.entry(&one.slot) else {
            return self.inner.lease_take(one).await.map(|(taken, _)| taken);
        };
        if one.writes
            && !one.reserve
            && entry.holder.try_take(one.count, || leases.now(&self.inner))
        {
            entry.local.fetch_add(1, Ordering::Relaxed);
            self.fetch_if_low(leases, &entry);
            let status = Status { remaining: entry.holder.held(), reset_after: 0.0 };
            return Ok(Taken { decision: Decision { ok: true, retry_after: None }, status });
        }
        entry.direct.fetch_add(1, Ordering::Relaxed);
        let (taken, value) = self.inner.lease_take(one).await?;
        if taken.decision.ok && one.writes {
            entry.spend(one.count);
        }
        let floor = entry.options.floor * entry.config.capacity();
        if value < floor {
            if !entry.near.swap(true, Ordering::AcqRel) {
                self.give_back(leases, &entry);
            }
        } else if value >= 2.0 * floor {
            entry.near.store(false, Ordering::Release);
            self.fetch_if_low(leases, &entry);
        }
        Ok(taken)
    }

    /// Asks for the next lease in the background if the one held is below half of what was
    /// spent since the last ask, or past half its term (a renewal, before it runs out), and
    /// the limit is not near its bound.
    fn fetch_if_low(&self, leases: &Leases, entry: &Arc<Entry>) {
        if entry.near.load(Ordering::Acquire) {
            return;
        }
        let now = leases.now(&self.inner);
        let spent = entry.holder.spent() + f64::from_bits(entry.spent.load(Ordering::Acquire));
        let held = entry.holder.held();
        let renew = entry.holder.deadline() - entry.options.term.as_secs_f64() * 1e3 / 2.0;
        if held > spent / 2.0 && held > 0.0 && now < renew {
            return;
        }
        let Some(asked) = entry.holder.ask(now) else { return };
        // Sized from demand: twice what was spent since the last ask, at least one token
        // (the store gives no more than the share allows, nor than it has).
        let direct = f64::from_bits(entry.spent.swap(0f64.to_bits(), Ordering::AcqRel));
        let want = (2.0 * (entry.holder.spent() + direct)).max(1.0);
        let (inner, entry, id) = (Arc::clone(&self.inner), Arc::clone(entry), leases.id);
        tokio::spawn(async move {
            let term = entry.options.term.as_secs_f64() * 1e3;
            let step = Step::Grant {
                holder: id,
                want,
                unused: asked.unused,
                term,
                share: entry.options.share,
            };
            match inner.lease_step(&entry.slot(), step).await {
                Ok((Answer::Granted(grant), store_now, after)) => {
                    entry.grants.fetch_add(1, Ordering::Relaxed);
                    entry.holder.granted(asked, grant, store_now);
                    let left = after.state.map_or(entry.config.capacity(), |s| s.value);
                    if left < entry.options.floor * entry.config.capacity()
                        && !entry.near.swap(true, Ordering::AcqRel)
                    {
                        release(&inner, &entry, id).await;
                    }
                }
                _ => entry.holder.failed(),
            }
        });
    }

    /// Returns what `entry` holds, in the background.
    fn give_back(&self, leases: &Leases, entry: &Arc<Entry>) {
        let (inner, entry, id) = (Arc::clone(&self.inner), Arc::clone(entry), leases.id);
        tokio::spawn(async move { release(&inner, &entry, id).await });
    }

    /// Returns every lease this store holds (for a graceful shutdown: the tokens go back to
    /// the limit at once instead of when the leases expire). Leases are fetched again on
    /// the next take.
    ///
    /// # Errors
    ///
    /// The first store error; the other leases are returned all the same.
    pub async fn release_leases(&self) -> Result<(), StoreError> {
        let Some(leases) = &self.inner.leases else { return Ok(()) };
        let mut first = Ok(());
        for entry in leases.all() {
            let unused = entry.holder.release(leases.now(&self.inner));
            let step = Step::Release { holder: leases.id, unused };
            match self.inner.lease_step(&entry.slot(), step).await {
                Ok(_) => {
                    entry.returns.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) if first.is_ok() => first = Err(e),
                Err(_) => {}
            }
        }
        first
    }

    /// What each leased (name, key) did in this process.
    pub fn lease_stats(&self) -> Vec<(String, Option<String>, LeaseStats)> {
        let Some(leases) = &self.inner.leases else { return Vec::new() };
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        leases
            .all()
            .iter()
            .map(|e| {
                let stats = LeaseStats {
                    grants: load(&e.grants),
                    returns: load(&e.returns),
                    local: load(&e.local),
                    direct: load(&e.direct),
                    held: e.holder.held(),
                };
                (e.name.to_string(), e.key.as_deref().map(str::to_string), stats)
            })
            .collect()
    }

    /// A reset of a leased (name, key): its state starts again at `capacity -
    /// outstanding`, its records kept (see [`Leased::reset`]).
    pub(super) async fn leased_reset(
        &self,
        leases: &Leases,
        name: &str,
        key: Option<&str>,
    ) -> Result<(), StoreError> {
        let Some(entry) = leases.lookup(&leases.entries.load(), name, key) else {
            return Err(StoreError::new(format!(
                "redis: a reset of the leased limit {name:?} needs its config, known here once \
                 it has been taken from: take from it first (its leases keep their tokens)"
            )));
        };
        // This process's own lease goes back first.
        let unused = entry.holder.release(leases.now(&self.inner));
        let id = leases.id;
        self.inner.lease_step(&entry.slot(), Step::Release { holder: id, unused }).await?;
        self.inner.lease_step(&entry.slot(), Step::Reset).await.map(drop)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use tollgate_core::{Config, ManualClock, OneTake, Take};

    use super::*;
    use crate::store::AsyncStore;
    use crate::store::testing::{T0, writing};

    fn url() -> Option<String> {
        crate::store::backend_url("TOLLGATE_REDIS_URL")
    }

    #[derive(Clone, Copy, Debug)]
    enum Op {
        Wait(f64),
        Step(Step),
    }

    fn op() -> impl Strategy<Value = Op> {
        let holder = 0..3u64;
        prop_oneof![
            2 => prop_oneof![0.0..300.0f64, 0.0..3_000.0f64].prop_map(Op::Wait),
            3 => (1.0..5.0f64, any::<bool>(), any::<bool>()).prop_map(|(count, reserve, writes)| {
                Op::Step(Step::Take { count: count.floor(), reserve, writes })
            }),
            3 => (holder.clone(), 0.0..30.0f64, 0.0..20.0f64, 50.0..3_000.0f64, prop_oneof![Just(0.5), Just(1.0)])
                .prop_map(|(holder, want, unused, term, share)| {
                    Op::Step(Step::Grant { holder, want: want.floor(), unused: unused.floor(), term, share })
                }),
            1 => (holder, 0.0..20.0f64).prop_map(|(holder, unused)| {
                Op::Step(Step::Release { holder, unused: unused.floor() })
            }),
            1 => Just(Op::Step(Step::Reset)),
        ]
    }

    fn config() -> impl Strategy<Value = Config> {
        (any::<bool>(), 1.0..40.0f64, 1.0..3.0f64, prop::option::of(0.0..10.0f64)).prop_map(
            |(bucket, rate, burst, reserved)| {
                let rate = rate.floor();
                let base = if bucket {
                    Config::token_bucket(rate, 1_000.0)
                } else {
                    Config::fixed_window(rate, 1_000.0)
                };
                let config = base.with_capacity((rate * burst).floor());
                match reserved {
                    Some(most) => config.with_max_reserved(most.floor()),
                    None => config,
                }
            },
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// Random steps on one leased shard, on Redis and on tollgate-core's model: every
        /// answer the same (the store checks the script against the model on each step), and
        /// what Redis keeps is the model's state and records.
        #[test]
        fn redis_runs_lease_steps_as_the_model(config in config(), ops in prop::collection::vec(op(), 1..40)) {
            // One Redis, and a cluster: a leased state is one key, so one slot.
            #[cfg(feature = "redis-cluster")]
            let urls = [url(), crate::store::backend_url("TOLLGATE_REDIS_CLUSTER_URL")];
            #[cfg(not(feature = "redis-cluster"))]
            let urls = [url()];
            for url in urls.into_iter().flatten() {
                run_case(&url, config, &ops);
            }
        }
    }

    fn run_case(url: &str, config: Config, ops: &[Op]) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            static CASE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            let clock = ManualClock::new(T0);
            let prefix = format!(
                "tollgate-lease:{}:{}:",
                std::process::id(),
                CASE.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            );
            let redis =
                RedisStore::builder().prefix(prefix).open_with_clock(url, clock.clone()).unwrap();
            let take = Take { name: "t", key: None, config, count: 1.0, reserve: false };
            let one = writing(&take);
            let slot = one.slot;
            let mut model = Leased::default();
            for op in ops {
                match *op {
                    Op::Wait(dt) => clock.advance(dt),
                    Op::Step(step) => {
                        let now = clock.now();
                        let answer = redis.lease_step(&slot, step).await.unwrap();
                        let expected = match step {
                            Step::Take { count, reserve, writes } => {
                                // The store saves only what it changed: the model keeps
                                // no more (a refill saved or not may round apart).
                                let before = model.clone();
                                let ok = model
                                    .take(&slot.config, slot.alignment, now, count, reserve, writes)
                                    .ok;
                                if !(ok && writes) {
                                    model = before;
                                }
                                Answer::Taken(ok)
                            }
                            Step::Grant { holder, want, unused, term, share } => {
                                Answer::Granted(model.grant(
                                    &slot.config,
                                    slot.alignment,
                                    now,
                                    holder,
                                    want,
                                    unused,
                                    term,
                                    share,
                                ))
                            }
                            Step::Release { holder, unused } => {
                                model.release(&slot.config, slot.alignment, now, holder, unused);
                                Answer::Released
                            }
                            Step::Reset => {
                                model.reset(&slot.config, slot.alignment, now);
                                Answer::Released
                            }
                        };
                        assert_eq!(answer, expected, "{step:?} at {now}");
                    }
                }
            }
            // What Redis keeps, advanced to now, is the model's.
            let key = redis.inner.key(slot.name, slot.key, slot.shard);
            let stored: Option<Vec<u8>> = redis
                .inner
                .on_connection(Writes::No, |mut conn| async move {
                    redis::cmd("GET").arg(&key).query_async(&mut conn).await
                })
                .await
                .unwrap();
            if let Some(stored) = stored {
                let mut kept = Leased::unpack(&stored).unwrap();
                let now = clock.now();
                assert_eq!(
                    kept.advance(&slot.config, slot.alignment, now),
                    model.clone().advance(&slot.config, slot.alignment, now)
                );
                let mut advanced = model.clone();
                advanced.advance(&slot.config, slot.alignment, now);
                assert_eq!(kept.leases, advanced.leases);
            } else {
                // Deleted: no records, and full again.
                let mut advanced = model.clone();
                let state = advanced.advance(&slot.config, slot.alignment, clock.now());
                assert!(advanced.leases.is_empty() && state.value >= slot.config.capacity());
            }
            redis.delete_async("t", None, 1).await.unwrap();
        });
    }

    /// The most one bucket of `config` admits in `[a, b]` (capacity, inflow, reservations),
    /// its windows starting at `alignment`.
    fn bound(config: &Config, alignment: f64, a: f64, b: f64) -> f64 {
        let window = |t: f64| ((t - alignment) / config.period()).floor();
        let inflow = match config.kind() {
            tollgate_core::Kind::TokenBucket => config.rate() * (b - a) / config.period(),
            tollgate_core::Kind::FixedWindow => config.rate() * (window(b) - window(a)),
        };
        config.capacity() + config.max_reserved().unwrap_or(0.0) + inflow
    }

    #[derive(Clone, Copy, Debug)]
    enum Act {
        /// Process `p` takes `count`.
        Take { p: usize, count: f64 },
        /// Time passes.
        Wait(f64),
        /// The runtime runs what is ready (background fetches and returns).
        Yield,
        /// Process `p` is killed: its store (and lease) dropped, a new one started.
        Kill { p: usize },
        /// Process `p` returns its leases (a graceful shutdown, then it goes on).
        Release { p: usize },
    }

    fn act() -> impl Strategy<Value = Act> {
        prop_oneof![
            10 => (0..4usize, 1.0..3.0f64).prop_map(|(p, count)| Act::Take { p, count: count.floor() }),
            2 => prop_oneof![0.0..50.0f64, 0.0..1_500.0f64].prop_map(Act::Wait),
            4 => Just(Act::Yield),
            1 => (0..4usize).prop_map(|p| Act::Kill { p }),
            1 => (0..4usize).prop_map(|p| Act::Release { p }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// Four processes, each its own store with the limit leased, on one Redis and the
        /// same (manual) clock, take, wait, get killed and return their leases: no interval
        /// admits more than one bucket would, and some requests are answered from leases.
        #[test]
        fn leased_processes_never_admit_more_than_the_limit(
            bucket in any::<bool>(),
            acts in prop::collection::vec(act(), 50..250),
        ) {
            let Some(url) = url() else { return Ok(()) };
            let config = if bucket {
                Config::token_bucket(20.0, 1_000.0).with_capacity(40.0)
            } else {
                Config::fixed_window(20.0, 1_000.0)
            };
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let (admitted, local) = runtime.block_on(processes(&url, config, &acts));
            let take = Take { name: "hot", key: None, config, count: 1.0, reserve: false };
            let alignment = writing(&take).slot.alignment;
            let mut worst = f64::NEG_INFINITY;
            for (i, &(a, _)) in admitted.iter().enumerate() {
                let mut sum = 0.0;
                for &(b, count) in &admitted[i..] {
                    sum += count;
                    worst = worst.max(sum - bound(&config, alignment, a, b));
                }
            }
            prop_assert!(worst <= 1e-6, "{worst} over the bound: {admitted:?}");
            let _ = local;
        }
    }

    async fn processes(url: &str, config: Config, acts: &[Act]) -> (Vec<(f64, f64)>, u64) {
        static CASE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let clock = ManualClock::new(T0);
        let prefix = format!(
            "tollgate-leased:{}:{}:",
            std::process::id(),
            CASE.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let options = LeaseOptions::new().term(Duration::from_millis(800));
        let open = || {
            RedisStore::builder()
                .prefix(prefix.clone())
                .lease("hot", options)
                .open_with_clock(url, clock.clone())
                .unwrap()
        };
        let mut stores: Vec<RedisStore<ManualClock>> = (0..4).map(|_| open()).collect();
        let take = |count| Take { name: "hot", key: None, config, count, reserve: false };
        let mut admitted = Vec::new();
        let mut local = 0;
        for act in acts {
            match *act {
                Act::Take { p, count } => {
                    let take = take(count);
                    let one = writing(&take);
                    if stores[p].execute_one_async(&one).await.unwrap().decision.ok {
                        admitted.push((clock.now(), count));
                    }
                }
                Act::Wait(dt) => clock.advance(dt),
                Act::Yield => tokio::time::sleep(Duration::from_millis(1)).await,
                Act::Kill { p } => {
                    local += stores[p].lease_stats().iter().map(|(_, _, s)| s.local).sum::<u64>();
                    stores[p] = open();
                }
                Act::Release { p } => stores[p].release_leases().await.unwrap(),
            }
        }
        for store in &stores {
            local += store.lease_stats().iter().map(|(_, _, s)| s.local).sum::<u64>();
        }
        stores[0].delete_async("hot", None, 1).await.ok();
        (admitted, local)
    }

    /// A store on a prefix of `test`'s own, on a manual clock, leasing the limit `name`
    /// with the default options.
    fn leasing(url: &str, test: &str, name: &str) -> RedisStore<ManualClock> {
        RedisStore::builder()
            .prefix(format!("tollgate-{test}:{}:", std::process::id()))
            .lease(name, LeaseOptions::new())
            .open_with_clock(url, ManualClock::new(T0))
            .unwrap()
    }

    /// Far from its bound, a hot limit is answered from the lease: few store calls; near it
    /// (below the floor) every request is a direct take again, and the lease is returned.
    #[tokio::test]
    async fn a_hot_limit_is_answered_from_the_lease_until_near_its_bound() {
        let Some(url) = url() else { return };
        let redis = leasing(&url, "hot", "hot");
        let config = Config::token_bucket(1_000.0, 1_000.0).with_capacity(1_000.0);
        let take = Take { name: "hot", key: None, config, count: 1.0, reserve: false };
        let one = writing(&take);
        let mut admitted = 0;
        for i in 0..600 {
            if redis.execute_one_async(&one).await.unwrap().decision.ok {
                admitted += 1;
            }
            if i % 10 == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        let stats = redis.lease_stats()[0].2;
        assert_eq!(admitted, 600, "far from the bound (1,000 with no time passing)");
        assert!(stats.local >= 500 && stats.direct <= 100, "{stats:?}");
        // The limit now holds 400 or so, counting what is leased: under a quarter soon.
        for _ in 0..300 {
            redis.execute_one_async(&one).await.unwrap();
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let before = redis.lease_stats()[0].2;
        for _ in 0..50 {
            redis.execute_one_async(&one).await.unwrap();
        }
        let after = redis.lease_stats()[0].2;
        assert!(before.returns >= 1 && after.held == 0.0, "{before:?} {after:?}");
        assert_eq!(after.local, before.local, "near the bound, direct takes only");
        let (_, states) = redis.read_async(&[one.slot]).await.unwrap();
        let taken = 600.0 + 300.0 + 50.0;
        assert!(states[0].unwrap().value <= 1_000.0 - taken + 1e-9, "{states:?}");
        redis.delete_async("hot", None, 1).await.unwrap();
    }

    /// A leased limit keyed by many keys holds leases for at most [`MOST_HELD`] of them; the
    /// others are direct takes, still exact.
    #[tokio::test]
    async fn leases_are_held_for_a_bounded_number_of_keys() {
        let Some(url) = url() else { return };
        let redis = leasing(&url, "many", "per-user");
        let config = Config::token_bucket(10.0, 1_000.0);
        let keys: Vec<String> = (0..MOST_HELD + 50).map(|i| format!("user-{i}")).collect();
        for key in &keys {
            let take =
                Take { name: "per-user", key: Some(key), config, count: 1.0, reserve: false };
            assert!(redis.execute_one_async(&writing(&take)).await.unwrap().decision.ok);
        }
        assert_eq!(redis.lease_stats().len(), MOST_HELD);
        tokio::time::sleep(Duration::from_millis(50)).await;
        redis.release_leases().await.unwrap();
        for key in &keys {
            redis.delete_async("per-user", Some(key), 1).await.ok();
        }
    }

    /// The take scripts refuse a state that carries leases, before writing: a path that did
    /// not know the records would refill past the cap they set.
    #[tokio::test]
    async fn take_scripts_refuse_a_leased_state_and_leave_it() {
        let Some(url) = url() else { return };
        let clock = ManualClock::new(T0);
        let prefix = format!("tollgate-leased-take:{}:", std::process::id());
        let redis =
            RedisStore::builder().prefix(prefix).open_with_clock(&url, clock.clone()).unwrap();
        let take = Take {
            name: "t",
            key: None,
            config: Config::token_bucket(10.0, 1_000.0),
            count: 1.0,
            reserve: false,
        };
        let one: OneTake<'_> = writing(&take);
        let grant = Step::Grant { holder: 7, want: 10.0, unused: 0.0, term: 60_000.0, share: 1.0 };
        let Answer::Granted(g) = redis.lease_step(&one.slot, grant).await.unwrap() else {
            panic!()
        };
        assert_eq!(g.tokens, 10.0);
        clock.advance(5_000.0);
        let error = redis.execute_one_async(&one).await.unwrap_err();
        assert!(error.message().contains("holds leases"), "{error}");
        let error = redis.execute_async(&one.to_plan()).await.unwrap_err();
        assert!(error.message().contains("holds leases"), "{error}");
        // Still leased, and the bucket still capped: nothing has flowed in past the lease.
        let direct = Step::Take { count: 1.0, reserve: false, writes: true };
        assert_eq!(redis.lease_step(&one.slot, direct).await.unwrap(), Answer::Taken(false));
        let back = Step::Release { holder: 7, unused: 10.0 };
        assert_eq!(redis.lease_step(&one.slot, back).await.unwrap(), Answer::Released);
        assert_eq!(redis.lease_step(&one.slot, direct).await.unwrap(), Answer::Taken(true));
        redis.delete_async("t", None, 1).await.unwrap();
    }
}
