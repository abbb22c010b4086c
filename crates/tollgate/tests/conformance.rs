//! The behaviours every store must show, written once: each function takes a way to make a
//! limiter on a fresh store and clock, through the sync API or the async one. Backends join
//! with one line at the bottom: every store through the async API, and those that keep a
//! sync API (memory, SQLite) through that too.

use std::sync::Arc;

use tokio::runtime::Runtime;
use tollgate::{
    AsyncStore, Call, Config, Decision, Error, HOUR, MINUTE, ManualClock, RateLimiter, Request,
    SECOND, State, Store, Target,
};

mod common;

use common::{Api, AsyncApi, SyncApi};

const T0: f64 = 1_700_000_000_000.0;

/// A limiter through the sync API on the store `make` makes (on `runtime`, which the sync
/// stores do not use) with its clock.
fn sync_api<S: Store + Send + Sync + 'static>(
    make: &impl Fn(&Runtime, ManualClock) -> S,
) -> (SyncApi<S>, ManualClock) {
    let clock = ManualClock::new(T0);
    let store = make(&common::runtime(), clock.clone());
    (SyncApi(Arc::new(RateLimiter::builder(store).seed(7).build())), clock)
}

/// A limiter through the async API on the store `make` makes on a runtime of two threads.
fn async_api<S: AsyncStore + 'static>(
    make: &impl Fn(&Runtime, ManualClock) -> S,
) -> (AsyncApi<S>, ManualClock) {
    let clock = ManualClock::new(T0);
    let runtime = common::runtime();
    let store = make(&runtime, clock.clone());
    (AsyncApi { limiter: Arc::new(RateLimiter::builder(store).seed(7).build()), runtime }, clock)
}

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

fn token_bucket_spec_numbers<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
    let (l, clock) = setup();
    let k = Request::new().key("u");
    assert_eq!(l.limit(tb(), k.count(5.0)).unwrap(), Decision::ADMIT);
    clock.advance(6.0 * SECOND);
    assert_eq!(l.limit(tb(), k.count(6.0)).unwrap(), Decision::ADMIT);
    assert_eq!(state(&l, tb(), Some("u")), State { value: 0.0, ts: T0 + 6_000.0 });
    assert_eq!(l.limit(tb(), k.count(10.0)).unwrap(), refused(MINUTE));
    assert_eq!(state(&l, tb(), Some("u")).value, 0.0, "a refusal stores nothing");
}

fn token_bucket_spec_numbers_reserved<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
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

fn fixed_window_spec_numbers<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
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

fn capacity_burst<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
    let (l, clock) = setup();
    let burst = Target::Inline("burst", Config::token_bucket(10.0, MINUTE).with_capacity(3.0));
    clock.advance(10.0 * MINUTE);
    for _ in 0..3 {
        assert!(l.limit(burst, "u").unwrap().ok);
    }
    assert_eq!(l.limit(burst, "u").unwrap(), refused(6_000.0));
}

fn max_reserved<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
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

fn check_does_not_consume<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
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

fn invalid_requests_consume_nothing<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
    let (l, _) = setup();
    for bad in [-1.0, f64::NAN, f64::INFINITY, 11.0] {
        assert!(
            matches!(l.limit(tb(), Request::new().count(bad)), Err(Error::Invalid(_))),
            "{bad}"
        );
    }
    let long_key = "k".repeat(1025);
    assert!(matches!(l.limit(tb(), Request::new().key(&long_key)), Err(Error::Invalid(_))));
    assert_eq!(state(&l, tb(), None), State { value: 10.0, ts: 0.0 });
    let err = l.limit("nowhere", Request::new()).unwrap_err();
    assert!(matches!(err, Error::NotDefined { .. }));
    assert!(err.to_string().starts_with("Rate limit nowhere not defined."), "{err}");
}

fn throws_turns_refusal_into_error<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
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

fn reset_forgets<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
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

fn forget_needs_no_config_and_takes_every_shard<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
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

fn keys_are_isolated<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
    let (l, _) = setup();
    l.limit(tb(), Request::new().key("a").count(10.0)).unwrap();
    assert!(l.limit(tb(), Request::new().key("b").count(10.0)).unwrap().ok);
    assert!(l.limit(tb(), Request::new().count(10.0)).unwrap().ok, "no key is the global value");
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

fn value_reports_config_and_state<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
    let (l, clock) = setup();
    let fresh = l.value(tb(), Some("new")).unwrap();
    assert_eq!((fresh.value, fresh.ts), (10.0, 0.0));
    assert_eq!(fresh.config.capacity(), 10.0);
    l.limit(tb(), Request::new().key("u").count(4.0)).unwrap();
    clock.advance(12.0 * SECOND);
    let r = l.value(tb(), Some("u")).unwrap();
    assert_eq!((r.value, r.ts, r.shard), (6.0, T0, 0));
    // The client can run the algebra itself from what value returned.
    let at_now = tollgate::core::evaluate(
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

fn transaction_all_or_nothing<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
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

fn sharded_never_over_admits<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
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

fn status_after_requests<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
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
fn carrying_keeps_every_limit<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
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

fn concurrent_exactness<A: Api>(setup: &dyn Fn() -> (A, ManualClock)) {
    // 256 callers (threads, or tasks of a runtime with two threads) race for a limit of 100,
    // 20 times: exactly 100 admitted each time.
    for round in 0..20 {
        let (l, _) = setup();
        let limit = Target::Inline("race", Config::token_bucket(100.0, MINUTE));
        assert_eq!(l.race(limit, 256, 1), 100, "round {round}");
    }
}

macro_rules! conformance {
    // A store with both APIs.
    ($backend:ident, $make:expr, $available:expr, sync and async) => {
        mod $backend {
            mod sync_api {
                conformance!(@tests sync_api, $make, $available);
            }
            mod async_api {
                conformance!(@tests async_api, $make, $available);
            }
        }
    };
    // A store with the async API only.
    ($backend:ident, $make:expr, $available:expr) => {
        mod $backend {
            mod async_api {
                conformance!(@tests async_api, $make, $available);
            }
        }
    };
    (@tests $api:ident, $make:expr, $available:expr) => {
        conformance!(@each $api, $make, $available; token_bucket_spec_numbers,
            token_bucket_spec_numbers_reserved, fixed_window_spec_numbers, capacity_burst,
            max_reserved, check_does_not_consume, invalid_requests_consume_nothing,
            throws_turns_refusal_into_error, reset_forgets,
            forget_needs_no_config_and_takes_every_shard, keys_are_isolated,
            value_reports_config_and_state, transaction_all_or_nothing, sharded_never_over_admits,
            status_after_requests, carrying_keeps_every_limit, concurrent_exactness);
    };
    (@each $api:ident, $make:expr, $available:expr; $($test:ident),*) => {
        $(#[test] fn $test() { if $available { crate::$test(&|| crate::$api(&$make)) } })*
    };
}

conformance!(memory, |_: &tokio::runtime::Runtime, clock| tollgate::MemoryStore::with_clock(clock), true, sync and async);
conformance!(
    memory_two_segments,
    |_: &tokio::runtime::Runtime, clock| tollgate::MemoryStore::builder().segments(2).build_with_clock(clock),
    true,
    sync and async
);

#[cfg(feature = "sqlite")]
conformance!(
    sqlite_in_memory,
    |_: &tokio::runtime::Runtime, clock| {
        tollgate::store::SqliteStore::builder().open_in_memory_with_clock(clock).unwrap()
    },
    true,
    sync and async
);

#[cfg(feature = "sqlite")]
conformance!(sqlite_file, crate::on_disk, true, sync and async);

/// A SQLite store on a file in a directory that goes away with it.
#[cfg(feature = "sqlite")]
fn on_disk(
    _: &Runtime,
    clock: ManualClock,
) -> common::Owned<tollgate::store::SqliteStore<ManualClock>, tempfile::TempDir> {
    let dir = tempfile::tempdir().unwrap();
    let store = tollgate::store::SqliteStore::builder()
        .open_with_clock(dir.path().join("t.db"), clock)
        .unwrap();
    common::Owned { store, resource: dir }
}

#[cfg(feature = "redis")]
conformance!(redis, crate::on_redis::open, crate::on_redis::url().is_some());

/// The suite's limits that have no shards (a leased limit has none), each leased by the
/// `*_leased` stores below with a floor of the whole capacity: every take of them goes the
/// lease path's way (a direct take through the lease script or function, refilled under the
/// cap of the leases out, a reset through the lease step), as near its bound, where a
/// leased limit must answer exactly as one that is not.
#[cfg(any(feature = "redis", feature = "postgres"))]
const LEASED: [&str; 7] = ["tb", "fw", "burst", "mr", "win", "small", "race"];

#[cfg(any(feature = "redis", feature = "postgres"))]
fn near_the_bound() -> tollgate::store::LeaseOptions {
    tollgate::store::LeaseOptions::new().floor(1.0)
}

#[cfg(feature = "redis")]
conformance!(redis_leased, crate::on_redis::open_leased, crate::on_redis::url().is_some());

#[cfg(feature = "redis")]
conformance!(redis_acl_user, crate::on_redis::open_as_user, crate::on_redis::url().is_some());

#[cfg(feature = "redis")]
mod on_redis {
    use std::sync::atomic::{AtomicU64, Ordering};

    use tokio::runtime::Runtime;
    use tollgate::ManualClock;
    use tollgate::store::RedisStore;

    pub(crate) fn url() -> Option<String> {
        super::common::backend_url("TOLLGATE_REDIS_URL", "redis://127.0.0.1:6379")
    }

    #[cfg(feature = "redis-cluster")]
    pub(crate) fn cluster_url() -> Option<String> {
        super::common::backend_url(
            "TOLLGATE_REDIS_CLUSTER_URL",
            "redis+cluster://127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002 (scripts/redis-cluster start DIR prints one)",
        )
    }

    /// A store with a key prefix of its own, so tests never see each other's states.
    /// A store's builder on a key prefix of its own.
    fn builder() -> tollgate::store::RedisStoreBuilder {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let prefix = format!(
            "tollgate-test:{}:{}:",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        RedisStore::builder().prefix(prefix)
    }

    fn open_on(url: &str, clock: ManualClock) -> RedisStore<ManualClock> {
        builder().open_with_clock(url, clock).unwrap()
    }

    pub(crate) fn open(_: &Runtime, clock: ManualClock) -> RedisStore<ManualClock> {
        open_on(&url().expect("checked"), clock)
    }

    /// With the suite's unsharded limits leased (see [`crate::LEASED`]).
    pub(crate) fn open_leased(_: &Runtime, clock: ManualClock) -> RedisStore<ManualClock> {
        let leasing =
            crate::LEASED.iter().fold(builder(), |b, n| b.lease(*n, crate::near_the_bound()));
        leasing.open_with_clock(&url().expect("checked"), clock).unwrap()
    }

    /// The commands a tollgate user needs, as the guide's `ACL SETUSER` gives them (shell
    /// quotes included: the guide's Redis chapter is checked to hold this very text).
    const ACL_COMMANDS: &str = "+evalsha '+script|load' +time +get +mget +set +del";

    /// What a cluster's user needs besides: the command redis-rs finds the nodes with.
    #[cfg(feature = "redis-cluster")]
    const ACL_CLUSTER_COMMANDS: &str = "'+cluster|slots'";

    /// What a user behind Sentinel needs besides: `ROLE` (the store checks that the node
    /// the Sentinels name is the primary) and `WAIT` (for `replicas=N`).
    const ACL_SENTINEL_COMMANDS: &str = "+role +wait";

    const ACL_USER: (&str, &str) = ("tollgate-test-acl", "tollgate-test-acl-password");

    /// Makes (again) the ACL user of these tests on the Redis at `admin` (a `redis://` URL
    /// whose user may): `commands` alone, on the tests' keys alone (`~tollgate-test:*`).
    fn set_up_user(admin: &str, commands: &str) {
        let guide = include_str!("../../../docs/src/stores/redis.md");
        assert!(guide.contains(commands), "the guide's ACL does not hold {commands:?}");
        let (user, password) = ACL_USER;
        let mut conn = redis::Client::open(admin).unwrap().get_connection().unwrap();
        let mut setuser = redis::cmd("ACL");
        setuser.arg(&["SETUSER", user, "reset", "on", &format!(">{password}")][..]);
        setuser.arg(&["~tollgate-test:*", "resetchannels", "-@all"][..]);
        setuser.arg(commands.split(' ').map(|c| c.trim_matches('\'')).collect::<Vec<_>>());
        let () = setuser.query(&mut conn).expect("ACL SETUSER");
    }

    /// `url` (`redis://HOST:PORT` or `redis+cluster://HOST:PORT,...`) with the tests' ACL
    /// user's credentials in place of any it has.
    fn as_user(url: &str) -> String {
        let (scheme, rest) = url.split_once("://").expect("a URL");
        let rest = rest.rsplit_once('@').map_or(rest, |(_, hosts)| hosts);
        let (user, password) = ACL_USER;
        format!("{scheme}://{user}:{password}@{rest}")
    }

    /// A store that connects as a Redis ACL user allowed the guide's commands alone.
    pub(crate) fn open_as_user(_: &Runtime, clock: ManualClock) -> RedisStore<ManualClock> {
        static URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        let url = URL.get_or_init(|| {
            let admin = url().expect("checked");
            set_up_user(&admin, ACL_COMMANDS);
            as_user(&admin)
        });
        open_on(url, clock)
    }

    /// The same on Redis Cluster: the user made on every node, with the guide's commands
    /// for a cluster.
    #[cfg(feature = "redis-cluster")]
    pub(crate) fn open_cluster_as_user(_: &Runtime, clock: ManualClock) -> RedisStore<ManualClock> {
        static URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        let url = URL.get_or_init(|| {
            let admin = cluster_url().expect("checked");
            let nodes = admin.strip_prefix("redis+cluster://").expect("a redis+cluster:// URL");
            let nodes = nodes.rsplit_once('@').map_or(nodes, |(_, nodes)| nodes);
            let commands = format!("{ACL_COMMANDS} {ACL_CLUSTER_COMMANDS}");
            for node in nodes.split('/').next().unwrap_or_default().split(',') {
                set_up_user(&format!("redis://{}", node.trim()), &commands);
            }
            as_user(&admin)
        });
        open_on(url, clock)
    }

    /// One Redis over TLS, asking for a client certificate: `scripts/redis-tls start`.
    #[cfg(feature = "redis-tls")]
    pub(crate) fn tls_url() -> Option<String> {
        super::common::backend_url(
            "TOLLGATE_REDIS_TLS_URL",
            "rediss://127.0.0.1:6380?ca=ca.crt&cert=client.crt&key=client.key (scripts/redis-tls start DIR prints one)",
        )
    }

    /// A primary, replicas and Sentinels: `scripts/redis-sentinel start`.
    pub(crate) fn sentinel_url() -> Option<String> {
        super::common::backend_url(
            "TOLLGATE_REDIS_SENTINEL_URL",
            "redis+sentinel://127.0.0.1:26379/tollgate (scripts/redis-sentinel start DIR prints one)",
        )
    }

    /// The same over TLS: `scripts/redis-sentinel start DIR CERTS`.
    #[cfg(feature = "redis-tls")]
    pub(crate) fn sentinel_tls_url() -> Option<String> {
        super::common::backend_url(
            "TOLLGATE_REDIS_SENTINEL_TLS_URL",
            "rediss+sentinel://127.0.0.1:26379/tollgate?ca=ca.crt (scripts/redis-sentinel start DIR CERTS prints one)",
        )
    }

    /// A cluster over TLS: `scripts/redis-cluster start DIR CERTS`.
    #[cfg(all(feature = "redis-cluster", feature = "redis-tls"))]
    pub(crate) fn cluster_tls_url() -> Option<String> {
        super::common::backend_url(
            "TOLLGATE_REDIS_CLUSTER_TLS_URL",
            "rediss+cluster://127.0.0.1:7000,127.0.0.1:7001?ca=ca.crt (scripts/redis-cluster start DIR CERTS prints one)",
        )
    }

    #[cfg(feature = "redis-tls")]
    pub(crate) fn open_tls(_: &Runtime, clock: ManualClock) -> RedisStore<ManualClock> {
        open_on(&tls_url().expect("checked"), clock)
    }

    pub(crate) fn open_sentinel(_: &Runtime, clock: ManualClock) -> RedisStore<ManualClock> {
        open_on(&sentinel_url().expect("checked"), clock)
    }

    #[cfg(feature = "redis-tls")]
    pub(crate) fn open_sentinel_tls(_: &Runtime, clock: ManualClock) -> RedisStore<ManualClock> {
        open_on(&sentinel_tls_url().expect("checked"), clock)
    }

    #[cfg(all(feature = "redis-cluster", feature = "redis-tls"))]
    pub(crate) fn open_cluster_tls(_: &Runtime, clock: ManualClock) -> RedisStore<ManualClock> {
        open_on(&cluster_tls_url().expect("checked"), clock)
    }

    /// Behind Sentinel, with `replicas=1`: the user made on the primary and every replica
    /// (ACLs are not replicated, and any replica may be promoted), with the guide's
    /// commands for Sentinel.
    pub(crate) fn open_sentinel_as_user(
        _: &Runtime,
        clock: ManualClock,
    ) -> RedisStore<ManualClock> {
        static URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        let url = URL.get_or_init(|| {
            let admin = sentinel_url().expect("checked");
            let rest = admin.strip_prefix("redis+sentinel://").expect("a redis+sentinel:// URL");
            let (sentinels, master) = rest.split_once('/').expect("/MASTER");
            let sentinel = sentinels.rsplit_once('@').map_or(sentinels, |(_, s)| s);
            let sentinel = format!("redis://{}", sentinel.split(',').next().unwrap());
            let mut conn = redis::Client::open(sentinel).unwrap().get_connection().unwrap();
            let primary: Vec<String> = redis::cmd("SENTINEL")
                .arg(&["get-master-addr-by-name", master][..])
                .query(&mut conn)
                .unwrap();
            let replicas: Vec<Vec<String>> =
                redis::cmd("SENTINEL").arg(&["replicas", master][..]).query(&mut conn).unwrap();
            let field = |fields: &[String], name: &str| {
                let at = fields.iter().position(|f| f == name).expect(name);
                fields[at + 1].clone()
            };
            let mut nodes = vec![format!("{}:{}", primary[0], primary[1])];
            nodes.extend(
                replicas.iter().map(|r| format!("{}:{}", field(r, "ip"), field(r, "port"))),
            );
            let commands = format!("{ACL_COMMANDS} {ACL_SENTINEL_COMMANDS}");
            for node in nodes {
                set_up_user(&format!("redis://{node}"), &commands);
            }
            format!("{}?replicas=1", as_user(&admin))
        });
        open_on(url, clock)
    }

    /// On Redis Cluster, each state placed by its own key: the shards of a limit spread
    /// over the nodes.
    #[cfg(feature = "redis-cluster")]
    pub(crate) fn open_cluster(_: &Runtime, clock: ManualClock) -> RedisStore<ManualClock> {
        open_on(&cluster_url().expect("checked"), clock)
    }
}

#[cfg(feature = "redis-cluster")]
conformance!(
    redis_cluster,
    crate::on_redis::open_cluster,
    crate::on_redis::cluster_url().is_some()
);

#[cfg(feature = "redis-cluster")]
conformance!(
    redis_cluster_acl_user,
    crate::on_redis::open_cluster_as_user,
    crate::on_redis::cluster_url().is_some()
);

#[cfg(feature = "redis-tls")]
conformance!(redis_tls, crate::on_redis::open_tls, crate::on_redis::tls_url().is_some());

#[cfg(feature = "redis")]
conformance!(
    redis_sentinel,
    crate::on_redis::open_sentinel,
    crate::on_redis::sentinel_url().is_some()
);

#[cfg(feature = "redis")]
conformance!(
    redis_sentinel_acl_user_replicas_1,
    crate::on_redis::open_sentinel_as_user,
    crate::on_redis::sentinel_url().is_some()
);

#[cfg(feature = "redis-tls")]
conformance!(
    redis_sentinel_tls,
    crate::on_redis::open_sentinel_tls,
    crate::on_redis::sentinel_tls_url().is_some()
);

#[cfg(all(feature = "redis-cluster", feature = "redis-tls"))]
conformance!(
    redis_cluster_tls,
    crate::on_redis::open_cluster_tls,
    crate::on_redis::cluster_tls_url().is_some()
);

#[cfg(feature = "postgres")]
conformance!(postgres, crate::on_postgres::open, crate::on_postgres::url().is_some());

#[cfg(feature = "postgres")]
conformance!(postgres_leased, crate::on_postgres::open_leased, crate::on_postgres::url().is_some());

#[cfg(feature = "postgres")]
mod on_postgres {
    use tokio::runtime::Runtime;
    use tollgate::ManualClock;
    use tollgate::store::PgStore;

    use super::common::{DropTable, Owned, backend_url};

    pub(crate) fn url() -> Option<String> {
        backend_url("TOLLGATE_POSTGRES_URL", "postgres://postgres@127.0.0.1/test")
    }

    /// A store on a table of its own, dropped with it.
    pub(crate) fn open(
        runtime: &Runtime,
        clock: ManualClock,
    ) -> Owned<PgStore<ManualClock>, DropTable> {
        open_leasing(runtime, clock, &[])
    }

    /// With the suite's unsharded limits leased (see [`crate::LEASED`]).
    pub(crate) fn open_leased(
        runtime: &Runtime,
        clock: ManualClock,
    ) -> Owned<PgStore<ManualClock>, DropTable> {
        open_leasing(runtime, clock, &crate::LEASED)
    }

    /// A store on a table of its own, dropped with it, leasing the limits `leased`.
    fn open_leasing(
        runtime: &Runtime,
        clock: ManualClock,
        leased: &[&str],
    ) -> Owned<PgStore<ManualClock>, DropTable> {
        let table = DropTable::new(&url().expect("checked"), "tollgate_test");
        let builder = leased.iter().fold(PgStore::builder().table(&table.table), |b, name| {
            b.lease(*name, crate::near_the_bound())
        });
        let store = builder.open_with_clock(&table.url, clock);
        Owned { store: runtime.block_on(store).unwrap(), resource: table }
    }
}
