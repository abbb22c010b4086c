//! Concurrency limits on Redis in real time (the store on Redis `TIME`): stores on their own
//! connections, standing for processes, never hold more than a limit's slots at once
//! together; and a ticket never released frees its slot when its ttl ends, its keys gone
//! with it.
//!
//! On the Redis of `TOLLGATE_REDIS_URL`.

#![cfg(feature = "redis")]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tollgate::store::RedisStore;
use tollgate::{Acquired, Concurrency, RateLimiter};

mod common;

fn url() -> Option<String> {
    common::backend_url("TOLLGATE_REDIS_URL", "redis://127.0.0.1:6379")
}

/// A key prefix of the test's own.
fn prefix(test: &str) -> String {
    format!("tollgate-slots-{test}:{}:", std::process::id())
}

/// A limiter on a store of its own (its own connection) on `prefix`.
fn limiter(url: &str, prefix: &str) -> Arc<RateLimiter<RedisStore>> {
    let store = RedisStore::builder().prefix(prefix).connections(1).open(url).unwrap();
    Arc::new(RateLimiter::new(store))
}

/// Four stores of 16 tasks each take one key's slots (max 10) over and over, each holding a
/// few random ms; every hold is logged from its grant's answer to its release's sending (so
/// within the time the store held it), and at no instant of the log are more than 10 held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_processes_never_hold_more_than_max_at_once() {
    const MAX: u32 = 10;
    const STORES: u64 = 4;
    const TASKS: u64 = 16;
    const HOLDS: usize = 12;
    let Some(url) = url() else { return };
    let prefix = prefix("four");
    let limit = ("render", Concurrency::new(MAX));
    let start = Instant::now();
    let log: Arc<Mutex<Vec<(Duration, Duration)>>> = Arc::default();
    let mut tasks = tokio::task::JoinSet::new();
    for store in 0..STORES {
        let limiter = limiter(&url, &prefix);
        for task in 0..TASKS {
            let (limiter, log) = (Arc::clone(&limiter), Arc::clone(&log));
            let seed = (store * TASKS + task + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            tasks.spawn(async move {
                for _ in 0..HOLDS {
                    let hold = hold_once(&limiter, limit, start, seed).await;
                    log.lock().unwrap().push(hold);
                }
            });
        }
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }

    let log = std::mem::take(&mut *log.lock().unwrap());
    assert_eq!(log.len(), (STORES * TASKS) as usize * HOLDS);
    // Grants (0) sort before releases (1) at one instant: a hold that ends when another
    // starts counts as overlapping it.
    let mut events: Vec<(Duration, u8)> =
        log.iter().flat_map(|&(granted, released)| [(granted, 0), (released, 1)]).collect();
    events.sort_unstable();
    let (mut held, mut most) = (0, 0);
    for (_, event) in events {
        if event == 0 {
            held += 1;
            most = most.max(held);
        } else {
            held -= 1;
        }
    }
    assert!(most <= MAX as i32, "{most} held at once, more than {MAX}");
    assert!(most > 1, "the holds never overlapped: the test tested nothing");
    let value = limiter(&url, &prefix).slots_value_async(limit, Some("shared")).await.unwrap();
    assert_eq!((value.in_flight, value.holders), (0, 0));
}

/// Acquires one of `limit`'s slots (trying again every ms while refused: a release may come
/// long before the earliest expiry), holds it 1 to 5 ms (from `seed`), and releases it:
/// when, since `start`, the grant's answer came and the release was sent.
async fn hold_once(
    limiter: &RateLimiter<RedisStore>,
    limit: (&'static str, Concurrency),
    start: Instant,
    seed: u64,
) -> (Duration, Duration) {
    loop {
        if let Acquired::Granted(ticket) = limiter.acquire_async(limit, "shared").await.unwrap() {
            let granted = start.elapsed();
            let nanos = u64::from(granted.subsec_nanos());
            let ms = 1 + (seed ^ nanos).wrapping_mul(0x2545_F491_4F6C_DD1D) % 5;
            tokio::time::sleep(Duration::from_millis(ms)).await;
            let released = start.elapsed();
            let id = ticket.id;
            assert!(limiter.release_async(limit, Some("shared"), id).await.unwrap());
            return (granted, released);
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// A ticket never released holds its slot until its ttl ends, then frees it; once every
/// ticket's ttl has ended, nothing of the key is left in Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ticket_never_released_frees_its_slot_at_its_ttl() {
    let Some(url) = url() else { return };
    let prefix = prefix("ttl");
    let limiter = limiter(&url, &prefix);
    let ttl = 300.0;
    let job = ("job", Concurrency::new(1).with_ttl(ttl));
    let Acquired::Granted(first) = limiter.acquire_async(job, "k").await.unwrap() else {
        panic!("the first acquire was refused");
    };
    let refused = limiter.acquire_async(job, "k").await.unwrap();
    let wait = refused.retry_after().expect("held by the first");
    assert!(wait > 0.0 && wait <= ttl, "{wait}");
    tokio::time::sleep(Duration::from_secs_f64(wait / 1e3) + Duration::from_millis(20)).await;
    let Acquired::Granted(second) = limiter.acquire_async(job, "k").await.unwrap() else {
        panic!("the first's slot was not freed at its ttl");
    };
    assert_ne!(first.id, second.id);
    assert!(second.expires_at >= first.expires_at, "on Redis's clock");
    // Its release and renewal come too late: they say so, and touch nothing.
    assert!(!limiter.release_async(job, Some("k"), first.id).await.unwrap());
    assert_eq!(limiter.renew_async(job, Some("k"), first.id, None).await.unwrap(), None);
    assert!(!limiter.acquire_async(job, "k").await.unwrap().ok(), "the second holds it");

    tokio::time::sleep(Duration::from_secs_f64(ttl / 1e3) + Duration::from_millis(50)).await;
    let mut conn = redis::Client::open(url.as_str()).unwrap().get_connection().unwrap();
    let left: Vec<String> = redis::cmd("KEYS").arg(format!("{prefix}*")).query(&mut conn).unwrap();
    assert!(left.is_empty(), "left in Redis: {left:?}");
    assert!(limiter.acquire_async(job, "k").await.unwrap().ok());
    limiter.reset_slots_async(job, Some("k")).await.unwrap();
}
