//! Leases on Redis (issue 34, the store's side): one script runs a [`Step`] on one shard whose
//! state carries its lease records, exactly as `tollgate_algebra::lease` computes it; the
//! answer is the core's, computed from what the script loaded (`store::lease`, shared with
//! PostgreSQL, checks the script against it on every step).
//!
//! A leased state is stored under the state's own key (so a cluster keeps it in one slot):
//! `value` and `ts`, then `holder`, `tokens` and `expiry` per record, little-endian doubles
//! ([`Leased::pack`]). The take scripts refuse a key longer than a plain state, before they
//! write, so a leased state is never refilled past its cap by a path that ignores its
//! records.

use redis::Value;
use tollgate_algebra::lease::Leased;
use tollgate_algebra::{Clock, Slot};

use super::{AnyConnection, Inner, RedisStore, Writes, garbage, num, slot_args, unpack_f64};
use crate::error::StoreError;
#[cfg(test)]
use crate::store::lease::Answer;
use crate::store::lease::{self, LeaseStore, Leases, Step};

/// Runs a [`Step`] on one shard: loads the state and its records, refills it under the cap
/// `capacity - outstanding` (each expired record dropped at its expiry), runs the step, and
/// saves the state with its records (kept at least until the last record's expiry and until
/// the state could be full again).
///
/// KEYS: the state. ARGV: now ("" = Redis `TIME`), the step (`take`, `grant`, `release`),
/// kind (0 token bucket, 1 fixed window), rate, period, capacity, maxReserved ("" =
/// unbounded), alignment, then for a take count, reserve (0/1), writes (0/1); for a grant
/// holder, want, unused, term, share; for a return holder, unused; for `forget` (a reset,
/// whose slot arguments are ignored) nothing. Answers the time it used
/// (a packed double), what it loaded (or ""), and the step's answer: `1`/`0` for a take,
/// kept, tokens and expiry packed for a grant, "" for a return.
pub(super) const SCRIPT_LEASE: &str = concat!(
    lua_now!(),
    lua_lease!(),
    r#"
local key, step = KEYS[1], ARGV[2]
local kind, rate, period, cap = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local maxr, align = tonumber(ARGV[7]), tonumber(ARGV[8])
local raw = redis.call('GET', key)
local v, ts
-- The records, in the order of their holders: { holder, tokens, expiry }.
local recs = {}
if raw then
  v, ts, recs = lease_unpack(raw)
  if not v then error('tollgate: ' .. key .. ' is not a state') end
end
-- None yet, or forgotten (NaN): fresh, under the cap of the leases out.
if not raw or v ~= v then v, ts = lease_fresh(recs, kind, period, cap, align, now) end
v, ts = lease_advance(recs, v, ts, kind, rate, period, cap, now)

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
  local room = share * cap - lease_outstanding(recs) - kept
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
elseif step == 'forget' then
  -- Forgotten: kept (a value of NaN) while records are out, deleted when none are.
  v, ts = 0 / 0, now
elseif step == 'release' then
  local holder, unused = tonumber(ARGV[9]), tonumber(ARGV[10])
  local i = find(holder)
  if i then
    v = v + math.min(recs[i][2], math.max(unused, 0))
    table.remove(recs, i)
  else
    -- Nothing to return: nothing written (a state refilled and saved by a return would
    -- read apart from the one stored, as SPEC's value reads it).
    save = false
  end
else
  error('tollgate: unknown lease step ' .. tostring(step))
end

if save then
  lease_save(key, recs, v, ts, kind, rate, period, cap, now, least)
end
return { struct.pack('<d', now), raw or '', answer }
"#
);

impl<C: Clock> LeaseStore for Inner<C> {
    const NAME: &'static str = "redis";

    async fn lease_call(
        &self,
        slot: &Slot<'_>,
        step: Step,
    ) -> Result<(f64, Leased, Vec<f64>), StoreError> {
        let mut invocation = self.lease.prepare_invoke();
        invocation.key(self.key(slot.name, slot.key, slot.shard)).arg(self.now_arg());
        let name = match step {
            Step::Take { .. } => "take",
            Step::Grant { .. } => "grant",
            Step::Release { .. } => "release",
            Step::Forget => "forget",
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
            Step::Forget => {}
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
        // A take says "1" or "0"; a grant, three packed doubles; a return, nothing.
        let said = match said.as_slice() {
            b"1" => vec![1.0],
            b"0" => vec![0.0],
            packed => packed
                .chunks(8)
                .map(unpack_f64)
                .collect::<Option<Vec<f64>>>()
                .ok_or_else(|| garbage("a lease answer"))?,
        };
        Ok((now, leased, said))
    }

    /// `SET <prefix>lease-config:<len>:<name> said PX ttl GET` (Redis 6.2 and later).
    async fn announce(
        &self,
        name: &str,
        said: &str,
        ttl: std::time::Duration,
    ) -> Result<Option<String>, StoreError> {
        let key = format!("{}lease-config:{}:{name}", self.prefix, name.len());
        let millis = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
        let said = said.to_owned();
        self.on_connection(Writes::No, |mut conn| async move {
            redis::cmd("SET")
                .arg(&key)
                .arg(&said)
                .arg("PX")
                .arg(millis)
                .arg("GET")
                .query_async::<Option<String>>(&mut conn)
                .await
        })
        .await
    }

    fn leases(&self) -> Option<&Leases> {
        self.leases.as_ref()
    }

    fn clock_now(&self) -> Option<f64> {
        self.clock.as_ref().map(Clock::now)
    }
}

impl<C: Clock> RedisStore<C> {
    /// Runs `step` on the leased shard of `slot` (for the tests: the answer checked against
    /// tollgate-algebra's).
    #[cfg(test)]
    pub(crate) async fn lease_step(
        &self,
        slot: &Slot<'_>,
        step: Step,
    ) -> Result<Answer, StoreError> {
        lease::step(&*self.inner, slot, step).await.map(|(answer, _, _)| answer)
    }

    /// Returns every lease this store holds (for a graceful shutdown: the tokens go back to
    /// the limit at once instead of when the leases expire). Leases are fetched again on
    /// the next take.
    ///
    /// # Errors
    ///
    /// The first store error; the other leases are returned all the same.
    pub async fn release_leases(&self) -> Result<(), StoreError> {
        lease::release_all(&*self.inner).await
    }

    /// Per leased limit, its keys leased now in this process and its takes no lease served
    /// (cold keys: see [`LeaseOptions::hot_after`](crate::store::LeaseOptions::hot_after)).
    pub fn lease_names(&self) -> Vec<lease::LeasedName> {
        lease::names(self.inner.leases.as_ref())
    }

    /// What each leased (name, key) did in this process.
    pub fn lease_stats(&self) -> Vec<(String, Option<String>, lease::LeaseStats)> {
        lease::stats(self.inner.leases.as_ref())
    }

    /// The tokens of the leased limit (name, key) leased out now, over every process
    /// (`/v1/value` reports them beside the value, which is what a direct take may take).
    ///
    /// # Errors
    ///
    /// The store's.
    pub async fn leased_out(
        &self,
        name: &str,
        key: Option<&str>,
        config: &tollgate_algebra::Config,
    ) -> Result<f64, StoreError> {
        lease::leased_out(&*self.inner, &lease::look_slot(name, key, *config)).await
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use tollgate_algebra::{Config, ManualClock, OneTake, Take};

    use std::time::Duration;

    use super::*;
    use crate::store::lease::testing::{
        self, Leasing, Op, act, an_adjust_gives_back_no_more_than_the_leases_leave, config, op,
        processes, run_op, transaction_takes_a_leased_limit_directly, worst,
    };
    use crate::store::lease::{LeaseOptions, LeaseStats, MOST_HELD};
    use crate::store::seam::AsyncStore;
    use crate::store::testing::{T0, writing};

    fn url() -> Option<String> {
        crate::store::testing::backend_url("TOLLGATE_REDIS_URL")
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// Random steps on one leased shard, on Redis and on tollgate-algebra's model: every
        /// answer the same (the store checks the script against the model on each step), and
        /// what Redis keeps is the model's state and records.
        #[test]
        fn redis_runs_lease_steps_as_the_model(config in config(), ops in prop::collection::vec(op(), 1..40)) {
            // One Redis, and a cluster: a leased state is one key, so one slot.
            #[cfg(feature = "redis-cluster")]
            let urls = [url(), crate::store::testing::backend_url("TOLLGATE_REDIS_CLUSTER_URL")];
            #[cfg(not(feature = "redis-cluster"))]
            let urls = [url()];
            for url in urls.into_iter().flatten() {
                run_case(&url, config, &ops);
            }
        }
    }

    /// A key prefix of a property's case of its own: states of other cases and runs do not
    /// count.
    fn case_prefix(test: &str) -> String {
        static CASE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let case = CASE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        format!("tollgate-{test}:{}:{case}:", std::process::id())
    }

    fn run_case(url: &str, config: Config, ops: &[Op]) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let clock = ManualClock::new(T0);
            let prefix = case_prefix("lease");
            let redis =
                RedisStore::builder().prefix(prefix).open_with_clock(url, clock.clone()).unwrap();
            let take = Take { name: "t", key: None, config, count: 1.0, reserve: false };
            let one = writing(&take);
            let slot = one.slot;
            let mut model = Leased::default();
            for &op in ops {
                if let Op::Wait(dt) = op {
                    clock.advance(dt);
                }
                let now = clock.now();
                let (answer, expected) =
                    run_op(&redis, &*redis.inner, &mut model, &slot, now, op).await;
                assert_eq!(answer, expected, "{op:?} at {now}");
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
            let clock = ManualClock::new(T0);
            let prefix = case_prefix("leased");
            let options = LeaseOptions::new().term(Duration::from_millis(800)).hot_after(1);
            let open = async || {
                RedisStore::builder()
                    .prefix(prefix.clone())
                    .lease("hot", options)
                    .open_with_clock(&url, clock.clone())
                    .unwrap()
            };
            let (admitted, _) = runtime.block_on(processes(&clock, config, &acts, open));
            let worst = worst(&config, &admitted);
            prop_assert!(worst <= 1e-6, "{worst} over the bound: {admitted:?}");
        }
    }

    impl Leasing for RedisStore<ManualClock> {
        fn stats(&self) -> Vec<LeaseStats> {
            self.lease_stats().into_iter().map(|(_, _, s)| s).collect()
        }

        fn names(&self) -> Vec<lease::LeasedName> {
            self.lease_names()
        }

        async fn release(&self) {
            self.release_leases().await.unwrap();
        }
    }

    /// A store on a prefix of `test`'s own, on `clock`, leasing the limit `name` with the
    /// default options but one: every key is leased from its first take (`hot_after(1)`),
    /// since these tests are of the leases themselves.
    fn leasing(url: &str, test: &str, name: &str, clock: &ManualClock) -> RedisStore<ManualClock> {
        leasing_with(url, test, name, clock, LeaseOptions::new().hot_after(1))
    }

    fn leasing_with(
        url: &str,
        test: &str,
        name: &str,
        clock: &ManualClock,
        options: LeaseOptions,
    ) -> RedisStore<ManualClock> {
        RedisStore::builder()
            .prefix(case_prefix(test))
            .lease(name, options)
            .open_with_clock(url, clock.clone())
            .unwrap()
    }

    /// Only hot keys are leased; a cold key goes by the one-take script, and by a lease step
    /// when its state holds another's lease (see `only_hot_keys_are_leased`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn only_hot_keys_are_leased() {
        let Some(url) = url() else { return };
        let clock = ManualClock::new(T0);
        let redis = leasing_with(&url, "hot-keys", "hot", &clock, LeaseOptions::new());
        testing::only_hot_keys_are_leased(&redis, &*redis.inner, &clock).await;
    }

    /// Far from its bound, a hot limit is answered from the lease: few store calls; near it
    /// (below the floor) every request is a direct take again, and the lease is returned.
    #[tokio::test]
    async fn a_hot_limit_is_answered_from_the_lease_until_near_its_bound() {
        let Some(url) = url() else { return };
        let redis = leasing(&url, "hot", "hot", &ManualClock::new(T0));
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
        assert!(stats.local >= 400 && stats.direct <= 200, "mostly from the lease: {stats:?}");
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
        let redis = leasing(&url, "many", "per-user", &ManualClock::new(T0));
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

    /// Checks take no lease and no entry; idle keys' entries come back (see
    /// `checks_take_no_lease_and_idle_keys_make_room`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn checks_take_no_lease_and_idle_keys_make_room() {
        let Some(url) = url() else { return };
        let clock = ManualClock::new(T0);
        let redis = leasing(&url, "room", "hot", &clock);
        testing::checks_take_no_lease_and_idle_keys_make_room(&redis, &clock).await;
    }

    /// A transaction takes a leased limit directly (the plan script refills it under the
    /// cap its records set, as the lease script does), all or nothing with a plain limit.
    /// An adjust of a leased limit gives back no more than its leases leave room for (see
    /// `an_adjust_gives_back_no_more_than_the_leases_leave`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_adjust_keeps_the_lease_bound() {
        let Some(url) = url() else { return };
        let clock = ManualClock::new(T0);
        let redis = leasing(&url, "adjust", "hot", &clock);
        an_adjust_gives_back_no_more_than_the_leases_leave(&redis, &*redis.inner).await;
    }

    /// A release right after the take that asked for a lease (see
    /// `a_grant_on_its_way_at_a_release_goes_back`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_grant_on_its_way_at_a_release_goes_back() {
        let Some(url) = url() else { return };
        let redis = leasing(&url, "release-race", "hot", &ManualClock::new(T0));
        testing::a_grant_on_its_way_at_a_release_goes_back(&redis).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_transaction_takes_a_leased_limit_directly() {
        let Some(url) = url() else { return };
        let clock = ManualClock::new(T0);
        let redis = leasing(&url, "transaction", "hot", &clock);
        transaction_takes_a_leased_limit_directly(&redis, &*redis.inner, &clock).await;
    }

    /// A reset from a process that never took from the leased limit (see
    /// `a_reset_needs_no_lease_of_its_own`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reset_needs_no_lease_of_its_own() {
        let Some(url) = url() else { return };
        let clock = ManualClock::new(T0);
        let redis = leasing(&url, "reset", "hot", &clock);
        testing::a_reset_needs_no_lease_of_its_own(&redis, &*redis.inner, &clock).await;
    }

    /// The one-take scripts refuse a state that carries leases, before writing: a path that
    /// did not know the records would refill past the cap they set. The plan script takes
    /// from it under that cap.
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
        assert!(!redis.execute_async(&one.to_plan()).await.unwrap().ok, "all 10 leased");
        // Still leased, and the bucket still capped: nothing has flowed in past the lease.
        let direct = Step::Take { count: 1.0, reserve: false, writes: true };
        assert_eq!(redis.lease_step(&one.slot, direct).await.unwrap(), Answer::Taken(false));
        let back = Step::Release { holder: 7, unused: 10.0 };
        assert_eq!(redis.lease_step(&one.slot, back).await.unwrap(), Answer::Released);
        assert_eq!(redis.lease_step(&one.slot, direct).await.unwrap(), Answer::Taken(true));
        redis.delete_async("t", None, 1).await.unwrap();
    }
}
