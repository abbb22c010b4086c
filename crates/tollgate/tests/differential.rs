//! Random sequences of operations with explicit times: every store gives the same answers
//! as the memory store, decision for decision and number for number.
//!
//! States are compared through what the algebra makes of them (a check of 0 tokens, with
//! its status), not by their raw fields: a state that is full again may be dropped by one
//! store and kept by another, and the two mean the same.
//!
//! The memory store is also compared with itself served through plans only (the trait's
//! default `execute_one` and `execute_each`), which checks its own fast paths. The stores
//! that wait on I/O are driven through the async API (SQLite through both).

use std::sync::Arc;

use proptest::prelude::*;
use tokio::runtime::Runtime;
use tollgate::core::{Outcome, Plan, Slot, State};
use tollgate::{
    AsyncStore, Call, Config, MINUTE, ManualClock, MemoryStore, RateLimiter, Request, SECOND,
    Store, StoreError, Target,
};

mod common;

use common::{Api, AsyncApi, SyncApi};

const T0: f64 = 1_700_000_000_000.0;

fn limits() -> [Target<'static>; 5] {
    [
        Target::Inline("tb", Config::token_bucket(10.0, MINUTE).with_capacity(3.0)),
        Target::Inline("fw", Config::fixed_window(5.0, 10.0 * SECOND)),
        Target::Inline("tb4", Config::token_bucket(40.0, MINUTE).with_shards(4)),
        Target::Inline(
            "fw3",
            Config::fixed_window(30.0, MINUTE).with_shards(3).with_max_reserved(6.0),
        ),
        // Small shards, so that a take often needs two of them together (SPEC §3).
        Target::Inline("hot", Config::token_bucket(12.0, MINUTE).with_shards(3)),
    ]
}

const KEYS: [Option<&str>; 3] = [None, Some(""), Some("a")];

#[derive(Clone, Debug)]
enum Op {
    Limit {
        limit: usize,
        key: usize,
        count: f64,
        reserve: bool,
    },
    Check {
        limit: usize,
        key: usize,
        count: f64,
    },
    /// Up to six calls: (limit, key, count, reserve).
    Transaction(Vec<(usize, usize, f64, bool)>),
    Reset {
        limit: usize,
        key: usize,
    },
}

/// An operation; with `transactions` false, none over several limits (a Redis Cluster
/// refuses those when their states are in different hash slots, as these may be).
fn op(transactions: bool) -> impl Strategy<Value = Op> {
    let pick = (0..5usize, 0..3usize, (0..12u32).prop_map(|n| f64::from(n) / 2.0));
    prop_oneof![
        4 => (pick.clone(), any::<bool>()).prop_map(|((limit, key, count), reserve)| Op::Limit { limit, key, count, reserve }),
        2 => pick.clone().prop_map(|(limit, key, count)| Op::Check { limit, key, count }),
        if transactions { 2 } else { 0 } => prop::collection::vec((pick, any::<bool>()), 1..=6)
            .prop_map(|calls| Op::Transaction(calls.into_iter().map(|((l, k, c), r)| (l, k, c, r)).collect())),
        1 => (0..5usize, 0..3usize).prop_map(|(limit, key)| Op::Reset { limit, key }),
    ]
}

/// What an operation answered, as text: decisions, statuses, or the error message.
fn run(l: &impl Api, op: &Op) -> String {
    let limits = limits();
    let request = |key: usize, count: f64| {
        let r = Request::new().count(count);
        match KEYS[key] {
            Some(k) => r.key(k),
            None => r,
        }
    };
    let answer = match *op {
        Op::Limit { limit, key, count, reserve } => {
            let r = request(key, count);
            l.limit_with_status(limits[limit], if reserve { r.reserve() } else { r })
                .map(|t| format!("{t:?}"))
        }
        Op::Check { limit, key, count } => {
            l.check_with_status(limits[limit], request(key, count)).map(|t| format!("{t:?}"))
        }
        Op::Transaction(ref calls) => {
            let calls: Vec<Call<'_>> = calls
                .iter()
                .map(|&(limit, key, count, reserve)| {
                    let r = request(key, count);
                    Call::new(limits[limit], if reserve { r.reserve() } else { r })
                })
                .collect();
            // Both ways of asking: decisions only for an odd number of calls, with
            // statuses for an even one.
            if calls.len() % 2 == 1 {
                l.transaction(&calls).map(|t| format!("{t:?}"))
            } else {
                l.transaction_with_status(&calls).map(|t| format!("{t:?}"))
            }
        }
        Op::Reset { limit, key } => l.reset(limits[limit], KEYS[key]).map(|()| "reset".into()),
    };
    answer.unwrap_or_else(|e| format!("error: {e}"))
}

/// Every limit and key as the algebra sees it now: a check of 0 tokens for one shard's worth.
/// (Unsharded only: a sharded check picks random shards, which the seeded sequence would
/// have to match call for call; the sharded limits are compared through their decisions.)
fn states(l: &impl Api) -> Vec<String> {
    let limits = limits();
    let mut out = Vec::new();
    for limit in &limits[..2] {
        for key in KEYS {
            let r = match key {
                Some(k) => Request::new().count(0.0).key(k),
                None => Request::new().count(0.0),
            };
            out.push(format!("{:?}", l.check_with_status(*limit, r).unwrap()));
        }
    }
    out
}

/// The limiter over `store` through the sync API.
fn sync_api<S: Store + Send + Sync + 'static>(store: S) -> SyncApi<S> {
    SyncApi(Arc::new(RateLimiter::builder(store).seed(11).build()))
}

/// The limiter over the store `make` makes on a runtime of two threads, through the async
/// API.
#[cfg_attr(not(any(feature = "sqlite", feature = "redis", feature = "postgres")), allow(dead_code))]
fn async_api<S: AsyncStore + 'static>(make: impl FnOnce(&Runtime) -> S) -> AsyncApi<S> {
    let runtime = common::runtime();
    let store = make(&runtime);
    AsyncApi { limiter: Arc::new(RateLimiter::builder(store).seed(11).build()), runtime }
}

/// `ops` through the memory store and through the limiter `other` makes on the same clock:
/// the same answers and the same states after every step.
fn compare<A: Api>(
    other: impl FnOnce(ManualClock) -> A,
    ops: &[(f64, Op)],
) -> Result<(), TestCaseError> {
    let clock = ManualClock::new(T0);
    let reference = sync_api(MemoryStore::with_clock(clock.clone()));
    let candidate = other(clock.clone());
    let mut now = T0;
    for (step, (gap, op)) in ops.iter().enumerate() {
        now += gap;
        clock.set(now);
        prop_assert_eq!(run(&reference, op), run(&candidate, op), "step {}: {:?}", step, op);
        prop_assert_eq!(states(&reference), states(&candidate), "after step {}: {:?}", step, op);
    }
    Ok(())
}

fn traffic() -> impl Strategy<Value = Vec<(f64, Op)>> {
    prop::collection::vec(((0..4_000u32).prop_map(f64::from), op(true)), 1..60)
}

/// A memory store served through plans only: the trait's defaults for everything else.
struct ThroughPlans(MemoryStore<ManualClock>);

impl Store for ThroughPlans {
    fn execute(&self, plan: &Plan<'_>) -> Result<Outcome, StoreError> {
        self.0.execute(plan)
    }
    fn read(&self, slots: &[Slot<'_>]) -> Result<(f64, Vec<Option<State>>), StoreError> {
        self.0.read(slots)
    }
    fn delete(&self, name: &str, key: Option<&str>, shards: u16) -> Result<(), StoreError> {
        self.0.delete(name, key, shards)
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn memory_fast_paths_answer_as_plans(ops in traffic()) {
        compare(|clock| sync_api(ThroughPlans(MemoryStore::with_clock(clock))), &ops)?;
    }

    /// The same with two segments, so that a transaction's states often share one.
    #[test]
    fn memory_fast_paths_answer_as_plans_in_two_segments(ops in traffic()) {
        compare(|clock| sync_api(ThroughPlans(MemoryStore::builder().segments(2).build_with_clock(clock))), &ops)?;
    }
}

#[cfg(feature = "sqlite")]
proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn sqlite_answers_as_memory(ops in traffic()) {
        let open = |clock| tollgate::store::SqliteStore::builder().open_in_memory_with_clock(clock).unwrap();
        compare(|clock| sync_api(open(clock)), &ops)?;
    }

    #[test]
    fn sqlite_answers_as_memory_through_the_async_api(ops in traffic()) {
        let open = |clock| tollgate::store::SqliteStore::builder().open_in_memory_with_clock(clock).unwrap();
        compare(|clock| async_api(|_| open(clock)), &ops)?;
    }
}

#[cfg(feature = "redis")]
mod redis {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;

    fn url() -> Option<String> {
        common::backend_url("TOLLGATE_REDIS_URL", "redis://127.0.0.1:6379")
    }

    fn store(url: &str, clock: ManualClock) -> tollgate::store::RedisStore<ManualClock> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let prefix = format!(
            "tollgate-diff:{}:{}:",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        tollgate::store::RedisStore::builder().prefix(prefix).open_with_clock(url, clock).unwrap()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

        #[test]
        fn redis_answers_as_memory(ops in traffic()) {
            let Some(url) = url() else { return Ok(()) };
            compare(|clock| async_api(|_| store(&url, clock)), &ops)?;
        }
    }

    // On a cluster the sharded limits' shards are on different nodes, so their takes run in
    // steps of one shard each; the answers must not change.
    #[cfg(feature = "redis-cluster")]
    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

        #[test]
        fn redis_cluster_answers_as_memory(
            ops in prop::collection::vec(((0..4_000u32).prop_map(f64::from), op(false)), 1..60)
        ) {
            let Some(url) = common::backend_url(
                "TOLLGATE_REDIS_CLUSTER_URL",
                "redis+cluster://127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002",
            ) else {
                return Ok(());
            };
            compare(|clock| async_api(|_| store(&url, clock)), &ops)?;
        }
    }

    /// The case that once failed CI: at step 14, 3 of the fixed window "fw" for key "" are
    /// taken 0.52 ms before its window ends. Redis set the state to live 1 ms of real time,
    /// which had passed by the next read while the test's clock stood still.
    #[cfg(feature = "redis-cluster")]
    #[test]
    fn redis_cluster_keeps_a_state_due_in_half_a_ms() {
        let Some(url) = common::backend_url(
            "TOLLGATE_REDIS_CLUSTER_URL",
            "redis+cluster://127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002",
        ) else {
            return;
        };
        let limit = |limit, key, count, reserve| Op::Limit { limit, key, count, reserve };
        let ops = [
            (3618.0, limit(2, 0, 4.5, false)),
            (2407.0, limit(1, 2, 2.5, true)),
            (2479.0, limit(0, 0, 4.0, false)),
            (632.0, limit(3, 1, 0.0, false)),
            (482.0, limit(3, 2, 1.0, false)),
            (3151.0, Op::Check { limit: 0, key: 2, count: 1.0 }),
            (1891.0, Op::Reset { limit: 2, key: 0 }),
            (1577.0, Op::Check { limit: 3, key: 0, count: 5.0 }),
            (748.0, Op::Reset { limit: 4, key: 2 }),
            (1885.0, limit(4, 2, 4.5, true)),
            (1195.0, limit(0, 2, 0.0, true)),
            (3824.0, limit(2, 0, 0.5, false)),
            (2758.0, Op::Check { limit: 2, key: 2, count: 5.5 }),
            (3628.0, limit(0, 1, 1.5, false)),
            (404.0, limit(1, 1, 3.0, true)),
        ];
        compare(|clock| async_api(|_| store(&url, clock)), &ops).unwrap();
    }
}

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;
    use common::DropTable;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 32, failure_persistence: None, ..ProptestConfig::default() })]

        #[test]
        fn postgres_answers_as_memory(ops in traffic()) {
            let Some(url) = common::backend_url("TOLLGATE_POSTGRES_URL", "postgres://postgres@127.0.0.1/test") else {
                return Ok(());
            };
            let table = DropTable::new(&url, "tollgate_diff");
            let open = |runtime: &Runtime, clock| {
                let store = tollgate::store::PgStore::builder().table(&table.table).connections(1);
                runtime.block_on(store.open_with_clock(&url, clock)).unwrap()
            };
            compare(|clock| async_api(|runtime| open(runtime, clock)), &ops)?;
        }
    }
}
