//! What only a Redis Cluster shows: the shards of a hot limit spread over its nodes, a take
//! over two shards on two nodes answers as the memory store does and never over-admits, and
//! a transaction that cannot be atomic is refused rather than run in parts.
//!
//! The cluster is the one of `TOLLGATE_REDIS_CLUSTER_URL` (`scripts/redis-cluster start DIR`
//! starts one and prints its URL; `.ci/run` does).

#![cfg(feature = "redis-cluster")]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tollgate::store::RedisStore;
use tollgate::{
    Config, Error, MINUTE, ManualClock, MemoryStore, RateLimiter, Request, SECOND, Target,
};

mod common;

use common::{Api, AsyncApi};

/// The limiter on `store` through the async API, on a runtime of two threads.
fn on(
    store: RedisStore<impl tollgate::Clock>,
    seed: u64,
) -> AsyncApi<RedisStore<impl tollgate::Clock>> {
    AsyncApi {
        limiter: Arc::new(RateLimiter::builder(store).seed(seed).build()),
        runtime: common::runtime(),
    }
}

const T0: f64 = 1_700_000_000_000.0;

fn url() -> Option<String> {
    common::backend_url(
        "TOLLGATE_REDIS_CLUSTER_URL",
        "redis+cluster://127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002 (scripts/redis-cluster start DIR prints one)",
    )
}

/// A fresh key prefix, so tests never see each other's states.
fn prefix() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("tollgate-cluster:{}:{}:", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

/// The `redis://` URL of each node of a `redis+cluster://` URL.
fn nodes(url: &str) -> Vec<String> {
    let list = url.strip_prefix("redis+cluster://").expect("a redis+cluster:// URL");
    list.split(',').map(|node| format!("redis://{node}")).collect()
}

#[test]
fn shards_of_a_hot_limit_spread_over_the_nodes() {
    let Some(url) = url() else { return };
    let prefix = prefix();
    let limiter = on(RedisStore::builder().prefix(&prefix).open(&url).unwrap(), 0);
    let hot = Target::Inline("hot", Config::token_bucket(1_000.0, MINUTE).with_shards(12));
    for _ in 0..200 {
        assert!(limiter.limit(hot, Request::new()).unwrap().ok);
    }
    let mut nodes_with_states = 0;
    let mut states = 0;
    for node in nodes(&url) {
        let mut conn = redis::Client::open(node).unwrap().get_connection().unwrap();
        let keys: Vec<String> =
            redis::cmd("KEYS").arg(format!("{prefix}*")).query(&mut conn).unwrap();
        nodes_with_states += usize::from(!keys.is_empty());
        states += keys.len();
    }
    assert_eq!(states, 12, "one state per shard");
    assert!(nodes_with_states >= 2, "the shards are on {nodes_with_states} node(s)");
}

#[test]
fn a_transaction_over_several_hash_slots_is_refused_and_takes_nothing() {
    let Some(url) = url() else { return };
    let limiter = on(RedisStore::builder().prefix(prefix()).open(&url).unwrap(), 0);
    // Without a common hash tag, three limits' states are (all but surely) in several slots.
    let [a, b, c] = ["a", "b", "c"].map(|n| Target::Inline(n, Config::token_bucket(5.0, MINUTE)));
    let err = limiter
        .transaction(&[a.with(Request::new()), b.with(Request::new()), c.with(Request::new())])
        .unwrap_err();
    assert!(matches!(err, Error::Store(_)), "{err:?}");
    let message = err.to_string();
    assert!(message.contains("hash slots") && message.contains("{user42}"), "{message}");
    for t in [a, b, c] {
        assert_eq!(limiter.value(t, None).unwrap().value, 5.0, "nothing was taken");
    }
    // With a common hash tag, the same transaction is atomic, all or nothing.
    let user = Request::new().key("{user42}");
    assert!(limiter.transaction(&[a.with(user.count(3.0)), b.with(user.count(3.0))]).unwrap().ok);
    let refused = limiter.transaction(&[a.with(user.count(1.0)), b.with(user.count(3.0))]).unwrap();
    assert!(!refused.ok);
    assert_eq!(limiter.value(a, Some("{user42}")).unwrap().value, 2.0, "a was not taken");
}

#[test]
fn a_store_prefix_with_a_hash_tag_allows_every_transaction() {
    let Some(url) = url() else { return };
    let tagged = format!("{{{}}}", prefix());
    let limiter = on(RedisStore::builder().prefix(tagged).open(&url).unwrap(), 0);
    let [a, b, c] = ["a", "b", "c"].map(|n| Target::Inline(n, Config::token_bucket(5.0, MINUTE)));
    let t = limiter
        .transaction(&[a.with(Request::new()), b.with("x"), c.with(Request::new().count(5.0))])
        .unwrap();
    assert!(t.ok);
    assert_eq!(limiter.value(c, None).unwrap().value, 0.0);
}

/// A long run of takes from small shards on several nodes, so that many need two shards
/// together (SPEC §3), answers decision for decision and status for status as the memory
/// store with the same seed and times.
#[test]
fn takes_across_nodes_answer_as_memory() {
    let Some(url) = url() else { return };
    let clock = ManualClock::new(T0);
    let memory = RateLimiter::builder(MemoryStore::with_clock(clock.clone())).seed(3).build();
    let store = RedisStore::builder().prefix(prefix()).open_with_clock(&url, clock.clone());
    let cluster = on(store.unwrap(), 3);
    let hot = Target::Inline("hot", Config::token_bucket(10.0, MINUTE).with_shards(5));
    let windows = Target::Inline(
        "windows",
        Config::fixed_window(12.0, 10.0 * SECOND).with_shards(4).with_max_reserved(4.0),
    );
    let mut random = 0x5eed_u64;
    let mut next = || {
        random = random.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        random >> 33
    };
    for step in 0..400 {
        clock.advance((next() % 1_500) as f64);
        let target = if next() % 3 == 0 { windows } else { hot };
        let count = (1 + next() % 6) as f64 / 2.0;
        let mut request = Request::new().count(count);
        if next() % 4 == 0 {
            request = request.reserve();
        }
        let expected = memory.limit_with_status(target, request).map(|t| format!("{t:?}"));
        let got = cluster.limit_with_status(target, request).map(|t| format!("{t:?}"));
        assert_eq!(
            got.map_err(|e| e.to_string()),
            expected.map_err(|e| e.to_string()),
            "step {step}"
        );
    }
}

/// Many tasks race for a hot limit whose shards are on several nodes, with counts that
/// often need two shards together: never more than the limit is admitted.
#[test]
fn racing_takes_across_nodes_never_over_admit() {
    let Some(url) = url() else { return };
    let runtime = common::runtime();
    for round in 0..5 {
        let store = RedisStore::builder().prefix(prefix()).open(&url).unwrap();
        let limiter = Arc::new(RateLimiter::new(store));
        // 100 tokens a day: nothing refills during the race.
        let hot =
            Target::Inline("hot", Config::token_bucket(100.0, 24.0 * 60.0 * MINUTE).with_shards(8));
        let admitted: f64 = runtime.block_on(async {
            let tasks: Vec<_> = (0..32u64)
                .map(|t| {
                    let limiter = Arc::clone(&limiter);
                    tokio::spawn(async move {
                        let mut admitted = 0.0;
                        for i in 0..12u64 {
                            let count = (1 + (t + i) % 4) as f64;
                            let request = Request::new().count(count);
                            if limiter.limit_async(hot, request).await.unwrap().ok {
                                admitted += count;
                            }
                        }
                        admitted
                    })
                })
                .collect();
            let mut admitted = 0.0;
            for task in tasks {
                admitted += task.await.unwrap();
            }
            admitted
        });
        assert!(admitted <= 100.0, "round {round}: {admitted} tokens admitted of 100");
        assert!(admitted >= 50.0, "round {round}: only {admitted} of 100: shards unusable?");
    }
}
