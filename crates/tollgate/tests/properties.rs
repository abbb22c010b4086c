//! The invariants of SPEC §2 and §3, checked on random traffic with a manual clock.

use proptest::prelude::*;
use tollgate::{Config, Decision, ManualClock, MemoryStore, RateLimiter, Request, Target};

type Limiter = RateLimiter<MemoryStore<ManualClock>>;

const T0: f64 = 1_700_000_000_000.0;

fn limiter_at(start: f64, seed: u64) -> (Limiter, ManualClock) {
    let clock = ManualClock::new(start);
    (RateLimiter::builder(MemoryStore::with_clock(clock.clone())).seed(seed).build(), clock)
}

fn limiter(seed: u64) -> (Limiter, ManualClock) {
    limiter_at(T0, seed)
}

/// Random traffic: (ms since the previous request, count).
fn traffic() -> impl Strategy<Value = Vec<(f64, f64)>> {
    prop::collection::vec((0.0..3_000.0f64, 0.0..4.0f64), 1..200)
}

fn config() -> impl Strategy<Value = Config> {
    (1.0..50.0f64, 100.0..10_000.0f64, 0.0..60.0f64, any::<bool>()).prop_map(
        |(rate, period, capacity, fixed)| {
            let c = if fixed {
                Config::fixed_window(rate, period)
            } else {
                Config::token_bucket(rate, period)
            };
            c.with_capacity(capacity.max(4.0))
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    /// In any interval, a token bucket admits at most capacity + rate * elapsed / period
    /// (plus one period's rate for a fixed window, whose tokens come at the window's start).
    #[test]
    fn never_admits_more_than_the_rate_allows(config in config(), traffic in traffic(), seed in any::<u64>()) {
        let (l, clock) = limiter(seed);
        let t = Target::Inline("p", config);
        let mut admitted = Vec::new();
        let mut now = T0;
        for (gap, count) in traffic {
            now += gap;
            clock.set(now);
            if l.limit(t, Request::new().count(count)).unwrap().ok {
                admitted.push((now, count));
            }
        }
        let burst = match config.kind() {
            tollgate::Kind::TokenBucket => config.capacity(),
            tollgate::Kind::FixedWindow => config.capacity() + config.rate(),
        };
        for i in 0..admitted.len() {
            let mut sum = 0.0;
            for &(at, count) in &admitted[i..] {
                sum += count;
                let bound = burst + config.rate() * (at - admitted[i].0) / config.period();
                prop_assert!(sum <= bound + 1e-9, "{sum} admitted in {} ms, bound {bound}", at - admitted[i].0);
            }
        }
    }

    /// A fixed window admits at most `capacity` within one window.
    #[test]
    fn fixed_window_admits_at_most_capacity_per_window(rate in 1.0..20.0f64, traffic in traffic(), start in 0.0..1e6f64) {
        let (l, clock) = limiter(0);
        let config = Config::fixed_window(rate, 1_000.0).with_start(start);
        let t = Target::Inline("fw", config);
        let mut per_window = std::collections::HashMap::<i64, f64>::new();
        let mut now = T0;
        for (gap, count) in traffic {
            now += gap;
            clock.set(now);
            if count <= rate && l.limit(t, Request::new().count(count)).unwrap().ok {
                *per_window.entry(((now - start) / 1_000.0).floor() as i64).or_default() += count;
            }
        }
        for (window, sum) in per_window {
            prop_assert!(sum <= rate + 1e-9, "window {window}: {sum} > {rate}");
        }
    }

    /// retry_after is exact: refused just before it, admitted at it.
    #[test]
    fn retry_after_is_exact(config in config(), used in 0.0..1.0f64, count in 0.1..4.0f64, reserve_first in any::<bool>()) {
        // Times near 0 keep every bit of the wait: at T0 the clock itself rounds to 0.24 us.
        let (l, clock) = limiter_at(0.0, 1);
        let t = Target::Inline("r", config);
        let first = Request::new().count(config.capacity() * used);
        l.limit(t, if reserve_first { first.reserve() } else { first }).unwrap();
        let Decision { ok, retry_after } = l.check(t, Request::new().count(count)).unwrap();
        if ok {
            prop_assert_eq!(retry_after, None);
            return Ok(());
        }
        let wait = retry_after.expect("a refusal says when");
        prop_assert!(wait > 0.0);
        clock.set(wait - wait.max(1.0) * 1e-9);
        prop_assert!(!l.check(t, Request::new().count(count)).unwrap().ok, "admitted before retry_after {wait}");
        clock.set(wait);
        let at = l.check(t, Request::new().count(count)).unwrap();
        prop_assert!(at.ok, "refused at retry_after {wait}: {at:?}");
    }

    /// A sharded limit never admits more than the same limit unsharded could.
    #[test]
    fn sharded_never_over_admits(shards in 2u16..12, rate in 20.0..200.0f64, traffic in traffic(), seed in any::<u64>()) {
        let (l, clock) = limiter(seed);
        let period = 10_000.0;
        let config = Config::token_bucket(rate, period).with_shards(shards);
        let t = Target::Inline("s", config);
        let per_shard_max = rate / config.shard_factor();
        let mut admitted = Vec::new();
        let mut now = T0;
        for (gap, count) in traffic {
            now += gap;
            clock.set(now);
            let count = count.min(per_shard_max);
            if l.limit(t, Request::new().count(count)).unwrap().ok {
                admitted.push((now, count));
            }
        }
        for i in 0..admitted.len() {
            let mut sum = 0.0;
            for &(at, count) in &admitted[i..] {
                sum += count;
                let bound = rate + rate * (at - admitted[i].0) / period;
                prop_assert!(sum <= bound + 1e-9, "{sum} admitted, unsharded bound {bound}");
            }
        }
    }
}
