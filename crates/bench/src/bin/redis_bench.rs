//! tollgate's Redis store against the plainest Redis operation through the same client:
//! `limit` (one EVALSHA of the request's script) vs `INCR`, with 1 and 32 requests in
//! flight, in one run. Loopback only; each measurement is bounded by time.
//!
//! `cargo run --release -p tollgate-bench --bin redis_bench [SECONDS] [ROUNDS] [CONNECTIONS]`
//! (default 5 s, 1 round, the store's default of 8 connections), against `TOLLGATE_REDIS_URL`
//! (default redis://127.0.0.1:6379). With several rounds the two sides alternate (INCR,
//! limit, limit, INCR, ...), each round prints its ratio, and the median follows.
//!
//! INCR gets a connection per thread. tollgate's store keeps its own (a user's choice, here
//! the default unless given): with more requests in flight than connections, the waiting
//! ones go to Redis together, one script for all, in the next round trip.

use std::sync::Arc;
use std::time::Duration;

use tollgate::store::RedisStore;
use tollgate::{RateLimiter, Request};
use tollgate_bench::{
    Limit, alternate, counter_key, delete_counters, keys, loopback_url, throughput,
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
    for in_flight in [1, 32] {
        let conns: Vec<_> = (0..in_flight)
            .map(|_| parking_lot::Mutex::new(client.get_connection().unwrap()))
            .collect();
        let incr = || {
            throughput(in_flight, duration, |t, n| {
                let key = counter_key(&keys[(t * 7919 + n) % keys.len()]);
                let _: i64 = redis::cmd("INCR").arg(key).query(&mut *conns[t].lock()).unwrap();
            })
        };
        let mut store = RedisStore::builder().prefix("tollgate-bench:");
        if let Some(connections) = connections {
            store = store.connections(connections);
        }
        let store = store.open(&url).unwrap();
        let limiter = RateLimiter::new(store);
        let limit = || {
            throughput(in_flight, duration, |t, n| {
                let key = &keys[(t * 7919 + n) % keys.len()];
                assert!(limiter.limit(Limit::PerUser, Request::new().key(key)).unwrap().ok);
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
