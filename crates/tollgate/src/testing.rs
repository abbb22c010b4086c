//! The conformance suite every store must pass, exported so that a store written outside this
//! crate proves itself the way tollgate's own stores do (feature `testing`).
//!
//! Each behaviour takes a way to make a limiter on a fresh store and a [`ManualClock`] that
//! the store must read (SPEC's numbers are exact, at exact times), through the sync API
//! ([`sync_api`], for a [`Store`]) or the async one ([`async_api`], for an [`AsyncStore`]).
//! [`conformance_tests!`](crate::conformance_tests) writes one `#[test]` per behaviour;
//! [`run_sync`] and [`run_async`] run them all in one call, naming the one that fails.
//!
//! # Examples
//!
//! In a store crate's `tests/conformance.rs` (with `tollgate = { features = ["testing"] }`
//! among its dev-dependencies):
//!
//! ```
//! mod memory {
//!     tollgate::conformance_tests!(async_api, |_: &tokio::runtime::Runtime, clock| {
//!         tollgate::MemoryStore::with_clock(clock)
//!     });
//! }
//! ```
//!
//! The guide's chapter "Writing a store" walks through a complete store and runs this suite on
//! it.

use std::future::Future;
use std::sync::Arc;

use tokio::runtime::Runtime;
use tollgate_algebra::{
    Adjusted, Config, DAY, Decision, HOUR, MINUTE, ManualClock, Reading, SECOND, State, Taken,
};

use crate::concurrency::{Acquire, Acquired, AcquiredWith, SlotsTarget, SlotsValue};
use crate::error::Error;
use crate::limiter::{Call, RateLimiter, Request, Target, TransactionDecision, TransactionTaken};
use crate::store::{AsyncStore, Store};
use tollgate_algebra::slots::Concurrency;

/// The time every behaviour starts at: the clock handed to the store reads this, in
/// milliseconds since the Unix epoch.
pub const T0: f64 = 1_700_000_000_000.0;

/// The behaviours' names, in the order they run.
pub const BEHAVIOURS: [&str; 23] = [
    "token_bucket_spec_numbers",
    "token_bucket_spec_numbers_reserved",
    "fixed_window_spec_numbers",
    "capacity_burst",
    "max_reserved",
    "check_does_not_consume",
    "invalid_requests_consume_nothing",
    "far_from_full_is_kept",
    "throws_turns_refusal_into_error",
    "reset_forgets",
    "forget_needs_no_config_and_takes_every_shard",
    "keys_are_isolated",
    "value_reports_config_and_state",
    "transaction_all_or_nothing",
    "sharded_never_over_admits",
    "status_after_requests",
    "carrying_keeps_every_limit",
    "adjust_settles_after_the_work",
    "calendar_windows_in_a_time_zone",
    "concurrent_exactness",
    "slots_spec_numbers",
    "slots_racing_acquirers",
    "slots_with_rate_limits",
];

/// A limiter through the sync API on the store `make` makes (given a runtime, which a sync
/// store need not use, and the clock it must read), seeded as every run of the suite is.
pub fn sync_api<S: Store + Send + Sync + 'static>(
    make: &impl Fn(&Runtime, ManualClock) -> S,
) -> (SyncApi<S>, ManualClock) {
    let clock = ManualClock::new(T0);
    let store = make(&runtime(), clock.clone());
    (SyncApi(Arc::new(RateLimiter::builder(store).seed(7).build())), clock)
}

/// A limiter through the async API on the store `make` makes on a runtime of two threads
/// (open a store that needs a runtime with `runtime.block_on`).
pub fn async_api<S: AsyncStore + 'static>(
    make: &impl Fn(&Runtime, ManualClock) -> S,
) -> (AsyncApi<S>, ManualClock) {
    let clock = ManualClock::new(T0);
    let runtime = runtime();
    let store = make(&runtime, clock.clone());
    (AsyncApi { limiter: Arc::new(RateLimiter::builder(store).seed(7).build()), runtime }, clock)
}

/// Every behaviour through the sync API on stores `make` makes.
///
/// # Panics
///
/// When a behaviour fails: the message names it, then says what it found.
pub fn run_sync<S: Store + Send + Sync + 'static>(make: impl Fn(&Runtime, ManualClock) -> S) {
    run_all(&|| sync_api(&make));
}

/// Every behaviour through the async API on stores `make` makes.
///
/// # Panics
///
/// When a behaviour fails: the message names it, then says what it found.
pub fn run_async<S: AsyncStore + 'static>(make: impl Fn(&Runtime, ManualClock) -> S) {
    run_all(&|| async_api(&make));
}

/// A behaviour of the suite, on the API `A`.
type Behaviour<A> = fn(&dyn Fn() -> (A, ManualClock));

fn run_all<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
    let all: [Behaviour<A>; 23] = [
        behaviours::token_bucket_spec_numbers,
        behaviours::token_bucket_spec_numbers_reserved,
        behaviours::fixed_window_spec_numbers,
        behaviours::capacity_burst,
        behaviours::max_reserved,
        behaviours::check_does_not_consume,
        behaviours::invalid_requests_consume_nothing,
        behaviours::far_from_full_is_kept,
        behaviours::throws_turns_refusal_into_error,
        behaviours::reset_forgets,
        behaviours::forget_needs_no_config_and_takes_every_shard,
        behaviours::keys_are_isolated,
        behaviours::value_reports_config_and_state,
        behaviours::transaction_all_or_nothing,
        behaviours::sharded_never_over_admits,
        behaviours::status_after_requests,
        behaviours::carrying_keeps_every_limit,
        behaviours::adjust_settles_after_the_work,
        behaviours::calendar_windows_in_a_time_zone,
        behaviours::concurrent_exactness,
        behaviours::slots_spec_numbers,
        behaviours::slots_racing_acquirers,
        behaviours::slots_with_rate_limits,
    ];
    for (name, behaviour) in BEHAVIOURS.iter().zip(all) {
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| behaviour(setup)));
        if let Err(panic) = ran {
            let said = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)");
            panic!("conformance: {name} failed: {said}");
        }
    }
}

/// One `#[test]` per behaviour of the conformance suite ([`testing`](crate::testing)), in
/// the module where it is called: `conformance_tests!(async_api, MAKE)` for an
/// [`AsyncStore`](crate::AsyncStore), `conformance_tests!(sync_api, MAKE)` for a
/// [`Store`](crate::Store), `MAKE` a function or closure of
/// `(&tokio::runtime::Runtime, ManualClock)` that opens a fresh store reading that clock.
/// An optional third argument, a `bool` expression, runs the tests only when it is true
/// (a backend that is not there).
#[macro_export]
macro_rules! conformance_tests {
    ($api:ident, $make:expr) => {
        $crate::conformance_tests!($api, $make, true);
    };
    ($api:ident, $make:expr, $when:expr) => {
        $crate::conformance_tests!(@each $api, $make, $when;
            token_bucket_spec_numbers,
            token_bucket_spec_numbers_reserved,
            fixed_window_spec_numbers,
            capacity_burst,
            max_reserved,
            check_does_not_consume,
            invalid_requests_consume_nothing,
            far_from_full_is_kept,
            throws_turns_refusal_into_error,
            reset_forgets,
            forget_needs_no_config_and_takes_every_shard,
            keys_are_isolated,
            value_reports_config_and_state,
            transaction_all_or_nothing,
            sharded_never_over_admits,
            status_after_requests,
            carrying_keeps_every_limit,
            adjust_settles_after_the_work,
            calendar_windows_in_a_time_zone,
            concurrent_exactness,
            slots_spec_numbers,
            slots_racing_acquirers,
            slots_with_rate_limits);
    };
    (@each $api:ident, $make:expr, $when:expr; $($test:ident),*) => {
        $(
            #[test]
            fn $test() {
                if $when {
                    $crate::testing::behaviours::$test(&|| $crate::testing::$api(&$make))
                }
            }
        )*
        /// The macro's list is the suite's, whole and in order.
        #[test]
        fn every_behaviour_is_here() {
            assert_eq!([$(stringify!($test)),*], $crate::testing::BEHAVIOURS);
        }
    };
}

/// A multi-threaded runtime with two worker threads, as on this project's CI machines: the
/// async API's calls, and the tasks of the stores that have them, run on it.
/// A runtime of two threads, as the suite's async behaviours run on.
pub fn runtime() -> Arc<Runtime> {
    Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a runtime"),
    )
}

/// The limiter's operations, through its sync API ([`SyncApi`]) or its async one
/// ([`AsyncApi`]), so that one suite runs both.
pub trait Api: Send + Sync + 'static {
    /// [`RateLimiter::limit`].
    fn limit<'n, 'k>(
        &self,
        t: impl Into<Target<'n>>,
        r: impl Into<Request<'k>>,
    ) -> Result<Decision, Error>;
    /// [`RateLimiter::check`].
    fn check<'n, 'k>(
        &self,
        t: impl Into<Target<'n>>,
        r: impl Into<Request<'k>>,
    ) -> Result<Decision, Error>;
    /// [`RateLimiter::limit_with_status`].
    fn limit_with_status<'n, 'k>(
        &self,
        t: impl Into<Target<'n>>,
        r: impl Into<Request<'k>>,
    ) -> Result<Taken, Error>;
    /// [`RateLimiter::check_with_status`].
    fn check_with_status<'n, 'k>(
        &self,
        t: impl Into<Target<'n>>,
        r: impl Into<Request<'k>>,
    ) -> Result<Taken, Error>;
    /// [`RateLimiter::transaction`].
    fn transaction(&self, calls: &[Call<'_>]) -> Result<TransactionDecision, Error>;
    /// [`RateLimiter::transaction_with_status`].
    fn transaction_with_status(&self, calls: &[Call<'_>]) -> Result<TransactionTaken, Error>;
    /// [`RateLimiter::reset`].
    fn reset<'a>(&self, t: impl Into<Target<'a>>, key: Option<&str>) -> Result<(), Error>;
    /// [`RateLimiter::forget`].
    fn forget(&self, name: &str, key: Option<&str>) -> Result<(), Error>;
    /// [`RateLimiter::carry`].
    fn carry(
        &self,
        name: &str,
        key: Option<&str>,
        old: &Config,
        new: &Config,
    ) -> Result<usize, Error>;
    /// [`RateLimiter::value_sampled`].
    fn value_sampled<'a>(
        &self,
        t: impl Into<Target<'a>>,
        key: Option<&str>,
        sample_shards: u16,
    ) -> Result<Reading, Error>;
    /// [`RateLimiter::adjust`].
    fn adjust<'a>(
        &self,
        t: impl Into<Target<'a>>,
        key: Option<&'a str>,
        count: f64,
    ) -> Result<Adjusted, Error>;
    /// [`RateLimiter::value`].
    fn value<'a>(&self, t: impl Into<Target<'a>>, key: Option<&str>) -> Result<Reading, Error> {
        self.value_sampled(t, key, 1)
    }
    /// `callers` concurrent callers (threads for the sync API; tasks of a two-thread runtime
    /// for the async one), all started before any calls, each taking one token from `limit`
    /// `calls` times: how many were admitted.
    fn race(&self, limit: Target<'static>, callers: usize, calls: usize) -> usize;
    /// [`RateLimiter::acquire`].
    fn acquire<'n, 'k>(
        &self,
        t: impl Into<SlotsTarget<'n>>,
        r: impl Into<Acquire<'k>>,
    ) -> Result<Acquired, Error>;
    /// [`RateLimiter::acquire_with`].
    fn acquire_with<'n, 'k>(
        &self,
        t: impl Into<SlotsTarget<'n>>,
        r: impl Into<Acquire<'k>>,
        calls: &[Call<'_>],
    ) -> Result<AcquiredWith, Error>;
    /// [`RateLimiter::release`].
    fn release<'n>(
        &self,
        t: impl Into<SlotsTarget<'n>>,
        key: Option<&str>,
        ticket: u64,
    ) -> Result<bool, Error>;
    /// [`RateLimiter::renew`].
    fn renew<'n>(
        &self,
        t: impl Into<SlotsTarget<'n>>,
        key: Option<&str>,
        ticket: u64,
        ttl: Option<f64>,
    ) -> Result<Option<f64>, Error>;
    /// [`RateLimiter::check_slots`].
    fn check_slots<'n, 'k>(
        &self,
        t: impl Into<SlotsTarget<'n>>,
        r: impl Into<Acquire<'k>>,
    ) -> Result<Decision, Error>;
    /// [`RateLimiter::slots_value`].
    fn slots_value<'n>(
        &self,
        t: impl Into<SlotsTarget<'n>>,
        key: Option<&str>,
    ) -> Result<SlotsValue, Error>;
    /// [`RateLimiter::reset_slots`].
    fn reset_slots<'n>(
        &self,
        t: impl Into<SlotsTarget<'n>>,
        key: Option<&str>,
    ) -> Result<(), Error>;
    /// `callers` concurrent callers, all started before any calls, each acquiring one slot
    /// of `limit` (never released): how many were granted.
    fn race_slots(&self, limit: (&'static str, Concurrency), callers: usize) -> usize;
}

/// The sync API.
pub struct SyncApi<S>(pub Arc<RateLimiter<S>>);

impl<S: Store + Send + Sync + 'static> Api for SyncApi<S> {
    fn limit<'n, 'k>(
        &self,
        t: impl Into<Target<'n>>,
        r: impl Into<Request<'k>>,
    ) -> Result<Decision, Error> {
        self.0.limit(t, r)
    }
    fn check<'n, 'k>(
        &self,
        t: impl Into<Target<'n>>,
        r: impl Into<Request<'k>>,
    ) -> Result<Decision, Error> {
        self.0.check(t, r)
    }
    fn limit_with_status<'n, 'k>(
        &self,
        t: impl Into<Target<'n>>,
        r: impl Into<Request<'k>>,
    ) -> Result<Taken, Error> {
        self.0.limit_with_status(t, r)
    }
    fn check_with_status<'n, 'k>(
        &self,
        t: impl Into<Target<'n>>,
        r: impl Into<Request<'k>>,
    ) -> Result<Taken, Error> {
        self.0.check_with_status(t, r)
    }
    fn transaction(&self, calls: &[Call<'_>]) -> Result<TransactionDecision, Error> {
        self.0.transaction(calls)
    }
    fn transaction_with_status(&self, calls: &[Call<'_>]) -> Result<TransactionTaken, Error> {
        self.0.transaction_with_status(calls)
    }
    fn reset<'a>(&self, t: impl Into<Target<'a>>, key: Option<&str>) -> Result<(), Error> {
        self.0.reset(t, key)
    }
    fn forget(&self, name: &str, key: Option<&str>) -> Result<(), Error> {
        self.0.forget(name, key)
    }
    fn carry(
        &self,
        name: &str,
        key: Option<&str>,
        old: &Config,
        new: &Config,
    ) -> Result<usize, Error> {
        self.0.carry(name, key, old, new)
    }
    fn value_sampled<'a>(
        &self,
        t: impl Into<Target<'a>>,
        key: Option<&str>,
        sample_shards: u16,
    ) -> Result<Reading, Error> {
        self.0.value_sampled(t, key, sample_shards)
    }
    fn adjust<'a>(
        &self,
        t: impl Into<Target<'a>>,
        key: Option<&'a str>,
        count: f64,
    ) -> Result<Adjusted, Error> {
        self.0.adjust(t, key, count)
    }
    fn race(&self, limit: Target<'static>, callers: usize, calls: usize) -> usize {
        let start = Arc::new(std::sync::Barrier::new(callers));
        let threads: Vec<_> = (0..callers)
            .map(|_| {
                let (l, start) = (Arc::clone(&self.0), Arc::clone(&start));
                std::thread::spawn(move || {
                    start.wait();
                    (0..calls).filter(|_| l.limit(limit, Request::new()).unwrap().ok).count()
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).sum()
    }
    fn acquire<'n, 'k>(
        &self,
        t: impl Into<SlotsTarget<'n>>,
        r: impl Into<Acquire<'k>>,
    ) -> Result<Acquired, Error> {
        self.0.acquire(t, r)
    }
    fn acquire_with<'n, 'k>(
        &self,
        t: impl Into<SlotsTarget<'n>>,
        r: impl Into<Acquire<'k>>,
        calls: &[Call<'_>],
    ) -> Result<AcquiredWith, Error> {
        self.0.acquire_with(t, r, calls)
    }
    fn release<'n>(
        &self,
        t: impl Into<SlotsTarget<'n>>,
        key: Option<&str>,
        ticket: u64,
    ) -> Result<bool, Error> {
        self.0.release(t, key, ticket)
    }
    fn renew<'n>(
        &self,
        t: impl Into<SlotsTarget<'n>>,
        key: Option<&str>,
        ticket: u64,
        ttl: Option<f64>,
    ) -> Result<Option<f64>, Error> {
        self.0.renew(t, key, ticket, ttl)
    }
    fn check_slots<'n, 'k>(
        &self,
        t: impl Into<SlotsTarget<'n>>,
        r: impl Into<Acquire<'k>>,
    ) -> Result<Decision, Error> {
        self.0.check_slots(t, r)
    }
    fn slots_value<'n>(
        &self,
        t: impl Into<SlotsTarget<'n>>,
        key: Option<&str>,
    ) -> Result<SlotsValue, Error> {
        self.0.slots_value(t, key)
    }
    fn reset_slots<'n>(
        &self,
        t: impl Into<SlotsTarget<'n>>,
        key: Option<&str>,
    ) -> Result<(), Error> {
        self.0.reset_slots(t, key)
    }
    fn race_slots(&self, limit: (&'static str, Concurrency), callers: usize) -> usize {
        let start = Arc::new(std::sync::Barrier::new(callers));
        let threads: Vec<_> = (0..callers)
            .map(|_| {
                let (l, start) = (Arc::clone(&self.0), Arc::clone(&start));
                std::thread::spawn(move || {
                    start.wait();
                    usize::from(l.acquire(limit, Acquire::new()).unwrap().ok())
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).sum()
    }
}

/// The async API, each call awaited on a runtime of two threads (as a test's thread blocks
/// on it; the calls themselves never block a runtime thread).
pub struct AsyncApi<S> {
    /// The limiter.
    pub limiter: Arc<RateLimiter<S>>,
    /// The runtime its calls are awaited on.
    pub runtime: Arc<Runtime>,
}

impl<S> AsyncApi<S> {
    fn on<T>(&self, call: impl Future<Output = T>) -> T {
        self.runtime.block_on(call)
    }
}

impl<S: AsyncStore + 'static> Api for AsyncApi<S> {
    fn limit<'n, 'k>(
        &self,
        t: impl Into<Target<'n>>,
        r: impl Into<Request<'k>>,
    ) -> Result<Decision, Error> {
        self.on(self.limiter.limit_async(t.into(), r.into()))
    }
    fn check<'n, 'k>(
        &self,
        t: impl Into<Target<'n>>,
        r: impl Into<Request<'k>>,
    ) -> Result<Decision, Error> {
        self.on(self.limiter.check_async(t.into(), r.into()))
    }
    fn limit_with_status<'n, 'k>(
        &self,
        t: impl Into<Target<'n>>,
        r: impl Into<Request<'k>>,
    ) -> Result<Taken, Error> {
        self.on(self.limiter.limit_with_status_async(t.into(), r.into()))
    }
    fn check_with_status<'n, 'k>(
        &self,
        t: impl Into<Target<'n>>,
        r: impl Into<Request<'k>>,
    ) -> Result<Taken, Error> {
        self.on(self.limiter.check_with_status_async(t.into(), r.into()))
    }
    fn transaction(&self, calls: &[Call<'_>]) -> Result<TransactionDecision, Error> {
        self.on(self.limiter.transaction_async(calls))
    }
    fn transaction_with_status(&self, calls: &[Call<'_>]) -> Result<TransactionTaken, Error> {
        self.on(self.limiter.transaction_with_status_async(calls))
    }
    fn reset<'a>(&self, t: impl Into<Target<'a>>, key: Option<&str>) -> Result<(), Error> {
        self.on(self.limiter.reset_async(t.into(), key))
    }
    fn forget(&self, name: &str, key: Option<&str>) -> Result<(), Error> {
        self.on(self.limiter.forget_async(name, key))
    }
    fn carry(
        &self,
        name: &str,
        key: Option<&str>,
        old: &Config,
        new: &Config,
    ) -> Result<usize, Error> {
        self.on(self.limiter.carry_async(name, key, old, new))
    }
    fn value_sampled<'a>(
        &self,
        t: impl Into<Target<'a>>,
        key: Option<&str>,
        sample_shards: u16,
    ) -> Result<Reading, Error> {
        self.on(self.limiter.value_sampled_async(t.into(), key, sample_shards))
    }
    fn adjust<'a>(
        &self,
        t: impl Into<Target<'a>>,
        key: Option<&'a str>,
        count: f64,
    ) -> Result<Adjusted, Error> {
        self.on(self.limiter.adjust_async(t.into(), key, count))
    }
    fn race(&self, limit: Target<'static>, callers: usize, calls: usize) -> usize {
        self.on(async {
            let start = Arc::new(tokio::sync::Barrier::new(callers));
            let tasks: Vec<_> = (0..callers)
                .map(|_| {
                    let (l, start) = (Arc::clone(&self.limiter), Arc::clone(&start));
                    tokio::spawn(async move {
                        start.wait().await;
                        let mut admitted = 0;
                        for _ in 0..calls {
                            admitted +=
                                usize::from(l.limit_async(limit, Request::new()).await.unwrap().ok);
                        }
                        admitted
                    })
                })
                .collect();
            let mut admitted = 0;
            for task in tasks {
                admitted += task.await.unwrap();
            }
            admitted
        })
    }
    fn acquire<'n, 'k>(
        &self,
        t: impl Into<SlotsTarget<'n>>,
        r: impl Into<Acquire<'k>>,
    ) -> Result<Acquired, Error> {
        self.on(self.limiter.acquire_async(t.into(), r.into()))
    }
    fn acquire_with<'n, 'k>(
        &self,
        t: impl Into<SlotsTarget<'n>>,
        r: impl Into<Acquire<'k>>,
        calls: &[Call<'_>],
    ) -> Result<AcquiredWith, Error> {
        self.on(self.limiter.acquire_with_async(t.into(), r.into(), calls))
    }
    fn release<'n>(
        &self,
        t: impl Into<SlotsTarget<'n>>,
        key: Option<&str>,
        ticket: u64,
    ) -> Result<bool, Error> {
        self.on(self.limiter.release_async(t.into(), key, ticket))
    }
    fn renew<'n>(
        &self,
        t: impl Into<SlotsTarget<'n>>,
        key: Option<&str>,
        ticket: u64,
        ttl: Option<f64>,
    ) -> Result<Option<f64>, Error> {
        self.on(self.limiter.renew_async(t.into(), key, ticket, ttl))
    }
    fn check_slots<'n, 'k>(
        &self,
        t: impl Into<SlotsTarget<'n>>,
        r: impl Into<Acquire<'k>>,
    ) -> Result<Decision, Error> {
        self.on(self.limiter.check_slots_async(t.into(), r.into()))
    }
    fn slots_value<'n>(
        &self,
        t: impl Into<SlotsTarget<'n>>,
        key: Option<&str>,
    ) -> Result<SlotsValue, Error> {
        self.on(self.limiter.slots_value_async(t.into(), key))
    }
    fn reset_slots<'n>(
        &self,
        t: impl Into<SlotsTarget<'n>>,
        key: Option<&str>,
    ) -> Result<(), Error> {
        self.on(self.limiter.reset_slots_async(t.into(), key))
    }
    fn race_slots(&self, limit: (&'static str, Concurrency), callers: usize) -> usize {
        self.on(async {
            let start = Arc::new(tokio::sync::Barrier::new(callers));
            let tasks: Vec<_> = (0..callers)
                .map(|_| {
                    let (l, start) = (Arc::clone(&self.limiter), Arc::clone(&start));
                    tokio::spawn(async move {
                        start.wait().await;
                        usize::from(l.acquire_async(limit, Acquire::new()).await.unwrap().ok())
                    })
                })
                .collect();
            let mut granted = 0;
            for task in tasks {
                granted += task.await.unwrap();
            }
            granted
        })
    }
}

/// The behaviours, each a function of how to make a fresh limiter and its clock.
pub mod behaviours {
    use super::*;

    /// The token bucket most behaviours take from: 10 a minute.
    fn tb() -> Target<'static> {
        Target::Inline("tb", Config::token_bucket(10.0, MINUTE))
    }

    fn fw() -> Target<'static> {
        Target::Inline("fw", Config::fixed_window(10.0, MINUTE).with_start(T0))
    }

    fn state(l: &impl Api, t: Target<'_>, key: Option<&str>) -> State {
        let r = l.value(t, key).unwrap();
        State { value: r.value, ts: r.ts }
    }

    const fn refused(retry_after: f64) -> Decision {
        Decision { ok: false, retry_after: Some(retry_after) }
    }

    /// SPEC's token bucket numbers: takes, refill, a refusal's `retryAfter`, and a refusal stores nothing.
    pub fn token_bucket_spec_numbers<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
        let (l, clock) = setup();
        let k = Request::new().key("u");
        assert_eq!(l.limit(tb(), k.count(5.0)).unwrap(), Decision::ADMIT);
        clock.advance(6.0 * SECOND);
        assert_eq!(l.limit(tb(), k.count(6.0)).unwrap(), Decision::ADMIT);
        assert_eq!(state(&l, tb(), Some("u")), State { value: 0.0, ts: T0 + 6_000.0 });
        assert_eq!(l.limit(tb(), k.count(10.0)).unwrap(), refused(MINUTE));
        assert_eq!(state(&l, tb(), Some("u")).value, 0.0, "a refusal stores nothing");
    }

    /// The same takes with `reserve`: the third is granted with a wait, and the value goes negative.
    pub fn token_bucket_spec_numbers_reserved<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
        let (l, clock) = setup();
        let k = Request::new().key("u").reserve();
        l.limit(tb(), k.count(5.0)).unwrap();
        clock.advance(6.0 * SECOND);
        l.limit(tb(), k.count(6.0)).unwrap();
        assert_eq!(
            l.limit(tb(), k.count(10.0)).unwrap(),
            Decision { ok: true, retry_after: Some(MINUTE) }
        );
        assert_eq!(state(&l, tb(), Some("u")).value, -10.0);
    }

    /// SPEC's fixed window numbers: one window holds its capacity, the next starts full, reservations book ahead.
    pub fn fixed_window_spec_numbers<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
        let (l, clock) = setup();
        let k = Request::new().key("u");
        l.limit(fw(), k.count(5.0)).unwrap();
        clock.advance(6.0 * SECOND);
        assert_eq!(l.limit(fw(), k.count(6.0)).unwrap(), refused(54_000.0), "one window holds 10");
        clock.set(T0 + MINUTE);
        assert_eq!(l.limit(fw(), k.count(6.0)).unwrap(), Decision::ADMIT);
        assert_eq!(state(&l, fw(), Some("u")), State { value: 4.0, ts: T0 + MINUTE });
        assert_eq!(l.limit(fw(), k.count(10.0)).unwrap(), refused(MINUTE));
        assert_eq!(
            l.limit(fw(), k.count(10.0).reserve()).unwrap(),
            Decision { ok: true, retry_after: Some(MINUTE) }
        );
        assert_eq!(state(&l, fw(), Some("u")).value, -6.0);
    }

    /// A burst `capacity` below the rate: at most that many at once, then a refill's wait.
    pub fn capacity_burst<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
        let (l, clock) = setup();
        let burst = Target::Inline("burst", Config::token_bucket(10.0, MINUTE).with_capacity(3.0));
        clock.advance(10.0 * MINUTE);
        for _ in 0..3 {
            assert!(l.limit(burst, "u").unwrap().ok);
        }
        assert_eq!(l.limit(burst, "u").unwrap(), refused(6_000.0));
    }

    /// `maxReserved` bounds what reservations may book; a count beyond capacity plus it is an error.
    pub fn max_reserved<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
        let (l, _) = setup();
        let t = Target::Inline("mr", Config::token_bucket(10.0, MINUTE).with_max_reserved(5.0));
        let r = Request::new().reserve();
        assert_eq!(l.limit(t, r.count(10.0)).unwrap(), Decision::ADMIT);
        assert_eq!(
            l.limit(t, r.count(5.0)).unwrap(),
            Decision { ok: true, retry_after: Some(30_000.0) }
        );
        assert_eq!(l.limit(t, r.count(1.0)).unwrap(), refused(36_000.0));
        assert_eq!(state(&l, t, None).value, -5.0);
        let err = l.limit(t, r.count(16.0)).unwrap_err();
        assert_eq!(err.to_string(), "Rate limit mr count 16 exceeds 15.");
    }

    /// `check` decides as `limit` would and stores nothing.
    pub fn check_does_not_consume<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
        let (l, _) = setup();
        for _ in 0..5 {
            assert_eq!(l.check(tb(), Request::new().count(10.0)).unwrap(), Decision::ADMIT);
        }
        assert_eq!(
            l.check(tb(), Request::new().count(11.0)).unwrap_err().to_string(),
            "Rate limit tb count 11 exceeds 10."
        );
        l.limit(tb(), Request::new().count(4.0)).unwrap();
        assert_eq!(l.check(tb(), Request::new().count(7.0)).unwrap(), refused(6_000.0));
        assert_eq!(state(&l, tb(), None).value, 6.0);
    }

    /// A bad count, a key too long, a name not defined: an error, and nothing taken.
    pub fn invalid_requests_consume_nothing<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
        let (l, _) = setup();
        for bad in [-1.0, f64::NAN, f64::INFINITY, 11.0] {
            assert!(
                matches!(l.limit(tb(), Request::new().count(bad)), Err(Error::Invalid(_))),
                "{bad}"
            );
        }
        let long_key = "k".repeat(1025);
        assert!(matches!(l.limit(tb(), Request::new().key(&long_key)), Err(Error::Invalid(_))));
        // A NUL, which PostgreSQL's text cannot hold: refused alike on every store.
        for (name, key) in [("tb", "a\0b"), ("t\0b", "k")] {
            let nul = Target::Inline(name, Config::token_bucket(10.0, MINUTE));
            let err = l.limit(nul, Request::new().key(key)).unwrap_err();
            assert!(matches!(err, Error::Invalid(_)), "{err}");
            assert!(err.to_string().contains("NUL character"), "{err}");
        }
        assert_eq!(state(&l, tb(), None), State { value: 10.0, ts: 0.0 });
        let err = l.limit("nowhere", Request::new()).unwrap_err();
        assert!(matches!(err, Error::NotDefined { .. }));
        assert!(err.to_string().starts_with("Rate limit nowhere not defined."), "{err}");
    }

    /// A state that will be full again only in aeons (a billionth of a token per longest
    /// period; a reservation a quadrillion tokens deep) is kept like any other: Redis, which
    /// cannot hold such an expiry, once failed these requests as a store error.
    pub fn far_from_full_is_kept<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
        let (l, clock) = setup();
        let slow = Target::Inline("slow", Config::token_bucket(1e-9, 1e15).with_capacity(1.0));
        let deep = Target::Inline("deep", Config::token_bucket(1.0, 1e6).with_capacity(1.0));
        assert!(l.limit(slow, Request::new()).unwrap().ok);
        assert!(l.limit(deep, Request::new().count(1e15).reserve()).unwrap().ok);
        clock.advance(DAY);
        assert!(!l.limit(slow, Request::new()).unwrap().ok, "still empty a day later");
        let booked = l.limit(deep, Request::new().reserve()).unwrap();
        assert!(booked.ok && booked.retry_after.unwrap() > 1e20, "{booked:?}");
    }

    /// `throws` makes a refusal `Error::RateLimited` (a granted reservation is not one).
    pub fn throws_turns_refusal_into_error<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
        let (l, _) = setup();
        l.limit(tb(), Request::new().count(10.0)).unwrap();
        match l.limit(tb(), Request::new().throws()) {
            Err(Error::RateLimited { name, retry_after }) => {
                assert_eq!((name.as_str(), retry_after), ("tb", 6_000.0))
            }
            other => panic!("expected RateLimited, got {other:?}"),
        }
        // A granted reservation is not an error.
        assert_eq!(
            l.limit(tb(), Request::new().reserve().throws()).unwrap(),
            Decision { ok: true, retry_after: Some(6_000.0) }
        );
        assert!(matches!(l.check(tb(), Request::new().throws()), Err(Error::RateLimited { .. })));
    }

    /// `reset` forgets one key's states (every shard), and no other key's.
    pub fn reset_forgets<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
        let (l, _) = setup();
        let sharded = Target::Inline("sh", Config::token_bucket(40.0, MINUTE).with_shards(4));
        for _ in 0..20 {
            l.limit(sharded, "u").unwrap();
        }
        l.limit(tb(), Request::new().key("u").count(10.0)).unwrap();
        l.limit(tb(), Request::new().key("v").count(10.0)).unwrap();
        l.reset(tb(), Some("u")).unwrap();
        l.reset(sharded, Some("u")).unwrap();
        assert_eq!(l.limit(tb(), Request::new().key("u").count(10.0)).unwrap(), Decision::ADMIT);
        assert!(!l.limit(tb(), "v").unwrap().ok, "other keys keep their state");
        assert_eq!(l.value_sampled(sharded, Some("u"), 4).unwrap().value, 40.0);
    }

    /// `forget` needs no config and clears every shard a name ever had for the key.
    pub fn forget_needs_no_config_and_takes_every_shard<A: Api>(
        setup: &dyn Fn() -> (A, ManualClock),
    ) {
        let (l, _) = setup();
        // States made with 8 shards; the limit's config now has 2, whose reset clears only
        // shards 0 and 1. Forgetting by name alone clears them all.
        let eight = Target::Inline("f", Config::token_bucket(80.0, MINUTE).with_shards(8));
        let two = Target::Inline("f", Config::token_bucket(80.0, MINUTE).with_shards(2));
        let user = Request::new().key("{u}");
        for _ in 0..40 {
            assert!(l.limit(eight, user).unwrap().ok);
        }
        l.limit(tb(), user.count(10.0)).unwrap();
        l.reset(two, Some("{u}")).unwrap();
        assert!(l.value_sampled(eight, Some("{u}"), 8).unwrap().value < 80.0, "shards 2-7 kept");
        l.forget("f", Some("{u}")).unwrap();
        assert_eq!(l.value_sampled(eight, Some("{u}"), 8).unwrap().value, 80.0);
        assert_eq!(state(&l, tb(), Some("{u}")).value, 0.0, "other names keep their states");
        assert!(matches!(l.forget("", None), Err(Error::Invalid(_))));
    }

    /// Keys, the empty key, no key, and names are each their own state.
    pub fn keys_are_isolated<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
        let (l, _) = setup();
        l.limit(tb(), Request::new().key("a").count(10.0)).unwrap();
        assert!(l.limit(tb(), Request::new().key("b").count(10.0)).unwrap().ok);
        assert!(
            l.limit(tb(), Request::new().count(10.0)).unwrap().ok,
            "no key is the global value"
        );
        assert!(
            l.limit(tb(), Request::new().key("").count(10.0)).unwrap().ok,
            "the empty key is its own key"
        );
        let other_name = Target::Inline("tb2", Config::token_bucket(10.0, MINUTE));
        assert!(
            l.limit(other_name, Request::new().key("a").count(10.0)).unwrap().ok,
            "names are isolated"
        );
        assert!(!l.limit(tb(), "a").unwrap().ok);
    }

    /// `value` answers the stored state with its config, from which the algebra runs on the client.
    pub fn value_reports_config_and_state<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
        let (l, clock) = setup();
        let fresh = l.value(tb(), Some("new")).unwrap();
        assert_eq!((fresh.value, fresh.ts), (10.0, 0.0));
        assert_eq!(fresh.config.capacity(), 10.0);
        l.limit(tb(), Request::new().key("u").count(4.0)).unwrap();
        clock.advance(12.0 * SECOND);
        let r = l.value(tb(), Some("u")).unwrap();
        assert_eq!((r.value, r.ts, r.shard), (6.0, T0, 0));
        // The client can run the algebra itself from what value returned.
        let at_now = tollgate_algebra::evaluate(
            &r.config,
            Some(State { value: r.value, ts: r.ts }),
            0.0,
            T0 + 12_000.0,
            0.0,
            false,
        );
        assert_eq!(at_now.state.value, 8.0);
        let window = Target::Inline("win", Config::fixed_window(10.0, MINUTE));
        let start = l.value(window, Some("u")).unwrap().config.start().expect("start is filled in");
        assert!((0.0..MINUTE).contains(&start));
        l.limit(window, "u").unwrap();
        let stored = l.value(window, Some("u")).unwrap();
        assert_eq!(
            ((stored.ts - start) / MINUTE).fract(),
            0.0,
            "the stored window is aligned to start"
        );
    }

    /// A transaction admits all its limits or takes from none of them.
    pub fn transaction_all_or_nothing<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
        let (l, _) = setup();
        // One user's limits: on Redis Cluster the key's hash tag keeps them in one hash slot, as a
        // transaction needs there; elsewhere it is a key like any other.
        let user = Request::new().key("{u}");
        let small = Target::Inline("small", Config::token_bucket(3.0, MINUTE));
        l.limit(small, user.count(2.0)).unwrap();
        let t = l.transaction(&[tb().with(user.count(4.0)), small.with(user.count(2.0))]).unwrap();
        assert!(!t.ok);
        assert_eq!(t.results[..], [Decision::ADMIT, refused(20_000.0)]);
        assert_eq!(t.retry_after, Some(20_000.0));
        assert_eq!(state(&l, tb(), Some("{u}")).value, 10.0, "the admitted part was not taken");
        let t = l.transaction(&[tb().with(user.count(4.0)), small.with(user)]).unwrap();
        assert!(t.ok);
        assert_eq!(state(&l, tb(), Some("{u}")).value, 6.0);
        assert_eq!(state(&l, small, Some("{u}")).value, 0.0);
        // Invalid anywhere: an error, nothing taken.
        assert!(l.transaction(&[tb().with(user), small.with(user.count(4.0))]).is_err());
        assert_eq!(state(&l, tb(), Some("{u}")).value, 6.0);
        // throws names the refused limit.
        let err = l.transaction(&[tb().with(user), Call::new(small, user.throws())]).unwrap_err();
        assert!(
            matches!(err, Error::RateLimited { ref name, retry_after } if name == "small" && retry_after == 20_000.0),
            "{err:?}"
        );
    }

    /// `adjust` (SPEC §4): a cost settled after the work, signed, never refused, never above
    /// capacity; a debt delays the next requests by exactly what it owes.
    pub fn adjust_settles_after_the_work<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
        let (l, clock) = setup();
        let (k, u) = (Some("u"), Request::new().key("u"));
        let settled = |value, retry_after| Adjusted { value, retry_after };
        // 4 taken as the estimate; the work used 7: 3 more.
        assert!(l.limit(tb(), u.count(4.0)).unwrap().ok);
        assert_eq!(l.adjust(tb(), k, 3.0).unwrap(), settled(3.0, None));
        // 5 more than it holds: never refused, a debt of 2 (a token each 6 s).
        assert_eq!(l.adjust(tb(), k, 5.0).unwrap(), settled(-2.0, Some(12_000.0)));
        assert_eq!(state(&l, tb(), k), State { value: -2.0, ts: T0 });
        assert_eq!(l.limit(tb(), u).unwrap(), refused(18_000.0), "the debt delays the next");
        clock.advance(6.0 * SECOND);
        // Given back: never above capacity.
        assert_eq!(l.adjust(tb(), k, -20.0).unwrap(), settled(10.0, None));
        assert_eq!(l.value(tb(), k).unwrap().value, 10.0);
        assert!(l.limit(tb(), u.count(10.0)).unwrap().ok);
        assert_eq!(l.adjust(tb(), k, -2.5).unwrap(), settled(2.5, None));
        // A fixed window's debt waits for whole windows: 15 short at T0 + 6 s, windows of 10
        // from T0, back at 0 at T0 + 2 min.
        assert_eq!(l.adjust(fw(), k, 25.0).unwrap(), settled(-15.0, Some(114_000.0)));
        assert_eq!(l.limit(fw(), u).unwrap(), refused(114_000.0));
        clock.advance(MINUTE);
        assert_eq!(l.adjust(fw(), k, 0.0).unwrap(), settled(-5.0, Some(54_000.0)));
        // Bad input is an error, and changes nothing.
        assert!(matches!(l.adjust(tb(), k, f64::NAN), Err(Error::Invalid(_))));
        assert!(matches!(l.adjust(tb(), k, f64::INFINITY), Err(Error::Invalid(_))));
        assert!(matches!(l.adjust("nowhere", k, 1.0), Err(Error::NotDefined { .. })));
        let before = state(&l, tb(), k);
        assert!(l.adjust(tb(), Some(&"k".repeat(1025)), 1.0).is_err());
        assert_eq!(state(&l, tb(), k), before);
        // Sharded: a count goes to one of two sampled shards, none raised past its share.
        let sharded =
            Target::Inline("shardedCost", Config::token_bucket(40.0, MINUTE).with_shards(4));
        let total = |l: &A| l.value_sampled(sharded, k, 4).unwrap().value;
        assert_eq!(l.adjust(sharded, k, 8.0).unwrap().value, 8.0, "2 left of 10, times 4");
        assert_eq!(total(&l), 32.0);
        // Given back: to the emptier of two sampled shards (the short one, once sampled);
        // what a full shard cannot hold is dropped, never moved.
        let mut totals = Vec::new();
        while totals.last() != Some(&40.0) && totals.len() < 64 {
            assert!(l.adjust(sharded, k, -100.0).unwrap().value <= 40.0);
            totals.push(total(&l));
        }
        assert!(totals.iter().all(|&t| t == 32.0 || t == 40.0), "{totals:?}");
        assert_eq!(totals.last(), Some(&40.0), "{totals:?}");
    }

    /// Calendar windows (SPEC §1, §2): each window one day of Europe/Berlin, refilled at local
    /// midnight; a refusal waits exactly until then, a reservation for as many days as it
    /// books. [`T0`] is 23:13:20 in Berlin (UTC+1), 46 min 40 s before midnight.
    pub fn calendar_windows_in_a_time_zone<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
        let (l, clock) = setup();
        let day =
            tollgate_algebra::Calendar::new(tollgate_algebra::CalendarUnit::Day, "Europe/Berlin")
                .expect("a zone of the database");
        let daily = Target::Inline("daily", Config::fixed_window(3.0, 1.0).with_calendar(day));
        let u = Request::new().key("u");
        let (midnight, next) = (1_699_916_400_000.0, 1_700_002_800_000.0);
        for _ in 0..3 {
            assert_eq!(l.limit(daily, u).unwrap(), Decision::ADMIT);
        }
        assert_eq!(l.limit(daily, u).unwrap(), refused(next - T0));
        let r = l.value(daily, Some("u")).unwrap();
        assert_eq!((r.value, r.ts), (0.0, midnight), "the window began at midnight in Berlin");
        assert_eq!(r.config.calendar(), Some(day));
        // Booked: 3 tomorrow, then 1 more the day after.
        let booked = l.limit(daily, u.count(3.0).reserve()).unwrap();
        assert_eq!(booked, Decision { ok: true, retry_after: Some(next - T0) });
        let booked = l.limit(daily, u.reserve()).unwrap();
        assert_eq!(booked, Decision { ok: true, retry_after: Some(next + DAY - T0) });
        // At midnight one day's tokens are back: 1 short still, for a day.
        clock.advance(next - T0 - 1.0);
        assert_eq!(l.value(daily, Some("u")).unwrap().ts, midnight);
        clock.advance(1.0);
        assert_eq!(l.check(daily, u).unwrap(), refused(DAY));
        // An adjust's debt waits for windows too.
        let settled = l.adjust(daily, Some("u"), 2.0).unwrap();
        assert_eq!(settled, Adjusted { value: -3.0, retry_after: Some(DAY) });
        // Two days on, full again.
        clock.advance(2.0 * DAY);
        assert!(l.limit(daily, u.count(3.0)).unwrap().ok);
    }

    /// A sharded limit never admits more than its capacity, and its shards stay usable.
    pub fn sharded_never_over_admits<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
        let (l, clock) = setup();
        let sharded = Target::Inline("hot", Config::token_bucket(100.0, MINUTE).with_shards(10));
        let mut admitted = 0;
        for _ in 0..300 {
            if l.limit(sharded, Request::new()).unwrap().ok {
                admitted += 1;
            }
        }
        assert!(admitted <= 100, "{admitted}");
        assert!(admitted >= 90, "the power of two choices keeps shards usable: {admitted}");
        clock.advance(30.0 * SECOND);
        let mut more = 0;
        for _ in 0..300 {
            if l.limit(sharded, Request::new()).unwrap().ok {
                more += 1;
            }
        }
        assert!(more <= 50, "{more}");
    }

    /// The status after each request (remaining, reset after), refusals and transactions too.
    pub fn status_after_requests<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
        let (l, clock) = setup();
        let burst = Target::Inline("burst", Config::token_bucket(10.0, MINUTE).with_capacity(3.0));
        let first = l.limit_with_status(burst, "u").unwrap();
        assert_eq!((first.status.remaining, first.status.reset_after), (2.0, 6_000.0));
        let second = l.limit_with_status(burst, "u").unwrap();
        assert_eq!((second.status.remaining, second.status.reset_after), (1.0, 12_000.0));
        // A refusal reports the state as it stands: nothing was taken.
        let refused = l.check_with_status(burst, Request::new().key("u").count(2.0)).unwrap();
        assert!(!refused.decision.ok);
        assert_eq!((refused.status.remaining, refused.status.reset_after), (1.0, 12_000.0));
        // Outstanding reservations: nothing remains, and full again once they are repaid.
        let reserved =
            l.limit_with_status(burst, Request::new().key("u").count(3.0).reserve()).unwrap();
        assert_eq!((reserved.status.remaining, reserved.status.reset_after), (0.0, 30_000.0));
        // A fixed window is full again at the start of the next window.
        let window = Target::Inline("win", Config::fixed_window(10.0, MINUTE).with_start(T0));
        clock.advance(15.0 * SECOND);
        let w = l.limit_with_status(window, Request::new().key("{v}").count(4.0)).unwrap();
        assert_eq!((w.status.remaining, w.status.reset_after), (6.0, 45_000.0));
        let t = l.transaction_with_status(&[burst.with("{v}"), window.with("{v}")]).unwrap();
        assert_eq!(t.statuses.iter().map(|s| s.remaining).collect::<Vec<_>>(), [2.0, 5.0]);
        // A refused transaction takes nothing: every limit as it stands, the one that would have
        // granted too.
        let refused = [burst.with("{v}"), window.with(Request::new().key("{v}").count(6.0))];
        let t = l.transaction_with_status(&refused).unwrap();
        assert!(!t.decision.ok);
        let statuses: Vec<_> = t.statuses.iter().map(|s| (s.remaining, s.reset_after)).collect();
        assert_eq!(statuses, [(2.0, 6_000.0), (5.0, 45_000.0)]);
    }

    /// A change of config carried over (`carry`, SPEC §2 with `tollgate_algebra::Carry`): another
    /// number of shards or another kind gives nothing back, a slower refill reads the stored state
    /// under the new config, and carrying again takes nothing more.
    pub fn carrying_keeps_every_limit<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
        let (l, clock) = setup();
        let u = Request::new().key("u");
        // One shard of 100 with 40 left, then ten: 4 in each, 40 in all.
        let one = Config::token_bucket(100.0, HOUR);
        let ten = one.with_shards(10);
        assert_eq!(l.limit(("s", one), u.count(60.0)).unwrap(), Decision::ADMIT);
        assert_eq!(l.carry("s", Some("u"), &one, &ten).unwrap(), 10);
        assert_eq!(l.value_sampled(("s", ten), Some("u"), 10).unwrap().value, 40.0);
        assert_eq!(l.carry("s", Some("u"), &one, &ten).unwrap(), 10, "again: each shard rewritten");
        assert!(l.value_sampled(("s", ten), Some("u"), 10).unwrap().value <= 40.0);
        // A key never taken from is full under both: nothing to carry.
        assert_eq!(l.carry("s", Some("fresh"), &one, &ten).unwrap(), 0);
        // A fixed window exhausted half way through its window, then a token bucket: still empty.
        let window = Config::fixed_window(10.0, MINUTE).with_start(T0 - 30.0 * SECOND);
        let bucket = Config::token_bucket(10.0, MINUTE);
        assert_eq!(l.limit(("k", window), u.count(10.0)).unwrap(), Decision::ADMIT);
        assert_eq!(l.carry("k", Some("u"), &window, &bucket).unwrap(), 1);
        assert_eq!(state(&l, Target::Inline("k", bucket), Some("u")), State { value: 0.0, ts: T0 });
        assert!(!l.check(("k", bucket), u).unwrap().ok);
        // A slower refill: the state as stored, read under the new config (a take of nothing).
        let fast = Config::token_bucket(10.0, SECOND);
        let slow = Config::token_bucket(10.0, HOUR);
        assert_eq!(l.limit(("r", fast), u.count(10.0)).unwrap(), Decision::ADMIT);
        clock.advance(100.0);
        assert_eq!(l.carry("r", Some("u"), &fast, &slow).unwrap(), 1);
        let per_ms = 10.0 / HOUR;
        assert_eq!(
            state(&l, Target::Inline("r", slow), Some("u")),
            State { value: 100.0 * per_ms, ts: T0 + 100.0 }
        );
        // A faster one asks nothing: the state stays as stored.
        assert_eq!(l.carry("r", Some("u"), &slow, &fast).unwrap(), 0);
    }

    /// 256 concurrent callers on a limit of 100: exactly 100 admitted, 20 times over.
    pub fn concurrent_exactness<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
        // 256 callers (threads, or tasks of a runtime with two threads) race for a limit of 100,
        // 20 times: exactly 100 admitted each time.
        for round in 0..20 {
            let (l, _) = setup();
            let limit = Target::Inline("race", Config::token_bucket(100.0, MINUTE));
            assert_eq!(l.race(limit, 256, 1), 100, "round {round}");
        }
        // A calendar window (decided outside Lua on Redis, with its writes compared and set):
        // 64 callers for 30, five times.
        let month = tollgate_algebra::Calendar::new(tollgate_algebra::CalendarUnit::Month, "UTC")
            .expect("UTC");
        for round in 0..5 {
            let (l, _) = setup();
            let limit =
                Target::Inline("raceMonthly", Config::fixed_window(30.0, 1.0).with_calendar(month));
            assert_eq!(l.race(limit, 64, 1), 30, "calendar round {round}");
        }
    }

    /// SPEC §6f's numbers: acquire, refuse with the wait to the earliest expiry, expire,
    /// renew (after expiry too), release twice, check, value, reset, counts and errors.
    pub fn slots_spec_numbers<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
        let (l, clock) = setup();
        let gpu = ("gpu", Concurrency::new(3).with_ttl(10.0 * SECOND));
        let k = Some("t1");
        let granted = |a: Acquired| a.ticket().unwrap_or_else(|| panic!("refused: {a:?}"));
        let one = l.acquire(gpu, "t1").unwrap();
        let one = granted(one);
        assert_eq!(one.expires_at, T0 + 10.0 * SECOND);
        clock.advance(SECOND);
        let two = granted(l.acquire(gpu, Acquire::new().key("t1").count(2)).unwrap());
        assert_eq!(two.expires_at, T0 + 11.0 * SECOND);
        assert_ne!(one.id, two.id, "tickets are distinct");
        // Full: refused until the earliest expiry; nothing written.
        clock.advance(SECOND);
        assert_eq!(l.acquire(gpu, "t1").unwrap(), Acquired::Refused { retry_after: 8.0 * SECOND });
        assert_eq!(
            l.check_slots(gpu, "t1").unwrap(),
            Decision { ok: false, retry_after: Some(8.0 * SECOND) }
        );
        let value = l.slots_value(gpu, k).unwrap();
        assert_eq!(
            value,
            SlotsValue { in_flight: 3, max: 3, holders: 2, earliest: Some(T0 + 10.0 * SECOND) }
        );
        // Other keys are independent; throws turns a refusal into an error.
        assert!(l.acquire(gpu, "t2").unwrap().ok());
        match l.acquire(gpu, Acquire::new().key("t1").throws()) {
            Err(Error::RateLimited { name, retry_after }) => {
                assert_eq!((name.as_str(), retry_after), ("gpu", 8.0 * SECOND));
            }
            other => panic!("throws: {other:?}"),
        }
        // Renewing the first moves the earliest expiry to the second's.
        assert_eq!(l.renew(gpu, k, one.id, Some(20.0 * SECOND)).unwrap(), Some(T0 + 22.0 * SECOND));
        assert_eq!(l.acquire(gpu, "t1").unwrap(), Acquired::Refused { retry_after: 9.0 * SECOND });
        // The second expires at T0 + 11 s: its slots are free, its renewal and release say so.
        clock.set(T0 + 11.0 * SECOND);
        assert_eq!(l.renew(gpu, k, two.id, None).unwrap(), None);
        assert!(!l.release(gpu, k, two.id).unwrap());
        assert_eq!(l.slots_value(gpu, k).unwrap().in_flight, 1);
        assert!(l.check_slots(gpu, Acquire::new().key("t1").count(2)).unwrap().ok);
        let three = granted(l.acquire(gpu, Acquire::new().key("t1").count(2).ttl(500.0)).unwrap());
        assert_eq!(three.expires_at, T0 + 11.5 * SECOND);
        // Released twice: true, then false; an unknown ticket: false.
        assert!(l.release(gpu, k, three.id).unwrap());
        assert!(!l.release(gpu, k, three.id).unwrap());
        assert!(!l.release(gpu, k, 987_654_321).unwrap());
        // Errors consume nothing: a count over max, a count of 0, a bad ttl, no such name.
        for bad in [Acquire::new().key("t1").count(4), Acquire::new().key("t1").count(0)] {
            assert!(matches!(l.acquire(gpu, bad), Err(Error::Invalid(_))), "{bad:?}");
        }
        let short = Acquire::new().key("t1").ttl(0.0);
        assert!(matches!(l.acquire(gpu, short), Err(Error::Invalid(_))));
        assert!(matches!(l.acquire("nope", "t1"), Err(Error::NotDefined { .. })));
        assert_eq!(l.slots_value(gpu, k).unwrap().in_flight, 1);
        // Reset frees every slot of the key, not the other key's.
        l.reset_slots(gpu, k).unwrap();
        assert_eq!(
            l.slots_value(gpu, k).unwrap(),
            SlotsValue { in_flight: 0, max: 3, holders: 0, earliest: None }
        );
        assert_eq!(l.slots_value(gpu, Some("t2")).unwrap().holders, 1);
        assert!(!l.release(gpu, k, one.id).unwrap());
        // The global (unkeyed) slots are a key of their own.
        assert!(l.acquire(gpu, Acquire::new().count(3)).unwrap().ok());
        assert_eq!(l.slots_value(gpu, None).unwrap().in_flight, 3);
        assert_eq!(l.slots_value(gpu, k).unwrap().in_flight, 0);
    }

    /// SPEC §6f: an acquire taken with rate limits, all or nothing: the slot and the tokens
    /// both, or neither; with the slots full the rate limits are decided as a check.
    pub fn slots_with_rate_limits<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
        let (l, clock) = setup();
        // One tenant's limits: on Redis Cluster the hash tag keeps them in one hash slot.
        let (tenant, k) = ("{t1}", Some("{t1}"));
        let gpu = ("gpuWith", Concurrency::new(2).with_ttl(10.0 * SECOND));
        let tokens = Target::Inline("tokensWith", Config::token_bucket(10.0, MINUTE));
        let spend = |count: f64| [tokens.with(Request::new().key(tenant).count(count))];
        let both = l.acquire_with(gpu, tenant, &spend(6.0)).unwrap();
        assert!(both.ok && both.slot.ok && both.limits.decision.ok, "{both:?}");
        assert_eq!(both.ticket.unwrap().expires_at, T0 + 10.0 * SECOND);
        assert_eq!(both.retry_after, None);
        assert_eq!(state(&l, tokens, k).value, 4.0);
        assert_eq!(l.slots_value(gpu, k).unwrap().in_flight, 1);
        // The tokens are refused (2 short: 12 s at 10 a minute): no slot is held for it.
        clock.advance(SECOND);
        let short = l.acquire_with(gpu, tenant, &spend(6.0)).unwrap();
        assert_eq!((short.ok, short.ticket, short.slot), (false, None, Decision::ADMIT));
        assert_eq!(short.limits.decision.results[..], [refused(11_000.0)]);
        assert_eq!(short.retry_after, Some(11_000.0));
        assert_eq!(l.slots_value(gpu, k).unwrap().in_flight, 1);
        // The slots full: refused until the earliest expiry; the tokens decided, not taken.
        let plain = l.acquire(gpu, tenant).unwrap();
        assert!(plain.ok());
        let left = state(&l, tokens, k);
        let full = l.acquire_with(gpu, tenant, &spend(1.0)).unwrap();
        assert_eq!((full.ok, full.ticket), (false, None));
        assert_eq!(full.slot, refused(9.0 * SECOND));
        assert!(full.limits.decision.ok);
        assert_eq!(full.retry_after, Some(9.0 * SECOND));
        assert_eq!(state(&l, tokens, k), left, "nothing taken while the slots were full");
        let left = left.value;
        // throws names the concurrency limit; an invalid call is an error; neither holds.
        match l.acquire_with(gpu, Acquire::new().key(tenant).throws(), &spend(1.0)) {
            Err(Error::RateLimited { name, retry_after }) => {
                assert_eq!((name.as_str(), retry_after), ("gpuWith", 9.0 * SECOND));
            }
            other => panic!("throws: {other:?}"),
        }
        assert!(l.release(gpu, k, plain.ticket().unwrap().id).unwrap());
        assert!(matches!(l.acquire_with(gpu, tenant, &spend(11.0)), Err(Error::Invalid(_))));
        let over = Acquire::new().key(tenant).count(3);
        assert!(matches!(l.acquire_with(gpu, over, &spend(1.0)), Err(Error::Invalid(_))));
        assert_eq!(l.slots_value(gpu, k).unwrap().in_flight, 1);
        assert_eq!(state(&l, tokens, k).value, left);
        // Granted again: both taken; without calls it is a plain acquire.
        let again = l.acquire_with(gpu, tenant, &spend(1.0)).unwrap();
        assert!(again.ok);
        assert_eq!(state(&l, tokens, k).value, left + 10_000.0 / 60_000.0 - 1.0);
        assert!(l.release(gpu, k, again.ticket.unwrap().id).unwrap());
        assert!(l.acquire_with(gpu, tenant, &[]).unwrap().ok);
        assert_eq!(l.slots_value(gpu, k).unwrap().in_flight, 2);
    }

    /// 64 racing acquirers of a limit of 10: exactly 10 granted, 10 times over.
    pub fn slots_racing_acquirers<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
        for round in 0..10 {
            let (l, _) = setup();
            let limit = ("raceSlots", Concurrency::new(10));
            assert_eq!(l.race_slots(limit, 64), 10, "round {round}");
        }
    }
}
