//! Redis's own time per call of each operation on a concurrency limit's slots, from `INFO
//! commandstats` (`evalsha`) read around each step: the Redis store's cost, free of the
//! client's and the network's.
//!
//! ```text
//! cargo run --release -p tollgate-bench --bin slots_cost [ROUNDS]
//! ```
//!
//! Against `TOLLGATE_REDIS_URL` (default redis://127.0.0.1:6379), loopback only, one call in
//! flight. A round, on one key of a limit of 64 slots: 64 acquires granted (holding 0 to 63
//! before each), 64 renewals of them, 64 acquires refused (full), 64 releases, and 64
//! releases again of the same tickets (unknown by then). Default 300 rounds: 19,200 calls of
//! each. Then, as `bindings/node/bench-slots.mjs` makes them (from Rust, on a runtime of one
//! thread), 64 acquire + release pairs in flight on one key for 3 s: pairs a second, and
//! Redis's time a pair.

use std::sync::Arc;

use tollgate::store::RedisStore;
use tollgate::{Acquired, AsyncStore, Concurrency, RateLimiter};
use tollgate_bench::{command_stats, loopback_url};

const SLOTS: usize = 64;

fn main() {
    let rounds: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(300);
    let url = loopback_url("TOLLGATE_REDIS_URL", "redis://127.0.0.1:6379");
    let mut stats = redis::Client::open(url.as_str()).unwrap().get_connection().unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let store: Arc<dyn AsyncStore> =
        Arc::new(RedisStore::builder().prefix("tollgate-bench:slots-cost:").open(&url).unwrap());
    let limiter = RateLimiter::builder(store)
        .define_concurrency("gpu", Concurrency::new(u32::try_from(SLOTS).unwrap()))
        .build();
    let name = format!("k{}", std::process::id());
    let (acquire, key) = (name.as_str(), Some(name.as_str()));
    let steps = ["acquire (granted)", "renew", "acquire (refused)", "release", "release (unknown)"];
    // (calls, usec) of `evalsha` per step.
    let mut sums = [(0.0, 0.0); 5];
    let mut took = |step: usize, stats: &mut redis::Connection, before: (f64, f64)| {
        let after = command_stats(stats, "evalsha");
        sums[step].0 += after.0 - before.0;
        sums[step].1 += after.1 - before.1;
        command_stats(stats, "evalsha")
    };
    runtime.block_on(async {
        // Warm: the scripts loaded.
        let warm = limiter.acquire_async("gpu", acquire).await.unwrap().ticket().unwrap();
        limiter.release_async("gpu", key, warm.id).await.unwrap();
        limiter.renew_async("gpu", key, warm.id, None).await.unwrap();
        for _ in 0..rounds {
            let mut at = command_stats(&mut stats, "evalsha");
            let mut tickets = Vec::with_capacity(SLOTS);
            for _ in 0..SLOTS {
                tickets.push(
                    limiter.acquire_async("gpu", acquire).await.unwrap().ticket().unwrap().id,
                );
            }
            at = took(0, &mut stats, at);
            for &t in &tickets {
                assert!(limiter.renew_async("gpu", key, t, None).await.unwrap().is_some());
            }
            at = took(1, &mut stats, at);
            for _ in 0..SLOTS {
                let refused = limiter.acquire_async("gpu", acquire).await.unwrap();
                assert!(matches!(refused, Acquired::Refused { .. }), "{refused:?}");
            }
            at = took(2, &mut stats, at);
            for &t in &tickets {
                assert!(limiter.release_async("gpu", key, t).await.unwrap());
            }
            at = took(3, &mut stats, at);
            for &t in &tickets {
                assert!(!limiter.release_async("gpu", key, t).await.unwrap());
            }
            took(4, &mut stats, at);
        }
    });
    println!("slots_cost: Redis's time per call (INFO commandstats, evalsha), {rounds} rounds");
    for (step, (calls, usec)) in steps.iter().zip(sums) {
        println!("  {step:<18} {:>6.2} us a call ({calls} calls)", usec / calls);
    }

    let limiter = Arc::new(limiter);
    let before = command_stats(&mut stats, "evalsha");
    let (pairs, secs) = runtime.block_on(async {
        let start = std::time::Instant::now();
        let until = start + std::time::Duration::from_secs(3);
        let tasks: Vec<_> = (0..SLOTS)
            .map(|_| {
                let (limiter, name) = (Arc::clone(&limiter), name.clone());
                tokio::spawn(async move {
                    let mut pairs = 0u64;
                    while std::time::Instant::now() < until {
                        let acquired = limiter.acquire_async("gpu", name.as_str()).await.unwrap();
                        let ticket = acquired.ticket().expect("granted").id;
                        assert!(limiter.release_async("gpu", Some(&name), ticket).await.unwrap());
                        pairs += 1;
                    }
                    pairs
                })
            })
            .collect();
        let mut pairs = 0;
        for task in tasks {
            pairs += task.await.unwrap();
        }
        (pairs, start.elapsed().as_secs_f64())
    });
    let after = command_stats(&mut stats, "evalsha");
    #[allow(clippy::cast_precision_loss)]
    let pairs = pairs as f64;
    println!(
        "  {SLOTS} pairs in flight: {:.0} pairs a second, Redis {:.2} us a pair",
        pairs / secs,
        (after.1 - before.1) / pairs
    );
}
