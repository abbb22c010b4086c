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

use redis::Value;
use tollgate_core::lease::{Grant, Leased};
use tollgate_core::{Clock, Slot};

use super::{AnyConnection, RedisStore, Writes, disagree, garbage, kind_code, num, unpack_f64};
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
        let inner = &self.inner;
        let c = &slot.config;
        let mut invocation = inner.lease.prepare_invoke();
        invocation.key(inner.key(slot.name, slot.key, slot.shard)).arg(inner.now_arg());
        let name = match step {
            Step::Take { .. } => "take",
            Step::Grant { .. } => "grant",
            Step::Release { .. } => "release",
        };
        invocation
            .arg(name)
            .arg(kind_code(c.kind()))
            .arg(num(c.rate()))
            .arg(num(c.period()))
            .arg(num(c.capacity()))
            .arg(c.max_reserved().map(num).unwrap_or_default())
            .arg(num(slot.alignment));
        match step {
            Step::Take { count, reserve, writes } => {
                invocation.arg(num(count)).arg(u8::from(reserve)).arg(u8::from(writes));
            }
            Step::Grant { holder, want, unused, term, share } => {
                #[allow(clippy::cast_precision_loss)] // ids are below 2^53
                let holder = holder as f64;
                invocation.arg(num(holder)).arg(num(want)).arg(num(unused));
                invocation.arg(num(term)).arg(num(share));
            }
            Step::Release { holder, unused } => {
                #[allow(clippy::cast_precision_loss)]
                let holder = holder as f64;
                invocation.arg(num(holder)).arg(num(unused));
            }
        }
        let reply: Vec<Value> = inner
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
        let mut leased = match loaded.as_slice() {
            [] => Leased::default(),
            bytes => Leased::unpack(bytes).ok_or_else(|| garbage("a leased state"))?,
        };
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
        Ok(answer)
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
