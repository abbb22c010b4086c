//! A leased key far from its store (issue 59): through the delay proxy (10 ms each way), a
//! process holding a lease answers what its lease cannot serve from the lease (a refusal,
//! with no store call), stays within the bucket's bound, fails at once when cut off from the
//! store (the limit's failure policy answers), and comes back by itself once healed.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use tollgate::store::{FAR_MS, LeaseOptions, RedisStore};
use tollgate::{Config, RateLimiter, Request};
use tollgate_bench::proxy::Proxy;

/// The Redis of `TOLLGATE_REDIS_URL` (`redis://host:port`, loopback), or `None` to skip;
/// with `TOLLGATE_REQUIRE_BACKENDS=1` its absence fails the test.
fn redis() -> Option<SocketAddr> {
    let Ok(url) = std::env::var("TOLLGATE_REDIS_URL") else {
        assert!(
            std::env::var("TOLLGATE_REQUIRE_BACKENDS").as_deref() != Ok("1"),
            "TOLLGATE_REDIS_URL is not set, and TOLLGATE_REQUIRE_BACKENDS=1 requires it"
        );
        eprintln!("skipped: no TOLLGATE_REDIS_URL");
        return None;
    };
    let rest = url.strip_prefix("redis://").expect("a redis:// URL");
    let host = rest.split('/').next().unwrap();
    let host = host.rsplit('@').next().unwrap().replace("localhost", "127.0.0.1");
    Some(host.parse().expect("host:port"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_far_holder_refuses_from_its_lease_and_fails_at_once_when_cut() {
    let Some(redis) = redis() else { return };
    let proxy = Proxy::start(redis, Duration::from_millis(10));
    let prefix = format!("far-leases:{}:{}:", std::process::id(), tollgate_bench_seed());
    let options = LeaseOptions::new().hot_after(1).term(Duration::from_millis(1_000));
    let store = RedisStore::builder()
        .prefix(prefix)
        .timeout(Duration::from_millis(300))
        .lease("hot", options)
        .open(&format!("redis://{}", proxy.addr))
        .unwrap();
    let (rate, capacity) = (200.0, 50.0);
    let limiter = RateLimiter::builder(store)
        .define("hot", Config::token_bucket(rate, 1_000.0).with_capacity(capacity))
        .build();
    let take = || limiter.limit_async("hot", Request::new().key("k"));

    // Offered 2,000 a second (ten times the rate) for a second, 100 at a time.
    let started = Instant::now();
    let (mut admitted, mut asked) = (0u32, 0u32);
    for _ in 0..20 {
        for answer in join_all((0..100).map(|_| take())).await {
            asked += 1;
            let decision = answer.expect("the store answers");
            if decision.ok {
                admitted += 1;
            } else {
                assert!(decision.retry_after.is_some_and(|wait| wait > 0.0), "{decision:?}");
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let secs = started.elapsed().as_secs_f64();
    let bound = capacity + rate * secs;
    assert!(f64::from(admitted) <= bound, "{admitted} admitted over a bound of {bound}");
    // Most of the limit is used (its rate over the run less some round trips' worth).
    assert!(f64::from(admitted) >= 0.5 * rate * secs, "only {admitted} in {secs} s");
    let stats = limiter.store().lease_stats();
    let (_, _, s) = stats.iter().find(|(name, ..)| name == "hot").expect("the key is leased");
    assert!(s.round_trip >= FAR_MS, "a round trip of {} ms is far", s.round_trip);
    assert!(s.refused > 0, "refused from the lease: {s:?}");
    // Store calls: a grant or a direct take each; most requests made none.
    let calls = s.grants + s.direct;
    assert!(calls * 5 < u64::from(asked), "{calls} store calls for {asked} requests: {s:?}");

    // Cut off: what the lease holds is spent, then the limit's failure policy (fail closed)
    // answers at once, with no wait for the store.
    proxy.cut();
    let cut_at = Instant::now();
    let failed = loop {
        assert!(cut_at.elapsed() < Duration::from_secs(10), "no failure while cut off");
        if let Err(e) = take().await {
            break e.to_string();
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    eprintln!("the first failure while cut off: {failed}");
    fails_at_once_then_heals(&limiter, &proxy).await;
}

/// While cut off, each failure is the lease's word that its last request got no answer (not
/// a wait for the store's timeout); healed, the limiter comes back by itself.
async fn fails_at_once_then_heals(limiter: &RateLimiter<RedisStore>, proxy: &Proxy) {
    let take = || limiter.limit_async("hot", Request::new().key("k"));
    for answer in join_all((0..50).map(|_| take())).await {
        let error = answer.expect_err("fail closed while cut off").to_string();
        assert!(error.contains("got no answer"), "{error}");
    }
    proxy.heal();
    let healed_at = Instant::now();
    loop {
        assert!(healed_at.elapsed() < Duration::from_secs(10), "not back after the heal");
        if take().await.is_ok_and(|d| d.ok) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = limiter.store().release_leases().await;
}

/// A process started while its store is cut off (a region's server restarted during a
/// partition): its key's first take fails within the store's timeout, however many wait for
/// it; after that, takes fail at once with the lease's word (no wait for the store); healed,
/// it comes back by itself. (Before, its requests waited for the store's connection one
/// after the other until the heal.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_started_while_cut_off_fails_in_time_and_comes_back() {
    let Some(redis) = redis() else { return };
    let proxy = Proxy::start(redis, Duration::from_millis(10));
    proxy.cut();
    let prefix = format!("far-leases-cut:{}:{}:", std::process::id(), tollgate_bench_seed());
    let options = LeaseOptions::new().hot_after(1).term(Duration::from_millis(1_000));
    let timeout = Duration::from_millis(300);
    let store = RedisStore::builder()
        .prefix(prefix)
        .timeout(timeout)
        .lease("hot", options)
        .open(&format!("redis://{}", proxy.addr))
        .unwrap();
    let limiter = RateLimiter::builder(store)
        .define("hot", Config::token_bucket(200.0, 1_000.0).with_capacity(50.0))
        .build();
    let take = || limiter.limit_async("hot", Request::new().key("k"));

    let started = Instant::now();
    let answers = join_all((0..100).map(|_| take())).await;
    let first = started.elapsed();
    for answer in answers {
        answer.expect_err("fail closed while cut off");
    }
    // Within the timeout and the probe's wait, with room for a loaded machine; they
    // waited until the heal before (never, here).
    assert!(first < 10 * timeout, "the first takes answered after {first:?}");
    fails_at_once_then_heals(&limiter, &proxy).await;
}

/// A number that differs between runs, for the key prefix.
fn tollgate_bench_seed() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()
}
