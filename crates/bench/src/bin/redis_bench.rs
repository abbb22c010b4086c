//! tollgate's Redis store against the plainest Redis operation through the same client:
//! `limit_async` (one EVALSHA of the request's script) vs `INCR`, both on redis-rs's async
//! multiplexed connections, with 1 and 32 requests in flight (tasks of a runtime with two
//! threads), in one run. Loopback only; each measurement is bounded by time.
//!
//! `cargo run --release -p tollgate-bench --bin redis_bench [SECONDS] [ROUNDS] [CONNECTIONS]`
//! (default 5 s, 1 round, the store's default connections), against `TOLLGATE_REDIS_URL`
//! (default redis://127.0.0.1:6379). With several rounds the two sides alternate (INCR,
//! limit, limit, INCR, ...), each round prints its ratio, and the median follows.
//!
//! INCR goes out on one multiplexed connection shared by every task, as a hand-written app
//! would send it; the store keeps its own (pipelined the same way).

use std::sync::Arc;
use std::time::Duration;

use tollgate::store::RedisStore;
use tollgate::{RateLimiter, Request};
use tollgate_bench::{
    Limit, alternate, async_throughput, counter_key, delete_counters, keys, loopback_url,
};

fn main() {
    let secs: u64 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(5);
    let url = loopback_url("TOLLGATE_REDIS_URL", "redis://127.0.0.1:6379");
    let rounds: usize = std::env::args().nth(2).and_then(|a| a.parse().ok()).unwrap_or(1).max(1);
    let connections: Option<usize> = std::env::args().nth(3).and_then(|a| a.parse().ok());
    let duration = Duration::from_secs(secs);
    let client = redis::Client::open(url.as_str()).unwrap();
    let keys = Arc::new(keys(10_000));
    println!("| in flight | INCR ops/s | tollgate limit ops/s | ratio |");
    println!("|---:|---:|---:|---:|");
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    for in_flight in [1, 32] {
        let conn = runtime.block_on(client.get_multiplexed_async_connection()).unwrap();
        let incr = || {
            let (conn, keys) = (conn.clone(), Arc::clone(&keys));
            async_throughput(&runtime, in_flight, duration, move |t, n| {
                let (mut conn, key) =
                    (conn.clone(), counter_key(&keys[(t * 7919 + n) % keys.len()]));
                async move {
                    let _: i64 = redis::cmd("INCR").arg(key).query_async(&mut conn).await.unwrap();
                }
            })
        };
        let mut store = RedisStore::builder().prefix("tollgate-bench:");
        if let Some(connections) = connections {
            store = store.connections(connections);
        }
        let limiter = Arc::new(RateLimiter::new(store.open(&url).unwrap()));
        let limit = || {
            let (limiter, keys) = (Arc::clone(&limiter), Arc::clone(&keys));
            async_throughput(&runtime, in_flight, duration, move |t, n| {
                let (limiter, keys) = (Arc::clone(&limiter), Arc::clone(&keys));
                async move {
                    let key = &keys[(t * 7919 + n) % keys.len()];
                    let decision = limiter.limit_async(Limit::PerUser, Request::new().key(key));
                    assert!(decision.await.unwrap().ok);
                }
            })
        };
        let median = alternate(rounds, incr, limit, |incr, limit| {
            println!("| {in_flight} | {incr:.0} | {limit:.0} | {:.2}x |", limit / incr);
        });
        if rounds > 1 {
            println!("| {in_flight}: median of {rounds} | | | {median:.3}x |");
        }
    }
    delete_counters(&mut client.get_connection().unwrap(), &keys);
}
